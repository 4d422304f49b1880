"""infinity: an NVMe-tiered offload engine for PyTorch training.

    config = infinity.TierConfig.load("tiers.toml")
    engine = infinity.initialize(model, config)
    loss = engine(batch); engine.backward(loss); engine.step()

Subpackages: `infinity.aio` (async file I/O), `infinity.swap` (swap spaces on NVMe),
`infinity.tools` (nvme-bench, swap-inspect and the demo). ``docs/`` in the repository
describes the design.

Names load on first use (PEP 562): ``import infinity.config`` reads and checks a config without
loading torch or the I/O layer.
"""

__version__ = "0.1.0"

_LAZY = {
    "AioConfig": ".config",
    "MemoryConfig": ".config",
    "NvmeConfig": ".config",
    "OptimizerConfig": ".config",
    "PartitionConfig": ".config",
    "PrecisionConfig": ".config",
    "PrefetchConfig": ".config",
    "TierConfig": ".config",
    "TiersConfig": ".config",
    "build": "._build",
    "Engine": ".engine",
    "initialize": ".engine",
    "from_pretrained": "._pretrained",
    "HostBudgetError": "._resources",
    "GatheredParameters": "._gather",
    "deepspeed_lr_scheduler": "._deepspeed",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return [*__all__, "__version__"]

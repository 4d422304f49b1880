"""infinity: an NVMe-tiered offload engine for PyTorch training.

    config = infinity.TierConfig.load("tiers.toml")
    engine = infinity.initialize(model, config)
    loss = engine(batch); engine.backward(loss); engine.step()

Subpackages: `infinity.aio` (async file I/O), `infinity.swap` (swap spaces on NVMe),
`infinity.tools` (the nvme-bench and swap-inspect command-line tools).
"""

from .config import (
    AioConfig,
    MemoryConfig,
    NvmeConfig,
    OptimizerConfig,
    PartitionConfig,
    PrecisionConfig,
    PrefetchConfig,
    TierConfig,
    TiersConfig,
)
from ._build import build
from .engine import Engine, initialize

__version__ = "0.1.0"

__all__ = [
    "AioConfig",
    "Engine",
    "MemoryConfig",
    "NvmeConfig",
    "OptimizerConfig",
    "PartitionConfig",
    "PrecisionConfig",
    "PrefetchConfig",
    "TierConfig",
    "TiersConfig",
    "build",
    "initialize",
]

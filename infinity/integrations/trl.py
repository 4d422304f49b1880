"""TRL's trainers with params, grads and optimizer state in infinity's tiers.

    from infinity.integrations.trl import InfinitySFTTrainer

    trainer = InfinitySFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds,
                                 processing_class=tokenizer, infinity_config="tiers.toml")
    trainer.train()

`InfinitySFTTrainer` is `trl.SFTTrainer` with `InfinityTrainer`'s engine (its optimizer,
clipping and checkpoints; see `infinity.integrations.transformers`).

TRL's trainers compute the loss with a fused LM head that reads ``lm_head.weight`` itself,
outside ``lm_head``'s forward, where the engine keeps only an empty placeholder (a read there
is refused: [Note: reads outside a module] in `infinity._gather`). For DeepSpeed ZeRO-3 TRL
gathers the head through one function, ``trl.trainer.utils.maybe_gather_lm_head_ctx``, at
every such read (forward and backward). `install` makes that function gather parameters an
engine holds with `infinity.GatheredParameters`, and leaves every other call to TRL's own: a
model no engine holds runs as before. `InfinitySFTTrainer` installs it; a trainer of one's
own on another TRL trainer (``class T(InfinityTrainer, DPOTrainer)``) calls ``install()``.
"""

from __future__ import annotations

import functools
import importlib

import trl

import infinity

from .transformers import InfinityTrainer

# The modules that read the function by name: trl.trainer.utils (the fused head's forward, and
# the kernels' backward, which imports it at call time) and a kernel that imported it at load.
_READERS = ("trl.trainer.utils", "trl.kernels.chunked_divergence")
_NAME = "maybe_gather_lm_head_ctx"


def install() -> None:
    """Make TRL gather the parameters an infinity engine holds with `infinity.GatheredParameters`
    (idempotent). Raises ImportError naming the TRL version when it has no such function."""
    utils = importlib.import_module(_READERS[0])
    original = getattr(utils, _NAME, None)
    if original is None:
        raise ImportError(f"trl {trl.__version__} has no trl.trainer.utils.{_NAME}, through which its trainers gather "
                          "the LM head they read directly; infinity.integrations.trl supports trl>=1.16,<2")  # fmt: skip
    if getattr(original, "_infinity", False):
        return

    @functools.wraps(original)
    def gather(*params):
        if any(getattr(p, "_infinity_managed", False) for p in params):
            return infinity.GatheredParameters([p for p in params if p is not None])
        return original(*params)

    gather._infinity = True
    for name in _READERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, _NAME, None) is original:
            setattr(module, _NAME, gather)
    _install_sync()


def _install_sync() -> None:
    """DPO's ``sync_ref_model`` mixes the policy's weights into the reference model after a step
    (``SyncRefModelCallback.sync_target_model``), reading every parameter outside any forward:
    with the parameters released between uses the first step's callback was refused (an audit
    helper's repro). The policy's parameters an engine holds are read here one module at a time
    under `infinity.GatheredParameters` (every rank calls it, as the callback runs on every
    rank; each updates its own reference model), as TRL's branch for DeepSpeed's ZeRO-3 gathers them."""
    try:
        callbacks = importlib.import_module("trl.trainer.callbacks")
    except ImportError:
        return
    cls = getattr(callbacks, "SyncRefModelCallback", None)
    original = getattr(cls, "sync_target_model", None) if cls is not None else None
    if original is None or getattr(original, "_infinity", False):
        return

    @functools.wraps(original)
    def sync_target_model(model, target_model, alpha):
        if not any(getattr(p, "_infinity_managed", False) for p in model.parameters()):
            return original(model, target_model, alpha)
        into = dict(zip((id(p) for p in model.parameters()), target_model.parameters(), strict=True))
        for module in model.modules():
            own = [p for p in module._parameters.values() if p is not None and id(p) in into]
            if not own:
                continue
            with infinity.GatheredParameters(own):
                for p in own:
                    into.pop(id(p)).data.mul_(1.0 - alpha).add_(p.data, alpha=alpha)

    sync_target_model._infinity = True
    cls.sync_target_model = staticmethod(sync_target_model)


class InfinitySFTTrainer(InfinityTrainer, trl.SFTTrainer):
    """`trl.SFTTrainer` whose model is trained by an infinity engine (``infinity_config``: what
    `infinity.initialize` takes); ``engine`` is None until training starts."""

    def __init__(self, *args, **kwargs):
        install()
        super().__init__(*args, **kwargs)

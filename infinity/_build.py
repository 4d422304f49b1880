"""`build`: construct a model straight into offloaded storage (DeepSpeed's zero.Init).

Owns: the swap space a model is built into until `initialize` adopts it, and the parameters it
stored there. Touches: `_resources` (to open and close the I/O), module registration hooks.

While the context is open, every module registered into a parent (which happens right after
the child's constructor returns) has its parameters written to the swap space in fp32 and
replaced by empty placeholders, so the whole model never sits in host memory: at most one
module's parameters do. `initialize` then adopts the swap space and reads each unit back
one sub-group at a time.

A module is stored when it joins its parent, so a model that builds a whole list of modules
before wrapping them (``nn.Sequential(*[nn.Linear(...) for _ in range(n)])``) holds that list
in memory until then; registering each as it is made (``ModuleList.append`` in a loop, or
submodules assigned in ``__init__``, as transformers' blocks do) keeps one at a time.

Caveat: an initialisation pass that runs over the whole model *after* its submodules are
built (transformers' ``post_init`` / ``_init_weights``) finds placeholders and changes
nothing; the weights keep the values each module's own constructor gave them (PyTorch's
defaults). Build the model normally when that initialisation matters and it fits in memory.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from infinity.swap import DTYPES

from . import _resources


class Builder:
    """What `build` opened (the aio engine, the pool, the swap space) and the parameters it
    stored, until `initialize` adopts them or `close` gives them up."""

    def __init__(self, config):
        self.config = cfg = _resources.as_config(config)
        self.space = self.pool = self.aio = None
        self._count = 0
        self.adopted = False
        if cfg.tiers.params != "nvme":
            return  # params that live in host memory or on the device are built there anyway
        # Before initialize there is no process group yet: the rank is torchrun's, so each rank
        # builds into its own rank directory (which its engine then adopts).
        rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
        self.aio, self.pool, self.space = _resources.open_io(cfg, rank, local_rank)
        _resources.close_at_exit(self)  # a model built and never initialized still lets go

    def on_child(self, parent: nn.Module, name: str, child: nn.Module):
        if self.space is None or child is None:
            return None
        for p in child.parameters():  # grandchildren were stored when they joined the child
            self._store(p)
        return None

    def _store(self, p: nn.Parameter) -> None:
        if hasattr(p, "_infinity_key") or p.device.type == "meta":
            return
        key = f"build.{self._count}/staged"
        self._count += 1
        value = p.detach().float() if p.is_floating_point() else p.detach()
        self.space.put(key, value.contiguous()).result()
        p._infinity_shape = tuple(p.shape)
        p._infinity_key = key
        p._infinity_builder = self
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def load(self, p: nn.Parameter) -> torch.Tensor:
        info = self.space.info(p._infinity_key)
        out = torch.empty(info.shape, dtype=DTYPES[info.dtype])
        return self.space.get(p._infinity_key, out).result()

    def forget(self, p: nn.Parameter) -> None:
        self.space.delete(p._infinity_key)
        for attr in ("_infinity_key", "_infinity_shape", "_infinity_builder"):
            delattr(p, attr)

    def discard_unadopted(self) -> None:
        """Staged parameters no unit took (replaced by tying, say) free their space."""
        for name in self.space.names():
            if name.startswith("build."):
                self.space.delete(name)

    def adopt(self):
        """Hand the aio engine, pool and swap space over to an engine (which closes them)."""
        if self.adopted:
            raise ValueError("this model was already given to initialize: build a new one for another engine")
        if self.space is None:
            raise ValueError("the build this model came from was closed (its block raised): build the model again")
        self.adopted = True
        _resources.closed(self)
        return self.aio, self.pool, self.space

    def close(self) -> None:
        """Give up what was opened, unless an engine adopted it (the swap directory is then unlocked)."""
        _resources.closed(self)
        if self.adopted:
            return
        space, pool, engine = self.space, self.pool, self.aio
        self.space = self.pool = self.aio = None
        _resources.close_io(space, pool, engine)


@contextlib.contextmanager
def build(config):
    """Construct a model inside ``with infinity.build(config):`` and its parameters go straight
    to the params tier, one module at a time; pass it to `initialize` with the same config.

    A block that raises closes what the build opened (the swap directory is unlocked and can be
    used again). A model built and never given to `initialize` keeps its swap space until the
    process exits."""
    builder = Builder(config)
    handle = nn.modules.module.register_module_module_registration_hook(builder.on_child)
    try:
        yield builder
    except BaseException as e:
        try:
            builder.close()
        except Exception as cleanup:  # noqa: BLE001 - the block's error is the one to see
            e.add_note(f"(closing the build's swap space after that also failed: {cleanup})")
        raise
    finally:
        handle.remove()

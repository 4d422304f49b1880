"""The engine: wires the tiers, the parameter scheduler, gradients and the optimizer around a
user's unmodified module. It owns no policy of its own; each piece lives in its module:

    _units.py     parameters flattened per module (what moves between tiers)
    _store.py     where one kind of state lives (device, cpu, nvme)
    _schedule.py  fetch / prefetch / release around forward and backward
    _grads.py     gradient accumulation in fp32 into the grads tier
    _optim.py     AdamW on fp32 master weights where the optimizer states live
    _stats.py     the counters behind stats()
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import platform
import weakref

import torch
from torch import nn

from infinity import aio
from infinity.swap import HostBufferPool, SwapSpace

from ._dist import Dist
from ._grads import GradAccumulator
from ._optim import KINDS, AdamW, make_groups
from ._schedule import Scheduler
from ._stats import Stats
from ._store import Store
from ._units import build_units
from .config import TierConfig

logger = logging.getLogger("infinity")

# Engines not closed yet. A script that ends without engine.close() still gets it at exit:
# manifests are flushed, and the I/O threads and the process group's peers are let go of
# while the interpreter is whole (left to finalization, a 2-rank run aborted in ~1 of 4 exits:
# "terminate called without an active exception").
_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for engine in list(_OPEN):
        try:
            engine.close()
        except Exception as e:  # noqa: BLE001 - exiting anyway; say what was not flushed
            logger.warning("closing an infinity engine at exit failed: %s", e)


class LossScaler:
    """Dynamic loss scaling for fp16: an overflow skips the step and lowers the scale; a run
    of ``growth_interval`` good steps raises it."""

    def __init__(self, precision):
        self.scale = float(precision.initial_scale)
        self.cfg = precision
        self._good = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale * self.cfg.backoff_factor, self.cfg.min_scale)
            self._good = 0
        else:
            self._good += 1
            if self._good >= self.cfg.growth_interval:
                self.scale *= self.cfg.growth_factor
                self._good = 0


# [Note: malloc threshold]
# glibc serves large blocks with mmap and returns them on free, until a large mmapped block is
# freed: then it raises its mmap threshold to that size, and later blocks of that size come
# from the heap, where freed ones stay in the process. An offload engine allocates and frees
# unit-sized tensors (gradients, copies) all the time, so RSS crept to several times what the
# engine holds (measured: 381 MiB against 84 MiB for the same run, tests/infinity/test_memory.py).
# Fixing the threshold at 1 MiB keeps large blocks mmapped, so RSS follows what is held.
_MALLOC_PINNED = False


def _pin_malloc_threshold() -> None:
    global _MALLOC_PINNED
    if _MALLOC_PINNED or "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return
    _MALLOC_PINNED = True


def open_io(cfg: TierConfig, rank: int, local_rank: int):
    """The aio engine, the host buffer pool and (when a tier is nvme) the swap space of a run:
    one place for the engine and `build` to open them."""
    engine = aio.open_engine(cfg.aio.backend, cfg.aio.queue_depth, cfg.aio.block_size)
    pool = space = None
    try:
        pool = HostBufferPool(cfg.memory.host_budget, engine=engine)
        if "nvme" in (cfg.tiers.params, cfg.tiers.grads, cfg.tiers.optimizer):
            cfg.nvme.check_paths()  # again: a drive may have gone since the config was made
            paths = list(cfg.nvme.resolve_paths(rank, local_rank))
            for path in paths:  # "{rank}" templates name a directory per rank: make it
                os.makedirs(path, mode=0o700, exist_ok=True)
            # A run's swap is scratch: what a previous run left there is stale (a checkpoint, not
            # the swap, is how a run resumes).
            space = SwapSpace(
                paths, rank=rank, engine=engine, pool=pool, verify=cfg.nvme.verify, fresh=True,
                stripe_size=cfg.nvme.stripe_size, stripe_threshold=cfg.nvme.stripe_threshold,
                grow_step=cfg.nvme.grow_step,
            )  # fmt: skip
    except BaseException:
        if pool is not None:
            pool.close()
        engine.close()
        raise
    return engine, pool, space


def _as_config(config) -> TierConfig:
    if isinstance(config, TierConfig):
        return config
    if isinstance(config, dict):
        return TierConfig.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return TierConfig.load(config)
    if config is None:
        return TierConfig()
    raise TypeError(f"config must be a TierConfig, a dict or a path, got {type(config).__name__}")


class Engine:
    """Wraps ``module``: ``engine(...)`` runs its forward, ``backward(loss)``, ``step()``.

    Create with `infinity.initialize`. ``module`` stays the user's module (its parameters are
    placeholders while released; ``engine.module`` is for calling, not for reading weights:
    use `export`-style helpers for that)."""

    def __init__(self, module: nn.Module, config, *, log_every: int | None = None):
        if not isinstance(module, nn.Module):
            raise TypeError(f"initialize takes a torch.nn.Module, got {type(module).__name__}")
        self.config = cfg = _as_config(config)
        _pin_malloc_threshold()  # see [Note: malloc threshold]
        self.module = module
        # The process group the user made, or one from torchrun's environment (world size 1 otherwise).
        self.dist = Dist(cfg.partition.timeout)
        self.dist.agree(cfg.to_dict())  # a mismatch is an error on every rank, not a hang later
        rank, local_rank = self.dist.rank, self.dist.local_rank
        self.rank, self.world_size = rank, self.dist.world_size
        self.device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        # ZeRO stages; at world size 1 they coincide (a shard is the whole).
        self.params_sharded = cfg.partition.stage == 3
        self.grads_full = cfg.partition.stage == 1 and self.world_size > 1
        self.dtype = cfg.precision.torch_dtype
        self.log_every = log_every
        self._stats = Stats()
        self._scaler = LossScaler(cfg.precision) if self.dtype == torch.float16 else None
        self._closed = True
        self._unusable: str | None = None  # why training cannot go on (a load that failed half-way)
        self.aio = self.pool = self.space = None
        builder = next((p._infinity_builder for p in module.parameters() if hasattr(p, "_infinity_builder")), None)
        if builder is not None:
            if builder.config.to_dict() != cfg.to_dict():
                raise ValueError("initialize got a config other than the one the model was built with")
            # The model was built into this swap space: adopt it (and its engine and pool).
            self.aio, self.pool, self.space = builder.aio, builder.pool, builder.space
            builder.adopted = True
        self._builder = builder
        try:
            if builder is not None:
                self._setup(module, cfg)
                builder.discard_unadopted()
                self._closed = False
                _OPEN.add(self)
                return
            self.aio, self.pool, self.space = open_io(cfg, rank, local_rank)
            self._setup(module, cfg)
        except BaseException as e:
            try:
                self._close_io()
            except Exception as cleanup:  # noqa: BLE001 - the first error is the one to see
                e.add_note(f"(closing the swap space after that also failed: {cleanup})")
            raise
        self._closed = False
        _OPEN.add(self)

    def _setup(self, module: nn.Module, cfg: TierConfig) -> None:
        units, module_units = build_units(module, self.world_size, self.rank)
        if not units:
            raise ValueError("the module has no parameters: there is nothing to offload or train")
        dev, stats, space = self.device, self._stats, self.space
        tiers = cfg.tiers
        self.param_store = Store(tiers.params, "param", device=dev, space=space, stats=stats)
        grad_store = Store(tiers.grads, "grad", device=dev, space=space, stats=stats)
        opt_stores = {k: Store(tiers.optimizer, k, device=dev, space=space, stats=stats) for k in KINDS}
        self.units = units
        self.grads = GradAccumulator(grad_store, dist=self.dist, grads_full=self.grads_full, pool=self.pool)
        self.optimizer = AdamW(units, make_groups(units, cfg.optimizer.sub_group_size), opt_stores,
                               self.param_store, self.grads, cfg.optimizer, self.dtype, stats, dev,
                               dist=self.dist, params_sharded=self.params_sharded)  # fmt: skip
        # fp32 master weights from the values as the user made them; low-precision params to
        # their tier. Parameters `build` stored are read back from it.
        self._check_budget(cfg, units)  # before anything is written: that needs the pool too
        builder = self._builder
        self.optimizer.init_state(load=builder.load if builder is not None else None)
        for unit in units:
            unit.unbind()  # the module's own copies go; the tier holds the parameters now
            if builder is not None:
                for p in unit.params:
                    if hasattr(p, "_infinity_key"):
                        builder.forget(p)
        self.scheduler = Scheduler(units, module_units, self.param_store, self.grads, stats, device=dev,
                                   dtype=self.dtype, depth=cfg.prefetch.depth, prefetch_bytes=cfg.prefetch.bytes,
                                   pool=self.pool, dist=self.dist if self.params_sharded else None)  # fmt: skip
        if self.scheduler.resident:
            for unit in units:
                self.scheduler.materialize(unit)
        for mod in module.modules():  # buffers stay buffers, on the compute device
            for key, buf in mod._buffers.items():
                if buf is not None and buf.device != dev:
                    mod._buffers[key] = buf.to(dev)
        self.scheduler.install()

    def _check_budget(self, cfg: TierConfig, units) -> None:
        """Refuse at initialize a host budget the pipelines cannot run in (DESIGN §5): better
        than a PoolExhausted in the middle of step 1000."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        largest = max(u.padded_numel for u in units)
        # The optimizer reads up to 3 sub-groups ahead; a tighter budget reads fewer.
        for ahead in (3, 2, 1):
            self.optimizer.ahead = ahead
            if self.optimizer.host_bytes_needed() <= cfg.memory.host_budget:
                break
        parts = {"optimizer step": self.optimizer.host_bytes_needed()}
        if self.param_store.tier == "nvme":  # a unit in use, `depth` prefetched, gradients gathered
            parts["forward/backward"] = ((cfg.prefetch.depth + 1) * itemsize + (self.grads.max_writes + 1) * 4) * largest
        need, what = max((v, k) for k, v in parts.items())
        if need > cfg.memory.host_budget:
            raise ValueError(
                f"memory.host_budget={cfg.memory.host_budget / 2**20:.0f}MiB is less than the "
                f"{need / 2**20:.0f}MiB the {what} needs with this model and config (largest unit "
                f"{largest * 4 / 2**20:.1f}MiB in fp32, optimizer.sub_group_size="
                f"{cfg.optimizer.sub_group_size / 2**20:.0f}MiB, prefetch.depth={cfg.prefetch.depth}); "
                "raise memory.host_budget, or lower optimizer.sub_group_size or prefetch.depth"
            )

    # -- training ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        self._check_usable()
        self.scheduler.begin_forward()
        try:
            # See [Note: saved parameter views] in _schedule.py.
            with torch.autograd.graph.saved_tensors_hooks(self.scheduler.pack, self.scheduler.unpack):
                return self.module(*args, **kwargs)
        except BaseException as e:
            self.dist.report_failure(e)  # see [Note: rank failures]
            raise
        finally:
            self.scheduler.end_forward()
            if not torch.is_grad_enabled():
                self.scheduler.release_all()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss``; gradients accumulate over calls until `step`."""
        self._check_open()
        if self._scaler is not None:
            loss = loss * self._scaler.scale
        try:
            loss.backward()
        except BaseException as e:
            self.dist.report_failure(e)
            try:
                self.scheduler.end_backward()
            except Exception as cleanup:  # noqa: BLE001 - the first error is the one to see
                e.add_note(f"(ending the backward pass after that also failed: {cleanup})")
            raise
        self.scheduler.end_backward()

    def step(self) -> bool:
        """The optimizer step, then gradients cleared. False when it was skipped (fp16 overflow,
        or a non-finite gradient in any precision)."""
        self._check_usable()
        self.scheduler.release_all()
        scale = self._scaler.scale if self._scaler is not None else 1.0
        try:
            stepped = self.optimizer.step(scale)
        except BaseException as e:
            self.dist.report_failure(e)
            raise
        if self._scaler is not None:
            self._scaler.update(overflow=not stepped)
        if not stepped:
            for c in self._stats.both():
                c.skipped_steps += 1
            if self._scaler is None:
                logger.warning("non-finite gradient: step %d skipped", self._stats.steps + 1)
        self.grads.zero()  # resident parameters are views of the tier, updated in place: nothing to rebind
        last = self._stats.end_step()
        self._last_step = last
        if self.log_every and self._stats.steps % self.log_every == 0:
            logger.info("step %d: %s", self._stats.steps, _one_line(last))
        return stepped

    def zero_grad(self) -> None:
        """Forget the gradients accumulated since the last step (also after a failed backward:
        the step can then be redone from its first micro-batch)."""
        self._check_open()
        self.scheduler.drop_grads()
        self.grads.zero()

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    # -- reporting --------------------------------------------------------------------------
    def stats(self) -> dict:
        """Per step (the last one) and cumulative: bytes and busy seconds per tier, stall
        seconds, fetches (prefetched or on demand), skipped steps, peak host-pool bytes."""
        out = {
            "steps": self._stats.steps,
            "step": getattr(self, "_last_step", None),
            "total": self._stats.total.as_dict(),
            "peak_host_pool_bytes": self.pool.peak_bytes if self.pool else 0,
            "host_budget_bytes": self.config.memory.host_budget,
            "loss_scale": self._scaler.scale if self._scaler else None,
        }
        if self.device.type == "cuda":
            out["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return out

    def unit_weights(self):
        """Yield ``(unit, full)`` per parameter unit in order: ``full`` is the unit's fp32 master
        weights, whole (gathered from every rank's shard: every rank must iterate to the end),
        1-D of ``unit.padded_numel`` on the CPU. One sub-group's state is in memory at a time."""
        opt = self.optimizer
        for group in opt.groups:
            value = opt.stores["master"].get(group.name).result()
            if opt.stores["master"].resident:
                master, lease = value.detach(), None
            else:
                master, lease = value.view(torch.float32, (group.numel,)), value
            try:
                for unit in group.units:
                    shard = master[group.slices[unit.index]]
                    if self.dist.active:
                        full = torch.empty(unit.padded_numel, dtype=torch.float32)
                        self.dist.all_gather(full, shard.cpu(), f"weight gather of {unit.name}")
                    else:  # one copy, whether master is on the device, in memory or a pool buffer
                        full = shard.to("cpu", copy=True)
                    yield unit, full
                    del full  # one unit's weights alive at a time
            finally:
                if lease is not None:
                    lease.release()

    def gathered_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by parameter name, whole (gathered from every rank's shard;
        every rank must call it). Tied parameters appear once, under their owner's name."""
        out = {}
        for unit, full in self.unit_weights():
            for name, off, n, shape in zip(unit.param_names, unit.offsets, unit.numels, unit.shapes):
                prefix = "" if unit.name == "<root>" else f"{unit.name}."
                out[prefix + name] = full[off : off + n].view(shape).clone()
        return out

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, path, tag: str | None = None, client_state=None, *, keep_last: int | None = None) -> str:
        """Save every rank's training state to ``path/<tag>`` (default tag ``step-<N>``) and
        point ``path/latest`` at it; returns the checkpoint directory. Every rank calls it.

        Atomic (see [Note: atomic checkpoint] in _checkpoint.py): a failed or killed save leaves
        the previous checkpoint and ``latest`` as they were. ``client_state``: anything JSON can
        hold, given back by `load_checkpoint`. ``keep_last=N`` removes all but the newest N
        checkpoints in ``path`` after a successful save. State on NVMe is streamed through pool
        buffers, checksummed (xxh3-64), never gathered whole in memory."""
        self._check_usable()
        from . import _checkpoint

        return _checkpoint.save(self, path, tag, client_state, keep_last)

    def load_checkpoint(self, path, tag: str = "latest"):
        """Load the checkpoint ``path/<tag>`` (default: the one ``path/latest`` names; ``path``
        may also be a checkpoint directory itself) and return its ``client_state``.

        Every tensor is checked against its checksum as it is read: a corrupt or incomplete
        checkpoint is refused, naming the tensor and file, before anything trains on it. A
        checkpoint saved with another world size, stage, tier placement, precision or
        sub-group size loads too: each rank reads the slices of every unit it now owns."""
        self._check_open()
        from . import _checkpoint

        return _checkpoint.load(self, path, tag)

    def export(self, path) -> str:
        """Write the consolidated weights to the safetensors file ``path`` under the model's own
        parameter names (``model.load_state_dict(safetensors.torch.load_file(path))`` loads it
        into the unwrapped model), one unit at a time. Every rank calls it; rank 0 writes."""
        self._check_usable()
        from ._export import export_safetensors

        return export_safetensors(self, path)

    @property
    def swap_dirs(self) -> list[str]:
        """The rank directories of the nvme swap space (for swap-inspect); empty without nvme."""
        return list(self.space.rank_dirs) if self.space is not None else []

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        self.scheduler.release_all()
        self.grads.flush()
        self.scheduler.remove()
        self._close_io()

    def _close_io(self) -> None:
        """Close the swap space, the pool and the aio engine: all three, whatever fails first
        (the first error is raised after the others are closed)."""
        try:
            if self.space is not None:
                self.space.close()
        finally:
            try:
                if self.pool is not None:
                    self.pool.close()
            finally:
                if self.aio is not None:
                    self.aio.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this infinity engine is closed")

    def _check_usable(self) -> None:
        self._check_open()
        if self._unusable:
            raise RuntimeError(self._unusable)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _one_line(step: dict) -> str:
    nvme = step.get("nvme", {})
    return (f"{step['seconds']:.2f}s, nvme read {nvme.get('read_bytes', 0) / 1e6:.1f} MB "
            f"write {nvme.get('write_bytes', 0) / 1e6:.1f} MB, stall {step['stall_seconds']:.3f}s")  # fmt: skip


def initialize(model: nn.Module, config=None, *, log_every: int | None = None) -> Engine:
    """Move ``model``'s parameters into the tiers ``config`` names and return the engine that
    trains it (AdamW from ``[optimizer]``). ``config``: a TierConfig, a dict, a path to a TOML
    or JSON file, or None (everything on the device)."""
    return Engine(model, config, log_every=log_every)

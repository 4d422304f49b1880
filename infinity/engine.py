"""The engine: wires the tiers, the parameter scheduler, gradients and the optimizer around a
user's unmodified module. It owns no policy of its own; each piece lives in its module:

    _lifecycle.py  whether the engine can be used (one state), the checks before each pass and step
    _assembly.py   the parts made before any tensor is written, and the memory plan made from them
    _accumulation.py the backward passes since the last step, and whether they are whole
    _resources.py  what a run opens (I/O engine, host pool, swap space) and the memory checks
    _admission.py  the host budget's shares by class of traffic, and what gives way to a fetch
    _footprint.py  the disk the swap space takes, checked against free space and nvme.disk_budget
    _units.py      parameters flattened per module (what moves between tiers)
    _sizes.py      the sizes those parameters report, and torch's clipping over them
    _store.py      a tier: leases out of it, writes into it
    _transport.py  copies to the device and collectives across ranks
    _schedule.py   the pass hooks around forward and backward
    _runtime.py    a unit's fetch, bind, release and gradient
    _prefetch.py   the predicted order, reads ahead, units kept for backward
    _grads.py      gradient accumulation in fp32 into the grads tier
    _algorithms.py the optimizer algorithms: state kinds, hyperparameters, kernels
    _substates.py  the optimizer state per sub-group: stores, keys, byte sizes, step counts
    _update.py     the streamed optimizer step where the optimizer states live
    _optim.py      engine.optimizer, the torch.optim.Optimizer around them
    _scaler.py     the fp16 loss scaler
    _stats.py      the counters behind stats()
    _checkpoint.py save and load, through the components' state_dict()s
    _export.py     the consolidated weights as safetensors

``docs/architecture.md`` describes the data path through them.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import _activations, _admission, _amp_check, _assembly, _build, _checkpoint, _deepspeed, _deepspeed_api, _gather, _overlap, _overlap_host, _placeholder, _resources, _sizes, _units, _wrap
from ._accumulation import Accumulation
from ._deepspeed_api import DeepSpeedEngineAPI
from ._dist import Dist
from ._export import export_safetensors
from ._grads import GradAccumulator
from ._inplace import InPlaceWrites
from ._interrupts import held_interrupts
from ._lifecycle import Lifecycle, TrainingGuard
from ._optim import Optimizer
from ._overlap import OnDisk, Overlap
from ._overlap_host import InMemory
from ._owner import Owner, entry
from ._scaler import LossScaler
from ._schedule import Scheduler
from ._statedict import StateDictHooks
from ._stats import Stats, peak_rss_bytes
from ._units import UnitState
from ._update import clip_coef
from .config import TierConfig

logger = logging.getLogger("infinity")


class Engine(DeepSpeedEngineAPI):
    """Wraps ``module``: ``engine(...)`` runs its forward, ``backward(loss)``, ``step()``
    (and DeepSpeed's engine's ``global_steps``, ``get_lr()``, ...: `_deepspeed_api`).

    Create with `infinity.initialize`. ``module`` stays the user's module (its parameters are
    placeholders while released; ``engine.module`` is for calling, not for reading weights:
    use `gathered_weights` or `export` for that)."""

    def __init__(self, module: nn.Module, config, *, optimizer=None, lr_scheduler=None, log_every: int | None = None):
        if not isinstance(module, nn.Module):
            raise TypeError(f"initialize takes a torch.nn.Module, got {type(module).__name__}")
        self.config = cfg = _resources.as_config(config)
        _resources.pin_malloc_threshold()  # see [Note: malloc threshold]
        self.module = module
        # The process group the user made, or one from torchrun's environment (world size 1 otherwise).
        self.dist = Dist(cfg.partition.timeout)
        self.dist.agree(cfg.to_dict())  # a mismatch is an error on every rank, not a hang later
        rank, local_rank = self.dist.rank, self.dist.local_rank
        self.rank, self.world_size = rank, self.dist.world_size
        self.device = _assembly.device_of(self.dist)
        self.dtype = cfg.precision.torch_dtype
        self.log_every = log_every
        self._stats = Stats()
        self._scaler = LossScaler(cfg.precision) if self.dtype == torch.float16 else None
        self._life = Lifecycle()  # closed until everything below is made
        self._owner = Owner()  # one thread inside at a time (see `_owner`)
        self._scaled_backward = False  # inside engine.backward (fp16: the loss is scaled)
        self._said_partial = False  # `_units.warn_partial` said its once
        self._step_applied = False  # the last step() updated (DeepSpeed's was_step_applied)
        self._amp_said = False  # `_amp_check.warn_unprepared_autocast` said its once
        self.aio = self.pool = self.space = None
        self.activations = None
        self.overlap = None  # the optimizer under backward, where it applies (`_overlap`, `_overlap_host`)
        try:
            self.aio, self.pool, self.space = _resources.open_io(cfg, rank, local_rank)
            if rank == 0:
                _resources.remove_stale_ranks(cfg, self.world_size, self.aio, self.pool)
            self._setup(module, cfg, optimizer, lr_scheduler)
        except BaseException as e:
            try:
                if self.activations is not None:
                    self.activations.close()
                _resources.close_io(self.space, self.pool, self.aio, discard=True)  # a refused run leaves nothing
            except Exception as cleanup:  # noqa: BLE001 - the first error is the one to see
                e.add_note(f"(closing the swap space after that also failed: {cleanup})")
            raise
        self._life.open()
        _resources.trim_malloc()  # what writing the initial state freed (see [Note: malloc threshold])
        self._stats.start_step()
        _resources.close_at_exit(self)
        # Dropped without close() (and its model with it: the model's hooks hold the engine),
        # the garbage collector still closes its files, which unlocks its swap directory.
        self._finalizer = weakref.finalize(self, _close_dropped, self.space, self.pool, self.aio)

    def _setup(self, module: nn.Module, cfg: TierConfig, optimizer_spec, scheduler_spec) -> None:
        dev, stats, space = self.device, self._stats, self.space
        # What the host budget's plan and the disk's footprint are computed from, before the
        # parts that run with the plan: they are made with it, finished.
        parts = _assembly.lay_out(module, cfg, device=dev, dist=self.dist, space=space, pool=self.pool, stats=stats,
                                  optimizer_spec=optimizer_spec)  # fmt: skip
        layout = parts.layout
        self.params_sharded, self.grads_full = parts.params_sharded, layout.grads_full  # the ZeRO stage's meaning
        units, substates = layout.units, layout.states
        self.units, self.param_store, self.transport = units, layout.param_store, layout.transport
        # Before anything is written: that needs the pool too.
        self.plan, self.footprint = _assembly.plan_memory(cfg, layout)  # footprint: [Note: disk footprint]
        self.admission = _admission.Admission(self.pool, self.plan)
        self.grads = GradAccumulator(layout.grad_store, self.transport, grads_full=self.grads_full,
                                     copier=self.transport.copies,  # on a GPU: [Note: gradients copied back]
                                     plan=self.plan, admission=self.admission)  # fmt: skip
        self.optimizer = Optimizer(substates, parts.defaults, grads=self.grads, max_grad_norm=cfg.optimizer.max_grad_norm,
                                   engine_step=self._step, engine_zero_grad=self.zero_grad, plan=self.plan)  # fmt: skip
        # Everything else that can refuse the user's arguments, before the module's weights move.
        self.lr_scheduler = _lr_scheduler(scheduler_spec, self.optimizer)
        # fp32 master weights from the values as the user made them; low-precision params to
        # their tier. A model made in `infinity.build` gets its values now, one unit at a time.
        built = {u.index for u in units if _build.on_meta(u)}
        modules = dict(module.named_modules(remove_duplicate=False)) if built else {}
        # Each unit drawn from its stream of the block; the random state as it was is back after.
        with torch.random.fork_rng(devices=[], enabled=bool(built)):
            trim = _resources.TrimEvery()  # see [Note: malloc threshold]

            def done(u):
                if u.index in built:
                    _build.release(u)
                trim.add(16 * u.numel)

            self.optimizer.init_state(
                prepare=lambda u: _build.materialize(module, u, modules) if u.index in built else None, done=done
            )
        _sizes.mark(units, self)  # what counts and clipping read: [Note: sizes of placeholders]
        for unit in units:
            unit.placeholder_dtype, unit.placeholder_device = self.dtype, dev
            for p in unit.params:
                p._infinity_managed = True  # see _refuse_foreign_step
            unit.unbind()  # the module's own copies go; the tier holds the parameters now
        self._managed = {id(p): (p.requires_grad, p.dtype) for u in units for p in u.params}  # `_lifecycle.TrainingGuard`
        self._writes = InPlaceWrites(units, substates)  # see [Note: in-place writes to bound parameters]
        opt = self.optimizer
        self._guard = TrainingGuard(self._life, module, self._managed, functools.partial(_rebind, units), self._writes,
                                    clip_asked=lambda: opt.clip_next)  # fmt: skip
        plan = self.plan
        staging = None  # where early updates wait for the step: [Note: exact overlap] in `_overlap`
        if plan.overlap:
            staging = OnDisk(self.optimizer, plan.overlap, disk_room=self.footprint.staging_room, space=self.space,
                             on_disk_full=self._life.refuse)  # fmt: skip
        elif plan.staging:  # the states in host memory: see [Note: staged in host memory]
            fp = self.footprint
            staged = fp is not None and _overlap_host.params_staged(plan, layout)
            staging = InMemory(self.optimizer, plan.staging, disk_room=fp.staging_room if staged else 0)
            if self.pool is not None:  # its copies are host memory beside the pool, in the same budget:
                self.pool.reserve(plan.staging)  # buffers set aside grow no slab into it
        if staging is not None:
            self.overlap = Overlap(self.optimizer, functools.partial(_scale_of, self._scaler), staging,
                                   threaded=_overlap.on_worker(dev))
        overlap = self.overlap
        self._accumulation = Accumulation(cfg.optimizer.gradient_accumulation_steps, overlap, self.optimizer,
                                          counts=cfg.optimizer.accumulation == "engine")  # fmt: skip
        # [activations] tier: see [Note: activations offloaded] in `_activations`
        self.activations = _activations.build(cfg, rank=self.rank, local_rank=self.dist.local_rank, aio=self.aio,
                                              pool=self.pool, transport=self.transport, stats=stats,
                                              params=module.parameters, admission=self.admission)  # fmt: skip
        self.scheduler = Scheduler(units, parts.module_units, self.param_store, self.grads, stats, self.transport,
                                   depth=cfg.prefetch.depth, prefetch_bytes=cfg.prefetch.bytes, keep=cfg.prefetch.keep,
                                   keep_limit=plan.kept, device_budget=_device_budget(cfg, dev),
                                   gather=parts.gather, tiled=parts.tiled,
                                   admission=self.admission, activations=self.activations,
                                   listeners=(self._accumulation,) if overlap is not None else (),
                                   on_unit_final=overlap.unit_final if overlap is not None else None,
                                   keep_grad=overlap.keep_grad if overlap is not None else None,
                                   before_forward=self._guard.before_forward, after_backward=self._end_backward,
                                   owner=self._owner)  # fmt: skip
        if self.scheduler.always_ready:
            for unit in units:
                self.scheduler.runtime.materialize(unit)
        # Buffers stay buffers, on the compute device. A norm's running statistics, and the
        # buffers of a parametrization (spectral_norm's u and v, orthogonal's base), take the
        # parameters' dtype, as model.to(dtype) and DeepSpeed's bf16 give them: batch_norm and
        # the parametrizations' matmuls refuse to mix bf16 weights with fp32 buffers.
        cast = set() if self.dtype == torch.float32 else _cast_buffers_of(module)
        for mod in module.modules():
            for key, buf in mod._buffers.items():
                if buf is None:
                    continue
                dtype = self.dtype if mod in cast and buf.is_floating_point() else buf.dtype
                if buf.device != dev or buf.dtype != dtype:
                    mod._buffers[key] = buf.to(dev, dtype)
        self.scheduler.hooks.install(module)
        self._state_hooks = StateDictHooks(self, module)
        # What waits in the pool for later gives way to a transfer needed now, in this order
        # ([Note: traffic classes] in `_admission`).
        if self.transport.copies is not None:
            self.admission.give_way(_admission.COPIES, functools.partial(self.transport.copies.drain, block=False))
        self.admission.give_way(_admission.PREFETCH, self.scheduler.runtime.cancel_prefetches)
        if self.activations is not None:
            self.admission.give_way(_admission.ACTIVATION, self.activations.drop_reads)
        self.admission.give_way(_admission.KEPT, self.scheduler.prefetcher.give_back_kept)
        if self.overlap is not None:
            self.admission.give_way(_admission.OVERLAP, self.overlap.relieve)
        self.admission.give_way(_admission.GRAD, self.grads.held.spill)

    # -- training ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """The module's forward. Calling ``engine.module(...)`` is the same: the engine's work
        is in hooks on the module itself (`_hooks.ModuleHooks.install`)."""
        outermost = not self.scheduler.in_forward
        if not self._amp_said:
            self._amp_said = _amp_check.warn_unprepared_autocast(self.module, self.device)
        try:
            return self.module(*args, **kwargs)
        except BaseException as e:
            self.dist.report_failure(e)  # see [Note: rank failures]
            # A Ctrl-C: torch runs the always-called hook that ends the pass on Exceptions only.
            if outermost and self.scheduler.in_forward and self._owner.holds():
                self.scheduler.end_interrupted_pass()
            raise

    def __getattr__(self, name: str):
        """An attribute the engine lacks is the module's (``engine.generate(...)``), as DeepSpeed's
        engine gives its module's: a script written for it calls them so. The engine's own come
        first (``engine.config`` is its TierConfig, as DeepSpeed's is its config)."""
        module = self.__dict__.get("module")
        if module is not None and not name.startswith("__"):
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}, nor has its module")

    @entry("backward")
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss``; gradients accumulate over calls until `step`. A plain
        ``loss.backward()`` does the same in fp32 and bf16; fp16 needs this (loss scaling).
        With ``optimizer.accumulation = "engine"`` (a DeepSpeed config) the loss is divided by
        ``gradient_accumulation_steps`` first, as DeepSpeed's backward does."""
        self._life.check_open()
        if self._accumulation.loss_divisor > 1:
            loss = loss / self._accumulation.loss_divisor
        if self._scaler is not None:
            loss = loss * self._scaler.scale
        self._scaled_backward = True
        try:
            loss.backward()
        except BaseException as e:
            self.dist.report_failure(e)
            # Some units have this backward's gradient and some not: a step on them would train
            # on part of a gradient, silently. They stay refused until zero_grad().
            self._accumulation.failed(f"the last backward failed part-way ({type(e).__name__}: {e})")
            try:
                self.scheduler.runtime.drop_grads()
                self.scheduler.end_backward()
            except Exception as cleanup:  # noqa: BLE001 - the first error is the one to see
                e.add_note(f"(ending the backward pass after that also failed: {cleanup})")
            raise
        finally:
            self._scaled_backward = False
        if self.scheduler.in_backward:  # a loss that reached none of the module's outputs
            self.scheduler.end_backward()

    def scale_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` (its value unchanged) whose plain ``loss.backward()`` is scaled by the fp16
        loss scale, as `backward` scales it: for a loop that calls backward itself and reports
        the loss (InfinityTrainer wraps the Trainer's loss so). Other precisions: ``loss``."""
        return loss if self._scaler is None else self._scaler.in_backward(loss)

    def _end_backward(self) -> None:
        """The end of a backward pass (autograd calls it once the pass is done). One that gave
        no parameter a gradient (``torch.autograd.grad(loss, x)``, input saliency) is no
        micro-batch: nothing to scale, nothing to count (DeepSpeed's loop refused the step after
        one, as if its gradients came from a plain loss.backward(); an audit helper's repro)."""
        delivered = self.scheduler.runtime.take_received()
        if delivered and self._scaler is not None and not (self._scaled_backward or self._scaler.scaled_backward):
            self.scheduler.end_backward()
            self.zero_grad()
            raise RuntimeError(
                "precision.param_dtype = \"fp16\" needs engine.backward(loss), which scales the loss (or "
                "engine.scale_backward(loss).backward()); a plain loss.backward() would step on unscaled "
                "gradients (they were dropped)"
            )
        self.scheduler.end_backward()
        if not delivered:
            return
        with self.pool.traffic(_admission.OVERLAP):  # the early updates it starts (reads, staging)
            self._accumulation.backward_ended(through_engine=self._scaled_backward)

    def step(self) -> bool:
        """The optimizer step, then gradients cleared, then the LR scheduler given to
        `initialize` stepped. False when it was skipped (fp16 overflow, or a non-finite
        gradient in any precision), or, with ``optimizer.accumulation = "engine"`` (a DeepSpeed
        config), when this call is not the last micro-batch's of a step: then nothing changes
        and the gradients go on accumulating. ``engine.optimizer.step()`` (the torch optimizer's
        API, which accelerate and the Trainer call once per step) updates whenever it is called."""
        self._life.check_usable()  # (a closed or refusing engine says so, on a counted call too)
        if not self._accumulation.due():  # DeepSpeed's loop: [Note: DeepSpeed's accumulation] in `_deepspeed`
            self._step_applied = False
            return False
        return self.optimizer.step()

    @entry("step")
    def _step(self) -> bool:
        self._guard.before_step()
        _wrap.refuse_hand_set_grads(self.units)
        _gather.refuse_open(self, "engine.step()")
        self._accumulation.check_whole(self.scheduler.backward_lost)
        if _units.warn_partial(self.units, say=not self._said_partial):
            self._said_partial = True
        self.scheduler.release_all()
        scale = _scale_of(self._scaler)
        try:
            with self.pool.traffic(_admission.STEP):
                stepped = self.optimizer.update(scale, self.overlap)
        except BaseException as e:
            self.dist.report_failure(e)
            # Part of the sub-groups may be updated and part not: training on would be silently
            # inconsistent. The optimizer's state is whole again once a checkpoint loads.
            self._life.refuse(f"the optimizer step failed part-way ({type(e).__name__}: {e}); the parameters and "
                         "optimizer states are partly updated: load the last checkpoint (engine.load_checkpoint) "
                         "to train on")  # fmt: skip
            try:  # this step's gradients are of no use now, and a load wants none
                self.zero_grad()
            except Exception as cleanup:  # noqa: BLE001 - the first error is the one to see
                e.add_note(f"(dropping the gradients after that also failed: {cleanup})")
            raise
        # The parameters are updated: what counts the step runs whole, a Ctrl-C held to its end
        # (one in the middle left the update uncounted, the step, the schedule and the gradients
        # as before it, and a redone step updated twice: an audit helper's repro).
        with held_interrupts:
            self._accumulation.stepped()
            if self._scaler is not None:
                self._scaler.update(overflow=not stepped)
            if not stepped:
                for c in self._stats.both():
                    c.skipped_steps += 1
                if self._scaler is None:
                    logger.warning("non-finite gradient norm (an inf or NaN element, or squares summing past fp32's "
                                   "3.4e38, as torch's fp32 norm does): step %d skipped", self._stats.steps + 1)
            self.grads.zero()  # resident parameters are views of the tier, updated in place: nothing to rebind
            if stepped and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            _resources.trim_malloc(_resources.STEP_TRIM_SLACK)  # see [Note: malloc threshold]
            last = self._stats.end_step()
            self._last_step = last
            self._step_applied = stepped
        if self._scaler is not None and self._scaler.at_floor:  # the step counted, skipped: the run stops here
            raise self._scaler.floor_error()
        if self.log_every and self._stats.steps % self.log_every == 0:
            logger.info("step %d: %s", self._stats.steps, _one_line(last))
        return stepped

    @entry("zero_grad")
    def zero_grad(self) -> None:
        """Forget the gradients accumulated since the last step (also after a failed backward:
        the step can then be redone from its first micro-batch)."""
        self._life.check_open()
        self.scheduler.forget_backward()
        if self.overlap is not None:
            self.overlap.discard()
        self.grads.zero()
        self.optimizer.clip_next = None  # a clip asked goes with the gradients it was asked of, as torch's
        _units.forget_gradients(self.units)
        self._accumulation.reset()

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    # -- reporting --------------------------------------------------------------------------
    def stats(self) -> dict:
        """Per step (the last one) and cumulative: bytes and busy seconds per tier (nvme's
        transfers; in the resident tiers, what the optimizer step reads and writes there), by
        kind of state, stall seconds, fetches (prefetched or on demand), skipped steps, every
        copy between the host and a GPU (``h2d_bytes``, ``d2h_bytes`` and their GPU seconds:
        [Note: every copy counted] in `_transport`), the optimizer's time in its kernels
        (``optimizer_seconds``) and the step's update (``update_seconds``), peak host-pool bytes
        and the process's peak RSS; "disk": per swap directory, the state's bytes, the peak, the
        arena's cap and size now; "pool": the host pool's bytes by traffic class (held now,
        peak) and the budget's shares."""
        out = {
            "steps": self._stats.steps,
            "step": getattr(self, "_last_step", None),
            "total": self._stats.total.as_dict(),
            "peak_host_pool_bytes": self.pool.peak_bytes if self.pool else 0,
            "peak_rss_bytes": peak_rss_bytes(),
            "host_budget_bytes": self.config.memory.host_budget,
            "device_budget_bytes": self.scheduler.prefetcher.device_budget,  # kept for backward (None: no bound)
            "loss_scale": self._scaler.scale if self._scaler else None,
            "resident_bytes": _resident_bytes((self.param_store, self.grads.store, *self.optimizer.states.values())),
            "disk": self.footprint.as_dict(self.space) if self.footprint is not None else {},
            # each traffic class's bytes held and peak, beside the plan's shares ([Note: traffic classes])
            "pool": self.admission.stats() if self.pool is not None else {},
        }
        if self.device.type == "cuda":
            out["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return out

    @entry("grad_norm")
    def grad_norm(self) -> float:
        """The global L2 norm of the gradients accumulated since the last step (all ranks,
        unscaled, before clipping), as ``torch.nn.utils.clip_grad_norm_`` returns it."""
        self._life.check_open()
        self.grads.flush()
        scale = _scale_of(self._scaler)
        return self.grads.norms.global_norm() / scale

    @entry("clip_grad_norm_")
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """What ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` does in a plain
        loop (whose parameters here have no ``.grad``: their gradients are in the tiers): the
        next step clips the gradients to the global norm ``max_norm``; returns the norm before
        clipping. ``torch.nn.utils.clip_grad_norm_`` and ``accelerator.clip_grad_norm_`` over
        ``engine.module.parameters()`` call it ([Note: clipping managed parameters] in `_sizes`)."""
        if not max_norm > 0:
            raise ValueError(f"{max_norm=} must be > 0")
        norm, before = self.grad_norm(), self.optimizer.clip_next
        if before is not None:  # a clip asked earlier this step: the norm of the gradients as it left them
            norm *= clip_coef(before, norm)
        # Two clips in a row leave the smaller bound, as torch's would (and [optimizer]
        # max_grad_norm still applies: the step clips to the smallest).
        self.optimizer.clip_next = float(max_norm) if before is None else min(before, float(max_norm))
        return torch.tensor(norm)

    @entry("load_state_dict")
    def load_state_dict(self, state_dict, strict: bool = True):
        """``engine.module.load_state_dict``: the weights go into the tiers (see `_statedict`)."""
        return self.module.load_state_dict(state_dict, strict=strict)

    @entry("state_dict")
    def state_dict(self) -> dict:
        """``engine.module.state_dict()``: every weight gathered into memory; at several ranks
        every rank calls it and rank 0 alone gets them, the others an empty dict ([Note:
        state_dict at several ranks]). For a large model, `save_pretrained` and `export` stream
        them to a file instead."""
        return self.module.state_dict()

    @entry("save_pretrained")
    def save_pretrained(self, directory, max_shard_size="2GB") -> str:
        """Write the weights as a Hugging Face checkpoint directory that
        ``AutoModel*.from_pretrained(directory)`` loads: ``config.json`` (and
        ``generation_config.json``) when the module has one, and safetensors shards of at most
        ``max_shard_size`` (transformers' sizes: "2GB", "500MB", "1GiB") with their index, each
        written atomically and streamed one unit at a time (each parameter in the dtype the
        model was made in). Every rank calls it; rank 0 writes. Returns the directory."""
        self._life.check_usable()
        from ._pretrained import save_pretrained

        return save_pretrained(self, directory, max_shard_size)

    def unit_weights(self, rank0_only: bool = False, units: set[int] | None = None):
        """Yield ``(unit, full)`` per parameter unit in order: ``full`` is the unit's fp32 master
        weights, whole (gathered from every rank's shard: every rank must iterate to the end),
        1-D of ``unit.padded_numel`` on the CPU. One sub-group's state is in memory at a time.
        ``rank0_only``: gathered to rank 0 only; the other ranks send their shard and get None.
        ``units``: the indices of the units to read (the same on every rank; None: all)."""
        self._writes.carry()  # what was written into bound parameters is the weights too
        opt = self.optimizer
        for group in opt.groups:
            if units is not None and not any(u.index in units for u in group.units):
                continue
            lease = opt.states["master"].get(group.name).result()
            master = lease.tensor.detach()
            try:
                for unit in group.units:
                    if units is not None and unit.index not in units:
                        continue
                    full = _whole(self.dist, unit, master[group.slices[unit.index]], rank0_only)
                    yield unit, full
                    del full  # one unit's weights alive at a time
            finally:
                lease.release()
        for unit in opt.frozen:  # no master weights: the parameters are the weights
            if units is not None and unit.index not in units:
                continue
            lease = self.param_store.get(unit.name).result()
            try:
                value = lease.tensor.reshape(-1)
                if value.numel() == unit.padded_numel:  # stages 1, 2 keep all of it
                    value = value[unit.shard]
                full = _whole(self.dist, unit, value.to("cpu", torch.float32), rank0_only)
            finally:
                lease.release()
            yield unit, full
            del full

    @entry("gathered_weights")
    def gathered_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by parameter name, whole (gathered from every rank's shard;
        every rank must call it). Tied parameters appear once, under their owner's name."""
        out = {}
        for unit, full in self.unit_weights():
            prefix = "" if unit.path == "<root>" else f"{unit.path}."
            for i, r in enumerate(unit.records):
                name, whole = r.name, r.full_shape
                if unit.rows is None:
                    out[prefix + name] = unit.view(full, i).clone()
                    continue
                if unit.rows[0] == 0:
                    out[prefix + name] = torch.empty(whole, dtype=torch.float32)
                out[prefix + name][unit.rows[0] : unit.rows[1]] = unit.view(full, i)
        return out

    # -- checkpoints ------------------------------------------------------------------------
    @entry("save_checkpoint")
    def save_checkpoint(self, path, tag: str | None = None, client_state=None, *, keep_last: int | None = None) -> str:
        """Save every rank's training state to ``path/<tag>`` (default tag ``step-<N>``) and
        point ``path/latest`` at it; returns the checkpoint directory. Every rank calls it.

        Atomic (see [Note: atomic checkpoint] in _checkpoint.py): a failed or killed save leaves
        the previous checkpoint and ``latest`` as they were. ``client_state``: anything JSON can
        hold, given back by `load_checkpoint`. ``keep_last=N`` removes all but the newest N
        checkpoints in ``path`` after a successful save. State on NVMe is streamed through pool
        buffers, checksummed (xxh3-64), never gathered whole in memory."""
        self._life.check_usable()
        return _checkpoint.save(self, path, tag, client_state, keep_last)

    @entry("load_checkpoint")
    def load_checkpoint(self, path, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):  # fmt: skip
        """Load the checkpoint ``path/<tag>`` (``None`` or ``"latest"``: the one ``path/latest``
        names; ``path`` may also be a checkpoint directory itself) and return ``(directory,
        client_state)``, the checkpoint directory it loaded and what its save was given, as
        DeepSpeed's engine returns its load path and client state (a script's ``_, client =
        engine.load_checkpoint(d)`` bound the first two keys of a client_state returned alone).

        Every tensor is checked against its checksum as it is read: a corrupt or incomplete
        checkpoint is refused, naming the tensor and file, before anything trains on it. A
        checkpoint saved with another world size, stage, tier placement, precision,
        sub-group size or tile size loads too: each rank reads the slices of every unit it now
        owns, re-cut by rows where the modules are tiled otherwise ([Note: re-cut] in `_recut`).
        DeepSpeed's partial loads (``load_optimizer_states=False``, ...) are refused, naming
        what loads the weights alone (`_deepspeed_api.refuse_partial_load`)."""
        _deepspeed_api.refuse_partial_load(load_module_strict=load_module_strict, load_module_only=load_module_only,
                                           load_optimizer_states=load_optimizer_states,
                                           load_lr_scheduler_states=load_lr_scheduler_states)  # fmt: skip
        self._life.check_open()
        _gather.refuse_open(self, "engine.load_checkpoint()")
        self._writes.carry()  # (else a parameter given new data before the load would be carried over it after)
        where, client_state = _checkpoint.load(self, path, "latest" if tag is None else tag, on_partial=self._life.refuse)
        self.optimizer.clip_next = None  # asked of the gradients before the load: none remain
        self._accumulation.reset()  # a step starts over from its first micro-batch
        self._life.restore()
        self._stats.start_step()
        return where, client_state

    @entry("export")
    def export(self, path) -> str:
        """Write the consolidated weights to the safetensors file ``path`` under the model's own
        parameter names (``model.load_state_dict(safetensors.torch.load_file(path))`` loads it
        into the unwrapped model), one unit at a time. Every rank calls it; rank 0 writes."""
        self._life.check_usable()
        return export_safetensors(self, path)

    @property
    def overlap_from(self) -> int | None:
        """The smallest ``memory.host_budget`` with the optimizer under backward for this model
        and config (None: never); see ``optimizer.overlap`` in docs/config.md."""
        return self.plan.overlap_from

    @property
    def swap_dirs(self) -> list[str]:
        """The rank directories of the nvme swap space (for swap-inspect); empty without nvme."""
        return list(self.space.rank_dirs) if self.space is not None else []

    # -- lifetime ---------------------------------------------------------------------------
    @entry("close")
    def close(self) -> None:
        if not self._life.close():
            return
        _resources.closed(self)
        self._finalizer.detach()
        # The files are closed (and the swap directory unlocked) whatever the rest raises: a
        # Ctrl-C or a failed read must not leave the directory locked for the whole process.
        try:
            if self.scheduler.in_forward:  # a forward a Ctrl-C left
                self.scheduler.end_interrupted_pass()
            _gather.end_open(self)  # their memory goes with the engine's
            self.scheduler.release_all()
            for unit in self.units:  # a placeholder read from here on says why it is empty
                for p in unit.params:
                    _placeholder.mark_closed(p)
            if self.overlap is not None:
                self.overlap.close()
            self.grads.flush()
        finally:
            try:
                if self.activations is not None:
                    self.activations.close()
                self.scheduler.hooks.remove()
                self._state_hooks.remove()
            finally:
                _resources.close_io(self.space, self.pool, self.aio)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _scale_of(scaler) -> float:
    """The loss scale gradients are multiplied by now: fp16's, else 1."""
    return scaler.scale if scaler is not None else 1.0


def _lr_scheduler(spec, optimizer):
    """The LR scheduler the engine steps after each step: ``spec(optimizer)`` for a
    callable (as DeepSpeed takes it), or a scheduler already built on ``engine.optimizer`` or
    on the torch optimizer given to `initialize` whose groups it took."""
    if spec is None:
        return None
    if isinstance(spec, torch.optim.lr_scheduler.LRScheduler):
        # One built on the torch optimizer the engine was given (DeepSpeed's client scheduler) changes
        # the groups the engine steps with, where it took that optimizer's own dicts (offloaded state).
        shared = len(spec.optimizer.param_groups) == len(optimizer.param_groups) and all(
            a is b for a, b in zip(spec.optimizer.param_groups, optimizer.param_groups))
        if spec.optimizer is not optimizer and not shared:
            raise ValueError("lr_scheduler was built on another optimizer: pass a callable that builds it "
                             "from engine.optimizer, e.g. lambda opt: LambdaLR(opt, f)")  # fmt: skip
        if spec.optimizer is not optimizer:  # the engine steps in its place: torch's "scheduler before step" is not so
            spec.optimizer._opt_called = True
        return _no_metric_needed(spec)
    if not callable(spec):
        raise TypeError(f"lr_scheduler must be a callable taking the optimizer, got {type(spec).__name__}")
    built = spec(optimizer)
    if not hasattr(built, "step") or not hasattr(built, "state_dict"):
        raise TypeError(f"lr_scheduler(optimizer) returned a {type(built).__name__}, not an LR scheduler")
    return _no_metric_needed(built)


def _resident_bytes(stores) -> dict[str, int]:
    """Bytes each resident tier ("device", "cpu") of ``stores`` holds now: memory two stores share (the
    parameters that are the master weights) counted once, in the params tier."""
    # storage -> (the tier of the first store that holds it, the byte ranges held): the
    # params store first, whose tier made the memory it shares with the master weights.
    spans: dict[tuple, tuple[str, list]] = {}
    for store in stores:
        if store.tier not in ("device", "cpu"):
            continue
        for t in store.resident_tensors():
            storage = t.untyped_storage()
            start = t.storage_offset() * t.element_size()
            spans.setdefault((storage.device, storage.data_ptr()), (store.tier, []))[1].append(
                (start, start + t.numel() * t.element_size()))
    out = {"device": 0, "cpu": 0}
    for tier, ranges in spans.values():
        end = 0
        for lo, hi in sorted(ranges):  # their union: what overlaps counted once
            out[tier] += max(0, hi - max(lo, end))
            end = max(end, hi)
    return out


def _whole(dist, unit, shard: torch.Tensor, rank0_only: bool = False) -> torch.Tensor | None:
    """``unit``'s weights from every rank's ``shard`` (``dist``: `_dist.Dist`) (fp32), 1-D on the CPU, a copy (None
    on ranks other than 0 when ``rank0_only``)."""
    if dist.active and rank0_only:
        full = torch.empty(unit.padded_numel, dtype=torch.float32) if dist.rank == 0 else None
        what = f"weight gather of {unit.name} to rank 0 (every rank calls state_dict, save_pretrained, export)"
        dist.gather_to_rank0(full, shard.to("cpu", torch.float32), what)
        return full
    if dist.active:
        full = torch.empty(unit.padded_numel, dtype=torch.float32)
        dist.all_gather(full, shard.to("cpu", torch.float32), f"weight gather of {unit.name}")
        return full
    return shard.to("cpu", torch.float32, copy=True)  # one copy, wherever the shard lives


def _device_budget(cfg: TierConfig, device: torch.device) -> int | None:
    """``memory.device_budget``, or its default: on a GPU half of what it has free now (the
    rest for activations and the units in use), on the host none (``host_budget`` bounds the
    pool buffers kept units are). Free on a GPU counts what torch's caching allocator holds
    unused, which the kept units are allocated from first: after a large batch, or another
    model's run in the same process, most of a GPU can be cached (in benchmarks/gpu_step.py the
    runs before an engine's initialize had peaked at 142 GB of an H200's 149)."""
    if cfg.memory.device_budget is not None or device.type == "cpu":
        return cfg.memory.device_budget
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return (free + cached) // 2


def _close_dropped(space, pool, aio) -> None:
    """An engine collected without close(): close its I/O (errors logged; nothing to raise to)."""
    logger.warning("an infinity engine was garbage-collected without engine.close(): closing its swap space %s",
                   space.rank_dirs[0] if space is not None and space.rank_dirs else "(none)")  # fmt: skip
    try:
        _resources.close_io(space, pool, aio)
    except Exception as e:  # noqa: BLE001 - at collection time there is no caller to raise to
        logger.warning("closing the dropped engine's swap space failed: %s", e)


def _rebind(units) -> None:
    """Point the parameters of every bound unit at its memory again: a ``module.to(dtype)``
    replaced their data by copies (`_lifecycle.TrainingGuard` refuses the cast)."""
    for unit in units:
        if unit.state is UnitState.READY:
            unit.bind(unit.full)


def _cast_buffers_of(module: nn.Module) -> set[nn.Module]:
    """The modules whose floating buffers a low ``param_dtype`` casts: norms (running
    statistics), the modules of every parametrization (``torch.nn.utils.parametrize``) and
    those of hook-based ``torch.nn.utils.spectral_norm`` (its u and v: left in fp32, the
    forward's matmul with the bf16 weight failed, where model.to(torch.bfloat16) trains; an
    audit helper's repro)."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.spectral_norm import SpectralNorm

    cast = set()
    for mod in module.modules():
        if isinstance(mod, nn.modules.batchnorm._NormBase):
            cast.add(mod)
        if any(isinstance(hook, SpectralNorm) for hook in mod._forward_pre_hooks.values()):
            cast.add(mod)
        if parametrize.is_parametrized(mod):
            for plist in mod.parametrizations.values():
                cast.update(plist.modules())
    return cast


def _refuse_foreign_step(optimizer, args, kwargs):
    """A torch optimizer other than the engine's, stepping parameters the engine manages, would
    step on empty placeholders without gradients and train nothing, silently: refuse it."""
    if getattr(optimizer, "_infinity_engine_optimizer", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "_infinity_managed", False):
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step() on parameters that an infinity engine manages: they "
                    "are placeholders whose gradients and updates live in the engine's tiers, so this step "
                    "would train nothing. Use engine.step() (engine.optimizer is the engine's optimizer; "
                    "with transformers' Trainer, use infinity.integrations.transformers)"
                )


register_optimizer_step_pre_hook(_refuse_foreign_step)


def _no_metric_needed(scheduler):
    """``scheduler``, which engine.step() steps with no argument: a ReduceLROnPlateau needs the
    metric it watches, so every step would raise. Refused here, saying how to use one."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            f"lr_scheduler is a {type(scheduler).__name__}, whose step() needs the metric it watches, and "
            "engine.step() has none to give: do not pass it to initialize; build it on engine.optimizer after "
            "initialize and call its .step(metric) yourself (after engine.step(), with your validation loss, "
            "say); keep its state_dict() in save_checkpoint's client_state"
        )
    return scheduler


def _one_line(step: dict) -> str:
    nvme = step.get("nvme", {})
    return (f"{step['seconds']:.2f}s, nvme read {nvme.get('read_bytes', 0) / 1e6:.1f} MB "
            f"write {nvme.get('write_bytes', 0) / 1e6:.1f} MB, stall {step['stall_seconds']:.3f}s")  # fmt: skip


def initialize(model: nn.Module, config=None, *, optimizer=None, lr_scheduler=None,
               log_every: int | None = None) -> Engine:  # fmt: skip
    """Move ``model``'s parameters into the tiers ``config`` names and return the engine that
    trains it. ``config``: a TierConfig, a dict, a path to a TOML or JSON file, or None
    (everything on the device).

    ``optimizer``: None (``[optimizer]`` of the config over every trainable parameter),
    parameters or parameter groups (``[{"params": [...], "weight_decay": 0.0}, ...]``, the
    config filling in the rest), a torch.optim AdamW, Adam, SGD or Adagrad (an instance, its
    class, ``(class, kwargs)`` or a callable building one from the parameters). The engine runs
    its update on the offloaded state; ``engine.optimizer`` is a torch.optim.Optimizer with the
    same ``param_groups``. ``lr_scheduler``: a callable building a scheduler from
    ``engine.optimizer``; the engine steps it after every step that was not skipped.

    A DeepSpeed config (its dict, or a path to ``ds_config.json``) is read as the tier config
    it means (`TierConfig.from_deepspeed`), its ``scheduler`` as ``lr_scheduler`` when none is
    given; one without an ``"optimizer"`` section needs ``optimizer=`` (DeepSpeed builds none
    then), unless no parameter requires grad."""
    if _deepspeed.is_deepspeed(config):
        if optimizer is None and isinstance(model, nn.Module):
            _deepspeed.refuse_without_optimizer(config, model)
        if lr_scheduler is None:
            lr_scheduler = _deepspeed.lr_scheduler(config)
    return Engine(model, config, optimizer=optimizer, lr_scheduler=lr_scheduler, log_every=log_every)

"""Fetch, prefetch and release of parameter units around each module's forward and backward.

Owns: the module hooks, the predicted order of modules, which units are fetched, ready or
released, and the saved-tensor pack/unpack that keeps views of released units valid. Touches:
the params `Store` (leases), `_transport.Transport` (copies to the device, the all-gather), and
hands each unit's finished gradient to `_grads.GradAccumulator`.

Forward: a module's pre-hook materialises its units (waiting for a prefetch, or reading on
demand) and issues the reads of the units of the next ``depth`` modules of the predicted
order; its post-hook releases them. Backward: the module's outputs carry a marker whose
backward runs just before the module's own, and fetches again, prefetching in the reverse of
this step's forward order; the units are released once all their gradients have arrived.

[Note: saved parameter views]
Autograd saves what backward needs, and for many ops that is a *view* of a parameter
(``nn.Linear`` saves ``weight.t()``), which keeps pointing at the memory the parameter had in
forward. Once a unit is released that memory goes back to the pool and the next fetch reuses
it, so the view would read another unit's weights. A saved-tensor hook packs any saved tensor
that lives in a released-able unit's memory as (unit, offset, size, stride) and unpacks it
as the same view of the unit's memory at backward time (fetching the unit if it is not there).
A forward that runs again inside backward (activation recomputation) keeps its units until
their gradients have arrived, for the same reason.

[Note: kept for backward]
Backward uses the units in the reverse of forward's order, so the units forward used last are
the ones backward needs first. A unit that backward will need is kept bound after its forward
rather than released, as long as the parameters kept stay within ``memory.device_budget``
(`device_budget`: on a GPU they hold its memory) and, with the compute on the host (the pool
buffer a unit was read into is its parameters), the pool keeps room for what the rest of the
pass needs (the engine's plan gives `keep_limit`: the budget less its slack and backward's own
buffers, a unit in use, ``depth`` prefetched, gradients being written); when either does not,
the units kept longest go first, those backward needs last. Where the optimizer's early
updates under backward ([Note: exact overlap] in `_overlap`) are planned, units are kept only
in what the most those hold at once leaves (the room of held gradients, [Note: gradients held]
in `_grads`: a kept unit turns into a gradient as backward uses it); kept units that took the
early updates' room too (a 2.7B model at 2GiB) made forward wait on the pool and the RSS pass
its bound. Backward finds the rest bound and reads only what was let go: with a budget that
holds every unit, each parameter is read once a step. A kept unit in a pool buffer whose module's backward has not begun is given
back whenever a fetch or a gradient buffer finds the pool full; one whose backward has begun
is in use and never is.
The values are the ones a second read would give (parameters change only at the step).

[Note: gradient hand-over]
Autograd accumulates a parameter's gradient into ``param.grad`` and then runs the engine's
hook, which takes it from there into the unit's fp32 gradient; a tile's Function hands its
rows over directly (`tile_grad`). A ``.grad`` left on a parameter would be accumulated into by
the next backward and taken with it: every weight of the redone step off, with no error. So
the bookkeeping from taking a gradient to the unit's hand-over (``param.grad`` cleared, the
gradient copied or added, the use counted; the unit's gradient taken for `_grads`) runs with
SIGINT held back ([Note: interrupt windows] in `_interrupts`); the pool buffer it may wait for
is taken before, while nothing has changed. What no section can cover (the hook's first
bytecodes run before any section is entered) is undone by `forget_backward`, which
``zero_grad`` and ``load_checkpoint`` call: every managed parameter's ``.grad`` cleared (a
tile's too: a gathered tiled parameter's gradient passes through it), every unit's gradient
dropped, and a backward that never ended ended.

[Note: predicted order]
The first forward uses module registration order (so prefetch works from the first step);
each forward records the order that really ran, and the next forward predicts it. When a
module arrives that is not the predicted one, prediction stops for the rest of that pass and
units are fetched on demand: a departure costs speed, never correctness.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
import weakref

import torch
from torch import nn

from infinity.swap import PoolExhausted

from . import _gather, _tiled
from ._activations import SavedTensors
from ._admission import FETCH, GRAD, OVERLAP, PREFETCH, Admission
from ._compile import eager
from ._grads import GradAccumulator
from ._interrupts import held_interrupts
from ._profile import region
from ._stats import Stats
from ._store import Store
from ._transport import Transport
from ._units import ParamUnit, UnitState


class _Order:
    """A predicted sequence of modules and how far a pass has followed it."""

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules
        self.pos = 0
        self.valid = True

    def advance(self, module: nn.Module) -> int | None:
        """The position of ``module`` if it is the predicted next one, else None (and stop)."""
        if self.valid and self.pos < len(self.modules) and self.modules[self.pos] is module:
            self.pos += 1
            return self.pos - 1
        self.valid = False
        return None


class _UnitView:
    """A saved tensor that is a view of a unit's memory, kept by position, not by memory."""

    __slots__ = ("unit", "offset", "size", "stride")

    def __init__(self, unit, offset, size, stride):
        self.unit, self.offset, self.size, self.stride = unit, offset, size, stride


def _on_grad(t, hook):
    """Call ``hook(grad)`` when backward computes the gradient of ``t`` (a tensor that needs one)."""
    if isinstance(t, torch.Tensor) and t.requires_grad:
        t.register_hook(hook)
    return t


def _weak_grad_hook(scheduler, unit, i: int):
    """The hook a parameter runs once its gradient is accumulated. It holds the scheduler
    weakly: hooks on tensors live in C++, where the garbage collector cannot see the cycle
    parameter -> hook -> scheduler -> model -> parameter, so a strong one would keep an engine
    dropped without close() (and its locked swap directory) alive for good."""
    ref = weakref.ref(scheduler)

    def hook(param: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            live.grad_arrived(unit, i, param)

    return hook


LOST_BACKWARD = "the last backward raised part-way (a plain loss.backward(), whose end never ran)"


def _graph_task() -> int | None:
    """The autograd graph task running in this thread (-1: none; None: torch cannot say)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else None


def _traffic(pool, name: str):
    """Count the pool buffers taken inside under traffic class ``name`` ([Note: traffic classes])."""
    return pool.traffic(name) if pool is not None else contextlib.nullcontext()


def _map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(o, fn) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):  # includes transformers' ModelOutput (an OrderedDict)
        for k in list(obj.keys()):
            obj[k] = _map_tensors(obj[k], fn)
        return obj
    return obj


class Scheduler:
    """Materialises each module's units just before it runs (forward and backward), prefetches
    along the predicted order, and releases them after."""

    def __init__(
        self,
        units: list[ParamUnit],
        module_units: dict[nn.Module, list[ParamUnit]],
        store: Store,
        grads: GradAccumulator,
        stats: Stats,
        transport: Transport,
        *,
        depth: int,
        prefetch_bytes: int | None,
        gather: bool,
        tiled: dict[nn.Module, list[ParamUnit]] | None = None,
        keep: bool = True,
        keep_limit: int = 0,
        device_budget: int | None = None,
        admission: Admission,
        on_backward_due=None,
        on_unit_final=None,
    ):
        self.units = units
        self.module_units = module_units
        # Tiled modules (see [Note: tiles] in `_units`): their forward (`_tiled`) fetches their
        # tiles one by one; the hooks here only count their uses and prefetch their first tile.
        self.tiled = tiled or {}
        self.store = store
        self.grads = grads
        self.stats = stats
        self.transport = transport
        self.device = transport.device
        self.depth = depth
        self.prefetch_bytes = prefetch_bytes
        self._itemsize = transport.dtype.itemsize
        self.pool = transport.pool  # host buffers for gradients gathered on a CPU device
        # What gives way when a fetch finds the pool full: see [Note: traffic classes] in `_admission`.
        self.admission = admission
        # Gradients gathered straight into pool buffers (a CPU device with a pool); else on the
        # device, whence `_grads` copies them back ([Note: gradients copied back]).
        self.grads_in_pool = self.device.type == "cpu" and self.pool is not None
        # Stage 3 across ranks: the tier holds this rank's shard; materialising gathers the rest.
        self.gather = gather
        # Units always materialised: the tier lends its own tensors on the compute device.
        self.always_ready = store.in_place_on(self.device) and not gather
        self.forward_order = _Order(list(module_units))  # registration order: see [Note: predicted order]
        self.backward_order = _Order([])
        self._trace: list[nn.Module] = []
        self._handles = []
        self._by_storage: dict[int, ParamUnit] = {}  # storage address -> READY unit (released-able)
        self._in_backward = False  # between a grad-enabled forward and the end of its backward
        # Per module, grad-enabled calls whose gradient uses were counted in forward, and calls
        # run again inside backward (activation checkpointing): a reentrant checkpoint's first
        # forward runs without grad, so its uses are counted when backward runs it again.
        self._calls: dict[nn.Module, int] = {}
        self._recomputed: dict[nn.Module, int] = {}
        self._depth = 0  # nested calls of the root module
        self._began = False  # the outermost root call set up the pass
        self._saved_hooks = None  # the saved-tensor hooks of the pass, while the root runs
        self.saved = SavedTensors()  # what they hand saved tensors to: parameter views first
        self.saved.add(self._pack_view, self._unpack_view)
        self.activations = None  # `_activations.ActivationTier`, told when passes begin and end
        self._end_queued = False  # the end of this backward is queued with autograd
        self.owner = None  # the engine's `_owner.Owner`: a root call is an entry point
        self._before_forward = None  # the engine's checks, before each pass
        self._after_backward = None  # the engine's end of a backward pass
        # The engine's overlap (see _overlap): told when a backward is due, with the units
        # expecting gradients, and when a unit's gradient is stored.
        self.on_backward_due = on_backward_due
        self.on_unit_final = on_unit_final
        # Units kept bound after forward for backward, in the order forward left them: at most
        # ``device_budget`` bytes of them (None: no bound but the pool's), and with the compute
        # on the host (the pool buffer is the parameters) while the pool holds at most
        # ``keep_limit`` bytes. See [Note: kept for backward].
        on_host = self.device.type == "cpu"
        self.keep_limit = keep_limit if on_host else None
        self.device_budget = device_budget
        self.keep = (keep and not self.always_ready and device_budget != 0
                     and (keep_limit > 0 if on_host else device_budget is not None))  # fmt: skip
        self._kept: dict[int, ParamUnit] = {}
        self._kept_bytes = 0  # of the parameters the kept units hold

    # -- hooks ------------------------------------------------------------------------------
    def install(self, root: nn.Module, *, before_forward, after_backward, owner=None) -> None:
        """Hook ``root`` and every module that uses a unit. Calling ``root`` itself (what
        ``engine(...)``, transformers' Trainer and accelerate do alike) runs a whole pass:
        ``before_forward()`` first, the saved-tensor hooks around it; and a backward through
        its outputs ends with ``after_backward()``. ``owner`` (`_owner.Owner`) is entered for
        each root call: a second thread's is refused."""
        self._before_forward, self._after_backward, self.owner = before_forward, after_backward, owner
        # Every hook on a module runs eagerly under torch.compile: [Note: hooks under torch.compile].
        self._handles.append(root.register_forward_pre_hook(eager(self._root_pre_hook), prepend=True))
        self._install_modules()
        for module, tiles in self.tiled.items():
            _tiled.install(module, self, tiles)
            module.forward = eager(module.forward)  # it reads tiles from the tiers
        self._handles.append(root.register_forward_hook(eager(self._root_post_hook), always_call=True))

    def _install_modules(self) -> None:
        # Per module: for each unit, how many of its gradients one grad-enabled call will bring
        # (the parameters the module holds itself that require grad). Fixed: counted once here.
        self._uses_per_call = {
            module: [(u, sum(1 for p, needs in zip(u.params, u.requires_grad)
                             if needs and any(q is p for q in module._parameters.values()))) for u in units]
            for module, units in self.module_units.items()
        }  # fmt: skip
        for module in self.module_units:
            self._handles.append(module.register_forward_pre_hook(eager(self._pre_forward_hook)))
            self._handles.append(module.register_forward_hook(eager(self._post_forward_hook)))
        for unit in self.units:
            for i, (p, needs) in enumerate(zip(unit.params, unit.requires_grad)):
                if needs and not unit.is_tile:  # a tile's gradients come from its Function (tile_grad)
                    self._handles.append(p.register_post_accumulate_grad_hook(_weak_grad_hook(self, unit, i)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module in self.tiled:
            _tiled.remove(module)

    def _root_pre_hook(self, module, args):
        with held_interrupts:  # one owner entry per root call counted in _depth (see end_interrupted_pass)
            if self.owner is not None:
                self.owner.enter("forward")  # another thread inside: refused before anything changes
            if self._depth and not self._outer_call_live(module):
                self.end_interrupted_pass()
            self._depth += 1
        if self._depth == 1:
            if self.backward_lost:
                raise RuntimeError(f"{LOST_BACKWARD}: the gradients accumulated since the last step are incomplete; "
                                   "call engine.zero_grad() and run this step's micro-batches again")  # fmt: skip
            self._before_forward()
            self.begin_forward()
            self._began = True
            # See [Note: saved parameter views].
            # Units always bound are never placeholders nor moved: with no other handler (the
            # activation tier), nothing to do for a saved tensor.
            if not (self.always_ready and len(self.saved.handlers) == 1):
                self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
                self._saved_hooks.__enter__()

    def _root_post_hook(self, module, args, output):
        """Runs also when the forward raised (``always_call``): the pass always ends."""
        if self.owner is None:
            return self._end_root_call(output)
        if not self.owner.holds():
            return output  # a call refused in the pre-hook: another thread is inside
        try:
            return self._end_root_call(output)
        finally:
            self.owner.exit()

    def _end_root_call(self, output):
        self._depth -= 1
        if self._depth > 0 or not self._began:
            return output
        self._began = False
        try:
            if torch.is_grad_enabled() and any(u.requires_grad for u in self.units) and output is not None:
                # The root's outputs get their gradients first in a backward pass, in its outermost
                # graph task (also with reentrant checkpointing inside): the end of the pass is
                # queued from there, so ``loss.backward()`` alone ends it as ``engine.backward`` does.
                _map_tensors(output, lambda t: _on_grad(t, self._root_grad_arrives))
        finally:
            hooks, self._saved_hooks = self._saved_hooks, None
            if hooks is not None:
                hooks.__exit__(None, None, None)
            self.end_forward()
            if not torch.is_grad_enabled():
                self.release_all()
        return output

    @staticmethod
    def _outer_call_live(root: nn.Module) -> bool:
        """Whether a call of ``root`` is running further up this thread's stack (a nested call),
        rather than left by a KeyboardInterrupt (see `end_interrupted_pass`). Looked at only
        when a root call begins inside another, which no ordinary forward does."""
        call = nn.Module._call_impl.__code__
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not call:  # past `eager`'s frames
            frame = frame.f_back
        frame = frame.f_back if frame is not None else None  # the module call that runs this hook
        while frame is not None:
            if frame.f_code is call and frame.f_locals.get("self") is root:
                return True
            frame = frame.f_back
        return False

    @property
    def in_forward(self) -> bool:
        """A call of the root module began and has not ended."""
        return self._depth > 0

    def end_interrupted_pass(self) -> None:
        """End a pass whose root forward a KeyboardInterrupt left: torch runs a module's
        always-called forward hooks on an Exception only, so `_root_post_hook` did not run. Its
        saved-tensor hooks come off, the units its modules held are released, and the next
        root call begins a pass again (checking first that the engine is usable)."""
        began, hooks, depth = self._began, self._saved_hooks, self._depth
        self._depth, self._began, self._saved_hooks = 0, False, None
        if self.owner is not None:
            self.owner.exit(depth)  # the entries of the root calls left
        if began and hooks is not None:
            hooks.__exit__(None, None, None)
        for unit in self.units:
            unit.active = 0  # their modules' post-hooks never ran
            self.release(unit)

    def _grad_arrives(self, module, grad) -> None:
        self.pre_backward(module)

    def _root_grad_arrives(self, grad) -> None:
        self.backward_started()

    def backward_started(self) -> None:
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._end_queued = False
        self._after_backward()

    @property
    def backward_lost(self) -> bool:
        """A backward began (its end queued with autograd) and raised: a plain
        ``loss.backward()`` (``engine.backward`` ends its own), whose end never runs. Its
        units hold part of its gradients, and the pass it began is still open: the next
        forward would be taken for a recomputation inside it. `forget_backward` ends it."""
        return self._end_queued and _graph_task() == -1

    @property
    def in_backward(self) -> bool:
        """A grad-enabled pass ran and its backward has not ended."""
        return self._in_backward

    def _pre_forward_hook(self, module, args):
        self._trace.append(module)
        pos = self.forward_order.advance(module)
        for unit in self._held(module):
            self.materialize(unit)
            unit.active += 1
        if pos is not None:
            self._prefetch(self.forward_order, pos + 1)

    def _post_forward_hook(self, module, args, output):
        units = self.module_units[module]
        for unit in self._held(module):
            unit.active -= 1
        if self._in_backward:
            # A forward recomputed inside backward (activation checkpointing): its units stay
            # until their gradients arrive. Its uses were counted by the first forward, unless
            # that ran without grad (reentrant checkpointing): then they are counted now.
            if torch.is_grad_enabled():
                self._recomputed[module] = self._recomputed.get(module, 0) + 1
                if self._recomputed[module] > self._calls.get(module, 0):
                    for unit, uses in self._uses_per_call[module]:
                        unit.uses += uses
            return output
        if torch.is_grad_enabled():
            self._calls[module] = self._calls.get(module, 0) + 1
            for unit, uses in self._uses_per_call[module]:
                unit.uses += uses
            if not self.always_ready and any(unit.requires_grad for unit in units):
                # (Units always bound need no fetch in backward: no hook.)
                # The gradient of an output arrives just before the module's own backward runs.
                # A hook on the tensor (not an identity Function, whose output would be a view
                # that the model may not change in place) says so.
                _map_tensors(output, lambda t: _on_grad(t, functools.partial(self._grad_arrives, module)))
        for unit in units:
            if not self._keep_for_backward(unit):
                self.release(unit, after_forward=True)
        return output

    def _keep_for_backward(self, unit: ParamUnit) -> bool:
        """After ``unit``'s module's forward: keep it for backward if backward will use it
        (a tile was kept or not by its module's own forward: `_tiled`)."""
        if unit.is_tile:
            return unit.index in self._kept
        return unit.uses > 0 and self.keep_for_backward(unit)

    def keep_for_backward(self, unit: ParamUnit) -> bool:
        """Keep ``unit`` bound after its forward for backward, giving back the units kept
        longest while they hold more than `device_budget` or the pool more than `keep_limit`
        ([Note: kept for backward])."""
        if not self.keep or unit.active > 0 or unit.state is not UnitState.READY:
            return False
        if self.keep_limit is not None and unit.lease is None:
            return False  # on the host, a unit not in a pool buffer (none to keep it in)
        self._unkeep(unit.index)
        self._kept[unit.index] = unit  # the newest: needed first in backward
        self._kept_bytes += unit.padded_numel * self._itemsize
        while self._kept and self._over_keep():
            self._let_go(next(iter(self._kept.values())))
        return unit.index in self._kept

    def _over_keep(self) -> bool:
        if self.device_budget is not None and self._kept_bytes > self.device_budget:
            return True
        return self.keep_limit is not None and self.pool.in_use_bytes > self.keep_limit

    def _unkeep(self, index: int) -> ParamUnit | None:
        """No longer count unit ``index`` as kept; it, or None if it was not."""
        unit = self._kept.pop(index, None)
        if unit is not None:
            self._kept_bytes -= unit.padded_numel * self._itemsize
        return unit

    def take_kept(self, unit: ParamUnit) -> None:
        """``unit`` is in use from now (its backward began): never given back while kept."""
        if self._unkeep(unit.index) is not None:
            for c in self.stats.both():
                c.kept_for_backward += 1

    def _let_go(self, unit: ParamUnit) -> None:
        """Release a kept unit: backward reads it again."""
        self._unkeep(unit.index)
        self.release(unit, after_forward=True)

    def give_back_kept(self) -> None:
        """The pool is full: release every unit kept for a backward that has not reached it
        in a pool buffer (on a GPU, kept units hold device memory: none is in the pool)."""
        for unit in list(self._kept.values()):
            if unit.lease is not None:
                self._let_go(unit)

    def pre_backward(self, module: nn.Module) -> None:
        # Several outputs of one call each run this; the first materialises, the rest find it ready.
        pos = self.backward_order.advance(module) if self.backward_order.valid else None
        for unit in self._held(module):
            self.take_kept(unit)
            self.materialize(unit)
        if pos is not None:
            self._prefetch(self.backward_order, pos + 1)

    def _held(self, module: nn.Module) -> list[ParamUnit]:
        """The units ``module``'s hooks fetch and hold around it: none for a tiled module."""
        return [] if module in self.tiled else self.module_units[module]

    def grad_arrived(self, unit: ParamUnit, i: int, param: torch.Tensor) -> None:
        """Parameter ``i`` of ``unit`` has its gradient (``param.grad``) of this backward. The
        fp32 copy in the unit is the gradient from here; the parameter's goes
        ([Note: gradient hand-over])."""
        self._receive(unit, i, param=param)

    def tile_grad(self, unit: ParamUnit, i: int, grad: torch.Tensor) -> None:
        """``grad`` is the gradient of this backward of parameter ``i`` of ``unit`` (of the
        unit's part of it: a tile's rows)."""
        self._receive(unit, i, grad=grad)

    def _receive(self, unit: ParamUnit, i: int, *, grad: torch.Tensor | None = None, param=None) -> None:
        """``grad``, or ``param``'s ``.grad`` (taken from it), into the unit's gradient; the
        unit handed on when it was its last ([Note: gradient hand-over])."""
        lease = self._grad_buffer(unit)
        try:
            with held_interrupts:
                if param is not None:
                    grad, param.grad = param.grad, None
                final = self._gather_grad(unit, i, grad, lease)
        except BaseException:
            self._unclaimed(unit, lease)
            raise
        if final:
            self.finish_unit_backward(unit)

    def _grad_buffer(self, unit: ParamUnit):
        """The pool buffer ``unit``'s gradient is gathered in, when it has none yet and one is
        needed (a CPU device with a pool: budgeted, and aligned so its write-behind is
        direct); else None. It may wait for room: taken before anything changes, so that an
        interrupt here leaves the gradient where it was."""
        if unit.grad is None and self.grads_in_pool and self.grads.in_place(unit, self.device) is None:
            return self._acquire(unit.padded_numel * 4)
        return None

    @staticmethod
    def _unclaimed(unit: ParamUnit, lease) -> None:
        """An interrupt came before ``lease`` was the unit's: given back now, not at garbage collection."""
        if lease is not None and unit.grad_lease is not lease:
            lease.release()

    def _gather_grad(self, unit: ParamUnit, i: int, grad: torch.Tensor | None, lease) -> bool:
        """Copy (the first) or add (the next ones) ``grad`` into the unit's gradient and count
        the use; whether it was the unit's last. Runs with interrupts held: it never waits."""
        if unit.grad is None:
            # Not zeroed: each parameter's first gradient is copied in, later ones added,
            # and what none arrived for is zeroed when the unit is handed on.
            if lease is not None:
                unit.grad_lease = lease
                unit.grad = lease.view(torch.float32, (unit.padded_numel,))
            else:  # the tier's own tensor where it can be (then `add` copies nothing), else a new one
                unit.grad = self.grads.in_place(unit, self.device)
                if unit.grad is None:
                    unit.grad = torch.empty(unit.padded_numel, dtype=torch.float32, device=self.device)
            unit.grad_seen = set()
        off, n = unit.offsets[i], unit.numels[i]
        if grad is None:
            pass  # a Function that gave this parameter none: as a parameter no gradient reached
        elif i in unit.grad_seen:
            unit.grad[off : off + n].add_(grad.reshape(-1))
        else:
            unit.grad[off : off + n].copy_(grad.reshape(-1))
            unit.grad_seen.add(i)
        unit.uses -= 1
        return unit.uses <= 0

    # -- passes -----------------------------------------------------------------------------
    def begin_forward(self) -> None:
        if self.activations is not None:
            self.activations.begin_forward()
        self._trace = []
        self.forward_order.pos, self.forward_order.valid = 0, True
        self._prefetch(self.forward_order, 0)

    def end_forward(self) -> None:
        if self.activations is not None:
            self.activations.end_forward()
        if self._trace != self.forward_order.modules:
            self.forward_order = _Order(list(self._trace))  # the next pass predicts this one
        if torch.is_grad_enabled():
            self._in_backward = True
            self.backward_order = _Order(list(reversed(self._trace)))
            self._prefetch(self.backward_order, 0)
            if self.on_backward_due is not None:
                self.on_backward_due([u for u in self.units if u.uses > 0])

    def finish_unit_backward(self, unit: ParamUnit) -> None:
        with held_interrupts:  # see [Note: gradient hand-over]
            grad, lease = unit.grad, unit.grad_lease
            unit.grad = unit.grad_lease = None  # handed on, or (if that fails) dropped: never twice
            if grad is not None:  # zeros where no gradient arrived: parameters unused, the padding
                for i, (off, n) in enumerate(zip(unit.offsets, unit.numels)):
                    if i not in unit.grad_seen:
                        grad[off : off + n].zero_()
                grad[unit.numel :].zero_()
            unit.uses = 0
        if grad is not None:
            with _traffic(self.pool, GRAD):
                self.grads.add(unit, grad, lease)  # owns the lease from here, failing or not
        self.release(unit)
        if grad is not None and self.on_unit_final is not None:
            with _traffic(self.pool, OVERLAP):  # the optimizer's early updates: see `_overlap`
                self.on_unit_final(unit)

    def end_backward(self) -> None:
        """Gradients not yet handed on (a unit whose uses never reached zero: activation
        recomputation runs a forward twice) are handed on now; every unit is released.
        The pass ends even when handing on fails (the first error is raised after)."""
        try:
            for unit in self.units:
                if unit.grad is not None or unit.uses:
                    self.finish_unit_backward(unit)
            self.grads.land()  # see [Note: gradients copied back] in `_grads`
        finally:
            if self.activations is not None:
                self.activations.end_backward()
            self.drop_grads()
            for unit in self.units:
                unit.active = 0
                self.release(unit)
            self.backward_order = _Order([])
            self._in_backward = False
            # A backward that raised (a Ctrl-C in a hook) never runs the callback it queued.
            self._end_queued = False
            self._calls.clear()
            self._recomputed.clear()
            self.transport.drain()

    def forget_backward(self) -> None:
        """Forget this step's gradients still in units and parameters (zero_grad, a load), and
        end a backward that began and never ended: a plain ``loss.backward()`` that raised (a
        Ctrl-C in a hook) never runs the end it queued, and the next would queue none."""
        self.drop_grads()
        if self._end_queued:
            self.end_backward()

    def drop_grads(self) -> None:
        """Forget gradients still being gathered in units (after a failed backward), and any a
        parameter still holds ([Note: gradient hand-over])."""
        with held_interrupts:  # one section for all: it never waits
            for unit in self.units:
                if unit.grad_lease is not None:
                    unit.grad_lease.release()
                unit.grad = unit.grad_lease = None
                unit.uses = 0
                for p in unit.params:  # a tile's too: a gathered one's gradient passes through it
                    if p.grad is not None:
                        p.grad = None

    # -- saved tensors: see [Note: saved parameter views] -------------------------------------
    def pack(self, t: torch.Tensor):
        """The pass's saved-tensor pack hook: parameter views here, then the other handlers
        (the activation tier: `_activations.SavedTensors`)."""
        return self.saved.pack(t)

    def unpack(self, saved):
        return self.saved.unpack(saved)

    def _pack_view(self, t: torch.Tensor):
        _gather.refuse_placeholder(t)  # see [Note: reads outside a module]
        if self.always_ready or not self._by_storage:
            return None
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
        unit = self._by_storage.get(ptr)
        # An entry a Ctrl-C left behind may name memory given back since: only a bound unit's counts.
        if unit is None or unit.full is None or unit.full.untyped_storage().data_ptr() != ptr:
            return None
        return _UnitView(unit, t.storage_offset() - unit.full.storage_offset(), t.size(), t.stride())

    def _unpack_view(self, saved: _UnitView):
        self.materialize(saved.unit)
        full = saved.unit.full
        return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)

    # -- fetch and release ------------------------------------------------------------------
    def _prefetch(self, order: _Order, start: int) -> None:
        if self.always_ready or not order.valid:
            return
        budget = self.prefetch_bytes
        for module in order.modules[start : start + self.depth]:
            units = self.module_units.get(module, ())
            if module in self.tiled:
                units = _tiled.ahead(module, units, backward=order is self.backward_order)
            for unit in units:
                if unit.state is UnitState.RELEASED:
                    if budget is not None:
                        budget -= unit.padded_numel * self._itemsize
                        if budget < 0:  # prefetch.bytes: whichever limit comes first
                            return
                    if not self._start_fetch(unit, wait=False):
                        return  # no free host memory now: the rest is fetched on demand

    def prefetch_unit(self, unit: ParamUnit) -> None:
        """Start reading ``unit`` if it is released and the pool has room now."""
        if not self.always_ready and unit.state is UnitState.RELEASED:
            self._start_fetch(unit, wait=False)

    def _start_fetch(self, unit: ParamUnit, wait: bool = True) -> bool:
        """Issue the read of ``unit``. A prefetch (``wait=False``) takes pool memory only if it
        is free now; a fetch that is needed now first gives back what prefetches hold."""
        # Urgent: forward and backward wait on these, not on the optimizer's reads ahead (the
        # early updates under backward queue theirs on the same drive).
        if wait:
            with _traffic(self.pool, FETCH):
                pending = self.admission.take_now(lambda t: self.store.get(unit.name, timeout=t, urgent=True))
        else:
            try:
                with _traffic(self.pool, PREFETCH):
                    pending = self.store.get(unit.name, timeout=0, urgent=True)
            except PoolExhausted:
                return False
        with held_interrupts:  # see [Note: interrupt windows]
            unit.pending = pending
            unit.state = UnitState.FETCHING
        return True

    def _acquire(self, nbytes: int):
        """A pool buffer for backward's own use: what waits in the pool for later gives way
        first if the pool has no room (the optimizer's work under backward never makes backward
        wait), but the prefetches, which backward needs next."""
        return self.admission.take_now(lambda t: self.pool.acquire(nbytes, timeout=t, traffic=GRAD),
                                       skip=(PREFETCH,))  # fmt: skip

    def cancel_prefetches(self) -> None:
        for other in self.units:
            self._drop_fetch(other)

    @staticmethod
    def _drop_fetch(unit: ParamUnit) -> None:
        """Wait for a fetch in flight and give its lease back: the unit is not needed now. A
        read that failed is forgotten too (its error raised): nothing used it."""
        if unit.state is not UnitState.FETCHING:
            return
        try:
            lease = unit.pending.result()  # interrupted, the unit is still fetching: waited for again
        except Exception:
            Scheduler._forget_fetch(unit, None)
            raise
        Scheduler._forget_fetch(unit, lease)

    @staticmethod
    def _forget_fetch(unit: ParamUnit, lease) -> None:
        """The unit's read is spent or not wanted: released, ``lease`` (its buffer) given back."""
        with held_interrupts:  # see [Note: interrupt windows]
            unit.pending = None
            unit.state = UnitState.RELEASED
            if lease is not None:
                lease.release()

    def materialize(self, unit: ParamUnit) -> None:
        if unit.state is UnitState.READY:
            return
        if self.always_ready:
            tensor = self.store.get(unit.name).result().tensor
            with held_interrupts:
                unit.bind(tensor)
            return
        with region("infinity::fetch"):
            counters = self.stats.both()
            if unit.state is UnitState.RELEASED:
                self._start_fetch(unit)
                for c in counters:
                    c.on_demand += 1
            else:
                for c in counters:
                    c.prefetch_hits += 1
            start = time.perf_counter()
            # Interrupted while it waits, the unit stays fetching and the next call waits again;
            # once the read is used, the unit is bound whole or released (see [Note: interrupt
            # windows]): never fetching with its read spent.
            lease = unit.pending.result()
            host = None
            try:
                if self.gather:
                    full, host = self.transport.gather(unit, lease)
                elif self.device.type == "cpu":  # computing on the host: the lease is the parameters
                    full, host = lease.tensor, lease
                else:
                    full = self.transport.to_device(lease)
                with held_interrupts:
                    # Known to the saved-tensor hooks before any module can see it bound.
                    self._by_storage[full.untyped_storage().data_ptr()] = unit
                    unit.lease = host
                    unit.bind(full)
                    unit.pending = None
            except BaseException:
                if unit.state is not UnitState.READY:
                    if host is not None and host is not lease:
                        host.release()
                    self._forget_fetch(unit, lease)
                raise
            waited = time.perf_counter() - start
            for c in counters:
                c.stall_seconds += waited
                c.fetches += 1

    def release(self, unit: ParamUnit, after_forward: bool = False) -> None:
        """Free a unit's full parameters unless a running module or an open GatheredParameters
        still uses them or (in backward) more of its gradients are due; after a forward, pending
        backward uses do not hold it: backward fetches it again."""
        if self.always_ready or unit.active > 0 or unit.gathers > 0 or (unit.uses > 0 and not after_forward):
            return
        if unit.state is UnitState.FETCHING:
            return  # a prefetch for a coming module: keep it
        if unit.state is UnitState.READY:
            with held_interrupts:  # see [Note: interrupt windows]
                self._unkeep(unit.index)
                self._by_storage.pop(unit.full.untyped_storage().data_ptr(), None)
                unit.unbind()
                if unit.lease is not None:
                    unit.lease.release()
                    unit.lease = None

    def release_all(self) -> None:
        """Release every unit and forget the gradient uses still expected: a forward whose
        backward has not run (a loss computed and dropped before a save) is forgotten with them,
        or the next forward, taken for its recomputation, would count no uses and its units
        would be released under their own backward."""
        for unit in self.units:
            self._drop_fetch(unit)
            unit.active = unit.uses = 0
            self.release(unit)
        self._in_backward = False
        self.backward_order = _Order([])
        self._calls.clear()
        self._recomputed.clear()

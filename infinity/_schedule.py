"""The pass hooks: what fetches and releases parameter units around each module's forward and
backward, and where a pass begins and ends.

Owns: what the module hooks and the root module's hooks do (a pass begins and ends at the
root, also when a forward raised or a Ctrl-C left it), the uses of each unit's gradients
counted per call, and the saved-tensor hooks of a pass. Touches: units only through
`_runtime.UnitRuntime` (fetch, bind, release, gradients gathered and handed on),
`_prefetch.Prefetcher` (the predicted order, reads ahead, units kept for backward) and
`_hooks.ModuleHooks` (where the hooks are registered, their handles), which it builds and owns.
Calling the root (what ``engine(...)``, transformers' Trainer and accelerate do alike) runs a
whole pass: the constructor's ``before_forward()`` first, the saved-tensor hooks around it; a
backward through its outputs ends with ``after_backward()``; ``owner`` (`_owner.Owner`) is
entered for each root call, so a second thread's is refused.

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

[Note: passes begun by a submodule]
A module of the model called outside a call of the root (a model's method such as CLIP's
``encode_text``, transformers' ``get_text_features``, or a backbone then its head as chunked-
loss code calls ``model.model(ids)`` then ``model.lm_head(h)``) begins a pass of its own, as a
root call does: the engine's checks, the saved-tensor hooks around it ([Note: saved parameter
views]: without them the views autograd saves read pool memory another unit has taken since,
and the weights train wrong where units are released before backward), and its outputs' end
of backward. Its nested calls are part of it. A module called inside backward (recomputation
by activation checkpointing) begins none: it is part of that backward. Where units are always
bound, modules have no hooks ([Note: always-ready units' uses]): there the first gradient of a
backward that no pass began begins one, and its end is queued with autograd (`_weak_grad_hook`).

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

[Note: always-ready units' uses]
Where every unit is always bound (`UnitRuntime.always_ready`: the parameters lent where the
model computes, and no all-gather: one rank, or stages 1 and 2), modules get no hooks (but a
tiled module's post-hook, below): there is nothing to fetch, hold, predict or release, and the
post-hooks' one remaining task, counting each unit's gradient uses so that its gradient is
handed on once the last arrives, needs no per-module call. Ranks that run the same graph hand
their units on in the same order, so their reductions meet, as with counting calls.
Autograd runs a parameter's post-accumulate hook once per backward graph task, after every
use of it in the graph is summed (a module called twice, a weight tied to another module's),
so a grad-enabled pass's root pre-hook sets each unit's uses to its hooked parameters; a
unit is then handed on when each has arrived once, earlier than counting calls did (which
counted a tied or repeated use twice and left such a unit to the end of backward). A unit
whose module did not run is handed on by the end of backward, as before; a reentrant
checkpoint's inner backward, which runs a parameter's hook again, adds its gradient to the
one handed on as a later micro-batch's would be (and an early update that assumed the first
is discarded at the step: [Note: exact overlap] in `_overlap`). A tile's gradients come from
its module's Function once per call of the module, not from autograd's accumulation: a tiled
module keeps its post-hook, which counts its tiles' uses per call as before.

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

A gradient that is all of its unit (a parameter alone in its unit, unpadded: a Linear without
bias, a norm's weight) and its last of the backward (always, but where a unit's uses count a
module twice), where the grads tier keeps gradients on its device, takes the short way
(`UnitRuntime._took_whole`, `GradAccumulator.take_whole`): as the step's first, the tensor
itself becomes the tier's tensor where it is fp32 in memory of its own (`_store.Store.adopt`:
no copy), or is cast into the tier's tensor (a bf16 gradient); a later micro-batch's is added
to the sum there from where autograd left it. Its norm is noted and the unit handed on, with
nothing gathered in the unit: the values the long way gives, bit for bit.
Autograd gives ``param.grad`` a tensor of its own (it steals the one it computed, or clones a
shared one), which the hook takes: nothing else holds it.

[Note: predicted order]
The first forward uses module registration order (so prefetch works from the first step);
each forward records the order that really ran, and the next forward predicts it. When a
module arrives that is not the predicted one, prediction stops for the rest of that pass and
units are fetched on demand: a departure costs speed, never correctness.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
import weakref

import torch
from torch import nn

from . import _placeholder
from ._activations import SavedTensors
from ._admission import GRAD, Admission
from ._compile import eager
from ._grads import GradAccumulator
from ._hooks import ModuleHooks, PassHooks
from ._interrupts import held_interrupts
from ._pass import PassListener
from ._prefetch import Prefetcher
from ._runtime import UnitRuntime, traffic
from ._stats import Stats
from ._store import Store
from ._transport import Transport
from ._units import ParamUnit


def _on_grad(t, fn):
    """Call ``fn()`` when backward computes the gradient of ``t`` (a tensor that needs one)."""
    if isinstance(t, torch.Tensor) and t.requires_grad:
        t.register_hook(functools.partial(_called, fn))
    return t


def _called(fn, grad) -> None:
    fn()  # and return None: the gradient goes on unchanged


def _weak_grad_hook(scheduler, unit, i: int):
    """The hook a parameter runs once its gradient is accumulated. It holds the scheduler
    weakly: hooks on tensors live in C++, where the garbage collector cannot see the cycle
    parameter -> hook -> scheduler -> model -> parameter, so a strong one would keep an engine
    dropped without close() (and its locked swap directory) alive for good.

    Where units are always bound, modules have no hooks: a forward through submodules outside
    a call of the root (``model.backbone(x)`` then ``model.head(h)``) began no pass, and its
    backward ended none: the engine's end of backward never ran (fp16's plain-backward
    refusal, accumulation = "engine"'s mean, the passes counted). The first gradient of a
    backward with no pass begun begins one, its end queued with autograd as a root call's."""
    ref = weakref.ref(scheduler)

    def hook(param: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            if live.always_ready and live.state is TrainingState.IDLE:
                live.backward_started()
            live.runtime.grad_arrived(unit, i, param)

    return hook


SECOND_BACKWARD = (
    "a backward through a graph whose forward ran before the last backward ended: a second backward "
    "through a retained graph (loss.backward(retain_graph=True) then backward again; torch.autograd.grad("
    "..., create_graph=True) then backward, as a gradient penalty does), or the losses of two forwards "
    "given to backward one at a time; the end of a backward releases every parameter its step's forwards "
    "used, so with this placement the engine cannot run it; sum the step's losses into one backward, or "
    "keep the parameters where they are always bound (tiers.params = \"device\", one rank)"
)
LOST_BACKWARD = "the last backward raised part-way (a plain loss.backward(), whose end never ran)"


def _off_units(module: nn.Module, units, output):
    """[Note: outputs that alias a unit]
    A module may return a view of its own parameter (a learned position table's
    ``self.weight[:T]``, Perceiver's ``latents.expand(...)``), which its caller reads after the
    module's call. The unit is released there and its buffer taken by other units' weights: the
    view read their bytes, silently (an audit helper's repro: 1.65 off plain PyTorch, in a
    forward with grad or without). Such an output is given as a copy (``clone``, through which
    autograd reaches the parameter as through the view), where it is a tensor or lies in a
    tuple, list or dict (transformers' ModelOutput); one deeper in an object is refused, naming
    the module."""
    bound = {u.full.untyped_storage().data_ptr() for u in units if u.full is not None and u.full.numel()}
    if not bound:
        return output

    def aliases(t) -> bool:
        return isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().data_ptr() in bound

    opaque = []  # objects `off` does not look into: walked for a view once, after

    def off(obj, depth=0):
        if aliases(obj):
            return obj.clone()
        if depth > 8 or isinstance(obj, torch.Tensor):
            return obj
        if not isinstance(obj, (tuple, list, dict)):
            if obj is not None and not isinstance(obj, (int, float, bool, str)):
                opaque.append(obj)
            return obj
        if isinstance(obj, tuple):
            items = [off(v, depth + 1) for v in obj]
            if all(a is b for a, b in zip(items, obj)):
                return obj
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        if isinstance(obj, list):
            obj[:] = [off(v, depth + 1) for v in obj]
        elif isinstance(obj, dict):
            for k, v in list(obj.items()):
                new = off(v, depth + 1)
                if new is not v:
                    obj[k] = new
        return obj

    output = off(output)
    left = []
    for obj in opaque:
        _each_tensor(obj, lambda t: left.append(t) if aliases(t) else None, objects=True)
    if left:
        raise RuntimeError(
            f"module {type(module).__name__} returned a view of its own parameters inside an object the engine "
            "cannot copy it out of: once the module's call ends, its parameters' memory is released and reused, and "
            "the view would read other weights. Return it as a tensor, or in a tuple, list or dict, or return a copy "
            "(.clone())"
        )
    return output


def _graph_task() -> int | None:
    """The autograd graph task running in this thread (-1: none; None: torch cannot say)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else None


def _each_tensor(obj, fn, *, objects: bool = False, depth: int = 8, _seen: set | None = None) -> None:
    """Call ``fn`` on each tensor in ``obj`` (a module's output), as FSDP reaches into one:
    tensors, tuples (namedtuples), lists, sets, dicts (transformers' ModelOutput) and
    dataclasses, each object once, ``depth`` levels down; with ``objects``, a plain object's
    attributes too (``types.SimpleNamespace``, a model's own output class; not a module or a
    class). A root's loss the engine cannot find is a backward it does not see begin: the
    recompute of ``checkpoint(use_reentrant=False)`` taken for a new forward, a plain
    ``loss.backward()`` never ended (an audit helper's repros with a SimpleNamespace and a
    dataclass output). A submodule's output is not looked into so far: an object there may
    hold tensors other modules made (transformers' Cache, the attention layers' keys and
    values), whose gradients arrive in the middle of backward, out of the predicted order."""
    if isinstance(obj, torch.Tensor):
        fn(obj)
        return
    if depth == 0 or obj is None or isinstance(obj, (str, bytes, int, float, complex, nn.Module, type)):
        return
    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = obj
    elif dataclasses.is_dataclass(obj):
        items = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    elif objects and hasattr(obj, "__dict__"):
        items = vars(obj).values()
    else:
        return
    for item in items:
        _each_tensor(item, fn, objects=objects, depth=depth - 1, _seen=seen)


class TrainingState(enum.Enum):
    """Where the pass is, between a grad-enabled forward and the end of its backward (as
    FSDP2's ``TrainingState``; a root call running is `Scheduler.in_forward`, apart: a forward
    recomputed inside backward runs in BACKWARD)."""

    IDLE = "idle"  # no backward due
    BACKWARD_DUE = "backward_due"  # a grad-enabled forward ended; its backward has not begun
    BACKWARD = "backward"  # its backward began: its end is queued with autograd


class Scheduler:
    """Materialises each module's units just before it runs (forward and backward), prefetches
    along the predicted order, and releases them after: the hooks, over a `UnitRuntime` and a
    `Prefetcher` built here."""

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
        activations=None,
        listeners: tuple[PassListener, ...] = (),
        on_unit_final=None,
        keep_grad=None,
        before_forward=None,
        after_backward=None,
        owner=None,
    ):
        self.units = units
        self.module_units = module_units
        # Tiled modules (see [Note: tiles] in `_units`): their forward (`_tiled`) fetches their
        # tiles one by one; the hooks here only count their uses and prefetch their first tile.
        self.tiled = tiled or {}
        self.runtime = UnitRuntime(units, store, grads, stats, transport, gather=gather, admission=admission,
                                   on_unit_final=on_unit_final, keep_grad=keep_grad)  # fmt: skip
        self.prefetcher = Prefetcher(self.runtime, module_units, self.tiled, depth=depth, prefetch_bytes=prefetch_bytes,
                                     keep=keep, keep_limit=keep_limit, device_budget=device_budget)  # fmt: skip
        self.always_ready = self.runtime.always_ready
        # Where the hooks below go, and their handles: `install` is ``hooks.install(root)``.
        self.hooks = ModuleHooks(units, module_units, self.tiled, always_ready=self.always_ready, scheduler=self,
                                 fns=PassHooks(root_pre=self._root_pre_hook, root_post=self._root_post_hook,
                                               container_pre=self._container_pre_hook,
                                               sub_root_post=self._sub_root_post_hook,
                                               pre_forward=self._pre_forward_hook, call_over=self._call_over_hook,
                                               post_forward=self._post_forward_hook,
                                               grad=functools.partial(_weak_grad_hook, self)))  # fmt: skip
        self.state = TrainingState.IDLE
        # Per module, its units no gradient comes to (every parameter frozen): [Note: frozen
        # units in backward].
        self._frozen = {m: [u for u in us if not u.trainable]
                        for m, us in module_units.items() if m not in self.tiled}  # fmt: skip
        # Per module, grad-enabled calls whose gradient uses were counted in forward, and calls
        # run again inside backward (activation checkpointing): a reentrant checkpoint's first
        # forward runs without grad, so its uses are counted when backward runs it again.
        self._calls: dict[nn.Module, int] = {}
        self._recomputed: dict[nn.Module, int] = {}
        self._depth = 0  # nested calls of the root module
        self._began = False  # the outermost root call set up the pass
        self._saved_hooks = None  # the saved-tensor hooks of the pass, while the root runs
        self._sub_root: nn.Module | None = None  # a submodule whose call is the pass: [Note: passes begun by a submodule]
        self._sub_root_calls = 0  # its calls open (it may call itself)
        self.saved = SavedTensors()  # what they hand saved tensors to: parameter views first
        self.saved.add(self._pack_view, self.runtime.unpack_view)
        # `_activations.ActivationTier` (None: activations stay where autograd keeps them): the
        # saved tensors parameter views do not take; a listener of the passes, first.
        if activations is not None:
            self.saved.add(activations.pack, activations.unpack)
        self.listeners = ((activations,) if activations is not None else ()) + tuple(listeners)
        self.owner = owner  # the engine's `_owner.Owner`: a root call is an entry point (None: no check)
        self._before_forward = before_forward  # the engine's checks, before each pass (None: none)
        self._after_backward = after_backward  # the engine's end of a backward pass (None: none)

    # -- hooks (`_hooks.ModuleHooks` registers them) -----------------------------------------
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
            if self._before_forward is not None:
                self._before_forward()
            self.begin_forward(module)
            self._began = True
            if self.always_ready and self.state is TrainingState.IDLE and torch.is_grad_enabled():
                for unit, hooked in self.hooks.hooked_grads:  # see [Note: always-ready units' uses]
                    unit.uses = hooked
            # See [Note: saved parameter views].
            # Units always bound are never placeholders nor moved: with no other handler (the
            # activation tier), nothing to do for a saved tensor.
            if not (self.always_ready and len(self.saved.handlers) == 1):
                # Run eagerly as the module hooks are: dynamo compiled them (and the pool code the
                # activation tier's pack calls) where a compiled forward breaks its graph, and
                # failed on its own guard ("Guard failed on the same frame it was created").
                self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(eager(self.saved.pack),
                                                                             eager(self.saved.unpack))  # fmt: skip
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
            if torch.is_grad_enabled() and any(u.trainable for u in self.units) and output is not None:
                # The root's outputs get their gradients first in a backward pass, in its outermost
                # graph task (also with reentrant checkpointing inside): the end of the pass is
                # queued from there, so ``loss.backward()`` alone ends it as ``engine.backward`` does.
                _each_tensor(output, lambda t: _on_grad(t, self.backward_started), objects=True)
        finally:
            hooks, self._saved_hooks = self._saved_hooks, None
            if hooks is not None:
                hooks.__exit__(None, None, None)
            self.end_forward()
            if not torch.is_grad_enabled():
                # What this forward fetched goes back; the uses of a backward still due stand (a
                # no-grad forward between a forward and its backward, as in an eval inside a step).
                self.release_all(keep_uses=self.state is TrainingState.BACKWARD_DUE)
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
        self._depth, self._began, self._saved_hooks, self._sub_root = 0, False, None, None
        if self.owner is not None:
            self.owner.exit(depth)  # the entries of the root calls left
        if began and hooks is not None:
            hooks.__exit__(None, None, None)
        for unit in self.units:
            unit.active = 0  # their modules' post-hooks never ran
            self.runtime.release(unit)

    def backward_started(self) -> None:
        if self.state is TrainingState.IDLE and not self.always_ready:
            # No forward since the last backward ended, which released its units: a retained graph.
            raise RuntimeError(SECOND_BACKWARD)
        if self.state is not TrainingState.BACKWARD:
            self.state = TrainingState.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self.state = TrainingState.BACKWARD_DUE  # the callback ran: ended by what follows
        if self._after_backward is not None:
            self._after_backward()

    @property
    def backward_lost(self) -> bool:
        """A backward began (its end queued with autograd) and raised: a plain
        ``loss.backward()`` (``engine.backward`` ends its own), whose end never runs. Its
        units hold part of its gradients, and the pass it began is still open: the next
        forward would be taken for a recomputation inside it. `forget_backward` ends it."""
        return self.state is TrainingState.BACKWARD and _graph_task() == -1

    @property
    def in_backward(self) -> bool:
        """A grad-enabled pass ran and its backward has not ended."""
        return self.state is not TrainingState.IDLE

    def _container_pre_hook(self, module, args):
        if self._sub_root is not None and self._depth and not self._outer_call_live(self._sub_root):
            self.end_interrupted_pass()  # a submodule's pass a KeyboardInterrupt left
        if not self._depth and self.state is not TrainingState.BACKWARD:
            # Called outside a root call: its call is a pass ([Note: passes begun by a submodule]).
            self._sub_root, self._sub_root_calls = module, 1  # first: its post-hook ends it, also if this raises
            self._root_pre_hook(module, args)
        elif module is self._sub_root:
            self._sub_root_calls += 1

    def _pre_forward_hook(self, module, args):
        self._container_pre_hook(module, args)
        pos = self.prefetcher.forward_arrived(module)
        for unit in self._held(module):
            self.runtime.materialize(unit)
            unit.active += 1
        self.prefetcher.ahead(pos)

    def _call_over_hook(self, module, args, output):
        """The module's call is over (``always_call``: also when its forward raised): the units
        its pre-hook counted active are not. torch's non-reentrant checkpoint stops a
        recomputation by raising inside the module whose saved tensors it needs last: that
        module's units stayed active, never released until backward ended, one unit more held
        per recomputed block, and backward ran out of a host budget initialize had accepted (an
        audit helper's repro)."""
        for unit in self._held(module):
            unit.active -= 1
        return output

    def _post_forward_hook(self, module, args, output):
        units = self.module_units[module]
        if self.state is not TrainingState.IDLE:
            # A forward recomputed inside backward (activation checkpointing): its units stay
            # until their gradients arrive. Its uses were counted by the first forward, unless
            # that ran without grad (reentrant checkpointing): then they are counted now.
            if torch.is_grad_enabled():
                self._recomputed[module] = self._recomputed.get(module, 0) + 1
                if self._recomputed[module] > self._calls.get(module, 0):
                    for unit, uses in self.hooks.uses_per_call[module]:
                        unit.uses += uses
                    self._release_frozen_after(module, args)  # (a reentrant checkpoint's graph is this one)
            return output
        if not self.always_ready and units:
            output = _off_units(module, units, output)
        if torch.is_grad_enabled():
            self._calls[module] = self._calls.get(module, 0) + 1
            for unit, uses in self.hooks.uses_per_call[module]:
                unit.uses += uses
            if not self.always_ready and units:
                # (Units always bound need no fetch in backward: no hook. Frozen units are
                # fetched too: backward through their module needs their weights.)
                # The gradient of an output arrives just before the module's own backward runs.
                # A hook on the tensor (not an identity Function, whose output would be a view
                # that the model may not change in place) says so.
                _each_tensor(output, lambda t: _on_grad(t, functools.partial(self.pre_backward, module)))
                self._release_frozen_after(module, args)
        if not self.always_ready:  # kept for backward or released: never where always bound
            for unit in units:
                self.prefetcher.after_forward(unit)
        return output

    def _sub_root_post_hook(self, module, args, output):
        """Ends the pass a submodule's call began (``always_call``: also when it raised)."""
        if module is not self._sub_root:
            return output  # a call inside a pass (the root's, or a submodule's nested call)
        self._sub_root_calls -= 1
        if self._sub_root_calls:
            return output  # it called itself: the outer call goes on
        self._sub_root = None
        return self._root_post_hook(module, args, output)

    def _release_frozen_after(self, module: nn.Module, args) -> None:
        """[Note: frozen units in backward]
        A unit is released in backward when its last gradient arrives; a unit of frozen
        parameters gets none, so one that backward fetched (its weights compute the gradient of
        the module's input: the base layers of a LoRA model) stayed bound until backward ended,
        and backward held the whole frozen base in the host pool: PoolExhausted at a budget
        initialize had accepted, where the same model with every parameter trainable stepped
        (an audit helper's repro). Such units are released once the gradient of one of the
        call's inputs is computed, which is when the module's backward has used them; a saved
        weight read after that (a module whose backward goes on past one of its inputs) is
        fetched again (`unpack_view`). A call whose inputs need no gradient has none computed
        through its frozen weights, so backward never fetches them."""
        frozen = self._frozen.get(module)
        if not frozen:
            return
        done = []

        def release() -> None:
            if not done:  # the first of the call's inputs
                done.append(True)
                for unit in frozen:
                    self.runtime.release(unit)

        _each_tensor(args, lambda t: _on_grad(t, release))

    def pre_backward(self, module: nn.Module) -> None:
        # Several outputs of one call each run this; the first materialises, the rest find it ready.
        pos = self.prefetcher.backward_arrived(module)
        for unit in self._held(module):
            self.prefetcher.take_kept(unit)
            self.runtime.materialize(unit)
        self.prefetcher.ahead(pos, backward=True)

    def _held(self, module: nn.Module) -> list[ParamUnit]:
        """The units ``module``'s hooks fetch and hold around it: none for a tiled module."""
        return [] if module in self.tiled else self.module_units[module]

    # -- passes -----------------------------------------------------------------------------
    def begin_forward(self, root: nn.Module) -> None:
        for listener in self.listeners:
            listener.begin_forward()
        self.prefetcher.begin_forward(root)

    def end_forward(self) -> None:
        due = torch.is_grad_enabled()
        if due and self.state is TrainingState.IDLE:
            self.state = TrainingState.BACKWARD_DUE
        if self.listeners:
            expected = [u for u in self.units if u.uses > 0] if due else None
            for listener in self.listeners:
                listener.end_forward(expected)
        self.prefetcher.end_forward(backward_due=due)

    def end_backward(self) -> None:
        """Gradients not yet handed on (a unit whose uses never reached zero: activation
        recomputation runs a forward twice) are handed on now; every unit is released.
        The pass ends even when handing on fails (the first error is raised after)."""
        try:
            for unit in self.units:
                if unit.grad is not None or unit.uses:
                    self.runtime.finish_unit_backward(unit)
            with traffic(self.runtime.pool, GRAD):  # what the last landings read to add to: backward's
                self.runtime.grads.land()  # see [Note: gradients copied back] in `_grads`
        finally:
            for listener in self.listeners:
                listener.end_backward()
            self.runtime.drop_grads()
            for unit in self.units:
                unit.active = 0
                self.runtime.release(unit)
            self.prefetcher.end_backward()
            # Also where a backward raised (a Ctrl-C in a hook): it never runs the callback it queued.
            self.state = TrainingState.IDLE
            self._calls.clear()
            self._recomputed.clear()
            self.runtime.transport.drain()

    def forget_backward(self) -> None:
        """Forget this step's gradients still in units and parameters (zero_grad, a load), and
        end a backward that began and never ended: a plain ``loss.backward()`` that raised (a
        Ctrl-C in a hook) never runs the end it queued, and the next would queue none."""
        # A backward due (its forward ended, it has not begun) still comes: the uses its forward
        # counted stand, as zero_grad between a forward and its backward leaves that backward
        # whole in plain PyTorch (forgotten, the first gradient of a unit of several parameters
        # was taken for its last, and the unit released under the rest).
        self.runtime.drop_grads(keep_uses=self.state is TrainingState.BACKWARD_DUE)
        if self.state is TrainingState.BACKWARD:
            self.end_backward()

    # -- saved tensors: see [Note: saved parameter views] -------------------------------------
    def _pack_view(self, t: torch.Tensor):
        _placeholder.refuse_placeholder(t)  # see [Note: reads outside a module]
        return self.runtime.pack_view(t)

    # -- release ----------------------------------------------------------------------------
    def release_all(self, keep_uses: bool = False) -> None:
        """Release every unit and forget the gradient uses still expected: a forward whose
        backward has not run (a loss computed and dropped before a save) is forgotten with them,
        or the next forward, taken for its recomputation, would count no uses and its units
        would be released under their own backward. With ``keep_uses`` (the end of a no-grad
        forward while a backward is due) the units that backward uses stay, and it stays due."""
        for unit in self.units:
            self.runtime.drop_fetch(unit)
            unit.active = 0
            if not keep_uses:
                unit.uses = 0
            self.runtime.release(unit)
        if keep_uses:
            return
        if self.state is TrainingState.BACKWARD_DUE:  # a backward that began ends as it does
            self.state = TrainingState.IDLE
        self.prefetcher.end_backward()
        self._calls.clear()
        self._recomputed.clear()

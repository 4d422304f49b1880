"""Parameters used outside their modules: gathering them, and refusing a read of a placeholder.

Owns: `GatheredParameters`, which materialises parameters for use outside their modules'
forwards (the class a released parameter has, whose reads of data are refused, is
`_placeholder`'s).
Touches: the engine's units and `Scheduler` (materialise, release, the gradient hand-off), the
parameters' ``.data`` and class.

[Note: reads outside a module]
A released parameter is an empty placeholder; the engine materialises it only around the
forward and backward of the module that holds it. A model that reads a weight elsewhere
(TRL's fused LM head multiplies the hidden states by ``lm_head.weight`` itself, never calling
``lm_head``) would compute with the empty tensor: a vocabulary of 0 rows, then a size mismatch
deep in backward, or a wrong result with no error at all. So:

- A released parameter's class is a subclass of its own whose ``__torch_function__`` refuses
  every operation that reads its data, naming the parameter and the way out; its metadata
  (dtype, device, shape, ``requires_grad``, hooks) stays readable, since transformers, peft,
  accelerate and the engine itself read those of released parameters. Autograd saving one for
  backward is refused too (`refuse_placeholder`, from the saved-tensor hook): a Function may
  save a weight it read nothing of in forward (a loop over 0 rows).
- `GatheredParameters` (as ``deepspeed.zero.GatheredParameters``) materialises them for the
  context: a whole unit is fetched and held; a tiled parameter (see [Note: tiles]) is
  assembled from its tiles into one tensor of its own. Inside the model's forward with grad
  enabled, each gathered trainable parameter counts one more gradient for its units, so the
  gradient autograd accumulates into it reaches the engine's accumulation as if its module
  had run (a tiled one's is cut into its tiles' rows). A saved view of a whole unit is kept by
  position as always ([Note: saved parameter views]); one of an assembled tensor is assembled
  again in backward.

[Note: gathers across passes]
What a context gathers stays whole until its exit, whatever runs inside: nested contexts of
one tiled parameter share one assembled tensor (`_hold_assembled`), and a whole unit a context
holds (``ParamUnit.gathers``) is not released by `Scheduler.release`, so the end of a forward
without grad or of a backward inside leaves it bound (before, they released it, and
``p.detach()``, which a placeholder allows as metadata, read an empty tensor with no error). A
held unit is not fetched again, and an assembled tensor is a copy: a step or a load inside
would leave them their old values, and a forward inside would compute with them, so those
are refused while a context of the engine is open (`refuse_open`); closing the engine
releases everything (`end_open`).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from . import _resources
from ._interrupts import held_interrupts
from ._placeholder import bind_param, is_placeholder, release_param
from ._sizes import grad_of, set_grad
from ._units import holders

class _Assembled:
    """A saved view of a tiled parameter assembled by a gather: assembled again to unpack."""

    __slots__ = ("scheduler", "pieces", "offset", "size", "stride")

    def __init__(self, scheduler, pieces, offset, size, stride):
        self.scheduler, self.pieces, self.offset, self.size, self.stride = scheduler, pieces, offset, size, stride


def _assemble(scheduler, pieces) -> torch.Tensor:
    """A tiled parameter whole, from its tiles (``pieces``: (tile, index) in row order), each
    fetched and released in turn."""
    full = None
    for unit, i in pieces:
        scheduler.runtime.materialize(unit)
        try:
            piece = unit.piece(i)
            if full is None:
                full = torch.empty(unit.records[i].full_shape, dtype=piece.dtype, device=piece.device)
            full[unit.rows[0] : unit.rows[1]].copy_(piece)
        finally:
            scheduler.runtime.release(unit, after_forward=True)
    return full


def _hook(scheduler, p: nn.Parameter, pieces) -> None:
    """Once per parameter and engine: the hooks that take a gathered parameter's gradient.

    Autograd accumulates a leaf's gradient into a tensor laid out as the leaf (``p.grad`` in
    ``p``'s shape), and by then ``p`` may be a placeholder again: an assembled tiled parameter
    always is, a whole unit is when backward did not read it. The hook before accumulation
    gives ``p`` a stand-in of the gradient's shape that takes no memory (stride 0); the one
    after hands the gradient on (a tiled parameter's rows to each tile; a whole unit's goes
    through the engine's own hook, registered first) and puts the placeholder back."""
    ref = weakref.ref(scheduler)
    stood_in = []

    def before(grad):
        # None: a Function that took ``p`` gave it no gradient, and autograd runs a leaf's
        # hooks for that too. These hooks stay for every later backward: one that took None
        # for a gradient would fail them all (a tiled module's Function used to be such a one:
        # [Note: no autograd edge to a tiled parameter] in `_tiled`).
        if grad is not None and p.shape != grad.shape:
            with held_interrupts:
                p.data = grad.new_empty(()).expand(grad.shape)
                stood_in.append(True)

    def after(param):
        live = ref()
        if pieces[0][0].is_tile:
            grad = grad_of(param)
            set_grad(param, None)
            if live is not None and grad is not None:
                for unit, i in pieces:
                    live.runtime.tile_grad(unit, i, grad[unit.rows[0] : unit.rows[1]])
        if stood_in:
            stood_in.clear()
            unit, i = pieces[0]
            if unit.is_tile or unit.full is None:
                _replace(param, unit, i)
            else:  # bound meanwhile (fetched for its grad's hand-off): its view again
                unit.bind(unit.full)

    with torch._C.DisableTorchFunctionSubclass():  # the engine's own, on a tiled one too
        scheduler.hooks.add(torch.Tensor.register_hook(p, before))
        scheduler.hooks.add(torch.Tensor.register_post_accumulate_grad_hook(p, after))


_hooked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # scheduler -> ids of hooked parameters


class GatheredParameters:
    """Materialise ``params`` (parameters an infinity engine holds) for use outside their
    modules' forwards, for the duration of the context, as ``deepspeed.zero.GatheredParameters``.

    Tensors no open engine holds (and None) are left alone. Inside the model's forward with
    grad enabled, a gathered parameter may be used in the loss: its gradient reaches the
    engine's accumulation as if its module had run. Contexts nest, and passes may run inside:
    what a context gathered stays whole until its exit; a step or a load inside is refused
    ([Note: gathers across passes]). It is for reading: a write to the values inside is
    refused at the exit (`_written_inside`; ``modifier_rank`` must be None). With several ranks at ZeRO stage 3 every
    rank enters it for the same parameters: materialising is an all-gather. ``fwd_module`` is
    DeepSpeed's and has no use here."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled: bool = True):
        if modifier_rank is not None:
            raise ValueError(f"{modifier_rank=}: writes to gathered parameters are not written back to the tiers "
                             "(and refused at the context's exit); pass modifier_rank=None to read them, and load new "
                             "values with engine.module.load_state_dict")  # fmt: skip
        if isinstance(params, torch.Tensor):
            params = [params]
        seen, self._params = set(), []
        for p in params if enabled else ():
            if isinstance(p, torch.Tensor) and id(p) not in seen:
                seen.add(id(p))
                self._params.append(p)
        self._stack: contextlib.ExitStack | None = None
        self._versions: list = []

    def __enter__(self):
        stack = contextlib.ExitStack()
        gathered = []
        try:
            for engine, params in _by_engine(self._params):
                self._gather(stack, engine, params)
                gathered += params
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        # Each parameter's version as gathered: a write inside changes it (see `__exit__`).
        self._versions = [(p, p._version) for p in gathered]
        return self

    def __exit__(self, *exc):
        stack, self._stack = self._stack, None
        written = [p for p, version in self._versions if p._version != version]
        self._versions = []
        if stack is not None:
            stack.close()
        if written and exc[0] is None:
            raise RuntimeError(_written_inside(written))
        return False

    @staticmethod
    def _gather(stack: contextlib.ExitStack, engine, params) -> None:
        engine._life.check_open()
        engine._owner.enter("GatheredParameters")
        stack.callback(engine._owner.exit)

        scheduler = engine.scheduler
        where = holders(engine.units)
        # A gradient through a gathered parameter is one more for its units in this backward.
        counts = torch.is_grad_enabled() and scheduler.in_forward and not scheduler.in_backward
        assembled: dict[int, tuple] = {}  # storage address -> (scheduler, pieces) of an assembled parameter
        for p in params:
            pieces = where[id(p)]
            unit, i = pieces[0]
            if not unit.is_tile:
                scheduler.runtime.materialize(unit)
                with held_interrupts:
                    unit.gathers += 1
                    stack.callback(_let_go, scheduler, unit)
            else:
                full = _hold_assembled(stack, scheduler, p, pieces)
                assembled[full.untyped_storage().data_ptr()] = (scheduler, pieces)
            if unit.records[i].requires_grad and id(p) not in _hooked.setdefault(scheduler, set()):
                _hooked[scheduler].add(id(p))
                _hook(scheduler, p, pieces)
            if counts:
                for u, k in pieces:
                    u.uses += int(u.records[k].requires_grad)
        if assembled:
            hooks = torch.autograd.graph.saved_tensors_hooks(
                lambda t: _pack(scheduler, assembled, t), lambda s: _unpack(scheduler, s))
            stack.enter_context(hooks)


def _written_inside(params) -> str:
    """Writes inside a context are not the engine's to keep or drop: where the parameter is
    gathered into its unit's memory they reached the copy the next forward computes with but
    not the master weights (0.83 off and, a step later, 0.017 from either outcome), where it
    is bound they were kept, where it is assembled from tiles dropped (an audit helper's
    repros). DeepSpeed drops them at the exit with modifier_rank=None; refused, so that no run
    trains on one of those unsaid."""
    names = ", ".join(repr(getattr(p, "_infinity_name", "?")) for p in params[:3]) + (" ..." if len(params) > 3 else "")
    return (f"parameter(s) {names} written in place inside infinity.GatheredParameters: the "
            "engine neither keeps nor drops such a write for sure (some of its copies of the weights have it, others "
            "not), so they are now undefined. Load the values you mean with engine.module.load_state_dict (or "
            "engine.load_checkpoint) outside the context; read-only use inside is what it is for")


def _let_go(scheduler, unit) -> None:
    with held_interrupts:
        unit.gathers = max(unit.gathers - 1, 0)  # the engine's close zeroes it (`end_open`)
        scheduler.runtime.release(unit, after_forward=True)


def _open_names(engine) -> list[str]:
    """The parameters of ``engine`` that open GatheredParameters contexts hold."""
    names = []
    for unit in engine.units:
        if not (unit.gathers if not unit.is_tile else _assembled_open):  # (asked before every step)
            continue
        for i, p in enumerate(unit.params):
            if (unit.gathers if not unit.is_tile else _open_on(p)) and unit.qualified_name(i) not in names:
                names.append(unit.qualified_name(i))
    return names


def holds(unit, i: int) -> bool:
    """Whether an open GatheredParameters context holds parameter ``i`` of ``unit`` whole."""
    return unit.gathers > 0 if not unit.is_tile else _open_on(unit.records[i].param) > 0


def refuse_open(engine, what: str) -> None:
    """Raise if GatheredParameters contexts of ``engine`` are open: ``what`` (a step, a load)
    changes the values they hold, and they would keep the old ones (a whole unit stays bound
    to them, and the forwards that follow inside would compute with them: [Note: gathers
    across passes])."""
    names = _open_names(engine)
    if names:
        raise RuntimeError(f"{what} while GatheredParameters holds {names}: they would keep their values from "
                           "before it, and forwards inside the context would compute with them; exit the context "
                           "first")  # fmt: skip


def end_open(engine) -> None:
    """The engine closes: the units open contexts hold are released with the rest (their
    memory goes with the engine's); the contexts' exits find them released."""
    for unit in engine.units:
        unit.gathers = 0


# id(tiled parameter) -> (the parameter, weakly; the GatheredParameters contexts open on it),
# while any is: see `_hold_assembled`.
_assembled_open: dict[int, tuple[weakref.ref, int]] = {}


def _open_on(p: nn.Parameter) -> int:
    ref, n = _assembled_open.get(id(p), (None, 0))
    return n if ref is not None and ref() is p else 0


def _hold_assembled(stack: contextlib.ExitStack, scheduler, p: nn.Parameter, pieces) -> torch.Tensor:
    """``p`` (tiled) whole until ``stack`` closes; its whole tensor. Nested contexts share one
    assembled tensor: the outermost assembles it and the last to exit puts the placeholder
    back, so an inner context's exit leaves ``p`` whole in the ones still open (replacing it
    there would leave them an empty tensor, which ``p.detach()`` reads without a refusal)."""
    unit, i = pieces[0]
    n = _open_on(p)
    full = _assemble(scheduler, pieces) if n == 0 else None
    with held_interrupts:
        if full is not None:
            p.data = full
            bind_param(p)
        _assembled_open[id(p)] = (weakref.ref(p), n + 1)
        stack.callback(_let_go_assembled, p, unit, i)
    return p.data


def _let_go_assembled(p: nn.Parameter, unit, i: int) -> None:
    with held_interrupts:
        n = _open_on(p) - 1
        if n > 0:
            _assembled_open[id(p)] = (weakref.ref(p), n)
        else:
            _assembled_open.pop(id(p), None)
            _replace(p, unit, i)


def _replace(p: nn.Parameter, unit, i: int) -> None:
    """An assembled parameter back to its placeholder (see `ParamUnit.unbind`)."""
    empty = torch.empty(0, dtype=unit.placeholder_dtype or p.dtype, device=unit.placeholder_device or p.device)
    p.data = empty
    release_param(p, unit.qualified_name(i))


def _pack(scheduler, assembled, t):
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return scheduler.saved.pack(t)
    if ptr in assembled:
        owner, pieces = assembled[ptr]
        return _Assembled(owner, pieces, t.storage_offset(), t.size(), t.stride())
    return scheduler.saved.pack(t)


def _unpack(scheduler, saved):
    if not isinstance(saved, _Assembled):
        return scheduler.saved.unpack(saved)
    full = _assemble(saved.scheduler, saved.pieces)
    return full.as_strided(saved.size, saved.stride, saved.offset)


def _by_engine(params):
    """(engine, its parameters among ``params``) for each open engine holding some; a
    placeholder no open engine holds is refused (its engine was closed)."""
    engines = [e for e in list(_resources._OPEN) if getattr(e, "_managed", None) is not None]
    out = []
    for engine in engines:
        mine = [p for p in params if id(p) in engine._managed]
        if mine:
            out.append((engine, mine))
    held = {id(p) for _, mine in out for p in mine}
    for p in params:
        if id(p) not in held and is_placeholder(p):
            raise RuntimeError(f"parameter {getattr(p, '_infinity_name', '?')!r} belongs to an infinity engine that "
                               "is closed: its values are gone from memory (load them from a checkpoint or export)")  # fmt: skip
    return out

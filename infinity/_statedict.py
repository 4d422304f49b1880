"""The module's own ``state_dict()`` and ``load_state_dict()`` while its parameters live in tiers.

Owns: the hooks on the user's module, and on each submodule holding a managed parameter, that
make the two calls mean what they mean in plain PyTorch, called on the root or on a submodule.
``load_state_dict(sd)`` takes each managed parameter's value out of ``sd`` and writes it into
the tiers (the fp32 master weights and the low-precision parameters; optimizer states
are left as they are, as torch leaves an optimizer's); the rest loads as usual, and a missing,
unexpected or mis-shaped key is reported as torch reports it. ``state_dict()`` gives every
managed parameter's weights (the fp32 masters in the parameter's own dtype) instead of its
empty placeholder. Touches: the units, `Engine.unit_weights`, `engine.optimizer.load_master` (`load_weights`).

[Note: state_dict at several ranks]
The weights are sharded over the ranks at every stage (the fp32 masters are the optimizer's
state, partitioned from stage 1 on), so ``state_dict()`` at several ranks is a collective, as
torch's ``get_model_state_dict`` with ``full_state_dict=True, cpu_offload=True`` (FSDP's
FULL_STATE_DICT with ``rank0_only``) is: every rank must call it, one unit at a time is gathered
to rank 0, and rank 0 gets the full dict (on the CPU) while every other rank gets an empty one
(its entries of the module removed), so no rank but the writer holds the model. ``keep_vars=True`` gives
the placeholders, gathers nothing, and is not a collective. A call that only some ranks make
(DDP's ``if rank == 0: torch.save(model.state_dict(), ...)``) is refused with the ranks that did
not come, after ``partition.timeout``, before any gather (`Dist.meet`). To write the weights without
holding them, `Engine.save_pretrained` and `Engine.export` stream them to rank 0's files.

Inside a GatheredParameters context that holds every parameter the call reads, every rank has
them whole already: ``state_dict()`` is no collective there and gives them on every rank, as
they compute (in the dtype the model was made in; with a lower ``precision.param_dtype``, its
rounding of the masters), copied out of the context's memory to the CPU. That is DeepSpeed's idiom, ``with
GatheredParameters(model.parameters()): if rank == 0: torch.save(model.state_dict(), ...)``,
refused after the timeout before (an audit helper's repro: rank 1 got an empty dict, and rank 0
alone waited for it).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from . import _gather
from ._owner import entry
from ._units import holders


def parameter_keys(engine) -> dict:
    """Every state_dict key of a parameter ``engine`` manages -> its pieces, [(unit, index in
    the unit)]: one, or a tiled parameter's tiles in row order; tied weights have several keys."""
    return dict(engine._state_hooks.names)


@entry("load_weights")
def load_weights(engine, values: dict) -> None:
    """New weights (``(unit index, parameter index) -> tensor``) into ``engine``'s tiers."""
    engine._life.check_usable()
    if engine.grads.has_grad:
        raise RuntimeError("load_state_dict between backward and step: call step() or zero_grad() first")
    _gather.refuse_open(engine, "load_state_dict")
    engine.scheduler.release_all()
    engine._writes.carry()  # the parameters this load leaves as they are keep what was written into them
    engine.optimizer.load_master(values)


class StateDictHooks:
    """The hooks on every module that holds a managed parameter, the root's and each
    submodule's: ``engine.module.layers[3].load_state_dict(sd)`` and its ``state_dict()`` mean
    what they mean in plain PyTorch too (before, only the root's calls did: a submodule's gave
    the empty placeholders, or loaded values that the next step undid). In one call, the
    outermost module's hooks do the work for everything below it (the nested modules' hooks
    find that call and leave it): one load of the masters, one gather of the weights."""

    def __init__(self, engine, module: nn.Module):
        self.engine = engine
        where = holders(engine.units)
        # Every name of every managed parameter (tied weights: several names, one parameter),
        # with the (unit, index) pieces that hold it (a tiled one: one per tile, in row order).
        self.names = [(name, where[id(p)]) for name, p in module.named_parameters(remove_duplicate=False)
                      if id(p) in where]  # fmt: skip
        self._consumed: set[str] = set()
        # The load being handled: its outermost module, and the call's missing_keys list, which
        # every module of one load_state_dict shares.
        self._loading: tuple | None = None
        # The state_dict calls under way: (outermost module, prefix), the innermost call last.
        self._saving: list[tuple] = []
        self._placeholders = 0  # open `placeholders()` contexts: state_dict() gathers nothing
        self._paths: dict[int, list[str]] = {}  # id(module) -> its paths in the root (shared: several)
        for path, sub in module.named_modules(remove_duplicate=False):
            self._paths.setdefault(id(sub), []).append(path)
        # Each module's names below it, in one pass over the names (a name under every module
        # on its path; a module registered twice: under its first path, whose subtree is the same).
        first = dict(module.named_modules())  # path -> module, each module at its first path
        below: dict[str, list] = {}
        for name, pieces in self.names:
            parts = name.split(".")
            for k in range(len(parts)):
                path = ".".join(parts[:k])
                if path in first:
                    below.setdefault(path, []).append((".".join(parts[k:]), pieces))
        self.handles = []
        for path, names in below.items():
            sub = first[path]
            self.handles += [
                sub.register_load_state_dict_pre_hook(functools.partial(self._before_load, names)),
                sub.register_load_state_dict_post_hook(self._after_load),
                sub.register_state_dict_pre_hook(self._before_state_dict),
                sub.register_state_dict_post_hook(functools.partial(self._after_state_dict, names)),
            ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # -- load_state_dict --------------------------------------------------------------------
    def _before_load(self, names, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                     error_msgs) -> None:  # fmt: skip
        if self._loading is not None and self._loading[1] is missing_keys:
            return  # a module inside the call's outermost one, whose hook took every key below it
        self._loading = (module, missing_keys)
        values, consumed, bad = {}, set(), False
        for name, pieces in names:
            key = prefix + name
            if key not in state_dict:
                continue
            value = state_dict.pop(key)
            consumed.add(key)
            unit, i = pieces[0]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != unit.records[i].full_shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {shape} from checkpoint, "
                                  f"the shape in current model is {torch.Size(unit.records[i].full_shape)}.")  # fmt: skip
                bad = True
                continue
            for unit, i in pieces:  # tied weights given twice: the last key wins, as in torch
                values[(unit.index, i)] = value
        self._consumed = consumed
        engine = self.engine
        if engine.world_size > 1:
            # Each rank writes its own slices from what it was given: a rank given none of the
            # weights (the DDP idiom's state_dict() leaves the others an empty dict) would leave
            # its slices as they were, a model half loaded, silently.
            engine.dist.meet("load_state_dict", "load_state_dict() of a module whose weights are sharded over the ranks")
            engine.dist.agree_text(",".join(sorted(consumed)), "load_state_dict() at several ranks: every rank "
                                   "passes the same weights (state_dict() gives them to rank 0 only: load them "
                                   "from a file on every rank, or broadcast them); the keys given")  # fmt: skip
        if values and not bad:
            load_weights(engine, values)

    def _after_load(self, module, incompatible_keys) -> None:
        if self._loading is None or self._loading[0] is not module or self._loading[1] is not incompatible_keys.missing_keys:
            return  # (post hooks run innermost first: the outermost module's comes last)
        # The keys taken above were loaded into the tiers: they are not missing.
        incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in self._consumed]
        self._consumed = set()
        self._loading = None

    # -- state_dict -------------------------------------------------------------------------
    def _before_state_dict(self, module, prefix, keep_vars) -> None:
        if not self._saving or not self._inside(module, prefix):
            self._saving.append((module, prefix))  # a call's outermost module: its post hook, the last, gathers

    def _inside(self, module, prefix) -> bool:
        """Whether ``module``'s state_dict at ``prefix`` is a part of the call on top of
        `_saving`: below its module, at the prefix torch gives a child (``outer.`` and the path
        between; a module registered at several paths: any). An entry an error left on the
        stack is so passed over by the next call, which has no such prefix."""
        outer, outer_prefix = self._saving[-1]
        if module is outer:
            return False
        for top in self._paths[id(outer)]:
            for mine in self._paths[id(module)]:
                if top == "" or mine.startswith(top + "."):
                    if prefix == outer_prefix + (mine if top == "" else mine[len(top) + 1 :]) + ".":
                        return True
        return False

    @contextlib.contextmanager
    def placeholders(self):
        """Inside, ``state_dict()`` gives the placeholders (detached), gathers nothing and is no
        collective: for a caller that reads only its keys, on one rank (peft's save, given the
        values by `integrations._peft`, reads a ``modules_to_save`` copy's keys from its own
        ``state_dict()``, on rank 0 alone: a gather no other rank joined)."""
        self._placeholders += 1
        try:
            yield
        finally:
            self._placeholders -= 1

    def _after_state_dict(self, names, module, state_dict, prefix, local_metadata) -> None:
        if not self._saving or self._saving[-1][0] is not module or self._saving[-1][1] != prefix:
            return  # a module inside the call's outermost one, whose hook gathers every weight below it
        self._saving.pop()
        keys = [(prefix + name, pieces) for name, pieces in names if prefix + name in state_dict]
        if not keys or isinstance(state_dict[keys[0][0]], nn.Parameter) or self._placeholders:
            return  # keep_vars=True (the parameters), or inside `placeholders()`
        engine = self.engine
        if all(_gather.holds(unit, j) for _, pieces in keys for unit, j in pieces[:1]):
            copies: dict[int, torch.Tensor] = {}  # id(pieces) -> its copy: tied keys share one, as torch's do
            for key, pieces in keys:  # (a copy: the context's memory goes back at its exit)
                unit, j = pieces[0]
                if id(pieces) not in copies:  # on the CPU, as the gathered path gives them (not a second model on a GPU)
                    copies[id(pieces)] = state_dict[key].to("cpu", unit.records[j].dtype, copy=True)
                state_dict[key] = copies[id(pieces)]
            return
        engine.dist.meet("state_dict", "state_dict() of a module whose weights are sharded over the ranks")
        if engine.world_size > 1 and engine.rank != 0:
            # [Note: state_dict at several ranks]: this rank only sends its shards.
            for key in [k for k in state_dict if k.startswith(prefix)]:
                del state_dict[key]
        for key, whole in _gathered(engine, keys):
            state_dict[key] = whole


def state_dict_of(engine, keys) -> dict:
    """What ``engine.module.state_dict()`` gives for ``keys`` alone (the root's keys): a
    collective as it is ([Note: state_dict at several ranks]: rank 0 gets them, the others an
    empty dict), reading only the units those keys lie in. A PEFT model's adapters are so saved
    without its frozen base in memory (`integrations._peft`)."""
    keys = set(keys)
    module, managed = engine.module, parameter_keys(engine)
    engine.dist.meet("state_dict", "state_dict() of a module whose weights are sharded over the ranks")
    out = {}
    if engine.world_size == 1 or engine.rank == 0:
        out = {k: v.detach() for k, v in module.state_dict(keep_vars=True).items() if k in keys and k not in managed}
    wanted = [(k, managed[k]) for k in managed if k in keys]
    units = {unit.index for _, pieces in wanted for unit, _ in pieces}
    for key, whole in _gathered(engine, wanted, units):
        out[key] = whole
    return out


def _gathered(engine, keys, units: set[int] | None = None):
    """Yield ``(key, tensor)`` for each of ``keys`` ((key, pieces) as `holders` gives them), whole
    and in the dtype the model was made in, as soon as the last unit it lies in has been gathered:
    the weights are read one unit at a time (every rank iterates, rank 0 alone receives), so what
    is in memory beside the result is one unit. Keys of one parameter (tied) share one tensor,
    as they do in torch's state_dict. ``units``: the indices of the units to read (None: all)."""
    waiting: dict[int, list] = {}  # unit index -> the pieces lists with a piece in that unit
    parts: dict[int, list] = {}  # id(pieces) -> its parts so far (None until read), in row order
    names: dict[int, list[str]] = {}  # id(pieces) -> its keys
    for key, pieces in keys:
        if id(pieces) not in parts:
            parts[id(pieces)] = [None] * len(pieces)
            for unit, _ in pieces:
                waiting.setdefault(unit.index, []).append(pieces)
        names.setdefault(id(pieces), []).append(key)
    for unit, full in engine.unit_weights(rank0_only=True, units=units):
        if full is None:  # a rank other than 0 (see [Note: state_dict at several ranks])
            continue
        for pieces in waiting.get(unit.index, ()):
            got = parts[id(pieces)]
            for n, (u, j) in enumerate(pieces):
                if u is unit:
                    # A copy in the parameter's dtype: ``full`` is let go after this unit.
                    got[n] = u.view(full, j).to(u.records[j].dtype, copy=True)
            if all(part is not None for part in got):
                whole = got[0] if len(got) == 1 else torch.cat(got)
                for key in names[id(pieces)]:
                    yield key, whole
        del full  # one unit's weights alive at a time

"""Who may take how much of the host pool, and who gives way: the one owner of pool admission.

Owns: the plan of ``memory.host_budget`` (`Plan`, made once at initialize: what each class of
traffic may hold) and, at run time, the order in which what waits in the pool for later gives
way to a transfer needed now (`Admission`). Touches: the pool (it counts each buffer under its
traffic class: `infinity.swap.HostBufferPool.traffic`), the engine's parts, which register
what they can give back (`Admission.give_way`) and take through it what they need now.

[Note: traffic classes]
Every host buffer the engine moves data through comes from one pool; several parts of the
engine want it at once, for reasons of unequal urgency. The classes, as the pool counts them:

- ``fetch``: parameters a module is about to run with (forward or backward). Needed now: it
  may wait for room, after the others give way.
- ``prefetch``: parameters of the next modules of the predicted order. Takes only room that
  is free now; given back first when a fetch finds none.
- ``step``: the optimizer's sub-groups streamed through the update (read ahead, written behind).
  The step runs alone; the plan fits its read-ahead to the budget (`_update.fit_read_ahead`).
- ``overlap``: the optimizer's early updates under backward ([Note: exact overlap]), within the
  plan's ``overlap`` share; they give way before held gradients.
- ``grad``: backward's gradient buffers (needed now, as a fetch, but prefetches stay), the
  gradients accumulated and written behind, or held for the step ([Note: gradients held])
  within the plan's ``held`` share; held ones are written (given way) last.
- ``activation``: saved activations on their way to their tier, or read back ahead of backward
  ([Note: activations offloaded]), within the plan's ``activations`` share, in chunks of at most
  ``activation_chunk`` bytes: a write that finds its share full waits for its own oldest write,
  a read ahead that finds it full stops, and reads ahead give way right after prefetches.
- units kept from forward for backward ([Note: kept for backward]) are ``fetch`` and
  ``prefetch`` buffers kept bound while the pool holds at most the plan's ``kept`` limit; they
  give way after reads ahead.
- ``other``: what names no class (checkpoint and export streaming, the initial state's writes).

The plan (`Plan`): the budget less ``POOL_SLACK`` (the pool places buffers first-fit in slabs;
planned to the last byte it found no contiguous room) is split into what forward and backward
hold at most (a unit in use, ``prefetch.depth`` ahead, gradients on their way, and the
activation tier's share), what the step holds at most (its read-ahead), and what either leaves
to the classes that only fill room: the overlap's share (or its staged copies in host memory),
held gradients, kept units. `initialize` refuses a budget that cannot hold the larger of the
first two (`_resources.check_host_budget`); the rest are room, never a need. `engine.stats()`
gives each class's bytes held now and its peak beside the plan's shares ("pool").

A transfer needed now (`Admission.take_now`) tries the pool without waiting; when it finds no
room, the classes that wait for later give way one at a time, in the order registered (on a
GPU first the buffers of copies to it that are done, which go back otherwise only at the next
copy; then prefetches, activations read ahead, kept units, the overlap's early work, held
gradients), and it tries again after each; only when all have given way does it wait (the
pool's timeout). Backward's gradient buffers spare the prefetches, which backward needs next,
until the rest gave way and a brief wait for writes ending found no room: at the floor the
pool can have the bytes but not in one piece, prefetches between them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from infinity.swap import PoolExhausted

from . import _overlap_host, _resources
from ._bytes import group_bytes
from ._grads import MAX_WRITES
from ._overlap import MAX_IN_HAND
from ._update import POOL_SLACK, READ_AHEAD, ReadAhead, fit_read_ahead, step_bytes

logger = logging.getLogger("infinity")

FETCH, PREFETCH, STEP, OVERLAP, GRAD, ACTIVATION = "fetch", "prefetch", "step", "overlap", "grad", "activation"
KEPT = "kept"  # units kept for backward (fetch and prefetch buffers): what gives way, not a pool class
COPIES = "copies"  # host buffers of copies to a GPU that are done (fetch, prefetch, step): not a pool class

# The activation tier moves a tensor in chunks of at most this many bytes (fewer on a small
# budget: `Plan.activation_chunk`), at most ACTIVATION_CHUNKS of them in the pool at once.
ACTIVATION_CHUNK = 16 << 20
ACTIVATION_CHUNKS = 4
_PAGE = 4096
# Seconds a transfer needed now waits for buffers on their way back before what it spares gives way.
BRIEF_WAIT = 0.05

T = TypeVar("T")


@dataclass
class Plan:
    """The host budget split by class of traffic (bytes); see [Note: traffic classes]."""

    budget: int = 0
    usable: int = 0  # the budget less POOL_SLACK
    backward: int = 0  # forward and backward's own buffers at most (the activation share included)
    step: int = 0  # what the optimizer step needs of the budget (its buffers, and the slack where tight)
    read_ahead: ReadAhead = field(default_factory=ReadAhead)  # how far the step reads ahead
    step_buffers: int = 0  # the step's own pool buffers at that read-ahead
    overlap_from: int | None = None  # the smallest budget with the optimizer under backward
    overlap: int = 0  # pool bytes the optimizer's early updates may hold (states on nvme)
    staging: int = 0  # host bytes of their staged copies (states in host memory), beside the pool
    held: int = 0  # gradients held in the pool for the step
    step_holds: int = 0  # ... of which the step leaves held beside its own buffers
    kept: int = 0  # pool bytes in use up to which units stay kept for backward
    activation_chunk: int = 0  # bytes of one activation chunk (0: no activation tier in the pool)
    needs: dict = field(default_factory=dict)  # what initialize checked: what -> bytes

    @property
    def activations(self) -> int:
        """The activation tier's share: its chunks in the pool at most."""
        return ACTIVATION_CHUNKS * self.activation_chunk

    def shares(self) -> dict[str, int]:
        """The bound of each class that has one (what `engine.stats()` shows beside its use)."""
        out = {"backward": self.backward, "step": self.step, "overlap": self.overlap, "held": self.held,
               "kept": self.kept, "activation": self.activations}  # fmt: skip
        return {k: v for k, v in out.items() if v}


def activation_chunk(usable: int) -> int:
    """The chunk size of activations moved through the pool: ACTIVATION_CHUNK, or a 16th of
    the usable budget where that is smaller (so their share is at most a quarter of it), in
    whole pages."""
    return max(_PAGE, min(ACTIVATION_CHUNK, usable // (4 * ACTIVATION_CHUNKS)) // _PAGE * _PAGE)


def make_plan(layout, cfg, *, activations_in_pool: bool) -> Plan:
    """The plan for the model and parts of ``layout`` (a `_layout.Layout`) and ``cfg``,
    checked: a budget smaller than forward and backward's or the step's need is a
    `_resources.HostBudgetError`. `finish` then turns the overlap off where the disk has no
    room for it, and sets the limits that depend on it. Reads ``layout``, changes
    nothing of it: the components are made after, with the finished plan."""
    budget = cfg.memory.host_budget
    plan = Plan(budget=budget, usable=int(budget * (1 - POOL_SLACK)))
    largest = max(u.padded_numel for u in layout.units)
    plan.read_ahead, step_need = fit_read_ahead(layout, budget)
    plan.step_buffers = step_bytes(layout, plan.read_ahead)
    needs = {"optimizer step": step_need}
    backward = 0
    if layout.param_store.uses_pool:  # a unit in use, `depth` prefetched, gradients gathered
        itemsize = layout.dtype.itemsize
        backward = ((cfg.prefetch.depth + 1) * itemsize + (MAX_WRITES + 1) * 4) * largest
    fixed = backward  # what does not grow with the budget
    if activations_in_pool:  # see [Note: activations offloaded] in `_activations`
        plan.activation_chunk = activation_chunk(plan.usable)
        backward += plan.activations
    if backward:
        needs["forward/backward"] = backward
    plan.backward, plan.step, plan.needs = backward, needs["optimizer step"], needs
    plan.overlap_from = _overlap_from(layout, cfg, fixed, activations_in_pool)
    _resources.check_host_budget(cfg, needs, largest * 4, overlap_from=plan.overlap_from)
    plan.overlap = _fit_overlap(layout, cfg, plan)
    # Host bytes for the early updates' staged copies where the states are in host memory:
    # what the usable budget leaves beside the backward's buffers and the step's own.
    room = plan.usable - max(backward, plan.step_buffers)
    plan.staging = _overlap_host.fit(layout, cfg, room) if not plan.overlap else 0
    return plan


def finish(plan: Plan, layout, footprint=None) -> None:
    """Turn the overlap off where ``footprint`` (the disk's, `_footprint.Footprint`, or None
    without a swap space) leaves no room for a sub-group's staged copies; then the shares that
    depend on whether the optimizer runs under backward: held gradients, what the step leaves
    held, kept units."""
    if footprint is not None and footprint.staging_room == 0 and plan.overlap:
        logger.info("optimizer.overlap: the disk has no room for a sub-group's staged copies beside the state; "
                    "the optimizer runs after backward")  # fmt: skip
        plan.overlap = 0
    plan.held = _held(plan, layout)
    plan.step_holds = max(0, plan.usable - plan.step_buffers)
    if plan.overlap:  # kept units turn into gradients as backward uses them: the held room
        plan.kept = plan.backward + plan.held if plan.held else 0
    else:  # staged copies in host memory are beside the pool, in the same budget
        plan.kept = max(0, plan.usable - plan.backward - plan.staging)


def _held(plan: Plan, layout) -> int:
    """Bytes of gradients held in the pool, not written, for the step ([Note: gradients held]
    in `_grads`): what the usable budget leaves beside the larger of the backward's and the
    step's own buffers (the step starts with them held); where the optimizer runs under
    backward, what its share leaves beside the most it holds at once (`MAX_IN_HAND` sub-groups).
    Nothing where the grads are not on nvme. On a GPU they are held as they land from the
    device ([Note: gradients copied back])."""
    if not layout.grad_store.uses_pool or plan.staging:
        return 0  # (staged copies in host memory take the room held gradients would)
    st = layout.states
    if plan.overlap:
        in_hand = MAX_IN_HAND * max(group_bytes(st, g) for g in st.groups)
        return max(0, plan.overlap - in_hand)
    return max(0, plan.usable - max(plan.backward, plan.step_buffers))


def _overlap_applies(layout, cfg) -> bool:
    """Whether the optimizer can run under backward at all, whatever the budget (see
    [Note: exact overlap] in `_overlap`)."""
    st = layout.states
    return bool(cfg.optimizer.overlap and st.groups and st.algorithm.name != "torch" and st.stores["master"].uses_pool
                and layout.param_store.uses_pool and not st.gather_params)  # fmt: skip


def _room_beside_backward(layout, budget: int, backward_bytes: int) -> int:
    """Pool bytes ``budget`` leaves beside the backward: its own buffers (planned, as the
    step's read-ahead, POOL_SLACK short of the budget) and one sub-group's gradients kept
    in memory."""
    largest = max(g.numel for g in layout.states.groups)
    return int(budget * (1 - POOL_SLACK)) - backward_bytes - 4 * largest


def _overlap_from(layout, cfg, fixed_backward: int, activations: bool) -> int | None:
    """The smallest host budget from which `_fit_overlap` runs the optimizer under backward,
    for this model and config; None where overlap cannot apply. With that much the step reads
    its full `READ_AHEAD`, so that is what the room must hold. The backward's buffers are
    ``fixed_backward`` and, with ``activations`` in the pool, the activation chunks, which grow
    with the budget (`activation_chunk`): the figure computed with the chunks of the budget at
    hand was too low near the floor (a budget set to it left the overlap off) and 4.75x too
    high at 1 GiB (an audit helper's repro). Here the chunks are bounded above without their
    rounding down to pages, a room that only grows with the budget: from the budget returned
    on, every larger one runs it, and the bound is within a few pages of the least that does."""
    if not _overlap_applies(layout, cfg):
        return None
    st = layout.states
    step = max(step_bytes(layout, READ_AHEAD), min(group_bytes(st, g) for g in st.groups))

    def enough(budget: int) -> bool:
        acts = 0
        if activations:
            usable = int(budget * (1 - POOL_SLACK))
            acts = ACTIVATION_CHUNKS * max(_PAGE, min(ACTIVATION_CHUNK, usable / (4 * ACTIVATION_CHUNKS)))
        return _room_beside_backward(layout, budget, fixed_backward) - acts >= step

    lo, hi = 0, 1
    while not enough(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # the least budget that is enough: ``enough`` only turns true as the budget grows
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def _fit_overlap(layout, cfg, plan: Plan) -> int:
    """Pool bytes the optimizer may hold under backward (0: no overlap): where it applies
    (see [Note: exact overlap] in `_overlap`), what the host budget leaves beside the
    backward's own buffers and one sub-group's gradients kept in memory."""
    if not _overlap_applies(layout, cfg):
        return 0
    st = layout.states
    # Only with room to spare: what the budget leaves beside the backward must hold at least
    # what the step itself plans for. The pool places buffers first-fit in slabs; early
    # updates cut them into their own sizes, and under a tight budget the backward or the
    # step then found no contiguous room (the 25M demo at 46MiB, whose step plans 39MiB:
    # waits of seconds, and once the pool's 60 s timeout).
    room = _room_beside_backward(layout, cfg.memory.host_budget, plan.backward)
    if room < plan.step or room < min(group_bytes(st, g) for g in st.groups):
        have, step, want = _resources.distinct_sizes(max(room, 0), plan.step, plan.overlap_from)
        logger.info("optimizer.overlap: memory.host_budget leaves %s beside the backward, less than the %s the "
                    "optimizer step plans for; the optimizer runs after backward (a host_budget of %s or more "
                    "would run it under backward)", have, step, want)  # fmt: skip
        return 0
    return room


class Admission:
    """The run-time half: what gives way, in which order, to a transfer needed now."""

    def __init__(self, pool, plan: Plan):
        self.pool = pool
        self.plan = plan
        self._give_way: list[tuple[str, Callable[[], None]]] = []  # (what, give back), in order

    def give_way(self, what: str, fn: Callable[[], None]) -> None:
        """Register ``fn``, which gives back the pool memory of ``what`` (memory held for later),
        after those registered before it."""
        self._give_way.append((what, fn))

    def take_now(self, take: Callable[[float | None], T], *, last: tuple[str, ...] = ()) -> T:
        """``take(timeout)`` (a pool acquire, or a read into a pool buffer) for a transfer needed
        now: first without waiting; then after each of the registered gives way in turn, but
        those ``last`` names; then, with ``last``, after a brief wait for what is on its way back
        (writes ending), after those too; then waiting for a release (``timeout=None``: the pool's)."""
        try:
            return take(0)
        except PoolExhausted:
            pass
        for what, fn in self._give_way:
            if what in last:
                continue
            fn()
            try:
                return take(0)
            except PoolExhausted:
                pass
        if last:
            try:
                return take(BRIEF_WAIT)
            except PoolExhausted:
                pass
            for what, fn in self._give_way:
                if what in last:
                    fn()
                    try:
                        return take(0)
                    except PoolExhausted:
                        pass
        return take(None)

    def take_for_backward(self, nbytes: int):
        """A pool buffer for backward's own use (a gradient gathered on the host, or copied back
        from a GPU: [Note: gradients copied back] in `_grads`), counted as ``grad``: what waits
        in the pool for later gives way first if the pool has no room (the optimizer's work
        under backward never makes backward wait), the prefetches, which backward needs next,
        last. At the floor budget the pool can have the bytes but not in one piece (its extents
        first-fit): the prefetches kept were then all that could give them, and backward waited
        on reads only it would use, until the pool's timeout."""
        return self.take_now(lambda t: self.pool.acquire(nbytes, timeout=t, traffic=GRAD), last=(PREFETCH,))

    def stats(self) -> dict:
        """Each class's bytes held now and at most, and the plan's shares ("pool" in `engine.stats()`)."""
        pool = self.pool.stats()
        return {"by_traffic": pool["by_traffic"], "shares": self.plan.shares(),
                "in_use_bytes": pool["in_use_bytes"], "peak_bytes": pool["peak_bytes"],
                "aside_bytes": pool["aside_bytes"]}  # fmt: skip (parameters kept: memory.keep_params)

"""The optimizer step: the sub-groups streamed through the algorithm's kernel.

Owns: the update of one step (clipping, the commit of the overlap's early updates, the stream
of the sub-groups that are left), the read of each sub-group's gradients ahead of its update,
the kernel calls (one per parameter group, with that group's hyperparameters as they are now),
and the pool bytes it holds (`step_bytes`) at the read-ahead the host budget allows (`fit_read_ahead`,
which the memory plan calls: `_admission`).
Touches: the grads (their norm, their reads), the sub-group states (`_substates`: stores, step
counts, new parameters), the algorithm (`_algorithms`: its kernel), the overlap (`_overlap`).

The step streams the sub-groups (`_store.stream_together`): on nvme group i+1 is read and i-1
written back while the update runs on i, and each unit's new low-precision parameters are
written to the params tier as they are made. Semantics follow the matching ``torch.optim``
class: only parameters in a group are updated (frozen ones are left alone), a unit without a
gradient this step is left alone (no decay, no state update), and each unit keeps its own step
count.

[Note: the host step on a GPU]
With the optimizer's states on the host (the cpu or nvme tier) and the gradients or parameters
on a GPU, the update is a pipeline of sub-groups: while the kernel runs on sub-group i, the
gradients of i+1 are on their way to pinned pool buffers on the copy-back stream
(`Transport.to_host`), which the kernel then reads in place; the new parameters of i are
converted once, on the host, into pinned pool buffers of their stored dtype and copied to the
device on the side stream (`Transport.to_device_as`), which the compute stream waits for with
an event: the next forward's kernels run after the copies, and the host waits for nothing. A
staging buffer goes back to the pool only once its copy's event is done; before a sub-group's
parameters are staged the previous one's copies are drained (done by then: the kernel ran in
between), so the step holds at most two sub-groups' gradients and one's parameters in the pool
(`step_bytes`). On the host (no GPU) the kernel reads the gradients where they are and
nothing is staged. Every copy is counted ([Note: every copy counted] in `_transport`), and the
resident tiers' bytes the update reads and writes are counted by kind in their tier.

The kernels run on the caller's thread. A worker thread for the kernel while this thread stages
the next sub-group buys nothing here: what this thread does between kernels is issue copies and
convert parameters, and the conversion is a host kernel that would share the same cores and
memory bandwidth as the update's (torch's kernels already use every core).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from infinity.swap import PoolExhausted, round_up

from ._grads import GradAccumulator
from ._store import InHand, Lease, release_unused, stream_together
from ._substates import SubGroup, SubGroupStates

READ_AHEAD = 3  # sub-groups; see fit_read_ahead
POOL_SLACK = 0.15  # of the host budget the read-ahead does not plan for; see fit_read_ahead


@dataclass(frozen=True)
class ReadAhead:
    """How far the step's stream reads ahead: ``count`` sub-groups, and (where not None) at
    most ``bytes`` of them, so that one large sub-group holds back only itself."""

    count: int = READ_AHEAD
    bytes: int | None = None


def clip_coef(max_norm: float, norm: float) -> float:
    """What gradients of global norm ``norm`` are multiplied by to clip them to ``max_norm``, as
    torch.nn.utils.clip_grad_norm_ computes it."""
    return min(1.0, max_norm / (norm + 1e-6))


class StreamedUpdate:
    """The update of every sub-group with a gradient, streamed (see the module's docstring).
    ``param_groups`` is the optimizer's own list: its hyperparameters as they are now."""

    def __init__(self, substates: SubGroupStates, param_groups: list[dict], grads: GradAccumulator, max_grad_norm,
                 plan=None):  # fmt: skip
        self.substates = substates
        # `_admission.Plan`, the engine's: its ``read_ahead``, and ``step_holds``, the gradients
        # the stream leaves held (None: the default read-ahead, nothing held)
        self.plan = plan
        self.algorithm = substates.algorithm
        self.param_groups = param_groups
        self.grads = grads
        self.max_grad_norm = max_grad_norm  # clip every step to this (the config's)
        self.clip_next: float | None = None  # clip the next step to this (Engine.clip_grad_norm_)
        self.last_norm: float | None = None  # the last step's global norm (unscaled; None: skipped)
        self._pushed_foreign = [{} for _ in param_groups]  # the group values last given a torch optimizer run as it is
        self.clipped_last = False  # the last step clipped (early updates would be discarded)
        self.transport = grads.transport  # `_transport.Transport`: the copies ([Note: every copy counted])
        self.stats = getattr(self.transport, "stats", None)  # `_stats.Stats`, or None (nothing counted)

    @property
    def read_ahead(self) -> ReadAhead:
        """How far the stream reads ahead: the plan's (the default without one)."""
        return self.plan.read_ahead if self.plan is not None else ReadAhead()

    def update(self, loss_scale: float = 1.0, overlap=None) -> bool:
        """One update of every parameter with a gradient; False when skipped (non-finite).
        Sub-groups ``overlap`` (the engine's `_overlap.Overlap`, staged on nvme or in host memory,
        where the optimizer runs under backward) updated early are committed where valid, see
        [Note: exact overlap] in `_overlap`."""
        start = time.perf_counter()
        try:
            return self._update_all(loss_scale, overlap)
        finally:
            if self.stats is not None:
                self.stats.add("update_seconds", time.perf_counter() - start)

    def _update_all(self, loss_scale: float, overlap) -> bool:
        st = self.substates
        if overlap is None:  # see [Note: one copy of the fp32 weights] in `_onecopy`
            st.share_masters()
        self.grads.flush()
        if self.transport is not None:
            self.transport.check_same_units()  # before anything is updated from the pass's reductions
        # The smallest of [optimizer] max_grad_norm and a clip asked this step: clipping to one
        # and then the other (torch's two clips) leaves the smaller bound. A clip asked is this
        # step's, skipped or not: torch's scaled gradients the skip then drops.
        limits = [c for c in (self.clip_next, self.max_grad_norm) if c is not None]
        clip, self.clip_next = (min(limits) if limits else None), None
        self.clipped_last = False
        self.last_norm = None
        if not self.grads.norms.all_finite():
            if overlap is not None:
                overlap.discard()
            return False
        divide = loss_scale  # gradients are stored multiplied by the loss scale
        # The step's norm, clipping or not, as DeepSpeed's ZeRO computes it every step
        # (`get_global_grad_norm`): a sum of the norms backward noted, and one all-reduce.
        norm = self.last_norm = self.grads.norms.global_norm() / loss_scale
        if clip is not None:
            coef = clip_coef(clip, norm)
            divide = loss_scale / coef
            self.clipped_last = coef < 1.0
        committed = overlap.commit(divide) if overlap is not None else set()
        groups = [g for g in st.groups if g.index not in committed]
        # Held gradients ([Note: gradients held] in `_grads`): those of committed sub-groups go
        # back, and what the stream has no room for beside its own buffers is written.
        self.grads.held.release(u.index for g in st.groups if g.index in committed for u in g.units)
        if self.plan is not None:
            self.grads.held.spill(keep=self.plan.step_holds)
        # (a fill on the kernel's device, not a copy from the host: nothing to wait for on a GPU)
        grad_scale = None if divide == 1.0 else torch.full((), divide, dtype=torch.float32, device=st.device)
        grads_now = grads_next = None
        try:
            # The next sub-group's gradients are read while this one is updated.
            grads_next = self._read_grads(groups[0]) if groups else None
            stores = [st.stores[k] for k in st.kinds]
            ahead = self.read_ahead
            items = stream_together(stores, [g.record.name_for() for g in groups], ahead=ahead.count,
                                    ahead_bytes=ahead.bytes)  # fmt: skip
            # Iterate the stream itself (not a zip with the groups, which would stop without
            # resuming the generator after its last item, and so skip that item's write-back).
            for i, item in enumerate(items):
                # Read ahead only where the pool has room now, else now that they are needed
                # (waiting then only for this step's write-behinds, not for reads ahead that
                # this loop itself would release).
                grads_now = grads_next if grads_next is not None else self._read_grads(groups[i])
                grads_next = None  # held as grads_now now: released once on failure, not twice
                grads_next = self._read_grads(groups[i + 1], wait=False) if i + 1 < len(groups) else None
                with record_function("infinity::optimizer.subgroup"):
                    item.write_back = self._update(groups[i].index, item.tensors, grad_scale, grads_now)
        except BaseException:
            # Every buffer goes back; the first error is the one raised.
            release_unused((*(grads_now or {}).values(), *(grads_next or {}).values()))
            st.param_writes.discard_errors()
            if self.transport is not None:
                try:  # staging buffers go back once their copies are done
                    self.transport.settle()
                except Exception:  # noqa: BLE001 - the first error is the one to see
                    pass
            raise
        st.param_writes.drain()
        if self.transport is not None:
            self.transport.settle()  # the last parameters' copies; the copies' GPU time counted
        return True

    def _read_grads(self, group: SubGroup, wait: bool = True) -> dict | None:
        """Issue the reads of ``group``'s gradients (unit index -> store Pending of a lease);
        without ``wait``, only if the pool has room for all of them now (None if not)."""
        pending = {}
        units = [u for u in group.units if u.index in self.grads.has_grad]
        lent = 0  # bytes of the tier's own tensors lent in place (nvme's reads the store counts)
        try:
            for u in units:
                if not self.grads.is_held(u.index):
                    pending[u.index], nbytes = self._read_grad(u, timeout=None if wait else 0)
                    lent += nbytes
        except BaseException as e:
            release_unused(pending.values())  # the held ones stay held: a later read finds them
            if wait or not isinstance(e, PoolExhausted):
                raise
            return None
        if lent and self.stats is not None:  # once per sub-group: the counter takes a lock
            self.stats.count(self.grads.store.tier, "grad", False, lent)
        for u in units:  # see [Note: gradients held] in `_grads`
            if u.index not in pending:
                pending[u.index] = InHand(Lease(*self.grads.take_held(u.index)))
        return pending

    def _read_grad(self, unit, timeout: float | None):
        """The `Pending` of ``unit``'s gradient for the step and the bytes of the tier's own
        tensor it lends (for the caller to count): a read from nvme (counted by the store; 0),
        the tier's own tensor, or that tensor on its way from a GPU to a pinned buffer
        (`Transport.to_host`; [Note: the host step on a GPU])."""
        pending = self.grads.get(unit, timeout=timeout)
        store = self.grads.store
        if store.uses_pool:
            return pending, 0
        value = pending.result().tensor  # resident: lent in place, nothing to wait for
        if value.numel() != unit.shard_numel:  # stage 1 keeps the whole gradient
            value = value[unit.shard]
        if self.transport is None:
            out = InHand(Lease(value))
        else:  # on the host, or on its way there ([Note: the host step on a GPU])
            out = self.transport.to_reader(value, self.substates.device, timeout=timeout)
        return out, value.numel() * value.element_size()

    def _update(self, index: int, tensors, grad_scale, pending: dict) -> bool:
        """Update sub-group ``index``'s parameters that have a gradient; False when none has."""
        st = self.substates
        group = st.groups[index]
        have = [u for u in group.units if u.index in pending]
        if not have:
            return False
        master, states = tensors[0], tensors[1:]
        grads, leases = {}, []
        try:
            for u in have:
                lease = pending[u.index].result()
                if lease.tensor.device == master.device:  # a resident tier's, or brought by `_read_grad`
                    leases.append(lease)
                    value = lease.tensor
                else:  # read from nvme or held in the pool (host memory), for a kernel on a GPU
                    value = self._onto(lease, master.device)
                if value.numel() != u.shard_numel:  # stage 1 keeps the whole gradient
                    value = value[u.shard]
                grads[u.index] = value
            stepped = {u.index for u in have}
            if st.foreign is not None:
                self._step_foreign(index, grads, grad_scale)
                return st.write_params(group, have, master, self.transport)
            first = st.mark_stepped(stepped)
            torch._foreach_add_([st.steps[i] for i in stepped], 1.0)
            # The tiers' own tensors where no kind is streamed through the pool: the kernels' views
            # of them are kept from step to step (`_algorithms.Cut`).
            resident = not any(st.stores[k].uses_pool for k in st.kinds)
            self._apply_kernels(index, master, states, grads, grad_scale, st.steps, first, resident)
        finally:
            for lease in leases:
                lease.release()
        self._count_states(index, have)
        return st.write_params(group, have, master, self.transport)

    def _onto(self, lease, device: torch.device) -> torch.Tensor:
        """A gradient in host memory (``lease``, owned from here) on ``device`` for the kernel:
        copied on the side stream, which the kernel's stream waits for, the lease given back
        once the copy is done (`Transport.to_device`; counted). Only a GPU's kernel reads
        gradients on another device than the store's, so the transport has its copies."""
        try:
            return self.transport.to_device(lease)
        except BaseException:
            lease.release()
            raise

    def _count_states(self, index: int, have: list) -> None:
        """The optimizer's reads and writes of sub-group ``index``'s states, where they are
        resident (nvme's are counted by the stream): each kind's part of every unit it stepped."""
        if self.stats is None:
            return
        st = self.substates
        for kind in st.kinds:
            store = st.stores[kind]
            if store.uses_pool:
                continue
            nbytes = sum(st.records[u.index].nbytes(kind) for u in have)
            self.stats.count(store.tier, kind, False, nbytes)
            self.stats.count(store.tier, kind, True, nbytes)

    def apply(self, index: int, master, states, grads: dict, divide: float, steps: dict, first: set) -> None:
        """Sub-group ``index``'s update in place on ``master`` and ``states`` from ``grads``
        (unit -> its gradient shard, divided by ``divide``), with the step counts ``steps``
        (unit -> the count this update makes) and ``first`` the units stepping for the first time."""
        grad_scale = None if divide == 1.0 else torch.full((), divide, dtype=torch.float32, device=self.substates.device)
        if grad_scale is not None:
            # The fused kernels unscale the gradients they are given in place. An early update
            # (the overlap's, the one caller) reads gradients the step reads again when it is not
            # committed (a held one, the tier's own tensor): it unscales private copies.
            grads = {i: g.clone() for i, g in grads.items()}
        self._apply_kernels(index, master, states, grads, grad_scale, steps, first)

    def _apply_kernels(self, index, master, states, grads, grad_scale, step_of, first, resident=False) -> None:
        """The algorithm's kernel once per parameter group over its parameters in sub-group
        ``index`` that have a gradient (on fp32 copies of compact states: `_compact`);
        ``resident``: ``master`` and ``states`` are the tiers' own tensors."""
        start = time.perf_counter()
        try:
            self._run_kernels(index, master, states, grads, grad_scale, step_of, first, resident)
        finally:
            if self.stats is not None:
                self.stats.add("optimizer_seconds", time.perf_counter() - start)

    def _run_kernels(self, index, master, states, grads, grad_scale, step_of, first, resident=False) -> None:
        st = self.substates
        self.algorithm.update(st.groups[index], st.slices[index], self.param_groups, master, states, grads,
                              grad_scale, step_of, first, st.cuts[index], resident)  # fmt: skip

    def _step_foreign(self, index: int, grads: dict, grad_scale) -> None:
        """The user's torch optimizer on sub-group ``index``: gradients as ``.grad`` of the
        master views (unscaled and clipped first), hyperparameters as ours are now."""
        st = self.substates
        used = []
        for entries in st.slices[index].values():
            for u, _, gs, i in entries:
                if u.index in grads:
                    shadow = st.shadows[(u.index, i)]
                    g = grads[u.index][gs].view(u.records[i].shape)
                    shadow.grad = g if grad_scale is None else g / grad_scale
                    used.append(shadow)
        for mine, theirs, last in zip(self.param_groups, st.foreign.param_groups, self._pushed_foreign):
            # A value changed on the user's own optimizer since the last step (a schedule made on
            # it before initialize, a change by hand) is taken; then ours go to it.
            for k, v in theirs.items():
                if k != "params" and k in last and v is not last[k]:
                    mine[k] = v
            last.clear()
            last.update({k: v for k, v in mine.items() if k != "params"})
            theirs.update(last)
        try:
            st.foreign.step()
        finally:
            for shadow in used:
                shadow.grad = None


def stages_grads(transport, grad_store, states: SubGroupStates) -> bool:
    """Whether the gradients come to the host kernel by copies from a GPU into pinned pool
    buffers ([Note: the host step on a GPU])."""
    return transport is not None and not grad_store.uses_pool and transport.stages(grad_store.device, states.device)


# -- host memory: what the memory plan reads (`_admission.make_plan`) ------------------------
def _largest_state(states: SubGroupStates, rounded: bool) -> int:
    """Bytes of the largest sub-group's state, every kind (each rounded to whole pages of the
    pool where ``rounded``)."""
    size = round_up if rounded else int
    return max(sum(size(g.record.nbytes(k)) for k in states.kinds) for g in states.groups)


def step_bytes(layout, ahead: ReadAhead | int) -> int:
    """Pool bytes the update of ``layout`` (a `_layout.Layout`) holds at most, reading
    ``ahead`` (a `ReadAhead`, or a count of the largest sub-group): the stream's sub-groups
    (read ahead, one in hand, one written behind), the gradients of one sub-group and the
    next one's, and three parameter write-behinds (copies; none with one copy of the fp32
    weights, where the master weights' write is theirs); each only where its store uses the
    pool. On a GPU with the states on the host, the gradients staged from the device (two
    sub-groups') and one sub-group's new parameters staged to it ([Note: the host step on a
    GPU])."""
    st = layout.states
    if not st.groups:
        return 0
    if isinstance(ahead, int):
        ahead = ReadAhead(ahead)
    # Each buffer takes whole pages of the pool: counted so, small units are not free.
    need = 0
    if st.stores["master"].uses_pool:
        state = _largest_state(st, rounded=True)
        need += 2 * state + (ahead.bytes if ahead.bytes is not None else ahead.count * state)
    if layout.grad_store.uses_pool or stages_grads(layout.transport, layout.grad_store, st):  # one buffer per unit
        need += 2 * max(sum(round_up(4 * u.shard_numel) for u in g.units) for g in st.groups)
    if st.param_store.uses_pool and not st.one_copy:
        need += 3 * max(round_up(st.param_dtype.itemsize * u.shard_numel) for u in st.units)
    if st.stages_params(layout.transport):  # one sub-group's staged parameters ([Note: the host step on a GPU])
        need += max(sum(round_up(st.param_dtype.itemsize * u.shard_numel) for u in g.units) for g in st.groups)
    return need


def fit_read_ahead(layout, budget: int) -> tuple[ReadAhead, int]:
    """How far the step of ``layout`` reads ahead in ``budget``, and the pool bytes it then
    needs: as many sub-groups as ``budget`` allows, up to `READ_AHEAD` (3 measured best here:
    step time over the I/O floor 1.3 at 1, 1.2 at 2, 1.0-1.1 at 3; benchmarks/engine_bench.py),
    counted in bytes when the sub-groups differ in size: one vocabulary-sized sub-group (an
    embedding alone) then holds back only itself, not the read-ahead of every other. At least
    one ahead."""
    # The read-ahead leaves POOL_SLACK of the budget unplanned: the pool places buffers
    # first-fit in slabs, and a stream planned to the last byte found no contiguous room
    # for its next read once other users had cut the slabs (the 25M demo at 46MiB, planned
    # at 45.1MiB, waited out the pool's timeout). At least one ahead whatever the slack.
    usable = int(budget * (1 - POOL_SLACK))
    full = ReadAhead()
    need = step_bytes(layout, full)
    if need <= usable or not layout.states.groups:
        return full, need
    largest_state = _largest_state(layout.states, rounded=False)
    one = ReadAhead(READ_AHEAD, largest_state)  # one of the largest ahead, at least
    spare = usable - step_bytes(layout, one)
    fitted = ReadAhead(READ_AHEAD, largest_state + min(spare, (READ_AHEAD - 1) * largest_state)) if spare > 0 else one
    # The slack is part of what the budget must hold: planned to the last byte, the pool
    # ran out of contiguous room (a step at exactly this figure without it waited out the
    # pool's timeout: tests/infinity/test_resources.py).
    return fitted, math.ceil(step_bytes(layout, fitted) / (1 - POOL_SLACK))

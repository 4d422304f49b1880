"""The optimizer under backward with its states in host memory (the cpu tier): `InMemory`,
the staging strategy `_overlap.Overlap` is given there.

Owns: where the early updates of [Note: exact overlap] (in `_overlap`) run when the optimizer
states are resident in host memory, ZeRO-Offload's placement: the staged copies they make
(`_Staging`, bounded in bytes by the host budget), their commit and their discard, and whether
and with how much memory this applies (`applies`, `fit`). Touches: the optimizer's stores
(each resident state tensor is replaced by its staged copy at commit), the params store (the
new parameters are put at commit), the grads (read as `_overlap.Overlap` reads them).

[Note: staged in host memory]
The semantics are those of [Note: exact overlap]: a sub-group's update runs once every unit
of it has its last gradient of the step, on the assumptions clip coefficient 1, the loss scale
of now, the hyperparameters of now and the gradients of now, and is committed at the step
only if they held, otherwise discarded and redone by the step. What differs is where the
staged results live. The states are resident, and the kernels update in place, so an early
update first copies the sub-group's states into staging tensors (one copy each, under
backward) and updates those. At commit each staged tensor *becomes* the state: the store's
tensor under that name is swapped for it (`Store.swap`, no copy), and the tensor it replaces
goes back to the staging tensors for the next step's early updates. The new parameters are
cast from the staged master weights into staging tensors too and put into the params store
only at commit (resident: copied into the tensors the modules' parameters view, so a forward
run again inside backward, or a discarded update, never sees them; nvme: written then, behind
the step). A discard gives the staging tensors back and nothing else changed.

Staging is host memory beside the resident state, and counts in `memory.host_budget`: `fit`
gives the early updates what the budget leaves beside the backward's pool buffers (the
parameters' fetches and, on nvme, the gradients'), less its slack; an early update that finds
no room is left to the step, as on nvme. The tensors are pinned where CUDA is, as the cpu tier's.
"""

from __future__ import annotations

import bisect
import logging
import math
import mmap
from concurrent.futures import Future

import torch

from infinity.aio import empty_aligned
from infinity.swap import OutOfSpace, PoolExhausted

from ._bytes import host_staged_bytes
from ._overlap import _Early, settle
from ._profile import region
from ._store import Lease, release_unused

logger = logging.getLogger("infinity")


def applies(layout, cfg) -> bool:
    """Whether the optimizer can run under backward with its states in host memory: a tier
    resident on the host (the cpu tier, or the device tier where the device is the CPU), an
    algorithm of ours (a torch optimizer steps all at once), and no all-gather of the new
    parameters (stages 1 and 2 over several ranks: a collective at a point that differs across
    ranks, as for nvme). With ``overlap = "auto"`` also where it can gain (`gains`)."""
    st = layout.states
    master = st.stores["master"]
    possible = bool(cfg.optimizer.overlap and st.groups and st.algorithm.name != "torch" and not master.uses_pool
                    and master.in_place_on(torch.device("cpu")) and not st.gather_params)  # fmt: skip
    return possible and (cfg.optimizer.overlap is True or gains(layout.device, cfg))


def gains(device: torch.device, cfg) -> bool:
    """Whether early updates in host memory can take time off a step: the host's cores are
    free while backward computes on a GPU, or while it waits for parameters read from nvme.
    With the compute on the host and every parameter in memory, an early update only takes
    the cores backward needs, and copies the states first: the step takes longer (measured
    with benchmarks/small_layers.py)."""
    return device.type != "cpu" or cfg.tiers.params == "nvme"


def stages_params(device: torch.device, param_store) -> bool:
    """Whether the early updates write the new parameters to nvme under backward ([Note:
    parameters written under backward]): with the parameters on nvme, and the compute on a GPU,
    whose backward leaves the host's cores and the drive free. With the compute on the host,
    the writes (their checksums, their copies into aligned buffers) and the drive's share take
    what backward needs: on this project's 2-core machine, 97M parameters in nvme,cpu,cpu, the
    step's own phase halved (0.10 s against 0.22) but backward grew more (1.08-1.12 s against
    0.85-0.88), the step 1.57-1.61 s against 1.38 (benchmarks/scale_step.py --tiers
    nvme,cpu,cpu --hidden 768 --layers 12 --intermediate 2048 --vocab 8000 --overlap-disk 1)."""
    return device.type == "cuda" and param_store.uses_pool


def params_staged(plan, layout) -> bool:
    """Whether early updates in host memory (``plan``, an `_admission.Plan`, stages them) write
    the new parameters to nvme under backward ([Note: parameters written under backward])."""
    return bool(plan.staging) and stages_params(layout.device, layout.param_store)


def fit(layout, cfg, room: int) -> int:
    """Host bytes the staged copies may take (0: the optimizer runs after backward): ``room``,
    what the plan leaves beside the backward's pool buffers and the step's own (the gradients it
    reads, where they are on nvme; `_admission.make_plan`), if it holds one sub-group's."""
    if not applies(layout, cfg):
        return 0
    st = layout.states
    smallest = min(host_staged_bytes(st, g) for g in st.groups)
    if room < smallest:
        logger.info("optimizer.overlap: memory.host_budget leaves %d bytes beside the backward, less than one "
                    "sub-group's staged states (%d); the optimizer runs after backward", max(room, 0), smallest)  # fmt: skip
        return 0
    return room


class _Staging:
    """Host buffers for staged copies, at most ``budget`` bytes held, staged and free together.

    [Note: staging without churn]
    Where CUDA is, a buffer is pinned when it is made (cudaHostRegister) and unpinned when it
    is given up (cudaHostUnregister): 3.4 ms and 25.8 ms for a sub-group's buffer of the 953M
    model on the H200 machine, on the thread that hands the updates over, under backward.
    Matched by exact shape and taken one at a time, buffers were given up and made again every
    step where the budget staged only part of the sub-groups (36 of each a step there: 1.05 s of
    the hand-over's 1.10, benchmarks/gpu_step.py's profile). So a buffer serves any request it
    holds, whatever it served before: the smallest free one that holds it (by bytes), if it
    is at most an eighth (and a page) larger: a copy of a state becomes the state at commit,
    with the buffer's spare bytes, which staging no longer counts; a
    sub-group's requests are taken together or not at all (`take_all`); free buffers are given
    up only where that makes the whole sub-group fit. A buffer that becomes a state's tensor at
    commit is exchanged for the one it replaces (`exchange`), so next step each staged sub-group
    finds the buffers its own commit gave back: once the first step has made them, a step makes
    and gives up none (`allocated` counts them)."""

    def __init__(self, budget: int, pin: bool):
        self.budget = budget
        self.pin = pin
        self.bytes = 0  # the bytes of the buffers held, staged and free together
        self.allocated = 0  # buffers made, ever
        self._warned = False  # making one failed once (said once)
        self._held: dict[int, torch.Tensor] = {}  # data_ptr -> the whole buffer (uint8), staged or free
        self._free: list[tuple[int, int]] = []  # (bytes, data_ptr) of the free ones, sorted

    def take_all(self, requests) -> list[torch.Tensor] | None:
        """A tensor for each ``(shape, dtype, page_aligned)`` of ``requests`` (contents
        undefined), or None and nothing taken: no room for all of them. ``page_aligned``: the
        tensor may be written to nvme directly (a new parameter: [Note: parameters written
        under backward]); a state's former tensor, exchanged in, is aligned as torch's
        allocator left it (64 bytes), and serves only the others."""
        needs = [max(_nbytes(shape, dtype), 1) for shape, dtype, _ in requests]
        free, chosen = list(self._free), {}
        for i in sorted(range(len(needs)), key=lambda i: -needs[i]):  # the largest first: then best fit is optimal
            at, most = bisect.bisect_left(free, (needs[i], -1)), needs[i] + needs[i] // 8 + 4096
            while requests[i][2] and at < len(free) and free[at][0] <= most and free[at][1] % mmap.PAGESIZE:
                at += 1
            if at < len(free) and free[at][0] <= most:
                chosen[i] = free.pop(at)[1]
        new = sum(n for i, n in enumerate(needs) if i not in chosen)
        if self.bytes + new > self.budget:
            if self.bytes - sum(n for n, _ in free) + new > self.budget:
                return None  # not even giving up every spare buffer makes room: nothing changes
            while self.bytes + new > self.budget:
                n, ptr = free.pop()  # the largest spare first: the fewest given up
                del self._held[ptr]
                self.bytes -= n
        self._free = free
        try:
            for i, n in enumerate(needs):
                if i not in chosen:
                    chosen[i] = self._make(n)
        except (RuntimeError, OSError, MemoryError) as e:  # no memory to map, or to pin (cudaHostRegister)
            for ptr in chosen.values():
                self._put(ptr)
            if not self._warned:
                self._warned = True
                logger.warning("optimizer.overlap: %d bytes of staging could not be allocated (%s); the "
                               "sub-groups that needed them are updated by the step instead", new, e)  # fmt: skip
            return None
        return [self._held[chosen[i]][: _nbytes(shape, dtype)].view(dtype).view(shape)
                for i, (shape, dtype, _) in enumerate(requests)]  # fmt: skip

    def give(self, t: torch.Tensor) -> None:
        """``t``, taken from here, is free again: a staged copy discarded or written."""
        self._put(t.data_ptr())

    def exchange(self, staged: torch.Tensor, replaced: torch.Tensor) -> None:
        """``staged``, taken from here, became a state's tensor, in place of ``replaced``, which
        is a free buffer from now on (the bytes held stay the same where they are the same)."""
        base = self._held.pop(staged.data_ptr())
        self.bytes -= base.numel()
        flat = replaced.detach().reshape(-1)
        if not replaced.is_contiguous() or flat.data_ptr() % 64:
            return  # not a buffer of its own: left to the store's owner
        base = flat.view(torch.uint8)
        self._held[base.data_ptr()] = base
        self.bytes += base.numel()
        self._put(base.data_ptr())

    def _make(self, nbytes: int) -> int:
        # Page-aligned (and pinned where CUDA is): a staged tensor written to nvme (the new
        # parameters, [Note: parameters written under backward]) goes to the drive directly,
        # with no bounce buffer taken from the pool inside a hook.
        base = empty_aligned(nbytes, pin=self.pin)
        self._held[base.data_ptr()] = base
        self.bytes += nbytes
        self.allocated += 1
        return base.data_ptr()

    def _put(self, ptr: int) -> None:
        bisect.insort(self._free, (self._held[ptr].numel(), ptr))


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class _Back:
    """A `Lease` buffer that gives a staging tensor back once its write is done."""

    __slots__ = ("_staging", "_tensor")

    def __init__(self, staging: _Staging, tensor: torch.Tensor):
        self._staging, self._tensor = staging, tensor

    def release(self) -> None:
        if self._tensor is not None:
            self._staging.give(self._tensor)
            self._tensor = None


class InMemory:
    """The staging of early updates with the optimizer states in host memory (see [Note:
    staged in host memory]), for `_overlap.Overlap`. ``budget``: the host bytes their staged
    copies may take; ``disk_room``: the staged parameter bytes on nvme at once (0: none written
    early; None: every sub-group's).

    [Note: early updates on a worker]
    Autograd's hooks only hand the work over: `_update_now`, called from the hook that stored a
    sub-group's last gradient, does the bookkeeping (what the update assumes, staging tensors,
    the gradients lent) and starts each gradient's copy from a GPU into a pinned pool buffer on
    the copy-back stream; one worker thread then copies the states into staging, waits for the
    gradients' copies (CUDA events), runs the kernel and casts the new parameters, while
    backward goes on (the copies and the kernels release the GIL). The worker touches only what
    it was handed; the step waits for every job before it commits or discards one (`finish`,
    `delete_staged`), and a job's error is raised there.

    [Note: parameters written under backward]
    With the parameters on nvme (ZeRO-Infinity's nvme,cpu,cpu), the step after backward had
    each committed sub-group's new parameters to write, and waited for them: 2 bytes a parameter
    in bf16, 1.9 GB a step of the 953M model, about 0.7 s at the 2.76 GB/s the H200 machine's
    drive wrote between the pairs of benchmarks/gpu_step.py, while the drive
    sits idle through backward (the parameters forward read stay on the GPU for it). So once a
    sub-group's job is done, the next hook writes its new parameters under their staged names
    (``~next``, as `_overlap` stages on nvme), behind; a commit renames them (no copy), a
    discard deletes them. They take disk beside the state: `_footprint` counts them, and
    ``disk_room`` (`Footprint.staging_room`, within ``optimizer.overlap_disk`` of the state;
    None: all of them) bounds the staged bytes on disk at once: past it, or where a write finds
    no room, a sub-group's parameters are written at the commit, as before. A staged write that
    failed is redone at the commit under the real name from the staging tensor, which stays
    until then."""

    def __init__(self, optimizer, budget: int, *, disk_room: int | None = 0):
        self.disk_room = disk_room
        self.tensors = _Staging(budget, pin=torch.cuda.is_available())
        self._param_writes: dict[int, tuple[list, int]] = {}  # sub-group -> (its staged writes, their bytes)
        # sub-group -> (state copies, unit -> new params, unit -> a pool copy of them to keep:
        # [Note: parameters kept in the pool] in `_param_cache`)
        self._copies: dict[int, tuple[list, dict, dict]] = {}
        self._jobs: dict[int, Future] = {}  # sub-group -> its update on the worker (`Overlap.submit`)

    @property
    def budget(self) -> int:
        return self.tensors.budget

    def in_hand(self) -> set[int]:
        return set()  # a sub-group is staged (`Overlap.staged`) as soon as it is handed over

    # -- backward: each sub-group is handed to the worker as soon as it is ready ------------
    def pump(self, ov, block: bool) -> None:
        """Hand over the sub-groups that are ready, in order; one whose gradient is still being
        written waits for a later call, or with ``block`` (the step is due) is left to the step."""
        with region("infinity::optimizer.early"):  # the hand-over, on this thread
            while ov.ready:
                if self._update_now(ov, ov.ready[0]) or block:
                    ov.ready.popleft()
                else:
                    break
            self._write_done(ov)

    def _write_done(self, ov) -> None:
        """Start writing the new parameters of the sub-groups whose jobs are done, under their
        staged names, as far as ``disk_room`` goes ([Note: parameters written under backward])."""
        opt = ov.opt
        store = opt.param_store
        if self.disk_room == 0 or not store.uses_pool:
            return
        for index, job in list(self._jobs.items()):
            if index in self._param_writes or not job.done() or job.exception() is not None:
                continue
            early = ov.staged[index]
            nbytes = sum(opt.record(u).nbytes("param") for u in early.units)
            staged = sum(n for _, n in self._param_writes.values())
            if self.disk_room is not None and staged + nbytes > self.disk_room:
                return  # the commit writes it and the rest
            _, params, pooled = self._copies[index]
            futures = []
            try:
                for u in early.units:
                    futures.append(store.put(opt.record(u).name_for(staged=True), params[u.index], timeout=0,
                                             kept_copy=pooled.pop(u.index, None)))  # fmt: skip
            except BaseException as e:  # the writes started are finished (their buffers back), none kept
                settle(futures)
                for u in early.units:
                    store.discard(opt.record(u).name_for(staged=True))
                if isinstance(e, (OutOfSpace, PoolExhausted, OSError)):
                    return  # no room now: the commit writes them
                raise
            self._param_writes[index] = (futures, nbytes)

    def _update_now(self, ov, index: int) -> bool:
        """Start sub-group ``index``'s update on staged copies of its states (on the worker);
        left to the step when staging has no room or the pool none for a gradient's copy.
        False: a gradient is being written (read back once written, not by waiting here)."""
        opt = ov.opt
        sg = opt.groups[index]
        early = ov.begin(index)
        if not isinstance(early, _Early):
            return early
        transport = opt.grads.transport
        states, copies, params, leases, grads, pooled = [], [], {}, [], {}, {}
        try:
            states = [opt.states[kind].get(sg.record.name_for()).result().tensor for kind in opt.kinds]  # lent in place
            wanted = [(src.shape, src.dtype, False) for src in states]
            wanted += [((sg.slices[u.index].stop - sg.slices[u.index].start,), opt.param_dtype, True) for u in early.units]
            taken = self.tensors.take_all(wanted)  # all or none: [Note: staging without churn]
            if taken is None:
                raise _NoRoom
            copies = taken[: len(states)]
            params = {u.index: t for u, t in zip(early.units, taken[len(states) :])}
            for u in early.units:  # the worker casts the new parameters into these too, to keep
                spare = opt.param_store.spare_buffer(params[u.index].numel() * opt.param_dtype.itemsize)
                if spare is None:
                    break
                pooled[u.index] = spare
            host = copies[0].device
            for u in early.units:
                early.versions[u.index] = opt.grads.version[u.index]
                lease = opt.grads.lend(u, timeout=0).result()
                leases.append(lease)
                grads[u.index] = transport.to_reader(lease.tensor, host, timeout=0)  # from a GPU: arriving
            ov.assume(early)
        except (_NoRoom, PoolExhausted):  # the step updates it
            _drop(grads, leases, (*copies, *params.values()), self.tensors, pooled)
            return True
        except BaseException:
            _drop(grads, leases, (*copies, *params.values()), self.tensors, pooled)
            raise
        self._jobs[index] = ov.submit(_run, opt, early, states, copies, params, grads, leases, pooled)
        ov.staged[index] = early
        self._copies[index] = (copies, params, pooled)
        return True

    def _wait(self, index: int) -> BaseException | None:
        """Wait for sub-group ``index``'s job, if one was handed over; its error, if it failed."""
        job = self._jobs.pop(index, None)
        if job is None:
            return None
        try:
            job.result()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            return e
        return None

    def relieve(self, ov) -> None:
        """Nothing to give back now: the staged copies are host tensors of their own, and a
        job's pool buffers (its gradients' copies from a GPU) go back when the job is done."""

    # -- the step ---------------------------------------------------------------------------
    def finish(self, ov) -> None:
        """Before the commit: every sub-group ready is handed over and every job finished; the
        first that failed is raised."""
        self.pump(ov, block=True)
        error = None
        for index in list(self._jobs):
            e = self._wait(index)
            if e is not None and error is None:
                error = e
        if error is not None:
            raise error

    def commit_one(self, ov, index: int, early: _Early) -> None:
        copies, params, pooled = self._copies.pop(index)
        try:
            self._commit_params(ov, index, early, copies, params, pooled)
        finally:
            _release(pooled)  # those no write took

    def _commit_params(self, ov, index: int, early: _Early, copies, params, pooled) -> None:
        opt = ov.opt
        sg = opt.groups[index]
        for kind, t in zip(opt.kinds, copies):
            self.tensors.exchange(t, opt.states[kind].swap(sg.record.name_for(), t))
        opt.substates.forget_views(index)  # the replaced ones are the staging's now
        if self._renamed(ov, index, early):
            for u in early.units:
                self.tensors.give(params[u.index])
            return
        st = opt.substates
        transport = opt.grads.transport
        for u in early.units:
            new = params[u.index]
            store = opt.param_store
            if store.uses_pool:  # nvme: written behind the step, from the staged tensor
                st.param_writes.add(store.put(u.name, new, kept_copy=pooled.pop(u.index, None)),
                                    Lease(new, _Back(self.tensors, new)))  # fmt: skip
                continue
            dst = store.writable(u.name).tensor  # resident: the tier's own tensor
            if dst.device.type == "cuda" and transport is not None and transport.pipelined:
                # From pinned staging on the side stream; the staging tensor goes back once the
                # copy is done (`Copies.drain`), and the next forward waits on its event.
                transport.to_device(Lease(new.view(dst.shape), _Back(self.tensors, new)), dst)
            else:
                store.put(u.name, new).result()
                self.tensors.give(new)

    def _renamed(self, ov, index: int, early: _Early) -> bool:
        """Sub-group ``index``'s parameters written under backward take their real names; False
        where none were written, or a write failed (their staged names are deleted then)."""
        written = self._param_writes.pop(index, None)
        if written is None:
            return False
        store = ov.opt.param_store
        names = [ov.opt.record(u).name_for(staged=True) for u in early.units]
        if settle(written[0]) is not None:
            for name in names:
                store.discard(name)
            return False
        for u, name in zip(early.units, names):
            store.rename(name, ov.opt.record(u).name_for())
        return True

    def discard(self, ov) -> None:
        pass  # every update handed over is staged (`Overlap.staged`): `delete_staged` drops each

    def delete_staged(self, ov, early: _Early) -> None:
        self._wait(early.index)  # its error does not matter: it is discarded
        written = self._param_writes.pop(early.index, None)
        if written is not None:
            settle(written[0])
            for u in early.units:
                ov.opt.param_store.discard(ov.opt.record(u).name_for(staged=True))
        copies, params, pooled = self._copies.pop(early.index, ([], {}, {}))
        for t in (*copies, *params.values()):
            self.tensors.give(t)
        _release(pooled)


def _run(opt, early: _Early, states, copies, params, grads, leases, pooled) -> None:
    """On the worker: sub-group ``early.index``'s update on staged copies of ``states`` from
    ``grads`` (host tensors, or copies from a GPU still arriving); the gradients' leases go back
    when it is done, whatever happens."""
    sg = opt.groups[early.index]
    try:
        for src, dst in zip(states, copies):
            dst.copy_(src)
        here = {i: p.result().tensor for i, p in grads.items()}  # a copy from a GPU: waits for its event
        opt.apply(early.index, copies[0], copies[1:], here, early.divide, early.steps, early.first)
        for u in early.units:
            params[u.index].copy_(copies[0][sg.slices[u.index]])
            if u.index in pooled:  # the copy to keep, made here rather than on the thread of the hooks,
                new = params[u.index]  # then set aside: any acquire until the write may take its room
                pooled[u.index].view(new.dtype, tuple(new.shape)).copy_(new)
                pooled[u.index].set_aside()
    finally:
        _drop(grads, leases, (), None)


def _drop(grads: dict, leases: list, staged, staging, pooled=None) -> None:
    """Give back what a sub-group's update held: its gradients on the host (a copy from a GPU
    once it is done: the DMA writes it), the gradients' leases, staging tensors, and the pool
    buffers its new parameters were to be kept in."""
    release_unused(grads.values())
    grads.clear()
    for lease in leases:
        lease.release()
    leases.clear()
    for t in staged:
        staging.give(t)
    _release(pooled or {})


def _release(pooled: dict) -> None:
    """Give back the pool copies of new parameters no write took (`InMemory._copies`)."""
    for buffer in pooled.values():
        buffer.release()
    pooled.clear()


class _NoRoom(Exception):
    """Staging has no room for a sub-group's copies now."""


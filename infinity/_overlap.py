"""The optimizer under backward: sub-groups updated as their gradients become final, committed
at the step only when the step turns out to be the one they assumed.

Owns: which sub-groups wait for which units' gradients in the last micro-batch's backward,
the updates started early (their reads, their staged writes, the step counts and
hyperparameters they used), and their commit or discard. Touches: the optimizer (its stores,
kernels and step counts), the grads (their version per unit).

[Note: exact overlap]
A sub-group's update reads its states and its units' gradients and writes new states and
parameters; nothing else. Once every unit of the sub-group has received its last gradient of
the step, that update can run, except that the step may still (a) clip, since the global norm
is known only once backward ends, (b) be skipped, an fp16 overflow or a non-finite gradient
anywhere, (c) run with other hyperparameters, when the user changes them between backward and
step, or (d) see more gradients: another micro-batch, or a module run again in backward. So
the early update assumes none of these happens: clip coefficient 1 (what clipping multiplies
by when the norm is under the limit), the loss scale of now, the hyperparameters of now, and
the gradients of now (each unit's version). It writes its states and parameters under staged
names (``<name>~next``: `_substates.StateRecord.name_for`, [Note: state keys]), new extents
of the swap space, so the states and parameters under the real names stay those of the
previous step; its step counts are kept aside. At the step,
once everything is known, each early update whose assumptions all hold is committed: its
staged tensors take the real names (`infinity.swap.SwapSpace.rename`, no copy) and its step
counts replace the old ones. Every other one is discarded and its sub-group updated then, as
without overlap. A committed update ran the same kernel on the same inputs (old states,
final gradients, step counts, hyperparameters, gradient scale) as the step would have run,
so the result is bit-identical.

Overlap applies when the optimizer states and the parameters are both on nvme (staging
needs the swap space, and parameters on a resident tier would be visible to a forward run
again inside backward), with one rank or at stage 3 (stages 1 and 2 all-gather the new
parameters: a collective cannot run at a point that differs across ranks), and when the host
budget has room beside the backward for what the step plans (`_admission._fit_overlap`). The
staged copies take disk beside the state: only as many sub-groups are staged at once as the
disk room allows, the rest are updated by the step ([Note: disk footprint] in `_footprint`).
With the optimizer states in host memory instead, `_overlap_host.InMemory` stages the same
early updates on staged copies in host memory ([Note: staged in host memory]).
"""

from __future__ import annotations

import collections
import errno
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.profiler import record_function

from infinity.swap import OutOfSpace, PoolExhausted, WriteBehind

from ._bytes import group_bytes, staged_disk_bytes
from ._profile import region
from ._store import release_unused

MAX_IN_HAND = 4  # sub-groups being read or written at once, whatever their size


def on_worker(device: torch.device) -> bool:
    """Whether early updates run on a worker thread that the hooks hand them to ([Note: early
    updates on a worker] in `_overlap_host`): with the compute on a GPU, whose backward leaves
    the host's cores free. With the compute on the host, the hooks run them in place, as
    before the worker: there it can only compete for the cores backward needs, and it showed no
    gain on this project's 2-core machine (a 97M model with every tier on nvme: steps of 1.77
    and 2.01 s with the worker against 1.63 and 1.81 s without, though nearer their I/O floor,
    1.15 and 1.28x against 1.28 and 1.31x, the drive drifting between runs;
    benchmarks/scale_step.py --pairs 3 --hidden 768 --layers 12 --intermediate 2048 --vocab 8000)."""
    return device.type == "cuda"


class _Early:
    """One sub-group updated early: what it assumed, and what it wrote."""

    __slots__ = ("index", "versions", "steps", "first", "hyper", "divide", "units", "reads", "grads", "job", "held",
                 "tensors")  # fmt: skip

    def __init__(self, index: int):
        self.index = index
        self.versions: dict[int, int] = {}  # unit -> the gradient version it read
        self.steps: dict[int, torch.Tensor] = {}  # unit -> its step count after this update
        self.first: set[int] = set()  # units whose first step this is
        self.hyper: list | None = None
        self.divide = 1.0
        self.units: list = []  # the units updated (those with a gradient)
        self.reads: list = []  # Pendings of the state leases, in kind order
        self.grads: dict = {}  # unit -> Pending of its gradient lease
        self.job: Future | None = None  # its kernel on the worker, once read (`OnDisk._compute`)
        self.held: list = []  # the leases it holds then: the states' (in kind order), the gradients'
        self.tensors: list = []  # the states' tensors, which the kernel updates in place

    @property
    def arrived(self) -> bool:
        """Every read it waits for (its states, its gradients) is done."""
        return all(p.done() for p in self.reads) and all(p.done() for p in self.grads.values())


class Overlap:
    """Early updates of one step (see [Note: exact overlap]): which sub-groups wait for which
    units' final gradients, what each update assumed, and its commit or discard at the step.
    ``staging`` is where the results wait for the step: `OnDisk` (the states and parameters on
    nvme: written under staged names, renamed at commit) or `_overlap_host.InMemory` (the
    states in host memory: updated in staging copies, swapped in at commit). ``loss_scale()``:
    the loss scale gradients are multiplied by now; ``threaded``: the updates run on a worker
    thread (`on_worker`), else in the hooks."""

    def __init__(self, optimizer, loss_scale, staging, *, threaded: bool = False):
        self.opt = optimizer
        self.staging = staging
        self.threaded = threaded
        self.loss_scale = loss_scale
        self.group_of = {u.index: sg.index for sg in optimizer.groups for u in sg.units}
        self._waiting: dict[int, set[int]] = {}  # sub-group -> units whose final gradient is due
        # What the staging strategy works on: the sub-groups whose gradients are all final, in
        # order (it takes them), and the early updates it staged (it adds them; the commit and
        # the discard take them).
        self.ready: collections.deque[int] = collections.deque()
        self.staged: dict[int, _Early] = {}
        self._worker: ThreadPoolExecutor | None = None  # made on first use
        self.armed = False
        self.committed = 0  # sub-groups committed at the last step (for tests and stats)
        # Gradients kept in memory for sub-groups not started yet: at most one sub-group's.
        self.keep_bytes = 4 * max(sg.numel for sg in optimizer.groups)

    # -- backward ---------------------------------------------------------------------------
    def arm(self, expected) -> None:
        """The last micro-batch's forward ended: ``expected`` units will receive gradients."""
        self.armed = True
        self._waiting.clear()
        self.ready.clear()
        started = self.staging.in_hand()
        for u in expected:
            g = self.group_of.get(u.index)
            if g is not None and g not in self.staged and g not in started:
                self._waiting.setdefault(g, set()).add(u.index)

    def keep_grad(self, unit, nbytes: int) -> bool:
        """Keep ``unit``'s stored gradient in memory for its sub-group's early update? (The
        scheduler asks, for each gradient it hands to the grads tier.)"""
        return (self.armed and self.group_of.get(unit.index) in self._waiting
                and self.opt.grads.kept_bytes + nbytes <= self.keep_bytes)  # fmt: skip

    def disarm(self) -> None:
        """This backward is not the step's last: nothing is updated early in it."""
        self.armed = False
        self._waiting.clear()
        self.ready.clear()  # their gradients are about to change

    def unit_final(self, unit) -> None:
        """``unit``'s gradient of this backward is stored (it is final unless it comes again)."""
        if not self.armed:
            return
        g = self.group_of.get(unit.index)
        waiting = self._waiting.get(g)
        if waiting is None or unit.index not in waiting:
            return  # not expected (its sub-group is already started, or none waits): checked at commit
        waiting.discard(unit.index)
        if not waiting:
            del self._waiting[g]
            self.ready.append(g)
        self.pump()

    def backward_ended(self) -> None:
        self.armed = False
        self._waiting.clear()
        self.pump()

    def pump(self, block: bool = False) -> None:
        """Start what can start and finish what has arrived; with ``block``, all of it."""
        self.staging.pump(self, block)

    # -- what the staging strategies share --------------------------------------------------
    def begin(self, index: int) -> "_Early | bool":
        """A record of sub-group ``index``'s early update, or what to tell the pump without one:
        True where none of its units has a gradient (nothing to update early; the step finds
        it without one too), False where a gradient is still being written (read back once
        written, not by waiting for the write here)."""
        opt = self.opt
        early = _Early(index)
        early.units = [u for u in opt.groups[index].units if u.index in opt.grads.has_grad]
        if not early.units:
            return True
        if any(opt.grads.writing(u.index) for u in early.units):
            return False
        return early

    def assume(self, early: "_Early") -> None:
        """What ``early``'s update assumes, from now: the loss scale, the hyperparameters, the
        step counts; the commit checks them against the step's (see [Note: exact overlap])."""
        opt = self.opt
        early.divide = self.loss_scale()
        early.hyper = opt.hyperparameters()
        early.first = {u.index for u in early.units} & opt.substates.never_stepped
        early.steps = {u.index: opt.steps[u.index] + 1 for u in early.units}

    def submit(self, fn, *args) -> Future:
        """``fn(*args)`` on the worker thread, in the order handed over; or now, on this thread,
        where not ``threaded`` (its error then in the future, as the worker's)."""
        if not self.threaded:
            done: Future = Future()
            try:
                with region("infinity::optimizer.early_kernel"):
                    fn(*args)
            except BaseException as e:  # noqa: BLE001 - raised where the result is read, as the worker's
                done.set_exception(e)
            else:
                done.set_result(None)
            return done
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infinity-optimizer")

        def run():  # a range on the worker's thread: a profiler that records every thread shows it
            with record_function("infinity::optimizer.early_kernel"):
                fn(*args)

        return self._worker.submit(run)

    def relieve(self) -> None:
        """The backward needs pool memory that is not free: give back what the early updates
        hold (what the staging holds in the pool, and the gradients kept in memory: they are
        stored in the grads tier); the sub-groups not started go to the step."""
        self.staging.relieve(self)
        self.ready.clear()
        self._waiting.clear()
        self.opt.grads.drop_kept()

    # -- the step ---------------------------------------------------------------------------
    def commit(self, divide: float) -> set[int]:
        """Finish every early update, then commit those whose assumptions hold (``divide``: the
        gradient divisor the step uses); discard the rest. Returns the committed sub-groups.
        An update that failed is raised here, after every early update is discarded."""
        try:
            self.staging.finish(self)
        except BaseException:
            self.discard()
            raise
        opt = self.opt
        hyper = opt.hyperparameters()
        done = set()
        try:
            for index, early in list(self.staged.items()):
                sg = opt.groups[index]
                valid = (
                    early.divide == divide
                    and early.hyper == hyper
                    and all(opt.grads.version.get(i) == v for i, v in early.versions.items())
                    and {u.index for u in sg.units if u.index in opt.grads.has_grad} == set(early.versions)
                )
                if not valid:
                    continue
                self.staging.commit_one(self, index, early)
                for u in early.units:
                    opt.steps[u.index].copy_(early.steps[u.index])
                opt.substates.mark_stepped(early.steps)
                del self.staged[index]
                done.add(index)
        finally:
            self.discard()
            self.committed = len(done)
        return done

    def discard(self) -> None:
        """Forget every early update (their staged results are deleted) and the gradients kept
        for them (the step reads what it needs from the grads tier)."""
        self.committed = 0
        self.armed = False
        self._waiting.clear()
        self.ready.clear()
        self.staging.discard(self)
        self.opt.grads.drop_kept()
        for early in list(self.staged.values()):
            self.staging.delete_staged(self, early)
        self.staged.clear()

    def close(self) -> None:
        """The engine closes: every early update is forgotten, the worker stopped."""
        self.discard()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    @property
    def pending(self) -> int:
        """Sub-groups updated early and not yet committed or discarded."""
        return len(self.staged) + len(self.staging.in_hand())


class OnDisk:
    """The staging of early updates on nvme (see [Note: exact overlap]): each sub-group's
    states and gradients read into pool buffers, its kernel run, its results written under
    staged names; renamed at commit. ``budget``: the pool bytes the sub-groups in hand (reads
    issued, or written behind) may hold together; a sub-group larger than that is left to the
    step. ``disk_room``: the staged bytes the swap ``space`` may hold at once (None: all
    sub-groups); past it the step updates the rest. ``on_disk_full(why)`` is told when a staged
    write finds the disk full anyway (the engine then refuses to train)."""

    def __init__(self, optimizer, budget: int, *, disk_room: int | None = None, space=None, on_disk_full=None):
        self.budget = budget
        self.disk_room = disk_room
        self.on_disk_full = on_disk_full
        members = len(space.rank_dirs) if space is not None else 1
        self._disk = {sg.index: staged_disk_bytes(optimizer.substates, sg, members) for sg in optimizer.groups}
        self._bytes = {sg.index: group_bytes(optimizer.substates, sg) for sg in optimizer.groups}
        self._writes = WriteBehind(MAX_IN_HAND)  # keyed by sub-group
        self._reading: collections.deque[_Early] = collections.deque()
        self._computing: collections.deque[_Early] = collections.deque()  # read, their kernels on the worker

    def in_hand(self) -> set[int]:
        """Sub-groups started and not yet staged (being read, or computed)."""
        return {e.index for e in (*self._reading, *self._computing)}

    def _pool_bytes(self) -> int:
        """Pool bytes the sub-groups being read or written hold (finished writes are reaped)."""
        self._writes.poll()
        return (sum(self._bytes[e.index] for e in (*self._reading, *self._computing))
                + sum(self._bytes[i] for i in self._writes.keys()))  # fmt: skip

    def pump(self, ov: Overlap, block: bool) -> None:
        ready = ov.ready
        while ready:
            need = self._bytes[ready[0]]
            if need > self.budget or not self._disk_fits(ov, ready[0]):  # never in hand: the step updates it
                ready.popleft()
                continue
            in_hand = self._pool_bytes()  # reaps finished writes first
            busy = bool(self._reading or self._computing or len(self._writes))
            if busy and (in_hand + need > self.budget
                         or len(self._reading) + len(self._computing) + len(self._writes) >= MAX_IN_HAND):  # fmt: skip
                if not block:
                    break
                self._make_room(ov)
                continue
            if self._start(ov, ready[0]):
                ready.popleft()
                continue
            if not block:
                break  # no pool memory now, or a gradient still being written: later
            if busy:
                self._make_room(ov)
                continue
            ready.popleft()  # no room even alone (a fragmented pool): the step updates it
        self._finish(ov, block)

    def finish(self, ov: Overlap) -> None:
        """Before the commit: every update started is computed and staged."""
        self.pump(ov, block=True)

    def _disk_fits(self, ov: Overlap, index: int) -> bool:
        """Whether sub-group ``index``'s staged copies fit the disk room beside those staged."""
        if self.disk_room is None:
            return True
        staged = sum(self._disk[i] for i in ov.staged) + sum(self._disk[i] for i in self.in_hand())
        return staged + self._disk[index] <= self.disk_room

    def _make_room(self, ov: Overlap) -> None:
        """Finish the oldest sub-group in hand (its update, or its writes)."""
        if self._computing:
            self._write(ov, self._computing.popleft())
        elif self._reading:
            self._compute(ov, self._reading.popleft())
            self._write(ov, self._computing.popleft())
        else:
            self._writes.poll(keep=max(0, len(self._writes) - 1))

    def _finish(self, ov: Overlap, block: bool) -> None:
        """Hand the updates whose reads arrived to the worker, and write those it has done (all
        of them with ``block``, and drain)."""
        with region("infinity::optimizer.early"):  # the hand-over and the writes, on this thread
            while self._reading and (block or self._reading[0].arrived):
                self._compute(ov, self._reading.popleft())
            while self._computing and (block or self._computing[0].job.done()):
                self._write(ov, self._computing.popleft())
        if block:
            self._writes.drain()
        else:
            self._writes.poll()

    def _start(self, ov: Overlap, index: int) -> bool:
        """Issue the reads of sub-group ``index``'s states and gradients; False when the pool
        has no room now, or a gradient is still being written. Never waits: the backward's
        own buffers come first."""
        opt = ov.opt
        sg = opt.groups[index]
        early = ov.begin(index)
        if not isinstance(early, _Early):
            return early
        try:
            for kind in opt.kinds:
                early.reads.append(opt.states[kind].get(sg.record.name_for(), timeout=0))
            transport, host = opt.grads.transport, opt.substates.device
            for u in early.units:
                early.versions[u.index] = opt.grads.version[u.index]
                early.grads[u.index] = pending = opt.grads.lend(u, timeout=0)
                if opt.grads.store.device != host:  # the device tier, lent in place: brought to the host
                    lease = pending.result()
                    early.grads[u.index] = transport.to_reader(lease.tensor, host, timeout=0)
                    lease.release()
        except PoolExhausted:
            _give_back(early)
            return False
        self._reading.append(early)
        return True

    def _compute(self, ov: Overlap, early: _Early) -> None:
        """Hand ``early``'s update on what it read to the worker ([Note: early updates on a
        worker] in `_overlap_host`: the hooks only hand work over); it is written by `_write`."""
        opt = ov.opt
        try:
            for p in early.reads:
                early.held.append(p.result())
                early.tensors.append(early.held[-1].tensor)
            grads = {}
            for i, p in early.grads.items():  # on the host (`_start`)
                early.held.append(p.result())
                grads[i] = early.held[-1].tensor
            ov.assume(early)
        except BaseException:
            _undo(early, early.held, [])
            raise
        tensors = early.tensors
        early.job = ov.submit(opt.apply, early.index, tensors[0], tensors[1:], grads, early.divide, early.steps,
                              early.first)  # fmt: skip
        self._computing.append(early)

    def _write(self, ov: Overlap, early: _Early) -> None:
        """Write ``early``'s results (its kernel done: waited for here) under staged names."""
        opt = ov.opt
        sg = opt.groups[early.index]
        leases, futures = early.held, []
        try:
            early.job.result()
            for k, t in zip(opt.kinds, early.tensors):
                futures.append(opt.states[k].put(sg.record.name_for(staged=True), t))
            for u in early.units if not opt.one_copy else ():  # one copy: the staged master weights are them
                s = sg.slices[u.index]
                futures.append(opt.param_store.put(opt.record(u).name_for(staged=True), early.tensors[0][s],
                                                   copy=True, dtype=opt.param_dtype, timeout=0))  # fmt: skip
            ov.staged[early.index] = early
        except (PoolExhausted, OutOfSpace):  # no room in the pool or the capped arena: the step updates it
            _undo(early, leases, futures)
            self.delete_staged(ov, early)
            return
        except OSError as e:
            _undo(early, leases, futures)
            self.delete_staged(ov, early)
            if e.errno == errno.ENOSPC and self.on_disk_full is not None:
                why = (f"the disk under {e.filename or 'nvme.paths'} is full (errno {e.errno}, ENOSPC): the optimizer "
                       f"under backward could not write its staged states ({e.strerror}). The parameters and "
                       "optimizer states are those of the last step, but this step's gradients may be incomplete; "
                       "free space on that drive (or set a lower nvme.disk_budget, or optimizer.overlap = false), "
                       "then call engine.zero_grad() and load a checkpoint (engine.load_checkpoint) to train on")  # fmt: skip
                self.on_disk_full(why)
                raise OSError(e.errno, why, e.filename) from e
            raise
        except BaseException:
            _undo(early, leases, futures)
            raise
        # The state buffers go back once their staged writes are done; gradients now.
        state_leases, grad_leases = leases[: len(early.reads)], leases[len(early.reads) :]
        for lease in grad_leases:
            lease.release()
        early.held, early.tensors, early.job = [], [], None
        self._writes.add(futures, *state_leases, key=early.index)

    def relieve(self, ov: Overlap) -> None:
        """Reads in flight are dropped (their sub-groups go to the step), staged writes finish."""
        while self._reading:
            _give_back(self._reading.popleft())
        while self._computing:  # written, so that their buffers go back once the writes are done
            self._write(ov, self._computing.popleft())
        self._writes.drain()

    def commit_one(self, ov: Overlap, index: int, early: _Early) -> None:
        """Sub-group ``index``'s staged states and parameters take the real names."""
        opt = ov.opt
        sg = opt.groups[index]
        for kind in opt.kinds:
            opt.states[kind].rename(sg.record.name_for(staged=True), sg.record.name_for())
        for u in early.units if not opt.one_copy else ():  # one copy: renamed with the master weights above
            rec = opt.record(u)
            opt.param_store.rename(rec.name_for(staged=True), rec.name_for())

    def discard(self, ov: Overlap) -> None:
        """Forget the updates in hand (their kernels and writes finish first)."""
        while self._reading:
            _give_back(self._reading.popleft())
        while self._computing:
            early = self._computing.popleft()
            _undo(early, early.held, [])
        self._writes.discard_errors()

    def delete_staged(self, ov: Overlap, early: _Early) -> None:
        opt = ov.opt
        sg = opt.groups[early.index]
        for kind in opt.kinds:
            opt.states[kind].discard(sg.record.name_for(staged=True))
        for u in early.units:
            opt.param_store.discard(opt.record(u).name_for(staged=True))


def _undo(early: _Early, leases, futures) -> None:
    """Give back what an update that is not kept holds: its kernel and staged writes finish
    first (their errors do not matter: never committed), then its buffers go back."""
    if early.job is not None:
        try:
            early.job.result()
        except BaseException:  # noqa: BLE001 - dropped with the update
            pass
        early.job = None
    settle(futures)
    for lease in leases:
        lease.release()
    _give_back(early)


def settle(futures) -> BaseException | None:
    """Wait for every write of ``futures``; the first error, if one failed."""
    error = None
    for f in futures:
        try:
            f.result()
        except Exception as e:  # noqa: BLE001 - handed to the caller
            error = error or e
    return error


def _give_back(early: _Early) -> None:
    """Wait for ``early``'s reads and give their buffers back (errors dropped: unused)."""
    release_unused((*early.reads, *early.grads.values()))
    early.reads, early.grads = [], {}

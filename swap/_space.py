"""SwapSpace: named tensors in preallocated arena files, striped over one directory per drive."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import torch

from infinity import aio
from infinity._interrupts import held_interrupts

from ._arenas import Arenas, run_all
from ._checksum import Checker, SwapCorruption
from ._checksum import checksum as compute_checksum
from ._common import ALIGNMENT, VERIFY_MODES, round_up
from ._inflight import InFlight
from ._io import Transfer, as_uint8
from ._manifest import DTYPES, Extent, TensorRecord, dtype_name
from ._pool import HostBuffer, HostBufferPool, PoolExhausted


class SwapFuture:
    """Completion of one `SwapSpace.put` or `SwapSpace.get`.

    ``result()`` waits, finishes the operation (for a put: records the tensor; for a get:
    copies staged bytes, checks the checksum) and returns its value, or raises its error; every
    call after the first returns or raises the same. ``done()`` polls. An interrupt
    (KeyboardInterrupt) while ``result()`` waits or finishes leaves the future unfinished: the
    next ``result()`` (or the space's `flush`/`close`, which finish every pending operation)
    waits again and finishes it, so a caught Ctrl-C loses nothing.
    """

    __slots__ = ("_transfer", "_finish", "_value", "_error", "_finished")

    def __init__(self, transfer: Transfer | None, finish: Callable[[BaseException | None], object]):
        self._transfer = transfer
        self._finish = finish  # finish(error) -> value; may run again after an interrupt
        self._finished = False
        self._value = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._finished or self._transfer is None or self._transfer.done()

    def result(self):
        if not self._finished:
            # Only Exceptions are the operation's outcome. KeyboardInterrupt and SystemExit
            # propagate from here with nothing marked: the wait and the finish run again.
            error = None
            try:
                if self._transfer is not None:
                    self._transfer.wait()
            except OSError as e:
                error = e
            try:
                self._value = self._finish(error)
            except Exception as e:  # noqa: BLE001 - kept and re-raised to every caller
                self._error = e
            self._finished = True
            self._transfer = self._finish = None
        if self._error is not None:
            raise self._error
        return self._value

    wait = result


class SwapSpace:
    """Tensors stored under stable names in arena files under ``dirs`` (one per drive).

    A directory of ``dirs`` that does not exist is created (0700) when its parent does. Each
    gets a per-rank subdirectory ``rank{rank}`` (0700) with an arena file (0600), a
    ``space.json`` naming the space and a lock held while the space is open; the first
    directory's also holds the manifest. Two entries of ``dirs`` that are one directory (a
    symlink to another entry, say) are an error. A tensor of ``stripe_threshold`` bytes or more
    is split over all directories in pieces of whole ``stripe_size`` units, written and read in
    parallel; a smaller one goes to the directory with the least data.

    Arena files grow (preallocated) as tensors need room: by doubling from 1 MiB up to
    ``grow_step`` at a time, or, with ``doubling=False``, by ``grow_step`` from the first
    tensor on (for a space whose size is known: a checkpoint's, which doubling could grow to
    twice what it holds, failing on a disk that had room for it). `close` shrinks each to the
    end of its last tensor, so a closed space takes the disk its tensors need; with
    ``keep=False`` it removes the space's files (and the directories it created, once empty)
    instead: for scratch nothing reads later.

    Every put records an xxh3-64 checksum of the tensor ([Note: checksums]). ``verify`` says
    when reads check it: "always" (the default), every `get`, before its result is handed out,
    on threads of the space's own ([Note: reads checked off the caller's thread] in
    `_checksum`); "off" and "checkpoint", never on `get` ("checkpoint" is for the layers above:
    checkpoint loads check): a byte changed on the drive is then read back silently.
    Opening a directory that holds a manifest resumes that space; ``fresh=True`` first removes
    the files the old manifest lists (or, when it cannot be read, the files whose names only a
    swap space makes), nothing else. Files in a rank directory that a space does not make are an
    error unless ``allow_foreign=True``. Only regular files are opened: an arena, manifest,
    space.json or lock that is a symlink, a FIFO or a device is refused, naming it.
    """

    def __init__(
        self,
        dirs: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        rank: int = 0,
        engine: aio.Engine | None = None,
        pool: HostBufferPool | None = None,
        verify: str = "always",
        fresh: bool = False,
        allow_foreign: bool = False,
        keep: bool = True,
        stripe_size: int = 1 << 20,
        stripe_threshold: int = 8 << 20,
        grow_step: int = 256 << 20,
        host_budget: int = 1 << 30,
        doubling: bool = True,
    ):
        dirs = [dirs] if isinstance(dirs, (str, os.PathLike)) else list(dirs)
        if not dirs:
            raise ValueError("dirs is empty: a swap space needs at least one directory")
        if verify not in VERIFY_MODES:
            raise ValueError(f"{verify=} is not one of {', '.join(VERIFY_MODES)}")
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"{rank=} must be a non-negative int")
        for key, value in (("stripe_size", stripe_size), ("grow_step", grow_step)):
            if value <= 0 or value % ALIGNMENT:
                raise ValueError(f"{key}={value} must be a positive multiple of {ALIGNMENT}")
        self.verify = verify
        self.rank = rank
        self.keep = keep
        self.stripe_size = stripe_size
        self.stripe_threshold = stripe_threshold
        self.grow_step = grow_step
        self.rank_dirs: list[str] = []
        self._closed = True  # until everything below is set up
        self._inflight = InFlight()  # the puts and gets not finished, the names whose write failed
        self._own_engine = engine is None
        self._own_pool = pool is None
        self.engine = engine
        self.pool = pool
        self._arenas = Arenas([os.fspath(d) for d in dirs], rank=rank, fresh=fresh, allow_foreign=allow_foreign,
                              stripe_size=stripe_size, stripe_threshold=stripe_threshold, grow_step=grow_step,
                              doubling=doubling)  # fmt: skip
        self.rank_dirs = self._arenas.rank_dirs
        self.space_id = self._arenas.manifest.space_id  # the manifest's and every member's space.json
        self._records: dict[str, TensorRecord] = self._arenas.records_at_open  # names whose bytes are on disk
        self._checker: Checker | None = None
        try:
            self._checker = Checker(threads=min(8, max(2, len(dirs))))  # hashes reads as they land
            if self.engine is None:
                self.engine = aio.open_engine(queue_depth=32 * len(dirs))
            if self.pool is None:
                self.pool = HostBufferPool(host_budget, engine=self.engine, slab_size=min(64 << 20, host_budget))
        except BaseException:
            try:
                self._release()
            finally:
                self._arenas.remove_dirs()  # those this open made, where still empty
            raise
        self._closed = False

    # -- the API ----------------------------------------------------------------------------
    def put(self, name: str, tensor: torch.Tensor, *, checksum: bool | None = None) -> SwapFuture:
        """Write ``tensor`` under ``name`` (replacing what was there), with its checksum (see
        [Note: checksums]); do not modify the tensor until the future is done. The future's
        result is the name's new `TensorRecord` (a new object at every put and rename). ``checksum`` is
        accepted as True or None for callers written when checksums were optional; False is
        refused (every put records one)."""
        self._check_open()
        if checksum is False:
            raise ValueError("checksum=False: every put records the tensor's checksum; the space's verify "
                             "says when reads check it")  # fmt: skip
        if not isinstance(name, str) or not name or "\0" in name:
            raise ValueError(f"tensor names are non-empty strings without NUL, got {name!r}")
        dtype = dtype_name(tensor.dtype)
        data = as_uint8(tensor)
        self._inflight.settle(name)  # no read or write of the old bytes in flight
        old = self._records.get(name)
        plan = self._arenas.plan(data.numel())
        if old is not None and [(e.file, round_up(e.nbytes)) for e in old.extents] == [
            (k, round_up(n)) for k, n in plan
        ]:
            extents = tuple(Extent(e.file, e.offset, n) for e, (_, n) in zip(old.extents, plan))  # in place
        else:
            if old is not None:
                # Forgotten and freed as one: a Ctrl-C between them (caught by a training loop)
                # left the name on free space, which the next tensor written took; read back, the
                # name gave that tensor's bytes (an audit helper's repro).
                with held_interrupts:
                    del self._records[name]
                    self._arenas.free(old)
            extents = self._arenas.allocate(plan)
        record = TensorRecord(name=name, dtype=dtype, shape=tuple(tensor.shape), nbytes=data.numel(),
                              extents=extents, generation=(old.generation + 1) if old else 1)  # fmt: skip
        self._records.pop(name, None)  # readable again once the write is done
        self._inflight.failed.pop(name, None)
        try:
            transfer = Transfer(self.engine, self._arenas.files, extents, data, write=True, alloc=self._stage,
                                name=name) if extents else None  # fmt: skip
        except BaseException as e:
            self._arenas.free(record)
            self._inflight.failed[name] = (e, record)
            raise

        def finish(error):
            # Each step may run again after an interrupt (see SwapFuture), so each is idempotent.
            if error is None:
                if record.checksum is None:  # put was interrupted before it computed it
                    record.checksum = compute_checksum(data.numpy())
                self._records[name] = record
            elif self._inflight.failed.get(name, (None,))[0] is not error:
                self._inflight.failed[name] = (error, record)
                self._arenas.free(record)  # the bytes are not what the name says: forget it
            self._inflight.done(name, fut)
            if error is not None:
                raise error
            return record

        fut = SwapFuture(transfer, finish)
        self._inflight.add(name, fut, write=True)
        record.checksum = compute_checksum(data.numpy())  # overlaps the write (tracked already)
        return fut

    def get(self, name: str, out: torch.Tensor | None = None, *, verify: bool | None = None,
            timeout: float | None = None, urgent: bool = False) -> SwapFuture:  # fmt: skip
        """Read ``name``: into ``out`` (same dtype and shape; the result is ``out``) or, with
        ``out=None``, into a buffer from the pool (the result is a `HostBuffer`: use
        ``.view(dtype, shape)``, then ``release()`` it), waiting at most ``timeout`` seconds
        for pool memory (PoolExhausted after). ``verify``: check the checksum (SwapCorruption
        naming the tensor, its file and offset on a mismatch, raised by ``result()`` before it
        hands out a byte); None follows the space's ``verify`` (checks under "always").
        ``urgent``: needed now, read before the reads waiting that are not (`aio.Engine.pread`)."""
        self._check_open()
        record = self.info(name)  # the engine does not order requests: read after the write
        dtype = DTYPES[record.dtype]
        lease: HostBuffer | None = None
        if out is None:
            lease = self.pool.acquire(max(round_up(record.nbytes), ALIGNMENT), timeout=timeout)
            data = lease.tensor[: record.nbytes]
        else:
            if out.dtype != dtype or tuple(out.shape) != record.shape:
                raise ValueError(
                    f"out is {out.dtype} {tuple(out.shape)}, tensor {name!r} is {dtype} {record.shape}"
                )
            data = as_uint8(out)
        check = self.verify == "always" if verify is None else verify
        try:
            transfer = Transfer(self.engine, self._arenas.files, record.extents, data, write=False, alloc=self._stage,
                                name=name, urgent=urgent) if record.extents else None  # fmt: skip
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        if check and transfer is not None:
            # Waited for and hashed on the checker's threads: the SwapFuture's wait is the check's.
            transfer = self._checker.check(transfer, data, record.checksum,
                                           lambda actual: self._corruption(record, actual))  # fmt: skip

        def finish(error):
            # An interrupt (not an Exception) keeps the lease: the next result() finishes.
            try:
                if error is not None:
                    raise error
                if check and transfer is None:  # an empty tensor's: no read to check on a thread
                    actual = compute_checksum(data.numpy())
                    if actual != record.checksum:
                        raise self._corruption(record, actual)
            except Exception:
                if lease is not None:
                    lease.release()
                self._inflight.done(name, fut)
                raise
            self._inflight.done(name, fut)
            return out if lease is None else lease

        fut = SwapFuture(transfer, finish)
        self._inflight.add(name, fut)
        return fut

    def _corruption(self, record: TensorRecord, actual: str) -> SwapCorruption:
        first = record.extents[0] if record.extents else Extent(0, 0, 0)
        return SwapCorruption(record.name, self._arenas.files[first.file].path, first.offset, record.checksum, actual)

    def delete(self, name: str) -> None:
        self._check_open()
        self._inflight.settle(name)
        self._inflight.failed.pop(name, None)
        record = self._records.pop(name, None)
        if record is None:
            raise KeyError(f"no tensor {name!r} in swap space {self.rank_dirs[0]}")
        self._arenas.free(record)

    def rename(self, src: str, dst: str) -> None:
        """Give ``src``'s bytes the name ``dst``, replacing what ``dst`` held (whose extents
        are freed); ``src`` is gone after. Nothing is copied: the manifest's next write
        records the new name."""
        self._check_open()
        if src == dst:
            raise ValueError(f"rename of {src!r} onto itself")
        self._inflight.settle(src)
        self._inflight.settle(dst)
        record = self.info(src)  # raises naming src (and its failed write) when it has none
        with held_interrupts:  # one change (see `put`)
            old = self._records.pop(dst, None)
            if old is not None:
                self._arenas.free(old)
            del self._records[src]
            self._inflight.failed.pop(dst, None)
            self._records[dst] = dataclasses.replace(record, name=dst, generation=(old.generation + 1) if old else 1)

    def names(self) -> list[str]:
        return list(self._records)

    @property
    def files(self) -> tuple[aio.File, ...]:
        """The open arena files, one per directory, in the manifest's order (read-only)."""
        return tuple(self._arenas.files)

    def info(self, name: str) -> TensorRecord:
        """``name``'s record, once its write in flight has finished."""
        self._inflight.settle_write(name)
        try:
            return self._records[name]
        except KeyError:
            failed, _ = self._inflight.failed.get(name, (None, None))
            why = f" (its last write failed: {type(failed).__name__}{f': {failed}' if str(failed) else ''})" \
                if failed is not None else ""
            raise KeyError(f"no tensor {name!r} in swap space {self.rank_dirs[0]}{why}") from None

    def written_as(self, name: str) -> TensorRecord:
        """``name``'s record, or, where its last write failed (a full disk, a Ctrl-C), the record
        that write was for: its dtype and shape, to write the name again with (its bytes are
        not there). KeyError as `info` otherwise."""
        self._inflight.settle_write(name)
        failed = self._inflight.failed.get(name)
        return failed[1] if failed is not None and name not in self._records else self.info(name)

    def __contains__(self, name: str) -> bool:
        self._inflight.settle_write(name)
        return name in self._records

    def __len__(self) -> int:
        return len(self._records)

    def arena_sizes(self) -> list[int]:
        """Each arena file's size in bytes, in the order of the directories."""
        return self._arenas.sizes()

    def limit(self, caps: Sequence[int | None]) -> None:
        """Never grow arena ``k`` past ``caps[k]`` bytes (rounded down to the alignment; None:
        no cap): a tensor that would need more raises `OutOfSpace` instead of taking the disk
        (the engine sizes the caps at initialize: [Note: disk footprint] in infinity/_footprint.py)."""
        self._arenas.limit(caps)

    def stats(self) -> dict:
        """Bytes in the arena files, allocated to tensors, and free inside the arenas."""
        capacity, used = self._arenas.usage()
        return {"tensors": len(self._records), "tensor_bytes": sum(r.nbytes for r in self._records.values()),
                "arena_bytes": capacity, "allocated_bytes": used, "free_bytes": capacity - used}  # fmt: skip

    def flush(self) -> None:
        """Finish every pending operation, make the arena files durable, write the manifest.

        Raises the first error of a pending operation (after finishing all of them)."""
        self._check_open()
        error = self._inflight.settle_all()
        self._arenas.sync()
        self._arenas.write_manifest(self._records)
        if error is not None:
            raise error

    def close(self) -> None:
        """Flush, shrink each arena file to the end of its last tensor, and release everything;
        with ``keep=False``, remove the space's files instead. Idempotent. An interrupt
        (KeyboardInterrupt) while operations are being finished leaves the space open: a later
        `close` finishes it."""
        if self._closed:
            return
        error = self._inflight.settle_all()  # an interrupt here leaves everything as it was
        try:
            if self.keep:
                self._arenas.close_keeping(self._records)
        finally:
            self._closed = True
            try:
                if not self.keep:
                    self._arenas.remove_files()
            finally:
                self._release()
                if not self.keep:
                    self._arenas.remove_dirs()
        if error is not None:
            raise error

    def discard(self) -> None:
        """Close and remove the space's files, as ``keep=False`` does: for a space whose run
        never started (an initialize that failed), whose files hold nothing to keep."""
        self.keep = False
        self.close()

    def __enter__(self) -> "SwapSpace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------
    def _stage(self, nbytes: int):
        """A bounce buffer for a transfer's unaligned part. From the pool; but a tail (at most
        one alignment unit: a tensor whose size is not a multiple of it) that finds no room now
        gets its own aligned memory instead of waiting: a write-back staging its tail while the
        pool is full of reads ahead that only its own loop releases would wait for good, and
        so many bytes do not need the budget's protection."""
        if nbytes <= ALIGNMENT:
            try:
                lease = self.pool.acquire(nbytes, timeout=0)
            except PoolExhausted:
                return aio.empty_aligned(nbytes, ALIGNMENT), lambda: None
        else:
            lease = self.pool.acquire(nbytes)
        return lease.tensor, lease.release

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"swap space {self.rank_dirs[0] if self.rank_dirs else ''} is closed")

    def _release(self) -> None:
        """Close what is open: the checker's threads, the arena files, the pool and engine if
        owned, the locks; every step runs (this is the cleanup of a failed open too, so it must
        not leak what a later step holds); the first error is raised after."""
        files, locks = self._arenas.closers()
        steps = [self._checker.close] if self._checker is not None else []
        steps += files
        if self._own_pool and self.pool is not None:
            steps.append(self.pool.close)
        if self._own_engine and self.engine is not None:
            steps.append(self.engine.close)
        run_all([*steps, *locks])  # the locks last: released, the directories are another space's to take

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._records)} tensors"
        return f"SwapSpace({self.rank_dirs!r}, rank={self.rank}, {state})"


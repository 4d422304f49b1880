"""SwapSpace: named tensors in preallocated arena files, striped over one directory per drive."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import gc
import logging
import os
import stat
import uuid
from collections.abc import Callable, Sequence

import torch
from infinity.aio._files import file_kind, open_regular

from infinity import aio

from ._allocator import ExtentAllocator, OutOfSpace
from ._checksum import Checker, SwapCorruption
from ._checksum import checksum as compute_checksum
from ._common import ALIGNMENT, VERIFY_MODES, round_up
from ._io import Transfer, as_uint8
from ._manifest import (
    DTYPES,
    LOCK_NAME,
    MANIFEST_NAME,
    SPACE_NAME,
    ArenaFile,
    Extent,
    Manifest,
    ManifestError,
    TensorRecord,
    arena_name,
    dtype_name,
    is_space_file,
    load_manifest,
    load_space_json,
    space_json,
    write_json_atomic,
)
from ._pool import HostBuffer, HostBufferPool, PoolExhausted

logger = logging.getLogger("infinity.swap")

# The arena grows by doubling from this size up to ``grow_step`` (see `SwapSpace`), so a small
# space does not take a whole grow_step of disk.
GROW_FLOOR = 1 << 20


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
    ``grow_step`` at a time. `close` shrinks each to the end of its last tensor, so a closed
    space takes the disk its tensors need; with ``keep=False`` it removes the space's files
    (and the directories it created, once empty) instead: for scratch nothing reads later.

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
        self._checker = Checker(threads=min(8, max(2, len(dirs))))  # hashes reads as they land
        self.rank = rank
        self.keep = keep
        self.stripe_size = stripe_size
        self.stripe_threshold = stripe_threshold
        self.grow_step = grow_step
        self._closed = True  # until everything below is set up
        self._locks: list[int] = []
        self._files: list[aio.File] = []
        self._allocs: list[ExtentAllocator] = []
        self._made_dirs: list[str] = []  # swap directories this space created (removed with keep=False)
        self._pending: dict[str, list[SwapFuture]] = {}  # every unfinished put/get, by name
        self._writes: dict[str, SwapFuture] = {}  # the unfinished put of a name, if any
        self._failed: dict[str, BaseException] = {}  # names whose last write failed
        self._records: dict[str, TensorRecord] = {}  # names whose bytes are on disk
        self._own_engine = engine is None
        self._own_pool = pool is None
        self.engine = engine
        self.pool = pool
        self.rank_dirs: list[str] = []
        try:
            paths = [os.fspath(d) for d in dirs]
            _check_distinct(paths, [self._ensure_dir(p) for p in paths])
            for path in paths:
                self.rank_dirs.append(self._prepare_dir(path, allow_foreign))
            if self.engine is None:
                self.engine = aio.open_engine(queue_depth=32 * len(dirs))
            if self.pool is None:
                self.pool = HostBufferPool(host_budget, engine=self.engine, slab_size=min(64 << 20, host_budget))
            self._open(fresh)
        except BaseException:
            try:
                self._release()
            finally:
                self._remove_dirs()  # those this open made, where still empty
            raise
        self._closed = False

    # -- setting up -------------------------------------------------------------------------
    def _ensure_dir(self, directory: str) -> os.stat_result:
        """``directory``'s stat, after creating it (0700) when it is missing and its parent is
        there; a missing parent is an error naming it (a mistyped mount point is not made)."""
        try:
            st = os.stat(directory)
        except FileNotFoundError:
            parent = os.path.dirname(os.path.abspath(directory))
            if not os.path.isdir(parent):
                raise ValueError(
                    f"swap directory {directory!r} does not exist, nor does its parent {parent!r}: create the "
                    "parent (a swap space creates only the last component of its path)"
                ) from None
            try:
                os.mkdir(directory, 0o700)
                self._made_dirs.append(os.path.abspath(directory))
            except FileExistsError:
                pass  # made meanwhile by another rank
            except OSError as e:
                raise OSError(e.errno, f"cannot create the swap directory: {e.strerror}", directory) from None
            st = os.stat(directory)
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"swap directory {directory!r} is not a directory (it is {file_kind(st.st_mode)})")
        return st

    def _prepare_dir(self, directory: str, allow_foreign: bool) -> str:
        rank_dir = os.path.abspath(os.path.join(directory, f"rank{self.rank}"))
        # A space closing with keep=False unlinks its lock file and removes its rank directory:
        # one opened meanwhile is made again (a lock on an unlinked file excludes nobody).
        for _ in range(10):
            fd = self._lock(rank_dir)
            if fd is not None:
                break
        else:
            raise RuntimeError(f"swap directory {rank_dir}: its lock file kept being removed while it was opened")
        self._locks.append(fd)
        foreign = sorted(n for n in os.listdir(rank_dir) if not is_space_file(n))
        if foreign and not allow_foreign:
            raise ValueError(
                f"swap directory {rank_dir} holds files a swap space did not make: "
                f"{', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}; "
                "use an empty directory or pass allow_foreign=True"
            )
        return rank_dir

    def _lock(self, rank_dir: str) -> int | None:
        """Make ``rank_dir``, take its lock and write our pid into it: the lock's fd, or None
        when the lock file was removed under us (try again). Every failure closes the fd."""
        try:
            os.makedirs(rank_dir, mode=0o700, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"cannot create the swap rank directory: {e.strerror}", rank_dir) from None
        st = os.lstat(rank_dir)
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"swap rank directory {rank_dir} is {file_kind(st.st_mode)}, not a directory")
        if not os.access(rank_dir, os.W_OK):
            raise PermissionError(errno.EACCES, "swap rank directory is not writable", rank_dir)
        lock_path = os.path.join(rank_dir, LOCK_NAME)
        try:
            fd = open_regular(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            return None  # the rank directory went away (a space closing with keep=False)
        except OSError as e:
            if e.filename is None:
                raise OSError(e.errno, f"cannot open the swap lock file: {e.strerror}", lock_path) from None
            raise
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                if holder == str(os.getpid()):
                    # This process: maybe a space (an engine) dropped without close and not yet
                    # collected; collecting it releases its lock.
                    gc.collect()
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        raise RuntimeError(
                            f"swap directory {rank_dir} is in use by another swap space of this process "
                            f"({holder}): an infinity engine or SwapSpace still open on it. Close it first "
                            "(engine.close()); an engine dropped without close() stays open while its model is alive"
                        ) from None
                else:
                    raise RuntimeError(
                        f"swap directory {rank_dir} is in use by another swap space (process {holder}); "
                        "each rank of each run needs its own directory"
                    ) from None
            try:
                same = os.stat(lock_path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                return None
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError as e:
                raise OSError(e.errno, f"cannot write this process's id into the swap lock file: {e.strerror}",
                              lock_path) from None  # fmt: skip
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open(self, fresh: bool) -> None:
        manifest_path = os.path.join(self.rank_dirs[0], MANIFEST_NAME)
        old = None
        if os.path.lexists(manifest_path):
            try:
                old = load_manifest(manifest_path, allow_unchecked=fresh)  # fresh: only its file list is used
            except (ManifestError, OSError) as e:
                if not fresh:
                    raise
                # Scratch: an unreadable old manifest does not block. What it listed cannot be
                # known, so the files whose names only a swap space makes are removed below.
                logger.warning("swap manifest %s cannot be read (%s); fresh=True: removing the swap space files "
                               "in %s by name", manifest_path, e, ", ".join(self.rank_dirs))  # fmt: skip
        if old is not None and fresh:
            self._remove_space(old)
            old = None
        if old is None:
            # Space files without a manifest: a space whose manifest is elsewhere (directories
            # in another order) or was lost. Their names are a space's own, so fresh=True may
            # remove them; otherwise the caller decides.
            for rank_dir in self.rank_dirs:
                leftovers = sorted(n for n in os.listdir(rank_dir) if is_space_file(n) and n != LOCK_NAME)
                if leftovers and not fresh:
                    raise ManifestError(
                        f"{rank_dir} holds swap space files ({', '.join(leftovers[:3])}) but "
                        f"{self.rank_dirs[0]} has no manifest for them: pass the directories in their "
                        "original order, or fresh=True to start over"
                    )
                for n in leftovers:
                    os.unlink(os.path.join(rank_dir, n))
            self._create()
        else:
            self._resume(old)

    def _remove_space(self, old: Manifest) -> None:
        """Remove what ``old`` lists (and the markers), never anything else."""
        for f in old.files:
            if f.dir < len(self.rank_dirs):
                path = os.path.join(self.rank_dirs[f.dir], f.name)
                if os.path.lexists(path):
                    os.unlink(path)
        for rank_dir in self.rank_dirs:
            for name in (SPACE_NAME, MANIFEST_NAME):
                if os.path.lexists(os.path.join(rank_dir, name)):
                    os.unlink(os.path.join(rank_dir, name))

    def _create(self) -> None:
        space_id = uuid.uuid4().hex
        self._manifest = Manifest(space_id=space_id, rank=self.rank, directories=len(self.rank_dirs),
                                  alignment=ALIGNMENT, members=list(self.rank_dirs))  # fmt: skip
        made: list[str] = []
        try:
            for k, rank_dir in enumerate(self.rank_dirs):
                name = arena_name(0)
                path = os.path.join(rank_dir, name)
                self._files.append(aio.open_file(path, "x+", regular=True))
                made.append(path)
                self._allocs.append(self._allocator(0))
                self._manifest.files.append(ArenaFile(dir=k, name=name, size=0))
                marker = os.path.join(rank_dir, SPACE_NAME)
                write_json_atomic(marker, space_json(space_id, self.rank, k, len(self.rank_dirs)))
                made.append(marker)
            self._write_manifest()
        except BaseException:
            for path in made:  # a half-made space would block the next open that is not fresh
                try:
                    os.unlink(path)
                except OSError:
                    pass
            raise

    def _allocator(self, capacity: int) -> ExtentAllocator:
        return ExtentAllocator(alignment=ALIGNMENT, grow_step=self.grow_step, capacity=capacity,
                               grow_floor=min(GROW_FLOOR, self.grow_step))  # fmt: skip

    def _resume(self, old: Manifest) -> None:
        if old.directories != len(self.rank_dirs) or old.rank != self.rank:
            raise ManifestError(
                f"{self.rank_dirs[0]}: the space was made for rank {old.rank} over {old.directories} "
                f"directories, opened for rank {self.rank} over {len(self.rank_dirs)}"
            )
        for k, rank_dir in enumerate(self.rank_dirs):
            info = load_space_json(os.path.join(rank_dir, SPACE_NAME))
            if (info["space_id"], info["member"]) != (old.space_id, k):
                raise ManifestError(
                    f"{rank_dir}: belongs to space {info['space_id']} as member {info['member']}, "
                    f"expected {old.space_id} member {k}: pass the directories in their original order"
                )
        self._manifest = old
        old.members = list(self.rank_dirs)
        for i, f in enumerate(old.files):
            path = os.path.join(self.rank_dirs[f.dir], f.name)
            file = aio.open_file(path, "r+", regular=True)
            size = file.size()
            if size < f.size or size % ALIGNMENT:
                file.close()
                lost = [(t.name, e) for t in old.tensors.values() for e in t.extents
                        if e.file == i and e.offset + e.nbytes > size]  # fmt: skip
                what = (f"; tensor {lost[0][0]!r} (bytes {lost[0][1].offset} to {lost[0][1].offset + lost[0][1].nbytes}) "
                        f"lies past its end" + (f", and {len(lost) - 1} more tensors" if len(lost) > 1 else "")
                        if lost else "")  # fmt: skip
                raise ManifestError(
                    f"{path}: arena file is {size} bytes; the manifest says {f.size} "
                    f"(a multiple of {ALIGNMENT}): the file was truncated or changed outside the space{what}"
                )
            self._files.append(file)
            self._allocs.append(self._allocator(size))
        for record in old.tensors.values():
            for e in record.extents:
                self._allocs[e.file].reserve(e.offset, round_up(e.nbytes))
        self._records = dict(old.tensors)

    # -- placement --------------------------------------------------------------------------
    def _plan(self, nbytes: int) -> list[tuple[int, int]]:
        """(file index, bytes) pieces for a tensor of ``nbytes``; see [Note: swap alignment]."""
        members = len(self._files)
        if nbytes == 0:
            return []
        if members > 1 and nbytes >= self.stripe_threshold:
            per = round_up(-(-nbytes // members), self.stripe_size)
            return [(k, min(per, nbytes - k * per)) for k in range(members) if k * per < nbytes]
        least = min(range(members), key=lambda k: self._allocs[k].used_bytes)
        return [(least, nbytes)]

    def _allocate(self, plan: list[tuple[int, int]]) -> tuple[Extent, ...]:
        extents: list[Extent] = []
        try:
            for k, nbytes in plan:
                extents.append(Extent(k, self._alloc_in(k, round_up(nbytes)), nbytes))
        except BaseException:
            for e in extents:
                self._allocs[e.file].free(e.offset, round_up(e.nbytes))
            raise
        return tuple(extents)

    def _alloc_in(self, k: int, nbytes: int) -> int:
        alloc, file = self._allocs[k], self._files[k]
        before = alloc.capacity
        try:
            offset = alloc.allocate(nbytes)
        except OutOfSpace as e:  # the cap `limit` set: say which arena
            raise OutOfSpace(f"arena {file.path}: {e}", requested=e.requested, capacity=e.capacity,
                             free_bytes=e.free_bytes, largest_free=e.largest_free) from None  # fmt: skip
        if alloc.capacity > before:
            try:
                try:
                    os.posix_fallocate(file.fileno(), before, alloc.capacity - before)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                        raise
                    os.ftruncate(file.fileno(), alloc.capacity)  # no fallocate here: sparse
            except OSError as e:
                alloc.free(offset, nbytes)
                raise OSError(
                    e.errno,
                    f"cannot grow the arena file from {before} to {alloc.capacity} bytes "
                    f"({alloc.capacity - before} more) for a tensor of {nbytes} bytes: {e.strerror}",
                    file.path,
                ) from None
            f = self._manifest.files[k]
            self._manifest.files[k] = ArenaFile(f.dir, f.name, alloc.capacity)
        return offset

    def _free(self, record: TensorRecord) -> None:
        for e in record.extents:
            self._allocs[e.file].free(e.offset, round_up(e.nbytes))

    # -- the API ----------------------------------------------------------------------------
    def put(self, name: str, tensor: torch.Tensor, *, checksum: bool | None = None) -> SwapFuture:
        """Write ``tensor`` under ``name`` (replacing what was there), with its checksum (see
        [Note: checksums]); do not modify the tensor until the future is done. ``checksum`` is
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
        self._settle(self._pending.get(name, ()))  # no read or write of the old bytes in flight
        old = self._records.get(name)
        plan = self._plan(data.numel())
        if old is not None and [(e.file, round_up(e.nbytes)) for e in old.extents] == [
            (k, round_up(n)) for k, n in plan
        ]:
            extents = tuple(Extent(e.file, e.offset, n) for e, (_, n) in zip(old.extents, plan))  # in place
        else:
            if old is not None:
                self._free(old)
                del self._records[name]
            extents = self._allocate(plan)
        record = TensorRecord(name=name, dtype=dtype, shape=tuple(tensor.shape), nbytes=data.numel(),
                              extents=extents, generation=(old.generation + 1) if old else 1)  # fmt: skip
        self._records.pop(name, None)  # readable again once the write is done
        self._failed.pop(name, None)
        try:
            transfer = Transfer(self.engine, self._files, extents, data, write=True, alloc=self._stage,
                                name=name) if extents else None  # fmt: skip
        except BaseException as e:
            self._free(record)
            self._failed[name] = e
            raise

        def finish(error):
            # Each step may run again after an interrupt (see SwapFuture), so each is idempotent.
            if error is None:
                if record.checksum is None:  # put was interrupted before it computed it
                    record.checksum = compute_checksum(data.numpy())
                self._records[name] = record
            elif self._failed.get(name) is not error:
                self._failed[name] = error
                self._free(record)  # the bytes are not what the name says: forget it
            if self._writes.get(name) is fut:
                del self._writes[name]
            self._done_with(name, fut)
            if error is not None:
                raise error

        fut = SwapFuture(transfer, finish)
        self._pending.setdefault(name, []).append(fut)
        self._writes[name] = fut
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
            transfer = Transfer(self.engine, self._files, record.extents, data, write=False, alloc=self._stage,
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
                self._done_with(name, fut)
                raise
            self._done_with(name, fut)
            return out if lease is None else lease

        fut = SwapFuture(transfer, finish)
        self._pending.setdefault(name, []).append(fut)
        return fut

    def _corruption(self, record: TensorRecord, actual: str) -> SwapCorruption:
        first = record.extents[0] if record.extents else Extent(0, 0, 0)
        return SwapCorruption(record.name, self._files[first.file].path, first.offset, record.checksum, actual)

    def delete(self, name: str) -> None:
        self._check_open()
        self._settle(self._pending.get(name, ()))
        self._failed.pop(name, None)
        record = self._records.pop(name, None)
        if record is None:
            raise KeyError(f"no tensor {name!r} in swap space {self.rank_dirs[0]}")
        self._free(record)

    def rename(self, src: str, dst: str) -> None:
        """Give ``src``'s bytes the name ``dst``, replacing what ``dst`` held (whose extents
        are freed); ``src`` is gone after. Nothing is copied: the manifest's next write
        records the new name."""
        self._check_open()
        if src == dst:
            raise ValueError(f"rename of {src!r} onto itself")
        self._settle(self._pending.get(src, ()))
        self._settle(self._pending.get(dst, ()))
        record = self.info(src)  # raises naming src (and its failed write) when it has none
        old = self._records.pop(dst, None)
        if old is not None:
            self._free(old)
        del self._records[src]
        self._failed.pop(dst, None)
        self._records[dst] = dataclasses.replace(record, name=dst, generation=(old.generation + 1) if old else 1)

    def names(self) -> list[str]:
        return list(self._records)

    @property
    def files(self) -> tuple[aio.File, ...]:
        """The open arena files, one per directory, in the manifest's order (read-only)."""
        return tuple(self._files)

    def _after_write(self, name: str) -> None:
        """Finish ``name``'s write in flight, if any: until then the name has no record (its
        error stays with the write's future and shows as the name's failed write)."""
        if name in self._writes:
            self._settle([self._writes[name]])

    def info(self, name: str) -> TensorRecord:
        """``name``'s record, once its write in flight has finished."""
        self._after_write(name)
        try:
            return self._records[name]
        except KeyError:
            why = f" (its last write failed: {self._failed[name]})" if name in self._failed else ""
            raise KeyError(f"no tensor {name!r} in swap space {self.rank_dirs[0]}{why}") from None

    def __contains__(self, name: str) -> bool:
        self._after_write(name)
        return name in self._records

    def __len__(self) -> int:
        return len(self._records)

    def arena_sizes(self) -> list[int]:
        """Each arena file's size in bytes, in the order of the directories."""
        return [a.capacity for a in self._allocs]

    def limit(self, caps: Sequence[int | None]) -> None:
        """Never grow arena ``k`` past ``caps[k]`` bytes (rounded down to the alignment; None:
        no cap): a tensor that would need more raises `OutOfSpace` instead of taking the disk
        (the engine sizes the caps at initialize: [Note: disk footprint] in infinity/_footprint.py)."""
        if len(caps) != len(self._allocs):
            raise ValueError(f"{len(caps)} caps for {len(self._allocs)} arenas ({', '.join(self.rank_dirs)})")
        for alloc, cap, d in zip(self._allocs, caps, self.rank_dirs):
            if cap is None:
                alloc.max_capacity = None
                continue
            cap = cap // ALIGNMENT * ALIGNMENT
            if cap < alloc.capacity:
                raise ValueError(f"cap {cap} for the arena in {d} is below its size {alloc.capacity}")
            alloc.max_capacity = cap

    def stats(self) -> dict:
        """Bytes in the arena files, allocated to tensors, and free inside the arenas."""
        capacity = sum(a.capacity for a in self._allocs)
        used = sum(a.used_bytes for a in self._allocs)
        return {"tensors": len(self._records), "tensor_bytes": sum(r.nbytes for r in self._records.values()),
                "arena_bytes": capacity, "allocated_bytes": used, "free_bytes": capacity - used}  # fmt: skip

    def flush(self) -> None:
        """Finish every pending operation, make the arena files durable, write the manifest.

        Raises the first error of a pending operation (after finishing all of them)."""
        self._check_open()
        error = self._settle_all()
        for file in self._files:
            os.fdatasync(file.fileno())
        self._write_manifest()
        if error is not None:
            raise error

    def close(self) -> None:
        """Flush, shrink each arena file to the end of its last tensor, and release everything;
        with ``keep=False``, remove the space's files instead. Idempotent. An interrupt
        (KeyboardInterrupt) while operations are being finished leaves the space open: a later
        `close` finishes it."""
        if self._closed:
            return
        error = self._settle_all()  # an interrupt here leaves everything as it was
        try:
            if self.keep:
                for file in self._files:
                    os.fdatasync(file.fileno())
                shrunk = self._shrink_manifest()
                self._write_manifest()
                for k, size in shrunk:  # after the manifest: a crash between leaves files longer, which is fine
                    os.ftruncate(self._files[k].fileno(), size)
        finally:
            self._closed = True
            try:
                if not self.keep:
                    self._remove_files()
            finally:
                self._release()
                if not self.keep:
                    self._remove_dirs()
        if error is not None:
            raise error

    def discard(self) -> None:
        """Close and remove the space's files, as ``keep=False`` does: for a space whose run
        never started (an initialize that failed), whose files hold nothing to keep."""
        self.keep = False
        self.close()

    def _shrink_manifest(self) -> list[tuple[int, int]]:
        """Set each arena's size in the manifest to the end of its last extent (aligned); the
        (file index, size) of those that shrink."""
        shrunk = []
        for k, alloc in enumerate(self._allocs):
            used = alloc.used_extents()
            end = used[-1][0] + used[-1][1] if used else 0
            f = self._manifest.files[k]
            if end < f.size:
                self._manifest.files[k] = ArenaFile(f.dir, f.name, end)
                shrunk.append((k, end))
        return shrunk

    def _remove_files(self) -> None:
        """keep=False: unlink what this space made: its arenas, the manifest, the markers, the
        locks (still held until `_release`) and temporary files of manifest writes."""
        arenas = {(f.dir, f.name) for f in self._manifest.files}
        for k, rank_dir in enumerate(self.rank_dirs):
            for name in sorted(os.listdir(rank_dir)):
                # An arena file the manifest does not list was not made by this space: left.
                if (k, name) in arenas or (is_space_file(name) and not name.startswith("arena-")):
                    try:
                        os.unlink(os.path.join(rank_dir, name))
                    except FileNotFoundError:
                        pass

    def _remove_dirs(self) -> None:
        """Remove the rank directories, then the swap directories this space created, where empty."""
        for d in [*self.rank_dirs, *reversed(self._made_dirs)]:
            try:
                os.rmdir(d)
            except OSError:
                pass  # not empty (foreign files, another rank's directory): left as it is

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

    def _done_with(self, name: str, fut: SwapFuture) -> None:
        futures = self._pending.get(name)
        if futures is not None:
            try:
                futures.remove(fut)
            except ValueError:
                pass
            if not futures:
                del self._pending[name]

    def _settle(self, futures) -> None:
        """Finish ``futures`` (their errors stay with them, for their owners to see)."""
        for fut in list(futures):
            try:
                fut.result()
            except Exception:  # noqa: BLE001, S110 - an interrupt propagates; errors stay with the future
                pass

    def _settle_all(self) -> BaseException | None:
        first = None
        for name in list(self._pending):
            for fut in list(self._pending.get(name, ())):
                try:
                    fut.result()
                except Exception as e:  # noqa: BLE001 - an interrupt propagates, the rest finish
                    first = first or e
        return first

    def _write_manifest(self) -> None:
        m = self._manifest
        m.tensors = dict(self._records)
        m.members = list(self.rank_dirs)
        m.generation += 1
        write_json_atomic(os.path.join(self.rank_dirs[0], MANIFEST_NAME), m.to_json())

    def _release(self) -> None:
        """Close what is open: files, the pool and engine if owned, the locks; every step runs
        (this is the cleanup of a failed open too, so it must not leak what a later step holds);
        the first error is raised after."""
        steps = [self._checker.close, *(f.close for f in self._files)]
        if self._own_pool and self.pool is not None:
            steps.append(self.pool.close)
        if self._own_engine and self.engine is not None:
            steps.append(self.engine.close)
        steps += [lambda fd=fd: os.close(fd) for fd in self._locks]  # releases the flock
        self._files, self._locks = [], []
        error = None
        for step in steps:
            try:
                step()
            except BaseException as e:  # noqa: BLE001 - the rest still run
                error = error or e
        if error is not None:
            raise error

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._records)} tensors"
        return f"SwapSpace({self.rank_dirs!r}, rank={self.rank}, {state})"


def _check_distinct(paths: list[str], stats: list[os.stat_result]) -> None:
    """Refuse two entries of ``paths`` that are one directory (one a symlink to the other, a
    bind mount of it): the space would lock the same rank directory twice."""
    seen: dict[tuple[int, int], str] = {}
    for path, st in zip(paths, stats):
        key = (st.st_dev, st.st_ino)
        if key in seen:
            raise ValueError(
                f"swap directories {seen[key]!r} and {path!r} are the same directory ({os.path.realpath(path)}): "
                "give each drive's directory once"
            )
        seen[key] = path

"""The disk side of a swap space: its directories, locks, arena files, their allocation and the manifest.

Owns: one rank directory per drive (made 0700, locked while open, foreign files refused), an
arena file in each (grown by preallocation as tensors need room, shrunk at close), the extent
allocator of each, and the manifest that lists the arenas and the tensors in them (written
atomically). Touches nothing in memory: `_space.SwapSpace` owns the tensors' names, records,
reads and writes, and hands its records to `write_manifest`.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import os
import stat
import uuid
from collections.abc import Sequence

from infinity.aio._files import file_kind, open_regular

from infinity import aio

from ._allocator import ExtentAllocator, OutOfSpace
from ._common import ALIGNMENT, round_up
from ._manifest import (
    LOCK_NAME,
    MANIFEST_NAME,
    SPACE_NAME,
    ArenaFile,
    Extent,
    Manifest,
    ManifestError,
    TensorRecord,
    arena_name,
    is_space_file,
    load_manifest,
    load_space_json,
    space_json,
    write_json_atomic,
)

logger = logging.getLogger("infinity.swap")

# An arena grows by doubling from this size up to ``grow_step`` (see `SwapSpace`), so a small
# space does not take a whole grow_step of disk.
GROW_FLOOR = 1 << 20


class Arenas:
    """The rank directories, arena files and manifest of one swap space over ``dirs`` (see
    `SwapSpace` for what each argument means). Opened by the constructor, which leaves nothing
    behind when it fails (files closed, locks released, the directories it made removed where
    empty); `records_at_open` are the tensors a resumed manifest lists (none for a new space)."""

    def __init__(self, dirs: Sequence[str], *, rank: int, fresh: bool, allow_foreign: bool, stripe_size: int,
                 stripe_threshold: int, grow_step: int, doubling: bool = True):  # fmt: skip
        self.rank = rank
        self.doubling = doubling  # grow by doubling from GROW_FLOOR up to grow_step, else by grow_step
        self.stripe_size = stripe_size
        self.stripe_threshold = stripe_threshold
        self.grow_step = grow_step
        self.rank_dirs: list[str] = []
        self.files: list[aio.File] = []  # one per directory, in the manifest's order
        self.allocs: list[ExtentAllocator] = []
        self._locks: list[int] = []
        self._made_dirs: list[str] = []  # swap directories this space created (removed with keep=False)
        try:
            _check_distinct(list(dirs), [self._ensure_dir(p) for p in dirs])
            for path in dirs:
                self.rank_dirs.append(self._prepare_dir(path, allow_foreign))
            self.records_at_open = self._open(fresh)
        except BaseException:
            try:
                files, locks = self.closers()
                run_all([*files, *locks])
            finally:
                self.remove_dirs()  # those this open made, where still empty
            raise

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

    def _open(self, fresh: bool) -> dict[str, TensorRecord]:
        """Make a space or resume the one the manifest names: the tensors it holds."""
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
            return {}
        return self._resume(old)

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
        self.manifest = Manifest(space_id=space_id, rank=self.rank, directories=len(self.rank_dirs),
                                 alignment=ALIGNMENT, members=list(self.rank_dirs))  # fmt: skip
        made: list[str] = []
        try:
            for k, rank_dir in enumerate(self.rank_dirs):
                name = arena_name(0)
                path = os.path.join(rank_dir, name)
                self.files.append(aio.open_file(path, "x+", regular=True))
                made.append(path)
                self.allocs.append(self._allocator(0))
                self.manifest.files.append(ArenaFile(dir=k, name=name, size=0))
                marker = os.path.join(rank_dir, SPACE_NAME)
                write_json_atomic(marker, space_json(space_id, self.rank, k, len(self.rank_dirs)))
                made.append(marker)
            self.write_manifest({})
        except BaseException:
            for path in made:  # a half-made space would block the next open that is not fresh
                try:
                    os.unlink(path)
                except OSError:
                    pass
            raise

    def _allocator(self, capacity: int) -> ExtentAllocator:
        return ExtentAllocator(alignment=ALIGNMENT, grow_step=self.grow_step, capacity=capacity,
                               grow_floor=min(GROW_FLOOR, self.grow_step) if self.doubling else None)  # fmt: skip

    def _resume(self, old: Manifest) -> dict[str, TensorRecord]:
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
        self.manifest = old
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
            self.files.append(file)
            self.allocs.append(self._allocator(size))
        for record in old.tensors.values():
            for e in record.extents:
                self.allocs[e.file].reserve(e.offset, round_up(e.nbytes))
        return dict(old.tensors)

    # -- placement --------------------------------------------------------------------------
    def plan(self, nbytes: int) -> list[tuple[int, int]]:
        """(file index, bytes) pieces for a tensor of ``nbytes``; see [Note: swap alignment]."""
        members = len(self.files)
        if nbytes == 0:
            return []
        if members > 1 and nbytes >= self.stripe_threshold:
            per = round_up(-(-nbytes // members), self.stripe_size)
            return [(k, min(per, nbytes - k * per)) for k in range(members) if k * per < nbytes]
        least = min(range(members), key=lambda k: self.allocs[k].used_bytes)
        return [(least, nbytes)]

    def allocate(self, plan: list[tuple[int, int]]) -> tuple[Extent, ...]:
        extents: list[Extent] = []
        try:
            for k, nbytes in plan:
                extents.append(Extent(k, self._alloc_in(k, round_up(nbytes)), nbytes))
        except BaseException:
            for e in extents:
                self.allocs[e.file].free(e.offset, round_up(e.nbytes))
            raise
        return tuple(extents)

    def _alloc_in(self, k: int, nbytes: int) -> int:
        alloc, file = self.allocs[k], self.files[k]
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
            f = self.manifest.files[k]
            self.manifest.files[k] = ArenaFile(f.dir, f.name, alloc.capacity)
        return offset

    def free(self, record: TensorRecord) -> None:
        for e in record.extents:
            self.allocs[e.file].free(e.offset, round_up(e.nbytes))


    # -- sizes ------------------------------------------------------------------------------
    def sizes(self) -> list[int]:
        """Each arena file's size in bytes, in the order of the directories."""
        return [a.capacity for a in self.allocs]

    def usage(self) -> tuple[int, int]:
        """(bytes in the arena files, bytes allocated to tensors)."""
        return sum(a.capacity for a in self.allocs), sum(a.used_bytes for a in self.allocs)

    def limit(self, caps: Sequence[int | None]) -> None:
        """See `SwapSpace.limit`."""
        if len(caps) != len(self.allocs):
            raise ValueError(f"{len(caps)} caps for {len(self.allocs)} arenas ({', '.join(self.rank_dirs)})")
        for alloc, cap, d in zip(self.allocs, caps, self.rank_dirs):
            if cap is None:
                alloc.max_capacity = None
                continue
            cap = cap // ALIGNMENT * ALIGNMENT
            if cap < alloc.capacity:
                raise ValueError(f"cap {cap} for the arena in {d} is below its size {alloc.capacity}")
            alloc.max_capacity = cap

    # -- durability and the end -------------------------------------------------------------
    def sync(self) -> None:
        """Make the arena files' bytes durable."""
        for file in self.files:
            os.fdatasync(file.fileno())

    def write_manifest(self, records: dict[str, TensorRecord]) -> None:
        """Write the manifest (atomically): the arenas, and ``records`` as the tensors in them."""
        m = self.manifest
        m.tensors = dict(records)
        m.members = list(self.rank_dirs)
        m.generation += 1
        write_json_atomic(os.path.join(self.rank_dirs[0], MANIFEST_NAME), m.to_json())

    def close_keeping(self, records: dict[str, TensorRecord]) -> None:
        """Make everything durable, write the manifest with each arena at the end of its last
        tensor, then shrink the files to it (a crash between leaves them longer, which is fine)."""
        self.sync()
        shrunk = self._shrink_manifest()
        self.write_manifest(records)
        for k, size in shrunk:
            os.ftruncate(self.files[k].fileno(), size)

    def _shrink_manifest(self) -> list[tuple[int, int]]:
        """Set each arena's size in the manifest to the end of its last extent (aligned); the
        (file index, size) of those that shrink."""
        shrunk = []
        for k, alloc in enumerate(self.allocs):
            used = alloc.used_extents()
            end = used[-1][0] + used[-1][1] if used else 0
            f = self.manifest.files[k]
            if end < f.size:
                self.manifest.files[k] = ArenaFile(f.dir, f.name, end)
                shrunk.append((k, end))
        return shrunk

    def remove_files(self) -> None:
        """keep=False: unlink what this space made: its arenas, the manifest, the markers, the
        locks (still held until `_release`) and temporary files of manifest writes."""
        arenas = {(f.dir, f.name) for f in self.manifest.files}
        for k, rank_dir in enumerate(self.rank_dirs):
            for name in sorted(os.listdir(rank_dir)):
                # An arena file the manifest does not list was not made by this space: left.
                if (k, name) in arenas or (is_space_file(name) and not name.startswith("arena-")):
                    try:
                        os.unlink(os.path.join(rank_dir, name))
                    except FileNotFoundError:
                        pass

    def remove_dirs(self) -> None:
        """Remove the rank directories, then the swap directories this space created, where empty."""
        for d in [*self.rank_dirs, *reversed(self._made_dirs)]:
            try:
                os.rmdir(d)
            except OSError:
                pass  # not empty (foreign files, another rank's directory): left as it is


    def closers(self) -> tuple[list, list]:
        """The calls that close the arena files and release the locks (the flocks go with their
        fds), forgotten here: the caller runs every one, files first."""
        files = [f.close for f in self.files]
        locks = [lambda fd=fd: os.close(fd) for fd in self._locks]
        self.files, self._locks = [], []
        return files, locks


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


def run_all(steps) -> None:
    """Run every step; raise the first error after."""
    error = None
    for step in steps:
        try:
            step()
        except BaseException as e:  # noqa: BLE001 - the rest still run
            error = error or e
    if error is not None:
        raise error

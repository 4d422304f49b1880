"""Files for the aio transport: O_DIRECT where the filesystem allows it, and its alignment."""

from __future__ import annotations

import errno
import logging
import os
import stat
import weakref

logger = logging.getLogger("infinity.aio")

# O_DIRECT's alignment of memory, offsets and lengths where the kernel does not say (statx
# STATX_DIOALIGN); also the unit of every swap extent and I/O block size.
ALIGNMENT = 4096

_MODES = {
    "r": os.O_RDONLY,
    "r+": os.O_RDWR,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "w+": os.O_RDWR | os.O_CREAT | os.O_TRUNC,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "x+": os.O_RDWR | os.O_CREAT | os.O_EXCL,
    "a+": os.O_RDWR | os.O_CREAT,  # read-write, created if missing, never truncated
}

_warned_buffered: set[int] = set()  # st_dev of filesystems already reported


def _dio_alignment(fd: int) -> tuple[int, int]:
    """(memory, offset) alignment for O_DIRECT on ``fd``: statx STATX_DIOALIGN, else 4096."""
    try:
        from . import _uring

        mem, off = _uring.dio_alignment(fd)
    except (ImportError, OSError):
        return ALIGNMENT, ALIGNMENT
    return (mem or ALIGNMENT), (off or ALIGNMENT)


class File:
    """An open file for `Engine.pread`/`Engine.pwrite`; see `open_file`.

    Attributes: ``path``; ``direct`` (True when O_DIRECT is in effect); ``mem_align`` and
    ``offset_align``, the alignment O_DIRECT needs of buffer addresses and of offsets and
    lengths (1 for buffered files).
    """

    def __init__(self, path: str, fd: int, direct: bool, mem_align: int, offset_align: int):
        self.path = path
        self._fd = fd
        self.direct = direct
        self.mem_align = mem_align
        self.offset_align = offset_align
        # Engines that registered this file; told on close so no ring keeps using it.
        self._engines: weakref.WeakSet = weakref.WeakSet()

    def fileno(self) -> int:
        if self._fd < 0:
            raise OSError(errno.EBADF, "file is closed", self.path)
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def size(self) -> int:
        return os.fstat(self.fileno()).st_size

    def close(self) -> None:
        if self._fd < 0:
            return
        for engine in list(self._engines):
            engine.unregister_file(self)
        fd, self._fd = self._fd, -1
        os.close(fd)

    def __enter__(self) -> "File":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self._fd}"
        return f"File({self.path!r}, {state}, direct={self.direct})"


def open_file(path: str | os.PathLike, mode: str = "r", *, direct: bool = True, regular: bool = False) -> File:
    """Open ``path`` for the aio engines.

    ``mode`` is one of r, r+, w, w+, x, x+ (as for ``open``) or a+ (read-write, created if
    missing, never truncated). New files get mode 0600. With ``direct=True`` the file is opened
    with O_DIRECT; where the filesystem refuses it (EINVAL) it is reopened buffered, with one
    warning per filesystem. With ``regular=True`` only a regular file is opened (see
    `open_regular`): a symlink, a FIFO or a device raises OSError naming the path and what it is.
    """
    path = os.fspath(path)
    try:
        flags = _MODES[mode]
    except KeyError:
        raise ValueError(f"{mode=} is not one of {sorted(_MODES)}") from None
    flags |= os.O_CLOEXEC
    opener = open_regular if regular else _open_plain
    if direct:
        try:
            fd = opener(path, flags | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL or isinstance(e, NotRegularFile):
                raise
            # The kernel creates the file before it refuses O_DIRECT, so an exclusive create
            # must not insist again: EEXIST would have come before EINVAL had it existed.
            fd = opener(path, flags & ~os.O_EXCL, 0o600)
            dev = os.fstat(fd).st_dev
            if dev not in _warned_buffered:
                _warned_buffered.add(dev)
                logger.warning(
                    "O_DIRECT refused (EINVAL) by the filesystem of %s; using buffered I/O there", path
                )
        else:
            mem_align, offset_align = _dio_alignment(fd)
            return File(path, fd, True, mem_align, offset_align)
    else:
        fd = opener(path, flags, 0o600)
    return File(path, fd, False, 1, 1)


def _open_plain(path: str, flags: int, mode: int) -> int:
    return os.open(path, flags, mode)


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFSOCK: "a socket",
}


def file_kind(mode: int) -> str:
    """What ``st_mode`` says a file is, in words ("a FIFO (named pipe)", "a regular file")."""
    return "a regular file" if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "not a regular file")


class NotRegularFile(OSError):
    """A path that `open_regular` refused: a symlink, FIFO, device, socket or directory."""


def open_regular(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that opens only a regular file, and never blocks doing so.

    O_NOFOLLOW refuses a symlink in the last component (no byte of its target is read or
    written) and O_NONBLOCK keeps the open of a FIFO from waiting for a writer; ``fstat`` right
    after the open, before any read or write, refuses everything but a regular file. O_NONBLOCK
    is cleared again (it means nothing for a regular file, but the caller asked for none).
    Raises `NotRegularFile` (an OSError: ELOOP for a symlink, EINVAL otherwise) naming the
    path and what it is.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # ENXIO: a FIFO opened write-only, no reader
            try:
                kind = file_kind(os.lstat(path).st_mode)
            except OSError:
                raise e from None
            if kind != "a regular file":
                raise NotRegularFile(e.errno, f"is {kind}, not a regular file: refused", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, f"is {file_kind(st.st_mode)}, not a regular file: refused", path)
        if not flags & os.O_NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fd_info(fd: int) -> tuple[str, bool, int, int]:
    """(name, direct, mem_align, offset_align) for a raw file descriptor."""
    import fcntl

    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        name = f"<fd {fd}>"
    try:
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
    except OSError:
        return name, False, 1, 1  # a bad fd: the I/O itself reports EBADF
    if not direct:
        return name, False, 1, 1
    mem, off = _dio_alignment(fd)
    return name, True, mem, off

"""Export: the engine's consolidated weights as one safetensors file, streamed.

Owns: the file's layout and its atomic write. Touches: `Engine.unit_weights` (the only way it
reads weights) and the module's state_dict keys.

The file loads with ``model.load_state_dict(safetensors.torch.load_file(path))`` (strict) into
a fresh instance of the user's model. Its layout is the safetensors format, written here
without the package: an 8-byte little-endian header size, a JSON header (per key: dtype,
shape, data_offsets; and ``__metadata__``), padded with spaces to a multiple of 8, then the
tensors' bytes in the header's order.

[Note: streamed export]
Every key's shape and dtype are known before any weight is read (the units keep their
parameters' shapes), so the header is written first and each unit's weights are written at
their offsets (``os.pwrite``) as `Engine.unit_weights` yields them: one unit is in memory at a
time, whatever the model's size. Only rank 0 writes; every rank iterates the units to the end
(each unit is gathered to rank 0 from every rank's shard, and the other ranks hold none of it),
and the ranks agree on the outcome before returning, so a failed write raises on every rank
instead of leaving the others in a gather.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import struct
import tempfile
import time

import torch

from infinity.swap import fsync_dir

logger = logging.getLogger("infinity")

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


class _Entry:
    """One state_dict key: its tensor (a managed parameter or a buffer), dtype and shape in the file."""

    __slots__ = ("key", "value", "is_param", "dtype", "shape", "nbytes")

    def __init__(self, key, value, is_param, dtype, shape):
        self.key, self.value, self.is_param, self.dtype, self.shape = key, value, is_param, dtype, tuple(shape)
        self.nbytes = torch.Size(self.shape).numel() * dtype.itemsize


def _entries(engine) -> list[_Entry]:
    """Every state_dict key of the module, in order, its shape and dtype known before any
    weight is read (a parameter's dtype is the one the model was made in: its `ParamRecord.dtype`)."""
    dtypes = {id(r.param): r.dtype for unit in engine.units for r in unit.records}
    shapes = {id(r.param): r.full_shape for u in engine.units for r in u.records}
    out = []
    for key, value in engine.module.state_dict(keep_vars=True).items():  # the parameters themselves
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict key {key!r} is a {type(value).__name__}, not a tensor; "
                            "safetensors holds tensors only")  # fmt: skip
        is_param = id(value) in shapes
        dtype = dtypes[id(value)] if is_param else value.dtype
        if dtype not in DTYPES:
            raise TypeError(f"state_dict key {key!r} has dtype {dtype}, which safetensors cannot hold "
                            f"(supported: {', '.join(str(d) for d in DTYPES)})")  # fmt: skip
        out.append(_Entry(key, value, is_param, dtype, shapes[id(value)] if is_param else value.shape))
    return out


class _Layout:
    """Where each of ``entries`` goes in one file, computed before anything is read."""

    def __init__(self, entries: list[_Entry]):
        header = {"__metadata__": {"format": "pt", "producer": "infinity"}}
        self.params: dict[int, list[tuple[int, torch.dtype]]] = {}  # id(param) -> (offset, dtype) of its keys
        self.buffers: list[tuple[int, torch.Tensor]] = []  # (file offset, tensor), persistent buffers
        end = 0
        for e in entries:
            header[e.key] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [end, end + e.nbytes]}
            if e.is_param:
                self.params.setdefault(id(e.value), []).append((end, e.dtype))
            else:
                self.buffers.append((end, e.value))
            end += e.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-aligned
        self.header = struct.pack("<Q", len(text)) + text
        self.size = len(self.header) + end
        # Offsets above are relative to the data; make them absolute in the file.
        self.params = {k: [(len(self.header) + o, dt) for o, dt in v] for k, v in self.params.items()}
        self.buffers = [(len(self.header) + o, t) for o, t in self.buffers]


def export_safetensors(engine, path) -> str:
    """Write ``engine``'s weights (fp32 masters, each parameter cast to its original dtype) and
    persistent buffers to ``path`` as one safetensors file; return its absolute path.

    Every rank must call it (see [Note: streamed export]); rank 0 writes. The file appears
    whole or not at all: an existing file at ``path`` is replaced atomically, or left as it was
    when the export fails. Its mode honours the umask."""
    path = os.path.abspath(os.fspath(path))
    layout = _Layout(_entries(engine))  # on every rank: a TypeError here raises before any gather
    engine.dist.meet("export", f"the export to {path}")
    write_files(engine, [(path, layout)], f"the export to {path}", done=f"exported {path}")
    return path


def write_files(engine, files: list[tuple[str, _Layout]], what: str, *, done: str, before_commit=None,
                after_commit=None) -> None:
    """Write each ``(path, layout)`` as a safetensors file, streaming the weights one unit at a
    time (every rank iterates; rank 0 writes), and rename them all into place, or none;
    ``before_commit`` runs on rank 0 just before the renames (to write what must appear with
    them), ``after_commit`` just after (to publish them: an index); an OSError of either fails
    the write on every rank. ``what`` names the work in errors, ``done`` in the log line."""
    start = time.monotonic()
    outs, error = [], None
    try:
        if engine.rank == 0:
            try:
                for path, layout in files:
                    out = _AtomicFile(path, layout.size)
                    outs.append(out)
                    out.write(layout.header, 0)
                    for offset, buf in layout.buffers:
                        out.write(buf.detach().to("cpu").contiguous(), offset)
            except Exception as e:  # noqa: BLE001 - raised below, once the ranks agree
                error = e
        if error is None or engine.dist.active:
            # Gathered to rank 0 only: the other ranks send their shard of each unit and hold none.
            with contextlib.closing(engine.unit_weights(rank0_only=True)) as weights:
                for unit, full in weights:
                    if outs and error is None:
                        try:
                            for out, (_, layout) in zip(outs, files):
                                _write_unit(out, layout, unit, full)
                        except Exception as e:  # noqa: BLE001 - as above
                            error = e
                    if error is not None and not engine.dist.active:
                        break  # no other rank waits on the gathers
                    del full  # one unit at a time
        if outs and error is None:
            try:
                if before_commit is not None:
                    before_commit()
                for out in outs:
                    out.commit()
                if after_commit is not None:
                    after_commit()
            except OSError as e:
                error = e
        engine.dist.agree_on_outcome(error, what)
    finally:
        for out in outs:
            out.discard()
    if engine.rank == 0:
        seconds = time.monotonic() - start
        size = sum(layout.size for _, layout in files)
        logger.info("%s: %.1f MB in %.2fs (%.0f MB/s)", done, size / 1e6, seconds, size / 1e6 / max(seconds, 1e-9))


def _write_unit(out: "_AtomicFile", layout: _Layout, unit, full: torch.Tensor) -> None:
    for r in unit.records:
        for offset, dtype in layout.params.get(id(r.param), ()):  # a parameter not in this file is not written
            # 1-D, the file's dtype, cpu; a tile's rows where they are in the parameter
            out.write(full[r.in_unit].to(dtype), offset + r.start * dtype.itemsize)


def _collect_dead(parent: str, name: str) -> None:
    """Remove the temporary files of ``name`` that killed writers left in ``parent``: each is
    the whole file's size, preallocated, and a killed export's was never removed (the next
    exports to the same path left it: an audit helper's repro). A live writer holds a flock
    on its own (`_AtomicFile`), and is left alone."""
    prefix = f".{name}.tmp-"
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return
    for n in names:
        tmp = os.path.join(parent, n)
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(tmp)
            logger.info("removed %s, which a killed write of %s left", tmp, os.path.join(parent, name))
        except OSError:
            pass  # held: a writer is at it
        finally:
            os.close(fd)


class _AtomicFile:
    """A temporary file beside ``path`` that `commit` renames onto it and `discard` removes.
    Its OSErrors name ``path``."""

    def __init__(self, path: str, size: int):
        self.path, self.fd, self.tmp = path, None, None
        parent, name = os.path.split(path)
        if not os.path.isdir(parent):
            raise FileNotFoundError(errno.ENOENT, "the export's directory does not exist", parent)
        try:
            with self._naming():
                _collect_dead(parent, name)  # their space, preallocated whole, first
                self.fd, self.tmp = tempfile.mkstemp(prefix=f".{name}.tmp-", dir=parent)
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # alive while held: `_collect_dead`
                os.fchmod(self.fd, 0o666 & ~_umask())  # mkstemp makes 0600; an export is for sharing
                try:  # reserve the space: a full disk fails now, not after hours of reading
                    os.posix_fallocate(self.fd, 0, size)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    os.ftruncate(self.fd, size)
        except BaseException:
            self.discard()
            raise

    def write(self, data, offset: int) -> None:
        if isinstance(data, torch.Tensor):  # its bytes, little-endian as the format requires
            data = data.reshape(-1).view(torch.uint8).numpy()
        view = memoryview(data).cast("B")
        with self._naming():
            while view:  # pwrite may write less than asked (at most 2 GiB a call on Linux)
                n = os.pwrite(self.fd, view, offset)
                if n == 0:
                    raise OSError(errno.EIO, "pwrite wrote nothing")
                view, offset = view[n:], offset + n

    def commit(self) -> None:
        with self._naming():
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = None
            os.replace(self.tmp, self.path)
            self.tmp = None
            fsync_dir(os.path.dirname(self.path))  # the rename, too, survives a crash

    def discard(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)
            self.tmp = None

    @contextlib.contextmanager
    def _naming(self):
        try:
            yield
        except OSError as e:
            if e.filename == self.path:
                raise
            via = f" (writing {self.tmp})" if self.tmp else ""
            raise OSError(e.errno, f"{e.strerror or e}{via}", self.path) from e


def _umask() -> int:
    # os.umask reads the mask only by setting it, a window in which another thread's files
    # would get the wrong mode; Linux reports it in /proc/self/status.
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask

"""A read-only view of one rank of a swap space: what swap-inspect and resume read.

It takes no lock and writes nothing, so it can look at a space that a running engine holds
(and may see a manifest older than the engine's newest writes, as a reader of any live
storage would).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import xxhash

from infinity import aio

from ._checksum import PREFIX, SwapCorruption, checksum
from ._common import ALIGNMENT, round_up
from ._io import Transfer, plain_alloc
from ._manifest import (
    MANIFEST_NAME,
    SPACE_NAME,
    Extent,
    ManifestError,
    Manifest,
    TensorRecord,
    DTYPES,
    load_manifest,
    load_space_json,
)

CHUNK_BYTES = 64 << 20  # what `read_chunks` holds at once: a tool's memory, whatever the tensor's size


class SpaceReader:
    """Read the tensors of the rank whose primary rank directory is ``rank_dir``.

    ``engine``: an aio engine to read with (opened here, and closed by `close`, if None).
    ``allow_unchecked``: open a version-1 manifest whose tensors lack checksums (see [Note:
    checksums]); ``read(verify=True)`` of such a tensor then checks nothing, and the caller
    must say so (swap-inspect does). Raises FileNotFoundError when ``rank_dir`` has no
    manifest, ManifestError when the manifest, or a member directory's space.json, cannot be
    trusted, and OSError naming the file when one is not a regular file.
    """

    def __init__(self, rank_dir: str | os.PathLike, *, engine: aio.Engine | None = None,
                 allow_unchecked: bool = False):  # fmt: skip
        self.rank_dir = os.path.abspath(os.fspath(rank_dir))
        path = os.path.join(self.rank_dir, MANIFEST_NAME)
        if not os.path.lexists(path):
            raise FileNotFoundError(2, "no swap manifest here (not a swap space rank directory)", path)
        self.manifest: Manifest = load_manifest(path, allow_unchecked=allow_unchecked)
        # Member 0 is where the manifest lies, whatever path it was opened under before.
        self.member_dirs = [self.rank_dir, *self.manifest.members[1:]]
        for k, member in enumerate(self.member_dirs):
            marker = os.path.join(member, SPACE_NAME)
            info = load_space_json(marker)
            if (info["space_id"], info["member"], info["rank"]) != (self.manifest.space_id, k, self.manifest.rank):
                raise ManifestError(
                    f"{marker}: belongs to space {info['space_id']} member {info['member']} rank {info['rank']}, "
                    f"not to {self.manifest.space_id} member {k} rank {self.manifest.rank}"
                )
        self._own_engine = engine is None
        self._engine = engine  # opened on the first read: looking needs no engine
        self._files: dict[int, aio.File] = {}

    @property
    def engine(self) -> aio.Engine:
        if self._engine is None:
            self._engine = aio.open_engine()
        return self._engine

    # -- what is there ----------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.manifest.tensors)

    def info(self, name: str) -> TensorRecord:
        try:
            return self.manifest.tensors[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in {self.rank_dir}") from None

    def file_path(self, index: int) -> str:
        f = self.manifest.files[index]
        return os.path.join(self.member_dirs[f.dir], f.name)

    def allocated_bytes(self) -> int:
        """Arena bytes owned by tensors (each extent rounded up to the alignment)."""
        a = self.manifest.alignment
        return sum(round_up(e.nbytes, a) for t in self.manifest.tensors.values() for e in t.extents)

    # -- reading ----------------------------------------------------------------------------
    def _file(self, index: int) -> aio.File:
        if index not in self._files:
            self._files[index] = aio.open_file(self.file_path(index), "r", regular=True)
        return self._files[index]

    def read(self, name: str, *, verify: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor ``name``, read through the aio engine into a new tensor, or into ``out``
        (contiguous, CPU, the tensor's dtype and numel); its checksum checked unless
        ``verify=False`` (SwapCorruption naming the tensor, its file and offset)."""
        record = self.info(name)
        dtype = DTYPES[record.dtype]
        if out is None:
            out = torch.empty(record.shape, dtype=dtype)
        elif out.dtype != dtype or out.numel() * out.element_size() != record.nbytes or not out.is_contiguous():
            raise ValueError(f"out is {out.dtype} of {out.numel()} elements, tensor {name!r} is {record.dtype} {list(record.shape)}")
        data = out.reshape(-1).view(torch.uint8) if out.numel() else torch.empty(0, dtype=torch.uint8)
        try:
            files = {e.file: self._file(e.file) for e in record.extents}  # only the ones it lives in
        except OSError as e:
            raise OSError(e.errno, f"tensor {name!r}: {e.strerror}", e.filename) from None
        Transfer(self.engine, files, record.extents, data, write=False, alloc=plain_alloc, name=name).wait()
        if verify:
            self.check(record, data)
        return out

    def read_chunks(self, name: str, *, verify: bool = True, chunk_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
        """The tensor ``name``, flat, as consecutive pieces of at most ``chunk_bytes`` bytes,
        so that a tensor larger than memory can be checked or summarised. Every piece is read
        into the same buffer, which the next one overwrites: use or copy it before asking for
        the next. With ``verify`` (the default) the checksum covers the whole tensor, so its
        SwapCorruption comes after the last piece: nothing drawn from the pieces is good before
        the end."""
        record = self.info(name)
        dtype = DTYPES[record.dtype]
        if chunk_bytes <= 0 or chunk_bytes % ALIGNMENT:
            raise ValueError(f"{chunk_bytes=} is not a positive multiple of {ALIGNMENT=} (O_DIRECT reads)")
        try:
            files = {e.file: self._file(e.file) for e in record.extents}
        except OSError as e:
            raise OSError(e.errno, f"tensor {name!r}: {e.strerror}", e.filename) from None
        digest = xxhash.xxh3_64() if verify and record.checksum is not None else None
        buffer = aio.empty_aligned(max(min(round_up(record.nbytes), chunk_bytes), 1), pin=False)  # 1-D uint8
        for lo in range(0, record.nbytes, chunk_bytes):
            hi = min(lo + chunk_bytes, record.nbytes)
            data = buffer[: hi - lo]
            Transfer(self.engine, files, _extents_within(record.extents, lo, hi), data, write=False,
                     alloc=plain_alloc, name=name).wait()  # fmt: skip
            if digest is not None:
                digest.update(data.numpy())
            yield data.view(dtype)
        if digest is not None and f"{PREFIX}{digest.hexdigest()}" != record.checksum:
            self._corrupt(record, f"{PREFIX}{digest.hexdigest()}")

    def check(self, record: TensorRecord, data: torch.Tensor) -> None:
        """Raise SwapCorruption unless ``data`` (the tensor's bytes) matches its checksum. A
        record without one (a version-1 manifest opened with ``allow_unchecked``) passes."""
        if record.checksum is None:
            return
        actual = checksum(data.numpy())
        if actual != record.checksum:
            self._corrupt(record, actual)

    def _corrupt(self, record: TensorRecord, actual: str):
        first = record.extents[0] if record.extents else None
        raise SwapCorruption(
            record.name, self.file_path(first.file) if first else self.rank_dir,
            first.offset if first else 0, record.checksum, actual,
        )  # fmt: skip

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._own_engine and self._engine is not None:
            self._engine.close()
            self._engine = None

    def __enter__(self) -> "SpaceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _extents_within(extents, lo: int, hi: int) -> list[Extent]:
    """The parts of ``extents`` (a tensor's, in order) that hold its bytes [lo, hi); ``lo`` a
    multiple of the alignment, as every extent but the last is long (see [Note: swap alignment]),
    so each part starts aligned in its file."""
    out, pos = [], 0
    for e in extents:
        a, b = max(lo, pos), min(hi, pos + e.nbytes)
        if a < b:
            out.append(Extent(e.file, e.offset + a - pos, b - a))
        pos += e.nbytes
    return out

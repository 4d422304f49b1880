"""A read-only view of one rank of a swap space: what swap-inspect and resume read.

It takes no lock and writes nothing, so it can look at a space that a running engine holds
(and may see a manifest older than the engine's newest writes, as a reader of any live
storage would).
"""

from __future__ import annotations

import os

import torch

from infinity import aio

from ._checksum import SwapCorruption, checksum
from ._common import round_up
from ._io import Transfer, plain_alloc
from ._manifest import (
    MANIFEST_NAME,
    SPACE_NAME,
    ManifestError,
    Manifest,
    TensorRecord,
    DTYPES,
    load_manifest,
    load_space_json,
)


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

    def read(self, name: str, *, verify: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor ``name``, read through the aio engine (checksum checked with ``verify``)
        into a new tensor, or into ``out`` (contiguous, CPU, the tensor's dtype and numel)."""
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

    def check(self, record: TensorRecord, data: torch.Tensor) -> None:
        """Raise SwapCorruption unless ``data`` (the tensor's bytes) matches its checksum. A
        record without one (a version-1 manifest opened with ``allow_unchecked``) passes."""
        if record.checksum is None:
            return
        actual = checksum(data.numpy())
        if actual != record.checksum:
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

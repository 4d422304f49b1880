"""A checkpoint's saved slices, read back: every saved rank's swap space, opened read-only on
first use, each slice verified against its checksum.

Owns: `Sources` (the readers of one load) and `fill` (a unit's flat tensor put together from
the saved units' runs, see [Note: re-cut] in `_recut`). Used by `_checkpoint.load` and by
`_consolidate.CheckpointWeights`, which reads the same slices without an engine.
"""

from __future__ import annotations

import os

import torch

from infinity.swap import SpaceReader

from ._substates import state_key
from .checkpoint import CheckpointError


BUFFER_PREFIX = "buffer/"  # a persistent buffer's tensor in rank 0's space: buffer/<state_dict key>


def rank_missing(rank_dir: str, q: int, world: int) -> str:
    return f"{rank_dir}: rank {q} of {world} is missing: the checkpoint is incomplete"


def rank_misplaced(rank_dir: str, held: int, q: int) -> str:
    return f"{rank_dir}: holds rank {held}, not rank {q}"


class Sources:
    """The saved ranks' swap spaces (read-only, opened on first use), for one load."""

    def __init__(self, where: str, world: int, aio=None, spaces: list[str] | None = None):
        """``aio``: the io_uring engine to read with (None: a reader's own); ``spaces``: each
        saved rank's space id, as meta.json records it (None: a checkpoint from before it did)."""
        self.where, self.world, self.aio, self.spaces = where, world, aio, spaces
        self.readers: dict[int, SpaceReader] = {}
        self.cache: dict[tuple[int, str], torch.Tensor] = {}  # (saved rank, tensor) -> 1-D, CPU; see _slice

    def reader(self, q: int) -> SpaceReader:
        if q not in self.readers:
            rank_dir = os.path.join(self.where, f"rank{q}")
            try:
                r = SpaceReader(rank_dir, engine=self.aio)
            except FileNotFoundError:
                raise CheckpointError(rank_missing(rank_dir, q, self.world)) from None
            if r.manifest.rank != q:
                r.close()
                raise CheckpointError(rank_misplaced(rank_dir, r.manifest.rank, q))
            if self.spaces is not None and r.manifest.space_id != self.spaces[q]:
                # Another save's files under this meta.json: the tag saved again while it was being
                # read (a loader beside a run that re-saves one tag), whose step, RNG states and
                # client_state would have come with the other save's tensors, silently (an audit
                # helper's repro).
                r.close()
                raise CheckpointError(f"{rank_dir}: holds the files of another save than {self.where}'s meta.json "
                                      f"(space {r.manifest.space_id}, not {self.spaces[q]}): the checkpoint was saved "
                                      "again while it was being read; load it again")  # fmt: skip
            self.readers[q] = r
        return self.readers[q]

    def record(self, q: int, name: str, dtype: torch.dtype, numel: int):
        r = self.reader(q)
        try:
            rec = r.info(name)
        except KeyError:
            raise CheckpointError(f"{r.rank_dir}: tensor {name!r} is missing: the checkpoint is incomplete") from None
        if rec.dtype != str(dtype).removeprefix("torch.") or rec.shape != (numel,):
            raise CheckpointError(f"{r.rank_dir}: tensor {name!r} is {rec.dtype} {list(rec.shape)}, expected "
                                  f"{str(dtype).removeprefix('torch.')} [{numel}]")  # fmt: skip
        return r

    def read(self, name: str, numel: int, kind: str, dtype: torch.dtype, a: int, b: int,
             out: torch.Tensor) -> None:  # fmt: skip
        """``out`` = elements ``[a, b)`` (within ``numel``) of the saved unit ``name``'s flat
        ``kind``, read from the saved ranks' slices, each verified against its checksum."""
        shard = -(-numel // self.world)  # a saved slice's length (the unit padded to the saved world size)
        tensor = state_key(name, kind)
        for q in range(a // shard, -(-b // shard)) if a < b else ():
            x, y = max(a, q * shard), min(b, (q + 1) * shard)
            reader = self.record(q, tensor, dtype, shard)
            if y - x == shard:
                reader.read(tensor, verify=True, out=out[x - a : y - a])
            else:
                out[x - a : y - a].copy_(self._slice(q, tensor)[x - q * shard : y - q * shard])

    def _slice(self, q: int, tensor: str) -> torch.Tensor:
        """Saved rank ``q``'s ``tensor``, whole, for reading part of it. The last two are kept: a
        re-cut unit takes its weight rows and its bias from one saved unit, and the next unit
        takes the rows after them from the same (see [Note: re-cut] in `_recut`)."""
        key = (q, tensor)
        if key in self.cache:
            self.cache[key] = self.cache.pop(key)  # the most recent last
        else:
            while len(self.cache) >= 2:
                del self.cache[next(iter(self.cache))]
            self.cache[key] = self.reader(q).read(tensor, verify=True)
        return self.cache[key]

    def close(self) -> None:
        self.cache.clear()
        for r in self.readers.values():
            r.close()


def fill(src: Sources, dst: torch.Tensor, runs: list, numel: int, kind: str, dtype, lo: int, hi: int) -> None:
    """``dst`` (1-D, CPU) = elements [lo, hi) of a unit's flat ``kind`` (zero past its ``numel``),
    made of ``runs`` of the saved units' (its `_recut.Plan` runs)."""
    if hi > numel:
        dst[max(numel - lo, 0) :].zero_()
    for run in runs:
        a, b = max(lo, run.at), min(hi, run.at + run.n)
        if a < b:
            at = run.start - run.at  # where the run's elements are in the saved unit, relative to the unit
            src.read(run.name, run.numel, kind, dtype, a + at, b + at, dst[a - lo : b - lo])

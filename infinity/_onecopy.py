"""One copy of the fp32 weights on nvme: the parameters are the master weights.

Owns: whether a run keeps one copy (`applies`), the page alignment of the units' slices in a
sub-group (`ALIGN`), and `MasterView`, the store of the master weights that reads and writes
them as the units' parameters. Touches: the params store's swap space (reads and writes under
the parameters' keys), the stats (its traffic counts as "master").

[Note: one copy of the fp32 weights]
With fp32 parameters and both the params and the optimizer tiers on nvme, each rank keeping
its own slice (not stages 1 and 2 with several ranks, which keep whole parameters), a unit's
parameters are exactly its slice of the master weights: two copies of the same values, and
the step wrote both (the new master weights, then the new parameters from them: 4 bytes a
parameter written twice, 4 more on disk). Here the engine keeps one: under the unit's name
(``<unit>/param``, what forward and backward read). A sub-group's master weights are its
units' parameters read into one buffer, each at its slice, and written back from there
(`MasterView`, `infinity.swap.Joined` in the step's stream). A step then moves, per
parameter, 4 bytes read for forward, 4 read and 4 written as the master weights, and the
algorithm's states; the disk holds the state less 4 bytes a parameter. Each unit's slice of a
sub-group starts at a whole page (`ALIGN` elements), so each read and write goes straight to
the buffer, not through a bounce copy; a unit under 8 pages is packed without a gap (its
few bytes go through the swap space's bounce buffers). The overlap ([Note: exact overlap]) stages the
master weights once: they are the staged parameters (``<unit>~next/param``). Checkpoints keep
their format (each unit's ``master`` and ``param``, equal here).

In memory the same holds where fp32 parameters and the master weights are resident on one
device (params on the device tier and the optimizer on the cpu tier with no GPU, or every tier
on the device), each rank keeping its slice, with the engine's own algorithm: initialize puts
each sub-group's parameters in one flat tensor laid out as its master weights
(`_substates.SubGroupStates.shared`), and the first step that runs without the overlap makes
that tensor the master weights (`Store.swap`, where the two hold the same values), so the
kernel updates the parameters in place: no copy of 4 bytes read and 4 written a parameter
after each update (a quarter of the 106M Llama's host step, `benchmarks/host_step.py`), and 4
bytes a parameter less memory. Not under the overlap in host memory ([Note: staged in host
memory]): its commit swaps staged copies in for the master weights and hands the old ones to
its staging, which must not be the parameters. Checkpoints and loads see two stores as
before; a write into either is a write into both, and the parameters' write after an update
is skipped (a `put` of a tensor into itself copies nothing). Its bytes count as ``master``.
"""

from __future__ import annotations

import torch

from infinity.swap import ALIGNMENT, Joined, JoinedRead

from ._store import Lease, Pending, Store
from ._substates import STAGED

ALIGN = ALIGNMENT // 4  # fp32 elements a page holds: where each unit's slice of a sub-group starts


def applies(params_tier: str, optimizer_tier: str, param_dtype: torch.dtype, whole_params: bool, algorithm) -> bool:
    """Whether the parameters are the master weights (see the module's note): fp32 parameters,
    both tiers on nvme, each rank keeping only its slice, an algorithm of the engine's own."""
    return (params_tier == optimizer_tier == "nvme" and param_dtype == torch.float32 and not whole_params
            and algorithm.name != "torch")  # fmt: skip


class _AllOf:
    """Several swap futures as one (every one waited for; the first error raised)."""

    __slots__ = ("futures",)

    def __init__(self, futures):
        self.futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self):
        error = None
        for f in self.futures:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - every write finishes; the first error is raised
                error = error or e
        if error is not None:
            raise error


class MasterView:
    """The master weights of every sub-group, stored as its units' parameters (see the module's
    note): `Store`'s interface over a sub-group's name (or its staged name)."""

    kind = "master"
    tier = "nvme"
    uses_pool = True
    held_bytes = 0

    def __init__(self, param_store: Store, groups, stats):
        self.params = param_store
        self._space = param_store._space
        self._stats = stats
        self.device = torch.device("cpu")
        self._groups = {g.name: g for g in groups}

    def in_place_on(self, device: torch.device) -> bool:
        return False

    def stream_member(self, name: str) -> Joined:
        return self.joined(name)

    def streamed_bytes(self, name: str, tensor: torch.Tensor) -> int:
        return self.real_bytes(name)

    def _parts(self, name: str) -> tuple[list[tuple[str, int, int]], int]:
        """(key, start, numel) of each unit's parameters in sub-group ``name``'s master weights
        (its staged ones for a staged name), and the sub-group's numel with the gaps."""
        staged = name.endswith(STAGED)
        group = self._groups[name.removesuffix(STAGED)]
        return [(self.params._key(u.name + STAGED if staged else u.name), group.slices[u.index].start, u.shard_numel)
                for u in group.units], group.numel  # fmt: skip

    def joined(self, name: str) -> Joined:
        """Sub-group ``name``'s master weights as the units' parameter tensors at their slices."""
        parts, numel = self._parts(name)
        return Joined(tuple(k for k, _, _ in parts), tuple(s for _, s, _ in parts), numel, torch.float32)

    def real_bytes(self, name: str) -> int:
        """Bytes of sub-group ``name``'s master weights, without the gaps between slices."""
        return 4 * sum(n for _, _, n in self._parts(name)[0])

    def get(self, name: str, timeout: float | None = None, urgent: bool = False) -> Pending:
        joined = self.joined(name)
        read = JoinedRead(self._space, joined, timeout)
        span = self._stats.io("nvme", False, self.real_bytes(name), self.kind)
        return Pending(read, span, wrap=lambda buffer: Lease(buffer.tensor[: joined.nbytes()].view(torch.float32), buffer))

    def put(self, name: str, tensor: torch.Tensor, *, copy: bool = False, dtype=None, timeout=None) -> Pending:
        """Write the units' parameters from their slices of ``tensor`` (behind: ``tensor`` must
        stay unchanged until the result)."""
        if copy or tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.dtype != torch.float32:
            raise ValueError(f"the master weights of {name} are written from the fp32 buffer they were read in")
        futures = []
        span = self._stats.io("nvme", True, self.real_bytes(name), self.kind)
        try:
            for key, start, n in self._parts(name)[0]:
                futures.append(self._space.put(key, tensor[start : start + n]))
        except BaseException:
            try:
                _AllOf(futures).result()  # what started still reads ``tensor``: finished first
            except Exception:  # noqa: BLE001 - the error being raised is the one to see
                pass
            span.done()
            raise
        return Pending(_AllOf(futures), span)

    def writable(self, name: str) -> Lease:
        """A pool buffer shaped as sub-group ``name``'s master weights, to fill and then `put`."""
        numel = self._parts(name)[1]
        buffer = self._space.pool.acquire(max(4 * numel, 1))
        return Lease(buffer.tensor[: 4 * numel].view(torch.float32), buffer)

    def rename(self, src: str, dst: str) -> None:
        for (a, _, _), (b, _, _) in zip(self._parts(src)[0], self._parts(dst)[0]):
            self._space.rename(a, b)

    def discard(self, name: str) -> None:
        for key, _, _ in self._parts(name)[0]:
            if key in self._space:
                self._space.delete(key)

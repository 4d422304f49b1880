"""How much disk a run's swap space takes, checked at initialize before anything is written.

Owns: the peak bytes each drive of ``nvme.paths`` holds (the state under its real names, the
overlap's staged ``~next`` copies, the arena's alignment), the comparison with the drive's free
space and ``nvme.disk_budget``, the cap put on each arena so that it never grows past what was
checked, and the bytes of staging the overlap may hold. Touches: the config, the engine's
stores and sub-groups through its `_layout.Layout` (read only), `infinity.swap.SwapSpace` (its
layout and `limit`), `_bytes` (the sizes of the tensors).

[Note: disk footprint]
A 2.7B model with every tier on nvme passed initialize and died in its first backward with
ENOSPC: the overlap's staged copies of the optimizer states ([Note: exact overlap]) come on top
of the state, and nothing had compared the two with the drive. The state under its real names
is written in place at every step (same name, same size), so the arena's peak is the state plus
what is staged at once. Staging every sub-group of an fp32 AdamW with every tier on nvme takes
16 bytes a parameter beside the state's 20 (the arena reached 1.87x the state), so the staging
is bounded too: ``optimizer.overlap_disk`` (default 0.3) of the state on each drive. The cap
(`SwapSpace.limit`) makes the bound hold whatever the growth rule of the arena (doubling, then
``grow_step``) would add: an arena never grows past the smallest of its drive's free space at
initialize, the budget, and the state with ``overlap_disk`` of it more. The overlap stages a
sub-group only while the staged bytes fit what is left (`Footprint.staging_room`); the rest is
updated by the step after backward, which is exact either way. What a commit frees (the old
extents of the names the staged copies take) is taken again, best fit, by the next step's
staged copies of the same sizes. A staged write that still finds no room (another process
filled the drive, or the extents free do not fit it) leaves its sub-group to the step; one
that finds the disk full is a failure the engine refuses to train on until a checkpoint loads
(`_overlap`). Ranks whose swap directories lie on one filesystem (one host, one ``st_dev``)
each saw all of its free space: `share` adds up their states, refuses on each of them what
does not fit together, and gives each a share of the space in proportion to its state.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket

from infinity.swap import ALIGNMENT, round_up

from . import _bytes, _overlap_host
from ._resources import distinct_sizes

logger = logging.getLogger("infinity")

def disk_free(path: str) -> int:
    """Bytes an unprivileged writer can still take on the filesystem of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class Drives:
    """Where a swap space puts tensors, per drive, as `_arenas.Arenas.plan` does: a tensor of
    ``stripe_threshold`` bytes or more in ``stripe_size`` pieces over every drive, a smaller
    one whole on the drive holding the least; every piece rounded up to the alignment."""

    def __init__(self, members: int, stripe_size: int, stripe_threshold: int):
        self.members, self.stripe_size, self.stripe_threshold = members, stripe_size, stripe_threshold
        self.used = [0] * members

    def add(self, nbytes: int) -> list[int]:
        """Place a tensor of ``nbytes``; the bytes it takes on each drive."""
        taken = [0] * self.members
        if nbytes <= 0:
            return taken
        if self.members > 1 and nbytes >= self.stripe_threshold:
            per = round_up(-(-nbytes // self.members), self.stripe_size)
            for k in range(self.members):
                if k * per < nbytes:
                    taken[k] = round_up(min(per, nbytes - k * per), ALIGNMENT)
        else:
            least = min(range(self.members), key=lambda k: self.used[k])
            taken[least] = round_up(nbytes, ALIGNMENT)
        for k, n in enumerate(taken):
            self.used[k] += n
        return taken


@dataclasses.dataclass
class Footprint:
    """The disk a run takes, per drive (in the order of ``nvme.paths``), in bytes."""

    paths: list[str]
    state: list[int]  # the state under its real names
    staging: list[int]  # every sub-group staged at once (0 without overlap)
    available: list[int]  # free space at initialize plus what the arena there held (this rank's share)
    budget: int | None  # nvme.disk_budget, per drive
    fraction: float = 0.0  # optimizer.overlap_disk: the staging allowed beside the state, per byte of it
    slack: int = 0  # how far the placement of whole (unstriped) tensors may stray from `Drives`', per drive
    staging_room: int | None = None  # staged bytes the overlap may hold at once (None: all)
    stages: bool = False  # whether early updates stage anything on disk (`plan`)

    @property
    def limits(self) -> list[int]:
        """What each drive allows: its free space, and ``nvme.disk_budget``."""
        return [a if self.budget is None else min(a, self.budget) for a in self.available]

    @property
    def caps(self) -> list[int]:
        """The most each arena may grow to: within its drive's limit, and within the state
        and ``fraction`` of it more (what the overlap may stage there, and the slack of the
        placement), so that the arena's bound holds whatever the growth steps."""
        return [min(lim, round_up(s + int(s * self.fraction), ALIGNMENT) + self.slack)
                for s, lim in zip(self.state, self.limits)]  # fmt: skip

    @property
    def peak(self) -> list[int]:
        """What each drive holds at most: the state and the staging that fits."""
        if self.staging_room is None:
            return [s + t for s, t in zip(self.state, self.staging)]
        total = sum(self.staging) or 1
        return [min(c, s + -(-t * self.staging_room // total)) for s, t, c in zip(self.state, self.staging, self.caps)]

    def as_dict(self, space=None) -> dict:
        """Per path: state, peak and cap bytes, and the arena's size now when ``space`` is given."""
        arenas = space.arena_sizes() if space is not None else [None] * len(self.paths)
        return {p: {"state_bytes": s, "peak_bytes": k, "cap_bytes": c, "arena_bytes": a}
                for p, s, k, c, a in zip(self.paths, self.state, self.peak, self.caps, arenas)}  # fmt: skip


def plan(layout, cfg, run) -> Footprint:
    """The footprint of the run that ``layout`` (a `_layout.Layout`) lays out on its swap space
    under the memory plan ``run`` (an `_admission.Plan`: whether the optimizer may run under
    backward with its states on nvme, whose staged copies then take disk; or with them in host
    memory, where the new parameters may be written under backward under staged names,
    [Note: parameters written under backward] in `_overlap_host`), with each drive's room now."""
    overlap = bool(run.overlap)
    staged_params = _overlap_host.params_staged(run, layout)
    space = layout.space
    drives = Drives(len(space.rank_dirs), cfg.nvme.stripe_size, cfg.nvme.stripe_threshold)
    state = [0] * drives.members
    for n in (n for sizes in _bytes.state_tensors(layout).values() for n in sizes):
        state = [a + b for a, b in zip(state, drives.add(n))]
    staging = [0] * drives.members
    if overlap or staged_params:
        st = layout.states
        for sg in st.groups:
            sizes = _bytes.staged_tensors(st, sg) if overlap else _bytes.staged_params(st, sg)
            for n in sizes:
                staging = [a + b for a, b in zip(staging, drives.add(n))]
    arenas = space.arena_sizes()
    available = [(disk_free(d) + a) // ALIGNMENT * ALIGNMENT for d, a in zip(space.rank_dirs, arenas)]
    # A whole tensor goes to the drive holding the least when it is written, which need not be
    # the drive `Drives` chose: a drive may hold up to one such tensor more than planned.
    slack = round_up(cfg.nvme.stripe_threshold, ALIGNMENT) if drives.members > 1 else 0
    return Footprint(list(space.rank_dirs), state, staging, available, cfg.nvme.disk_budget,
                     fraction=cfg.optimizer.overlap_disk, slack=slack, stages=overlap or staged_params)  # fmt: skip


def share(fp: Footprint, dist, space) -> None:
    """Ranks whose swap directories lie on one filesystem (this host's, by ``st_dev``) share its
    free space: refuse, on each of them, states that do not fit it together, naming the ranks
    and the figures; otherwise give each rank a share of the space in proportion to its state
    (``fp.available``). Every rank calls it (a collective); nothing with one rank."""
    if not dist.active:
        return
    host = socket.gethostname()
    held = space.arena_sizes()
    mine = [[f"{host}:{os.stat(d).st_dev}", s, a - h, h]  # a - h: the free space `plan` read
            for d, s, a, h in zip(space.rank_dirs, fp.state, fp.available, held)]  # fmt: skip
    every = [json.loads(t) for t in dist.gather_text(json.dumps(mine), "the disk footprint check at initialize")]
    for k, (key, state, _, _) in enumerate(mine):
        alike = [(r, s, f, h) for r, drives in enumerate(every) for fs, s, f, h in drives if fs == key]
        if len(alike) < 2:
            continue  # this drive is this rank's alone
        total = sum(s for _, s, _, _ in alike)
        room = (min(f for _, _, f, _ in alike) + sum(h for _, _, _, h in alike)) // ALIGNMENT * ALIGNMENT
        if total > room:
            need, free = distinct_sizes(total, room)
            ranks = ", ".join(str(r) for r, _, _, _ in alike)
            raise ValueError(
                f"the swap spaces of ranks {ranks} lie on one filesystem (this rank's under {fp.paths[k]!r}) "
                f"and need {need} together for their state on nvme, but it has {free} free (statvfs, with "
                "what their arenas held); give the ranks drives of their own (nvme.paths with {local_rank}), "
                "put fewer tiers on nvme, or free space there"
            )
        if total:
            fp.available[k] = min(fp.available[k], room * state // total // ALIGNMENT * ALIGNMENT)


def check(fp: Footprint) -> None:
    """Refuse a run whose state does not fit a drive's free space or ``nvme.disk_budget``,
    naming the path, the figures and what to change; otherwise set ``fp.staging_room``."""
    for path, state, avail in zip(fp.paths, fp.state, fp.available):
        if state > avail:
            need, free = distinct_sizes(state, avail)  # never two different figures that read the same
            raise ValueError(
                f"the swap space under {path!r} needs {need} for the state on nvme, but its "
                f"filesystem has {free} free (statvfs, with what the arena there held); "
                "put fewer tiers on nvme ([tiers] params, grads, optimizer), add or change nvme.paths "
                "(the state stripes over them), or free space there"
            )
        if fp.budget is not None and state > fp.budget:
            need, budget = distinct_sizes(state, fp.budget)
            raise ValueError(
                f"the swap space under {path!r} needs {need} for the state on nvme, more than "
                f"nvme.disk_budget={budget}; raise nvme.disk_budget, put fewer tiers on nvme "
                "or add nvme.paths (the state stripes over them)"
            )
    total = sum(fp.staging)
    if not fp.stages or total == 0:
        fp.staging_room = None if fp.stages else 0
        return
    # The staged bytes the tightest drive allows (its cap, less the state and the placement's
    # slack), spread as the staging spreads over the drives.
    room = min((c - s - fp.slack) * total // t for s, t, c in zip(fp.state, fp.staging, fp.caps) if t)
    fp.staging_room = None if room >= total else max(room, 0)


def fit(layout, cfg, run) -> Footprint:
    """`plan`, `share` and `check` the footprint of ``layout``'s run under the memory plan
    ``run``, then cap each arena at what was checked."""
    fp = plan(layout, cfg, run)
    share(fp, layout.dist, layout.space)
    check(fp)
    if fp.staging_room:
        room, total = distinct_sizes(fp.staging_room, sum(fp.staging))
        logger.info("optimizer.overlap: the disk (optimizer.overlap_disk=%g of the state, free space, "
                    "nvme.disk_budget) leaves %s beside the state for staged copies, of the %s staging every "
                    "sub-group takes; the sub-groups past it are updated after backward",
                    fp.fraction, room, total)  # fmt: skip
    # never below what an arena holds already (a swap space reopened with its tensors)
    layout.space.limit([max(c, a) for c, a in zip(fp.caps, layout.space.arena_sizes())])
    return fp

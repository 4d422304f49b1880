"""Sizing before a run: what a model takes on each tier, the host budget and the disk, and what
a step moves, for each placement, without training or writing its state.

Owns: the estimate (`estimate`, one `Estimate` per placement) and the machine it is compared
with (`Machine`). Touches: `_assembly.lay_out` (what `initialize` lays out, called);
`_admission`'s plan, `_footprint`'s layout and check (called, not copied).

[Note: estimate from the engine's own plan]
Figures computed a second time drift from the engine's. So the estimate lays the model out
with the function `initialize` lays it out with, `_assembly.lay_out` (units, tiles,
sub-groups, stores, the optimizer's records: no tensor is made, a model from `infinity.build`
stays on the meta device), and, given the `_layout.Layout` that `initialize` plans the host
budget and checks the disk from (`_assembly.plan_memory`), it runs those same functions
(`_admission.make_plan` and `finish`, `_footprint.plan` and `check`) with the budgets it
wants; nothing is written, and the swap space it opened under a directory of its own is
discarded. What the engine does not compute
before a step, the bytes a step moves, follows docs/architecture.md "The bytes of a step" from
the same records. tests/tools/test_estimate.py holds every figure to a real `initialize` and
`engine.stats()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from typing import Callable

import torch
from torch import nn

from infinity.swap import ALIGNMENT, round_up

from . import _activations, _admission, _assembly, _bytes, _footprint, _resources
from ._dist import Dist
from ._stats import Stats
from .config import TierConfig

logger = logging.getLogger("infinity")

# The placements DeepSpeed users pick, as (params, grads, optimizer) tiers. An offloaded
# optimizer takes the gradients with it to the cpu, as DeepSpeed's does (`_deepspeed`).
PLACEMENTS: dict[str, tuple[str, str, str]] = {
    "device": ("device", "device", "device"),  # ZeRO-3 without offload
    "zero-offload": ("device", "cpu", "cpu"),  # offload_optimizer cpu
    "params-cpu": ("cpu", "cpu", "cpu"),  # offload_param and offload_optimizer cpu
    "zero-infinity": ("nvme", "cpu", "nvme"),  # offload_param and offload_optimizer nvme
    "nvme": ("nvme", "nvme", "nvme"),  # every tier on nvme, gradients too
}
TIERS = ("device", "cpu", "nvme")
KINDS = ("params", "grads", "optimizer")
# The bound README.md and docs/config.md give for the process's peak RSS growth over its
# resident state: 1.25 x memory.host_budget + 128MiB (with a small batch; activations on top).
RSS_FACTOR, RSS_EXTRA = 1.25, 128 << 20


@dataclasses.dataclass(kw_only=True)
class Machine:
    """What the estimate compares with: bytes free per swap directory (in the order of
    ``nvme.paths``), host memory available and device memory (None: no GPU)."""

    disk_free: list[int]
    ram: int | None
    gpu: int | None

    @classmethod
    def detect(cls, paths, *, disk_free=None, ram=None, gpu=None) -> Machine:
        """This machine: statvfs of each path, MemAvailable, the GPU's total memory; each
        given value overrides what was read."""
        if disk_free is None:
            disk_free = [_footprint.disk_free(_existing(p)) for p in paths]
        if ram is None:
            ram = _resources.mem_available()
        if gpu is None and torch.cuda.is_available():
            gpu = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return cls(disk_free=list(disk_free), ram=ram, gpu=gpu)


@dataclasses.dataclass(kw_only=True)
class Estimate:
    """One placement's figures (bytes)."""

    name: str
    tiers: dict[str, str]  # params, grads, optimizer -> device, cpu or nvme
    params: int  # parameters of the model
    units: int  # parameter units (a tiled Linear or Embedding is a unit per tile)
    sub_groups: int  # optimizer sub-groups
    state: dict[str, dict[str, int]]  # tier -> kind -> bytes at rest there (nvme: as written, aligned)
    host_budget: int  # memory.host_budget the plan was made for
    floor: int  # the smallest memory.host_budget initialize accepts
    floor_what: str  # what sets it ("optimizer step", "forward/backward")
    overlap_from: int | None  # the smallest budget with the optimizer under backward (None: never)
    overlap: bool  # whether the optimizer runs under backward at host_budget
    shares: dict[str, int]  # the plan's shares of host_budget (engine.stats()["pool"]["shares"])
    disk: list[dict[str, int]]  # per swap directory: state_bytes, peak_bytes, cap_bytes
    disk_refused: str | None  # why initialize would refuse the disk (None: it fits)
    step_floor: dict[str, int]  # nvme bytes a step moves by kind, with every unit kept and gradient held
    step_most: dict[str, int]  # ... with none kept or held
    step_expected: dict[str, int]  # ... with the gradients the plan holds held, the units it keeps kept
    fits: dict[str, bool | None]  # gpu, ram, disk, budget -> whether it fits (None: not known)
    needs: dict[str, int]  # gpu, ram, disk -> what was compared with the machine

    @property
    def fits_all(self) -> bool:
        """Whether nothing known is short (an unknown figure does not count against it)."""
        return all(v is not False for v in self.fits.values())

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["fits_all"] = self.fits_all
        for key in ("step_floor", "step_most", "step_expected"):
            out[key + "_bytes_per_param"] = sum(out[key].values()) / max(self.params, 1)
        return out


def estimate(make_model: Callable[[], nn.Module], config=None, *, placements=None, host_budget=None,
             machine: Machine | None = None) -> list[Estimate]:  # fmt: skip
    """The figures of the model ``make_model()`` (called inside ``infinity.build``, once per
    placement) under ``config`` (anything `initialize` takes), for each placement of
    ``placements`` (name -> (params, grads, optimizer) tiers; default `PLACEMENTS`), at
    ``host_budget`` (default the config's), compared with ``machine`` (default this one)."""
    from . import _build

    cfg = _resources.as_config(config)
    if host_budget is not None:
        cfg = cfg.replace(memory={"host_budget": host_budget})
    paths = [p.format(rank=0, local_rank=0) for p in cfg.nvme.paths] or [os.getcwd()]
    if machine is None:
        machine = Machine.detect(paths)
    if len(machine.disk_free) != len(paths):
        raise ValueError(f"the machine has {len(machine.disk_free)} disk figures for {len(paths)} nvme.paths {paths}")
    out = []
    level = logger.level
    # The bisection plans dozens of budgets; what the engine logs about each is not the user's.
    logger.setLevel(max(level, logging.WARNING))
    try:
        for name, tiers in (placements or PLACEMENTS).items():
            tiers = dict(zip(KINDS, tiers))
            with _scratch(paths) as dirs:
                run = cfg.replace(tiers=tiers, nvme={"paths": dirs})
                with _build.build(run):
                    model = make_model()
                figures = _figures(model, run, machine.disk_free, paths)
            out.append(_finish(name, tiers, figures, machine, paths, cfg))
    finally:
        logger.setLevel(level)
    return out


def _figures(model: nn.Module, cfg: TierConfig, disk_free: list[int], paths: list[str]) -> dict:
    """`_measure` of what `initialize` lays out for ``model`` under ``cfg`` (`_assembly.lay_out`,
    its stores in a swap space under ``cfg``'s scratch directories, discarded after), with
    ``disk_free`` as the free space of each of the drives ``paths`` ([Note: estimate from the
    engine's own plan]). Nothing is written."""
    dist = Dist(cfg.partition.timeout)
    aio, pool, space = _resources.open_io(cfg, dist.rank, dist.local_rank)
    try:
        parts = _assembly.lay_out(model, cfg, device=_assembly.device_of(dist), dist=dist, space=space, pool=pool,
                                  stats=Stats())  # fmt: skip
        return _measure(parts.layout, cfg, disk_free, paths)
    finally:
        _resources.close_io(space, pool, aio, discard=True)


def _measure(layout, cfg: TierConfig, disk_free: list[int], paths: list[str]) -> dict:
    """What `_assembly.plan_memory` would plan and check for ``cfg`` and ``layout`` (the
    engine's `_layout.Layout`) on a machine with ``disk_free`` bytes free on each drive of
    ``paths``, and the floor."""
    in_pool = _activations.in_pool(cfg)
    units = layout.units

    def plan_at(budget: int, base: TierConfig = cfg):
        try:
            return _admission.make_plan(layout, base.replace(memory={"host_budget": budget}),
                                        activations_in_pool=in_pool)  # fmt: skip
        except _resources.HostBudgetError as e:
            return e

    floor, what = _floor(plan_at)
    budget = cfg.memory.host_budget
    plan = plan_at(max(budget, floor))  # below the floor: the figures at the floor, marked refused
    if isinstance(plan, _resources.HostBudgetError):  # a need that grew past the budget above the floor
        plan = plan_at(floor)
    at = cfg.replace(memory={"host_budget": plan.budget})
    fp, refused = None, None
    if layout.space is not None:
        fp = _footprint.plan(layout, at, plan)
        fp.available = [f // ALIGNMENT * ALIGNMENT for f in disk_free]  # the machine's, not the scratch's
        fp.paths = list(paths)  # what a refusal names: the user's directories, not the scratch ones
        try:
            _footprint.check(fp)
        except ValueError as e:
            refused = str(e)
    _admission.finish(plan, layout, fp)
    # What the step moves under the overlap is what it moves after backward, where the
    # overlap's early updates leave room for held gradients (docs/config.md, optimizer.overlap:
    # 29.9 bytes a parameter against 30.1 for the 953M Llama): the plan without it says how
    # many gradients are held and units kept. Where no gradient is held in the pool, the
    # overlap's own plan keeps no unit either (`_admission.finish`), and that is what runs.
    moves = plan
    if plan.overlap and plan.held:
        moves = plan_at(plan.budget, cfg.replace(optimizer={"overlap": False}))
        _admission.finish(moves, layout)
    st = layout.states
    shard = sum(u.shard_numel for u in units)
    full = sum(u.padded_numel for u in units)
    trainable = [u for u in units if u.trainable]
    grad_numel = sum(u.padded_numel if layout.grads_full else u.shard_numel for u in trainable)
    params = {p for u in units for p in u.params}  # a tiled one is in each of its tiles
    # From the first step on, fp32 parameters resident beside the master weights are them
    # ([Note: one copy of the fp32 weights] in `_onecopy`; counted in the params tier), unless
    # the overlap stages copies in host memory.
    shares = st.may_share() and not plan.staging
    shared = sum(g.record.nbytes("master") for g in st.groups) if shares else 0
    return {
        "params": sum(p.numel() for p in params), "units": len(units), "sub_groups": len(st.groups),
        "floor": floor, "floor_what": what, "budget_ok": plan.budget == budget, "overlap_from": plan.overlap_from,
        "plan": plan, "moves": moves, "footprint": fp, "refused": refused, "on_nvme": _on_nvme(layout),
        "resident": {"params": (full if st.gather_params else shard) * layout.dtype.itemsize, "grads": grad_numel * 4,
                     "optimizer": sum(g.record.state_bytes(st.kinds) for g in st.groups) - shared},
        "step": _step_bytes(layout, units, cfg.memory.keep_params), "grad_bytes": grad_numel * 4,
        "param_bytes": sum(st.record(u).nbytes("param") for u in units),
    }  # fmt: skip


def _floor(plan_at) -> tuple[int, str]:
    """The smallest budget ``plan_at`` accepts, and the need that sets it. The needs grow with
    the budget (the step reads further ahead, activation chunks grow) but slower than it, so
    the budgets accepted are those from one on: found by bisection."""
    tried = plan_at(_admission._PAGE)
    lo = tried.need if isinstance(tried, _resources.HostBudgetError) else _admission._PAGE
    hi = lo
    while isinstance(plan_at(hi), _resources.HostBudgetError):
        hi *= 2
    lo = min(lo, hi) - 1  # refused (or below the page, where the first try was accepted)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if isinstance(plan_at(mid), _resources.HostBudgetError):
            lo = mid
        else:
            hi = mid
    plan = plan_at(hi)
    return hi, max((v, k) for k, v in plan.needs.items())[1]


def _on_nvme(layout) -> dict[str, int]:
    """Bytes of each kind the run keeps on nvme, each tensor aligned as the swap space writes it."""
    out = dict.fromkeys(KINDS, 0)
    for kind, sizes in _bytes.state_tensors(layout).items():
        out[kind] = sum(round_up(n, ALIGNMENT) for n in sizes)
    return out


def _step_bytes(layout, units, keep_params: bool) -> dict[str, dict[str, int]]:
    """The nvme bytes of one step (one micro-batch) by kind, as `engine.stats()["step"]["nvme"]
    ["by_kind"]` counts them (read and written together): "floor" with every unit kept for
    backward, every gradient held for the step and (``keep_params``) every parameter kept in
    the pool between steps, "most" with none; see docs/architecture.md "The bytes of a step"."""
    st = layout.states
    floor, most = {}, {}
    trainable = [u for u in units if u.trainable]
    if layout.param_store.tier == "nvme":
        param = sum(st.record(u).nbytes("param") for u in units)
        written = sum(st.record(u).nbytes("param") for u in trainable) if not st.one_copy else 0
        # Read for forward, unless kept in the pool from the write (not with one copy: the
        # optimizer's stream writes those back); the new parameters written.
        floor["param"] = (param if st.one_copy or not keep_params else param - written) + written
        most["param"] = 2 * param + written  # read again for backward
    if layout.grad_store.tier == "nvme":
        grads = sum(4 * (u.padded_numel if layout.grads_full else u.shard_numel) for u in trainable)
        floor["grad"], most["grad"] = 0, 2 * grads  # written in backward, read by the step
    if st.stores["master"].tier == "nvme":
        for k in st.kinds:
            if k == "master" and st.one_copy:  # the parameters: read for the update, written once
                n = 2 * sum(st.record(u).nbytes("param") for u in trainable)
            else:
                n = 2 * sum(g.record.nbytes(k) for g in st.groups)
            floor[k] = most[k] = n
    return {"floor": floor, "most": most}


def _finish(name: str, tiers: dict, f: dict, machine: Machine, paths: list[str], cfg: TierConfig) -> Estimate:
    """The placement's `Estimate` from the measured figures, compared with ``machine``."""
    plan, fp = f["plan"], f["footprint"]
    state = {t: dict.fromkeys(KINDS, 0) for t in TIERS}
    for kind in KINDS:
        tier = tiers[kind]
        state[tier][kind] = f["on_nvme"][kind] if tier == "nvme" else f["resident"][kind]
    disk = []
    if fp is not None:
        disk = [{"path": p, "state_bytes": s, "peak_bytes": k, "cap_bytes": c}
                for p, s, k, c in zip(paths, fp.state, fp.peak, fp.caps)]  # fmt: skip
    expected, moves = dict(f["step"]["floor"]), f["moves"]
    if "grad" in expected:  # gradients past what the plan holds are written and read back
        expected["grad"] = 2 * max(0, f["grad_bytes"] - moves.held)
    # Units past what the plan keeps for backward are read again, unless the pool keeps their
    # buffers (memory.keep_params): expected where the room no need of the plan nor the
    # overlap's staged copies take holds every parameter (a bound, not the pool at each fetch).
    room = plan.usable - plan.staging - max(plan.needs.values())  # (the staged copies are beside the pool)
    kept_in_pool = cfg.memory.keep_params and room >= f["param_bytes"]
    if "param" in expected and not kept_in_pool:  # read for forward (the most less the read again), and again
        expected["param"] = f["step"]["most"]["param"] - f["param_bytes"] + max(0, f["param_bytes"] - moves.kept)
    on_gpu = machine.gpu is not None
    host = sum(state["cpu"].values()) + (0 if on_gpu else sum(state["device"].values()))
    pool = any(t != "device" for t in tiers.values())  # every tier on the device moves nothing through it
    needs = {"gpu": sum(state["device"].values()) if on_gpu else 0,
             "ram": host + (int(RSS_FACTOR * plan.budget) + RSS_EXTRA if pool else 0),
             "disk": sum(d["peak_bytes"] for d in disk)}  # fmt: skip
    fits = {
        "budget": f["budget_ok"],
        "gpu": (needs["gpu"] <= machine.gpu) if on_gpu else None,
        "ram": (needs["ram"] <= machine.ram) if machine.ram is not None else None,
        "disk": None if fp is None else (f["refused"] is None and all(
            d["peak_bytes"] <= free for d, free in zip(disk, machine.disk_free))),
    }  # fmt: skip
    return Estimate(
        name=name, tiers=tiers, params=f["params"], units=f["units"], sub_groups=f["sub_groups"], state=state,
        host_budget=cfg.memory.host_budget, floor=f["floor"], floor_what=f["floor_what"],
        overlap_from=f["overlap_from"], overlap=bool(plan.overlap), shares=plan.shares(), disk=disk,
        disk_refused=f["refused"], step_floor=f["step"]["floor"], step_most=f["step"]["most"],
        step_expected=expected, fits=fits, needs=needs,
    )  # fmt: skip


@contextlib.contextmanager
def _scratch(paths: list[str]):
    """A directory of the estimate's own under each of ``paths``, removed after (the dry
    engine's swap space opens there and is discarded; nothing of the user's is touched)."""
    made = []
    try:
        for p in paths:
            made.append(tempfile.mkdtemp(prefix=".infinity-estimate-", dir=_existing(p)))
        yield made
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)  # our own directories only


def _existing(path: str) -> str:
    """``path``, or its nearest existing parent (a swap directory not made yet lies on its
    parent's filesystem)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path

"""Counters behind `Engine.stats()`: bytes and busy seconds per tier, stall, steps.

Owns: the counters of the step in progress and the cumulative ones, and the step count (the
one piece a checkpoint keeps: `state_dict`). Touches nothing: the stores, the scheduler and the
optimizer add to it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .config import TIERS


@dataclass(slots=True)
class _Busy:
    """Seconds during which at least one operation was in flight (a union of intervals)."""

    inflight: int = 0
    since: float = 0.0
    seconds: float = 0.0

    def begin(self) -> None:
        if self.inflight == 0:
            self.since = time.perf_counter()
        self.inflight += 1

    def end(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.seconds += time.perf_counter() - self.since


@dataclass(slots=True)
class TierCounters:
    read_bytes: int = 0
    write_bytes: int = 0
    read_busy: _Busy = field(default_factory=_Busy)
    write_busy: _Busy = field(default_factory=_Busy)
    # bytes read and written per kind of state (params, grads, master, exp_avg, ...): where a
    # step's traffic goes, against what exact training must move (docs/architecture.md)
    by_kind: dict[str, list[int]] = field(default_factory=dict)

    def count(self, kind: str | None, write: bool, nbytes: int) -> None:
        if write:
            self.write_bytes += nbytes
        else:
            self.read_bytes += nbytes
        if kind is not None:
            self.by_kind.setdefault(kind, [0, 0])[int(write)] += nbytes

    def as_dict(self) -> dict:
        r, w = self.read_busy.seconds, self.write_busy.seconds
        return {
            "read_bytes": self.read_bytes,
            "write_bytes": self.write_bytes,
            "read_seconds": r,
            "write_seconds": w,
            "read_gbps": self.read_bytes / r / 1e9 if r else 0.0,
            "write_gbps": self.write_bytes / w / 1e9 if w else 0.0,
            "by_kind": {k: {"read_bytes": rw[0], "write_bytes": rw[1]} for k, rw in self.by_kind.items()},
        }


@dataclass(slots=True)
class Counters:
    tiers: dict[str, TierCounters] = field(default_factory=lambda: {t: TierCounters() for t in TIERS})
    stall_seconds: float = 0.0  # compute waiting for a parameter fetch
    fetches: int = 0  # parameter units materialised
    prefetch_hits: int = 0  # ... whose read was already issued when they were needed
    on_demand: int = 0  # ... read only when needed (first use, or the order departed from the trace)
    kept_for_backward: int = 0  # units backward found still in memory from forward (not read again)
    param_cache_bytes: int = 0  # parameters lent from buffers kept in the pool, not read from nvme (memory.keep_params)
    skipped_steps: int = 0  # fp16 overflows
    h2d_bytes: int = 0  # parameters copied host -> GPU (side stream)
    h2d_seconds: float = 0.0  # ... the GPU time of those copies (CUDA events)
    d2h_bytes: int = 0  # gradients copied GPU -> host (side stream)
    d2h_seconds: float = 0.0  # ... the GPU time of those copies (CUDA events)
    activation_out_bytes: int = 0  # saved activations moved to the activation tier
    activation_in_bytes: int = 0  # ... and brought back for backward
    # The optimizer's own time: its kernels (the codec of compact states included; on the host,
    # the work itself; on a GPU, their launch), under backward too, and the update of the step
    # from its gradient check to its last new parameter (what the step waited for around the
    # kernels: reads, copies, parameter writes, is the difference).
    optimizer_seconds: float = 0.0
    update_seconds: float = 0.0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {
            **{t: c.as_dict() for t, c in self.tiers.items()},
            "stall_seconds": self.stall_seconds,
            "fetches": self.fetches,
            "prefetch_hits": self.prefetch_hits,
            "on_demand": self.on_demand,
            "kept_for_backward": self.kept_for_backward,
            "param_cache_bytes": self.param_cache_bytes,
            "skipped_steps": self.skipped_steps,
            "h2d_bytes": self.h2d_bytes,
            "h2d_seconds": self.h2d_seconds,
            "h2d_gbps": self.h2d_bytes / self.h2d_seconds / 1e9 if self.h2d_seconds else 0.0,
            "d2h_bytes": self.d2h_bytes,
            "d2h_seconds": self.d2h_seconds,
            "d2h_gbps": self.d2h_bytes / self.d2h_seconds / 1e9 if self.d2h_seconds else 0.0,
            "activation_out_bytes": self.activation_out_bytes,
            "activation_in_bytes": self.activation_in_bytes,
            "optimizer_seconds": self.optimizer_seconds,
            "update_seconds": self.update_seconds,
            "seconds": self.seconds,
        }


class Stats:
    """Cumulative counters and the counters of the step in progress."""

    def __init__(self):
        self.total = Counters()
        self.step = Counters()
        self.steps = 0
        self._step_start = time.perf_counter()
        self._lock = threading.Lock()  # `add` and `count` come from the optimizer's worker too

    def both(self):
        return (self.total, self.step)

    def io(self, tier: str, write: bool, nbytes: int, kind: str | None = None) -> "_IoSpan":
        """A read or write of ``nbytes`` of state ``kind`` in ``tier``, counted when done."""
        return _IoSpan(self, tier, write, nbytes, kind)

    def count(self, tier: str, kind: str, write: bool, nbytes: int) -> None:
        """``nbytes`` of state ``kind`` read or written in a resident ``tier`` (in place: no
        busy time of its own, the work that touched them has it)."""
        with self._lock:
            for c in self.both():
                c.tiers[tier].count(kind, write, nbytes)

    def add(self, name: str, value) -> None:
        """``value`` more of the counter ``name`` (``optimizer_seconds``, ``h2d_bytes``, ...)."""
        with self._lock:
            for c in self.both():
                setattr(c, name, getattr(c, name) + value)

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])

    def start_step(self) -> None:
        """The step in progress starts now, with nothing counted: what initialize, from_pretrained
        or load_checkpoint read and wrote counts in the totals, not in the first step after it."""
        self.step = Counters()
        self._step_start = time.perf_counter()

    def end_step(self) -> dict:
        now = time.perf_counter()
        self.step.seconds = now - self._step_start
        self.total.seconds += self.step.seconds
        self.steps += 1
        done = self.step.as_dict()
        self.step = Counters()
        self._step_start = now
        return done


def peak_rss_bytes() -> int | None:
    """The process's peak resident set in bytes: VmHWM of /proc/self/status (the kernel's
    high-water mark, which a write of "5" to /proc/self/clear_refs resets to the RSS now), or
    getrusage's ru_maxrss where there is no such file; None where neither exists. Beside the
    pool's peak it shows what the process holds outside ``memory.host_budget``."""
    from ._resources import proc_bytes

    peak = proc_bytes("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return None
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


class _IoSpan:
    """One read or write of ``nbytes`` in ``tier``: call ``done()`` once it completed."""

    __slots__ = ("_counters", "_write", "_nbytes", "_kind", "_open")

    def __init__(self, stats: Stats, tier: str, write: bool, nbytes: int, kind: str | None = None):
        self._counters = [c.tiers[tier] for c in stats.both()]
        self._write = write
        self._nbytes = nbytes
        self._kind = kind
        self._open = True
        for c in self._counters:
            (c.write_busy if write else c.read_busy).begin()

    def done(self) -> None:
        if not self._open:
            return
        self._open = False
        for c in self._counters:
            (c.write_busy if self._write else c.read_busy).end()
            c.count(self._kind, self._write, self._nbytes)

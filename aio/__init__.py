"""infinity.aio: asynchronous file I/O for the swap tiers.

Bytes, file descriptors and offsets only: no tensors' meaning, no names (those are
`infinity.swap`'s). Two backends share one interface:

- ``uring``: a C++ io_uring engine (``infinity.aio._uring``, built against liburing) with
  batched submission, registered buffers and files, and checked completions;
- ``threads``: os.preadv/os.pwritev on a thread pool, the fallback where io_uring cannot run.

    engine = infinity.aio.open_engine()                 # "auto": uring if it works here
    f = infinity.aio.open_file("/mnt/nvme0/x", "w+")    # O_DIRECT, buffered where refused
    buf = infinity.aio.empty_aligned(64 << 20)
    engine.pwrite(buf, f, 0).result()
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._files import ALIGNMENT, File, open_file

if TYPE_CHECKING:
    from ._engine import Engine

__all__ = [
    "ALIGNMENT",
    "BACKENDS",
    "BackendStatus",
    "BackendUnavailable",
    "Engine",
    "File",
    "Future",
    "empty_aligned",
    "open_engine",
    "open_file",
    "probe",
]

logger = logging.getLogger("infinity.aio")

# Loaded on first use (PEP 562): they need torch, and a config or a launcher that only asks for
# the constants above should not pay for it.
_LAZY = {"empty_aligned": "._buffers", "Engine": "._engine", "Future": "._engine", "ThreadEngine": "._threads"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

BACKENDS = ("uring", "threads")
ENV_BACKEND = "INFINITY_AIO_BACKEND"


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run on this machine; the message says why."""


@dataclass(frozen=True, slots=True)
class BackendStatus:
    """Whether a backend works here, and if not, why (e.g. "io_uring_setup: EPERM ...")."""

    available: bool
    reason: str = ""


def _uring_status() -> BackendStatus:
    try:
        from . import _uring
    except ImportError as e:
        return BackendStatus(
            False,
            f"the io_uring extension infinity.aio._uring is not built ({e}); it is built when "
            "pkg-config finds liburing (Debian: liburing-dev) at install time",
        )
    reason = _uring.probe()
    if reason:
        try:
            with open("/proc/sys/kernel/io_uring_disabled") as f:
                disabled = f.read().strip()
        except OSError:
            disabled = "0"
        if disabled not in ("", "0"):
            reason += f" (kernel.io_uring_disabled={disabled})"
    return BackendStatus(not reason, reason)


def probe() -> dict[str, BackendStatus]:
    """Which backends work on this machine, and for each one that does not, why."""
    return {"uring": _uring_status(), "threads": BackendStatus(True)}


_fallback_logged: set[str] = set()


def open_engine(backend: str = "auto", queue_depth: int = 32, block_size: int = 1 << 20) -> Engine:
    """Open an I/O engine.

    ``backend`` is "auto" (uring where it works, else threads, with one logged line saying
    why), "uring" (raises `BackendUnavailable` where it cannot run) or "threads". The
    environment variable INFINITY_AIO_BACKEND, when set, overrides the argument (logged).
    A request is cut into ``block_size`` chunks, at most ``queue_depth`` of them in flight.
    """
    forced = os.environ.get(ENV_BACKEND, "").strip()
    if forced:
        if forced not in ("auto", *BACKENDS):
            raise ValueError(f"{ENV_BACKEND}={forced!r} is not one of auto, {', '.join(BACKENDS)}")
        if forced != backend:
            # A forced backend is for trying the fallback without code changes (as KvikIO's
            # compat-mode variable); overriding an explicit choice is worth a warning.
            log = logger.info if backend == "auto" else logger.warning
            log("%s=%s overrides backend=%r", ENV_BACKEND, forced, backend)
        backend = forced
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"{backend=} is not one of auto, {', '.join(BACKENDS)}")
    from ._threads import ThreadEngine

    if backend == "threads":
        return ThreadEngine(queue_depth, block_size)

    status = _uring_status()
    if status.available:
        from ._uring_engine import UringEngine

        try:
            return UringEngine(queue_depth, block_size)
        except OSError as e:
            status = BackendStatus(False, str(e))
    if backend == "uring":
        raise BackendUnavailable(f"the uring aio backend cannot run here: {status.reason}")
    if status.reason not in _fallback_logged:
        _fallback_logged.add(status.reason)
        logger.warning("io_uring unavailable (%s); using the threads aio backend", status.reason)
    return ThreadEngine(queue_depth, block_size)

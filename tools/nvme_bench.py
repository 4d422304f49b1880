"""nvme-bench: read and write throughput of the aio backends on one drive, and the best setting.

This is the repository's one I/O harness: `benchmarks/aio_vs_fio.py` imports `open_runner`,
`run_fio` and the test-file helpers instead of keeping a copy that drifts.

One pass moves ``size`` bytes of a test file through one engine (O_DIRECT, one registered
buffer, the registered file): requests of ``span`` bytes, two outstanding, which the engine
cuts into ``block_size`` chunks with up to ``queue_depth`` in flight, the shape of a swap-in of
large tensors. ``aiofiles`` is measured as the asyncio baseline, never as a candidate setting.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import errno
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from infinity import aio
from infinity.config import format_size, parse_size  # one grammar for sizes, here and in configs
from infinity.swap import human_size
from infinity.tools._cli import BadInput, Progress

ENGINE_BACKENDS = aio.BACKENDS  # the candidates for the [aio] snippet
ALL_BACKENDS = (*ENGINE_BACKENDS, "aiofiles")
OPS = ("read", "write")
MIN_SPAN = 64 << 20


class FioError(RuntimeError):
    """fio failed, or printed something that is not its JSON report."""


# -- backends and the test file ---------------------------------------------------------------
def probe_backends() -> dict[str, aio.BackendStatus]:
    """`infinity.aio.probe()` plus the aiofiles baseline."""
    try:
        import aiofiles  # noqa: F401
    except ImportError as e:
        return {**aio.probe(), "aiofiles": aio.BackendStatus(False, f"aiofiles is not installed ({e})")}
    return {**aio.probe(), "aiofiles": aio.BackendStatus(True)}


def check_directory(directory: str, size: int) -> None:
    """Raise BadInput unless ``directory`` can take a test file of ``size`` bytes."""
    if not os.path.exists(directory):
        raise BadInput(f"PATH {directory!r} does not exist")
    if not os.path.isdir(directory):
        raise BadInput(f"PATH {directory!r} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise BadInput(f"PATH {directory!r} is not writable")
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize  # what a non-root writer may use: the cautious figure
    if size > free:
        raise BadInput(f"--size={format_size(size)} does not fit in {directory!r}: {human_size(free)} free")


def create_test_file(directory: str) -> str:
    """Create a new, empty test file (never one that exists) and return its path."""
    path = os.path.join(directory, f"nvme-bench-{os.getpid()}.dat")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    except OSError as e:  # root passes os.access almost everywhere; creating is the real test
        raise BadInput(f"PATH {directory!r} is not writable: cannot create {path}: {e.strerror}") from None
    return path


def _random_buffer(nbytes: int, huge: bool | None = None) -> torch.Tensor:
    """An aligned buffer of incompressible bytes, every page touched before any clock starts.

    Random, not zeros, because some drives compress or deduplicate (fio writes random data
    too); one random MiB repeated keeps this quick for 512 MiB buffers. Filled by numpy on one
    thread, front to back, as fio fills its buffers: with ``huge=False`` the 4 KiB pages are
    then faulted in order, the way fio's are (see [Note: huge pages for I/O buffers]).
    """
    buffer = aio.empty_aligned(nbytes, huge=huge)
    view = buffer.numpy()
    pattern = np.random.default_rng().integers(0, 256, min(nbytes, 1 << 20), dtype=np.uint8)
    for offset in range(0, nbytes, len(pattern)):
        n = min(len(pattern), nbytes - offset)
        view[offset : offset + n] = pattern[:n]
    return buffer


def fill_test_file(path: str, size: int) -> bool:
    """Write ``size`` bytes to ``path`` and fsync; return whether O_DIRECT is in effect.

    Reads must find real data, and writes then overwrite allocated blocks as they do in a
    swap arena (first writes into a sparse file would also time the filesystem's allocator).
    """
    buffer = _random_buffer(min(size, MIN_SPAN))
    with aio.open_file(path, "r+") as file, aio.open_engine("threads", 8, 4 << 20) as engine:
        span = len(buffer)
        futures = [engine.pwrite(buffer[: min(span, size - off)], file, off) for off in range(0, size, span)]
        for fut in futures:
            fut.result()
        os.fsync(file.fileno())
        return file.direct


# -- one pass ---------------------------------------------------------------------------------
def _engine_pass(engine: aio.Engine, file: aio.File, buffer: torch.Tensor, op: str, size: int) -> float:
    submit, span = (engine.pread if op == "read" else engine.pwrite), len(buffer)
    # Two requests outstanding, so the engine has the next one queued when one drains. Both use
    # the same buffer: its contents are never looked at.
    pending: collections.deque[aio.Future] = collections.deque()
    moved = 0
    start = time.perf_counter()
    for offset in range(0, size, span):
        if len(pending) == 2:
            moved += pending.popleft().result()
        pending.append(submit(buffer[: min(span, size - offset)], file, offset))
    while pending:
        moved += pending.popleft().result()
    elapsed = time.perf_counter() - start
    if moved != size:
        raise OSError(errno.EIO, f"{op} moved {moved} of {size} bytes", file.path)
    return size / elapsed / 1e9


async def _aiofiles_pass(path: str, op: str, size: int, bs: int, qd: int, buffer, direct: bool) -> float:
    import aiofiles

    # The executor is the real concurrency: asyncio's default pool (min(32, cpus + 4) threads)
    # would measure that number instead of ``qd``.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=qd))
    view = memoryview(buffer.numpy())
    blocks = iter(range(0, size, bs))  # shared by the tasks; one event-loop thread, so no lock

    async def task(i: int, f) -> None:
        chunk = view[(i * bs) % len(view) :][:bs]
        for offset in blocks:
            await f.seek(offset)
            n = await (f.readinto(chunk) if op == "read" else f.write(chunk))
            if n != bs:
                raise OSError(errno.EIO, f"aiofiles {op} of {bs} bytes at {offset} moved {n}", path)

    def opener(name: str, flags: int) -> int:
        return os.open(name, flags | (os.O_DIRECT if direct else 0))

    handles = []
    try:
        for _ in range(qd):  # opened before the clock starts, as the engine's file is
            handles.append(await aiofiles.open(path, "r+b", buffering=0, opener=opener))
        start = time.perf_counter()
        await asyncio.gather(*(task(i, f) for i, f in enumerate(handles)))
        return size / (time.perf_counter() - start) / 1e9
    finally:
        for f in handles:
            await f.close()


@contextlib.contextmanager
def open_runner(backend: str, path: str, size: int, block_size: int, queue_depth: int, huge: bool | None = None):
    """Yield ``run(op) -> GB/s``, one pass of ``size`` bytes over ``path`` ("read" or "write").

    uring and threads: one engine, one registered buffer and the registered file serve every
    pass. aiofiles: each pass is a fresh asyncio run over ``queue_depth`` handles.
    """
    # At least 64 MiB per request keeps per-request overhead out of the figure, qd * bs keeps
    # every slot of the queue busy, and whole blocks keep every chunk full-sized.
    span = min(size, max(MIN_SPAN, queue_depth * block_size)) // block_size * block_size
    buffer = _random_buffer(span, huge)
    if backend == "aiofiles":
        with aio.open_file(path, "r") as f:
            direct = f.direct
        yield lambda op: asyncio.run(_aiofiles_pass(path, op, size, block_size, queue_depth, buffer, direct))
        return
    # with-statements unwind in reverse: the engine closes (and drains) before the file does.
    with aio.open_file(path, "r+") as file, aio.open_engine(backend, queue_depth, block_size) as engine:
        if engine.backend != backend:
            raise aio.BackendUnavailable(f"asked for the {backend} engine, got {engine.backend}")
        engine.register_buffer(buffer)
        engine.register_file(file)
        yield lambda op: _engine_pass(engine, file, buffer, op, size)


def measure(backend: str, op: str, path: str, size: int, block_size: int, queue_depth: int) -> float:
    """GB/s of one pass; `open_runner` keeps the engine and buffer across passes."""
    with open_runner(backend, path, size, block_size, queue_depth) as run:
        return run(op)


def run_fio(fio: str, path: str, op: str, size: int, bs: int, qd: int, direct: bool = True) -> float:
    """GB/s that fio (io_uring, registered buffers and file) reaches with the same setting.

    fio times a job in whole milliseconds: below a few hundred MiB its figure is coarse.
    """
    cmd = [fio, "--name=nvme-bench", f"--filename={path}", f"--rw={op}", f"--bs={bs}", f"--iodepth={qd}",
           "--ioengine=io_uring", f"--direct={int(direct)}", f"--size={size}", "--fixedbufs",
           "--registerfiles", "--output-format=json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        last = ((proc.stderr or proc.stdout).strip().splitlines() or ["no output"])[-1]
        raise FioError(f"fio exited with status {proc.returncode}: {last} (command: {' '.join(cmd)})")
    try:  # fio may print notes before its JSON
        job = json.loads(proc.stdout[proc.stdout.index("{") :])["jobs"][0]
        bw = job[op]["bw_bytes"]
    except (ValueError, KeyError, IndexError) as e:
        raise FioError(f"cannot read fio's JSON report ({e!r}): {proc.stdout[:200]!r}") from None
    if job.get("error"):
        raise FioError(f"fio reported errno {job['error']} ({os.strerror(job['error'])})")
    return bw / 1e9


# -- the sweep --------------------------------------------------------------------------------
@dataclass(slots=True)
class Result:
    """The passes of one (backend, op, block size, queue depth), ours and fio's, in GB/s."""

    backend: str
    op: str
    block_size: int
    queue_depth: int
    gbps: list[float] = field(default_factory=list)
    fio_gbps: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.gbps)

    def to_json(self) -> dict:
        runs = [_figure(g) for g in self.gbps]
        out = dict(type="measurement", backend=self.backend, op=self.op, block_size=self.block_size,
                   queue_depth=self.queue_depth, gbps_median=_figure(self.median), gbps_min=min(runs),
                   gbps_max=max(runs), repeats=runs)  # fmt: skip
        if self.fio_gbps:
            fio = statistics.median(self.fio_gbps)
            out.update(fio_gbps=_figure(fio), fio_repeats=[_figure(g) for g in self.fio_gbps])
            out.update(ratio=_figure(self.median / fio))
        return out

    def row(self) -> str:
        text = (f"{self.backend:<9} {self.op:<6} {format_size(self.block_size):>7} {self.queue_depth:>5} "
                f"{self.median:>7.2f} {min(self.gbps):>6.2f} {max(self.gbps):>6.2f}")  # fmt: skip
        if self.fio_gbps:
            fio = statistics.median(self.fio_gbps)
            text += f" {fio:>7.2f} {self.median / fio:>8.2f}"
        return text


def _figure(x: float) -> float:
    """x to 5 significant digits: fixed decimals lost the precision of slow runs (a ratio of
    0.0112 printed for 0.01123), so figures derived from the printed ones drifted."""
    return float(f"{x:.5g}")


def choose(results: list[Result], ops: tuple[str, ...]) -> tuple[dict[str, Result], tuple | None, str]:
    """The best uring/threads result per op; the (backend, block_size, queue_depth) to
    recommend, or None; and why, in words.

    The pick has the highest geometric mean of its op medians among settings measured for
    every op: unlike a sum, a fast read cannot buy back a slow write.
    """
    engines = [r for r in results if r.backend in ENGINE_BACKENDS]
    best = {op: max((r for r in engines if r.op == op), key=lambda r: r.median, default=None) for op in ops}
    medians: dict[tuple, dict[str, float]] = collections.defaultdict(dict)
    for r in engines:
        medians[(r.backend, r.block_size, r.queue_depth)][r.op] = r.median
    scores = {k: math.prod(v.values()) ** (1 / len(v)) for k, v in medians.items() if len(v) == len(ops)}
    if not scores:
        return {op: r for op, r in best.items() if r}, None, ""
    pick = max(scores, key=scores.get)
    figures = ", ".join(f"{op} {medians[pick][op]:.2f}" for op in ops)
    what = f"geometric mean of the {' and '.join(ops)} medians" if len(ops) > 1 else f"{ops[0]} median"
    return best, pick, f"the highest {what} of the uring/threads settings ({figures} GB/s)"


def toml_snippet(pick: tuple, basis: str) -> str:
    backend, block_size, queue_depth = pick
    return (f"# nvme-bench: {basis}\n[aio]\nbackend = \"{backend}\"\n"
            f"block_size = \"{format_size(block_size)}\"\nqueue_depth = {queue_depth}\n")  # fmt: skip


def run_sweep(cfg: Settings, backends: list[str], report: Report) -> list[Result]:
    """Measure every setting with each backend; the test file is removed whatever happens."""
    with_fio = {b: cfg.fio is not None and b in ENGINE_BACKENDS for b in backends}
    passes = sum(1 + with_fio[b] for b in backends) * len(cfg.block_sizes) * len(cfg.queue_depths)
    progress = Progress(passes * len(cfg.ops) * cfg.repeat, live=sys.stderr.isatty() and not cfg.json)
    results = []
    path = create_test_file(cfg.directory)
    try:
        progress.show(f"filling the {format_size(cfg.size)} test file")
        report.direct = direct = fill_test_file(path, cfg.size)
        progress.clear()
        if not direct:
            report.note(f"O_DIRECT was refused by the filesystem of {cfg.directory}: these figures "
                        "are buffered I/O through the page cache, not the drive's")  # fmt: skip
        for backend in backends:
            for bs in cfg.block_sizes:
                for qd in cfg.queue_depths:
                    with open_runner(backend, path, cfg.size, bs, qd) as run:
                        for op in cfg.ops:
                            r = Result(backend, op, bs, qd)
                            for _ in range(cfg.repeat):  # ours then fio in each repeat: drift cancels
                                progress.show(f"{backend} {op} {format_size(bs)} qd {qd}")
                                r.gbps.append(run(op))
                                progress.done += 1
                                if with_fio[backend]:
                                    progress.show(f"fio {op} {format_size(bs)} qd {qd}")
                                    r.fio_gbps.append(run_fio(cfg.fio, path, op, cfg.size, bs, qd, direct))
                                    progress.done += 1
                            progress.clear()
                            report.emit(r)
                            results.append(r)
    finally:
        progress.clear()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return results


# -- command line -----------------------------------------------------------------------------
SYNOPSIS = """nvme-bench PATH [--size 1GiB] [--block-sizes 128K,1M,4M] [--queue-depths 8,32,128]
                  [--backends uring,threads,aiofiles] [--ops read,write] [--repeat 3]
                  [--quick] [--json] [--fio]"""

DESCRIPTION = """\
description:
  Measures read and write throughput of infinity's aio backends on the drive holding the
  directory PATH, for every block size and queue depth, and recommends the [aio] section of
  a tier config. A test file of --size bytes is created in PATH, filled once, used with
  O_DIRECT (reads come from the drive, not the page cache) and removed at the end, also on
  error or Ctrl-C. Where the filesystem refuses O_DIRECT (tmpfs) the output says so.

  A pass moves --size bytes through one engine: one registered aligned buffer of
  min(size, max(64MiB, qd*bs)) bytes, two requests outstanding, cut by the engine into
  block-size chunks with up to queue-depth of them in flight; writes are not fsynced (nor
  are fio's). aiofiles (qd asyncio tasks, each with its own O_DIRECT handle) is a
  baseline, never recommended. Backends that cannot run here are skipped with one line
  saying why.
"""

EPILOG = """\
output:
  A table: backend, op, block size, queue depth, GB/s (1e9 bytes/s) as the median of the
  --repeat passes, min and max; with --fio also fio's GB/s for the same setting (io_uring,
  O_DIRECT, fixed buffers and files, passes interleaved with ours) and the ratio ours/fio.
  Then the best uring/threads setting per op and a ready [aio] snippet: the setting with
  the highest geometric mean of its read and write medians. A progress bar goes to stderr
  when it is a terminal.
  --json: one object per line per measurement (type "measurement", backend, op,
  block_size in bytes, queue_depth, gbps_median, gbps_min, gbps_max, repeats; with --fio
  fio_gbps, fio_repeats, ratio), then one object of type "summary" (best per op, "aio":
  the snippet's values, "toml": the snippet, "skipped", "direct"). Nothing else on stdout.

sizes:
  1GiB, 64MiB, 128K, 4M, 4096: binary units (K = KB = KiB = 1024 bytes, as in fio).

exit status:
  0 measured; 1 an I/O error, fio failed, or no requested backend can run here;
  2 bad input: PATH missing, not a directory or not writable, --size larger than the free
  space or not a multiple of every block size, an unknown backend or op, a value that is
  not positive, --fio without fio installed; 130 interrupted.
"""

QUICK = dict(size="64MiB", block_sizes="1M", queue_depths="32", repeat="2")
DEFAULTS = dict(size="1GiB", block_sizes="128K,1M,4M", queue_depths="8,32,128", repeat="3")


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """The validated command line."""

    directory: str
    size: int
    block_sizes: tuple[int, ...]
    queue_depths: tuple[int, ...]
    backends: tuple[str, ...]
    ops: tuple[str, ...]
    repeat: int
    json: bool
    fio: str | None  # the fio binary, with --fio


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nvme-bench", usage=SYNOPSIS, description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("path", metavar="PATH", help="a directory on the drive to measure")
    p.add_argument("--size", help="bytes per pass, the test file's size (default 1GiB)")
    p.add_argument("--block-sizes", help="comma-separated chunk sizes (default 128K,1M,4M)")
    p.add_argument("--queue-depths", help="comma-separated chunks in flight (default 8,32,128)")
    p.add_argument("--backends", help=f"comma-separated, of {','.join(ALL_BACKENDS)} (default all)")
    p.add_argument("--ops", default="read,write", help="read, write or both (default read,write)")
    p.add_argument("--repeat", help="passes per setting (default 3)")
    p.add_argument("--quick", action="store_true", help="64MiB, 1M blocks, qd 32, 2 passes (explicit options win)")
    p.add_argument("--json", action="store_true", help="JSON lines on stdout, no table or progress")
    p.add_argument("--fio", action="store_true", help="also run fio with each uring/threads setting")
    return p


def _number(option: str, text: str, parse) -> int:
    try:
        value = parse(text.strip())
    except ValueError:
        kind = "size" if parse is parse_size else "whole number"
        raise BadInput(f"{option}: {text!r} is not a {kind}") from None
    if value <= 0:
        raise BadInput(f"{option}: {text!r} is not positive")
    return value


def _names(option: str, text: str, known: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(t.strip().lower() for t in text.split(",")))
    for name in names:
        if name not in known:
            raise BadInput(f"{option}: unknown {name!r} (known: {', '.join(known)})")
    return names


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Check every value (BadInput names the bad one) before anything is written."""
    raw = QUICK if args.quick else DEFAULTS
    raw = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in raw.items()}
    size = _number("--size", raw["size"], parse_size)
    bss = tuple(dict.fromkeys(_number("--block-sizes", t, parse_size) for t in raw["block_sizes"].split(",")))
    qds = tuple(dict.fromkeys(_number("--queue-depths", t, int) for t in raw["queue_depths"].split(",")))
    repeat = _number("--repeat", raw["repeat"], int)
    for bs in bss:  # the engines' own limits (infinity.aio.Engine), said before any I/O
        if bs % 4096 or bs > 1 << 30:
            raise BadInput(f"--block-sizes: {format_size(bs)} is not a multiple of 4096 up to 1GiB")
        if size % bs:
            raise BadInput(f"--size={format_size(size)} is not a multiple of block size {format_size(bs)}")
    if max(qds) > 4096:
        raise BadInput(f"--queue-depths: {max(qds)} is over the engines' limit of 4096")
    backends = ALL_BACKENDS if args.backends is None else _names("--backends", args.backends, ALL_BACKENDS)
    ops = _names("--ops", args.ops, OPS)
    check_directory(args.path, size)
    fio = shutil.which("fio") if args.fio else None
    if args.fio and fio is None:
        raise BadInput("--fio needs the fio program, which is not installed (not on PATH)")
    return Settings(directory=args.path, size=size, block_sizes=bss, queue_depths=qds, backends=backends,
                    ops=ops, repeat=repeat, json=args.json, fio=fio)  # fmt: skip


class Report:
    """Prints the table (or JSON lines) as results arrive, then the summary and snippet."""

    def __init__(self, cfg: Settings):
        self.cfg = cfg
        self.skipped: dict[str, str] = {}
        self.notes: list[str] = []
        self.direct: bool | None = None
        self._header = False

    def note(self, text: str) -> None:
        self.notes.append(text)  # stdout is JSON only with --json
        print(f"nvme-bench: {text}", file=sys.stderr if self.cfg.json else sys.stdout, flush=True)

    def skip(self, backend: str, reason: str) -> None:
        self.skipped[backend] = reason
        self.note(f"{backend}: skipped: {reason}")

    def emit(self, r: Result) -> None:
        if self.cfg.json:
            print(json.dumps(r.to_json()), flush=True)
            return
        if not self._header:
            self._header = True
            io = "O_DIRECT" if self.direct else "buffered"
            cfg = self.cfg
            passes = f"{cfg.repeat} pass{'es' if cfg.repeat > 1 else ''}"
            print(f"{cfg.directory}: {format_size(cfg.size)} per pass, {io}, {passes} per setting")
            head = f"{'backend':<9} {'op':<6} {'block':>7} {'qd':>5} {'GB/s':>7} {'min':>6} {'max':>6}"
            print(head + (f" {'fio':>7} {'ours/fio':>8}" if self.cfg.fio else ""))
        print(r.row(), flush=True)

    def finish(self, results: list[Result]) -> None:
        best, pick, basis = choose(results, self.cfg.ops)
        snippet = toml_snippet(pick, basis) if pick else None
        if self.cfg.json:
            summary = dict(type="summary", path=self.cfg.directory, size=self.cfg.size, direct=self.direct,
                           skipped=self.skipped, notes=self.notes,
                           best={op: r.to_json() for op, r in best.items()},
                           aio=dict(zip(("backend", "block_size", "queue_depth"), pick)) if pick else None,
                           basis=basis, toml=snippet)  # fmt: skip
            print(json.dumps(summary), flush=True)
            return
        print()
        for op, r in best.items():
            print(f"best {op + ':':<6} {r.backend}, {format_size(r.block_size)} blocks, "
                  f"queue depth {r.queue_depth}: {r.median:.2f} GB/s")  # fmt: skip
        if snippet:
            print("\n" + snippet, end="")
        else:
            print("no uring/threads setting was measured for every op: no [aio] snippet")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = settings_from_args(args)
    except BadInput as e:
        print(f"nvme-bench: error: {e}", file=sys.stderr)
        return 2
    report = Report(cfg)
    status = probe_backends()
    for backend in cfg.backends:
        if not status[backend].available:
            report.skip(backend, status[backend].reason)
    backends = [b for b in cfg.backends if status[b].available]
    # `timeout` or kill must not leave the test file behind; the override of the backend would
    # silently swap the engine measured. Both are put back for callers of main() in-process.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    forced = os.environ.pop(aio.ENV_BACKEND, None)
    if forced:
        report.note(f"ignoring {aio.ENV_BACKEND}={forced}: --backends chooses what is measured")
    try:
        if not backends:
            raise aio.BackendUnavailable(f"none of the backends {', '.join(cfg.backends)} can run here")
        report.finish(run_sweep(cfg, backends, report))
    except BadInput as e:
        print(f"nvme-bench: error: {e}", file=sys.stderr)
        return 2
    except (OSError, FioError, aio.BackendUnavailable) as e:
        print(f"nvme-bench: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nnvme-bench: interrupted; the test file was removed", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if forced is not None:
            os.environ[aio.ENV_BACKEND] = forced
    return 0


if __name__ == "__main__":
    sys.exit(main())

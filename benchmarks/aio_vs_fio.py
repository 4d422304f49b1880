"""Our aio engines against fio: same file, 1 MiB blocks, queue depth 32, O_DIRECT, read and write.

Not run by CI. For each backend (uring, threads) and op, runs interleaved pairs, ours then fio,
so that drift in the drive (thermal state, background GC, neighbours on a shared disk) lands on
both sides of each pair alike; reports every pair and the medians of ours, of fio and of the
per-pair ratios ours/fio. The harness is nvme-bench's (infinity.tools.nvme_bench), not a copy.

    python benchmarks/aio_vs_fio.py [--dir bench-data/] [--size 1GiB] [--pairs 7]
                                    [--backends uring,threads] [--small-pages] [--json]

Memory matters as much as the engine: our buffers are on huge pages (see [Note: huge pages for
I/O buffers] in aio/_buffers.py), fio's are malloc'd 4 KiB pages unless transparent huge pages
are "always", and a 1 MiB transfer into scattered 4 KiB pages is split by the device (fio's own
figure then flips between ~1.2 and ~3 GB/s from run to run as its fresh buffers land). So:
- default: ours as the engine runs it against fio as users run it;
- engine against engine: with THP set to "always" (as root: echo always >
  /sys/kernel/mm/transparent_hugepage/enabled; put back "madvise" after), both sides get huge
  pages and fio's figure is steady;
- --small-pages: our buffer on 4 KiB pages too (a lottery of page placement on both sides).

Exit status: 0 measured, 1 an I/O error or fio failed, 2 bad input or fio not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import sys
from pathlib import Path

from infinity.tools.nvme_bench import (
    ENGINE_BACKENDS,
    BadInput,
    FioError,
    check_directory,
    create_test_file,
    fill_test_file,
    format_size,
    open_runner,
    parse_size,
    probe_backends,
    run_fio,
)

BLOCK_SIZE = 1 << 20
QUEUE_DEPTH = 32
OPS = ("read", "write")
BENCH_DATA = Path(__file__).resolve().parent.parent / "bench-data"  # gitignored


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=str(BENCH_DATA), help="test file directory (default: repo bench-data/)")
    p.add_argument("--size", default="1GiB", help="bytes per run and the test file's size (default 1GiB)")
    p.add_argument("--pairs", type=int, default=7, help="pairs per backend and op (default 7; 5+ to quote)")
    p.add_argument("--backends", default=",".join(ENGINE_BACKENDS), help="comma-separated (default all)")
    p.add_argument("--json", action="store_true", help="JSON lines: the command, every pair, every summary")
    p.add_argument("--small-pages", action="store_true",
                   help="our buffer in 4 KiB pages like fio's, not huge pages: engine against engine")  # fmt: skip
    return p.parse_args(argv)


def _check(args: argparse.Namespace) -> tuple[int, list[str], str]:
    """(size, backends, fio) or BadInput naming the bad value."""
    try:
        size = parse_size(args.size)
    except ValueError as e:
        raise BadInput(f"--size: {e}") from None
    if size <= 0 or size % BLOCK_SIZE:
        raise BadInput(f"--size={args.size!r} is not a positive multiple of {format_size(BLOCK_SIZE)}")
    if args.pairs <= 0:
        raise BadInput(f"--pairs={args.pairs} is not positive")
    backends = [b.strip() for b in args.backends.split(",")]
    for b in backends:
        if b not in ENGINE_BACKENDS:
            raise BadInput(f"--backends: unknown {b!r} (known: {', '.join(ENGINE_BACKENDS)})")
    fio = shutil.which("fio")
    if fio is None:
        raise BadInput("fio is not installed (not on PATH); this benchmark compares against it")
    return size, backends, fio


def _run(args, size: int, backends: list[str], fio: str, out) -> None:
    status = probe_backends()
    for b in backends:
        if not status[b].available:
            out(dict(type="skipped", backend=b, reason=status[b].reason), f"{b}: skipped: {status[b].reason}")
    backends = [b for b in backends if status[b].available]
    if not backends:
        raise OSError(f"none of the backends {args.backends} can run here")
    path = create_test_file(args.dir)
    try:
        direct = fill_test_file(path, size)
        if not direct:
            out(dict(type="note", direct=False), f"O_DIRECT refused in {args.dir}: buffered on both sides")
        summaries = []
        for backend in backends:
            huge = False if args.small_pages else None
            with open_runner(backend, path, size, BLOCK_SIZE, QUEUE_DEPTH, huge) as run:
                for op in OPS:
                    pairs = []
                    for i in range(args.pairs):
                        ours = run(op)
                        theirs = run_fio(fio, path, op, size, BLOCK_SIZE, QUEUE_DEPTH, direct)
                        pairs.append((ours, theirs))
                        out(dict(type="pair", backend=backend, op=op, pair=i + 1, ours_gbps=round(ours, 4),
                                 fio_gbps=round(theirs, 4), ratio=round(ours / theirs, 4)),  # fmt: skip
                            f"{backend} {op:<5} pair {i + 1}/{args.pairs}: ours {ours:.2f} GB/s, "
                            f"fio {theirs:.2f} GB/s, ratio {ours / theirs:.2f}")  # fmt: skip
                    ours_m = statistics.median(o for o, _ in pairs)
                    fio_m = statistics.median(f for _, f in pairs)
                    ratio_m = statistics.median(o / f for o, f in pairs)
                    summaries.append((dict(type="summary", backend=backend, op=op, pairs=len(pairs),
                                           ours_gbps=round(ours_m, 4), fio_gbps=round(fio_m, 4),
                                           ratio=round(ratio_m, 4)),  # fmt: skip
                                      f"{backend} {op}: ours {ours_m:.2f} GB/s, fio {fio_m:.2f} GB/s, "
                                      f"ratio {ratio_m:.2f} (median of {len(pairs)} pairs)"))  # fmt: skip
        if not args.json and summaries:
            print()
        for obj, text in summaries:
            out(obj, text)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)

    def out(obj: dict, text: str) -> None:
        print(json.dumps(obj) if args.json else text, flush=True)

    command = shlex.join(sys.orig_argv if argv is None else [sys.argv[0], *argv])
    out(dict(type="command", command=command), f"$ {command}")
    created = not os.path.exists(args.dir) and args.dir == str(BENCH_DATA)
    try:
        size, backends, fio = _check(args)
        if created:
            os.makedirs(args.dir)
        check_directory(args.dir, size)
        out(dict(type="setting", dir=args.dir, size=size, block_size=BLOCK_SIZE, queue_depth=QUEUE_DEPTH),
            f"{args.dir}: {format_size(size)} per run, 1MiB blocks, queue depth {QUEUE_DEPTH}, "
            f"our buffer in {'4 KiB' if args.small_pages else 'huge'} pages")
        _run(args, size, backends, fio, out)
    except BadInput as e:
        print(f"aio_vs_fio: error: {e}", file=sys.stderr)
        return 2
    except (OSError, FioError) as e:
        print(f"aio_vs_fio: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\naio_vs_fio: interrupted; the test file was removed", file=sys.stderr)
        return 130
    finally:
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(args.dir)  # only if we made it and it is empty
    return 0


if __name__ == "__main__":
    sys.exit(main())

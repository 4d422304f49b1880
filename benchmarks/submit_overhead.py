"""What owning every request costs: per-request submit+wait time and per-release pool time.

Not run by CI. The aio engine owns each request before its backend has it (so that a Ctrl-C
between the two cannot leave a request running on a buffer given back), and
the host buffer pool ask the engine, on every release, whether a request still runs on the
buffer. This measures both paths where they cost most, requests too small for the disk to
hide anything:

- ``submit``: microseconds per 4 KiB ``pread(...)`` + ``result()`` from a cached file, 32
  submitted before the first is waited for;
- ``release``: microseconds per ``pool.acquire(64 KiB)`` + ``release()`` while ``--inflight``
  reads (uring: on pipes, never ending during the run) sit in the engine.

With ``--other DIR`` (a directory whose ``infinity`` package is another checkout, e.g. one of
the commit before, its aio extension built) each figure is measured alternately under this
checkout and that one, in interleaved pairs (a b, b a, ...) in fresh processes, and the
medians of both and of their ratio are printed.

    python benchmarks/submit_overhead.py [--backend uring] [--pairs 7] [--other DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def measure(backend: str, requests: int, inflight: int) -> dict[str, float]:
    from infinity import aio
    from infinity.swap import HostBufferPool

    engine = aio.open_engine(backend)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "data")
        with open(path, "wb") as fh:
            fh.write(os.urandom(1 << 20))
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        bufs = [aio.empty_aligned(4096) for _ in range(32)]
        for _ in range(2):  # the second round is the one kept: warm caches and threads
            start = time.perf_counter()
            for _ in range(requests // 32):
                futs = [engine.pread(b, fd, 4096 * i) for i, b in enumerate(bufs)]
                for f in futs:
                    f.result()
            out["submit_us"] = (time.perf_counter() - start) / requests * 1e6
        os.close(fd)

        # Made before the reads are held: registering its slab may wait for the ring to go idle.
        pool = HostBufferPool(16 << 20, engine=engine, slab_size=16 << 20)
        pool.acquire(64 << 10).release()
        pipes, held = [], []
        if backend == "uring":  # reads on a pipe wait for data: requests in flight all along
            for _ in range(inflight):
                r, w = os.pipe()
                pipes.append((r, w))
                buf = aio.empty_aligned(4096)
                held.append((engine.pread(buf, r, 0), buf))
        for _ in range(2):
            start = time.perf_counter()
            for _ in range(requests):
                pool.acquire(64 << 10).release()
            out["release_us"] = (time.perf_counter() - start) / requests * 1e6
        for r, w in pipes:
            os.close(w)  # EOF ends the held reads
        for fut, _ in held:
            fut.wait()
        pool.close()  # after: unregistering its slab waits for the ring's requests to end
        engine.close()
        for r, _ in pipes:
            os.close(r)
    return out


def run_in(root: str | None, args) -> dict[str, float]:
    """One measurement in a fresh process, importing infinity from ``root`` (None: this one)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--backend", args.backend,
           "--requests", str(args.requests), "--inflight", str(args.inflight)]  # fmt: skip
    env = dict(os.environ)
    if root is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="uring", choices=["uring", "threads"])
    p.add_argument("--requests", type=int, default=32 * 1000)
    p.add_argument("--inflight", type=int, default=64, help="reads held in the engine during 'release'")
    p.add_argument("--pairs", type=int, default=7)
    p.add_argument("--other", help="directory whose infinity package is the checkout to compare with")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.backend, args.requests, args.inflight)))
        return 0
    if args.other is None:
        runs = {"this": [run_in(None, args) for _ in range(args.pairs)]}
    else:
        runs = {"this": [], "other": []}
        for i in range(args.pairs):
            order = ["this", "other"] if i % 2 == 0 else ["other", "this"]
            for side in order:
                runs[side].append(run_in(None if side == "this" else args.other, args))
    report = {}
    for key in ("submit_us", "release_us"):
        report[key] = {side: statistics.median(r[key] for r in rs) for side, rs in runs.items()}
        if args.other is not None:
            report[key]["this/other"] = statistics.median(
                a[key] / b[key] for a, b in zip(runs["this"], runs["other"])
            )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, figures in report.items():
            print(f"{key:11s} " + "  ".join(f"{side}={value:.3f}" for side, value in figures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The drive's throughput while the CPU works beside it, against the same drive idle. Not run by
CI (a 1 GiB test file, about a minute).

The optimizer step streams its sub-groups while it computes on them: the fused AdamW kernel,
the xxh3 checksum of every write, and the copy (or cast) of each unit's new parameters into
a pool buffer (no longer made for fp32 parameters, which are written from the master weights). nvme-bench measures the drive with the CPU idle, and the step's
floor in benchmarks/scale_step.py divides its bytes by that figure. This measures how much of
it is left when one thread runs each of those loads at the same time, so a gap between the
optimizer phase and its floor can be told apart from what the CPU's work costs the drive.

For each load, pairs (the drive idle, then the same pass with the load running), reads and
writes, as nvme-bench measures them (the engine's uring backend, 1 MiB blocks, queue depth 32);
reported: the medians of each side and of the per-pair ratios loaded / idle.

    python benchmarks/io_under_compute.py [--dir bench-data/] [--pairs 5] [--json]

Loads (one thread, on tensors the size of one default sub-group's state, 43 MiB each):
- copy:   tensor.copy_ (memory traffic, the GIL released);
- adamw:  torch._fused_adamw_ on one sub-group (the update itself);
- xxh3:   xxhash.xxh3_64 of a buffer (the checksum of every write).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
from pathlib import Path

import torch
import xxhash

from infinity.tools.nvme_bench import create_test_file, fill_test_file, open_runner

NUMEL = (128 << 20) // 12  # one 128MiB sub-group of master, exp_avg, exp_avg_sq: 43 MiB a tensor


def _loads() -> dict:
    def copy():
        src, dst = torch.ones(NUMEL), torch.empty(NUMEL)
        return lambda: dst.copy_(src)

    def adamw():
        p, g, m, v = (torch.rand(NUMEL) for _ in range(4))
        step = torch.zeros(())

        def run():
            torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01,
                                eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip

        return run

    def xxh3():
        data = torch.ones(NUMEL).numpy()
        return lambda: xxhash.xxh3_64_hexdigest(data)

    return {"copy": copy, "adamw": adamw, "xxh3": xxh3}


class _Load:
    """Runs ``work`` in a loop on one thread while the ``with`` block runs."""

    def __init__(self, work):
        self.work, self.stop, self.rounds = work, threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            self.work()
            self.rounds += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=str(Path(__file__).resolve().parent.parent / "bench-data"))
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    path = create_test_file(args.dir)
    size = 1 << 30
    loads = {name: make() for name, make in _loads().items()}
    rows = {(name, op): [] for name in loads for op in ("read", "write")}
    try:
        fill_test_file(path, size)
        with open_runner("uring", path, size, 1 << 20, 32) as run:
            for pair in range(args.pairs):
                for name, work in loads.items():
                    for op in ("read", "write"):
                        idle = run(op)
                        with _Load(work):
                            loaded = run(op)
                        rows[(name, op)].append((idle, loaded))
                        if args.json:
                            print(json.dumps({"pair": pair, "load": name, "op": op, "idle_gbps": idle,
                                              "loaded_gbps": loaded}), flush=True)  # fmt: skip
    finally:
        os.unlink(path)
    print("load   op     idle GB/s  loaded GB/s  loaded/idle (median of pairs)")
    for (name, op), pairs in rows.items():
        idle = statistics.median(a for a, _ in pairs)
        loaded = statistics.median(b for _, b in pairs)
        ratio = statistics.median(b / a for a, b in pairs)
        line = f"{name:6} {op:6} {idle:9.2f}  {loaded:11.2f}  {ratio:.3f}"
        print(json.dumps({"load": name, "op": op, "idle_gbps": idle, "loaded_gbps": loaded, "ratio": ratio})
              if args.json else line, flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The engine's performance goals, measured as ratios in one run. Not run by CI.

The goals: an optimizer step with its states on NVMe runs close to the drive's bandwidth
bound, and with parameters on NVMe and prefetch on, compute seldom waits for a fetch when each
module's compute exceeds its I/O (docs/architecture.md describes the data path measured).

1. Optimizer step with its states on NVMe against the I/O floor: the bytes the step must read
   (master, exp_avg, exp_avg_sq) and write (the same; the parameters are in the cpu tier in
   this run, so their new values add no NVMe bytes) divided by the read and write throughput
   that nvme-bench's harness measures on the same directory with the same engine settings,
   interleaved with the steps (bench, step, bench, step ...). Goal: step time <= 1.15 x floor,
   where floor = read_bytes / read_GBps + write_bytes / write_GBps.
2. Training step with params on NVMe and prefetch on, on modules whose compute exceeds their
   I/O: stall (compute waiting for a fetch) as a share of the step (goal <= 10%); and the step
   time of all-nvme against all-device on the same model, as a ratio (interleaved pairs).

    python benchmarks/engine_bench.py [--dir bench-data/] [--pairs 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import infinity
from infinity.tools.nvme_bench import create_test_file, fill_test_file, open_runner


class Stack(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(layers):
            self.layers.append(nn.Linear(width, width))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _config(path: str, params: str, grads: str, optimizer: str, budget: str = "512MiB") -> dict:
    return {"tiers": {"params": params, "grads": grads, "optimizer": optimizer},
            "nvme": {"paths": [path]}, "memory": {"host_budget": budget},
            "optimizer": {"sub_group_size": "64MiB"}, "prefetch": {"depth": 2}}  # fmt: skip


def optimizer_vs_floor(workdir: str, pairs: int, out) -> dict:
    width, layers = 2048, 24  # 100M parameters: 1.2 GB of optimizer state on nvme
    path = os.path.join(workdir, "opt")
    os.makedirs(path)
    torch.manual_seed(0)
    with infinity.build(_config(path, "cpu", "cpu", "nvme")) as _:
        model = Stack(width, layers)
    engine = infinity.initialize(model, _config(path, "cpu", "cpu", "nvme"))
    numel = sum(u.numel for u in engine.units)
    read_bytes = 12 * numel  # master, exp_avg, exp_avg_sq
    write_bytes = 12 * numel  # the same, back; params go to the cpu tier here
    bench_file = create_test_file(workdir)
    size = 1 << 30
    fill_test_file(bench_file, size)
    rows = []
    x = torch.randn(16, width)
    with open_runner("uring", bench_file, size, 1 << 20, 32) as run:
        for i in range(pairs):
            read_gbps, write_gbps = run("read"), run("write")
            engine.backward(engine(x).pow(2).mean())
            engine.scheduler.release_all()
            engine.grads.flush()
            start = time.perf_counter()
            engine.optimizer.update(1.0)  # the update alone (step() would also clear the gradients and count a step)
            step = time.perf_counter() - start
            engine.grads.zero()
            floor = read_bytes / (read_gbps * 1e9) + write_bytes / (write_gbps * 1e9)
            rows.append((step, floor))
            out(dict(type="optimizer_pair", pair=i + 1, step_s=step, floor_s=floor, read_gbps=read_gbps,
                     write_gbps=write_gbps), f"pair {i + 1}: step {step:.3f}s, floor {floor:.3f}s "
                f"(nvme-bench read {read_gbps:.2f} write {write_gbps:.2f} GB/s), ratio {step / floor:.3f}")  # fmt: skip
    os.unlink(bench_file)
    engine.close()
    ratio = statistics.median(s / f for s, f in rows)
    summary = dict(type="optimizer", params=numel, state_bytes_read=read_bytes, state_bytes_written=write_bytes,
                   median_ratio=ratio, goal_met=ratio <= 1.15)  # fmt: skip
    out(summary, f"optimizer step / I/O floor: {ratio:.3f} (median of {pairs} pairs; {numel / 1e6:.0f}M params, "
        f"{(read_bytes + write_bytes) / 1e9:.2f} GB moved; goal <= 1.15: {'met' if ratio <= 1.15 else 'NOT met'})")  # fmt: skip
    return summary


def training_stall(workdir: str, pairs: int, out) -> dict:
    width, layers, tokens = 1024, 16, 2048  # per module: 8.6 GFLOP forward vs 4 MiB of I/O
    torch.manual_seed(0)
    x = torch.randn(tokens, width)
    engines = {}
    for name, tiers in (("nvme", ("nvme", "nvme", "nvme")), ("device", ("device",) * 3)):
        path = os.path.join(workdir, f"train-{name}")
        os.makedirs(path)
        torch.manual_seed(0)
        engines[name] = infinity.initialize(Stack(width, layers), _config(path, *tiers))
    for engine in engines.values():  # one warm-up step each
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    rows = []
    for i in range(pairs):
        times = {}
        for name in (("nvme", "device") if i % 2 == 0 else ("device", "nvme")):
            engine = engines[name]
            start = time.perf_counter()
            engine.backward(engine(x).pow(2).mean())
            engine.step()
            times[name] = time.perf_counter() - start
        last = engines["nvme"].stats()["step"]
        stall = last["stall_seconds"] / last["seconds"]
        rows.append((times["nvme"], times["device"], stall, last["on_demand"]))
        out(dict(type="train_pair", pair=i + 1, nvme_s=times["nvme"], device_s=times["device"], stall_share=stall),
            f"pair {i + 1}: all-nvme {times['nvme']:.3f}s (stall {100 * stall:.1f}%, "
            f"{last['prefetch_hits']} prefetched, {last['on_demand']} on demand), all-device {times['device']:.3f}s")  # fmt: skip
    for engine in engines.values():
        engine.close()
    stall = statistics.median(r[2] for r in rows)
    ratio = statistics.median(r[0] / r[1] for r in rows)
    summary = dict(type="training", stall_share=stall, nvme_over_device=ratio, goal_met=stall <= 0.10)
    out(summary, f"training step, params on nvme with prefetch: stall {100 * stall:.1f}% of the step (goal <= 10%: "
        f"{'met' if stall <= 0.10 else 'NOT met'}); all-nvme / all-device step time {ratio:.2f} (medians of {pairs})")  # fmt: skip
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=str(Path(__file__).resolve().parent.parent / "bench-data"))
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    def out(obj, text):
        print(json.dumps(obj) if args.json else text, flush=True)

    out(dict(type="command", command=shlex.join(sys.orig_argv)), f"$ {shlex.join(sys.orig_argv)}")
    os.makedirs(args.dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="engine-bench-", dir=args.dir)
    try:
        optimizer_vs_floor(workdir, args.pairs, out)
        training_stall(workdir, args.pairs, out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # our own temporary directory only
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak RSS growth of an all-nvme run against ``memory.host_budget``, phase by phase.

Builds N x Linear(W, W) (fp32, 48 x 2048 by default: 192 MiB of weights, 768 MiB of fp32
state) straight into nvme under ``--swap-dir``, host_budget 256MiB, 32MiB sub-groups, batch 8,
and prints the RSS growth (from before the model is built) after initialize and the peak during
forward, backward and step of each step: VmHWM of /proc/self/status, reset to the current RSS
between phases by writing "5" to /proc/self/clear_refs. Then the pool's peak and the ratio of
the process's peak growth to the budget (the target: <= 1.25 x budget + 128 MiB).

By default a tiny engine runs first, so that what any run pays once is not counted; with
``--no-warmup`` it is: about 72 MiB of it is torch._dynamo, which the constructor of any
``torch.optim.Optimizer`` (the engine's is one) imports.

    python benchmarks/rss_bound.py [--layers 16] [--overlap on|off] [--no-warmup] [--swap-dir bench-data/rss]

Output: one line per phase (peak growth in it, growth after it), then the pool's peak and the
ratio, and per swap directory the disk footprint (engine.stats()["disk"]): the state's bytes, the
peak initialize checked against free space, and the size the arena file reached. Exit status 0 (it measures; it does not judge); the swap files it made are removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

MiB = 1 << 20


def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--host-budget", default="256MiB")
    p.add_argument("--sub-group-size", default="32MiB")
    p.add_argument("--overlap", choices=["on", "off"], default="on")
    p.add_argument("--no-warmup", action="store_true", help="measure from a process that ran no engine before")
    p.add_argument("--swap-dir", default=os.path.join(os.path.dirname(__file__), "..", "bench-data", "rss"))
    args = p.parse_args(argv)

    import torch
    from torch import nn

    import infinity
    from infinity.config import parse_size

    torch.set_num_threads(min(4, os.cpu_count() or 1))
    os.makedirs(args.swap_dir, exist_ok=True)
    swap = tempfile.mkdtemp(prefix="rss-bound-", dir=args.swap_dir)
    budget = parse_size(args.host_budget)
    cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
           "nvme": {"paths": [os.path.join(swap, "run")]}, "memory": {"host_budget": args.host_budget},
           "optimizer": {"sub_group_size": args.sub_group_size, "overlap": args.overlap == "on"}}  # fmt: skip
    try:
        # What every run pays once (torch's allocator, autograd, the aio engine) before the base.
        warm_cfg = {**cfg, "nvme": {"paths": [os.path.join(swap, "warm")]}, "optimizer": {}}
        if not args.no_warmup:
            with infinity.initialize(nn.Linear(4, 4), warm_cfg) as warm:
                warm.backward(warm(torch.randn(2, 4)).sum())
                warm.step()
        reset_peak()
        base = rss()
        rows = []

        def phase(name: str) -> None:
            rows.append((name, peak() - base, rss() - base))
            reset_peak()

        with infinity.build(cfg):
            model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
        engine = infinity.initialize(model, cfg)
        phase("initialize")
        for s in range(args.steps):
            x = torch.randn(args.batch, args.width)
            loss = engine(x).pow(2).mean()
            phase(f"step {s} forward")
            engine.backward(loss)
            del loss
            phase(f"step {s} backward")
            engine.step()
            phase(f"step {s} step")
        stats = engine.stats()
        engine.close()
        top = max(r[1] for r in rows)
        print(f"{args.layers} x Linear({args.width}, {args.width}) fp32, all nvme, batch {args.batch}, "
              f"host_budget {args.host_budget}, sub-groups {args.sub_group_size}, overlap {args.overlap}")  # fmt: skip
        print(f"{'phase':<18} {'peak growth':>12} {'after':>10}")
        for name, hi, now in rows:
            print(f"{name:<18} {hi / MiB:>9.0f}MiB {now / MiB:>7.0f}MiB")
        print(f"pool peak {stats['peak_host_pool_bytes'] / MiB:.0f}MiB; peak RSS growth {top / MiB:.0f}MiB = "
              f"{top / budget:.2f} x host_budget (target <= {(1.25 * budget + 128 * MiB) / MiB:.0f}MiB)")  # fmt: skip
        if "peak_rss_bytes" in stats:
            print(f"engine.stats() peak_rss_bytes {stats['peak_rss_bytes'] / MiB:.0f}MiB (absolute, not growth)")
        for path, d in stats.get("disk", {}).items():  # the footprint initialize checked, and what the arena reached
            print(f"disk {path}: state {d['state_bytes'] / MiB:.0f}MiB, checked peak {d['peak_bytes'] / MiB:.0f}MiB, "
                  f"arena {d['arena_bytes'] / MiB:.0f}MiB = {d['arena_bytes'] / max(d['state_bytes'], 1):.2f} x state")  # fmt: skip
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

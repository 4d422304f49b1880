"""Soak: the demo model trained for many steps with everything on NVMe, checkpointed as it goes.

    .venv/bin/python benchmarks/soak.py [--steps 1000] [--save-every 100] [--size small] [--dir DIR]

It checks what a long run must not do: the swap directory must not grow after the first
checkpoint (swap files reused, not appended to: DeepSpeed's grew with every run, PR #4416),
host RSS must not grow by more than 5% between the first checkpoint and the end, and every
checkpoint saved along the way must verify (every tensor re-read and its xxh3 checked, as
`swap-inspect --verify` does). Not a CI test: it takes minutes. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch.nn.functional as F

import infinity
from infinity.tools import demo
from infinity.swap import SpaceReader


def disk_usage(path: str) -> tuple[int, int]:
    """(allocated bytes, apparent bytes) of every file under ``path``."""
    allocated = apparent = 0
    for d, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(d, f))
            allocated += st.st_blocks * 512
            apparent += st.st_size
    return allocated, apparent


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def verify_checkpoint(where: str) -> tuple[int, int]:
    """(tensors, bytes) re-read and checked in every rank directory of checkpoint ``where``."""
    tensors = nbytes = 0
    for entry in sorted(os.listdir(where)):
        if not entry.startswith("rank"):
            continue
        with SpaceReader(os.path.join(where, entry)) as reader:
            for name in reader.names():
                reader.read(name, verify=True)  # SwapCorruption (an OSError) if a byte is off
                tensors += 1
                nbytes += reader.info(name).nbytes
    return tensors, nbytes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--size", choices=demo.SIZES, default="small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--dir", default="bench-data/soak", help="swap and checkpoints go here (removed first)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    swap, ckpt = os.path.join(args.dir, "swap"), os.path.join(args.dir, "ckpt")
    os.makedirs(swap)
    train_data, _ = demo.split_corpus(demo.load_corpus())
    model = demo.build_model(args.size, args.block_size, seed=0)
    nparams = sum(p.numel() for p in model.parameters())
    cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}, "nvme": {"paths": [swap]},
           "optimizer": {"lr": 1e-3}}  # fmt: skip
    engine = infinity.initialize(model, cfg)
    batches = demo.random_batches(train_data, args.block_size, args.batch_size, seed=1000)
    marks, saves, losses = {}, [], []
    start = time.perf_counter()
    print(f"soak: GPT-2 {args.size} ({nparams / 1e6:.2f}M parameters), {args.steps} steps, all on nvme, "
          f"a checkpoint every {args.save_every}", flush=True)  # fmt: skip
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        loss = F.cross_entropy(engine(input_ids=x).logits.float().flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step % args.save_every == 0:
            t = time.perf_counter()
            where = engine.save_checkpoint(ckpt)  # every one kept: each is verified at the end
            saves.append({"step": step, "dir": where, "seconds": time.perf_counter() - t,
                          "bytes": disk_usage(where)[1]})  # fmt: skip
            if step == args.save_every or step == args.steps:
                engine.space.flush()  # the manifest as it is now, for the disk figure
                marks[step] = {"swap_allocated": disk_usage(swap)[0], "swap_apparent": disk_usage(swap)[1],
                               "swap_tensor_bytes": engine.space.stats()["allocated_bytes"],
                               "rss": rss_bytes(), "pool_peak": engine.stats()["peak_host_pool_bytes"]}  # fmt: skip
            print(f"step {step}: loss {sum(losses[-args.save_every:]) / args.save_every:.3f}, saved {where} "
                  f"in {saves[-1]['seconds']:.2f}s, RSS {rss_bytes() / 2**20:.0f} MiB, swap "
                  f"{disk_usage(swap)[0] / 2**20:.1f} MiB, {time.perf_counter() - start:.0f}s", flush=True)  # fmt: skip
    engine.close()
    verified = []
    for s in saves:
        tensors, nbytes = verify_checkpoint(s["dir"])
        verified.append({"step": s["step"], "tensors": tensors, "bytes": nbytes})
    first, last = marks[args.save_every], marks[args.steps]
    result = {
        "steps": args.steps, "size": args.size, "parameters": nparams, "seconds": time.perf_counter() - start,
        "first": first, "last": last,
        "swap_growth_bytes": last["swap_allocated"] - first["swap_allocated"],
        "rss_growth": last["rss"] / first["rss"] - 1,
        "checkpoints": len(saves), "checkpoints_verified": len(verified),
        "save_seconds_median": sorted(s["seconds"] for s in saves)[len(saves) // 2],
        "checkpoint_bytes": saves[-1]["bytes"],
        "loss_first_window": sum(losses[: args.save_every]) / args.save_every,
        "loss_last_window": sum(losses[-args.save_every :]) / args.save_every,
    }  # fmt: skip
    ok_disk = result["swap_growth_bytes"] <= 0
    ok_rss = result["rss_growth"] <= 0.05
    print(f"swap directory at step {args.save_every}: {first['swap_allocated'] / 2**20:.2f} MiB allocated "
          f"({first['swap_apparent'] / 2**20:.2f} MiB apparent); at step {args.steps}: "
          f"{last['swap_allocated'] / 2**20:.2f} MiB ({last['swap_apparent'] / 2**20:.2f}): "
          f"growth {result['swap_growth_bytes']} bytes {'OK' if ok_disk else 'GREW'}; held by tensors "
          f"{first['swap_tensor_bytes'] / 2**20:.2f} and {last['swap_tensor_bytes'] / 2**20:.2f} MiB")  # fmt: skip
    print(f"host RSS at step {args.save_every}: {first['rss'] / 2**20:.1f} MiB; at step {args.steps}: "
          f"{last['rss'] / 2**20:.1f} MiB: {result['rss_growth'] * 100:+.2f}% {'OK' if ok_rss else 'over 5%'}")  # fmt: skip
    print(f"checkpoints: {len(verified)} of {len(saves)} verified ({verified[-1]['tensors']} tensors, "
          f"{verified[-1]['bytes'] / 2**20:.1f} MiB each); median save {result['save_seconds_median']:.2f}s; "
          f"loss {result['loss_first_window']:.3f} -> {result['loss_last_window']:.3f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok_disk and ok_rss and len(verified) == len(saves) else 1


if __name__ == "__main__":
    sys.exit(main())

"""A billion parameters on this machine: a Llama-shaped model built with infinity.build(), every
tier on nvme, a few steps. Not run by CI (about 20 GB of swap and minutes a step).

Reports, per phase (build, initialize, each step), the peak RSS growth over the RSS before the
model existed (VmHWM, reset before each phase); per step the forward, backward and optimizer
seconds, the bytes read and written, and those bytes per parameter, split by kind of state
(param, grad, master, exp_avg, exp_avg_sq, and with --state-dtype int8 exp_avg.scale and
exp_avg_sq.scale: engine.stats()["step"]["nvme"]["by_kind"]); the fp32 training state (16 bytes a parameter) over
the largest peak RSS growth, and that growth against the bound 1.25 x host_budget + 128MiB;
and per swap directory the disk footprint of engine.stats()["disk"] (the state, the peak
initialize checked, the arena's cap and the size it reached, over the state).

    python benchmarks/scale.py [--dir bench-data/] [--steps 3] [--host-budget 4GiB] [--json]
                               [--hidden 2048 --layers 16 --intermediate 5632]  (2.7B: 2560 32 6912)
                               [--no-overlap] [--no-keep] [--state-dtype fp32|bf16|int8]
                               [--precision fp32|bf16] [--tiers nvme,nvme,nvme]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import infinity


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current RSS


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The options of the Llama-shaped model (953M parameters by default) and the directory
    its state goes in: what benchmarks/scale_step.py and budget_floor.py share with this one."""
    p.add_argument("--dir", default=str(Path(__file__).resolve().parent.parent / "bench-data"))
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=64)


def llama_config(args):
    """The Llama-shaped model of ``args`` (hidden, layers, intermediate, vocab, tokens);
    benchmarks/scale_step.py trains the same one."""
    import transformers

    return transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                    num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16,
                                    max_position_embeddings=max(args.tokens, 64))  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--host-budget", default="4GiB")
    p.add_argument("--sub-group-size", default="128MiB")
    p.add_argument("--tile-size", default="32MiB", help='memory.tile_size ("none": no tiles)')
    p.add_argument("--no-overlap", action="store_true", help="optimizer.overlap = false")
    p.add_argument("--no-keep", action="store_true", help="prefetch.keep = false (backward reads every unit again)")
    p.add_argument("--state-dtype", default="fp32", choices=("fp32", "bf16", "int8"),
                   help="optimizer.state_dtype: how Adam's moments are stored (the master weights stay fp32)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="precision.param_dtype")
    p.add_argument("--tiers", default="nvme,nvme,nvme", help="params,grads,optimizer tiers")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="scale-", dir=args.dir)
    out = []

    def report(obj, text):
        out.append(obj)
        print(json.dumps(obj) if args.json else text, flush=True)

    try:
        cfg = llama_config(args)
        tiers = {"tiers": dict(zip(("params", "grads", "optimizer"), args.tiers.split(","))), "nvme": {"paths": [work]},
                 "precision": {"param_dtype": args.precision},
                 "memory": {"host_budget": args.host_budget,
                            "tile_size": None if args.tile_size == "none" else args.tile_size},
                 "optimizer": {"lr": 1e-4, "sub_group_size": args.sub_group_size, "overlap": not args.no_overlap,
                               "state_dtype": args.state_dtype},
                 "prefetch": {"keep": not args.no_keep}}  # fmt: skip
        torch.manual_seed(0)
        base = rss()
        reset_peak()
        start = time.perf_counter()
        with infinity.build():
            model = transformers.LlamaForCausalLM(cfg)
        n = sum(p.numel() for p in model.parameters())
        report({"phase": "build", "params": n, "seconds": time.perf_counter() - start, "peak_growth": peak() - base},
               f"build: {n / 1e9:.3f}B parameters in {time.perf_counter() - start:.1f}s, peak RSS growth "
               f"{(peak() - base) / 2**30:.2f} GiB")  # fmt: skip
        reset_peak()
        start = time.perf_counter()
        engine = infinity.initialize(model, tiers)
        report({"phase": "initialize", "seconds": time.perf_counter() - start, "peak_growth": peak() - base},
               f"initialize: {time.perf_counter() - start:.1f}s, peak RSS growth {(peak() - base) / 2**30:.2f} GiB")
        worst = 0
        for step in range(args.steps):
            ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(step))
            reset_peak()
            t0 = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            nvme = engine.stats()["step"]["nvme"]
            growth = peak() - base
            worst = max(worst, growth)
            # bytes per parameter this step, per kind of state (read + written)
            per_param = {k: (v["read_bytes"] + v["write_bytes"]) / n for k, v in sorted(nvme["by_kind"].items())}
            report({"phase": "step", "step": step, "loss": loss.item(), "forward": t1 - t0, "backward": t2 - t1,
                    "optimizer": t3 - t2, "read_bytes": nvme["read_bytes"], "write_bytes": nvme["write_bytes"],
                    "bytes_per_param": (nvme["read_bytes"] + nvme["write_bytes"]) / n, "by_kind": per_param,
                    "stall": engine.stats()["step"]["stall_seconds"], "peak_growth": growth},
                   f"step {step}: loss {loss.item():.3f}, {t3 - t0:.1f}s (forward {t1 - t0:.1f}, backward {t2 - t1:.1f}, "
                   f"optimizer {t3 - t2:.1f}), read {nvme['read_bytes'] / 1e9:.1f} GB, written "
                   f"{nvme['write_bytes'] / 1e9:.1f} GB = {(nvme['read_bytes'] + nvme['write_bytes']) / n:.1f} B/param "
                   f"({', '.join(f'{k} {v:.1f}' for k, v in per_param.items())}), peak RSS growth "
                   f"{growth / 2**30:.2f} GiB")  # fmt: skip
        state = 16 * n
        worst = max(worst, *(o["peak_growth"] for o in out if "peak_growth" in o))
        stats = engine.stats()
        budget = engine.config.memory.host_budget
        bound = 1.25 * budget + (128 << 20)  # the README's bound on the peak RSS growth
        report({"phase": "summary", "state_bytes": state, "peak_growth": worst, "ratio": state / worst,
                "pool_peak": stats["peak_host_pool_bytes"], "host_budget": budget, "rss_bound": bound},
               f"fp32 state {state / 2**30:.1f} GiB over peak RSS growth {worst / 2**30:.2f} GiB: {state / worst:.1f}x "
               f"(host pool peak {stats['peak_host_pool_bytes'] / 2**30:.2f} GiB; growth {worst / budget:.2f} x "
               f"host_budget, bound 1.25 x host_budget + 128MiB = {bound / 2**30:.2f} GiB)")  # fmt: skip
        for path, d in stats["disk"].items():  # the footprint initialize checked, and what the arena reached
            report({"phase": "disk", "path": path, **d},
                   f"disk: state {d['state_bytes'] / 2**30:.2f} GiB, peak checked at initialize "
                   f"{d['peak_bytes'] / 2**30:.2f} GiB, cap {d['cap_bytes'] / 2**30:.2f} GiB, arena "
                   f"{d['arena_bytes'] / 2**30:.2f} GiB = {d['arena_bytes'] / max(d['state_bytes'], 1):.3f} x state "
                   f"({engine.overlap.committed if engine.overlap else 0} of "
                   f"{len(engine.optimizer.groups)} sub-groups committed early in the last step)")  # fmt: skip
        engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)  # our own directory only
    return 0


if __name__ == "__main__":
    sys.exit(main())

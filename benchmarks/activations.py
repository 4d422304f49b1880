"""Activations on nvme against activations on the device: the step time at a sequence both
train, and the longest sequence each trains under one memory limit. Not run by CI (minutes).

The model is a transformers Llama (``benchmarks/scale.py``'s shape, small by default: hidden
256, 32 layers, intermediate 688, vocab 1024) trained with Hugging Face's gradient
checkpointing (``gradient_checkpointing_enable``, non-reentrant), one sequence a batch, fp32,
torch's flash attention kernel (``sdpa_kernel``) at every length,
params, grads and optimizer on ``--tiers`` (the device by default: on this CPU-only machine
that is host memory, so what differs between the two sides is only where the checkpointed
block inputs wait for backward).

Step time (``--seq``): two engines in one process, built from the same initial weights,
train on the same batches, their steps interleaved (device, ``--tier``, device, ``--tier`` ...;
nvme by default, cpu on a GPU); the first pair is a warm-up. ``--against verify-off`` compares
instead the tier with nvme.verify at ``--verify`` (always, the default: every read back checked
against its checksum) to the same tier with nvme.verify = off: the ratio is then what checking
costs the step. Reported: the median over the pairs of the tier's step / the other side's
(the device's, or the unchecked tier's), both medians, the activation bytes a step moved, the
largest loss difference (the tier is exact, so 0), and on a GPU the engine's D2H and H2D copy
throughput (``engine.stats()``), to set beside the pinned-copy peak ``benchmarks/gpu_step.py``
measures. On a GPU the longest-sequence sweep still measures host RSS, which is not the memory
that limits the sequence there: use the step comparison.

Longest sequence (``--limit``): for each tier, a fresh process per sequence length (``--from``
tokens, growing by ``--grow``, or by ``--step`` tokens, until a length does not fit) trains ``--warmup`` steps and one
more, and reports the peak RSS growth of that last one over the RSS just before it (VmHWM
after resetting it: what a step adds to a process whose model, states and pool are already
there; the steps before grew the pool and torch's allocator to what every step uses); a
length fits when that growth is at most ``--limit``. Reported per tier: each length's growth
and the process's peak RSS, the longest that fit, and the growth's slope in MiB per 1024
tokens (least squares over the lengths tried: what each more token costs). On these 2 cores the attention's compute grows with the square of the
sequence, which is what keeps the limit small here (128MiB: lengths of a few thousand tokens).

    python benchmarks/activations.py [--seq 1536] [--pairs 4] [--limit 128MiB] [--from 1024]
        [--grow 1.5 | --step 1024] [--warmup 2] [--tier nvme|cpu] [--max-seq 131072] [--tiers device,device,device] [--dir bench-data/]
        [--hidden 256 --layers 32 --intermediate 688 --vocab 1024] [--skip-step] [--skip-longest] [--json]
        [--verify always|off] [--against device|verify-off]

A tiny model checks the script in seconds (``--hidden 128 --layers 2 --intermediate 256 --vocab
512 --seq 2048 --pairs 1 --skip-longest``: each block's input is then 1 MiB, the tier's
``min_bytes``, so it moves; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rss_bound import peak as _peak_rss, reset_peak, rss as _rss  # this directory
from scale import llama_config  # ... and the same model family

HERE = Path(__file__).resolve().parent


def _model(args, seq: int, seed: int = 0):
    import transformers

    transformers.logging.set_verbosity_error()
    args.tokens = seq
    config = llama_config(args)
    config.num_attention_heads = config.num_key_value_heads = args.heads
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _config(args, swap: str, tier: str, verify: str | None = None) -> dict:
    params, grads, optimizer = args.tiers.split(",")
    nvme = {"paths": [swap], "verify": verify or args.verify}
    return {"tiers": {"params": params, "grads": grads, "optimizer": optimizer}, "nvme": nvme,
            "memory": {"host_budget": args.host_budget}, "optimizer": {"lr": 1e-4},
            "activations": {"tier": tier}}  # fmt: skip


def _batch(args, seq: int, step: int):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, args.vocab, (1, seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def _step(engine, batch) -> tuple[float, float]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    start = time.perf_counter()
    # One attention kernel at every length: torch's choice otherwise varies with it, and its
    # math kernel holds heads x seq^2 scores (150 MB at 3072 tokens), which swamps the rest.
    # (A loss of 0 difference between the sides needs the same kernel on both: it is.)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):  # (CUDA's flash: 16-bit only)
        loss = engine(**{k: v.to(engine.device) for k, v in batch.items()}).loss
        engine.backward(loss)
    engine.step()
    return time.perf_counter() - start, loss.item()


def step_time(args, root: str) -> dict:
    import infinity

    # side -> (activations tier, nvme.verify); the side the tier is measured against first
    other = args.tier
    base = "device" if args.against == "device" else f"{other} unchecked"
    sides = {base: ("device", args.verify) if args.against == "device" else (other, "off"), other: (other, args.verify)}
    models = {side: _model(args, args.seq) for side in sides}
    models[other].load_state_dict(models[base].state_dict())  # (the same seed: already equal)
    engines = {side: infinity.initialize(m, _config(args, os.path.join(root, side.replace(" ", "-")), *sides[side]))
               for side, m in models.items()}  # fmt: skip
    del models
    times = {tier: [] for tier in engines}
    diffs, moved = [], 0
    try:
        for pair in range(args.pairs + 1):
            batch = _batch(args, args.seq, pair)
            losses = {}
            for tier, engine in engines.items():
                seconds, losses[tier] = _step(engine, batch)
                if pair:  # the first pair warms up
                    times[tier].append(seconds)
            diffs.append(abs(losses[base] - losses[other]))
            moved = engines[other].stats()["step"]["activation_out_bytes"]
            shown = {t: f"{v[-1]:.2f} s" if pair else "warm-up" for t, v in times.items()}
            print(f"  pair {pair}: {base} {shown[base]}, {other} {shown[other]}, loss {losses[base]:.6f}",
                  file=sys.stderr)  # fmt: skip
        copies = engines[other].stats()["total"]
    finally:
        for engine in engines.values():
            engine.close()
    ratios = [n / d for n, d in zip(times[other], times[base])]
    return {"seq": args.seq, "pairs": args.pairs, "tier": other, "base": base, "verify": args.verify,
            "ratio": statistics.median(ratios), "ratios": ratios,
            "base_s": statistics.median(times[base]), "tier_s": statistics.median(times[other]),
            "activation_bytes_a_step": moved, "largest_loss_difference": max(diffs),
            "d2h_gbps": copies.get("d2h_gbps", 0.0), "h2d_gbps": copies.get("h2d_gbps", 0.0)}  # fmt: skip


def child(args) -> None:
    """One tier at one length in this fresh process: ``--warmup`` steps and one more, then that
    step's RSS growth and the process's peak RSS as JSON."""
    import infinity

    model = _model(args, args.seq)
    with infinity.initialize(model, _config(args, args.swap, args.child_tier)) as engine:
        for step in range(args.warmup + 1):
            if step == args.warmup:
                reset_peak()  # the peak (VmHWM) back to the RSS now
                base = _rss()
            _step(engine, _batch(args, args.seq, step))
        growth, st = _peak_rss() - base, engine.stats()
    print(json.dumps({"growth": growth, "peak_rss": _peak_rss(), "activation_out_bytes": st["step"]["activation_out_bytes"]}))


def longest(args, root: str) -> dict:
    from infinity.config import parse_size

    limit = parse_size(args.limit)
    out = {}
    for tier in ("device", args.tier):
        seq, rows, best = args.start, [], None
        while seq <= args.max_seq:
            swap = os.path.join(root, f"{tier}-{seq}")
            cmd = [sys.executable, __file__, "--child", "--child-tier", tier, "--seq", str(seq), "--swap", swap,
                   *_model_argv(args)]  # fmt: skip
            run = subprocess.run(cmd, capture_output=True, text=True)
            shutil.rmtree(swap, ignore_errors=True)
            if run.returncode != 0:
                rows.append({"seq": seq, "error": run.stderr.strip().splitlines()[-1:]})
                break
            row = {"seq": seq, **json.loads(run.stdout.strip().splitlines()[-1])}
            row["fits"] = row["growth"] <= limit
            rows.append(row)
            print(f"  {tier} {seq} tokens: step's RSS growth {row['growth'] / 2**20:.0f} MiB "
                  f"({'fits' if row['fits'] else 'over'} {args.limit}), peak RSS {row['peak_rss'] / 2**30:.2f} GiB",
                  file=sys.stderr)  # fmt: skip
            if not row["fits"]:
                break
            best = seq
            seq = seq + args.step if args.step else int(seq * args.grow) // 256 * 256
        points = [(r["seq"], r["growth"]) for r in rows if "growth" in r]
        out[tier] = {"longest": best, "rows": rows, "mib_per_1k_tokens": _slope(points) * 1024 / 2**20}
    out["limit"] = args.limit
    return out


def _slope(points) -> float:
    """Least-squares slope of y over x (bytes a token); nan with fewer than two points."""
    if len(points) < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def _model_argv(args) -> list[str]:
    return ["--hidden", str(args.hidden), "--layers", str(args.layers), "--intermediate", str(args.intermediate),
            "--vocab", str(args.vocab), "--heads", str(args.heads), "--tiers", args.tiers,
            "--host-budget", args.host_budget, "--warmup", str(args.warmup), "--verify", args.verify]  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=str(HERE.parent / "bench-data"))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--tiers", default="device,device,device", help="params,grads,optimizer")
    p.add_argument("--tier", default="nvme", choices=("nvme", "cpu"),
                   help="[activations] tier of the side compared with the device (cpu: a GPU only)")
    p.add_argument("--verify", default="always", choices=("always", "off"),
                   help="nvme.verify of the engines (always: every swap read checked against its checksum)")
    p.add_argument("--against", default="device", choices=("device", "verify-off"),
                   help="what the tier's step is measured against: activations on the device, or the same tier "
                        "with nvme.verify = off (then the ratio is verification on / off)")  # fmt: skip
    p.add_argument("--host-budget", default="256MiB")
    p.add_argument("--seq", type=int, default=1536, help="the sequence of the step-time comparison")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--limit", default="128MiB", help="the step's peak RSS growth a length must stay within to fit")
    p.add_argument("--from", dest="start", type=int, default=1024)
    p.add_argument("--grow", type=float, default=1.5)
    p.add_argument("--step", type=int, default=0, help="lengths grow by this many tokens instead (0: by --grow)")
    p.add_argument("--warmup", type=int, default=2, help="steps before the one measured")
    p.add_argument("--max-seq", type=int, default=131072)
    p.add_argument("--skip-step", action="store_true")
    p.add_argument("--skip-longest", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-tier", help=argparse.SUPPRESS)
    p.add_argument("--swap", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    if args.child:
        child(args)
        return 0
    os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="activations-", dir=args.dir)
    result = {"model": {"hidden": args.hidden, "layers": args.layers, "intermediate": args.intermediate,
                        "vocab": args.vocab, "tiers": args.tiers, "host_budget": args.host_budget}}  # fmt: skip
    try:
        if not args.skip_step:
            result["step"] = step_time(args, root)
        if not args.skip_longest:
            result["longest"] = longest(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if "step" in result:
        s = result["step"]
        print(f"step at {s['seq']} tokens ({s['pairs']} pairs, nvme.verify {s['verify']}): {s['tier']} / {s['base']} "
              f"{s['ratio']:.3f} (pairs {' / '.join(f'{r:.3f}' for r in s['ratios'])}); {s['base']} {s['base_s']:.2f} s, {s['tier']} "
              f"{s['tier_s']:.2f} s; {s['activation_bytes_a_step'] / 2**20:.0f} MiB of activations each way a step; "
              f"largest |loss difference| {s['largest_loss_difference']:g}"
              + (f"; copies D2H {s['d2h_gbps']:.1f} GB/s, H2D {s['h2d_gbps']:.1f} GB/s" if s["d2h_gbps"] else ""))  # fmt: skip
    if "longest" in result:
        lg = result["longest"]
        for tier in ("device", args.tier):
            print(f"longest sequence within a step's RSS growth of {lg['limit']}, activations on {tier}: "
                  f"{lg[tier]['longest']} tokens (" + ", ".join(f"{r['seq']}: {r['growth'] / 2**20:.0f} MiB"
                  if "growth" in r else f"{r['seq']}: failed" for r in lg[tier]["rows"]) +
                  f"); {lg[tier]['mib_per_1k_tokens']:.1f} MiB more per 1024 tokens")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

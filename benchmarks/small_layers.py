"""The engine's own cost per unit: many small layers, little compute, every tier in memory.
Not run by CI.

A model of many small layers at a small batch is where what the engine does per unit (its
hooks in forward and backward, each gradient's hand-over, the step's per-unit bookkeeping)
shows against the compute. No tier is on nvme, so no I/O hides it or is hidden by it: what
is left over plain PyTorch is the engine's critical path. On a GPU the same per-unit host work
is what a launch-bound step waits on.

One process trains the same Llama-shaped model (``--layers`` 24 of hidden 256, intermediate
512, vocab 4096, 16 heads: 17.8M parameters; ``benchmarks/scale.py``'s builder) on the same batches of
``--batch`` x ``--tokens`` (1 x 32):

- plain: the model in fp32, ``torch.optim.AdamW(fused=True)`` (the engine's kernel, and the
  fastest torch step on the host), ``zero_grad()`` after each step; with ``--precision bf16``
  the model in bf16 and the update on fp32 master copies (the gradients cast into them, the
  new values copied back), as mixed precision does and the engine does;
- infinity: ``infinity.initialize`` of a copy, with each placement of ``--placements`` in turn
  (params,grads,optimizer; ``device`` is the compute device, here the host), the optimizer
  under backward as ``--overlap`` says (the default's "auto"), same learning rate and weight
  decay.

With ``--clip`` both sides clip to that global norm (the engine's ``optimizer.max_grad_norm``;
plain calls ``clip_grad_norm_`` before its step, as the Trainer does with its default 1.0).
Without it, plain never reads a gradient outside backward and the step, while the engine reads
each one once in its hook for the overflow check (and clipping, when set): on this project's
2-core machine that read alone is about 15% of plain backward (`benchmarks/grad_hooks.py`).

Each placement runs in a process of its own (the first engine and model of a process leave
the allocator's heaps as the next one finds them). Steps are interleaved (plain, infinity,
plain, infinity ...), ``--repeat`` steps of one side
each time, ``--pairs`` pairs after a warm-up pair; reported per placement as medians: the step
time of both sides, their ratio (the issue's bar: 1.05), the forward / backward / step split
of both, and the largest loss difference (a sanity check: the engine's fp32 step is checked
against torch's in the tests).

    python benchmarks/small_layers.py [--pairs 7] [--repeat 5] [--placements
        "device,device,device;device,device,cpu"] [--precision fp32|bf16] [--overlap auto|true|false]
        [--clip 1.0] [--json]
        [--hidden 256 --layers 24 --intermediate 512 --vocab 4096] [--batch 1 --tokens 32]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from scale import add_model_args, llama_config  # this directory: the same model

TARGET = 1.05  # infinity step / plain step: the bar
# The model's shape (17.8M parameters), which benchmarks/grad_hooks.py shares.
MODEL = {"hidden": 256, "layers": 24, "intermediate": 512, "vocab": 4096, "tokens": 32}


def _timed_step(model, backward, step, zero, batch) -> tuple[float, float, float, float]:
    """(forward, backward, step seconds, loss) of one training step."""
    t0 = time.perf_counter()
    loss = model(**batch).loss
    t1 = time.perf_counter()
    backward(loss)
    t2 = time.perf_counter()
    step()
    zero()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, loss.detach().item()


def _plain_optimizer(model, lr: float, mixed: bool, clip: float | None = None):
    """(step, zero_grad) of plain torch's fused AdamW on ``model`` (fp32). ``mixed``: as mixed
    precision does, and the engine with bf16 parameters: fp32 master copies of the parameters
    as the model made them, the parameters themselves cast to bf16 (the buffers, the rotary
    frequencies, stay fp32); each step casts the gradients into the masters', updates them,
    and copies the new values back into the bf16 parameters. ``clip``: the step clips the
    gradients to that global norm first (`torch.nn.utils.clip_grad_norm_`, as the Trainer does)."""
    params = list(model.parameters())
    if not mixed:
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True)
        if clip is None:
            return opt.step, opt.zero_grad

        def clipped():
            torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()

        return clipped, opt.zero_grad
    masters = [p.detach().clone().requires_grad_() for p in params]
    for p in params:
        p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=lr, weight_decay=0.01, fused=True)

    def step():
        for p, m in zip(params, masters):
            m.grad = None if p.grad is None else p.grad.float()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params, masters)

    def zero():
        opt.zero_grad()
        model.zero_grad()

    return step, zero


def _placement(args, base, placement: str, batches) -> dict:
    import infinity

    params, grads, optimizer = placement.split(",")
    plain = copy.deepcopy(base)
    plain_step, plain_zero = _plain_optimizer(plain, args.lr, args.precision == "bf16", args.clip)
    cfg = infinity.TierConfig.from_dict({
        "tiers": {"params": params, "grads": grads, "optimizer": optimizer},
        "precision": {"param_dtype": args.precision},
        "optimizer": {"lr": args.lr, "weight_decay": 0.01, "max_grad_norm": args.clip,
                      "overlap": {"true": True, "false": False}.get(args.overlap, args.overlap)},
    })  # fmt: skip
    engine = infinity.initialize(copy.deepcopy(base), cfg)
    sides = {
        "plain": lambda b: _timed_step(plain, lambda loss: loss.backward(), plain_step, plain_zero, b),
        "infinity": lambda b: _timed_step(engine, engine.backward, engine.step, engine.zero_grad, b),
    }
    times = {side: [] for side in sides}  # per pair: (fwd, bwd, step) medians over the repeat
    losses = {side: [] for side in sides}
    ratios = []
    try:
        for pair in range(args.pairs + 1):
            total = {}
            for side, run in sides.items():
                out = [run(batches[(pair * args.repeat + r) % len(batches)]) for r in range(args.repeat)]
                losses[side].extend(o[3] for o in out)
                if pair:  # the first pair warms up
                    times[side].append([statistics.median(o[k] for o in out) for k in range(3)])
                total[side] = sum(sum(o[:3]) for o in out)
            if pair:
                ratios.append(total["infinity"] / total["plain"])
    finally:
        engine.close()
    split = {side: [statistics.median(t[k] for t in ts) for k in range(3)] for side, ts in times.items()}
    return {
        "placement": placement,
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "plain_ms": sum(split["plain"]) * 1e3,
        "infinity_ms": sum(split["infinity"]) * 1e3,
        "split_ms": {side: [round(x * 1e3, 2) for x in s] for side, s in split.items()},
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses["plain"], losses["infinity"])),
    }


def _in_own_process(argv, placement: str) -> dict:
    """``placement``'s result, measured in a fresh process with the same arguments: measured one
    after another in one process, the second placement ran 1.07-1.12x plain where it ran
    1.04-1.05x first (either order; its first pair 1.7-1.9x), the allocator's heaps and
    thresholds as the first engine and plain model left them."""
    import subprocess
    import sys

    rest = list(sys.argv[1:] if argv is None else argv)
    for flag in ("--placements", "--json"):
        while flag in rest:
            at = rest.index(flag)
            del rest[at : at + (2 if flag == "--placements" else 1)]
    out = subprocess.run([sys.executable, __file__, *rest, "--placements", placement, "--json"], check=True,
                         stdout=subprocess.PIPE, text=True).stdout  # fmt: skip
    return json.loads(out[out.index("{"):])["results"][0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p)
    p.set_defaults(**MODEL)
    p.add_argument("--pairs", type=int, default=7)
    p.add_argument("--repeat", type=int, default=5, help="steps of one side in a row")
    p.add_argument("--placements", default="device,device,device;device,device,cpu")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--overlap", choices=("auto", "true", "false"), default="auto", help="optimizer.overlap")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip", type=float, default=None,
                   help="both sides clip the gradients to this global norm (optimizer.max_grad_norm; "
                        "plain: clip_grad_norm_ before the step, as the Trainer does with its default 1.0)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import transformers

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(llama_config(args))
    n = sum(t.numel() for t in base.parameters())
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(8):
        ids = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    placements = args.placements.split(";")
    if len(placements) > 1:  # each in a process of its own: see _in_own_process
        results = [_in_own_process(argv, pl) for pl in placements]
    else:
        results = [_placement(args, base, placements[0], batches)]
    if args.json:
        print(json.dumps({"parameters": n, "results": results}, indent=2))
        return 0
    clip = f", clipped to {args.clip:g}" if args.clip is not None else ""
    print(f"{n / 1e6:.1f}M parameters, {args.layers} layers, {args.batch}x{args.tokens} tokens, {args.precision}{clip}, "
          f"{args.pairs} interleaved pairs of {args.repeat} steps a side (medians)")  # fmt: skip
    for r in results:
        pf, pb, ps = r["split_ms"]["plain"]
        inf_f, inf_b, inf_s = r["split_ms"]["infinity"]
        verdict = "within" if r["ratio"] <= TARGET else "over"
        print(f"{r['placement']:>22}: infinity / plain {r['ratio']:.3f} ({verdict} {TARGET}); "
              f"plain {r['plain_ms']:.1f} ms ({pf:.1f} / {pb:.1f} / {ps:.1f}), "
              f"infinity {r['infinity_ms']:.1f} ms ({inf_f:.1f} / {inf_b:.1f} / {inf_s:.1f}) fwd / bwd / step; "
              f"pairs {' / '.join(f'{x:.3f}' for x in r['ratios'])}; max loss diff {r['max_loss_diff']:.2e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

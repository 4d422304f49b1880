"""The host optimizer step (the optimizer states in host memory) against torch's fused AdamW on
the same parameters, and int8 states against fp32 ones. Not run by CI.

One process builds the Llama-shaped model of ``benchmarks/scale.py`` (106M parameters by
default here: hidden 768, 8 layers, intermediate 2048, vocab 32000) with random weights, and
times three comparisons, each as interleaved pairs (A, B, A, B ...; the first pair a warm-up):

- ``fp32``: ``engine.step()`` of an engine with placement device,device,cpu (params and grads on
  the compute device, which here is the host; the optimizer states on the cpu tier), fp32
  parameters, ``optimizer.overlap`` off (the whole update after backward), against
  ``torch.optim.AdamW(fused=True).step()`` plus ``zero_grad()`` over a copy of the model;
- ``bf16``: the same with bf16 parameters. The engine keeps fp32 master weights and writes
  each new parameter back in bf16, so the fair torch side is what mixed precision does in
  plain torch: fused AdamW over fp32 master copies of the parameters, then the new values
  copied back into the bf16 parameters (``torch._foreach_copy_``). The bf16 gradients are cast
  into the masters' ``.grad`` outside the timing, as the engine does in backward;
- ``int8``: the engine with ``optimizer.state_dtype = "int8"`` against the same engine with
  fp32 states (fp32 parameters), both engines' ``step()``.

Both sides of a pair run a forward and backward on the same batch first (not timed), so each
step has the gradients of that batch. The timed figure is the wall time of the step alone.
Reported per comparison: the medians of each side's step seconds over the pairs and the
median of the pairs' ratios A / B (the figure to hold to the targets: 1.25x for fp32 and
bf16, 1.5x for int8), and from ``engine.stats()["step"]`` the engine's time in the kernels
(``optimizer_seconds``), in the whole update (``update_seconds``: the kernels, the gradient
check, the parameters written; the rest of ``step()`` is its bookkeeping) and its bytes by tier. The machine may be shared: the pairs are
interleaved so that what else runs weighs on both sides alike, and the medians drop the
outliers; a noisy run shows as a wide spread of the pair ratios (printed). torch's kernels run
on every core with OpenMP, whose threads wait for each other: a process beside them on one of
the two cores slowed one fused AdamW call 8x (0.083 s to 0.66). So before each pair the script
waits (``--quiet``, at most that many seconds) until the other processes have used under 5% of
a core for half a second, and counts the pairs that ran with the machine busy all the same
(``busy_pairs``).

    python benchmarks/host_step.py [--pairs 5] [--compare fp32,bf16,int8] [--json]
        [--hidden 768 --layers 8 --intermediate 2048 --vocab 32000 --tokens 64]
        [--sub-group-size 128MiB] [--quiet 60] [--profile]

``--profile`` runs one more engine step of the first comparison under cProfile and prints its
top functions by own time (what Python costs per unit and per sub-group). Another checkout of
the engine is measured with ``PYTHONPATH=<its root>`` (its ``infinity`` first on the path):
before against after, each run's ratios against the same torch side.
Exit status 0; the targets are reported, not enforced.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from scale import llama_config  # noqa: E402 - this directory: the same model

TARGETS = {"fp32": 1.25, "bf16": 1.25, "int8": 1.5}  # the bars: engine / torch, int8 / fp32


def _others_busy(seconds: float = 0.5) -> float:
    """Cores' worth of CPU the other processes used over ``seconds`` (from /proc/stat, less
    this process's own)."""

    def sample():
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
        with open("/proc/self/stat") as f:
            mine = f.read().rsplit(")", 1)[1].split()
        return busy, int(mine[11]) + int(mine[12])  # utime, stime

    (b0, m0), t0 = sample(), time.perf_counter()
    time.sleep(seconds)
    (b1, m1), t1 = sample(), time.perf_counter()
    hz = os.sysconf("SC_CLK_TCK")
    return max(0, (b1 - b0) - (m1 - m0)) / hz / (t1 - t0)


def _wait_quiet(limit: float) -> bool:
    """Wait at most ``limit`` seconds for the other processes to go quiet; whether they did."""
    deadline = time.monotonic() + limit
    while True:
        if _others_busy() < 0.05:
            return True
        if time.monotonic() >= deadline:
            return False


def _batch(args, step: int) -> torch.Tensor:
    return torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(1000 + step))


class _Torch:
    """Plain torch: the model (fp32, or bf16 with fp32 masters) and fused AdamW."""

    def __init__(self, model, dtype: torch.dtype, lr: float):
        self.model = copy.deepcopy(model).to(dtype)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if dtype == torch.float32:
            self.masters = self.params
        else:
            self.masters = [p.detach().float().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, fused=True)

    def step(self, ids) -> dict:
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        if self.masters is not self.params:  # mixed precision: the gradients into the masters, in backward's place
            for p, m in zip(self.params, self.masters):
                m.grad = p.grad.float()
                p.grad = None
        t0 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.masters is not self.params:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        return {"seconds": time.perf_counter() - t0}

    def close(self) -> None:
        pass


class _Engine:
    """The engine, placement device,device,cpu, the optimizer after backward."""

    def __init__(self, model, dtype: str, state_dtype: str, args):
        import infinity

        cfg = {"tiers": {"params": "device", "grads": "device", "optimizer": "cpu"},
               "precision": {"param_dtype": dtype},
               "optimizer": {"lr": args.lr, "overlap": False, "state_dtype": state_dtype,
                             "sub_group_size": args.sub_group_size}}  # fmt: skip
        self.engine = infinity.initialize(copy.deepcopy(model), cfg)

    def step(self, ids) -> dict:
        loss = self.engine(input_ids=ids, labels=ids).loss
        self.engine.backward(loss)
        t0 = time.perf_counter()
        self.engine.step()
        seconds = time.perf_counter() - t0
        st = self.engine.stats()["step"]
        return {"seconds": seconds, "optimizer_seconds": st.get("optimizer_seconds", 0.0),
                "update_seconds": st.get("update_seconds", 0.0),
                "bytes": {t: {"read": st[t]["read_bytes"], "write": st[t]["write_bytes"]} for t in ("device", "cpu")},
                "h2d_bytes": st["h2d_bytes"], "d2h_bytes": st["d2h_bytes"]}  # fmt: skip

    def close(self) -> None:
        self.engine.close()


def _sides(name: str, model, args):
    """The (A, B) of a comparison: A is measured against B."""
    if name in ("fp32", "bf16"):
        dtype = torch.float32 if name == "fp32" else torch.bfloat16
        return ("engine", lambda: _Engine(model, name, "fp32", args)), ("torch", lambda: _Torch(model, dtype, args.lr))
    if name == "int8":
        return ("int8", lambda: _Engine(model, "fp32", "int8", args)), ("fp32", lambda: _Engine(model, "fp32", "fp32", args))
    raise SystemExit(f"--compare: no comparison {name!r} (fp32, bf16, int8)")


def _compare(name: str, model, args) -> dict:
    (a_name, make_a), (b_name, make_b) = _sides(name, model, args)
    a, b = make_a(), make_b()
    pairs, busy = [], 0
    try:
        for step in range(args.pairs + 1):
            ids = _batch(args, step)
            quiet = _wait_quiet(args.quiet) if step and args.quiet > 0 else True
            pair = {a_name: a.step(ids), b_name: b.step(ids)}
            if step:  # the first pair warms up both (allocations, page faults, the pool)
                pairs.append(pair)
                busy += not quiet
        if args.profile and name == args.compare[0]:
            _profile(a if isinstance(a, _Engine) else b, _batch(args, args.pairs + 1))
    finally:
        a.close()
        b.close()
        del a, b
        gc.collect()
    ratios = [p[a_name]["seconds"] / p[b_name]["seconds"] for p in pairs]
    row = {"compare": name, "a": a_name, "b": b_name, "pairs": len(pairs),
           "a_seconds": statistics.median(p[a_name]["seconds"] for p in pairs),
           "b_seconds": statistics.median(p[b_name]["seconds"] for p in pairs),
           "ratio": statistics.median(ratios), "ratios": ratios, "target": TARGETS[name], "busy_pairs": busy}  # fmt: skip
    for side in (a_name, b_name):
        if "optimizer_seconds" in pairs[0][side]:
            row[f"{side}_optimizer_seconds"] = statistics.median(p[side]["optimizer_seconds"] for p in pairs)
            row[f"{side}_update_seconds"] = statistics.median(p[side]["update_seconds"] for p in pairs)
            row[f"{side}_bytes"] = pairs[-1][side]["bytes"]
            row[f"{side}_h2d_d2h_bytes"] = (pairs[-1][side]["h2d_bytes"], pairs[-1][side]["d2h_bytes"])
    return row


def _profile(side: "_Engine", ids) -> None:
    import cProfile
    import pstats

    loss = side.engine(input_ids=ids, labels=ids).loss
    side.engine.backward(loss)
    prof = cProfile.Profile()
    prof.enable()
    side.engine.step()
    prof.disable()
    pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--sub-group-size", default="128MiB")
    p.add_argument("--compare", default="fp32,bf16,int8", type=lambda s: s.split(","))
    p.add_argument("--quiet", type=float, default=60.0,
                   help="wait at most this many seconds before each pair for the machine to be quiet (0: never)")
    p.add_argument("--profile", action="store_true", help="cProfile one engine step (to stderr)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(args))
    n = sum(q.numel() for q in model.parameters())
    rows = []
    for name in args.compare:
        row = _compare(name, model, args)
        rows.append(row)
        if not args.json:
            spread = f"{min(row['ratios']):.3f}-{max(row['ratios']):.3f}"
            extra = "".join(f"; {s}: kernels {row[f'{s}_optimizer_seconds']:.3f} s, update {row[f'{s}_update_seconds']:.3f} s"
                            for s in (row["a"], row["b"]) if f"{s}_optimizer_seconds" in row)  # fmt: skip
            print(f"{name}: {row['a']} {row['a_seconds']:.3f} s, {row['b']} {row['b_seconds']:.3f} s, "
                  f"{row['a']}/{row['b']} {row['ratio']:.3f} (pairs {spread}; target {row['target']}; "
                  f"{row['busy_pairs']} pairs busy){extra}",
                  flush=True)  # fmt: skip
    summary = {"params": n, "threads": torch.get_num_threads(), "pairs": args.pairs, "rows": rows}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{n / 1e6:.1f}M parameters, {summary['threads']} threads, medians of {args.pairs} interleaved pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The billion-parameter step against plain PyTorch and against its floor. Not run by CI
(about 25 GB on disk, 16 GB of RAM for the plain side, tens of seconds a step).

Two worker processes train the same Llama-shaped model (``benchmarks/scale.py``'s: hidden
2048, 16 layers, intermediate 5632, vocab 32000; 953M parameters) on the same batches:

- plain: the whole model in RAM, fp32, ``torch.optim.AdamW(fused=True)``;
- infinity: params, grads and optimizer states all on nvme, fp32, loaded from the plain
  side's initial weights (``save_pretrained`` then ``infinity.from_pretrained``), so the two
  losses must agree step for step.

Steps are interleaved (plain, infinity, plain, infinity ...), one worker idle while the other
runs, and between pairs the drive's read and write throughput are measured (the engine's
uring backend, 1 MiB blocks, queue depth 32, as ``nvme-bench`` measures them). Reported, as
medians over the pairs (the first step of each side is a warm-up and not counted):

- infinity step / plain step;
- infinity step / floor, where floor = max(compute, I/O), compute = the plain side's forward
  + backward, I/O = bytes read ÷ read throughput + bytes written ÷ write throughput;
- the optimizer phase over its own I/O floor (the bytes ``engine.step()`` read and wrote, over
  the same throughputs), where the optimizer ran after backward (``--no-overlap``, or a budget
  below ``engine.overlap_from``; under backward, ``step()`` only commits). The throughputs are
  measured with the CPU idle; the step computes beside its I/O, and on this 2-core machine
  that alone slows the drive (benchmarks/io_under_compute.py);
- the phase split of both sides, backward / forward, and the largest loss difference;
- the infinity side's peak RSS growth, and the fp32 state (16 bytes a parameter) over it;
- the infinity side's arena (the swap files) over the state it holds on disk (``--overlap-disk``
  sets optimizer.overlap_disk, the staging the overlap may add: 0.3 by default).

    python benchmarks/scale_step.py [--pairs 3] [--dir bench-data/] [--host-budget 4GiB]
                                    [--tile-size 32MiB] [--sub-group-size 128MiB]
                                    [--aio-block-size 4MiB] [--aio-queue-depth 32] [--json]
                                    [--against plain|sequential] [--no-overlap] [--overlap-disk 0.3]
                                    [--state-dtype fp32|bf16|int8] [--tiers nvme,cpu,cpu]
                                    [--verify always|off] [--against verify-off]

``--tiers`` places the infinity side's params, grads and optimizer states (every one on nvme by
default). With grads and states in host memory each engine holds 16 bytes a parameter of RAM,
so against the sequential engine (two such processes) pick a model that fits twice, e.g.
``--hidden 1024 --layers 16 --intermediate 2816`` (0.27B parameters).

``--against keep-off`` runs the same engine with ``memory.keep_params = false`` as the other
side: the ratio is what keeping the parameters' buffers in the pool gains (kept / every
parameter read from the drive); each row also has the parameter bytes read and lent.

``--verify`` sets the infinity side's nvme.verify (``always``, the default: every swap read
checked against its checksum). ``--against verify-off`` runs the same engine with
``nvme.verify = "off"`` as the other side, interleaved as above: the ratio is then what checking
every read costs the step (the cost of verification, on / off). A tiny model checks the script
in seconds (``--hidden 128 --layers 2 --intermediate 256 --vocab 512 --pairs 1``; its figures
mean nothing).
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

from scale import add_model_args, llama_config, peak, reset_peak, rss  # this directory: the same model and RSS probes


def _batch(args, step: int):
    import torch

    return torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(1000 + step))


# -- the workers: one JSON line in ("step N" or "quit"), one JSON line out ---------------------
def _serve(run_step) -> None:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        print(json.dumps(run_step(int(cmd[1]))), flush=True)


def _plain_worker(args) -> None:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(args))
    model.save_pretrained(args.weights)  # the infinity side starts from these weights
    if args.save_only:
        return
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)

    def run_step(step: int) -> dict:
        ids = _batch(args, step)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return {"loss": loss.item(), "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0}

    _serve(run_step)


def _infinity_worker(args) -> None:
    import transformers

    import infinity

    transformers.logging.set_verbosity_error()
    params, grads, optimizer = args.tiers.split(",")
    tiers = {"tiers": {"params": params, "grads": grads, "optimizer": optimizer}, "nvme": {"paths": [args.swap]},
             "memory": {"host_budget": args.host_budget,
                            "tile_size": None if args.tile_size == "none" else args.tile_size},
             "optimizer": {"lr": args.lr, "sub_group_size": args.sub_group_size, "overlap": not args.no_overlap,
                           "state_dtype": args.state_dtype}}  # fmt: skip
    aio = {"block_size": args.aio_block_size, "queue_depth": args.aio_queue_depth}
    tiers["aio"] = {k: v for k, v in aio.items() if v is not None}  # the config's defaults where not given
    if args.overlap_disk is not None:
        tiers["optimizer"]["overlap_disk"] = args.overlap_disk
    if args.worker == "sequential":  # the same engine with the optimizer after backward
        tiers["optimizer"]["overlap"] = False
    tiers["nvme"]["verify"] = "off" if args.worker == "unverified" else args.verify
    tiers["memory"]["keep_params"] = args.worker != "unkept"  # the same engine reading every parameter
    base = rss()
    reset_peak()
    engine = infinity.from_pretrained(transformers.LlamaForCausalLM, args.weights, tiers)
    init_growth = peak() - base
    engine.module.train()  # as a training loop sets it (from_pretrained returns eval mode)

    def run_step(step: int) -> dict:
        ids = _batch(args, step)
        reset_peak()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        before = engine.stats()["total"]["nvme"]
        engine.step()
        t3 = time.perf_counter()
        after = engine.stats()["total"]["nvme"]
        st = engine.stats()["step"]
        disk = engine.stats()["disk"].values()
        return {"arena_bytes": sum(d["arena_bytes"] for d in disk), "disk_state_bytes": sum(d["state_bytes"] for d in disk),
                "loss": loss.item(), "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0,
                "read_bytes": st["nvme"]["read_bytes"], "write_bytes": st["nvme"]["write_bytes"],
                "param_read_bytes": st["nvme"]["by_kind"].get("param", {}).get("read_bytes", 0),
                "param_cache_bytes": st["param_cache_bytes"],
                "opt_read_bytes": after["read_bytes"] - before["read_bytes"],
                "opt_write_bytes": after["write_bytes"] - before["write_bytes"],
                "stall": st["stall_seconds"], "peak_growth": peak() - base, "init_growth": init_growth,
                "pool_peak": engine.stats()["peak_host_pool_bytes"],
                "params": sum(u.numel for u in engine.units), "sub_groups": len(engine.optimizer.groups),
                "committed_early": engine.overlap.committed if engine.overlap else 0,
                "overlap_budget": engine.overlap.staging.budget if engine.overlap else 0}  # fmt: skip

    try:
        _serve(run_step)
    finally:
        engine.close()


# -- the driver -------------------------------------------------------------------------------
class _Worker:
    def __init__(self, kind: str, argv: list[str]):
        self.kind = kind
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", kind, *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.kind} worker exited with {self.proc.wait()}")
        return json.loads(line)

    def step(self, n: int) -> dict:
        self.proc.stdin.write(f"step {n}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--host-budget", default="4GiB")
    p.add_argument("--sub-group-size", default="128MiB")
    p.add_argument("--tile-size", default="32MiB", help='memory.tile_size ("none": no tiles)')
    p.add_argument("--no-overlap", action="store_true", help="optimizer.overlap = false on the infinity side")
    p.add_argument("--overlap-disk", type=float, help="optimizer.overlap_disk of the infinity side (default: the "
                   "config's, 0.3; 0.8 or more stages every sub-group)")  # fmt: skip
    p.add_argument("--aio-block-size", help="aio.block_size of the engine (default: the config's; the floor's "
                   "throughput is always measured with 1MiB blocks at queue depth 32, as nvme-bench does)")
    p.add_argument("--aio-queue-depth", type=int, help="aio.queue_depth of the engine (default: the config's)")
    p.add_argument("--tiers", default="nvme,nvme,nvme",
                   help="params,grads,optimizer tiers of the infinity side(s), e.g. nvme,cpu,cpu: grads and "
                        "optimizer states in host memory (then 16 bytes a parameter of RAM each side)")  # fmt: skip
    p.add_argument("--state-dtype", default="fp32", choices=("fp32", "bf16", "int8"),
                   help="optimizer.state_dtype of the infinity side (plain stays fp32: the losses then differ by "
                        "the quantisation, and 'largest |loss difference|' is that, not exactness)")  # fmt: skip
    p.add_argument("--verify", choices=("always", "off"), default="always",
                   help="nvme.verify of the infinity side (default always: every swap read checked)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--against", choices=("plain", "sequential", "verify-off", "keep-off"), default="plain",
                   help="the other side: plain PyTorch in RAM (default), the engine with optimizer.overlap = false "
                        "(then the ratio is overlap on / off), the engine with nvme.verify = off (then the "
                        "ratio is verification on / off), or the engine with memory.keep_params = false (then "
                        "the ratio is parameters kept in the pool / every parameter read)")  # fmt: skip
    p.add_argument("--worker", choices=("plain", "infinity", "sequential", "unverified", "unkept"), help=argparse.SUPPRESS)
    p.add_argument("--save-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--weights", help=argparse.SUPPRESS)
    p.add_argument("--swap", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.worker == "plain":
        _plain_worker(args)
        return 0
    if args.worker in ("infinity", "sequential", "unverified", "unkept"):
        _infinity_worker(args)
        return 0
    from infinity.tools.nvme_bench import create_test_file, fill_test_file, open_runner

    def report(obj, text):
        print(json.dumps(obj) if args.json else text, flush=True)

    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="scale-step-", dir=args.dir)
    shared = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--json")]
    shared += ["--weights", os.path.join(work, "weights"), "--swap", os.path.join(work, "swap")]
    os.makedirs(os.path.join(work, "swap"))
    workers = []
    try:
        if args.against == "plain":
            plain = _Worker("plain", shared)  # saves the initial weights before it answers
        else:  # the weights first, then the other engine (no overlap, or no verify) on its own swap directory
            subprocess.run([sys.executable, __file__, "--worker", "plain", "--save-only", *shared], check=True)
            kind = {"sequential": "sequential", "verify-off": "unverified", "keep-off": "unkept"}[args.against]
            os.makedirs(os.path.join(work, f"swap-{kind}"))
            plain = _Worker(kind, [*shared, "--swap", os.path.join(work, f"swap-{kind}")])
        workers.append(plain)
        infinity_side = _Worker("infinity", shared)
        workers.append(infinity_side)
        bench_file = create_test_file(work)
        size = 1 << 30
        fill_test_file(bench_file, size)
        rows = []
        with open_runner("uring", bench_file, size, 1 << 20, 32) as run:
            for step in range(args.pairs + 1):
                a = plain.step(step)
                b = infinity_side.step(step)
                read_gbps, write_gbps = run("read"), run("write")
                if step == 0:
                    report({"type": "warmup", "plain": a, "infinity": b},
                           f"warm-up: {plain.kind} {a['step']:.1f}s, infinity {b['step']:.1f}s")  # fmt: skip
                    continue
                io = b["read_bytes"] / (read_gbps * 1e9) + b["write_bytes"] / (write_gbps * 1e9)
                opt_io = b["opt_read_bytes"] / (read_gbps * 1e9) + b["opt_write_bytes"] / (write_gbps * 1e9)
                # The model's compute: plain PyTorch's forward and backward (not measured against
                # the sequential engine: then the floor is the I/O alone).
                compute = a["forward"] + a["backward"] if args.against == "plain" else 0.0
                floor = max(compute, io)
                row = {"type": "pair", "pair": step, "plain": a, "infinity": b, "read_gbps": read_gbps,
                       "write_gbps": write_gbps, "io_s": io, "compute_s": compute, "floor_s": floor,
                       "vs_plain": b["step"] / a["step"], "vs_floor": b["step"] / floor, "opt_io_s": opt_io,
                       "opt_vs_io": b["optimizer"] / opt_io,
                       "loss_diff": abs(a["loss"] - b["loss"])}  # fmt: skip
                rows.append(row)
                report(row, f"pair {step}: {plain.kind} {a['step']:.1f}s (fwd {a['forward']:.1f} bwd {a['backward']:.1f} "
                            f"opt {a['optimizer']:.1f}), infinity {b['step']:.1f}s (fwd {b['forward']:.1f} "
                            f"bwd {b['backward']:.1f} opt {b['optimizer']:.1f}, {b['committed_early']}/{b['sub_groups']} sub-groups "
                            f"early, read {b['read_bytes'] / 1e9:.1f} GB, "
                            f"written {b['write_bytes'] / 1e9:.1f} GB); nvme {read_gbps:.2f}/{write_gbps:.2f} GB/s, "
                            f"floor {floor:.1f}s (compute {compute:.1f}, I/O {io:.1f}); infinity/plain "
                            f"{row['vs_plain']:.3f}, infinity/floor {row['vs_floor']:.3f}, optimizer/its I/O "
                            f"{row['opt_vs_io']:.3f}; |loss diff| "
                            f"{row['loss_diff']:.2e}")  # fmt: skip
        os.unlink(bench_file)

        def med(f):
            return statistics.median(f(r) for r in rows)

        params = rows[-1]["infinity"]["params"]
        step_growth = max(r["infinity"]["peak_growth"] for r in rows)
        init_growth = rows[-1]["infinity"]["init_growth"]
        growth = max(step_growth, init_growth)
        summary = {
            "type": "summary", "params": params, "pairs": len(rows),
            "vs_plain": med(lambda r: r["vs_plain"]), "vs_floor": med(lambda r: r["vs_floor"]),
            "opt_vs_io": med(lambda r: r["opt_vs_io"]),
            "infinity_bwd_over_fwd": med(lambda r: r["infinity"]["backward"] / r["infinity"]["forward"]),
            "plain_bwd_over_fwd": med(lambda r: r["plain"]["backward"] / r["plain"]["forward"]),
            "max_loss_diff": max(r["loss_diff"] for r in rows), "state_bytes": 16 * params, "peak_growth": growth,
            "state_over_rss": 16 * params / growth, "host_budget": args.host_budget, "tile_size": args.tile_size,
            "init_growth": init_growth, "step_growth": step_growth,
            "pool_peak": max(r["infinity"]["pool_peak"] for r in rows),
            "arena_over_state": max(r["infinity"]["arena_bytes"] for r in rows) / rows[-1]["infinity"]["disk_state_bytes"],
        }  # fmt: skip
        for side in ("plain", "infinity"):
            for phase in ("forward", "backward", "optimizer", "step"):
                summary[f"{side}_{phase}"] = med(lambda r, s=side, p=phase: r[s][p])
        early = max(r["infinity"]["committed_early"] for r in rows)
        if early:  # then engine.step() only commits: its phase is not the optimizer's work
            groups = rows[-1]["infinity"]["sub_groups"]
            opt_line = (f"optimizer / its I/O:      -       ({early} of {groups} sub-groups ran under backward; "
                        "--no-overlap measures the optimizer on its own)")  # fmt: skip
        else:
            opt_line = (f"optimizer / its I/O:      {summary['opt_vs_io']:.3f}   (target <= 1.15; its bytes over the "
                        "throughput measured with the CPU idle)")  # fmt: skip
        other = {"plain": "plain", "sequential": "off", "verify-off": "unverified", "keep-off": "unkept"}[args.against]
        ratio = {"plain": f"infinity / plain PyTorch: {summary['vs_plain']:.3f}   (target <= 0.9)",
                 "sequential": f"overlap on / off:         {summary['vs_plain']:.3f}",
                 "verify-off": f"verify always / off:      {summary['vs_plain']:.3f}   (target <= 1.03)",
                 "keep-off": f"params kept / read:       {summary['vs_plain']:.3f}   (parameter bytes read a step: "
                             f"{med(lambda r: r['infinity']['param_read_bytes']) / 1e9:.2f} GB against "
                             f"{med(lambda r: r['plain']['param_read_bytes']) / 1e9:.2f}; lent "
                             f"{med(lambda r: r['infinity']['param_cache_bytes']) / 1e9:.2f} GB)"}[args.against]  # fmt: skip
        report(summary, "\n".join([
            f"{params / 1e9:.3f}B parameters, {len(rows)} pairs (medians):",
            f"  {ratio}",
            f"  infinity / floor:         {summary['vs_floor']:.3f}   (target <= 1.15)",
            f"  {opt_line}",
            f"  {other:8} fwd {summary['plain_forward']:.1f}s bwd {summary['plain_backward']:.1f}s "
            f"opt {summary['plain_optimizer']:.1f}s step {summary['plain_step']:.1f}s",
            f"  infinity fwd {summary['infinity_forward']:.1f}s bwd {summary['infinity_backward']:.1f}s "
            f"opt {summary['infinity_optimizer']:.1f}s step {summary['infinity_step']:.1f}s",
            f"  backward / forward: infinity {summary['infinity_bwd_over_fwd']:.2f}, {other} "
            f"{summary['plain_bwd_over_fwd']:.2f}   (target <= 2.3)",
            f"  largest |loss difference|: {summary['max_loss_diff']:.2e}",
            f"  fp32 state {16 * params / 2**30:.1f} GiB / peak RSS growth {growth / 2**30:.2f} GiB = "
            f"{summary['state_over_rss']:.1f}x (host_budget {args.host_budget}, tile_size {args.tile_size}, pool peak "
            f"{summary['pool_peak'] / 2**30:.2f} GiB); the growth: {init_growth / 2**30:.2f} GiB by from_pretrained, "
            f"{step_growth / 2**30:.2f} GiB by the steps",
            f"  infinity's arena: {summary['arena_over_state']:.3f} x its state on disk at the most",
        ]))  # fmt: skip
    finally:
        for w in workers:
            w.close()
        shutil.rmtree(work, ignore_errors=True)  # our own directory only
    return 0


if __name__ == "__main__":
    sys.exit(main())

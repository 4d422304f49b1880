"""Offloaded against resident training on a GPU, over batch sizes and placements, in bf16.
Needs a CUDA device (scripts/gpu_check.sh runs it); not run by CI. ``--device cpu`` runs the
same code on the host, for a check of the script itself with a small model (its figures mean
nothing).

One process trains the same Llama-shaped model (``benchmarks/scale.py``'s; 953M parameters by
default) twice on the same batches:

- resident: the whole model on the GPU in fp32 under ``torch.autocast(bfloat16)``,
  ``torch.optim.AdamW(fused=True)`` (the usual mixed precision: bf16 compute, fp32 weights
  and states), which fits in the GPU's memory;
- infinity: ``infinity.from_pretrained`` of the resident side's initial weights, precision
  bf16, with each placement of ``--placements`` in turn (params,grads,optimizer; one engine at
  a time): the tiers the engine does not keep on the device are streamed in on a side stream
  just ahead of the layer that needs them (parameters) or copied back on another (gradients).

For each placement and each batch of ``--batches`` (BATCHxTOKENS), steps are interleaved
(resident, infinity, resident, infinity ...); the first pair is a warm-up. Reported, as medians
over the pairs: the tokens a second of both sides and their ratio, the model TFLOP/s of both
(6 N + 12 L h s FLOPs a token, N the parameters, L layers, h hidden, s sequence: PaLM's
accounting, no recomputation counted), the phase split, the H2D and D2H throughput of the
engine's copies (``engine.stats()["step"]["h2d_gbps"]``, ``["d2h_gbps"]``: bytes over the GPU
time of the copies, CUDA events) against the pinned-copy peak measured between the pairs (one
256 MiB pinned host buffer to the GPU; a pageable one for comparison), the bytes read from and
written to nvme a step, the drive's throughput between the pairs, the step's I/O floor, the
stall, and the largest loss difference (autocast and bf16 parameters round differently: a
sanity check, not a parity test; tests/infinity/test_gpu.py is that). A side that runs out of
device memory at a batch is reported so, and the placement's larger batches are skipped.
At the end, per placement: the smallest batch at which it reaches 0.8x the resident tokens a
second, and its ratio at the first batch where the resident step takes a second or more.
Each placement starts both sides again from the same initial weights.

    python benchmarks/gpu_step.py [--pairs 3] [--dir bench-data/] [--batches 1x64,4x512,16x2048]
        [--placements "device,device,cpu;device,device,nvme;nvme,cpu,cpu;nvme,nvme,nvme"]
        [--host-budget 4GiB] [--overlap auto|true|false] [--overlap-disk 1.0] [--checkpointing] [--json] [--profile DIR] [--device cuda|cpu]
        [--hidden 2048 --layers 16 --intermediate 5632 --vocab 32000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from scale import add_model_args, llama_config  # this directory: the same model

TARGET = 0.8  # of the resident tokens a second: the bar for "compute hides the traffic"


def _sync_time(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _copy_peak(nbytes: int = 256 << 20, repeats: int = 5) -> dict:
    """GB/s of one host-to-GPU copy of ``nbytes``, pinned and pageable (medians of ``repeats``)."""
    out = {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for kind, pinned in (("pinned", True), ("pageable", False)):
        host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
        times = []
        for _ in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dev.copy_(host, non_blocking=pinned)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[kind] = nbytes / statistics.median(times[1:]) / 1e9
        del host
    return out


def _parse_batches(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        try:
            b, t = item.lower().split("x")
            out.append((int(b), int(t)))
        except ValueError:
            raise SystemExit(f"gpu_step: --batches item {item!r} is not BATCHxTOKENS (e.g. 4x512)") from None
    return out


def _parse_placements(text: str) -> list[str]:
    out = []
    for item in text.split(";"):
        tiers = item.strip().split(",")
        if len(tiers) != 3 or any(t not in ("device", "cpu", "nvme") for t in tiers):
            raise SystemExit(f"gpu_step: --placements item {item!r} is not params,grads,optimizer "
                             "each device, cpu or nvme (e.g. nvme,cpu,cpu)")  # fmt: skip
        out.append(",".join(tiers))
    return out


def model_flops_per_token(cfg, n_params: int, tokens: int) -> float:
    """6 N + 12 L h s: the matmuls of forward and backward over the parameters, and attention's
    scores and weighted sum (PaLM, appendix B)."""
    return 6 * n_params + 12 * cfg.num_hidden_layers * cfg.hidden_size * tokens


def _oom_types():
    return (torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else (torch.cuda.OutOfMemoryError,)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--batches", default="1x64", help="BATCHxTOKENS,... (the default is the first H100 figure's)")
    p.add_argument("--placements", default="nvme,nvme,nvme", help="params,grads,optimizer;... of the infinity side")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--host-budget", default="4GiB")
    p.add_argument("--overlap", default="auto", choices=("auto", "true", "false"),
                   help="optimizer.overlap of the infinity side (backward with it on against off: run twice)")
    p.add_argument("--overlap-disk", type=float, default=1.0,
                   help="optimizer.overlap_disk: with nvme,cpu,cpu the state on nvme is the parameters alone, and "
                        "1.0 lets every sub-group's new parameters be written under backward")  # fmt: skip
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on both sides")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--json", action="store_true")
    p.add_argument("--profile", metavar="DIR", help="after each placement and batch, one more infinity step under "
                   "torch.profiler: its busiest operations to DIR/profile_PLACEMENT_BxS.txt, and the host's waits "
                   "on the GPU (synchronize and blocking-copy calls) counted in the row")  # fmt: skip
    args = p.parse_args(argv)
    batches, placements = _parse_batches(args.batches), _parse_placements(args.placements)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("gpu_step: torch sees no CUDA device here (--device cpu checks the script itself)", file=sys.stderr)
        return 2
    import transformers

    import infinity

    transformers.logging.set_verbosity_error()
    args.tokens = max(t for _, t in batches)  # the model's positions
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu-step-", dir=args.dir)
    engine = None
    closing = contextlib.ExitStack()  # the drive's test engine, closed before the directory goes
    try:
        torch.manual_seed(0)
        t = time.perf_counter()
        config = llama_config(args)
        model = transformers.LlamaForCausalLM(config)
        model.save_pretrained(os.path.join(work, "weights"))
        n_params = sum(p.numel() for p in model.parameters())
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}  # each placement starts here
        model.to(dev)
        if args.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = None
        where = torch.cuda.get_device_name(0) if dev == "cuda" else "the host"
        print(f"gpu_step: {n_params / 1e6:.0f}M parameters on {where}, built and saved in "
              f"{time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)  # fmt: skip

        def batch_of(shape, step):
            g = torch.Generator().manual_seed(1000 + step)
            return torch.randint(0, args.vocab, shape, generator=g).to(dev)

        def resident_step(shape, step):
            ids = batch_of(shape, step)
            t0 = _sync_time(dev)
            with torch.autocast(dev, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            t1 = _sync_time(dev)
            loss.backward()
            t2 = _sync_time(dev)
            opt[0].step()
            opt[0].zero_grad(set_to_none=True)
            t3 = _sync_time(dev)
            return {"loss": loss.item(), "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0}

        def infinity_step(shape, step):
            ids = batch_of(shape, step)
            t0 = _sync_time(dev)
            loss = engine(input_ids=ids, labels=ids).loss
            t1 = _sync_time(dev)
            engine.backward(loss)
            t2 = _sync_time(dev)
            engine.step()
            t3 = _sync_time(dev)
            st = engine.stats()["step"]
            return {"loss": loss.item(), "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0,
                    "h2d_bytes": st["h2d_bytes"], "h2d_gbps": st["h2d_gbps"], "d2h_bytes": st["d2h_bytes"],
                    "d2h_gbps": st["d2h_gbps"], "stall": st["stall_seconds"], "h2d_seconds": st["h2d_seconds"],
                    "d2h_seconds": st["d2h_seconds"], "host_optimizer": st["optimizer_seconds"],
                    "update": st["update_seconds"],
                    "read_bytes": st["nvme"]["read_bytes"], "write_bytes": st["nvme"]["write_bytes"],
                    "kept_for_backward": st["kept_for_backward"], "fetches": st["fetches"],
                    "param_cache_bytes": st["param_cache_bytes"], "nvme_by_kind": st["nvme"]["by_kind"]}  # fmt: skip

        run_drive = None
        if any("nvme" in pl for pl in placements):
            from infinity.aio import probe
            from infinity.tools.nvme_bench import create_test_file, fill_test_file, open_runner

            # The drive, between the pairs, as scale_step.py measures it (1 GiB file, 1 MiB blocks, qd 32).
            backend = "uring" if probe()["uring"].available else "threads"
            bench_file = create_test_file(work)
            fill_test_file(bench_file, 1 << 30)
            run_drive = closing.enter_context(open_runner(backend, bench_file, 1 << 30, 1 << 20, 32))

        rows = []
        for placement in placements:
            params, grads, optimizer = placement.split(",")
            swap = os.path.join(work, "swap")
            os.makedirs(swap)
            cfg = {"tiers": {"params": params, "grads": grads, "optimizer": optimizer}, "nvme": {"paths": [swap]},
                   "memory": {"host_budget": args.host_budget}, "precision": {"param_dtype": "bf16"},
                   "optimizer": {"lr": args.lr, "overlap_disk": args.overlap_disk,
                                 "overlap": {"true": True, "false": False}.get(args.overlap, args.overlap)}}  # fmt: skip
            model.load_state_dict(initial)  # both sides from the same weights, on the same batches
            opt = [torch.optim.AdamW(model.parameters(), lr=args.lr, fused=dev == "cuda")]
            t = time.perf_counter()
            engine = infinity.from_pretrained(transformers.LlamaForCausalLM, os.path.join(work, "weights"), cfg)
            # Training mode, as a training loop sets it: from_pretrained returns the model in eval
            # mode, where transformers skips gradient checkpointing (before this, the infinity
            # side of a --checkpointing run kept every activation and did not recompute).
            engine.module.train()
            if args.checkpointing:
                engine.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            print(f"gpu_step: from_pretrained into {placement} in {time.perf_counter() - t:.1f}s", file=sys.stderr,
                  flush=True)  # fmt: skip
            for b, s in batches:
                row = _measure(args, dev, (b, s), placement, resident_step, infinity_step, run_drive, engine, opt,
                               model_flops_per_token(config, n_params, s))  # fmt: skip
                if args.profile and "oom" not in row:
                    row["host_waits"] = _profile(args.profile, placement, (b, s), infinity_step)
                    resident_step((b, s), 10_000)  # the same batch on the other side: neither is a step ahead
                rows.append(row)
                print(json.dumps(row) if args.json else _line(row), flush=True)
                if "oom" in row:
                    break  # larger batches need more memory still
            engine.close()
            engine = None
            shutil.rmtree(swap)
        closing.close()

        summary = {"params": n_params, "device": where, "batches": args.batches, "pairs": args.pairs,
                   "checkpointing": args.checkpointing, "smallest_batch_at_target": {}}  # fmt: skip
        for placement in placements:
            hit = next((r["batch"] for r in rows if r["placement"] == placement and "oom" not in r
                        and r["tokens_per_s_ratio"] >= TARGET), None)  # fmt: skip
            summary["smallest_batch_at_target"][placement] = hit
            # The bar: at the first batch where the resident step takes a second or more.
            long = next((r for r in rows if r["placement"] == placement and "oom" not in r
                         and r["resident_step"] >= 1.0), None)  # fmt: skip
            summary.setdefault("ratio_where_resident_takes_1s", {})[placement] = (
                None if long is None else {"batch": long["batch"], "ratio": long["tokens_per_s_ratio"]})
        if not args.json:
            print(f"smallest batch at {TARGET}x the resident tokens/s: " + "; ".join(
                f"{pl}: {'x'.join(map(str, hit)) if hit else 'none of those run'}"
                for pl, hit in summary["smallest_batch_at_target"].items()), flush=True)  # fmt: skip
        print(json.dumps(summary), flush=True)
        return 0
    finally:
        closing.close()
        if engine is not None:
            engine.close()
        shutil.rmtree(work, ignore_errors=True)


def _measure(args, dev, shape, placement, resident_step, infinity_step, run_drive, engine, opt, flops_token) -> dict:
    """``args.pairs`` pairs (after a warm-up) of one batch shape; the medians."""
    b, s = shape
    tokens = b * s
    row = {"placement": placement, "batch": [b, s], "overlap": args.overlap}
    pairs = []
    for step in range(args.pairs + 1):
        try:
            r = resident_step(shape, step)
        except _oom_types():
            opt[0].zero_grad(set_to_none=True)
            _free(dev)
            row["oom"] = "resident"
            return row
        try:
            i = infinity_step(shape, step)
        except _oom_types():
            engine.zero_grad()
            _free(dev)
            row["oom"] = "infinity"
            return row
        pair = {"resident": r, "infinity": i}
        if dev == "cuda":
            pair["copy_peak"] = _copy_peak()
        if run_drive is not None and "nvme" in placement:
            pair["read_gbps"], pair["write_gbps"] = run_drive("read"), run_drive("write")
            io = i["read_bytes"] / (pair["read_gbps"] * 1e9) + i["write_bytes"] / (pair["write_gbps"] * 1e9)
            pair["floor"] = max(io, r["forward"] + r["backward"])
        if step:
            pairs.append(pair)

    def med(f):
        return statistics.median(f(q) for q in pairs)

    row.update({
        "resident_step": med(lambda q: q["resident"]["step"]), "infinity_step": med(lambda q: q["infinity"]["step"]),
        "resident_tokens_per_s": med(lambda q: tokens / q["resident"]["step"]),
        "infinity_tokens_per_s": med(lambda q: tokens / q["infinity"]["step"]),
        "tokens_per_s_ratio": med(lambda q: q["resident"]["step"] / q["infinity"]["step"]),
        "resident_tflops": med(lambda q: flops_token * tokens / q["resident"]["step"] / 1e12),
        "infinity_tflops": med(lambda q: flops_token * tokens / q["infinity"]["step"] / 1e12),
        "infinity_phases": {k: med(lambda q, k=k: q["infinity"][k]) for k in ("forward", "backward", "optimizer")},
        "resident_phases": {k: med(lambda q, k=k: q["resident"][k]) for k in ("forward", "backward", "optimizer")},
        "h2d_gbps": med(lambda q: q["infinity"]["h2d_gbps"]), "d2h_gbps": med(lambda q: q["infinity"]["d2h_gbps"]),
        "stall": med(lambda q: q["infinity"]["stall"]),
        # engine.stats(): the copies' bytes and GPU seconds, the host kernel's and the whole update's seconds
        "stats": {k: med(lambda q, k=k: q["infinity"][k]) for k in ("h2d_bytes", "h2d_seconds", "d2h_bytes",
                                                                   "d2h_seconds", "host_optimizer", "update")},
        "read_bytes": med(lambda q: q["infinity"]["read_bytes"]), "write_bytes": med(lambda q: q["infinity"]["write_bytes"]),
        "max_loss_diff": max(abs(q["infinity"]["loss"] - q["resident"]["loss"]) for q in pairs),
        # units fetched, and found kept from forward by backward (memory.device_budget: not read again)
        "fetches": med(lambda q: q["infinity"]["fetches"]),
        "kept_for_backward": med(lambda q: q["infinity"]["kept_for_backward"]),
        "device_budget_bytes": engine.stats()["device_budget_bytes"],
        # parameter bytes lent from buffers kept in the pool instead of read (memory.keep_params)
        "param_cache_bytes": med(lambda q: q["infinity"]["param_cache_bytes"]),
        # the last pair's nvme bytes by kind (param, grad, exp_avg, ...): what a B/param above 28 is
        "nvme_by_kind": pairs[-1]["infinity"]["nvme_by_kind"],
    })  # fmt: skip
    if dev == "cuda":
        row["pinned_peak_gbps"] = med(lambda q: q["copy_peak"]["pinned"])
        row["pageable_gbps"] = med(lambda q: q["copy_peak"]["pageable"])
        row["h2d_over_peak"] = med(lambda q: q["infinity"]["h2d_gbps"] / q["copy_peak"]["pinned"])
        row["peak_device_bytes_both_sides"] = torch.cuda.max_memory_allocated()
    if "floor" in pairs[0]:
        row["drive_read_gbps"] = med(lambda q: q["read_gbps"])
        row["drive_write_gbps"] = med(lambda q: q["write_gbps"])
        row["infinity_over_floor"] = med(lambda q: q["infinity"]["step"] / q["floor"])
    return row


# The host waiting for the GPU: what torch.cuda.set_sync_debug_mode flags, and event waits.
_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")


def _profile(out_dir: str, placement: str, shape, infinity_step) -> dict:
    """One infinity step under torch.profiler: the 40 operations with the most self CPU time to
    ``out_dir``, and how often and how long the host waited on the GPU (calls of `_WAITS`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        infinity_step(shape, 10_000)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    os.makedirs(out_dir, exist_ok=True)
    name = f"profile_{placement.replace(',', '-')}_{shape[0]}x{shape[1]}.txt"
    with open(os.path.join(out_dir, name), "w") as f:
        f.write(table)
    waits = {}
    for e in prof.key_averages():
        if e.key in _WAITS:
            waits[e.key] = {"calls": e.count, "seconds": e.cpu_time_total / 1e6}
    return waits


def _free(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.empty_cache()


def _line(row: dict) -> str:
    head = f"{row['placement']} {row['batch'][0]}x{row['batch'][1]}"
    if "oom" in row:
        return f"{head}: the {row['oom']} side ran out of device memory; larger batches skipped"
    out = (f"{head}: resident {row['resident_step']:.3f}s ({row['resident_tokens_per_s']:.0f} tok/s, "
           f"{row['resident_tflops']:.1f} TFLOP/s), infinity {row['infinity_step']:.3f}s "
           f"({row['infinity_tokens_per_s']:.0f} tok/s, {row['infinity_tflops']:.1f} TFLOP/s): "
           f"{row['tokens_per_s_ratio']:.2f}x resident; phases {row['infinity_phases']['forward']:.2f}/"
           f"{row['infinity_phases']['backward']:.2f}/{row['infinity_phases']['optimizer']:.2f}s, stall "
           f"{row['stall']:.2f}s; H2D {row['h2d_gbps']:.1f} GB/s, D2H {row['d2h_gbps']:.1f} GB/s")  # fmt: skip
    if "pinned_peak_gbps" in row:
        out += f" (pinned peak {row['pinned_peak_gbps']:.1f}, H2D {row['h2d_over_peak']:.2f}x of it)"
    if "infinity_over_floor" in row:
        out += (f"; nvme {row['read_bytes'] / 1e9:.2f} GB read, {row['write_bytes'] / 1e9:.2f} GB written, drive "
                f"{row['drive_read_gbps']:.2f}/{row['drive_write_gbps']:.2f} GB/s, {row['infinity_over_floor']:.2f}x "
                "the floor")  # fmt: skip
    return out + f"; loss diff {row['max_loss_diff']:.4f}"


if __name__ == "__main__":
    sys.exit(main())

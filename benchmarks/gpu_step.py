"""The billion-parameter step on a GPU, in bf16, against a resident PyTorch run. Needs a CUDA
device (scripts/gpu_check.sh runs it); not run by CI.

One process trains the same Llama-shaped model (``benchmarks/scale.py``'s; 953M parameters by
default) twice on the same batches:

- resident: the whole model on the GPU in fp32 under ``torch.autocast(bfloat16)``,
  ``torch.optim.AdamW(fused=True)`` (the usual mixed precision: bf16 compute, fp32 weights
  and states), which fits in the GPU's memory;
- infinity: ``infinity.from_pretrained`` of the resident side's initial weights, precision
  bf16, params, grads and optimizer states on nvme (``--tiers`` changes that): parameters
  are read from the drive into pinned pool buffers and copied to the GPU on a side stream
  just ahead of the layer that needs them.

Steps are interleaved (resident, infinity, resident, infinity ...); the first of each side is
a warm-up. Reported, as medians over the pairs: infinity step / resident step and the phase
split of both; the H2D throughput of the engine's parameter copies (bytes over the GPU time
of the copies, CUDA events: ``engine.stats()["step"]["h2d_gbps"]``) against the pinned-copy
peak, which is measured between the pairs (one 256 MiB pinned host buffer copied to the GPU;
a pageable one for comparison); the bytes read from and written to nvme a step, the stall,
and the largest loss difference (autocast and bf16 parameters round differently: this is a
sanity check, not a parity test; tests/infinity/test_gpu.py is that).

    python benchmarks/gpu_step.py [--pairs 3] [--dir bench-data/] [--batch 1] [--tokens 64]
                                  [--host-budget 4GiB] [--tiers nvme,nvme,nvme] [--json]
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


def _sync_time() -> float:
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


def _batch(args, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, args.vocab, (args.batch, args.tokens), generator=g).cuda()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--host-budget", default="4GiB")
    p.add_argument("--tiers", default="nvme,nvme,nvme", help="params,grads,optimizer of the infinity side")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_step: torch sees no CUDA device here", file=sys.stderr)
        return 2
    import transformers

    import infinity

    transformers.logging.set_verbosity_error()
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu-step-", dir=args.dir)
    engine = None
    closing = contextlib.ExitStack()  # the drive's test engine, closed before the directory goes
    try:
        torch.manual_seed(0)
        t = time.perf_counter()
        model = transformers.LlamaForCausalLM(llama_config(args))
        model.save_pretrained(os.path.join(work, "weights"))
        n_params = sum(p.numel() for p in model.parameters())
        model.cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
        print(f"gpu_step: {n_params / 1e6:.0f}M parameters on {torch.cuda.get_device_name(0)}, "
              f"built and saved in {time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)  # fmt: skip

        params, grads, optimizer = args.tiers.split(",")
        cfg = {"tiers": {"params": params, "grads": grads, "optimizer": optimizer},
               "nvme": {"paths": [os.path.join(work, "swap")]}, "memory": {"host_budget": args.host_budget},
               "precision": {"param_dtype": "bf16"}, "optimizer": {"lr": args.lr}}  # fmt: skip
        os.makedirs(cfg["nvme"]["paths"][0])
        t = time.perf_counter()
        engine = infinity.from_pretrained(transformers.LlamaForCausalLM, os.path.join(work, "weights"), cfg)
        print(f"gpu_step: from_pretrained into {args.tiers} in {time.perf_counter() - t:.1f}s", file=sys.stderr,
              flush=True)  # fmt: skip

        def resident_step(step):
            ids = _batch(args, step)
            t0 = _sync_time()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            t1 = _sync_time()
            loss.backward()
            t2 = _sync_time()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = _sync_time()
            return {"loss": loss.item(), "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0}

        def infinity_step(step):
            ids = _batch(args, step)
            t0 = _sync_time()
            loss = engine(input_ids=ids, labels=ids).loss
            t1 = _sync_time()
            engine.backward(loss)
            t2 = _sync_time()
            engine.step()
            t3 = _sync_time()
            st = engine.stats()["step"]
            return {"loss": loss.item(), "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0,
                    "h2d_bytes": st["h2d_bytes"], "h2d_gbps": st["h2d_gbps"], "stall": st["stall_seconds"],
                    "read_bytes": st["nvme"]["read_bytes"], "write_bytes": st["nvme"]["write_bytes"]}  # fmt: skip

        from infinity.aio import probe
        from infinity.tools.nvme_bench import create_test_file, fill_test_file, open_runner

        # The drive, between the pairs, as scale_step.py measures it (1 GiB file, 1 MiB blocks, qd 32).
        backend = "uring" if probe()["uring"].available else "threads"
        bench_file = create_test_file(cfg["nvme"]["paths"][0])
        fill_test_file(bench_file, 1 << 30)
        run_drive = closing.enter_context(open_runner(backend, bench_file, 1 << 30, 1 << 20, 32))
        pairs = []
        for step in range(args.pairs + 1):
            r = resident_step(step)
            i = infinity_step(step)
            peak = _copy_peak()
            read_gbps, write_gbps = run_drive("read"), run_drive("write")
            io = i["read_bytes"] / (read_gbps * 1e9) + i["write_bytes"] / (write_gbps * 1e9)
            floor = max(io, r["forward"] + r["backward"])
            pair = {"step": step, "resident": r, "infinity": i, "copy_peak": peak, "read_gbps": read_gbps,
                    "write_gbps": write_gbps, "floor": floor}  # fmt: skip
            print(json.dumps(pair) if args.json else
                  f"step {step}{' (warm-up)' if step == 0 else ''}: resident {r['step']:.3f}s "
                  f"({r['forward']:.3f}/{r['backward']:.3f}/{r['optimizer']:.3f}), infinity {i['step']:.2f}s "
                  f"({i['forward']:.2f}/{i['backward']:.2f}/{i['optimizer']:.2f}), loss {r['loss']:.4f} / "
                  f"{i['loss']:.4f}; H2D {i['h2d_bytes'] / 1e9:.2f} GB at {i['h2d_gbps']:.1f} GB/s, pinned peak "
                  f"{peak['pinned']:.1f} GB/s (pageable {peak['pageable']:.1f}); nvme read {i['read_bytes'] / 1e9:.1f} "
                  f"GB, written {i['write_bytes'] / 1e9:.1f} GB, stall {i['stall']:.2f}s; drive "
                  f"{read_gbps:.2f}/{write_gbps:.2f} GB/s ({backend}), floor {floor:.2f}s", flush=True)  # fmt: skip
            if step:
                pairs.append(pair)
        closing.close()
        os.unlink(bench_file)

        def med(f):
            return statistics.median(f(q) for q in pairs)

        summary = {
            "params": n_params, "device": torch.cuda.get_device_name(0), "batch": [args.batch, args.tokens],
            "tiers": args.tiers, "pairs": len(pairs),
            "infinity_over_resident": med(lambda q: q["infinity"]["step"] / q["resident"]["step"]),
            "infinity_over_floor": med(lambda q: q["infinity"]["step"] / q["floor"]),
            "drive_read_gbps": med(lambda q: q["read_gbps"]), "drive_write_gbps": med(lambda q: q["write_gbps"]),
            "resident_step": med(lambda q: q["resident"]["step"]), "infinity_step": med(lambda q: q["infinity"]["step"]),
            "infinity_phases": {k: med(lambda q, k=k: q["infinity"][k]) for k in ("forward", "backward", "optimizer")},
            "resident_phases": {k: med(lambda q, k=k: q["resident"][k]) for k in ("forward", "backward", "optimizer")},
            "h2d_gbps": med(lambda q: q["infinity"]["h2d_gbps"]),
            "pinned_peak_gbps": med(lambda q: q["copy_peak"]["pinned"]),
            "pageable_gbps": med(lambda q: q["copy_peak"]["pageable"]),
            "h2d_over_peak": med(lambda q: q["infinity"]["h2d_gbps"] / q["copy_peak"]["pinned"]),
            "max_loss_diff": max(abs(q["infinity"]["loss"] - q["resident"]["loss"]) for q in pairs),
            "peak_device_bytes_both_sides": torch.cuda.max_memory_allocated(),
        }  # fmt: skip
        print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()), flush=True)
        return 0
    finally:
        closing.close()
        if engine is not None:
            engine.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

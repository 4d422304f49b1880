"""The swap layer's cost: SwapSpace against the raw aio engine, and checksums against none.

Not run by CI. Writes then reads back ``--total`` bytes of tensors of mixed sizes (64 KiB to
256 MiB) through a SwapSpace, and the same bytes with the raw aio engine to the same extents
of the same arena files with the same engine settings, in interleaved pairs (swap, raw, swap,
raw, raw, swap ...) so that drift and order in the disk lands on both sides alike. Then the same with
verify="always" against verify="off". Reports each pair and the medians of the per-pair ratios.

    python benchmarks/swap_overhead.py [--dir bench-data/] [--total 2GiB] [--pairs 5] [--json]

Goals: the swap layer (placement, manifest, staging, checksums) costs at most 10% of the raw
engine's throughput, swap / raw >= 0.9, and checksumming every tensor costs at most 10% too,
verify="always" / "off" >= 0.9 (docs/formats.md describes the layout and the checksums).
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

from infinity import aio, swap
from infinity.tools.nvme_bench import format_size, parse_size

KiB, MiB = 1 << 10, 1 << 20
# (bytes, count) per GiB: from 64 KiB to 256 MiB, each size class holding about the same bytes.
MIX = [(256 * MiB, 2), (128 * MiB, 2), (64 * MiB, 2), (16 * MiB, 4), (4 * MiB, 8), (1 * MiB, 16),
       (256 * KiB, 32), (64 * KiB, 64)]  # fmt: skip


def sizes_for(total: int) -> list[int]:
    per_gib = sum(n * c for n, c in MIX)
    scale = max(1, round(total / per_gib))
    return [n for n, c in MIX for _ in range(c * scale)]


def swap_pass(space: swap.SwapSpace, tensors: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(write GB/s, read GB/s) of all tensors through the space: submit all, then wait all."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    start = time.perf_counter()
    for fut in [space.put(name, t) for name, t in tensors.items()]:
        fut.result()
    wrote = time.perf_counter()
    for fut in [space.get(name, t) for name, t in tensors.items()]:
        fut.result()
    read = time.perf_counter()
    return nbytes / (wrote - start) / 1e9, nbytes / (read - wrote) / 1e9


def raw_pass(engine: aio.Engine, files: list[aio.File], placed: dict[str, tuple], tensors) -> tuple[float, float]:
    """The same bytes to the same extents with the engine alone."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    views = {name: t.reshape(-1).view(torch.uint8) for name, t in tensors.items()}

    def run(op):
        futures = []
        for name, extents in placed.items():
            pos = 0
            for e in extents:
                futures.append(op(views[name][pos : pos + e.nbytes], files[e.file], e.offset))
                pos += e.nbytes
        for fut in futures:
            fut.result()

    start = time.perf_counter()
    run(engine.pwrite)
    wrote = time.perf_counter()
    run(engine.pread)
    read = time.perf_counter()
    return nbytes / (wrote - start) / 1e9, nbytes / (read - wrote) / 1e9


def pairs(label_a: str, a, label_b: str, b, n: int, out) -> dict:
    rows = []
    for i in range(n):
        if i % 2 == 0:  # alternate which side goes first, so order effects cancel too
            wa, ra = a()
            wb, rb = b()
        else:
            wb, rb = b()
            wa, ra = a()
        rows.append((wa, ra, wb, rb))
        out(dict(type="pair", a=label_a, b=label_b, pair=i + 1, write=[wa, wb], read=[ra, rb]),
            f"pair {i + 1}/{n}: {label_a} write {wa:.2f} read {ra:.2f} GB/s | "
            f"{label_b} write {wb:.2f} read {rb:.2f} GB/s | ratios write {wa / wb:.2f} read {ra / rb:.2f}")  # fmt: skip
    med = statistics.median
    summary = dict(
        write_ratio=med(r[0] / r[2] for r in rows), read_ratio=med(r[1] / r[3] for r in rows),
        both_ratio=med((r[0] * r[1] / (r[0] + r[1])) / (r[2] * r[3] / (r[2] + r[3])) for r in rows),
        a_write=med(r[0] for r in rows), a_read=med(r[1] for r in rows),
        b_write=med(r[2] for r in rows), b_read=med(r[3] for r in rows),
    )  # fmt: skip
    out(dict(type="summary", a=label_a, b=label_b, pairs=n, **summary),
        f"{label_a} / {label_b}: write {summary['write_ratio']:.3f}, read {summary['read_ratio']:.3f}, "
        f"write+read {summary['both_ratio']:.3f} (medians of {n} pairs; {label_a} write "
        f"{summary['a_write']:.2f} read {summary['a_read']:.2f} GB/s, {label_b} write "
        f"{summary['b_write']:.2f} read {summary['b_read']:.2f} GB/s)")  # fmt: skip
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=str(Path(__file__).resolve().parent.parent / "bench-data"))
    p.add_argument("--total", default="2GiB", help="bytes of tensors (default 2GiB)")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    def out(obj, text):
        print(json.dumps(obj) if args.json else text, flush=True)

    out(dict(type="command", command=shlex.join(sys.orig_argv)), f"$ {shlex.join(sys.orig_argv)}")
    os.makedirs(args.dir, exist_ok=True)
    sizes = sizes_for(parse_size(args.total))
    out(dict(type="setting", tensors=len(sizes), bytes=sum(sizes)),
        f"{len(sizes)} tensors, {format_size(sum(sizes))}, from {format_size(min(sizes))} to {format_size(max(sizes))}")  # fmt: skip
    # Source tensors in aligned host memory, as the engine's swappers hold them (pool buffers).
    tensors = {}
    for i, n in enumerate(sizes):
        t = aio.empty_aligned(n).view(torch.float32)
        t.uniform_()
        tensors[f"t{i:04d}/param"] = t
    workdir = tempfile.mkdtemp(prefix="swap-overhead-", dir=args.dir)
    try:
        engine = aio.open_engine()
        spaces = {}
        for verify in ("off", "always"):
            d = os.path.join(workdir, verify)
            os.makedirs(d)
            spaces[verify] = swap.SwapSpace([d], engine=engine, verify=verify, grow_step=1 << 30)
            swap_pass(spaces[verify], tensors)  # places every tensor and preallocates the arena
        space = spaces["off"]
        placed = {name: space.info(name).extents for name in tensors}
        files = space.files  # the very arena files the space uses
        out({}, "") if not args.json else None
        out(dict(type="section", name="swap vs raw"), "SwapSpace (verify=off) against the raw aio engine, same extents:")
        s1 = pairs("swap", lambda: swap_pass(space, tensors), "raw", lambda: raw_pass(engine, files, placed, tensors),
                   args.pairs, out)  # fmt: skip
        out(dict(type="section", name="always vs off"), 'SwapSpace verify="always" against verify="off":')
        s2 = pairs("always", lambda: swap_pass(spaces["always"], tensors), "off", lambda: swap_pass(space, tensors),
                   args.pairs, out)  # fmt: skip
        for s in spaces.values():
            s.close()
        engine.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # our own temporary directory only
    ok = min(s1["write_ratio"], s1["read_ratio"], s2["write_ratio"], s2["read_ratio"]) >= 0.9
    out(dict(type="goal", met=ok), f"goal (every ratio >= 0.9): {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

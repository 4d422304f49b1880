"""The int8 codec of compact optimizer states: the C++ one (``infinity._compact_native``)
against the torch reference (``infinity._compact``'s torch ops), interleaved. Not run by CI.

Encodes and decodes one moment of ``--elements`` values (exp_avg-like: signed; exp_avg_sq-like:
unsigned, magnitudes over ten decades) with each side in turn (torch, native, torch, native
...), and reports per side the median nanoseconds an element and the median of the pairs'
ratios torch / native; beside them, ``torch._fused_adamw_`` on as many elements, the kernel the
codec runs around. The two sides' bytes are checked equal on every pair. Then the one-pass int8
AdamW update (`infinity._adam_int8`) of as many elements as one unit against
``torch._fused_adamw_`` over fp32 states, interleaved, with each instruction set the CPU has
(scalar, AVX2, AVX-512): the kernel's share of ``benchmarks/host_step.py --compare int8``.

    python benchmarks/codec.py [--elements 33554432] [--pairs 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from infinity import _compact


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=32 << 20)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if _compact._native_codec(True) is None:
        raise SystemExit("infinity._compact_native is not built: reinstall the package with a C++ compiler")
    n = args.elements
    g = torch.Generator().manual_seed(0)
    values = {True: torch.randn(n, generator=g) * 1e-3,
              False: torch.rand(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 10 - 9)}  # fmt: skip
    codes = {side: torch.empty(n, dtype=torch.uint8) for side in ("torch", "native")}
    scales = {side: torch.empty(_compact.blocks(n)) for side in ("torch", "native")}
    out = torch.empty(n)
    times = {(side, op, signed): [] for side in ("torch", "native") for op in ("encode", "decode") for signed in (True, False)}
    try:
        for _ in range(args.pairs):
            for signed, x in values.items():
                for side in ("torch", "native"):
                    _compact.NATIVE = side == "native"
                    times[(side, "encode", signed)].append(
                        _timed(lambda: _compact.encode_int8(x, codes[side], scales[side], signed)))
                    times[(side, "decode", signed)].append(
                        _timed(lambda: _compact.decode_int8(codes[side], scales[side], signed, out)))
                if not (torch.equal(codes["torch"], codes["native"]) and torch.equal(scales["torch"], scales["native"])):
                    raise SystemExit("the two codecs gave different bytes: a bug (tests/infinity/test_compact.py)")
    finally:
        _compact.NATIVE = True
    w, m = (torch.randn(n, generator=g) for _ in range(2))
    grad, sq = torch.randn(n, generator=g), torch.rand(n, generator=g)
    step = torch.tensor(5.0)
    adamw = [_timed(lambda: torch._fused_adamw_([w], [grad], [m], [sq], [], [step], lr=1e-4, beta1=0.9, beta2=0.999,
                                                weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False))
             for _ in range(args.pairs)]  # fmt: skip
    one_pass = _one_pass(n, args.pairs, g)
    rows = []
    for op in ("encode", "decode"):
        for signed in (True, False):
            a, b = times[("torch", op, signed)], times[("native", op, signed)]
            rows.append({"op": op, "map": "signed" if signed else "unsigned",
                         "torch_ns": statistics.median(a) / n * 1e9, "native_ns": statistics.median(b) / n * 1e9,
                         "torch_over_native": statistics.median(x / y for x, y in zip(a, b))})  # fmt: skip
    summary = {"elements": n, "pairs": args.pairs, "threads": torch.get_num_threads(), "rows": rows,
               "fused_adamw_ns": statistics.median(adamw) / n * 1e9, "one_pass": one_pass}  # fmt: skip
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{n} elements, {args.pairs} pairs (medians), {summary['threads']} threads:")
    for r in rows:
        print(f"  {r['op']} ({r['map']:8}): torch {r['torch_ns']:5.2f} ns/element, native {r['native_ns']:5.2f}; "
              f"torch / native {r['torch_over_native']:.1f}")
    print(f"  torch._fused_adamw_ beside them: {summary['fused_adamw_ns']:.2f} ns/element")
    for isa, r in one_pass.items():
        print(f"  one-pass int8 AdamW ({isa}): {r['ns']:.2f} ns/element, torch._fused_adamw_ on fp32 states "
              f"{r['fp32_ns']:.2f}; int8 / fp32 {r['ratio']:.2f} (pairs {r['low']:.2f}-{r['high']:.2f})")
    return 0


def _one_pass(n: int, pairs: int, g) -> dict:
    """The one-pass int8 AdamW update of ``n`` elements as one unit (``_compact_native.adam_int8``,
    infinity/csrc/adam_int8.h) against ``torch._fused_adamw_`` over as many fp32 states,
    interleaved, for each instruction set this CPU has: {isa: ns an element, the ratio}."""
    native = _compact.native_module()
    signed, unsigned = _compact._native_codec(True), _compact._native_codec(False)
    w, grad = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
    m, sq = torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-6
    states = []
    for x, is_signed in ((m, True), (sq, False)):
        codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(_compact.blocks(n))
        _compact.encode_int8(x, codes, scales, is_signed)
        states += [codes, scales]
    segment = [(0, n, grad.data_ptr(), 1e-4, 0.9, 0.999, 1e-8, 0.01, 5.0)]
    step, threads, best = torch.tensor(5.0), torch.get_num_threads(), native.isa()
    out = {}
    try:
        for isa in ("scalar", "avx2", "avx512", "avx512vbmi"):
            if native.set_isa(isa) != isa:
                continue
            ours, theirs = [], []
            for _ in range(pairs + 1):  # the first pair a warm-up
                ours.append(_timed(lambda: native.adam_int8(signed, unsigned, w.data_ptr(), *(t.data_ptr() for t in states),
                                                            n, _compact.BLOCK, segment, True, None, threads)))  # fmt: skip
                theirs.append(_timed(lambda: torch._fused_adamw_([w], [grad], [m], [sq], [], [step], lr=1e-4, beta1=0.9,
                                                                 beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
                                                                 maximize=False)))  # fmt: skip
            ratios = [a / b for a, b in zip(ours[1:], theirs[1:])]
            out[isa] = {"ns": statistics.median(ours[1:]) / n * 1e9, "fp32_ns": statistics.median(theirs[1:]) / n * 1e9,
                        "ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}  # fmt: skip
    finally:
        native.set_isa(best)
    return out


if __name__ == "__main__":
    raise SystemExit(main())

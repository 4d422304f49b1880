"""The one-pass Adam / AdamW update of int8 moments (``[optimizer] state_dtype = "int8"``).

Owns: when a sub-group's Adam update runs in one pass over its int8 states
(``infinity._compact_native.adam_int8``, infinity/csrc/adam_int8.h) instead of decoding both
moments to fp32 temporaries, running torch's fused kernel and encoding them back
(`_compact.Codec.unpacked`), and the call itself: per unit that steps, its part of the
sub-group's master weights, codes and scales, and one segment per parameter with its group's
hyperparameters. Touches: only the tensors it is handed.

The three passes cost 8x the fp32 step (106M Llama, 2 cores: 0.75 s against 0.091;
benchmarks/host_step.py, int8 against fp32), the encode most of it; here a unit's part goes by
tiles of a block that stay in the core's cache, both moments decoded, updated and encoded while
there, with AVX-512 or AVX2 where the CPU has them, and a sub-group's units in one call on
OpenMP's threads (1.30-2.17x the fp32 step, whose time moves with the machine's memory load;
docs/architecture.md has the figures). The arithmetic is that of torch's vectorised fused Adam
(infinity/csrc/adam_int8.h says how), so where torch's vector loop covers an element both give
the same bits (tests/infinity/test_adam_int8.py), and every element takes it, so the result
does not depend on where units, sub-groups or shards cut the parameters.

Where the extension was not built, or a tensor is not a contiguous fp32 host tensor, the
update takes the three passes (`served` says which): the same codes up to torch's own rounding
of the last elements of each parameter (its scalar loop).
"""

from __future__ import annotations

import torch

from . import _compact


def served(master: torch.Tensor, states: list[torch.Tensor], grads: dict[int, torch.Tensor]) -> bool:
    """Whether the one-pass update can run on these tensors: the extension built and every
    tensor a contiguous host tensor of the dtype it takes."""
    if not _compact.NATIVE or _compact.native_module() is None:
        return False
    want = (torch.float32, torch.uint8, torch.float32, torch.uint8, torch.float32)
    tensors = (master, *states)
    if len(tensors) != len(want) or any(t.dtype != d for t, d in zip(tensors, want)):
        return False
    return all(t.device.type == "cpu" and t.is_contiguous() and t.dtype == torch.float32
               for t in grads.values()) and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)  # fmt: skip


def update(master: torch.Tensor, states: list[torch.Tensor], slices: dict[int, slice], per_group: dict[int, list],
           param_groups: list[dict], grads: dict[int, torch.Tensor], steps: dict, grad_scale, adamw: bool) -> None:  # fmt: skip
    """One Adam (``adamw``: AdamW) update in place of a sub-group's ``master`` weights and int8
    ``states`` (exp_avg's codes and scales, exp_avg_sq's) for the units in ``grads`` (unit ->
    its gradient shard, fp32). ``slices``: unit -> its part of the sub-group; ``per_group``:
    parameter group -> entries (unit, slice of the sub-group, slice of the unit's gradient,
    parameter index); ``steps``: unit -> its step count (this update's); ``grad_scale``: what
    the gradients are divided by (a one-element tensor) or None."""
    native = _compact.native_module()
    signed, unsigned = _compact._native_codec(True), _compact._native_codec(False)
    m_codes, m_scales, v_codes, v_scales = states
    bslices = _compact.block_slices(slices)
    segments: dict[int, list] = {i: [] for i in grads}
    for gi, entries in per_group.items():
        hp = param_groups[gi]
        beta1, beta2 = (float(b) for b in hp["betas"])
        for u, s, gs, _ in entries:
            if u.index not in grads:
                continue
            base = slices[u.index].start
            grad = grads[u.index][gs]
            segments[u.index].append((s.start - base, s.stop - s.start, grad.data_ptr(), float(hp["lr"]), beta1, beta2,
                                      float(hp["eps"]), float(hp["weight_decay"]), float(steps[u.index])))  # fmt: skip
    scale = None if grad_scale is None else float(grad_scale)
    units = []
    for i, segs in segments.items():
        s, bs = slices[i], bslices[i]
        segs.sort()
        units.append((master[s].data_ptr(), m_codes[s].data_ptr(), m_scales[bs].data_ptr(), v_codes[s].data_ptr(),
                      v_scales[bs].data_ptr(), s.stop - s.start, segs))  # fmt: skip
    # one call for the sub-group: its threads start once and share the units' tiles
    native.adam_int8_units(signed, unsigned, units, _compact.BLOCK, adamw, scale, torch.get_num_threads())

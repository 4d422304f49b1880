"""Compact optimizer states: the codecs of ``[optimizer] state_dtype`` "bf16" and "int8".

Owns: how a moment (AdamW's exp_avg and exp_avg_sq, SGD's momentum buffer, Adagrad's sum) is
stored when it is not fp32, and the conversions between that and fp32: `encode` / `decode`
of one unit's part of a sub-group's flat state, the 8-bit code maps (`code_map`), bf16's
stochastic rounding, and `unpacked`, which gives the fp32 kernels fp32 temporaries of a
sub-group's compact moments and writes them back compact. Touches: only the tensors it is
handed (the stream's pool buffers, which it changes in place).

The int8 codec runs in C++ (``infinity._compact_native``, built from infinity/csrc/codec.h and
compact.cpp with the package, with AVX-512 or AVX2 where the CPU has them) where it was built,
and as torch ops (`_encode_blocks`, `_decode_blocks`, the reference) where not: the same bytes
either way (tests/infinity/test_compact.py), the C++ one about 24x faster to encode (1.2 ns an
element against 30 on these 2 cores over 8M elements; bucketize's binary search is the torch
cost) and 8x to decode (benchmarks/codec.py).

The fused kernels (`torch._fused_adamw_`, ...) take fp32 states only, so an update (but Adam's
and AdamW's with int8 states, which `_adam_int8` runs in one pass) decodes the moments of the
units that step to fp32, runs the same kernel as with fp32 states, and encodes
them back; the fp32 master weights are never compact. The temporaries (4 bytes per element per
moment of the largest sub-group) are plain host memory beside the pool, not pool buffers, kept
by the codec from one sub-group and one step to the next: made afresh for each sub-group, their
first touch (page faults, the kernel zeroing each page) took two thirds of the decode, 0.033 s
of 0.049 for 22M elements on these 2 cores (the decode itself 0.016).

One call of the codec per unit part: spreading a sub-group's parts in pieces of 256K elements
over worker threads (one per core; the C++ codec releases the GIL) measured slower here than
the C++ codec's own threads on parts of 1M elements or more (0.233 s against 0.211 for a
layer's and an embedding's sub-groups of the 106M Llama, 7 interleaved runs): the two cores
of this machine gave the codec 1.3x at best, less than the pieces cost.

[Note: compact state format]
A compact moment ``m`` of a sub-group is stored as the kind ``m`` itself (its codes) and, for
int8, the kind ``m.scale`` (one fp32 scale per block):

- "bf16": ``m`` is bfloat16, one per element. Updates round the fp32 result to bf16
  stochastically (`round_bf16`): the moments are exponential averages whose step-to-step change
  (1 - beta2 = 0.001 of exp_avg_sq) is smaller than half a bf16 ulp (2^-9 relative), which
  round-to-nearest would drop every step, freezing the average; stochastic rounding keeps it
  unbiased (E[round(x)] = x), as torchao's bf16 optimizers do for bf16 weights. The random bits
  come from a generator seeded by (unit, its shard's start, its step count, kind), never from
  the global RNG, so an update is the same whenever it runs (under backward or at the step).
  Initial values and checkpoint loads round to nearest (a one-off conversion: least error).
- "int8": ``m`` is uint8, one code per element, and ``m.scale`` is float32. Blocks of `BLOCK`
  (256) elements run over each unit's part of the sub-group's flat tensor from its first
  element; a unit's last block may be shorter. So the sub-group's ``m.scale`` holds
  ``sum(ceil(n_u / 256))`` elements over its units' parts ``n_u`` (a unit alone:
  ``ceil(n / 256)``), the units' scales end to end in unit order. Blocks never straddle two
  units: a unit that does not step this step keeps its codes and scales byte for byte, and a
  unit's compact state is a contiguous run of both tensors. A block's scale is its element of
  largest magnitude, with its sign (the first such in the block); each element is
  ``x / scale`` mapped to the nearest value of the 256-entry dynamic (tree) quantisation map
  of Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (arXiv:2110.02861), as
  bitsandbytes' and torchao's 8-bit Adam use it: the signed map for moments that may be
  negative (exp_avg, momentum_buffer), the unsigned one for those that may not (exp_avg_sq,
  sum). The code is the value's index in the sorted map; the value is ``map[code] * scale``.
  The signed scale is the one difference from those libraries (they divide by the absolute
  maximum): the signed map holds +1 but not -1, so a block whose extreme is negative loses
  0.7% on it there; here the extreme maps to +1 exactly whatever its sign, and decode then
  encode is the identity (the decoded block has the same extreme, every element the same
  code), which the checkpoint round trip relies on (tests/infinity/test_compact.py).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .config import STATE_DTYPES  # the choices of [optimizer] state_dtype: "fp32" and this module's

BLOCK = 256  # elements per int8 block (bitsandbytes' and torchao's 8-bit Adam default)
# Whether the int8 codec runs in C++ where it was built (`_native_codec`); tests turn it off to
# hold the torch reference and the native code to the same bytes.
NATIVE = True
SCALE = ".scale"  # an int8 moment's scales are the kind "<moment>.scale"


def blocks(n: int) -> int:
    """Scales of an int8 moment of ``n`` elements of one unit: ``ceil(n / BLOCK)``."""
    return -(-n // BLOCK)


def block_slices(slices: dict[int, slice]) -> dict[int, slice]:
    """Each unit's part of a sub-group's scales, from its part of the flat state (``slices``:
    unit index -> slice, in the sub-group's order)."""
    out, pos = {}, 0
    for i, s in slices.items():
        n = blocks(s.stop - s.start)
        out[i] = slice(pos, pos + n)
        pos += n
    return out


@functools.cache
def code_map(signed: bool, device: str = "cpu") -> torch.Tensor:
    """The 256 values of the dynamic quantisation map, ascending (float32): 0, 1, and for each
    decade i = 0..6 the midpoints of ``2^i`` (signed: with their negatives) or ``2^(i+1)``
    (unsigned) equal intervals of [0.1, 1] scaled by 10^(i-6): more codes near a block's
    extreme, down to 1e-7 of it, as [Note: compact state format]."""
    values = [0.0, 1.0]
    for i in range(7):
        n = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float32)
        mids = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        values += mids + ([-v for v in mids] if signed else [])
    table = torch.tensor(sorted(values), dtype=torch.float32, device=device)
    if table.numel() != 256:
        raise RuntimeError(f"the {'signed' if signed else 'unsigned'} code map has {table.numel()} values, not 256")
    return table


@functools.cache
def _boundaries(signed: bool, device: str = "cpu") -> torch.Tensor:
    """The 255 midpoints between neighbouring map values: a value's code is how many lie below it."""
    table = code_map(signed, device)
    return (table[:-1] + table[1:]) / 2


def _encode_blocks(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> None:
    """``x`` (rows of one block each, fp32) into ``codes`` (uint8, same shape) and ``scales``
    (one per row)."""
    scale = x.gather(1, x.abs().argmax(1, keepdim=True))  # the extreme, signed
    scales.copy_(scale.view(-1))
    normal = x / torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero block: all code 0.0
    dev = str(x.device)
    codes.copy_(torch.bucketize(normal, _boundaries(signed, dev), out_int32=True))


def _decode_blocks(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> None:
    """Rows of codes and their scales into ``out`` (fp32 rows)."""
    table = code_map(signed, str(codes.device))
    torch.index_select(table, 0, codes.reshape(-1).to(torch.int32), out=out.reshape(-1))
    out.mul_(scales.view(-1, 1))


def _by_blocks(fn, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> None:
    """``fn(x rows, codes rows, scales, signed)`` over the whole blocks of one unit's part, then
    over its shorter last block."""
    n = x.numel()
    whole = n // BLOCK * BLOCK
    if whole:
        fn(*_rows(x, codes, whole, BLOCK), scales[: whole // BLOCK], signed)
    if whole < n:
        fn(*_rows(x, codes, n, n - whole, whole), scales[whole // BLOCK :], signed)


def _rows(x, codes, stop, width, start=0):
    return x[start:stop].view(-1, width), codes[start:stop].view(-1, width)


@functools.cache
def native_module():
    """``infinity._compact_native``, or None where the extension was not built."""
    try:
        from . import _compact_native
    except ImportError:
        return None
    return _compact_native


@functools.cache
def _native_codec(signed: bool):
    """The C++ codec (``infinity._compact_native``) for this map, or None where the extension
    was not built: it computes the same bytes as the torch ops above, about 20x faster."""
    native = native_module()
    if native is None:
        return None
    return native.Codec(_boundaries(signed).tolist(), code_map(signed).tolist())


def _native_for(signed: bool, *tensors: torch.Tensor):
    """The native codec where it can serve these tensors (host, contiguous), else None."""
    if not NATIVE or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None
    return _native_codec(signed)


def _check(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    n = x.numel()
    if x.dtype != torch.float32 or codes.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise TypeError(f"int8 codec: values {x.dtype}, codes {codes.dtype}, scales {scales.dtype}; "
                        "wants float32, uint8, float32")  # fmt: skip
    if codes.numel() != n or scales.numel() != blocks(n):
        raise ValueError(f"int8 codec: {n} values want {n} codes and {blocks(n)} scales, "
                         f"got {codes.numel()} and {scales.numel()}")  # fmt: skip


def encode_int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> None:
    """One unit's part ``x`` (1-D, fp32) into ``codes`` (uint8, as many) and ``scales``
    (``blocks(x.numel())``, fp32)."""
    _check(x, codes, scales)
    native = _native_for(signed, x, codes, scales)
    if native is not None:
        native_module().encode(native, x.data_ptr(), codes.data_ptr(), scales.data_ptr(), x.numel(), BLOCK,
                               torch.get_num_threads())
    else:
        _by_blocks(_encode_blocks, x, codes, scales, signed)


def decode_int8(codes: torch.Tensor, scales: torch.Tensor, signed: bool, out: torch.Tensor) -> None:
    """One unit's part of an int8 moment into ``out`` (1-D, fp32, as many elements)."""
    _check(out, codes, scales)
    native = _native_for(signed, codes, scales, out)
    if native is not None:
        native_module().decode(native, codes.data_ptr(), scales.data_ptr(), out.data_ptr(), out.numel(), BLOCK,
                               torch.get_num_threads())
    else:
        _by_blocks(_decode_blocks, out, codes, scales, signed)


def round_bf16(x: torch.Tensor, out: torch.Tensor, generator: torch.Generator | None) -> None:
    """``x`` (fp32) into ``out`` (bf16): stochastically with ``generator`` (rounded away from
    zero with probability (the 16 bits bf16 drops) / 2^16), to nearest without."""
    if generator is None:
        out.copy_(x)
        return
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    # Adding below the kept bits carries into them with that probability; the sign bit is
    # apart, so this rounds the magnitude, away from zero, for either sign.
    rounded = (bits + noise).bitwise_and_(-65536)  # 0xFFFF0000: bf16 then holds it exactly
    out.copy_(rounded.view(torch.float32))


class Codec:
    """How one algorithm's moments are stored under ``state_dtype`` ("bf16" or "int8").
    ``moments``: (name, signed) of each of its own kinds, in its order."""

    def __init__(self, state_dtype: str, moments: tuple[tuple[str, bool], ...]):
        if state_dtype == "fp32" or state_dtype not in STATE_DTYPES:
            raise ValueError(f"optimizer.state_dtype={state_dtype!r} has no codec; the compact ones are "
                             f"{', '.join(d for d in STATE_DTYPES if d != 'fp32')}")  # fmt: skip
        self.state_dtype = state_dtype
        self.moments = moments
        self._temporaries: dict[int, torch.Tensor | None] = {}  # moment -> its fp32 temporary (see `unpacked`)

    @property
    def dtype(self) -> torch.dtype:
        """What the codes of a moment are stored in."""
        return torch.bfloat16 if self.state_dtype == "bf16" else torch.uint8

    def stored(self) -> tuple[tuple[str, torch.dtype, bool], ...]:
        """(kind, dtype, per block) of every tensor stored for the moments, in order: each
        moment, then (int8) its scales."""
        out = []
        for name, _ in self.moments:
            out.append((name, self.dtype, False))
            if self.state_dtype == "int8":
                out.append((name + SCALE, torch.float32, True))
        return tuple(out)

    def _per_moment(self, tensors) -> list[tuple]:
        """The stored tensors of each moment: (codes,) or (codes, scales)."""
        width = 2 if self.state_dtype == "int8" else 1
        return [tuple(tensors[k * width : (k + 1) * width]) for k in range(len(self.moments))]

    # -- one unit's part --------------------------------------------------------------------
    def decode(self, k: int, stored: tuple, s: slice, bs: slice | None, out: torch.Tensor) -> None:
        """Moment ``k``'s elements ``s`` (its blocks ``bs``) into ``out`` (fp32)."""
        if self.state_dtype == "bf16":
            out.copy_(stored[0][s])
        else:
            decode_int8(stored[0][s], stored[1][bs], self.moments[k][1], out)

    def encode(self, k: int, x: torch.Tensor, stored: tuple, s: slice, bs: slice | None,
               generator: torch.Generator | None = None) -> None:  # fmt: skip
        """``x`` (fp32, one unit's part) into moment ``k``'s elements ``s`` (its blocks ``bs``)."""
        if self.state_dtype == "bf16":
            round_bf16(x, stored[0][s], generator)
        else:
            encode_int8(x, stored[0][s], stored[1][bs], self.moments[k][1])

    # -- a sub-group ------------------------------------------------------------------------
    def encode_group(self, values: list[torch.Tensor], slices: dict[int, slice]) -> list[torch.Tensor]:
        """The stored tensors of a sub-group whose moments are ``values`` (fp32, flat), its
        units' parts ``slices``; rounded to nearest."""
        bslices = block_slices(slices)
        out = []
        for k, x in enumerate(values):
            # zeros: where the sub-group's layout leaves gaps between units, they hold no bytes of chance
            codes = torch.zeros(x.numel(), dtype=self.dtype, device=x.device)
            stored = (codes,)
            if self.state_dtype == "int8":
                stored += (torch.zeros(sum(blocks(s.stop - s.start) for s in slices.values()), device=x.device),)
            for i, s in slices.items():
                self.encode(k, x[s], stored, s, bslices[i])
            out += stored
        return out

    def decode_unit(self, tensors, k: int, slices: dict[int, slice], unit: int,
                    bslices: dict[int, slice] | None = None) -> torch.Tensor:  # fmt: skip
        """Moment ``k`` of unit ``unit`` (fp32, a new tensor) from a sub-group's stored ``tensors``
        (``bslices``: `block_slices(slices)`, when the caller has it)."""
        stored = self._per_moment(tensors)[k]
        s = slices[unit]
        out = torch.empty(s.stop - s.start, dtype=torch.float32, device=stored[0].device)
        self.decode(k, stored, s, (bslices or block_slices(slices))[unit], out)
        return out

    def _temporary(self, k: int, numel: int, device) -> torch.Tensor:
        """Moment ``k``'s fp32 temporary of ``numel`` elements, kept for the next sub-group
        (see the module's docstring: made afresh, its page faults cost more than the decode)."""
        kept = self._temporaries
        t = kept.get(k)
        if t is None or t.numel() < numel or t.device != torch.device(device):
            kept[k] = None  # the old one goes before the new one is made
            t = kept[k] = torch.empty(numel, dtype=torch.float32, device=device)
        return t[:numel]

    @contextlib.contextmanager
    def unpacked(self, tensors, slices: dict[int, slice], stepped, steps: dict, base: dict):
        """fp32 temporaries of a sub-group's moments (its stored ``tensors``, its units'
        parts ``slices``), the parts of the units in ``stepped`` filled; at the end, those
        parts encoded back into ``tensors`` (the others are left as they are, byte for byte).
        ``steps``: unit -> its step count this update (seeds bf16's rounding with ``base``:
        unit -> where its part starts in its whole flat parameter). The temporaries are the
        codec's, valid until the next call."""
        units = [i for i in slices if i in stepped]
        bslices = block_slices(slices) if self.state_dtype == "int8" else {}
        per = self._per_moment(tensors)
        values = [self._temporary(k, stored[0].numel(), stored[0].device) for k, stored in enumerate(per)]
        for k, (stored, full) in enumerate(zip(per, values)):
            for i in units:
                self.decode(k, stored, slices[i], bslices.get(i), full[slices[i]])
        yield values
        # Only after the kernels ran to the end: an error leaves the stored states as they were.
        for k, (stored, full) in enumerate(zip(per, values)):
            for i in units:
                gen = None
                if self.state_dtype == "bf16":
                    gen = _rounding_generator(full.device, i, base.get(i, 0), int(steps[i]), k)
                self.encode(k, full[slices[i]], stored, slices[i], bslices.get(i), gen)


def _rounding_generator(device, unit: int, start: int, step: int, k: int) -> torch.Generator:
    """The random bits of unit ``unit``'s moment ``k`` at step ``step``: the same wherever the
    update runs; ``start`` tells ranks' shards apart."""
    seed = hash((unit, start, step, k)) & ((1 << 63) - 1)  # ints hash to themselves: stable across runs
    return torch.Generator(device=device).manual_seed(seed)

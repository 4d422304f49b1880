"""Compact optimizer states (``[optimizer] state_dtype`` bf16 and int8, infinity/_compact.py).

The codec's own properties (decode then encode is the identity, stochastic rounding is
unbiased), the update against torchao's 8-bit and bf16 AdamW, a 200-step loss curve of a tiny
Llama against fp32 states, the byte sizes every planner asks the state record for, units
without a gradient left alone, checkpoints (compact to compact bit-exact, fp32 to compact and
back converted), the overlap bit-identical, and what swap-inspect shows.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys

import pytest
import torch
from torch import nn

import infinity
from infinity import _compact
from infinity.tools import swap_inspect

sys.path.insert(0, os.path.dirname(__file__))
from _common import config, make_model, train  # noqa: E402

NVME = ("nvme", "nvme", "nvme")
DEVICE = ("device", "device", "device")


def _engine(path, state_dtype: str, tiers=NVME, model=None, **sections):
    opt = {"state_dtype": state_dtype, **sections.pop("optimizer", {})}
    model = model if model is not None else make_model()
    return infinity.initialize(model, config(path, tiers, optimizer=opt, **sections))


def _states(engine) -> dict:
    """Every stored optimizer tensor: (sub-group, kind) -> a copy."""
    opt, out = engine.optimizer, {}
    for g in opt.groups:
        for kind in opt.kinds:
            lease = opt.states[kind].get(g.record.name_for()).result()
            try:
                out[(g.index, kind)] = lease.tensor.detach().clone().cpu()
            finally:
                lease.release()
    return out


# -- the codec ------------------------------------------------------------------------------
NO_NATIVE = "infinity._compact_native was not built (no C++ compiler at install, or INFINITY_BUILD_NATIVE=0)"


@pytest.fixture(params=["torch", pytest.param("native", marks=pytest.mark.skipif(
    _compact._native_codec(True) is None, reason=NO_NATIVE))])  # fmt: skip
def codec(request, monkeypatch):
    """Each test of the int8 codec runs on the torch reference and on the C++ codec."""
    monkeypatch.setattr(_compact, "NATIVE", request.param == "native")
    return request.param


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [1, 255, 256, 257, (1 << 21) + 77])  # the last: split over threads
def test_native_int8_codec_gives_the_reference_bytes(monkeypatch, isa, signed, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 10 - 9)
    x = x if signed else x.abs()
    if n > 40_000:  # what an update can meet: zeros, a negative extreme, -0.0, NaN, infinities
        x[5:300] = 0
        x[1000:1256] = -3.0
        x[4096:4352] = -0.0
        x[2000], x[9000], x[20000] = float("nan"), float("inf"), float("-inf")
        x[30000:30256] = float("inf")
        x[35000] = 1e-42  # subnormal
    out = {}
    for native in (False, True):
        monkeypatch.setattr(_compact, "NATIVE", native)
        codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(_compact.blocks(n))
        _compact.encode_int8(x, codes, scales, signed)
        decoded = torch.empty(n)
        _compact.decode_int8(codes, scales, signed, decoded)
        out[native] = (codes, scales.view(torch.int32), decoded.view(torch.int32))  # NaN == NaN, -0 != 0
    for a, b in zip(out[False], out[True]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("signed", [True, False])
def test_native_decode_gives_every_code_s_value(monkeypatch, isa, signed):
    """Each of the 256 codes, in every position of a vector, under scales of either sign (the
    AVX-512 path picks values by permutes over the code's bits, not by a gather)."""
    codes = torch.arange(256, dtype=torch.uint8).roll(7).repeat(3)  # each code at several lanes
    scales = torch.tensor([0.37, -2.5, 1e-30])
    out = {}
    for native in (False, True):
        monkeypatch.setattr(_compact, "NATIVE", native)
        decoded = torch.empty(codes.numel())
        _compact.decode_int8(codes, scales, signed, decoded)
        out[native] = decoded.view(torch.int32)
    assert torch.equal(out[False], out[True])


def _in_blocks_of_extreme_one(probes: torch.Tensor) -> torch.Tensor:
    """``probes`` (each within [-1, 1]) in blocks led by 1.0, so that each block's scale is 1
    and every probe is its own x / scale."""
    rows = -(-probes.numel() // (_compact.BLOCK - 1))
    padded = torch.zeros(rows * (_compact.BLOCK - 1))
    padded[: probes.numel()] = probes
    return torch.cat([torch.ones(rows, 1), padded.view(rows, -1)], 1).reshape(-1)


@pytest.mark.parametrize("signed", [True, False])
def test_native_codes_at_every_boundary_are_the_reference_s(monkeypatch, isa, signed):
    """At and up to eight floats either side of each of the map's 255 boundaries, both signs,
    and at every map value: where the AVX-512 encode computes codes by arithmetic (codec.h's
    ArithmeticCodes), exactly these are the lanes it must send to the table; every path gives
    the torch reference's bucketize."""
    bounds = _compact._boundaries(signed)
    near, up, down = [bounds], bounds, bounds
    for _ in range(8):
        up, down = torch.nextafter(up, torch.tensor(2.0)), torch.nextafter(down, torch.tensor(-2.0))
        near += [up, down]
    values = _compact.code_map(signed)
    probes = torch.cat(near + [values, torch.tensor([0.0, -0.0, 1e-42, -1e-42, 1e-38])])
    x = _in_blocks_of_extreme_one(torch.cat([probes, -probes]).clamp(-1, 1))
    out = {}
    for native in (False, True):
        monkeypatch.setattr(_compact, "NATIVE", native)
        codes, scales = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(_compact.blocks(x.numel()))
        _compact.encode_int8(x, codes, scales, signed)
        out[native] = codes
    assert torch.equal(out[False], out[True])


def test_the_maps_codes_need_no_table_on_avx512():
    """Both maps are of the shape ArithmeticCodes serves (its checks hold when the codec is
    made, on any CPU); a map that is not still encodes to the reference's codes, by the table."""
    native = _compact.native_module()
    if native is None:
        pytest.skip(NO_NATIVE)
    assert _compact._native_codec(True).arithmetic and _compact._native_codec(False).arithmetic
    g = torch.Generator().manual_seed(3)
    values = torch.linspace(-1, 1, 256) + (torch.rand(256, generator=g) - 0.5) * 0.003  # uneven steps
    values[-1] = 1.0
    bounds = (values[:-1] + values[1:]) / 2
    irregular = native.Codec(bounds.tolist(), values.tolist())
    assert not irregular.arithmetic
    x = _in_blocks_of_extreme_one(torch.rand(4000, generator=g) * 2 - 1)
    codes, scales = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(_compact.blocks(x.numel()))
    native.encode(irregular, x.data_ptr(), codes.data_ptr(), scales.data_ptr(), x.numel(), _compact.BLOCK, 1)
    assert torch.equal(codes.long(), torch.bucketize(x, bounds))


def test_int8_codec_refuses_mismatched_tensors():
    x = torch.zeros(300)
    with pytest.raises(ValueError, match="300 values want 300 codes and 2 scales, got 300 and 1"):
        _compact.encode_int8(x, torch.empty(300, dtype=torch.uint8), torch.empty(1), True)
    with pytest.raises(TypeError, match="codes torch.int8"):
        _compact.decode_int8(torch.empty(300, dtype=torch.int8), torch.empty(2), True, x)


@pytest.mark.parametrize("signed", [True, False])
def test_int8_decode_then_encode_is_the_identity(codec, signed):
    # 1000 elements: three whole blocks and a short one; magnitudes over eight decades (as
    # exp_avg_sq's are); an all-zero block; a block whose extreme is negative (the signed map
    # holds +1 but not -1: the signed scale is what makes this exact).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-8, 0, 1000)
    x[256:512] = 0
    x[512] = -10.0
    x = x if signed else x.abs()
    codes, scales = torch.empty(1000, dtype=torch.uint8), torch.empty(_compact.blocks(1000))
    _compact.encode_int8(x, codes, scales, signed)
    decoded = torch.empty(1000)
    _compact.decode_int8(codes, scales, signed, decoded)
    again_codes, again_scales = torch.empty_like(codes), torch.empty_like(scales)
    _compact.encode_int8(decoded, again_codes, again_scales, signed)
    assert torch.equal(again_codes, codes) and torch.equal(again_scales, scales)
    assert scales.numel() == 4 and scales[1] == 0 and torch.all(decoded[256:512] == 0)
    assert decoded[512] == x[512]  # the extreme is exact whatever its sign
    # The map's resolution: within 1% of each block's extreme (the top decade's step is 0.9/64).
    for b in range(4):
        block = slice(256 * b, min(256 * (b + 1), 1000))
        assert (decoded[block] - x[block]).abs().max() <= 0.01 * x[block].abs().max()


def test_int8_codes_are_the_nearest_map_values(codec):
    # torchao's own check of its quantiser: the code is the argmin of the distance to the map.
    g = torch.Generator().manual_seed(1)
    x = torch.rand(32, 256, generator=g) * 2 - 1
    x[:, 0] = 1.0  # each block's extreme is +1, so x / scale is x itself
    codes, scales = torch.empty(x.numel(), dtype=torch.uint8), torch.empty(32)
    _compact.encode_int8(x.reshape(-1), codes, scales, True)
    expected = (x.reshape(-1, 1) - _compact.code_map(True)).abs().argmin(1)
    assert torch.equal(codes.long(), expected)


def test_bf16_stochastic_rounding_is_unbiased_and_exact_values_stay():
    # torchao's test of its bf16 stochastic rounding, at its tolerance (3e-5 relative and absolute)
    x = torch.rand(32, generator=torch.Generator().manual_seed(2)) * 100
    many = x.view(-1, 1).repeat(1, 100_000)
    out = torch.empty_like(many, dtype=torch.bfloat16)
    _compact.round_bf16(many, out, torch.Generator().manual_seed(3))
    torch.testing.assert_close(out.float().mean(1), x, atol=3e-5, rtol=3e-5)
    exact = out.float()  # values bf16 holds come back as they are, whatever the random bits
    again = torch.empty_like(out)
    _compact.round_bf16(exact, again, torch.Generator().manual_seed(4))
    assert torch.equal(again, out)


# -- against torchao ------------------------------------------------------------------------
@pytest.fixture
def torchao_eager(monkeypatch):
    """torchao's optimizers with their step run eagerly: they torch.compile it, which on a CPU
    takes ~15 s per optimizer here; the eager step is the same arithmetic."""
    optim = pytest.importorskip("torchao.optim")
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    return optim


def _mlp_no_bias() -> nn.Module:
    # torchao's correctness test's model, without biases: torchao quantises only tensors of at
    # least 4096 elements (as bitsandbytes), the engine every state, so the biases would
    # compare quantised with fp32 states. Each weight is a whole number of 256-blocks, so the
    # engine's blocks (per unit) are torchao's (per tensor).
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 1024, bias=False), nn.ReLU(), nn.Linear(1024, 128, bias=False))


def test_int8_adamw_matches_torchao_adamw8bit(tmp_path, torchao_eager):
    # torchao's test_optim_8bit_correctness: two steps of AdamW8bit against bitsandbytes'
    # AdamW8bit, parameters within rtol = atol = 1e-5. The same here against the engine with
    # int8 states (torchao's defaults: lr 1e-3, weight decay 1e-2, blocks of 256). The schemes
    # differ only in a block whose extreme is negative (torchao stores it as -0.993 of itself,
    # the engine exactly: [Note: compact state format]), which moves an update by at most
    # lr x 0.7% = 7e-6, inside that tolerance.
    theirs = _mlp_no_bias()
    ours = _engine(tmp_path, "int8", DEVICE, model=_mlp_no_bias(), optimizer={"lr": 1e-3, "weight_decay": 1e-2})
    opt = torchao_eager.AdamW8bit(theirs.parameters(), lr=1e-3, weight_decay=1e-2, block_size=256)
    try:
        for step in range(2):
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
            theirs(x).sum().backward()
            opt.step()
            opt.zero_grad()
            ours.backward(ours(x).sum())
            ours.step()
        assert type(opt.state[theirs[0].weight]["exp_avg"]).__name__ == "OptimState8bit"  # quantised there too
        weights = ours.gathered_weights()
        for name, p in theirs.named_parameters():
            torch.testing.assert_close(weights[name], p.detach(), rtol=1e-5, atol=1e-5)
    finally:
        ours.close()


def test_bf16_adamw_matches_torchao_bf16_adamw(tmp_path, torchao_eager):
    # torchao's test_optim_bf16_stochastic_round_correctness: five steps overfitting one batch
    # at lr 1e-5, bf16 training (its _AdamW: bf16 weights rounded stochastically, bf16 states)
    # against fp32 AdamW, the losses compared at assert_close's bf16 tolerance (rtol 1.6e-2,
    # atol 1e-5). Here the engine computes in bf16 with bf16 states (stochastically rounded)
    # and fp32 master weights, against torchao's bf16 AdamW.
    torch.manual_seed(2024)
    model = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 128))
    theirs = copy.deepcopy(model).bfloat16()
    opt = torchao_eager._AdamW(theirs.parameters(), lr=1e-5, bf16_stochastic_round=True)
    ours = _engine(tmp_path, "bf16", DEVICE, model=model, precision={"param_dtype": "bf16"},
                   optimizer={"lr": 1e-5, "weight_decay": 1e-2})  # fmt: skip
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    try:
        for idx in range(5):
            loss_theirs = theirs(x).sum()
            loss_theirs.backward()
            opt.step()
            opt.zero_grad()
            loss_ours = ours(x).sum()
            ours.backward(loss_ours)
            ours.step()
            torch.testing.assert_close(loss_ours.detach(), loss_theirs.detach(), msg=lambda m: f"step {idx}: {m}")
    finally:
        ours.close()


# -- training -------------------------------------------------------------------------------
_VOCAB = 64


def _tokens(step: int) -> torch.Tensor:
    """A batch from a fixed random bigram chain, fresh every step: the loss falls to the chain's
    entropy (about 2 nats) and stays there, instead of to a memorised zero, where every
    difference is a large relative one."""
    chain = torch.softmax(torch.randn(_VOCAB, _VOCAB, generator=torch.Generator().manual_seed(7)) * 3, dim=1)
    g = torch.Generator().manual_seed(step)
    ids = torch.empty(8, 16, dtype=torch.long)
    ids[:, 0] = torch.randint(0, _VOCAB, (8,), generator=g)
    for t in range(1, ids.shape[1]):
        ids[:, t] = torch.multinomial(chain[ids[:, t - 1]], 1, generator=g).squeeze(1)
    return ids


def _llama_losses(path, state_dtype: str, steps: int = 200) -> list[float]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    # Every tier in memory: the codec is the nvme tiers' (test_every_algorithm_trains_with_compact_states
    # runs it there), the same losses at a thirteenth of the time (200 steps of I/O took 15 s a run).
    engine = _engine(path, state_dtype, DEVICE, model=transformers.LlamaForCausalLM(cfg), optimizer={"lr": 1e-2})
    losses = []
    try:
        for step in range(steps):
            ids = _tokens(step)
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.item())
    finally:
        engine.close()
    return losses


@pytest.fixture(scope="module")
def fp32_llama(tmp_path_factory):
    return _llama_losses(tmp_path_factory.mktemp("fp32"), "fp32")


@pytest.mark.parametrize("state_dtype", ["int8", "bf16"])
def test_llama_200_steps_within_1_percent_of_fp32(tmp_path, fp32_llama, state_dtype):
    # The loss over the last 50 steps (the plateau) and over all 200, each within 1% of the
    # same run with fp32 states; and the run learned (the plateau well under the first loss).
    losses = _llama_losses(tmp_path, state_dtype)
    for part in (slice(-50, None), slice(None)):
        ours, ref = (sum(v[part]) / len(v[part]) for v in (losses, fp32_llama))
        assert abs(ours / ref - 1) < 0.01, (state_dtype, part, ours, ref)
    assert sum(losses[-50:]) / 50 < 0.6 * losses[0]
    assert losses != fp32_llama  # the states were compact: not the fp32 run again


@pytest.mark.parametrize("state_dtype", ["int8", "bf16"])
@pytest.mark.parametrize("opt", [{"type": "adam"}, {"type": "sgd", "momentum": 0.9, "lr": 0.05},
                                 {"type": "adagrad", "lr": 0.05}], ids=["adam", "sgd", "adagrad"])  # fmt: skip
def test_every_algorithm_trains_with_compact_states(tmp_path, state_dtype, opt):
    # Each algorithm's own kinds compact (Adam's signed and unsigned moments, SGD's signed
    # momentum buffer, Adagrad's unsigned sum): 20 steps, the mean loss of the last 10 within
    # 2% of the same run with fp32 states (each moment within 1% of its block's extreme per
    # step), and not the fp32 run itself.
    runs = {}
    for sd in ("fp32", state_dtype):
        engine = _engine(tmp_path / sd, sd, optimizer=dict(opt, **({} if "lr" in opt else {"lr": 1e-2})))
        try:
            runs[sd] = train(engine, 20)
            kinds = engine.optimizer.kinds
        finally:
            engine.close()
    ours, ref = (sum(runs[k][-10:]) / 10 for k in (state_dtype, "fp32"))
    assert abs(ours / ref - 1) < 0.02, (ours, ref)
    assert runs[state_dtype] != runs["fp32"]
    own = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",), "adagrad": ("sum",)}[opt["type"]]
    scales = state_dtype == "int8"
    assert kinds == ("master", *[n for k in own for n in ((k, k + _compact.SCALE) if scales else (k,))])


# -- sizes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_records_give_the_bytes_on_disk(tmp_path, state_dtype):
    # Every planner (the memory plan, the overlap, the footprint, checkpoints) asks the record;
    # here its sizes are the tensors' in the swap space, scales included, for units whose
    # parts are not whole blocks (16x32+32 = 544 elements: 3 blocks, the last of 32).
    engine = _engine(tmp_path, state_dtype, optimizer={"sub_group_size": "1MiB"})
    try:
        train(engine, 1)
        opt = engine.optimizer
        itemsize = {"fp32": 4, "bf16": 2, "int8": 1}[state_dtype]
        for g in opt.groups:
            for kind in opt.kinds[1:]:  # the algorithm's own (the master weights' are not compact)
                info = engine.space.info(g.record.key(kind))
                assert info.nbytes == g.record.nbytes(kind), kind
                if kind.endswith(_compact.SCALE):
                    assert g.record.numel_of(kind) == sum(math.ceil(u.shard_numel / 256) for u in g.units)
                else:
                    assert info.dtype == {1: "uint8", 2: "bfloat16", 4: "float32"}[itemsize]
        for u in engine.units:
            rec = opt.record(u)
            scales = sum(4 * math.ceil(u.shard_numel / 256) for k in opt.kinds if k.endswith(_compact.SCALE))
            assert rec.state_bytes(opt.kinds) == u.shard_numel * (4 + 2 * itemsize) + scales
    finally:
        engine.close()


def test_compact_states_shrink_the_memory_plan(tmp_path):
    # Sub-groups of a fixed size (1 KiB of state) hold more parameters with compact states, and
    # the step's plan for the largest one is no larger than with fp32.
    needed, counts = {}, {}
    for sd in ("fp32", "int8"):
        engine = _engine(tmp_path / sd, sd, optimizer={"sub_group_size": "1MiB"})
        try:
            opt = engine.optimizer
            needed[sd] = sum(g.record.state_bytes(opt.kinds) for g in opt.groups)
            counts[sd] = engine.plan.step_buffers
        finally:
            engine.close()
    assert needed["int8"] < 0.55 * needed["fp32"]  # 6.03 bytes a parameter against 12
    assert counts["int8"] <= counts["fp32"]


# -- updates --------------------------------------------------------------------------------
class _Gated(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 40), nn.Linear(40, 4)  # 680 and 164 elements: short last blocks

    def forward(self, x, use_b: bool = True):
        x = self.a(x)
        return self.b(x) if use_b else x[:, :4]


@pytest.mark.parametrize("state_dtype", ["int8", "bf16"])
def test_a_unit_without_a_gradient_keeps_its_states_byte_for_byte(tmp_path, state_dtype):
    engine = _engine(tmp_path, state_dtype, model=_Gated())  # one sub-group holds both units
    try:
        opt = engine.optimizer
        (group,) = opt.groups
        a, b = (group.slices[u.index] for u in group.units)
        blocks = _compact.block_slices(group.slices)
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        for _ in range(2):  # both units step
            engine.backward(((engine(x) - y) ** 2).mean())
            engine.step()
        before = _states(engine)
        engine.backward(((engine(x, use_b=False) - y) ** 2).mean())  # only a has a gradient
        engine.step()
        after = _states(engine)
        ub = group.units[1].index
        for kind in opt.kinds[1:]:
            part_b = blocks[ub] if kind.endswith(_compact.SCALE) else b
            assert torch.equal(after[(0, kind)][part_b], before[(0, kind)][part_b]), kind
        assert not torch.equal(after[(0, "exp_avg")][a], before[(0, "exp_avg")][a])  # a did step
    finally:
        engine.close()


def test_bf16_moments_follow_their_fp32_values_over_many_steps(tmp_path):
    # A constant gradient of 1: exp_avg_sq after t steps is 1 - 0.999^t (0.45 at 600). Its
    # step-to-step change, 0.001 x (1 - v), falls under half a bf16 ulp once v reaches 0.25, so
    # round-to-nearest would hold it there; stochastic rounding follows it (the mean of 4096
    # elements, each with its own rounding noise, within 1%).
    model = nn.Linear(4096, 1, bias=False)
    engine = _engine(tmp_path, "bf16", DEVICE, model=model, optimizer={"lr": 1e-4, "weight_decay": 0.0})
    try:
        x = torch.ones(1, 4096)
        for _ in range(600):
            engine.backward(engine(x).sum())
            engine.step()
        (group,) = engine.optimizer.groups
        v = _states(engine)[(group.index, "exp_avg_sq")]
        assert v.dtype == torch.bfloat16 and abs(v.float().mean().item() / (1 - 0.999**600) - 1) < 0.01, v.float().mean()
    finally:
        engine.close()


@pytest.mark.parametrize("state_dtype", ["int8", "bf16"])
def test_overlap_is_bit_identical_with_compact_states(tmp_path, state_dtype):
    # As tests/infinity/test_overlap.py: the early updates (under backward, through the same
    # kernels and codec) commit bit-identical results; and they did run.
    runs = {}
    for overlap in (False, True):
        engine = _engine(tmp_path / str(overlap), state_dtype,
                         optimizer={"overlap": overlap, "overlap_disk": 1.0, "sub_group_size": "1KiB"})  # fmt: skip
        try:
            committed = 0
            losses = []
            for step in range(4):
                losses += train(engine, 1, start=step)
                committed += engine.overlap.committed if engine.overlap else 0
            runs[overlap] = (losses, engine.gathered_weights(), _states(engine), committed)
        finally:
            engine.close()
    (l0, w0, s0, c0), (l1, w1, s1, c1) = runs[False], runs[True]
    assert c0 == 0 and c1 > 0
    assert l0 == l1
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)


# -- checkpoints ----------------------------------------------------------------------------
@pytest.mark.parametrize("state_dtype", ["int8", "bf16"])
def test_compact_checkpoint_round_trip_is_bit_exact(tmp_path, state_dtype):
    saved = _engine(tmp_path / "a", state_dtype)
    try:
        train(saved, 3)
        saved.save_checkpoint(tmp_path / "ck")
        states = _states(saved)
        after = train(saved, 2, start=3)
        weights = saved.gathered_weights()
    finally:
        saved.close()
    loaded = _engine(tmp_path / "b", state_dtype, model=make_model(seed=1))
    try:
        loaded.load_checkpoint(tmp_path / "ck")
        got = _states(loaded)
        assert got.keys() == states.keys() and all(torch.equal(got[k], states[k]) for k in states)
        assert train(loaded, 2, start=3) == after
        w = loaded.gathered_weights()
        assert all(torch.equal(w[k], weights[k]) for k in weights)
    finally:
        loaded.close()


def _decoded(algo, states: dict, g, k: int) -> torch.Tensor:
    """Moment ``k`` of sub-group ``g``, its units' parts decoded to fp32 end to end, from
    ``states``: (sub-group, stored kind) -> tensor of an engine with ``algo``'s int8 states."""
    stored = [states[(g.index, n)] for n in algo.kind_names[1:]]
    return torch.cat([algo.codec.decode_unit(stored, k, g.slices, u.index) for u in g.units])


def test_fp32_checkpoint_loads_into_int8_and_back(tmp_path):
    fp32 = _engine(tmp_path / "a", "fp32")
    try:
        train(fp32, 3)
        fp32.save_checkpoint(tmp_path / "fp32")
        exact = _states(fp32)
    finally:
        fp32.close()
    int8 = _engine(tmp_path / "b", "int8", model=make_model(seed=1))
    try:
        int8.load_checkpoint(tmp_path / "fp32")  # converted: encoded from the saved fp32
        got = _states(int8)
        algo = int8.optimizer.algorithm
        for g in int8.optimizer.groups:
            assert torch.equal(got[(g.index, "master")], exact[(g.index, "master")])
            for k, kind in enumerate(algo.states):
                decoded = _decoded(algo, got, g, k)
                ref = exact[(g.index, kind.name)]
                assert not torch.equal(decoded, ref)  # quantised...
                assert (decoded - ref).abs().max() <= 0.01 * ref.abs().max()  # ...within the map's resolution
        train(int8, 1, start=3)
        int8.save_checkpoint(tmp_path / "int8")
        compact = _states(int8)
    finally:
        int8.close()
    back = _engine(tmp_path / "c", "fp32", model=make_model(seed=1))
    try:
        back.load_checkpoint(tmp_path / "int8")  # fp32 states: the int8 ones decoded
        got = _states(back)
        algo = infinity._algorithms.ALGORITHMS["adamw"].with_state_dtype("int8")
        for g in back.optimizer.groups:
            for k, kind in enumerate(algo.states):
                decoded = _decoded(algo, compact, g, k)
                assert torch.equal(got[(g.index, kind.name)], decoded)
        train(back, 1, start=4)
    finally:
        back.close()


def test_swap_inspect_shows_compact_states(tmp_path, capsys):
    engine = _engine(tmp_path / "swap", "int8")
    try:
        train(engine, 1)
        engine.save_checkpoint(tmp_path / "ck")
        record = engine.optimizer.groups[0].record
    finally:
        engine.close()
    assert swap_inspect.main([str(tmp_path / "swap"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    rank = shown["ranks"][0] if "ranks" in shown else shown
    tensors = {t["name"]: t for t in rank["tensors"]}
    assert tensors[record.key("exp_avg")]["dtype"] == "uint8"
    assert tensors[record.key("exp_avg.scale")]["dtype"] == "float32"
    assert tensors[record.key("exp_avg.scale")]["nbytes"] == record.nbytes("exp_avg.scale")
    assert swap_inspect.main([str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "states int8 (saved as fp32)" in out


# -- refusals -------------------------------------------------------------------------------
def test_a_torch_optimizer_run_as_it_is_refuses_compact_states(tmp_path):
    model = make_model()
    cfg = config(tmp_path, DEVICE, optimizer={"state_dtype": "int8"})
    with pytest.raises(ValueError, match=r"optimizer.state_dtype='int8': RMSprop runs as it is"):
        infinity.initialize(model, cfg, optimizer=torch.optim.RMSprop(model.parameters(), lr=1e-3))

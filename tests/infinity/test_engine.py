"""The engine against plain PyTorch: same model, data and seed, torch.optim.AdamW, fp32.

Tolerance: 1e-5 absolute on per-step losses and final weights. The engine runs the same
arithmetic (fp32 master weights, fp32 gradients, torch's fused AdamW kernel against
torch.optim.AdamW's default kernel), so differences are float rounding of a few ULPs, far
below 1e-5 at these magnitudes.
"""

from __future__ import annotations

import copy
import itertools
import os
import sys

import pytest
import torch
from torch import nn

import infinity

sys.path.insert(0, os.path.dirname(__file__))
from _common import config as _config  # noqa: E402

TIERS = ("device", "cpu", "nvme")
# A representative subset in CI: each tier for each state at least once, all-nvme included.
CI_COMBOS = [("device", "device", "device"), ("nvme", "nvme", "nvme"), ("cpu", "nvme", "device"),
             ("nvme", "cpu", "cpu"), ("device", "device", "nvme")]  # fmt: skip
ALL_COMBOS = [c for c in itertools.product(TIERS, repeat=3) if c not in CI_COMBOS]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _batches(kind: str, n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        if kind == "mlp":
            yield (torch.randn(8, 16, generator=g),), torch.randn(8, 4, generator=g)
        else:
            ids = torch.randint(0, 64, (2, 17), generator=g)
            yield (ids[:, :-1],), ids[:, 1:]


def _loss(kind, model_or_engine, inputs, target):
    if kind == "mlp":
        return ((model_or_engine(*inputs) - target) ** 2).mean()
    return model_or_engine(input_ids=inputs[0], labels=target).loss


def _weights(engine: infinity.Engine) -> dict[str, torch.Tensor]:
    """The engine's current fp32 master weights by parameter name."""
    out = {}
    opt = engine.optimizer
    for group in opt.groups:
        lease = opt.states["master"].get(group.name).result()
        master = lease.tensor.clone()
        lease.release()
        for unit in group.units:
            flat = master[group.slices[unit.index]]
            for r in unit.records:
                key = f"{unit.path}.{r.name}"
                piece = flat[r.offset : r.offset + r.numel].view(r.shape)
                if unit.rows is None:
                    out[key] = piece.clone()
                else:  # a tile: its rows of the parameter
                    out.setdefault(key, torch.full(r.full_shape, float("nan")))[slice(*unit.rows)] = piece
    return out


def _compare(kind, tmp_path, tiers, steps=6, accumulate=1, **sections):
    torch.manual_seed(0)
    model = _mlp() if kind == "mlp" else _gpt2()
    ref = copy.deepcopy(model)
    if kind == "gpt2":
        # The attention's key bias has a gradient that is exactly zero in exact arithmetic
        # (softmax ignores a shift per query), so what backward computes for it is rounding
        # noise, which differs with memory alignment, and Adam scales noise up to lr*|g|/eps.
        # A larger eps and smaller lr keep that noise's effect on the weights below 1e-6; the
        # other weights are compared as tightly.
        sections.setdefault("optimizer", {}).update(lr=1e-3, eps=1e-6)
    engine = infinity.initialize(model, _config(tmp_path, tiers, **sections))
    opt_cfg = engine.config.optimizer
    opt = torch.optim.AdamW(ref.parameters(), lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay, eps=opt_cfg.eps)
    batches = list(_batches(kind, steps * accumulate))
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            inputs, target = batches[step * accumulate + micro]
            loss = _loss(kind, engine, inputs, target)
            engine.backward(loss)
            ref_loss = _loss(kind, ref, inputs, target)
            ref_loss.backward()
            assert abs(loss.item() - ref_loss.item()) < 1e-5, (step, micro, loss.item(), ref_loss.item())
        if opt_cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), opt_cfg.max_grad_norm)
        engine.step()
        opt.step()
    weights = _weights(engine)
    for name, p in ref.named_parameters():
        key = name if name in weights else None
        if key is None:  # tied: the owner's name (GPT-2's lm_head.weight is transformer.wte.weight)
            continue
        torch.testing.assert_close(weights[key], p.detach(), atol=1e-5, rtol=0)
    engine.close()
    return engine


@pytest.mark.parametrize("tiers", CI_COMBOS, ids="-".join)
@pytest.mark.parametrize("kind", ["mlp", "gpt2"])
def test_matches_plain_pytorch(kind, tmp_path, tiers):
    _compare(kind, tmp_path, tiers)


@pytest.mark.slow
@pytest.mark.parametrize("tiers", ALL_COMBOS, ids="-".join)
@pytest.mark.parametrize("kind", ["mlp", "gpt2"])
def test_matches_plain_pytorch_every_placement(kind, tmp_path, tiers):
    _compare(kind, tmp_path, tiers)


@pytest.mark.parametrize("tiers", list(itertools.product(TIERS, repeat=3)), ids="-".join)
def test_matches_plain_pytorch_in_tiles_every_placement(tmp_path, tiers):
    """Every nn.Linear over 4KiB of fp32 (the 32 x 32 one) in tiles of rows, where some tier
    is not the device (docs/architecture.md#tiles)."""
    engine = _compare("mlp", tmp_path, tiers, memory={"tile_size": "4KiB"})
    assert any(u.is_tile for u in engine.units) == (tiers != ("device",) * 3)


@pytest.mark.parametrize("tiers", [("device",) * 3, ("nvme",) * 3], ids="-".join)
def test_gradient_accumulation(tmp_path, tiers):
    _compare("mlp", tmp_path, tiers, steps=4, accumulate=3)


@pytest.mark.parametrize("tiers", [("device",) * 3, ("nvme",) * 3], ids="-".join)
def test_global_norm_clipping(tmp_path, tiers):
    _compare("mlp", tmp_path, tiers, steps=4, optimizer={"max_grad_norm": 0.05})


def test_small_sub_groups_and_no_prefetch(tmp_path):
    _compare("gpt2", tmp_path, ("nvme",) * 3, optimizer={"sub_group_size": "16KiB"}, prefetch={"depth": 0})


class _Reorder(nn.Module):
    """Runs its blocks in an order that changes every call, one block twice (shared use)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.calls = 0

    def forward(self, x):
        order = [0, 1, 2, 3] if self.calls % 2 == 0 else [3, 1, 0, 2, 1]
        self.calls += 1
        for i in order:
            x = torch.tanh(self.blocks[i](x))
        return x


def test_results_exact_when_the_module_order_changes(tmp_path):
    torch.manual_seed(0)
    model = _Reorder()
    ref = copy.deepcopy(model)
    engine = infinity.initialize(model, _config(tmp_path, ("nvme",) * 3, prefetch={"depth": 2}))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        x = torch.randn(4, 8, generator=g)
        loss = engine(x).sum()
        engine.backward(loss)
        engine.step()
        ref_loss = ref(x).sum()
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        assert abs(loss.item() - ref_loss.item()) < 1e-5
    stats = engine.stats()["total"]
    assert stats["on_demand"] > 0  # the departures were fetched on demand...
    assert stats["prefetch_hits"] > 0  # ...and the rest prefetched
    engine.close()


def test_eval_inference_under_no_grad(tmp_path):
    torch.manual_seed(0)
    model = _gpt2()
    ref = copy.deepcopy(model).eval()
    engine = infinity.initialize(model, _config(tmp_path, ("nvme",) * 3)).eval()
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        out = engine(input_ids=ids).logits
        expected = ref(input_ids=ids).logits
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    assert all(u.state.value == "released" for u in engine.units)  # nothing left materialised
    engine.close()


def test_activation_checkpointing(tmp_path):
    torch.manual_seed(0)
    model = _gpt2()
    model.gradient_checkpointing_enable()
    ref = copy.deepcopy(model)
    model.train()
    ref.train()
    engine = infinity.initialize(model, _config(tmp_path, ("nvme",) * 3))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for inputs, target in _batches("gpt2", 4):
        loss = _loss("gpt2", engine, inputs, target)
        engine.backward(loss)
        engine.step()
        ref_loss = _loss("gpt2", ref, inputs, target)
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        assert abs(loss.item() - ref_loss.item()) < 1e-5
    engine.close()


def test_buffers_stay_buffers(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    engine = infinity.initialize(model, _config(tmp_path, ("nvme",) * 3))
    before = model[1].running_mean.clone()
    engine.backward(engine(torch.randn(8, 4)).sum())
    engine.step()
    assert isinstance(model[1].running_mean, torch.Tensor) and "running_mean" in dict(model[1].named_buffers())
    assert not torch.equal(model[1].running_mean, before)  # BatchNorm updated its own buffer
    engine.close()


def _loss_curve(tmp_path, dtype: str, steps: int = 12) -> list[float]:
    torch.manual_seed(0)
    model = _gpt2()
    engine = infinity.initialize(model, _config(tmp_path / dtype, ("nvme",) * 3,
                                                precision={"param_dtype": dtype}, optimizer={"lr": 3e-3}))  # fmt: skip
    curve = []
    batches = list(_batches("gpt2", 3))
    for step in range(steps):
        inputs, target = batches[step % 3]
        loss = _loss("gpt2", engine, inputs, target)
        engine.backward(loss)
        engine.step()
        curve.append(loss.item())
    engine.close()
    return curve


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_follows_the_fp32_loss_curve(tmp_path, dtype):
    """bf16 keeps 8 bits of mantissa (relative error 2^-8 ~ 0.4% per rounding), fp16 11 bits;
    masters stay fp32, so errors do not accumulate across steps. Over 12 steps on this tiny
    GPT-2 (loss ~4.2 falling to ~3) a per-step difference of 0.05 (~1-2%) is the tolerance:
    a few roundings' worth through 2 layers, and far below the 1.2 the loss falls."""
    (tmp_path / "fp32").mkdir()
    (tmp_path / dtype).mkdir()
    reference = _loss_curve(tmp_path, "fp32")
    curve = _loss_curve(tmp_path, dtype)
    assert reference[-1] < reference[0] - 0.5  # it learns
    for a, b in zip(curve, reference):
        assert abs(a - b) < 0.05, (curve, reference)


def test_fp16_overflow_skips_the_step_and_lowers_the_scale(tmp_path):
    torch.manual_seed(0)
    model = _mlp()
    engine = infinity.initialize(model, _config(tmp_path, ("nvme",) * 3,
                                                precision={"param_dtype": "fp16", "initial_scale": 2.0**60}))  # fmt: skip
    x = torch.randn(8, 16).half()
    before = _weights(engine)
    engine.backward(engine(x).float().pow(2).mean())
    assert engine.step() is False  # 2^60 x the gradient overflows fp16
    assert engine.stats()["total"]["skipped_steps"] == 1
    assert engine.stats()["loss_scale"] == 2.0**59
    after = _weights(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.close()


def test_fp16_overflow_at_the_minimum_scale_stops_the_run_as_deepspeeds_with_stop_at_min_scale(tmp_path):
    """DeepSpeed raises at an overflow with its scale at fp16.min_loss_scale; the engine skipped
    on, said once, and a run whose every step overflows there stood still (an audit helper's
    repro). precision.stop_at_min_scale (a DeepSpeed config's) raises once the skipped step is
    counted; the engine trains on after it where the scale allows."""
    torch.manual_seed(0)
    ds = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "fp16": {"enabled": True, "initial_scale_power": 61, "min_loss_scale": 2.0**60, "hysteresis": 1}}  # fmt: skip
    cfg = infinity.TierConfig.from_deepspeed(ds)
    assert cfg.precision.stop_at_min_scale
    engine = infinity.initialize(_mlp(), cfg)
    x = torch.randn(8, 16).half()
    before = _weights(engine)
    engine.backward(engine(x).float().pow(2).mean())
    assert engine.step() is False  # 2^61 -> 2^60: backing off
    engine.backward(engine(x).float().pow(2).mean())
    with pytest.raises(FloatingPointError, match=r"minimum loss scale \(precision.min_scale = 1.15292e\+18"):
        engine.step()
    assert engine.stats()["total"]["skipped_steps"] == 2 and engine.stats()["loss_scale"] == 2.0**60
    assert all(torch.equal(before[k], v) for k, v in _weights(engine).items())
    engine.backward(engine(x).float().pow(2).mean() * 0)  # a clean step (zero gradients): trains on
    assert engine.step() is True
    engine.close()


def test_module_used_several_times_per_step(tmp_path):
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    model = nn.ModuleDict({"a": shared, "b": nn.Linear(8, 8)})
    ref = copy.deepcopy(model)

    def forward(m, x):
        return m["a"](torch.tanh(m["b"](m["a"](x)))).sum()

    class Wrap(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return forward(self.inner, x)

    engine = infinity.initialize(Wrap(model), _config(tmp_path, ("nvme",) * 3))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for _ in range(4):
        x = torch.randn(3, 8)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        ref_loss = forward(ref, x)
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        assert abs(loss.item() - ref_loss.item()) < 1e-5
    engine.close()


def test_stats_count_nvme_traffic(tmp_path):
    engine = _compare("mlp", tmp_path, ("nvme",) * 3, steps=2)
    total = engine.stats()["total"]
    assert total["nvme"]["read_bytes"] > 0 and total["nvme"]["write_bytes"] > 0
    assert engine.stats()["steps"] == 2


def test_stats_split_the_traffic_by_kind_of_state(tmp_path):
    """fp32 AdamW, every tier on nvme, the optimizer after backward, no gradient held in
    memory (tests/infinity/test_grads.py has those): a step writes each gradient once and
    reads it once, reads and writes the master weights and both moments once, and reads the
    parameters for forward and again (all but what stayed in memory) for backward; the new
    parameters are the master weights written ([Note: one copy of the fp32 weights]); the
    kinds add up to the tier's totals."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    engine = infinity.initialize(model, _config(tmp_path, ("nvme",) * 3, optimizer={"overlap": False}))
    engine.plan.held = 0
    try:
        for _ in range(2):
            engine.backward(engine(torch.randn(8, 16)).pow(2).mean())
            engine.step()
        nvme = engine.stats()["step"]["nvme"]
        kinds = nvme["by_kind"]
        assert sorted(kinds) == ["exp_avg", "exp_avg_sq", "grad", "master", "param"]
        assert sum(k["read_bytes"] for k in kinds.values()) == nvme["read_bytes"]
        assert sum(k["write_bytes"] for k in kinds.values()) == nvme["write_bytes"]
        fp32 = 4 * sum(u.shard_numel for u in engine.units)
        for kind in ("grad", "master", "exp_avg", "exp_avg_sq"):
            assert kinds[kind] == {"read_bytes": fp32, "write_bytes": fp32}, (kind, kinds[kind], fp32)
        assert engine.optimizer.one_copy and kinds["param"]["write_bytes"] == 0, kinds["param"]
        assert fp32 <= kinds["param"]["read_bytes"] <= 2 * fp32, kinds["param"]
    finally:
        engine.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_the_first_step_counts_only_its_own_traffic(tmp_path, overlap):
    """What initialize writes (every state, once) is in stats()["total"], not in the first
    step: the first step moves the bytes every later step moves (the GPU benchmark's first
    step reported twice the writes before)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    engine = infinity.initialize(model, _config(tmp_path, ("nvme",) * 3, optimizer={"overlap": overlap}))
    written_by_init = engine.stats()["total"]["nvme"]["write_bytes"]
    assert written_by_init > 0
    steps = []
    for _ in range(2):
        engine.backward(engine(torch.randn(8, 16)).pow(2).mean())
        engine.step()
        steps.append(engine.stats()["step"]["nvme"])
    assert steps[0]["write_bytes"] == steps[1]["write_bytes"] > 0
    assert steps[0]["read_bytes"] == steps[1]["read_bytes"] > 0
    total = engine.stats()["total"]["nvme"]
    assert total["write_bytes"] == written_by_init + 2 * steps[0]["write_bytes"]
    engine.close()


def test_a_model_without_parameters_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no parameters"):
        infinity.initialize(nn.ReLU(), _config(tmp_path, ("device",) * 3))


class _Rotor(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        value = torch.randn(4, dtype=dtype) if dtype.is_complex else torch.arange(4, dtype=dtype)
        self.w = nn.Parameter(value, requires_grad=dtype.is_complex)

    def forward(self, x):
        return (self.lin(x) * self.w).real


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64])
def test_a_parameter_that_is_not_floating_point_is_refused_naming_it(tmp_path, dtype):
    """A complex parameter was cast to fp32 with its imaginary part dropped, and another model
    trained, with only torch's cast warning (an audit helper's repro); an integer one was cast
    too. Refused at initialize, naming it and what to do, with nothing written."""
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=rf"parameter 'w' is {name}: .*view_as_complex.*register_buffer"):
        infinity.initialize(_Rotor(dtype), _config(tmp_path, ("nvme",) * 3))
    assert not any(tmp_path.iterdir())


def test_parameters_of_another_dtype_cast_to_fp32_are_named(tmp_path, caplog):
    """precision.param_dtype = "fp32" casts a bf16 submodule and a float64 parameter to fp32:
    the bf16 one then failed at its bf16 input in the forward, the float64 one trained in fp32,
    both with nothing said at initialize (an audit helper's repro). Said, naming them."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 4).double())
    with caplog.at_level("WARNING", logger="infinity"), infinity.initialize(model, _config(tmp_path, ("device",) * 3)):
        pass
    said = [r.getMessage() for r in caplog.records if "computes every parameter in float32" in r.getMessage()]
    assert len(said) == 1 and "'1.weight', '1.bias', '2.weight', ..." in said[0] and "bfloat16, float64" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="infinity"), infinity.initialize(nn.Linear(4, 4), _config(tmp_path, ("device",) * 3)):
        pass
    assert "computes every parameter" not in caplog.text


def test_a_budget_too_small_is_refused_at_initialize(tmp_path):
    """A clear error at initialize, not an OOM kill (or PoolExhausted) mid-run."""
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 4 MiB of fp32 per unit
    with pytest.raises(ValueError, match=r"memory.host_budget=8MiB is less than the [\d.]+MiB the optimizer step needs"):
        infinity.initialize(model, _config(tmp_path, ("nvme",) * 3, memory={"host_budget": "8MiB"}))


def test_a_tight_budget_reads_fewer_sub_groups_ahead(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    roomy = infinity.initialize(model, _config(tmp_path / "a", ("nvme",) * 3, memory={"host_budget": "512MiB"}))
    assert roomy.optimizer.read_ahead.count == 3 and roomy.optimizer.read_ahead.bytes is None
    roomy.close()
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    # One layer per sub-group (12.6 MB of state): 3 ahead needs 79 MiB, 1 ahead 54 MiB (66 MiB
    # with the pool's 15% of slack).
    tight = infinity.initialize(model, _config(tmp_path / "b", ("nvme",) * 3, memory={"host_budget": "72MiB"},
                                               optimizer={"sub_group_size": "16MiB"}))  # fmt: skip
    state = 12 * (1024 * 1024 + 1024)
    ahead = tight.optimizer.read_ahead.bytes
    assert ahead is not None and state <= ahead < 3 * state
    tight.backward(tight(torch.randn(2, 1024)).sum())
    assert tight.step()
    tight.close()


def test_one_large_sub_group_does_not_hold_back_the_read_ahead_of_the_small_ones(tmp_path, monkeypatch):
    """The budget fits 1 ahead of the large sub-group (a vocabulary-sized unit); the read-ahead
    counts bytes, so the small ones are still read 3 ahead."""
    import infinity.swap._pipeline as pipeline

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8192, 256), *[nn.Linear(256, 256) for _ in range(6)])
    big = 12 * 8192 * 256  # 25 MB of fp32 state; each Linear 0.8 MB
    engine = infinity.initialize(model, _config(tmp_path, ("nvme",) * 3, memory={"host_budget": "150MiB"},
                                                optimizer={"sub_group_size": "1MiB", "overlap": False}))  # fmt: skip
    ahead = engine.optimizer.read_ahead
    assert ahead.count == 3 and big <= ahead.bytes < 3 * big
    most = []
    real = pipeline._Reads.more

    def more(self, limit):
        real(self, limit)
        most.append(len(self.queue))

    monkeypatch.setattr(pipeline._Reads, "more", more)
    engine.backward(engine(torch.randint(0, 8192, (2, 4))).sum())
    assert engine.step()
    assert max(most) == 4  # the next item and 3 ahead, among the small sub-groups
    engine.close()


def test_an_engine_left_open_is_closed_at_exit(tmp_path):
    """A script that never calls close(): at exit the engine is closed anyway, so the swap
    manifest lists what was written (and, with ranks, the exit does not abort)."""
    import json
    import subprocess
    import sys

    script = f"""
import torch, infinity
from torch import nn
engine = infinity.initialize(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
                             {{"tiers": {{"params": "nvme", "grads": "nvme", "optimizer": "nvme"}},
                              "nvme": {{"paths": [{str(tmp_path)!r}], "grow_step": "1MiB"}}}})
engine.backward(engine(torch.randn(2, 4)).sum())
engine.step()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = json.load(open(tmp_path / "rank0" / "manifest.json"))
    assert {"0/param", "1/param", "optimizer.0/exp_avg"} <= set(manifest["tensors"]), sorted(manifest["tensors"])


@pytest.mark.parametrize("tiers", [("device",) * 3, ("nvme",) * 3])
def test_fp16_scale_backward_trains_as_engine_backward_and_a_plain_backward_is_refused(tmp_path, tiers):
    """A loop that calls loss.backward() itself (the Trainer's) on engine.scale_backward(loss):
    the same value, the same scaled gradients, so bit for bit engine.backward's training, an
    overflow skipped and the scale lowered alike. A plain loss.backward() without it is refused."""
    def run(path, scaled_loss: bool):
        torch.manual_seed(0)
        engine = infinity.initialize(_mlp(), _config(path, tiers, precision={"param_dtype": "fp16",
                                                                            "initial_scale": 2.0**18}))  # fmt: skip
        losses, stepped = [], []
        for step in range(6):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).half()
            loss = engine(x).float().pow(2).mean()
            if scaled_loss:
                wrapped = engine.scale_backward(loss)
                assert torch.equal(wrapped, loss)  # the value reported is the loss itself
                wrapped.backward()
            else:
                engine.backward(loss)
            losses.append(loss.item())
            stepped.append(engine.step())
        out = losses, stepped, engine.stats()["loss_scale"], _weights(engine)
        engine.close()
        return out

    a, b = run(tmp_path / "a", False), run(tmp_path / "b", True)
    assert a[:3] == b[:3] and False in a[1] and True in a[1]  # an overflow skipped, then steps
    assert all(torch.equal(a[3][k], b[3][k]) for k in a[3])
    torch.manual_seed(0)
    engine = infinity.initialize(_mlp(), _config(tmp_path / "c", tiers, precision={"param_dtype": "fp16"}))
    with pytest.raises(RuntimeError, match=r"needs engine.backward\(loss\).*engine.scale_backward\(loss\)"):
        engine(torch.randn(8, 16).half()).float().pow(2).mean().backward()
    engine.close()


@pytest.mark.parametrize("tiers", [("device", "device", "cpu"), ("nvme", "nvme", "nvme")], ids=["ddc", "nvme"])
@pytest.mark.parametrize("kind", ["spectral_norm", "orthogonal", "spectral_norm_hook"])
def test_a_parametrizations_buffers_take_a_low_param_dtype(tmp_path, kind, tiers):
    """spectral_norm's u and v and orthogonal's base are buffers of the parametrization: kept in
    fp32 beside bf16 weights, its matmul refused to mix them (an audit helper's repro), and so
    are the u and v of the older hook-based torch.nn.utils.spectral_norm (another's). They
    take the parameters' dtype, as model.to(torch.bfloat16) gives them, and the forward is the
    plain bf16 model's, bit for bit, step after step while the weights are equal."""
    from torch.nn.utils import parametrizations, spectral_norm

    torch.manual_seed(0)
    wrap = spectral_norm if kind == "spectral_norm_hook" else getattr(parametrizations, kind)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), wrap(nn.Linear(8, 8)), nn.Linear(8, 2))
    ref = copy.deepcopy(model).to(torch.bfloat16)
    x = torch.randn(4, 8).bfloat16()
    with infinity.initialize(model, _config(tmp_path, tiers, precision={"param_dtype": "bf16"})) as engine:
        assert {b.dtype for b in engine.module.buffers()} == {torch.bfloat16}
        for _ in range(2):  # (spectral_norm's power iteration moves u and v in each training forward)
            with torch.no_grad():
                assert torch.equal(engine(x), ref(x))
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        assert engine.step()


@pytest.mark.parametrize("tiers", [("device", "device", "cpu"), ("nvme", "nvme", "nvme")], ids=["ddc", "nvme"])
def test_a_frozen_parameter_beside_trainable_ones_is_exported_as_it_computes(tmp_path, tiers):
    """With bf16 parameters a frozen parameter computes as its bf16 rounding, and a wholly frozen
    module is exported so; one beside trainable parameters of its module was exported as the
    fp32 value it was made with (6e-4 off what trained: an audit helper's repro). Its master
    holds the rounding now: exported as it computed, unchanged by the steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    model[0].bias.requires_grad_(False)
    made = model[0].bias.detach().clone()
    with infinity.initialize(model, _config(tmp_path, tiers, precision={"param_dtype": "bf16"})) as engine:
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 8).bfloat16()).float().pow(2).mean())
            engine.step()
        got = engine.gathered_weights()
    assert torch.equal(got["0.bias"], made.bfloat16().float()) and not torch.equal(made.bfloat16().float(), made)
    # A load of new fp32 values (load_state_dict; from_pretrained streams through it) kept them
    # unrounded in the master, 1.4e-3 off what the model computed with (an audit helper's repro).
    new = torch.linspace(-1, 1, 8) + 1e-3
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    model[0].bias.requires_grad_(False)
    with infinity.initialize(model, _config(tmp_path, tiers, precision={"param_dtype": "bf16"})) as engine:
        engine.module.load_state_dict({"0.bias": new}, strict=False)
        got = engine.gathered_weights()
        with infinity.GatheredParameters([engine.module[0].bias]):
            computed = engine.module[0].bias.detach().float().clone()
    assert torch.equal(got["0.bias"], new.bfloat16().float()) and torch.equal(computed, got["0.bias"])


def test_an_attribute_the_engine_lacks_is_its_module_s(tmp_path):
    """DeepSpeed's engine gives its module's attributes (``model_engine.generate(...)``); this
    one raised AttributeError (an audit helper). A script written for it calls them so."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    plain = copy.deepcopy(model)
    ids = torch.tensor([[1, 2, 3, 4]])
    with infinity.initialize(model, _config(str(tmp_path), ("nvme",) * 3)) as engine:
        got = engine.generate(ids, max_new_tokens=6, do_sample=False)
        assert engine.can_generate() and isinstance(engine.config, infinity.TierConfig)  # (the engine's own first)
        with pytest.raises(AttributeError, match="'Engine' object has no attribute 'nope', nor has its module"):
            engine.nope
    assert torch.equal(got, plain.generate(ids, max_new_tokens=6, do_sample=False))

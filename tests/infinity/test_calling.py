"""The engine called the ways users and their frameworks call it, with no silent wrong result.

transformers' Trainer, accelerate and Lightning call the module itself and run
``loss.backward()``; models read ``weight.dtype`` before a module runs; reentrant activation
checkpointing runs forwards without grad. Each gives exactly what ``engine(...)`` with
``engine.backward`` gives, or a clear error.
"""

import copy
import os
import sys

import pytest
import torch
from torch import nn

import infinity

sys.path.insert(0, os.path.dirname(__file__))
from _common import config  # noqa: E402

transformers = pytest.importorskip("transformers")
NVME = ("nvme", "nvme", "nvme")


def _gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _ids(step):
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))


def test_calling_the_module_and_loss_backward_equals_the_engine_bit_for_bit(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = infinity.initialize(_gpt2(), config(tmp_path / "a", NVME))
    b = infinity.initialize(_gpt2(), config(tmp_path / "b", NVME))
    for step in range(3):
        ids = _ids(step)
        a.backward(a(input_ids=ids, labels=ids).loss)
        a.step()
        b.module(input_ids=ids, labels=ids).loss.backward()  # as Trainer and accelerate do
        b.step()
    wa, wb = a.gathered_weights(), b.gathered_weights()
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    a.close()
    b.close()


def _train_gpt2(tmp_path, checkpointing):
    model = _gpt2()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    model.train()
    ref = copy.deepcopy(model)
    engine = infinity.initialize(model, config(tmp_path, NVME))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(3):
        ids = _ids(step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        losses.append((loss.item(), ref_loss.item()))
    weights = engine.gathered_weights()
    engine.close()
    return losses, weights


@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
def test_activation_checkpointing_gives_the_weights_of_a_run_without_it(tmp_path, checkpointing):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    losses, weights = _train_gpt2(tmp_path / "a", checkpointing)
    _, plain = _train_gpt2(tmp_path / "b", None)
    # Against torch: fp32 rounding (the fused AdamW kernel against torch's default one).
    assert all(abs(a - b) < 1e-5 for a, b in losses), losses
    # Against the engine without checkpointing: the same arithmetic, so the same bits.
    assert weights.keys() == plain.keys()
    assert all(torch.equal(weights[k], plain[k]) for k in weights)


def test_a_released_parameter_reports_the_parameter_dtype_and_device(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with infinity.initialize(model, config(tmp_path, NVME, precision={"param_dtype": "bf16"})) as engine:
        for p in model.parameters():
            assert p.shape == (0,) and p.dtype == torch.bfloat16 and p.device == engine.device


@pytest.mark.parametrize("family", ["t5", "vit"])
def test_models_that_read_weight_dtype_before_running_train_in_bf16(tmp_path, family):
    torch.manual_seed(0)
    if family == "t5":
        cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                    decoder_start_token_id=0, dropout_rate=0.0)  # fmt: skip
        model = transformers.T5ForConditionalGeneration(cfg)
        batch = {"input_ids": _ids(0), "labels": _ids(1)}
    else:
        cfg = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, num_labels=3)  # fmt: skip
        model = transformers.ViTForImageClassification(cfg)
        batch = {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.tensor([0, 2])}
    with infinity.initialize(model, config(tmp_path, NVME, precision={"param_dtype": "bf16"})) as engine:
        for _ in range(2):
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
        assert torch.isfinite(loss)


def test_a_foreign_optimizer_on_managed_parameters_is_refused(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with infinity.initialize(model, config(tmp_path, NVME)) as engine:
        opt = torch.optim.AdamW(model.parameters())  # what Trainer(model=engine.module) makes
        engine.module(torch.randn(3, 4)).sum().backward()
        with pytest.raises(RuntimeError, match="AdamW.step.. on parameters that an infinity engine manages"):
            opt.step()
    other = nn.Linear(2, 2)  # an optimizer of parameters the engine does not manage is left alone
    torch.optim.SGD(other.parameters(), lr=0.1).step()


def test_fp16_with_a_plain_backward_is_refused_not_trained_unscaled(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with infinity.initialize(model, config(tmp_path, NVME, precision={"param_dtype": "fp16", "initial_scale": 8})) as engine:
        with pytest.raises(RuntimeError, match="needs engine.backward"):
            engine.module(torch.randn(3, 4).half()).float().sum().backward()
        engine.backward(engine(torch.randn(3, 4).half()).float().sum())  # the supported way still works
        assert engine.step()


@pytest.mark.parametrize("tiers", [("device", "device", "device"), ("device", "device", "cpu")], ids=str)
def test_a_backward_of_layers_called_outside_the_root_ends_its_pass_where_units_are_always_bound(tmp_path, tiers,
                                                                                                 caplog):  # fmt: skip
    """Where units are always bound modules have no hooks, so layers called one by one outside
    a call of the root began no pass and their backward ended none (an audit helper's repros):
    fp16's plain backward stepped on unscaled gradients, accumulation = "engine" on the sum
    of the micro-batches, and the overlap warned of "0 backward passes" at every step."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))

    def layers(engine, x):
        return engine.module[2](engine.module[1](engine.module[0](x)))

    with infinity.initialize(copy.deepcopy(model), config(tmp_path / "fp16", tiers, precision={"param_dtype": "fp16"})) as engine:
        with pytest.raises(RuntimeError, match="needs engine.backward"):
            layers(engine, torch.randn(3, 4).half()).float().sum().backward()
    cfg = config(tmp_path / "ds", tiers, optimizer={"accumulation": "engine", "gradient_accumulation_steps": 2})
    with infinity.initialize(copy.deepcopy(model), cfg) as engine:
        layers(engine, torch.randn(3, 4)).sum().backward()
        with pytest.raises(RuntimeError, match=r"came from a plain loss.backward\(\)"):
            engine.step()
    with infinity.initialize(copy.deepcopy(model), config(tmp_path / "overlap", tiers, optimizer={"overlap": True})) as engine:
        with caplog.at_level("WARNING", logger="infinity"):
            for _ in range(2):
                layers(engine, torch.randn(3, 4)).sum().backward()
                engine.step()
    assert "backward passes" not in caplog.text


def test_a_forward_that_raises_ends_its_pass_and_the_next_one_runs(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with infinity.initialize(model, config(tmp_path, NVME)) as engine:
        with pytest.raises(RuntimeError):
            engine(torch.randn(3, 5))  # wrong width
        engine.zero_grad()
        engine.backward(engine(torch.randn(3, 4)).sum())
        engine.step()


def _pair(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


@pytest.mark.parametrize("tiers", [NVME, ("device", "device", "device"), ("cpu", "nvme", "cpu")])
def test_load_state_dict_into_a_live_engine_writes_the_tiers(tmp_path, tiers):
    model = _pair(0)
    source = _pair(1).state_dict()
    ref = _pair(0)
    ref.load_state_dict(source)
    with infinity.initialize(model, config(tmp_path, tiers, optimizer={"weight_decay": 0.0})) as engine:
        result = engine.module.load_state_dict(source)
        assert result.missing_keys == [] and result.unexpected_keys == []
        got = engine.gathered_weights()
        assert all(torch.equal(got[k], source[k]) for k in source)
        opt = torch.optim.AdamW(ref.parameters(), lr=config(tmp_path, tiers)["optimizer"]["lr"], weight_decay=0.0)
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            ref_loss = ref(x).pow(2).mean()
            opt.zero_grad()
            ref_loss.backward()
            opt.step()
            assert abs(loss.item() - ref_loss.item()) < 1e-5


def test_state_dict_gives_the_weights_not_placeholders_and_round_trips(tmp_path):
    model = _pair(0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with infinity.initialize(model, config(tmp_path, NVME, precision={"param_dtype": "bf16"})) as engine:
        sd = engine.module.state_dict()
        assert sd.keys() == expected.keys()
        assert all(sd[k].dtype == torch.float32 and torch.equal(sd[k], expected[k]) for k in sd)
        fresh = _pair(5)
        fresh.load_state_dict(engine.state_dict())  # strict, into a plain module
        assert all(torch.equal(fresh.state_dict()[k], expected[k]) for k in expected)


def test_load_state_dict_reports_missing_unexpected_and_mis_shaped_keys_as_torch_does(tmp_path):
    with infinity.initialize(_pair(0), config(tmp_path, NVME)) as engine:
        sd = _pair(1).state_dict()
        del sd["2.bias"]
        sd["extra"] = torch.zeros(1)
        with pytest.raises(RuntimeError, match=r"(?s)Missing key\(s\) in state_dict: \"2.bias\".*Unexpected key\(s\) in state_dict: \"extra\""):
            engine.module.load_state_dict(sd)
        result = engine.module.load_state_dict(sd, strict=False)
        assert result.missing_keys == ["2.bias"] and result.unexpected_keys == ["extra"]
        bad = _pair(1).state_dict()
        bad["0.weight"] = torch.zeros(3, 3)
        with pytest.raises(RuntimeError, match=r"size mismatch for 0.weight: copying a param with shape \(3, 3\)"):
            engine.module.load_state_dict(bad)


class _Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


class _TwoTowers(nn.Module):
    """CLIP's shape: trained through its methods (``get_text_features``), not its forward."""

    def __init__(self):
        super().__init__()
        self.text, self.image = _Tower(), _Tower()

    def encode_text(self, x):
        return self.text(x)

    def encode_image(self, x):
        return self.image(x)

    def forward(self, a, b):
        return self.text(a), self.image(b)


def _contrastive(fa, fb):
    logits = nn.functional.normalize(fa, dim=-1) @ nn.functional.normalize(fb, dim=-1).t() / 0.1
    labels = torch.arange(fa.shape[0])
    return (nn.functional.cross_entropy(logits, labels) + nn.functional.cross_entropy(logits.t(), labels)) / 2


def _through_methods(m, step):
    g = torch.Generator().manual_seed(step)
    a, b = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    return _contrastive(m.encode_text(a), m.encode_image(b))


def _aux_then_root(m, step):
    g = torch.Generator().manual_seed(step)
    a, b = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    aux = (m.text(b) ** 2).mean()  # a submodule called on its own, then the root
    return _contrastive(*m(a, b)) + aux


def _llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _backbone_then_head(m, step):
    ids = _ids(step)
    hidden = m.model(ids).last_hidden_state  # as chunked-loss code calls a causal LM
    logits = m.lm_head(hidden)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("case", ["methods", "aux_then_root", "backbone_then_head"])
@pytest.mark.parametrize("tiers", [("nvme", "cpu", "cpu"), NVME])
def test_submodules_called_outside_the_root_train_as_plain_pytorch(tmp_path, case, tiers):
    """Each module called outside a call of the root begins a pass of its own, with the saved-
    tensor hooks that keep autograd's views of released parameters ([Note: passes begun by a
    submodule] in `_schedule`): without them the weights went 0.01-0.08 off plain PyTorch's in
    three steps, silently. Nothing is kept for backward here, so every view is of a released unit."""
    if case == "backbone_then_head":
        loss_of, model = _backbone_then_head, _llama()  # (GPT-2's key bias has no gradient: Adam amplifies noise)
    else:
        torch.manual_seed(0)
        loss_of, model = (_through_methods if case == "methods" else _aux_then_root), _TwoTowers()
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    with infinity.initialize(model, config(tmp_path, tiers, prefetch={"keep": False})) as engine:
        for step in range(3):
            engine.backward(loss_of(engine.module, step))
            engine.step()
            loss_of(plain, step).backward()
            opt.step()
            opt.zero_grad()
        weights = engine.gathered_weights()
    for name, p in plain.named_parameters():
        if name in weights:  # (tied weights appear once)
            torch.testing.assert_close(weights[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_a_submodule_call_that_raises_ends_its_pass_and_training_goes_on(tmp_path):
    torch.manual_seed(0)
    model = _TwoTowers()
    with infinity.initialize(model, config(tmp_path, NVME)) as engine:
        with pytest.raises(RuntimeError):
            engine.module.encode_text(torch.randn(3, 5))  # wrong width
        engine.zero_grad()
        engine.backward(_through_methods(engine.module, 0))
        assert engine.step()


@pytest.mark.parametrize("pattern", ["retain_graph", "gradient_penalty", "two_forwards_two_backwards"])
def test_a_backward_through_a_graph_its_last_backward_released_is_refused_by_name(tmp_path, pattern):
    """With parameters released at the end of a backward, a later backward through the same
    forward's graph found their placeholders ("The size of tensor a (0) must match ...").
    It is refused saying what and why; where parameters stay bound it trains as plain PyTorch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(8, 16, requires_grad=pattern == "gradient_penalty")
    with infinity.initialize(model, config(tmp_path, ("nvme", "cpu", "cpu"))) as engine:
        loss = engine(x).pow(2).mean()
        if pattern == "retain_graph":
            loss.backward(retain_graph=True)
        elif pattern == "gradient_penalty":
            (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
            loss = loss + grad_x.pow(2).sum()
        else:
            other = engine(x * 2).abs().mean()
            loss.backward()
            loss = other
        with pytest.raises(RuntimeError, match="a backward through a graph whose forward ran before the last backward"):
            loss.backward()
        engine.zero_grad()
        engine.backward(engine(x.detach()).pow(2).mean())  # and training goes on
        assert engine.step()


def test_a_retained_graph_where_parameters_stay_bound_trains_as_plain_pytorch(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    cfg = config(tmp_path, ("device", "device", "cpu"))
    with infinity.initialize(model, cfg, optimizer=(torch.optim.SGD, {"lr": 0.1})) as engine:
        for step in range(2):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            loss = engine(x).pow(2).mean()
            loss.backward(retain_graph=True)
            loss.backward()  # the gradient twice, as torch accumulates it
            engine.step()
            ref = plain(x).pow(2).mean()
            ref.backward(retain_graph=True)
            ref.backward()
            opt.step()
            opt.zero_grad()
        weights = engine.gathered_weights()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(weights[name], p.detach())


@pytest.mark.parametrize("tiers", [("nvme", "cpu", "cpu"), ("device", "device", "cpu"), ("device", "device", "device")])
def test_a_cast_of_the_module_is_refused_and_training_goes_on_as_plain_pytorch(tmp_path, tiers):
    """model.to(torch.bfloat16) on an engine's module: released parameters took the dtype on
    their empty placeholders only (dropped at the next fetch), bound ones became copies that
    trained apart from the engine's weights. Refused, naming the parameter; the module's
    parameters are the engine's again after, and training matches plain PyTorch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    with infinity.initialize(model, config(tmp_path, tiers)) as engine:
        for step in range(3):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            engine.backward(engine(x).sum())
            engine.step()
            plain(x).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                with pytest.raises(RuntimeError, match=r"parameter '\d.\w+' cast to torch.bfloat16"):
                    model.to(torch.bfloat16)
                    with torch.no_grad():
                        engine(x.bfloat16())
                assert all(p.dtype == torch.float32 for p in model.parameters())
        weights = engine.gathered_weights()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(weights[name], p.detach())


class _Sometimes(nn.Module):
    """``shift`` is used on even steps only: torch.optim leaves it alone on the others."""

    def __init__(self):
        super().__init__()
        self.scale, self.shift = nn.Parameter(torch.ones(4)), nn.Parameter(torch.zeros(4))

    def forward(self, x, step):
        return x * self.scale + (self.shift if step % 2 == 0 else 0)


def test_a_parameter_without_a_gradient_beside_ones_with_is_said_once(tmp_path, caplog):
    """The engine steps a module's parameters together, so a parameter its module used on some
    steps only moves on a zero gradient (weight decay, momentum) where torch.optim would skip
    it: documented, and now said, once, naming it. Nothing is said where every parameter of a
    module that got gradients got one."""
    model = _Sometimes()
    with infinity.initialize(model, config(tmp_path, ("device", "device", "cpu"))) as engine:
        with caplog.at_level("WARNING", logger="infinity"):
            for step in range(4):
                engine.backward(engine(torch.randn(2, 4), step).sum())
                engine.step()
    said = [r.getMessage() for r in caplog.records if "got no gradient this step" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("parameter 'shift'"), said
    caplog.clear()
    torch.manual_seed(0)
    with infinity.initialize(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), config(tmp_path, NVME)) as engine:
        with caplog.at_level("WARNING", logger="infinity"):
            for step in range(2):
                engine.backward(engine(torch.randn(2, 4)).sum())
                engine.step()
    assert not [r for r in caplog.records if "got no gradient this step" in r.getMessage()]


@pytest.mark.parametrize("tiers", [("nvme", "cpu", "cpu"), ("device", "device", "cpu")])
def test_a_batchnorm_model_runs_in_bf16_as_the_model_cast_to_bf16(tmp_path, tiers):
    """precision.param_dtype = "bf16" left BatchNorm's running statistics in fp32, and the first
    forward failed in batch_norm ("expected scalar type BFloat16 but found Float"): they take
    the parameters' dtype, as model.to(torch.bfloat16) gives them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.BatchNorm1d(16), nn.Linear(16, 2))
    plain = copy.deepcopy(model).to(torch.bfloat16)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    with infinity.initialize(model, config(tmp_path, tiers, precision={"param_dtype": "bf16"})) as engine:
        assert model[2].running_mean.dtype == torch.bfloat16 and model[2].num_batches_tracked.dtype == torch.int64
        out = engine(x)
        assert torch.equal(out, plain(x))
        assert torch.equal(model[2].running_mean, plain[2].running_mean)
        engine.backward(out.float().pow(2).mean())
        assert engine.step()


def test_a_backbone_called_alone_is_one_pass_not_one_per_layer(tmp_path):
    """``model.model(ids)`` holds none of a unit's parameters itself: its call is the pass (the
    guard once, the order its own), where each leaf module's call was a pass of its own, 3x
    slower for a Llama backbone with params on nvme."""
    model = _llama()
    with infinity.initialize(model, config(tmp_path, ("nvme", "cpu", "cpu"))) as engine:
        passes = []
        check = engine.scheduler._before_forward
        engine.scheduler._before_forward = lambda: (passes.append(1), check())
        with torch.no_grad():
            hidden = model.model(_ids(0)).last_hidden_state
            model.lm_head(hidden)
        assert len(passes) == 2

"""infinity.build: a model constructed straight into the params tier, and what it opened."""

import contextlib
import os
import sys

import pytest
import torch
from torch import nn

import infinity
from infinity.swap import SwapSpace

sys.path.insert(0, os.path.dirname(__file__))
from _common import config, train, trains_as_plain  # noqa: E402


class _Boom(RuntimeError):
    pass


def test_a_build_block_that_raises_leaves_the_swap_directory_unlocked_and_reusable(tmp_path):
    cfg = config(tmp_path, ("nvme", "nvme", "nvme"))
    with pytest.raises(_Boom):
        with infinity.build(cfg):
            nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
            raise _Boom("the model's constructor failed")
    # The lock is gone: another space opens on the same directory, in this process ...
    SwapSpace(str(tmp_path), fresh=True).close()
    # ... and so do a new build and an engine that trains on it.
    with infinity.build(cfg):
        model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    with infinity.initialize(model, cfg) as engine:
        losses = train(engine, 2)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_a_built_model_trains_as_the_same_model_built_in_memory(tmp_path):
    cfg = config(tmp_path / "a", ("nvme", "nvme", "nvme"))
    (tmp_path / "a").mkdir()
    torch.manual_seed(0)
    with infinity.build(cfg):
        built = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    with infinity.initialize(built, cfg) as a, infinity.initialize(plain, config(tmp_path, ("device",) * 3)) as b:
        assert train(a, 3) == train(b, 3)


def _peak_rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def test_a_constructor_that_makes_every_layer_at_once_takes_no_memory(tmp_path):
    """64 layers of 2048 x 2048 (1 GiB of fp32) made in one list comprehension: on the meta device."""
    import gc

    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) from here
    rss = int(open("/proc/self/statm").read().split()[1]) * 4096
    with infinity.build():
        model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(64)])
    assert all(p.is_meta for p in model.parameters())
    assert _peak_rss() - rss < 64 << 20  # the real layers would be 1 GiB


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_built_transformers_model_is_initialised_as_a_normal_one(tmp_path, family):
    """The model's own initialisation, per unit: every tensor's std within 5% of a normally built
    model's (the values are other draws of the same distributions), GPT-2's tied lm_head, and
    the first loss within 2%."""
    transformers = pytest.importorskip("transformers")
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1000, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)  # fmt: skip
        make = lambda: transformers.GPT2LMHeadModel(cfg)  # noqa: E731
    else:
        cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        make = lambda: transformers.LlamaForCausalLM(cfg)  # noqa: E731
    torch.manual_seed(0)
    plain = make()
    with infinity.build():
        model = make()
    if family == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # tied on the meta device too
    with infinity.initialize(model, config(tmp_path, ("nvme", "nvme", "nvme"))) as engine:
        got = engine.gathered_weights()
        for name, p in plain.named_parameters():
            if name in got and p.numel() >= 128 and p.detach().std() > 0:
                assert abs(got[name].std() / p.detach().std() - 1) < 0.05, name
            elif name in got:  # biases and norms start at constants: exactly those
                assert torch.equal(got[name], p.detach()), name
        ids = torch.randint(0, 1000, (4, 32), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            loss, want = engine(input_ids=ids, labels=ids).loss.item(), plain(input_ids=ids, labels=ids).loss.item()
        assert abs(loss - want) / want < 0.02, (loss, want)


def _made(how, cfg):
    """The same small model, given to an engine by `initialize` or by `build` + `initialize`."""
    torch.manual_seed(0)
    with infinity.build() if how == "build" else contextlib.nullcontext():
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    return infinity.initialize(model, cfg)


@pytest.mark.parametrize("how", ["initialize", "build"])
def test_every_engine_refuses_a_foreign_optimizer_and_a_second_initialize(tmp_path, how):
    """A built model's placeholders carry the engine's mark as an initialized one's do: without
    it a torch AdamW stepped empty placeholders and a second initialize trained empty tensors."""
    cfg = config(tmp_path, ("nvme", "nvme", "nvme"))
    with _made(how, cfg) as engine:
        assert all(p.shape == (0,) for p in engine.module.parameters())  # placeholders, not weights
        opt = torch.optim.AdamW(engine.module.parameters())
        engine.module(torch.randn(8, 16)).sum().backward()
        with pytest.raises(RuntimeError, match=r"AdamW.step\(\) on parameters that an infinity engine manages"):
            opt.step()
        engine.zero_grad()
        with pytest.raises(ValueError, match="already given to infinity.initialize .parameter '0.weight'"):
            infinity.initialize(engine.module, config(tmp_path / "again", ("nvme", "nvme", "nvme")))


def test_parameters_with_values_of_their_own_keep_them_beside_a_built_model(tmp_path):
    """What did not come from build keeps its values through the model's init pass: a real
    parameter added to a built module (its unit is part meta, part real), and a real module put
    into a built GPT-2 where an ancestor's init reaches it (GPT2Attention's init scales its
    c_proj: it drew over the real one's values)."""
    transformers = pytest.importorskip("transformers")
    with infinity.build():
        seq = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    seq[0].scale = nn.Parameter(torch.full((32,), 3.0))
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    with infinity.build():
        gpt2 = transformers.GPT2LMHeadModel(cfg)
    proj = transformers.pytorch_utils.Conv1D(32, 32)
    with torch.no_grad():
        proj.weight.copy_(torch.arange(32 * 32, dtype=torch.float32).view(32, 32) / 1024)
        proj.bias.fill_(0.5)
    gpt2.transformer.h[0].attn.c_proj = proj
    want = {k: v.clone() for k, v in proj.state_dict().items()}  # the module's own go at initialize
    with infinity.initialize(seq, config(tmp_path / "a", ("nvme",) * 3)) as a:
        assert torch.equal(a.gathered_weights()["0.scale"], torch.full((32,), 3.0))
    with infinity.initialize(gpt2, config(tmp_path / "b", ("nvme",) * 3)) as b:
        got = b.gathered_weights()
        assert torch.equal(got["transformer.h.0.attn.c_proj.weight"], want["weight"])
        assert torch.equal(got["transformer.h.0.attn.c_proj.bias"], want["bias"])
        assert 0 < got["transformer.h.1.attn.c_proj.weight"].std() < 0.05  # the built one: the model's init


class _LayerNorm(nn.Module):
    """nanoGPT's: its weight made by torch.ones, no reset_parameters."""

    def __init__(self, ndim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim))

    def forward(self, x):
        return nn.functional.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = _LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(3 * d, d)

    def forward(self, x):
        return x + self.c_proj(torch.relu(self.c_attn(self.ln(x))))


class _NanoGPT(nn.Module):
    """nanoGPT's init: apply(_init_weights) after construction, then a scaled c_proj."""

    def __init__(self, vocab=256, d=128, n_layer=3):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList([_Block(d) for _ in range(n_layer)])
        self.ln_f = _LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as nanoGPT's
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / (2 * n_layer) ** 0.5)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, ids):
        x = self.wte(ids)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class _Titan(nn.Module):
    """torchtitan's way: made on the meta device, then init_weights() (trunc_normal_, norms to
    ones through .data, an in-place scale) called by the user inside the build block."""

    def __init__(self, d=128, n_layer=3):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(n_layer)])
        self.norm = nn.RMSNorm(d)
        self.out = nn.Linear(d, d, bias=False)

    def init_weights(self):
        for i, layer in enumerate(self.layers):
            nn.init.trunc_normal_(layer.weight, mean=0.0, std=0.02 / (i + 1))
            nn.init.zeros_(layer.bias)
        self.norm.weight.data.fill_(1.0)
        nn.init.trunc_normal_(self.out.weight, std=0.5, a=-1.0, b=1.0)
        with torch.no_grad():
            self.out.weight.mul_(0.1)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.out(self.norm(x))


def _compare_with_plain(engine, plain, tol=0.05):
    """Every tensor's std within ``tol`` of the plain model's (other draws of the same
    distribution), constants exactly; returns the gathered weights."""
    got = engine.gathered_weights()
    assert set(got) >= {n for n, _ in plain.named_parameters()}
    for name, p in plain.named_parameters():
        want = p.detach()
        if want.std() > 0:
            assert abs(got[name].std() / want.std() - 1) < tol, (name, got[name].std().item(), want.std().item())
            assert abs(got[name].mean() - want.mean()) < 0.1 * want.std(), name
        else:
            assert torch.equal(got[name], want), name
    return got


def test_a_model_that_initialises_itself_after_construction_keeps_its_own_init(tmp_path):
    """nanoGPT: apply(_init_weights) + scaled c_proj, and a LayerNorm made of torch.ones without
    reset_parameters (it was refused; the rest got torch's defaults: wte's std 1.0, not 0.02)."""
    torch.manual_seed(0)
    plain = _NanoGPT()
    torch.manual_seed(0)
    with infinity.build():
        model = _NanoGPT()
    with infinity.initialize(model, config(tmp_path, ("nvme",) * 3)) as engine:
        got = _compare_with_plain(engine, plain)
        assert abs(got["wte.weight"].std() - 0.02) < 0.001
        assert abs(got["h.0.c_proj.weight"].std() - 0.02 / 6**0.5) < 0.0005
        assert torch.equal(got["ln_f.weight"], torch.ones(128))
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            loss = nn.functional.cross_entropy(engine(ids).flatten(0, 1), ids.flatten())
            want = nn.functional.cross_entropy(plain(ids).flatten(0, 1), ids.flatten())
        assert abs(loss.item() - want.item()) / want.item() < 0.02, (loss.item(), want.item())


def test_a_model_made_on_meta_and_initialised_by_init_weights_in_the_block_gets_that_init(tmp_path):
    """torchtitan: torch.device('meta') + model.init_weights() inside build()."""
    torch.manual_seed(0)
    plain = _Titan()
    plain.init_weights()
    torch.manual_seed(0)
    with infinity.build():
        with torch.device("meta"):
            model = _Titan()
        model.init_weights()
    with infinity.initialize(model, config(tmp_path, ("nvme",) * 3)) as engine:
        got = _compare_with_plain(engine, plain)
        assert abs(got["layers.2.weight"].std() - 0.02 / 3) < 0.0005
        assert got["out.weight"].abs().max() <= 0.1  # truncated at 1.0, then scaled


def test_a_constructor_initialised_model_is_bit_equal_to_a_plain_build(tmp_path):
    """Linear's reset_parameters in its constructor, Embedding's zeroed padding row (a write to
    a view of the weight), a LayerNorm, a torch.full parameter: each drawn in unit order, so
    the recorded calls draw exactly what the plain build drew."""

    def make():
        torch.manual_seed(3)  # inside the block too: the model seeds itself
        m = nn.Sequential(nn.Embedding(10, 16, padding_idx=0), nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
        m[2].gain = nn.Parameter(torch.full((32,), 2.0))
        return m

    plain = make()
    with infinity.build():
        model = make()
    with infinity.initialize(model, config(tmp_path, ("nvme",) * 3)) as engine:
        got = engine.gathered_weights()
        for name, p in plain.named_parameters():
            assert torch.equal(got[name], p.detach()), name


def test_an_init_that_cannot_be_done_again_is_an_error_at_the_end_of_the_block():
    """Copying one built parameter into another: the source has no values until initialize."""
    with pytest.raises(ValueError, match=r"Tensor.copy_ writes parameter 'Linear.weight' \(4, 4\) from another tensor"):
        with infinity.build():
            a, b = nn.Linear(4, 4), nn.Linear(4, 4)
            with torch.no_grad():
                b.weight.copy_(a.weight)
    with pytest.raises(ValueError, match=r"torch.nn.init.normal_ writes parameter 'Linear.bias' \(4,\) from another"):
        with infinity.build():
            a = nn.Linear(4, 4)
            nn.init.normal_(a.bias, std=a.weight.std())


@pytest.mark.parametrize("how", ["parameter-computed", "out=", "foreach"])
def test_writes_build_cannot_do_again_are_errors_at_the_end_of_the_block(how):
    """A parameter made of another built one's values (nn.Parameter(w.data * 0.1)), a write
    through out=, a torch._foreach_ in-place call: none recorded, each lost with nothing said
    (the module's reset_parameters() in their place, or torch.empty's memory; an audit helper's
    repros). Each is an error naming the parameter."""
    said = {"parameter-computed": r"parameter 'Linear.weight' \(4, 4\) is registered with values computed from another "
                                  r"built parameter \(mul of parameter 'Linear.weight'",
            "out=": r"torch.normal\(..., out=...\) writes parameter 'Linear.weight' \(4, 4\)",
            "foreach": r"torch._foreach_mul_ writes parameter 'Linear.weight' \(4, 4\)"}[how]  # fmt: skip
    with pytest.raises(ValueError, match=said):
        with infinity.build():
            m = nn.Linear(4, 4)
            with torch.no_grad():
                if how == "parameter-computed":
                    m.weight = nn.Parameter(m.weight.data * 0.1)
                elif how == "out=":
                    torch.normal(0.0, 1.0, size=(4, 4), out=m.weight.data)
                else:
                    torch._foreach_mul_([m.weight], 0.01)


class _WithRecurrence(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru, self.lstm, self.out = nn.GRU(8, 16, batch_first=True), nn.LSTM(16, 8, batch_first=True), nn.Linear(8, 2)
        self.register_buffer("scale", torch.full((2,), 0.5))

    def forward(self, x):
        return self.out(self.lstm(self.gru(x)[0])[0]) * self.scale


def test_a_built_gru_and_lstm_train_as_plain_ones(tmp_path):
    """An RNN keeps weak references to its weights, which torch.utils.swap_tensors refuses:
    a built GRU failed at initialize with "Cannot swap t1 because it has weakref associated
    with it" (an audit helper's repro). Now bit-equal to a plain build, and it trains as one."""
    torch.manual_seed(0)
    plain = _WithRecurrence()
    torch.manual_seed(0)
    with infinity.build():
        built = _WithRecurrence()
    x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(1))
    with infinity.initialize(built, config(tmp_path, ("nvme",) * 3)) as engine:
        trains_as_plain(engine, plain, x)


def test_a_buffer_computed_from_a_built_parameter_is_refused_by_name(tmp_path):
    """A buffer made from a built parameter's values is on the meta device with it: initialize
    failed late, in the buffers' move, with torch's "Cannot copy out of meta tensor" naming
    nothing (an audit helper's repro)."""
    with infinity.build():
        model = nn.Sequential(nn.Linear(4, 4))
        model[0].register_buffer("ref", model[0].weight.detach().clone())
    with pytest.raises(ValueError, match=r"buffer '0.ref' \(4, 4\) is on the meta device, without values"):
        infinity.initialize(model, config(tmp_path, ("cpu",) * 3))


class _Scaled(nn.Linear):
    """A parameter computed in the constructor (128 KiB, beyond what build keeps) that the
    module's reset_parameters() does not make: it got that init's values without a word."""

    def __init__(self):
        super().__init__(256, 128)
        self.mix = nn.Parameter(torch.randn(128, 256) * 0.02)


def test_a_large_parameter_with_constructor_values_and_no_init_in_the_block_is_refused_by_name(tmp_path):
    with infinity.build():
        model = nn.Sequential(_Scaled())
    with pytest.raises(ValueError, match=r"parameter '0.mix' \(128, 256\) was registered inside infinity.build with values"):
        infinity.initialize(model, config(tmp_path, ("nvme",) * 3))
    with infinity.build():  # initialised in the block: recorded, so it is not refused
        model = nn.Sequential(_Scaled())
        nn.init.normal_(model[0].mix, std=0.02)
    with infinity.initialize(model, config(tmp_path / "b", ("nvme",) * 3)) as engine:
        assert abs(engine.gathered_weights()["0.mix"].std() - 0.02) < 0.001


def _built_and_plain_equal(tmp_path, built: nn.Module, plain: nn.Module) -> None:
    with infinity.initialize(built, config(tmp_path, ("cpu",) * 3)) as engine:
        got = engine.gathered_weights()
    for name, p in plain.named_parameters():
        assert torch.equal(got[name], p.detach()), name


class _FromOneGenerator(nn.Module):
    """Two parameters the constructor draws from one torch.Generator, and between them a layer
    drawn from the global generator after a reseed."""

    def __init__(self, gen: torch.Generator):
        super().__init__()
        self.a = nn.Parameter(torch.empty(8, 8))
        nn.init.normal_(self.a, generator=gen)
        torch.manual_seed(7)
        self.b = nn.Linear(8, 8)
        self.c = nn.Parameter(torch.empty(8, 8))
        nn.init.normal_(self.c, generator=gen)


def test_draws_from_one_generator_and_after_a_reseed_are_a_plain_builds(tmp_path):
    """Each init call with a generator replayed from that generator's state at its own call:
    nothing moves a generator on the meta device, so a second call replayed the first one's
    draws, and two weights came out equal (an audit helper's repro). Calls that share a
    generator now draw on from one another, and a torch.manual_seed between a constructor's
    layers counts for the layers after it (only the first state counted): bit for bit a plain
    build."""
    torch.manual_seed(0)
    plain = _FromOneGenerator(torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    with infinity.build():
        built = _FromOneGenerator(torch.Generator().manual_seed(5))
    _built_and_plain_equal(tmp_path, built, plain)
    assert not torch.equal(plain.a, plain.c)


def test_models_built_one_after_another_get_their_own_values_and_the_stream_moves_on(tmp_path):
    """Nothing is drawn in the block, so the random state stayed where it began: two models
    built after one seed came out equal, and the numbers drawn after the block (data, dropout)
    were the very ones the weights were drawn from (an audit helper's repro). Models built in
    one block draw on from one another at initialize (a plain build's values, initialised in
    order); after the block the generator goes on from a stream apart from the weights',
    the same on every run, so a model in a second block gets other values."""

    def make():
        return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))

    torch.manual_seed(0)
    plain = [make(), make()]
    torch.manual_seed(0)
    with infinity.build():
        built = [make(), make()]
    after = torch.rand(64)
    second_block = []
    for _ in range(2):
        with infinity.build():
            second_block.append(make())
    for i, (b, p) in enumerate(zip(built, plain)):
        _built_and_plain_equal(tmp_path / str(i), b, p)
    torch.manual_seed(0)
    with infinity.build():
        make()
    assert torch.equal(torch.rand(64), after)  # the same stream on every run
    torch.manual_seed(0)
    assert not torch.equal(torch.rand(64), after)  # not the one the weights come from
    got = []
    for i, m in enumerate(second_block):
        with infinity.initialize(m, config(tmp_path / f"s{i}", ("cpu",) * 3)) as engine:
            got.append(engine.gathered_weights())
    assert not torch.equal(got[0]["0.weight"], got[1]["0.weight"])


def test_an_init_pass_after_a_reseed_draws_from_the_reseeded_state(tmp_path):
    """A model that reseeds, then initialises every layer again (nanoGPT's apply(init) after a
    torch.manual_seed): the values come from the reseeded state, as a plain build's do, not
    from the state the constructor's own inits saw."""

    def make():
        m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        torch.manual_seed(11)
        for layer in m:
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)
        return m

    torch.manual_seed(0)
    plain = make()
    torch.manual_seed(0)
    with infinity.build():
        built = make()
    _built_and_plain_equal(tmp_path, built, plain)

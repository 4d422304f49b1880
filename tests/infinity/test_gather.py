"""Parameters used outside their modules: a released placeholder refuses the read, naming the
parameter; `infinity.GatheredParameters` makes the read right and its gradients exact.

The model is TRL's fused LM head in small: a backbone, then ``F.linear(h, head.weight,
head.bias)`` outside ``head``'s forward. Numbers are compared with plain PyTorch on the same
model and data at 1e-5 (fp32 AdamW, the engine with torch's fused kernel: rounding only).
"""

import contextlib

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import infinity
from infinity._runtime import _UnitView

from ._common import GivesNoGrad, config


class _FusedHead(nn.Module):
    """Reads ``head``'s parameters directly, as TRL's fused LM head does, gathering them
    through ``gather`` (a context manager factory) when given."""

    def __init__(self, vocab=200, width=16, gather=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)
        self.gather = gather

    def forward(self, ids):
        h = torch.tanh(self.body(self.embed(ids)))
        if self.gather is None:
            return F.linear(h, self.head.weight, self.head.bias)
        with self.gather([self.head.weight, self.head.bias]):
            return F.linear(h, self.head.weight, self.head.bias)


def _gathered(params):
    return infinity.GatheredParameters(params)


def _model(gather=None, tied=False):
    torch.manual_seed(0)
    m = _FusedHead(gather=gather)
    if tied:
        m.head.weight = m.embed.weight
    return m


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 200, (4, 6), generator=g), torch.randint(0, 200, (4, 6), generator=g)


def _loss(model, step):
    ids, labels = _batch(step)
    return F.cross_entropy(model(ids).reshape(-1, 200), labels.reshape(-1))


def _plain(steps, tied=False, model=None):
    model = _model(tied=tied) if model is None else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(steps):
        loss = _loss(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _nvme(tmp_path, **sections):
    (tmp_path / "swap").mkdir(parents=True, exist_ok=True)
    return config(tmp_path / "swap", ("nvme", "nvme", "nvme"), **sections)


def test_a_placeholder_read_outside_its_module_is_refused_naming_the_parameter(tmp_path):
    engine = infinity.initialize(_model(), _nvme(tmp_path))
    try:
        ids, _ = _batch(0)
        with pytest.raises(RuntimeError, match=r"'head\.weight'.*GatheredParameters"):
            engine(ids)
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"'head\.weight'"):
            engine(ids)  # no backward to fail later: refused at the read itself
        # Refused before anything ran: the engine trains on once the model gathers.
        engine.module.gather = _gathered
        loss = _loss(engine, 0)
        engine.backward(loss)
        engine.step()
    finally:
        engine.close()


def test_a_placeholder_saved_for_backward_is_refused_naming_it(tmp_path):
    class Saves(torch.autograd.Function):  # reads nothing in forward, as a kernel over 0 rows would
        @staticmethod
        def forward(ctx, h, w):
            ctx.save_for_backward(w)
            return h.sum(-1)

        @staticmethod
        def backward(ctx, g):
            return None, None

    class M(_FusedHead):
        def forward(self, ids):
            return Saves.apply(self.body(self.embed(ids)), self.head.weight)

    torch.manual_seed(0)
    engine = infinity.initialize(M(), _nvme(tmp_path))
    try:
        with pytest.raises(RuntimeError, match=r"'head\.weight'"):
            engine(_batch(0)[0])
    finally:
        engine.close()


@pytest.mark.parametrize("through", ["data", "detach"])
def test_a_placeholder_s_data_and_detach_are_placeholders_too(tmp_path, through):
    """``p.data`` and ``p.detach()`` of a released parameter are its empty memory: a read
    through them (a norm) or a write (transformers' ``weight.data.normal_()``, a clamp) is
    refused naming the parameter, as one through ``p`` is, where it read zeros and wrote
    nowhere; their metadata stays readable, and gathered they are the values."""
    engine = infinity.initialize(_model(), _nvme(tmp_path))
    try:
        w = engine.module.head.weight

        def view():
            return w.data if through == "data" else w.detach()

        assert view().dtype == torch.float32 and view().device.type == "cpu"
        for use in (lambda t: t.norm(), lambda t: t.sum(), lambda t: t.normal_(0, 0.02), lambda t: t.clamp_(-0.01, 0.01)):
            with pytest.raises(RuntimeError, match=r"'head\.weight'.*load_state_dict"):
                use(view())
        with infinity.GatheredParameters([w]):
            assert view().shape == w.shape and torch.equal(view(), w) and view().norm() > 0
        engine.module.gather = _gathered
        loss = _loss(engine, 0)  # nothing was written: training goes on
        engine.backward(loss)
        engine.step()
    finally:
        engine.close()


def test_metadata_of_a_placeholder_stays_readable(tmp_path):
    engine = infinity.initialize(_model(), _nvme(tmp_path))
    try:
        w = engine.module.head.weight
        assert isinstance(w, nn.Parameter) and w.dtype == torch.float32 and w.device.type == "cpu"
        assert w.requires_grad and w.shape == (0,) and w.grad is None
        with torch.no_grad():
            engine.module.to("cpu")  # what Trainer and accelerate do
    finally:
        engine.close()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_training_through_gathered_parameters_matches_plain_pytorch(tmp_path, tied):
    want, want_params = _plain(4, tied=tied)
    engine = infinity.initialize(_model(gather=_gathered, tied=tied), _nvme(tmp_path))
    try:
        _train_and_compare(engine, 4, want, want_params)
    finally:
        engine.close()


def test_a_tiled_parameter_is_gathered_whole_and_its_gradient_reaches_every_tile(tmp_path):
    want, want_params = _plain(3)
    # 200 x 17 fp32 is 13600 bytes: tiles of 4 KiB (60 rows) cut the head into 4 units.
    engine = infinity.initialize(_model(gather=_gathered), _nvme(tmp_path, memory={"tile_size": 4096}))
    try:
        assert sum(u.path == "head" for u in engine.units) == 4
        _train_and_compare(engine, 3, want, want_params)
        w = engine.module.head.weight
        assert w.shape == (0,)  # a placeholder again after the context
    finally:
        engine.close()


def test_gathered_parameters_read_the_values_in_the_tiers_and_release_them_after(tmp_path):
    model = _model()
    want = model.head.weight.detach().clone()
    engine = infinity.initialize(model, _nvme(tmp_path))
    try:
        head = engine.module.head
        with infinity.GatheredParameters(head.parameters()):
            torch.testing.assert_close(head.weight.detach(), want, rtol=0, atol=0)
            torch.testing.assert_close(head(torch.eye(16)).detach(), want.T + head.bias.detach(), rtol=0, atol=0)
        assert head.weight.shape == (0,)
        with infinity.GatheredParameters([torch.ones(2), None], enabled=True):
            pass  # tensors no engine holds are left alone
        with infinity.GatheredParameters(head.parameters(), enabled=False):
            assert head.weight.shape == (0,)
    finally:
        engine.close()


def test_modifier_rank_is_refused_naming_it(tmp_path):
    engine = infinity.initialize(_model(), _nvme(tmp_path))
    try:
        with pytest.raises(ValueError, match="modifier_rank=0"):
            infinity.GatheredParameters(engine.module.head.parameters(), modifier_rank=0)
    finally:
        engine.close()


@pytest.mark.parametrize("tiers,memory", [(("nvme", "nvme", "nvme"), {}), (("device", "device", "device"), {}),
                                          (("nvme", "nvme", "nvme"), {"tile_size": "4KiB"})],
                         ids=["nvme", "device", "tiled"])  # fmt: skip
def test_a_write_inside_gathered_parameters_is_refused_at_the_exit_naming_it(tmp_path, tiers, memory):
    """A write inside reached some of the engine's copies and not others (params on nvme: the
    next forward computed with it, the master weights never had it, 0.017 from either outcome
    a step later), was kept where the parameter is bound, dropped where it is assembled from
    tiles (an audit helper's repros). Refused at the exit; a read-only context is not."""
    (tmp_path / "swap").mkdir()
    engine = infinity.initialize(_model(), config(tmp_path / "swap", tiers, memory=memory))
    try:
        head = engine.module.head
        with infinity.GatheredParameters([head.weight, head.bias]):
            head(torch.eye(16)).sum()  # reads
        with pytest.raises(RuntimeError, match="'head.weight' written in place inside infinity.GatheredParameters"):
            with infinity.GatheredParameters([head.weight, head.bias]):
                with torch.no_grad():
                    head.weight.mul_(0.5)
    finally:
        engine.close()


def test_a_gathered_unit_saved_for_backward_is_kept_by_position(tmp_path):
    """The saved weight is packed as a view of its unit (by the first handler of the saved-tensor
    hooks), not kept as the parameter, whose data is a placeholder again by backward time."""
    seen = []
    engine = infinity.initialize(_model(gather=_gathered), _nvme(tmp_path))
    try:
        saved = engine.scheduler.saved
        pack = saved.pack
        saved.pack = lambda t: seen.append(pack(t)) or seen[-1]
        ids, labels = _batch(0)
        engine.backward(F.cross_entropy(engine(ids).reshape(-1, 200), labels.reshape(-1)))
        assert any(isinstance(getattr(s, "value", s), _UnitView) and s.value.unit.path == "head" for s in seen)
        engine.step()
    finally:
        engine.close()


class _LookupHead(_FusedHead):
    """Looks rows of ``head.weight`` up: the lookup's backward reads no weight, so the unit is
    released again when autograd accumulates the weight's (dense) gradient."""

    def __init__(self, gather=None):
        super().__init__(gather=gather)
        self.register_buffer("mix", torch.randn(200))

    def forward(self, ids):
        h = torch.tanh(self.body(self.embed(ids))).sum(-1, keepdim=True)
        with self.gather([self.head.weight]) if self.gather else contextlib.nullcontext():
            return (h + F.embedding(ids, self.head.weight).sum(-1, keepdim=True)) * self.mix


def test_a_gradient_into_a_parameter_released_again_reaches_the_engine(tmp_path):
    def run(model, step_fn):
        losses = []
        for step in range(3):
            loss = _loss(model, step)
            step_fn(loss)
            losses.append(loss.item())
        return losses

    torch.manual_seed(0)
    plain = _LookupHead()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    want = run(plain, lambda loss: (loss.backward(), opt.step(), opt.zero_grad()))
    torch.manual_seed(0)
    engine = infinity.initialize(_LookupHead(gather=_gathered), _nvme(tmp_path))
    try:
        got = run(engine, lambda loss: (engine.backward(loss), engine.step()))
        assert got == pytest.approx(want, abs=1e-5)
        head = engine.gathered_weights()["head.weight"]
        torch.testing.assert_close(head, plain.head.weight.detach(), atol=1e-5, rtol=0)
        assert engine.module.head.weight.shape == (0,)  # the stand-in went: a placeholder again
    finally:
        engine.close()


def _train_and_compare(engine, steps, want, want_params) -> None:
    """Train ``steps`` steps; the losses and final weights must be plain PyTorch's (1e-5)."""
    got = []
    for step in range(steps):
        loss = _loss(engine, step)
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
    assert got == pytest.approx(want, abs=1e-5)
    for name, value in engine.gathered_weights().items():
        torch.testing.assert_close(value, want_params[name], atol=1e-5, rtol=0)


# 200 x 17 fp32 is 13600 bytes: tiles of 4 KiB (60 rows) cut the head into 4 units (and the
# embedding into 4).
_TILES = {"tile_size": 4096}


class _Calls(_FusedHead):
    """Runs ``head`` as a module (tiled: its own Function, given the placeholder weight as an
    input); with ``gather``, also reads ``head.weight`` itself, gathered, in the same forward."""

    def forward(self, ids):
        h = torch.tanh(self.body(self.embed(ids)))
        out = self.head(h)
        if self.gather is None:
            return out
        with self.gather([self.head.weight]):
            return out + 0.5 * F.linear(h, self.head.weight)


def _calls(gather=None, dtype=torch.float32):
    torch.manual_seed(0)
    return _Calls(gather=gather).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_read_only_gather_of_a_tiled_trainable_weight_leaves_training_exact(tmp_path, dtype):
    """A tiled module's Function gives its placeholder weight no gradient, and autograd runs
    the weight's hooks for that too: the hooks a gather left on it must let it pass. Training
    with a gather before every step is bit-identical to training without one."""
    precision = {"param_dtype": "bf16"} if dtype is torch.bfloat16 else {}
    runs = {}
    for name in ("gathered", "never"):
        engine = infinity.initialize(_calls(dtype=dtype), _nvme(tmp_path / name, memory=_TILES, precision=precision))
        try:
            assert sum(u.path == "head" for u in engine.units) == 4
            head, losses = engine.module.head, []
            for step in range(3):
                if name == "gathered":
                    before = engine.gathered_weights()["head.weight"].to(dtype)
                    with infinity.GatheredParameters(head.parameters()):
                        seen = head.weight.detach().clone()
                    assert torch.equal(seen, before)
                loss = _loss(engine, step)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            runs[name] = losses, engine.gathered_weights()
        finally:
            engine.close()
    assert runs["gathered"][0] == runs["never"][0]
    for key, value in runs["never"][1].items():
        assert torch.equal(runs["gathered"][1][key], value), key
    if dtype is torch.float32:
        want, want_params = _plain(3, model=_calls())
        assert runs["gathered"][0] == pytest.approx(want, abs=1e-5)
        for key, value in runs["gathered"][1].items():
            torch.testing.assert_close(value, want_params[key], atol=1e-5, rtol=0)


@pytest.mark.parametrize("memory", [_TILES, {}], ids=["tiled", "whole"])
def test_nested_gathers_keep_the_weight_whole_until_the_outermost_exits(tmp_path, memory):
    model = _model()
    want = model.head.weight.detach().clone()
    engine = infinity.initialize(model, _nvme(tmp_path, memory=memory))
    try:
        assert any(u.is_tile for u in engine.units) == bool(memory)
        head = engine.module.head
        with infinity.GatheredParameters([head.weight]):
            with infinity.GatheredParameters(head.parameters()):
                assert torch.equal(head.weight.detach(), want)
            # The inner exit leaves the outer context its whole weight, not an empty tensor.
            assert torch.equal(head.weight.detach().clone(), want)
            with infinity.GatheredParameters([head.weight]):
                pass
            assert torch.equal(head.weight.detach().clone(), want)
        assert head.weight.untyped_storage().nbytes() == 0  # a placeholder again
        with pytest.raises(RuntimeError, match=r"'head\.weight'"):
            head.weight.sum()
    finally:
        engine.close()


def test_a_tiled_weight_gathered_in_forward_while_its_module_runs_trains_as_plain_pytorch(tmp_path):
    """Two gradients reach the weight: the tiled module's, handed to its tiles by its Function,
    and the gathered read's, cut into the tiles' rows; each tile waits for both."""
    want, want_params = _plain(3, model=_calls(gather=lambda params: contextlib.nullcontext()))
    engine = infinity.initialize(_calls(gather=_gathered), _nvme(tmp_path, memory=_TILES))
    try:
        assert sum(u.path == "head" for u in engine.units) == 4
        _train_and_compare(engine, 3, want, want_params)
        assert engine.module.head.weight.untyped_storage().nbytes() == 0
    finally:
        engine.close()


@pytest.mark.parametrize("memory", [_TILES, {}], ids=["tiled", "whole"])
def test_a_gathered_parameter_stays_whole_through_passes_inside_the_context(tmp_path, memory):
    """The end of a forward without grad and of a backward releases every unit but those an
    open context holds: the weight read after them is still whole, and training is exact."""
    runs = {}
    for name in ("gathered", "never"):
        engine = infinity.initialize(_calls(), _nvme(tmp_path / name, memory=memory))
        try:
            head = engine.module.head
            want = engine.gathered_weights()["head.weight"]
            with infinity.GatheredParameters([head.weight]) if name == "gathered" else contextlib.nullcontext():
                with torch.no_grad():
                    engine(_batch(0)[0])
                loss = _loss(engine, 0)
                engine.backward(loss)
                if name == "gathered":
                    assert torch.equal(head.weight.detach().clone(), want)
            engine.step()
            runs[name] = loss.item(), engine.gathered_weights()
        finally:
            engine.close()
    assert runs["gathered"][0] == runs["never"][0]
    for key, value in runs["never"][1].items():
        assert torch.equal(runs["gathered"][1][key], value), key


@pytest.mark.parametrize("memory", [_TILES, {}], ids=["tiled", "whole"])
def test_a_step_or_a_load_inside_gathered_parameters_is_refused_naming_them(tmp_path, memory):
    """Either would change the values the context holds, and it would keep the old ones."""
    engine = infinity.initialize(_calls(), _nvme(tmp_path, memory=memory))
    try:
        engine.save_checkpoint(tmp_path / "ckpt")
        state = engine.module.state_dict()
        head = engine.module.head
        with infinity.GatheredParameters([head.weight]):
            engine.backward(_loss(engine, 0))
            with pytest.raises(RuntimeError, match=r"engine\.step\(\) while GatheredParameters holds .*'head\.weight'"):
                engine.step()
            engine.zero_grad()
            with pytest.raises(RuntimeError, match=r"load_state_dict while .*'head\.weight'"):
                engine.module.load_state_dict(state)
            with pytest.raises(RuntimeError, match=r"load_checkpoint\(\) while .*'head\.weight'"):
                engine.load_checkpoint(tmp_path / "ckpt")
        engine.backward(_loss(engine, 0))
        engine.step()  # refused before anything changed: the engine trains on
    finally:
        engine.close()


def test_closing_the_engine_inside_gathered_parameters_releases_them(tmp_path):
    engine = infinity.initialize(_calls(), _nvme(tmp_path))
    head = engine.module.head
    with infinity.GatheredParameters([head.weight]):
        engine.close()
        with pytest.raises(RuntimeError, match=r"'head\.weight'"):
            head.weight.sum()  # its memory went with the engine's
    assert all(u.gathers == 0 for u in engine.units)


def test_a_gathered_tiled_weight_given_no_gradient_trains_as_plain_pytorch(tmp_path):
    """Autograd runs the weight's hooks for the None too: the gather's take it for no gradient."""

    class M(_Calls):
        def forward(self, ids):
            h = torch.tanh(self.body(self.embed(ids)))
            with self.gather([self.head.weight]):
                return self.head(GivesNoGrad.apply(h, self.head.weight))

    torch.manual_seed(0)
    want, want_params = _plain(3, model=M(gather=lambda params: contextlib.nullcontext()))
    torch.manual_seed(0)
    engine = infinity.initialize(M(gather=_gathered), _nvme(tmp_path, memory=_TILES))
    try:
        _train_and_compare(engine, 3, want, want_params)
    finally:
        engine.close()


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(32, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.wte(ids))))


def test_a_state_dict_inside_a_context_holding_every_parameter_is_local_and_ties_share(tmp_path):
    """Inside GatheredParameters over every parameter, state_dict() is local on every rank
    (DeepSpeed's idiom, rank 0 alone saving; test_multirank holds the two ranks): the weights
    the engine gathers, tied keys sharing one tensor as torch's do (they were two copies), and
    a copy that outlives the context's memory."""
    torch.manual_seed(0)
    engine = infinity.initialize(_Tied(), config(str(tmp_path), ("nvme", "nvme", "nvme")))
    ids = torch.randint(0, 32, (2, 5))
    engine.backward(engine(ids).pow(2).mean())
    engine.step()
    want = engine.gathered_weights()
    with infinity.GatheredParameters(list(engine.module.parameters())):
        inside = engine.module.state_dict()
    engine(ids)  # the context's memory taken by other units
    assert inside["wte.weight"].data_ptr() == inside["head.weight"].data_ptr()
    assert all(torch.equal(inside[k], want.get(k, want["wte.weight"])) for k in inside)
    engine.close()

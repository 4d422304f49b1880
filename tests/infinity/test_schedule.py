"""The scheduler's fetch and release around forward and backward: units kept from forward for
backward ([Note: kept for backward] in infinity/_schedule.py)."""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import types

import pytest
import torch
import torch.utils._python_dispatch
import torch.utils.checkpoint
from torch import nn

import infinity
from infinity import _schedule

sys.path.insert(0, os.path.dirname(__file__))
from _common import GivesNoGrad, Plain, config, train, trains_as_plain  # noqa: E402

NVME = ("nvme", "nvme", "nvme")


def _layers() -> nn.Module:
    torch.manual_seed(0)  # eight 257KiB units (fp32) and two small ones
    return nn.Sequential(nn.Linear(16, 256), *[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)],
                         nn.Linear(256, 4))  # fmt: skip


def _run(path, keep: bool, budget: str, steps: int = 3, tile_size: str | None = None, device_budget=None):
    # (keep_params off: a unit read in forward and released would be lent to backward from the
    # pool, which tests/infinity/test_param_cache.py tests; here every read counts.)
    memory = {"host_budget": budget, "tile_size": tile_size, "device_budget": device_budget, "keep_params": False}
    cfg = config(path, NVME, prefetch={"keep": keep}, memory=memory,
                 optimizer={"overlap": False, "sub_group_size": "256KiB"})  # fmt: skip
    engine = infinity.initialize(_layers(), cfg)
    try:
        losses = train(engine, steps)
        st = engine.stats()["step"]
        fp32 = 4 * sum(u.shard_numel for u in engine.units)
        return losses, engine.gathered_weights(), st["nvme"]["by_kind"]["param"]["read_bytes"], fp32, st
    finally:
        engine.close()


@pytest.mark.parametrize("budget", ["64MiB", "3584KiB"], ids=["all-fit", "tight"])
def test_units_kept_from_forward_are_not_read_again_and_change_nothing(tmp_path, budget):
    off = _run(tmp_path / "off", False, budget)
    on = _run(tmp_path / "on", True, budget)
    assert on[0] == off[0]
    for k in off[1]:
        assert torch.equal(on[1][k], off[1][k]), k
    read_off, read_on, fp32 = off[2], on[2], on[3]
    assert read_off == 2 * fp32  # forward and backward each read every unit
    assert off[4]["kept_for_backward"] == 0
    if budget == "64MiB":  # every unit fits beside what the pass needs: each is read once a step
        assert read_on == fp32 and on[4]["kept_for_backward"] == 10
    else:  # the units forward used last are kept, the rest read again
        assert fp32 < read_on < 2 * fp32 and 0 < on[4]["kept_for_backward"] < 10, (read_on, fp32, on[4])


@pytest.mark.parametrize("device_budget, kept", [(0, 0), ("300KiB", 2), ("64MiB", 10)])
def test_the_device_budget_bounds_the_units_kept(tmp_path, device_budget, kept):
    """memory.device_budget bounds the parameters kept on the compute device (here the host,
    whose pool buffers they are; on a GPU its memory): the units forward used last are kept,
    the rest read again, and nothing changes but the bytes read."""
    ref = _run(tmp_path / "ref", False, "64MiB")
    on = _run(tmp_path / "on", True, "64MiB", device_budget=device_budget)
    assert on[0] == ref[0]
    for k in ref[1]:
        assert torch.equal(on[1][k], ref[1][k]), k
    fp32 = on[3]
    assert on[4]["kept_for_backward"] == kept, on[4]
    if kept == 10:
        assert on[2] == fp32  # each parameter read once a step
    elif kept == 0:
        assert on[2] == 2 * fp32
    else:  # the last Linear (4KiB) and the 257KiB one before it: 300KiB holds no third
        assert on[2] == 2 * fp32 - 4 * (256 * 256 + 256) - 4 * (256 * 4 + 4), (on[2], fp32)


def test_tiles_kept_from_forward_are_not_read_again(tmp_path):
    """Every 257KiB Linear in 64KiB tiles: forward keeps its last tiles, backward goes over them
    last tile first, and with a budget that holds them all each tile is read once a step."""
    off = _run(tmp_path / "off", False, "64MiB", tile_size="64KiB")
    on = _run(tmp_path / "on", True, "64MiB", tile_size="64KiB")
    assert on[0] == off[0]
    for k in off[1]:
        assert torch.equal(on[1][k], off[1][k]), k
    assert off[2] == 2 * on[3] and on[2] == on[3], (off[2], on[2], on[3])
    assert on[4]["kept_for_backward"] > 10  # the tiles, and the two small whole units


class _Doubler(nn.Linear):
    def forward(self, x):
        return GivesNoGrad.apply(x, self.weight)


@pytest.mark.parametrize("tiers", [NVME, ("device",) * 3], ids=["nvme", "device"])
def test_a_parameter_given_a_none_gradient_trains_as_in_plain_pytorch(tmp_path, tiers):
    """The engine's gradient hook took param.grad as a tensor: a None there raised
    AttributeError in backward where plain PyTorch trains on. The parameter is one no gradient
    reached (zeros, which AdamW without weight decay leaves as it was)."""

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), _Doubler(16, 16), nn.Linear(16, 4))

    plain = model()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    engine = infinity.initialize(model(), config(tmp_path, tiers, optimizer={"weight_decay": 0.0}))
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        opt.zero_grad()
        ref = ((plain(x) - y) ** 2).mean()
        ref.backward()
        opt.step()
        assert abs(loss.item() - ref.item()) < 1e-6, step
    got = engine.gathered_weights()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), atol=1e-6, rtol=0)
    assert torch.equal(got["1.weight"], model()[1].weight.detach())  # never updated
    engine.close()


class _Copies(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the elements ``aten.copy_`` writes."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.elements += args[0].numel()
        return func(*args, **(kwargs or {}))


def test_a_whole_unit_gradient_becomes_the_tier_s_tensor_without_a_copy(tmp_path):
    """Every tier on the device, one rank: the gradient autograd gives a parameter that is all
    of its unit (a Linear without bias) is stored as the unit's gradient itself, not copied
    into the tier's tensor, and a later micro-batch's is added to it from where autograd left
    it ([Note: gradient hand-over]). Two micro-batches a step, three steps: the weights are
    plain PyTorch's."""

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64, bias=False), nn.Tanh(), nn.Linear(64, 4, bias=False))

    plain = model()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    engine = infinity.initialize(model(), config(tmp_path, ("device",) * 3, optimizer={"overlap": False}))
    try:
        for step in range(3):
            copies = _Copies()
            for micro in range(2):
                g = torch.Generator().manual_seed(10 * step + micro)
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
                with copies:
                    engine.backward(((engine(x) - y) ** 2).mean())
                ((plain(x) - y) ** 2).mean().backward()
            assert copies.elements == 0, (step, copies.elements)
            engine.step()
            opt.step()
            opt.zero_grad()
        _assert_weights_of(plain, engine, atol=1e-6)
    finally:
        engine.close()


def _record_stored(engine) -> list[tuple[str, bool]]:
    """(unit name, whether inside backward) of each gradient ``engine`` stores from here on:
    every one goes through `GradAccumulator._note`."""
    stored = []
    note = engine.grads._note

    def recording(unit, acc):
        stored.append((unit.name, engine.scheduler.state is _schedule.TrainingState.BACKWARD))
        note(unit, acc)

    engine.grads._note = recording
    return stored


def _assert_weights_of(plain: nn.Module, engine, atol: float) -> None:
    got = engine.gathered_weights()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), atol=atol, rtol=0)


class _Shared(nn.Module):
    """A tied embedding and output, a block called twice, reentrant checkpointing around the
    second call, and a module that runs on odd steps only."""

    def __init__(self, checkpoint: bool):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.sometimes = nn.Linear(16, 16)
        self.out = nn.Linear(16, 32, bias=False)
        self.out.weight = self.emb.weight
        self.checkpoint = checkpoint

    def forward(self, ids, odd: bool):
        h = self.block(self.emb(ids))
        if self.checkpoint:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True)
        else:
            h = self.block(h)
        if odd:
            h = self.sometimes(h)
        return self.out(h)


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "reentrant-checkpoint"])
def test_always_ready_units_are_handed_on_when_each_parameter_s_gradient_arrived(tmp_path, checkpoint):
    """Every tier on the device, one rank: no module hooks ([Note: always-ready units' uses]).
    A unit is handed on in backward once each of its parameters' gradients arrived, the tied
    one and the one a module called twice made included (counting calls waited for the end of
    backward there); a module that did not run is handed on at the end. Two micro-batches a
    step, the optimizer under backward on: the weights are plain PyTorch's."""

    def model():
        torch.manual_seed(0)
        return _Shared(checkpoint)

    plain = model()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    engine = infinity.initialize(model(), config(tmp_path, ("device",) * 3, optimizer={"overlap": True}))
    handed = _record_stored(engine)
    try:
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in engine.module.modules()
                       if m is not engine.module)  # fmt: skip
        for step in range(3):
            for micro in range(2):
                g = torch.Generator().manual_seed(10 * step + micro)
                ids = torch.randint(0, 32, (4, 6), generator=g)
                handed.clear()
                engine.backward(engine(ids, odd=step % 2 == 1).float().logsumexp(-1).mean())
                plain(ids, odd=step % 2 == 1).logsumexp(-1).mean().backward()
                inside = {name for name, during in handed if during}
                assert {"emb", "block.0"} <= inside, handed
                if step % 2 == 0:  # it did not run: no gradient, nothing handed on
                    assert not any(name == "sometimes" for name, _ in handed), handed
            engine.step()
            opt.step()
            opt.zero_grad()
        _assert_weights_of(plain, engine, atol=1e-6)
    finally:
        engine.close()


def test_always_ready_tiles_are_handed_on_once_with_their_module_s_gradients(tmp_path):
    """Parameters on the device with the optimizer states elsewhere: modules are tiled and units
    always bound. A tile's gradients come from its module's Function, once per call, so the
    tiled module keeps its post-hook counting them: each tile's gradient is stored once a
    backward (weight and bias together), and the weights are plain PyTorch's."""

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 64))

    cfg = config(tmp_path, ("device", "device", "cpu"), memory={"tile_size": "4KiB"}, optimizer={"weight_decay": 0.0})
    engine = infinity.initialize(model(), cfg)
    plain = model()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    stored = _record_stored(engine)
    try:
        assert engine.scheduler.always_ready and engine.scheduler.tiled
        for step in range(3):
            ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step))
            stored.clear()
            engine.backward(engine(ids).logsumexp(-1).mean())
            engine.step()
            plain(ids).logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
            assert sorted(name for name, _ in stored) == sorted(u.name for u in engine.units), stored
        _assert_weights_of(plain, engine, atol=1e-4)
    finally:
        engine.close()


@pytest.mark.parametrize("tiers", [("nvme",) * 3, ("nvme", "cpu", "cpu")], ids=["nvme", "params-nvme"])
@pytest.mark.parametrize("between", ["zero_grad", "no_grad_forward", "dropped_loss"])
def test_what_plain_pytorch_allows_between_a_forward_and_its_backward_trains_as_it(tmp_path, tiers, between):
    """The textbook order ``loss = f(model(x)); optimizer.zero_grad(); loss.backward()``, or a
    no-grad forward (an eval) between a forward and its backward, left that backward whole in
    plain PyTorch, and here forgot the uses its forward counted: the first gradient of a unit of
    several parameters was taken for its last and the unit released under the rest (a crash,
    "size of tensor a (0)"). A grad-enabled forward whose loss is dropped is forgotten as before."""
    import copy

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))

    model = make()
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01, fused=True)  # the engine's kernel
    (tmp_path / "swap").mkdir()
    engine = infinity.initialize(model, config(tmp_path / "swap", tiers, optimizer={"lr": 1e-2}))
    try:
        for s in range(3):
            g = torch.Generator().manual_seed(s)
            x, y = torch.randn(8, 32, generator=g), torch.randn(8, 8, generator=g)
            for m, step, zero in ((engine, engine.optimizer.step, engine.optimizer.zero_grad),
                                  (plain, opt.step, opt.zero_grad)):  # fmt: skip
                if between == "dropped_loss":
                    ((m(x) - y) ** 2).mean()
                loss = ((m(x) - y) ** 2).mean()
                if between == "zero_grad":
                    zero()
                if between == "no_grad_forward":
                    with torch.no_grad():
                        m(x[:4])
                loss.backward()
                step()
                zero()
        got = engine.gathered_weights()
        for name, p in plain.named_parameters():
            assert torch.equal(got[name], p.detach()), name
    finally:
        engine.close()


def _normed(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), getattr(nn.utils, kind)(nn.Linear(32, 64)), nn.Tanh(),
                         nn.Linear(64, 4))  # fmt: skip


@pytest.mark.parametrize("tile_size", [None, "4KiB"], ids=["whole", "tile_size"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_a_forward_pre_hook_of_the_model_reads_its_parameters_fetched(tmp_path, kind, tile_size):
    """torch.nn.utils' hook-based weight_norm and spectral_norm compute the weight in a forward
    pre-hook of the model's own, registered before the engine's: it read the parameters before
    the engine fetched them and was refused as a read outside the module's forward. The engine's
    pre-hook runs first, and the module (a Linear that tiles would otherwise cut) stays whole."""
    model, ref = _normed(kind), _normed(kind)  # (a weight_norm'd module cannot be deepcopied)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    with infinity.initialize(model, config(tmp_path, NVME, memory={"tile_size": tile_size})) as engine:
        assert not any(u.is_tile for u in engine.units)
        assert train(engine, 3) == pytest.approx(train(Plain(ref, opt), 3), abs=1e-6)
        weights = engine.gathered_weights()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=1e-6, atol=1e-6, msg=name)


def test_a_root_that_holds_parameters_is_fetched_after_the_roots_check(tmp_path):
    """An nn.Linear given to initialize whole: its units' pre-hook and the root's are on the
    same module, and the root's runs first (it opens the pass the fetch belongs to; fetched
    before it, the weight stayed a placeholder and the forward was refused)."""
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    ref = nn.Linear(16, 4)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    with infinity.initialize(model, config(tmp_path, NVME)) as engine:
        assert train(engine, 2) == pytest.approx(train(Plain(ref, opt), 2), abs=1e-6)



@dataclasses.dataclass
class _Loss:
    loss: torch.Tensor


@dataclasses.dataclass
class _Hidden:
    h: torch.Tensor


class _Checkpointed(nn.Module):
    """A model that returns its loss inside an output object of its own, and a submodule that
    returns its activation so, with non-reentrant checkpointing inside."""

    def __init__(self, namespace: bool):
        super().__init__()
        self.loss_of = types.SimpleNamespace if namespace else _Loss
        self.first, self.block, self.head = nn.Linear(16, 64), _Block(namespace), nn.Linear(64, 4)

    def forward(self, x, y):
        h = torch.utils.checkpoint.checkpoint(lambda t: self.block(t).h, self.first(x), use_reentrant=False)
        return self.loss_of(loss=((self.head(torch.tanh(h)) - y) ** 2).mean())


class _Block(nn.Module):
    def __init__(self, namespace: bool):
        super().__init__()
        self.hidden_of = types.SimpleNamespace if namespace else _Hidden
        self.linear = nn.Linear(64, 64)

    def forward(self, x):
        return self.hidden_of(h=self.linear(x))


@pytest.mark.parametrize("namespace", [True, False], ids=["namespace", "dataclass"])
def test_a_loss_inside_an_output_object_of_the_model_s_own_trains_as_in_plain_pytorch(tmp_path, namespace):
    """The engine finds the loss inside an output object of the model's own (a
    types.SimpleNamespace, a dataclass; a submodule returns its activation so too), as FSDP
    reaches into one: a backward it did not see begin made
    checkpoint(use_reentrant=False)'s recompute fail ("a different number of tensors was saved")
    and the second micro-batch of a plain loss.backward() read a released weight (an audit
    helper's repros); both on nvme. Two micro-batches a step, as plain PyTorch trains them."""
    torch.manual_seed(0)
    model = _Checkpointed(namespace)
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)) for _ in range(6)]
    with infinity.initialize(model, config(tmp_path, NVME, optimizer={"gradient_accumulation_steps": 2})) as engine:
        for step in range(3):
            for x, y in batches[2 * step : 2 * step + 2]:
                engine(x, y).loss.backward()  # a plain backward, as the README allows
                plain(x, y).loss.backward()
            engine.step()
            opt.step()
            opt.zero_grad()
        got = engine.gathered_weights()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), atol=1e-6, rtol=0)


class _StoppedEarly(nn.Module):
    """Blocks of Linear, GELU, Linear, each under torch's non-reentrant checkpoint, which stops
    a block's recomputation by raising inside its last Linear once it has what backward needs."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def test_a_recomputation_stopped_early_leaves_no_unit_held(tmp_path):
    """The units of a module whose forward raised stayed counted active (its post-hook never
    ran): each block's last Linear, where the checkpoint stops its recomputation, stayed held
    until backward ended, one unit more per block, and backward ran out of a host budget
    initialize had accepted (an audit helper's repro: PoolExhausted at the floor with
    activations on nvme). Now no unit is active when the first block's backward runs, and
    training is plain PyTorch's."""
    torch.manual_seed(0)
    model, ref = _StoppedEarly(), _StoppedEarly()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with infinity.initialize(model, config(tmp_path, ("nvme",) * 3)) as engine:
        active = []
        engine.module.blocks[0][0].register_full_backward_pre_hook(
            lambda m, g: active.append([u.name for u in engine.units if u.active]))
        trains_as_plain(engine, ref, x)
    assert active == [[], []]


class _Scaled(nn.Module):
    """A module that reads the parameters of the containers it holds in its own forward, as
    peft's LoRA on embeddings (``lora_embedding_A``, a ParameterDict) and IA3 do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.scales = nn.ParameterDict({"a": nn.Parameter(torch.linspace(0.5, 1.5, 16))})
        self.shifts = nn.ParameterList([nn.Parameter(torch.full((16,), 0.1)), nn.Parameter(torch.zeros(16))])

    def forward(self, x):
        return self.lin(x) * self.scales["a"] + self.shifts[0] - self.shifts[1]


@pytest.mark.parametrize("tiers", [("nvme", "nvme", "nvme"), ("device", "device", "device")], ids=["nvme", "device"])
def test_parameters_in_a_container_its_module_reads_train_as_plain(tmp_path, tiers):
    """An nn.ParameterDict or nn.ParameterList has no forward: its parameters were fetched by
    no hook, and the module holding it, reading them in its forward, was refused ("read
    outside the forward of the module that holds it": an audit helper's repro with peft's LoRA
    on embeddings and IA3). They are that module's units now ([Note: parameter containers] in
    `_units`): it trains as plain PyTorch, once with the parameters released between uses."""
    torch.manual_seed(0)
    model = nn.Sequential(_Scaled(), nn.GELU(), _Scaled(), nn.Linear(16, 4))
    plain = copy.deepcopy(model)
    engine = infinity.initialize(model, config(str(tmp_path), tiers))
    trains_as_plain(engine, plain, torch.randn(8, 16), steps=3)
    engine.close()


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.encoder(x))


def test_torchs_multihead_attention_trains_as_plain_on_nvme(tmp_path):
    """nn.MultiheadAttention's forward reads its out_proj's weight and bias itself, never
    calling out_proj (F.multi_head_attention_forward): with parameters on nvme the first
    forward of it, and so of every nn.Transformer layer, was refused as "read outside the
    forward of the module that holds it" (an audit helper's repro). out_proj's unit is the
    attention's now (`_units.READ_BY_PARENT`): training and an eval pass are plain PyTorch's,
    bit for bit (against torch's fused AdamW, the engine's kernel: the key bias's gradient is
    zero but for rounding, which Adam magnifies differently in torch's default kernel)."""
    torch.manual_seed(0)
    model = _Encoder()
    plain = copy.deepcopy(model)
    engine = infinity.initialize(model, config(str(tmp_path), ("nvme", "nvme", "nvme")))
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    x = torch.randn(3, 5, 16)
    for _ in range(3):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        plain(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    got = engine.gathered_weights()
    assert all(torch.equal(got[n], p) for n, p in plain.named_parameters())
    engine.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(engine(x), plain(x))
    engine.close()


class _Table(nn.Module):
    """A learned position table whose forward returns a view of its parameter."""

    def __init__(self, boxed: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 16))
        self.boxed = boxed

    def forward(self, n: int):
        rows = self.weight[:n]
        return types.SimpleNamespace(rows=rows) if self.boxed else (rows, {"rows": rows})


class _Positions(nn.Module):
    def __init__(self, boxed: bool = False):
        super().__init__()
        self.table = _Table(boxed)
        self.blocks = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        got = self.table(x.shape[0])
        rows, also = (got.rows, {"rows": got.rows}) if self.table.boxed else got
        return self.out(self.blocks(x) + rows + also["rows"])  # read after the table's call ended


def test_a_module_returning_a_view_of_its_parameter_gives_its_values_after_its_call(tmp_path):
    """A module may return a view of its parameter (a learned position table's weight[:T])
    that its caller reads after the module's call: there the unit was released and its buffer
    taken by the next units' weights, and the view read their bytes, silently (an audit
    helper's repro: 1.65 off plain PyTorch). The output is a copy now ([Note: outputs that
    alias a unit]), in a tensor, tuple or dict alike: no_grad forwards and training match
    plain PyTorch. One inside an object the engine cannot copy out of is refused."""
    torch.manual_seed(0)
    model = _Positions()
    plain = copy.deepcopy(model)
    cfg = config(str(tmp_path), ("nvme", "nvme", "nvme"), memory={"keep_params": False}, prefetch={"keep": False})
    engine = infinity.initialize(model, cfg)
    x = torch.randn(8, 16)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), plain(x), atol=0, rtol=0)
    trains_as_plain(engine, plain, x, steps=3)
    engine.close()
    engine = infinity.initialize(_Positions(boxed=True), config(str(tmp_path / "boxed"), ("nvme", "nvme", "nvme")))
    with pytest.raises(RuntimeError, match="module _Table returned a view of its own parameters inside an object"):
        engine(x)
    engine.close()

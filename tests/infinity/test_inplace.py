"""Writes to the module's parameters after initialize (infinity/_inplace.py, _statedict.py's
hooks on submodules): kept as plain PyTorch keeps them, or refused; never undone unsaid."""

import copy
import os
import socket
import subprocess
import sys

import pytest
import torch
from torch import nn

import infinity

sys.path.insert(0, os.path.dirname(__file__))
from _common import config, make_model, rank_env, train, write_layer  # noqa: E402

CHILD = os.path.join(os.path.dirname(__file__), "_inplace_child.py")
BF16 = {"precision": {"param_dtype": "bf16"}}


def _new(dtype) -> dict:
    """New values for make_model's Linear [3] (32 x 32), exact in ``dtype``."""
    g = torch.Generator().manual_seed(5)
    return {"weight": torch.randn(32, 32, generator=g).to(dtype).float(), "bias": torch.randn(32, generator=g).to(dtype).float()}


def _run(tmp_path, tiers, sections, how, before: int = 1):
    """``before`` steps, the write, then 2 steps: (state_dict right after the write, at the end)."""
    swap = tmp_path / f"swap-{how}"
    swap.mkdir()
    engine = infinity.initialize(make_model(), config(swap, tiers, **sections))
    try:
        engine.module.eval()  # (no dropout: the plain run draws no alike masks)
        dtype = engine.module[3].weight.dtype
        train(engine, before, dtype=dtype)
        write_layer(engine.module, "3", how, _new(dtype), whole=engine.module.state_dict() if how == "load" else None)
        after = engine.module.state_dict()
        train(engine, 2, start=before, dtype=dtype)
        return after, engine.module.state_dict()
    finally:
        engine.close()


CASES = [
    # bf16 parameters beside fp32 masters, the optimizer in host memory: a GPU's usual placement
    *[(("device", "device", "cpu"), "bf16", how, 1) for how in ("subload", "copy", "data", "assign")],
    # the masters on nvme, apart from the parameters in host memory
    *[(("cpu", "cpu", "nvme"), "fp32", how, 1) for how in ("subload", "copy", "data", "assign")],
    # fp32 on the device, before the first step (the one copy of the weights not yet shared)
    (("device", "device", "device"), "fp32", "copy", 0),
    # parameters on nvme: the submodule's load_state_dict writes the tiers
    (("nvme", "nvme", "nvme"), "fp32", "subload", 1),
]


@pytest.mark.parametrize("tiers,dtype,how,before", CASES, ids=lambda v: ",".join(v) if isinstance(v, tuple) else str(v))
def test_a_write_to_a_parameter_is_kept_as_a_load_of_it_is(tmp_path, tiers, dtype, how, before):
    """A submodule's load_state_dict, ``p.copy_`` under no_grad, ``p.data.copy_``, ``p.data =``:
    the next forward used the new values, then the step wrote the parameters from master weights
    that never saw them (and state_dict read the masters): undone, with no error. Now each is
    the whole module's load_state_dict of the same values, bit for bit, before and after steps."""
    sections = BF16 if dtype == "bf16" else {}
    (tmp_path / "ref").mkdir()
    ref_after, ref_final = _run(tmp_path / "ref", tiers, sections, "load", before)
    after, final = _run(tmp_path, tiers, sections, how, before)
    assert torch.equal(after["3.weight"], _new(torch.bfloat16 if dtype == "bf16" else torch.float32)["weight"])
    for key in ref_final:
        assert torch.equal(after[key], ref_after[key]), key
        assert torch.equal(final[key], ref_final[key]), key


def test_a_write_trains_on_as_plain_pytorch(tmp_path):
    """fp32, masters on nvme: a step, ``p.copy_`` of new values, two steps; against plain
    PyTorch's AdamW doing the same (the engine's update is torch's: within rounding)."""
    model = make_model()
    plain = copy.deepcopy(model).eval()
    _, final = _run(tmp_path, ("cpu", "cpu", "nvme"), {}, "copy")
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(3):
        if step == 1:
            with torch.no_grad():
                plain[3].weight.copy_(_new(torch.float32)["weight"])
                plain[3].bias.copy_(_new(torch.float32)["bias"])
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        ((plain(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(final[key], value, atol=1e-6, rtol=0)


def test_a_write_of_one_element_costs_the_others_no_precision(tmp_path):
    """bf16 parameters: one element written through ``p.data``, another parameter's ``p.data``
    only read (a norm logged). The written element's master takes it; every other master
    weight stays bit for bit what it was, its fp32 bits (not the bf16 parameter's rounding)."""
    engine = infinity.initialize(make_model(), config(tmp_path, ("device", "device", "cpu"), **BF16))
    try:
        train(engine, 2, dtype=torch.bfloat16)
        before = engine.gathered_weights()
        assert not torch.equal(before["3.weight"], before["3.weight"].bfloat16().float())  # (else nothing to lose)
        engine.module[3].weight.data[0, 0] = 1.0
        engine.module[5].weight.data.float().norm()
        after = engine.gathered_weights()
        assert after["3.weight"][0, 0] == 1.0
        after["3.weight"][0, 0] = before["3.weight"][0, 0]
        for key in before:
            assert torch.equal(after[key], before[key]), key
    finally:
        engine.close()


@pytest.mark.parametrize("tiers,dtype", [(("device", "device", "cpu"), "bf16"), (("cpu", "cpu", "nvme"), "fp32")],
                         ids=["bf16-device,device,cpu", "fp32-cpu,cpu,nvme"])  # fmt: skip
def test_a_write_through_p_data_held_across_steps_is_kept(tmp_path, tiers, dtype):
    """``p.data`` taken once and kept (a helper that averages the weights holds the tensors),
    written steps later: the forward used the write, then state_dict and the next step undid
    it (0.044 off plain PyTorch's lm_head in an audit helper's repro): the note of ``p.data``
    taken was forgotten at the first look, and a write through the held tensor bumps only its
    own version counter. Now kept, as a load of the same values keeps it, bit for bit."""
    sections = BF16 if dtype == "bf16" else {}
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    results = {}
    for how in ("load", "held"):
        (tmp_path / how).mkdir()
        engine = infinity.initialize(make_model(), config(tmp_path / how, tiers, **sections))
        try:
            engine.module.eval()
            held = engine.module[3].weight.data, engine.module[3].bias.data
            train(engine, 2, dtype=tdtype)  # looks at the versions before each forward and step
            new = _new(tdtype)
            if how == "held":
                with torch.no_grad():
                    held[0].copy_(new["weight"])
                    held[1].copy_(new["bias"])
            else:
                engine.module[3].load_state_dict(new)
            after = engine.module.state_dict()
            train(engine, 2, start=2, dtype=tdtype)
            results[how] = after, engine.module.state_dict()
        finally:
            engine.close()
    assert torch.equal(results["held"][0]["3.weight"], _new(tdtype)["weight"])
    for i in range(2):
        for key, value in results["load"][i].items():
            assert torch.equal(results["held"][i][key], value), (i, key)


def test_a_write_into_p_data_is_its_own_engine_s_to_carry(tmp_path):
    """Two engines in one process (a teacher and a student): the other engine's forward
    looked for written parameters first; a ``p.data`` write into this one's must still be
    carried by this one (the note of ``p.data`` taken is per parameter, not taken by any look)."""
    engines = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            engines.append(infinity.initialize(make_model(), config(tmp_path / name, ("device", "device", "cpu"), **BF16)))
        a, b = engines
        new = _new(torch.bfloat16)
        b.module[3].weight.data.copy_(new["weight"])
        train(a, 1, dtype=torch.bfloat16)
        assert torch.equal(b.module.state_dict()["3.weight"], new["weight"])
    finally:
        for engine in engines:
            engine.close()


def test_a_checkpoint_loaded_after_a_write_wins_over_it(tmp_path):
    """``p.data = t``, then load_checkpoint: the checkpoint's weights, as in plain PyTorch. The
    write, not yet carried, was carried over the loaded weights at the next look."""
    engine = infinity.initialize(make_model(), config(tmp_path, ("device", "device", "cpu"), **BF16))
    try:
        train(engine, 1, dtype=torch.bfloat16)
        engine.save_checkpoint(tmp_path / "ck")
        want = engine.module.state_dict()
        engine.module[3].weight.data = torch.zeros(32, 32, dtype=torch.bfloat16)
        engine.load_checkpoint(tmp_path / "ck")
        got = engine.module.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        engine.close()


def test_a_placeholder_given_data_is_refused(tmp_path):
    """Parameters on nvme are empty placeholders between uses: ``p.data = t`` was accepted and
    dropped by the next fetch. Refused at the next forward, naming the parameter."""
    engine = infinity.initialize(make_model(), config(tmp_path, ("nvme", "nvme", "nvme")))
    try:
        engine.module[3].weight.data = torch.zeros(32, 32)
        with pytest.raises(RuntimeError, match=r"'3.weight' was given new data .*load_state_dict"):
            train(engine, 1)
        train(engine, 1)  # the placeholder is back: training goes on
    finally:
        engine.close()


class _CastsItself(nn.Module):
    """transformers' SwitchTransformersTop1Router: ``self.classifier = self.classifier.to(fp32)``
    at each call."""

    def __init__(self):
        super().__init__()
        self.inp, self.classifier = nn.Linear(16, 16), nn.Linear(16, 16, bias=False)

    def forward(self, x):
        self.classifier = self.classifier.to(torch.float32)
        return self.classifier(self.inp(x).float())


@pytest.mark.parametrize("micro", [1, 2])
def test_a_cast_inside_the_forward_is_refused_at_the_step_too(tmp_path, micro):
    """Checked before the forward only, a cast inside it was carried at the step: the fp32
    masters took the bf16-rounded values every step (9.4e-4 off plain mixed precision in 6
    steps, growing; an audit helper's repro). With two micro-batches the second forward's check
    refused it; with one, nothing did."""
    engine = infinity.initialize(_CastsItself(), config(tmp_path, ("device", "device", "device"),
                                                        optimizer={"gradient_accumulation_steps": micro}, **BF16))  # fmt: skip
    try:
        with pytest.raises(RuntimeError, match=r"parameter 'classifier.weight' cast to torch.float32 \(torch.bfloat16"):
            for _ in range(micro):
                engine.backward(engine(torch.randn(4, 16).bfloat16()).pow(2).mean())
            engine.step()
        assert engine.module.classifier.weight.dtype == torch.bfloat16  # the engine's again
    finally:
        engine.close()


def test_a_submodule_s_state_dict_gives_its_weights(tmp_path):
    """On nvme, ``engine.module[3].state_dict()`` gave the empty placeholders; now the weights,
    as the whole module's state_dict gives them under the submodule's prefix."""
    model = make_model()
    want = {k: v.clone() for k, v in model[3].state_dict().items()}
    engine = infinity.initialize(model, config(tmp_path, ("nvme", "nvme", "nvme")))
    try:
        got = engine.module[3].state_dict()
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key
        whole = engine.module.state_dict()
        assert all(torch.equal(whole[f"3.{k}"], v) for k, v in got.items())
    finally:
        engine.close()


class _Shared(nn.Module):
    """One Linear registered twice (``a`` and ``b.inner``), as a model that reuses a layer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Sequential()
        self.b.inner = self.a
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


def test_state_dict_of_a_shared_submodule_and_of_a_wrapper(tmp_path):
    """The outermost module of a state_dict() call gathers: a module registered at two paths
    is recognised as inside the call from either, and a user's wrapper around engine.module
    (its prefix "model.") gets the weights too; each as plain PyTorch's."""
    torch.manual_seed(0)
    plain = _Shared()
    engine = infinity.initialize(copy.deepcopy(plain), config(tmp_path, ("nvme", "nvme", "nvme")))
    try:
        for got, want in ((engine.module.state_dict(), plain.state_dict()),
                          (engine.module.b.state_dict(), plain.b.state_dict())):  # fmt: skip
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)
        wrapper = nn.Module()
        wrapper.model = engine.module
        got = wrapper.state_dict()
        assert all(torch.equal(got[f"model.{k}"], v) for k, v in plain.state_dict().items())
    finally:
        engine.close()


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_given_two_values_take_the_last_as_torch_does(tmp_path):
    """A dict with the two keys of one tied weight holding other values: torch copies both into
    the one parameter, the last wins; the engine kept the first."""
    torch.manual_seed(0)
    plain = _Tied()
    engine = infinity.initialize(copy.deepcopy(plain), config(tmp_path, ("nvme", "nvme", "nvme")))
    try:
        sd = {"embed.weight": torch.ones(8, 4), "head.weight": torch.full((8, 4), 2.0)}
        plain.load_state_dict(sd)
        engine.module.load_state_dict(sd)
        got = engine.module.state_dict()
        assert torch.equal(got["embed.weight"], plain.embed.weight.detach())
        assert torch.equal(got["head.weight"], torch.full((8, 4), 2.0))
    finally:
        engine.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(tmp_path, tiers: str, stage: int, how: str, dtype: str) -> dict:
    out, swap = str(tmp_path / how), tmp_path / f"swap-{how}"
    swap.mkdir()
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, CHILD, out, str(stage), str(swap), tiers, how, dtype],
                              env=rank_env(rank, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]  # fmt: skip
    logs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    return torch.load(f"{out}.pt", weights_only=True)


@pytest.mark.multirank
def test_two_ranks_keep_a_write_to_their_whole_parameters(tmp_path):
    """Two ranks below stage 3 hold whole parameters and each its slice of the masters: a
    write on every rank (``p.copy_``, ``p.data.copy_``) was used by one forward, then undone by
    the step (stage 1 with fp32 on the device alike, measured when this was fixed). Now each is
    the whole module's load_state_dict, bit for bit: stage 2, bf16, the optimizer on the host."""
    ref = _two_ranks(tmp_path, "device,device,cpu", 2, "load", "bf16")
    for how in ("copy", "data"):
        got = _two_ranks(tmp_path, "device,device,cpu", 2, how, "bf16")
        for when in ("after_write", "final"):
            for key in ref[when]:
                assert torch.equal(got[when][key], ref[when][key]), (how, when, key)


class _Renormed(nn.Module):
    """An embedding that renormalises the rows it looks up in place (``max_norm``), then a Linear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(40, 8, max_norm=0.5)
        self.head = nn.Linear(8, 4)

    def forward(self, ids):
        return self.head(self.embed(ids)).sum(1)


def _train_renormed(model, step_fn, steps=4):
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids, y = torch.randint(0, 40, (8, 6), generator=g), torch.randn(8, 4, generator=g)
        loss = ((model(ids) - y) ** 2).mean()
        step_fn(loss)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("tiers", [("cpu", "cpu", "cpu"), ("device", "device", "nvme")], ids=",".join)
def test_an_embeddings_max_norm_renorm_is_kept_where_the_tier_lends_the_weight(tmp_path, tiers):
    """``max_norm`` renormalises rows of the weight in place inside forward: where the module
    holds the tier's own tensors the write is carried into the masters as any write is, and
    training matches plain PyTorch."""
    model = _Renormed()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)

    def plain_step(loss):
        loss.backward()
        opt.step()
        opt.zero_grad()

    with infinity.initialize(model, config(tmp_path, tiers)) as engine:
        got = _train_renormed(engine, lambda loss: (engine.backward(loss), engine.step()))
        weights = engine.gathered_weights()
    assert got == pytest.approx(_train_renormed(ref, plain_step), abs=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(weights[name].float(), p.detach(), rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("stage", [("nvme", "nvme", "nvme"), ("nvme", "cpu", "cpu")], ids=",".join)
def test_an_embeddings_max_norm_is_refused_where_the_weight_is_released(tmp_path, stage):
    """Parameters on nvme are released after each use: the rows ``max_norm`` renormalised in
    forward would be lost at the release and the step would train the old rows, silently (an
    audit found the weights 3.55 apart after 20 steps). Refused at initialize, naming the module."""
    with pytest.raises(ValueError, match=r"'embed'.*max_norm=0\.5.*tiers\.params = 'nvme' the weight is released"):
        infinity.initialize(_Renormed(), config(tmp_path, stage))


def test_a_sparse_embedding_is_refused_naming_it(tmp_path):
    """Sparse gradients have no place in the engine's dense gradient buffers: refused at
    initialize, naming the module (it failed in backward with torch's "reshape is not
    implemented for sparse tensors")."""
    model = nn.Sequential(nn.Embedding(40, 8, sparse=True), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"'0'.*sparse=True"):
        infinity.initialize(model, config(tmp_path, ("cpu", "cpu", "cpu")))

"""Tiled modules (memory.tile_size): a vocabulary-sized nn.Embedding or nn.Linear stored,
fetched, updated and computed in row tiles gives what plain PyTorch gives, in every path a
whole module has (forward, backward, the optimizer, checkpoints, export, pretrained loads)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import infinity
from infinity.checkpoint import CheckpointError

NVME = ("nvme", "nvme", "nvme")
VOCAB, WIDTH = 300, 24


class Toy(nn.Module):
    """An embedding with a padding row, a hidden layer, and an output layer with a bias: the
    two vocabulary-sized modules are the ones tiled."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=not tied)
        if tied:
            self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.hidden(self.embed(ids))))


def _cfg(path, tiers=NVME, tile="4KiB", **sections) -> dict:
    params, grads, optimizer = tiers
    cfg = {"tiers": {"params": params, "grads": grads, "optimizer": optimizer},
           "nvme": {"paths": [str(path)], "grow_step": "4MiB"}, "memory": {"host_budget": "64MiB", "tile_size": tile},
           "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}  # fmt: skip
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value)
    return cfg


def _batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    ids = torch.randint(0, VOCAB, (4, 6), generator=g)
    ids[0, :2] = 0  # the padding row: no gradient
    return ids, torch.randint(0, VOCAB, (4, 6), generator=g)


def _loss(logits, y):
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def _plain(model, steps, *, micro=1, clip=None):
    """Plain PyTorch on the same batches (a frozen parameter has no gradient: AdamW leaves it)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(steps):
        for m in range(micro):
            ids, y = _batch(step, m)
            loss = _loss(model(ids), y)
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _run(engine, steps, *, micro=1, start=0):
    losses = []
    for step in range(start, start + steps):
        for m in range(micro):
            ids, y = _batch(step, m)
            loss = _loss(engine(ids), y)
            engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _close(a: dict, b: dict, tol=1e-5) -> None:
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=tol, atol=tol, msg=k)


def _trains_as_plain(tmp_path, model, steps, cfg=None, *, micro=1, clip=None):
    """Train ``model`` under the engine (``cfg``, default `_cfg`) and a copy of it in plain
    PyTorch on the same batches; the losses and the final weights agree to 1e-5. Returns the
    (closed) engine, whose units the caller may look at."""
    ref = copy.deepcopy(model)
    with infinity.initialize(model, cfg or _cfg(tmp_path)) as engine:
        losses = _run(engine, steps, micro=micro)
        weights = engine.gathered_weights()
    assert losses == pytest.approx(_plain(ref, steps, micro=micro, clip=clip), abs=1e-5)
    _close(weights, dict(ref.named_parameters()))
    return engine


def test_vocabulary_sized_modules_are_tiled_and_nothing_else(tmp_path):
    with infinity.initialize(Toy(), _cfg(tmp_path)) as engine:
        tiles = [u for u in engine.units if u.is_tile]
        assert {u.path for u in tiles} == {"embed", "out"}
        # 4KiB of fp32 rows: 42 rows of 24 (embedding), 40 rows of 24 + 1 (output layer).
        assert [u.rows for u in tiles if u.path == "embed"][:2] == [(0, 42), (42, 84)]
        assert [u.rows for u in tiles if u.path == "out"][-1] == (280, 300)
        assert max(4 * u.numel for u in engine.units) <= 4096
        assert [u.name for u in engine.units if not u.is_tile] == ["hidden"]


@pytest.mark.parametrize("tiers", [NVME, ("cpu", "cpu", "cpu"), ("device", "nvme", "nvme")], ids=str)
def test_tiled_training_matches_plain_pytorch(tmp_path, tiers):
    torch.manual_seed(0)
    engine = _trains_as_plain(tmp_path, Toy(), 4, _cfg(tmp_path, tiers))
    assert any(u.is_tile for u in engine.units)


@pytest.mark.parametrize("overlap", [True, False])
def test_tiled_with_clipping_accumulation_and_overlap(tmp_path, overlap):
    torch.manual_seed(0)
    cfg = _cfg(tmp_path, optimizer={"max_grad_norm": 0.5, "overlap": overlap, "gradient_accumulation_steps": 2,
                                    "sub_group_size": "16KiB"})  # fmt: skip
    _trains_as_plain(tmp_path, Toy(), 3, cfg, micro=2, clip=0.5)


def test_tiled_and_whole_runs_agree_in_bf16(tmp_path):
    torch.manual_seed(0)
    model = Toy().to(torch.bfloat16)
    whole = copy.deepcopy(model)
    out = {}
    for name, m, tile in (("tiled", model, "4KiB"), ("whole", whole, None)):
        with infinity.initialize(m, _cfg(tmp_path / name, tile=tile, precision={"param_dtype": "bf16"})) as engine:
            assert any(u.is_tile for u in engine.units) == (tile is not None)
            out[name] = (_run(engine, 3), engine.gathered_weights())
    assert out["tiled"][0] == pytest.approx(out["whole"][0], abs=1e-3)
    _close(out["tiled"][1], out["whole"][1], tol=1e-2)


class _EmbedHead(nn.Module):
    """A tiled embedding (a padding row inside its second tile) under a head too small to tile."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=50)
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_a_tiled_embedding_trains_bit_for_bit_as_a_whole_one_in_bf16(tmp_path):
    # Frequent ids: a bf16 gradient row summed over many tokens, in nn.Embedding's order and
    # rounding (an index_add_ into the tile's bf16 gradient rounded otherwise: weights 1e-3 off in 3 steps).
    torch.manual_seed(0)
    model = _EmbedHead().to(torch.bfloat16)
    out = {}
    for name, m, tile in (("tiled", model, "4KiB"), ("whole", copy.deepcopy(model), None)):
        with infinity.initialize(m, _cfg(tmp_path / name, tile=tile, precision={"param_dtype": "bf16"})) as engine:
            assert [u.path for u in engine.units if u.is_tile][:1] == (["embed"] if tile else [])
            for step in range(3):
                g = torch.Generator().manual_seed(step)
                ids = torch.randint(0, 100, (8, 64), generator=g)  # rows 0..99: the first three tiles
                engine.backward(nn.functional.cross_entropy(engine(ids).float().reshape(-1, 8),
                                                            torch.randint(0, 8, (8 * 64,), generator=g)))  # fmt: skip
                engine.step()
            out[name] = engine.gathered_weights()
    for k in out["whole"]:
        assert torch.equal(out["tiled"][k], out["whole"][k]), (k, (out["tiled"][k].float() - out["whole"][k].float()).abs().max())


def test_a_tied_embedding_stays_whole(tmp_path):
    torch.manual_seed(0)
    engine = _trains_as_plain(tmp_path, Toy(tied=True), 2)
    assert not any(u.is_tile for u in engine.units)


def test_no_tiles_with_every_tier_on_the_device(tmp_path):
    with infinity.initialize(Toy(), _cfg(tmp_path, ("device", "device", "device"))) as engine:
        assert not any(u.is_tile for u in engine.units)


def test_a_frozen_tiled_embedding_and_eval(tmp_path):
    torch.manual_seed(0)
    model = Toy()
    model.embed.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    with infinity.initialize(model, _cfg(tmp_path)) as engine:
        losses = _run(engine, 2)
        ids, _ = _batch(7)
        with torch.no_grad():
            logits = engine(ids)
        weights = engine.gathered_weights()
    assert losses == pytest.approx(_plain(ref, 2), abs=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(logits, ref(ids), rtol=1e-5, atol=1e-5)
    _close(weights, dict(ref.named_parameters()))


def test_an_id_out_of_range_raises_as_torch_does(tmp_path):
    with infinity.initialize(Toy(), _cfg(tmp_path)) as engine:
        with pytest.raises(IndexError, match="index out of range"):
            engine(torch.tensor([[1, VOCAB]]))
        engine.zero_grad()
        _run(engine, 1)  # and the engine trains on


@pytest.mark.parametrize("tiers", [NVME, ("device", "device", "cpu")], ids=["nvme", "device-device-cpu"])
def test_the_embeddings_gpu_way_trains_the_same_bytes_as_the_hosts(tmp_path, monkeypatch, tiers):
    """The tiled embedding's way on a GPU (no boolean indexing, one gradient for the vocabulary
    handed to the tiles as views: [Note: a tiled embedding without host synchronisation]) taken
    on the host: the same losses and weights, bit for bit, as the host's way, the padding row
    and accumulation included; an id out of range is refused there too (by the assertion)."""
    from infinity import _tiled

    def train(path, gpu_way):
        if gpu_way:
            monkeypatch.setattr(_tiled, "_on_gpu", lambda t: True)
            monkeypatch.setattr(_tiled, "_computes_whole", lambda scheduler, x: False)  # the embedding's alone
        torch.manual_seed(0)
        with infinity.initialize(Toy(), _cfg(path, tiers)) as engine:
            assert sum(u.is_tile and u.path == "embed" for u in engine.units) >= 3
            losses = _run(engine, 3, micro=2)
            if gpu_way:
                with pytest.raises(RuntimeError, match="index out of range"):
                    engine(torch.tensor([[1, VOCAB]]))
                engine.zero_grad()
            weights = engine.gathered_weights()
        monkeypatch.undo()
        return losses, weights

    host, gpu = train(tmp_path / "host", False), train(tmp_path / "gpu", True)
    assert gpu[0] == host[0]
    assert all(torch.equal(gpu[1][k], host[1][k]) for k in host[1])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tiles_on_the_device_computed_whole_train_as_untiled(tmp_path, monkeypatch, dtype):
    """With the parameters on the device and the compute on a GPU (taken here on the host), a
    tiled Linear computes with its whole weight ([Note: tiles computed whole]): the losses and
    weights of an untiled run (tile_size None), the tiles still the units of the gradients and
    the optimizer; the tile-by-tile path is not taken."""
    from infinity import _tiled

    tiers = ("device", "device", "cpu")
    # SGD: Adam's update hides a gradient's scale
    precision = {"precision": {"param_dtype": dtype}, "optimizer": {"type": "sgd", "momentum": 0.9}}
    torch.manual_seed(0)
    model = Toy()
    untiled = copy.deepcopy(model)
    with infinity.initialize(untiled, _cfg(tmp_path / "whole", tiers, tile=None, **precision)) as engine:
        assert not any(u.is_tile for u in engine.units)
        want = _run(engine, 3, micro=2)
        want_w = engine.gathered_weights()
    monkeypatch.setattr(_tiled, "_on_gpu", lambda t: True)
    calls = {"tile by tile": 0}
    real = _tiled._fp32_product

    def counted(*args):
        calls["tile by tile"] += 1
        return real(*args)

    monkeypatch.setattr(_tiled, "_fp32_product", counted)
    with infinity.initialize(model, _cfg(tmp_path / "tiled", tiers, **precision)) as engine:
        assert sum(u.is_tile and u.path == "out" for u in engine.units) >= 3
        got = _run(engine, 3, micro=2)
        got_w = engine.gathered_weights()
    assert calls["tile by tile"] == 0
    tol = 1e-6 if dtype == "fp32" else 0
    assert got == pytest.approx(want, abs=tol)
    _close(got_w, want_w, tol=tol if tol else 1e-9)


@pytest.mark.parametrize("whole", [False, True], ids=["tile-by-tile", "whole"])
@pytest.mark.parametrize("ask", ["autograd.grad", "backward(inputs=[x])", "retain_graph, then backward()"])
def test_a_backward_for_the_inputs_gradient_alone_gives_the_tiles_none(tmp_path, monkeypatch, whole, ask):
    """torch.autograd.grad(loss, x) and backward(inputs=[x]) leave the parameters' gradients
    alone, as in plain PyTorch: a tiled Linear's tiles get none either (they were handed their
    weight gradients, added to the next backward's: an audit helper's repro, 1.5e-3 off). A
    graph kept (retain_graph) for a backward() after autograd.grad gives them theirs once.
    Against plain PyTorch, SGD with momentum; tiles computed whole too (the GPU's way, taken
    on the host: [Note: tiles computed whole])."""
    from infinity import _tiled

    width, vocab = 16, 200

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, vocab))  # the last: tiles at 4KiB

    g = torch.Generator().manual_seed(1)
    x0, y0 = torch.randn(6, width, generator=g), torch.randint(0, vocab, (6,), generator=g)
    x1, y1 = torch.randn(6, width, generator=g), torch.randint(0, vocab, (6,), generator=g)
    ce = nn.functional.cross_entropy

    def steps(call, backward, step):
        gxs = []
        for _ in range(2):
            x = x0.clone().requires_grad_()
            loss = ce(call(x), y0)
            if ask == "autograd.grad":
                gxs.append(torch.autograd.grad(loss, x)[0])
                backward(ce(call(x1), y1))
            elif ask == "backward(inputs=[x])":
                loss.backward(inputs=[x])
                gxs.append(x.grad)
                backward(ce(call(x1), y1))
            else:
                gxs.append(torch.autograd.grad(loss, x, retain_graph=True)[0])
                backward(loss)
            step()
        return gxs

    ref = make()
    opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    want_gx = steps(ref, lambda loss: loss.backward(), lambda: (opt.step(), opt.zero_grad()))
    if whole:
        monkeypatch.setattr(_tiled, "_on_gpu", lambda t: True)
    cfg = _cfg(tmp_path, ("device", "device", "cpu"), optimizer={"type": "sgd", "momentum": 0.9, "weight_decay": 0.0})
    with infinity.initialize(make(), cfg) as engine:
        assert sum(u.is_tile for u in engine.units) >= 3
        got_gx = steps(engine, engine.backward, engine.step)
        got = engine.gathered_weights()
    for a, b in zip(got_gx, want_gx):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    _close(got, {k: v.detach() for k, v in ref.named_parameters()}, tol=1e-6)


@pytest.mark.parametrize("tiers", [("cpu", "cpu", "cpu"), ("nvme", "cpu", "cpu")], ids=["cpu", "nvme"])
def test_a_gradient_penalty_through_tiles_is_refused(tmp_path, tiers):
    """A backward with create_graph=True through a tiled Linear (a gradient penalty) is
    refused by name: the tiles' gradients are made outside autograd, and the penalty's
    second-order terms in them were dropped, silently (1e-3 off plain PyTorch in a step; an
    audit helper's repro). The engine trains on after it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4))
    with infinity.initialize(model, _cfg(tmp_path, tiers)) as engine:
        assert any(u.is_tile and u.path == "2" for u in engine.units)
        x = torch.randn(6, 8, requires_grad=True)
        out = engine(x)
        with pytest.raises(RuntimeError, match="create_graph=True.*tiled module '2'.*tile_size"):
            torch.autograd.grad(out.sum(), x, create_graph=True)
        engine.zero_grad()
        before = engine.gathered_weights()["2.weight"].clone()
        engine.backward(engine(torch.randn(6, 8)).pow(2).mean())  # a plain backward still trains
        engine.step()
        assert not torch.equal(before, engine.gathered_weights()["2.weight"])


def test_state_dict_round_trip_and_checkpoint_resume(tmp_path):
    torch.manual_seed(0)
    model = Toy()
    ref = copy.deepcopy(model)
    with infinity.initialize(model, _cfg(tmp_path / "a")) as engine:
        _run(engine, 2)
        sd = engine.module.state_dict()
        _close(sd, engine.gathered_weights(), tol=0)
        engine.save_checkpoint(tmp_path / "ckpt")
        after = _run(engine, 2)
        final = engine.gathered_weights()
    assert sd["embed.weight"].shape == (VOCAB, WIDTH) and sd["out.bias"].shape == (VOCAB,)
    with infinity.initialize(ref, _cfg(tmp_path / "b")) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        assert _run(engine, 2) == after  # resumes exactly
        assert all(torch.equal(final[k], v) for k, v in engine.gathered_weights().items())
        # load_state_dict writes every tile
        engine.module.load_state_dict(sd)
        _close(engine.gathered_weights(), sd)


DEVICE = ("device", "device", "device")


def _save_and_load_in(tmp_path, saved: tuple, loaded: tuple, *, model=Toy, **sections):
    """Train 2 steps tiled as ``saved`` says ((memory.tile_size, tiers)), save, train 2 more:
    the run that never re-cuts. A fresh engine tiled as ``loaded`` says loads the checkpoint
    (re-cut: its weights are the saved ones, bit for bit), saves it again and trains the same 2
    steps; an engine tiled as the first loads that second checkpoint and trains them too."""
    (tile, tiers), (tile_b, tiers_b) = saved, loaded
    torch.manual_seed(0)
    first = model()
    with infinity.initialize(first, _cfg(tmp_path / "a", tiers, tile, **sections)) as engine:
        _run(engine, 2)
        engine.save_checkpoint(tmp_path / "saved")
        at_save, cut_a = engine.gathered_weights(), [u.name for u in engine.units]
        after, final = _run(engine, 2, start=2), engine.gathered_weights()
    with infinity.initialize(model(), _cfg(tmp_path / "b", tiers_b, tile_b, **sections)) as engine:
        assert [u.name for u in engine.units] != cut_a  # another cut of the same modules
        engine.load_checkpoint(tmp_path / "saved")
        _close(engine.gathered_weights(), at_save, tol=0)
        engine.save_checkpoint(tmp_path / "again")
        recut, recut_final = _run(engine, 2, start=2), engine.gathered_weights()
    with infinity.initialize(model(), _cfg(tmp_path / "c", tiers, tile, **sections)) as engine:
        engine.load_checkpoint(tmp_path / "again")
        assert _run(engine, 2, start=2) == after  # cut back: every kind of state came through exact
        _close(engine.gathered_weights(), final, tol=0)
    # The other cut computes the same sums in another order: 1e-6.
    assert recut == pytest.approx(after, abs=1e-6)
    _close(recut_final, final, tol=1e-6)


@pytest.mark.parametrize(("saved", "loaded"), [
    (("4KiB", NVME), ("8KiB", NVME)),  # tiles of 42 and 85 rows: no boundary of one is one of the other
    (("4KiB", NVME), (None, NVME)),
    ((None, NVME), ("4KiB", ("cpu", "nvme", "cpu"))),
    (("4KiB", NVME), ("4KiB", DEVICE)),  # every tier on the device: nothing tiled
    (("4KiB", DEVICE), ("8KiB", ("cpu", "cpu", "cpu"))),
], ids=["4KiB-8KiB", "4KiB-whole", "whole-4KiB", "4KiB-device", "device-8KiB"])  # fmt: skip
def test_a_checkpoint_loads_into_another_tiling(tmp_path, saved, loaded):
    _save_and_load_in(tmp_path, saved, loaded)


def test_a_checkpoint_loads_into_another_tiling_in_bf16(tmp_path):
    _save_and_load_in(tmp_path, ("8KiB", NVME), ("4KiB", NVME), precision={"param_dtype": "bf16"})


def test_a_checkpoint_loads_into_another_tiling_with_sgd_momentum(tmp_path):
    """SGD starts a momentum buffer at a unit's first step: the loaded units have stepped."""
    _save_and_load_in(tmp_path, ("4KiB", NVME), (None, NVME), optimizer={"type": "sgd", "momentum": 0.9})


def test_a_checkpoint_loads_into_another_tiling_and_precision_with_a_frozen_embedding(tmp_path):
    """bf16 in 4KiB tiles to fp32 whole: the parameters become the saved master weights, and
    those of the frozen embedding (which has none) its saved bf16 parameters, re-cut and cast."""
    torch.manual_seed(0)
    model = Toy()
    model.embed.weight.requires_grad_(False)
    with infinity.initialize(copy.deepcopy(model).to(torch.bfloat16),
                             _cfg(tmp_path / "a", precision={"param_dtype": "bf16"})) as engine:  # fmt: skip
        _run(engine, 2)
        engine.save_checkpoint(tmp_path / "ckpt")
        at_save = engine.gathered_weights()
    with infinity.initialize(model, _cfg(tmp_path / "b", tile=None)) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        assert not any(u.is_tile for u in engine.units)
        _close(engine.gathered_weights(), at_save, tol=0)
        _close(engine.module.state_dict(), at_save, tol=0)
        _run(engine, 1, start=2)


class _TiedWide(Toy):
    """The output layer tied to the embedding, which keeps both whole; the hidden layers (9600
    and 9312 bytes) are the ones tiled."""

    def __init__(self):
        super().__init__(tied=True)
        self.hidden = nn.Sequential(nn.Linear(WIDTH, 96), nn.Tanh(), nn.Linear(96, WIDTH))


def test_a_checkpoint_with_a_tied_embedding_loads_into_another_tiling(tmp_path):
    _save_and_load_in(tmp_path, ("16KiB", NVME), ("4KiB", NVME), model=_TiedWide)


def test_a_checkpoint_whose_tiles_stepped_apart_is_refused_naming_them(tmp_path):
    """The tiles of one module step together; were their counts ever to differ, no one count
    could be the whole module's, and the load says which."""
    with infinity.initialize(Toy(), _cfg(tmp_path / "a")) as engine:
        _run(engine, 1)
        tile = next(u for u in engine.units if u.name == "out#40")
        engine.optimizer.steps[tile.index].fill_(7.0)
        engine.save_checkpoint(tmp_path / "ckpt")
    with infinity.initialize(Toy(), _cfg(tmp_path / "b", tile=None)) as engine:
        with pytest.raises(CheckpointError, match=r"'out'.*'out#0' and 6 more: 1; 'out#40': 7"):
            engine.load_checkpoint(tmp_path / "ckpt")
        _run(engine, 1)  # refused before any state was replaced: the engine trains on


class _Wider(Toy):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(WIDTH, VOCAB + 1)


def test_a_checkpoint_of_another_model_is_refused_naming_the_unit(tmp_path):
    with infinity.initialize(Toy(), _cfg(tmp_path / "a")) as engine:
        engine.save_checkpoint(tmp_path / "ckpt")
    with infinity.initialize(_Wider(), _cfg(tmp_path / "b", tile="8KiB")) as engine:
        with pytest.raises(CheckpointError, match=r"'out#0'.*not the same model"):
            engine.load_checkpoint(tmp_path / "ckpt")


def test_export_and_pretrained_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(cfg)
    source.save_pretrained(tmp_path / "src")
    engine = infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "src", _cfg(tmp_path / "swap", tile="16KiB"))
    try:
        assert {u.path for u in engine.units if u.is_tile} == {"model.embed_tokens", "lm_head"}
        _close(engine.gathered_weights(), dict(source.named_parameters()), tol=0)
        engine.save_pretrained(tmp_path / "out")
        engine.export(tmp_path / "w.safetensors")
    finally:
        engine.close()
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    _close(dict(back.named_parameters()), dict(source.named_parameters()), tol=0)
    from safetensors.torch import load_file

    _close({k: v for k, v in load_file(tmp_path / "w.safetensors").items() if k in dict(source.named_parameters())},
           dict(source.named_parameters()), tol=0)  # fmt: skip


def test_a_model_built_into_the_tiers_gets_the_values_plain_pytorch_gives(tmp_path):
    """`infinity.build` makes a tiled module's values whole once (its initialisation draws
    from the RNG as the plain model's does), then stores them tile by tile."""
    cfg = _cfg(tmp_path)
    torch.manual_seed(3)
    with infinity.build(cfg):
        model = Toy()
    torch.manual_seed(3)
    ref = Toy()
    with infinity.initialize(model, cfg) as engine:
        assert any(u.is_tile for u in engine.units)
        _close(engine.gathered_weights(), dict(ref.named_parameters()), tol=0)
        assert _run(engine, 2) == pytest.approx(_plain(ref, 2), abs=1e-5)


def test_a_bias_trained_under_a_frozen_tiled_weight(tmp_path):
    """Each parameter of a tile gets its gradient on its own: the output layer's bias learns
    while its weight (and the embedding) are frozen, as in plain PyTorch."""
    torch.manual_seed(0)
    model = Toy()
    model.out.weight.requires_grad_(False)
    model.embed.weight.requires_grad_(False)
    _trains_as_plain(tmp_path, model, 3)


class _Twice(Toy):
    def forward(self, ids):
        h = self.embed(ids)
        return self.out(torch.tanh(self.hidden(h))) + self.out(h)  # the tiled output layer twice


def test_a_tiled_module_called_twice_in_one_forward(tmp_path):
    torch.manual_seed(0)
    _trains_as_plain(tmp_path, _Twice(), 3)


def _wrap_forward(module: nn.Module) -> None:
    """Replace ``module``'s forward on the instance the way accelerate's ``add_hook_to_module``
    does (the class's forward kept as ``_old_forward``), here doubling the output."""
    module._old_forward = module.forward
    module.forward = functools.partial(lambda m, *args: 2 * m._old_forward(*args), module)


def test_a_module_whose_forward_was_replaced_on_the_instance_stays_whole(tmp_path):
    """A tiled forward would replace the instance's (accelerate's hooks, a user's wrapper) and
    drop what it does: such a module is kept whole and computes through its own forward."""
    torch.manual_seed(0)
    model = Toy()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        _wrap_forward(m.out)
    engine = _trains_as_plain(tmp_path, model, 3)
    assert {u.path for u in engine.units if u.is_tile} == {"embed"}
    assert model.out.__dict__["forward"].args == (model.out,)  # the wrapper is still the module's after close


def _clamp(grad):
    return grad.clamp(-1e-3, 1e-3)


def _clamp_accumulated(p):
    p.grad.clamp_(-1e-3, 1e-3)


@pytest.mark.parametrize("which", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_module_whose_parameter_has_a_hook_stays_whole(tmp_path, which):
    """A hook on a tiled parameter never ran (a tile's gradient is made by its Function, not
    through the parameter): the clamp was dropped, 0.035 off plain SGD in 3 steps, silently.
    A module whose parameter carries a hook at initialize is kept whole, and trains as plain."""
    torch.manual_seed(0)
    model = Toy()
    ref = copy.deepcopy(model)  # (deepcopy carries no hooks: each model gets its own)
    for m in (model, ref):
        if which == "register_hook":
            m.out.weight.register_hook(_clamp)
        else:  # clamps the accumulated gradient in place, as a hand clip would
            m.out.weight.register_post_accumulate_grad_hook(_clamp_accumulated)
    with infinity.initialize(model, _cfg(tmp_path)) as engine:
        assert {u.path for u in engine.units if u.is_tile} == {"embed"}
        losses = _run(engine, 3)
        weights = engine.gathered_weights()
    assert losses == pytest.approx(_plain(ref, 3), abs=1e-5)
    _close(weights, dict(ref.named_parameters()))


@pytest.mark.parametrize("which", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_hook_on_a_tiled_parameter_after_initialize_is_refused(tmp_path, which):
    with infinity.initialize(Toy(), _cfg(tmp_path)) as engine:
        with pytest.raises(RuntimeError, match=r"parameter 'out\.weight' is cut into tiles.*before infinity\.initialize"):
            getattr(engine.module.out.weight, which)(_clamp)
        engine.module.hidden.weight.register_hook(_clamp)  # a whole one takes it
        _run(engine, 1)


@pytest.mark.parametrize("reentrant", [True, False])
def test_tiled_layers_under_activation_checkpointing(tmp_path, reentrant):
    """A Llama whose MLPs, embedding and output layer are tiled, trained with transformers'
    gradient checkpointing: the tiled forwards run again inside backward."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.train()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    with infinity.initialize(model, _cfg(tmp_path)) as engine:
        assert any(u.is_tile and "mlp" in u.name for u in engine.units)
        for step in range(3):
            ids, _ = _batch(step)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            ref_loss = ref(input_ids=ids, labels=ids).loss
            ref_loss.backward()
            opt.step()
            opt.zero_grad()
            assert abs(loss.item() - ref_loss.item()) < 1e-5, (step, loss.item(), ref_loss.item())
        _close(engine.gathered_weights(), dict(ref.named_parameters()), tol=1e-4)


def test_a_tiled_first_layer_whose_input_needs_no_gradient(tmp_path):
    """The first layer's input is data: its backward reads no weights, only the input and the
    output's gradient, and gives the same weights as plain PyTorch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    with infinity.initialize(model, _cfg(tmp_path)) as engine:
        assert [u.path for u in engine.units if u.is_tile] == ["0"] * 3  # 31 rows of 32 + 1 per 4KiB
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
            loss = ((engine(x) - y) ** 2).mean()
            engine.backward(loss)
            engine.step()
            ref_loss = ((ref(x) - y) ** 2).mean()
            ref_loss.backward()
            opt.step()
            opt.zero_grad()
            assert abs(loss.item() - ref_loss.item()) < 1e-5
        _close(engine.gathered_weights(), dict(ref.named_parameters()))


def test_tiles_begin_at_a_multiple_of_64_rows():
    """Tiles cut at the byte budget begin at multiples of `TILE_ROW_ALIGN` rows, so a tiled
    Linear's output slices begin aligned for cuBLAS (the 953M Llama's down_proj was cut at row
    1489 before); a tile of fewer rows than that keeps the budget's cut."""
    from collections import Counter

    from infinity._units import TILE_ROW_ALIGN, _tile_rows

    def rows(module, tile_bytes):
        own = list(module.parameters())
        return _tile_rows(module, own, Counter(id(p) for p in own), tile_bytes)

    down = rows(nn.Linear(5632, 2048, bias=False), 32 << 20)
    assert down == [(0, 1472), (1472, 2048)] and TILE_ROW_ALIGN == 64
    head = rows(nn.Linear(2048, 32000), 32 << 20)
    assert all(lo % 64 == 0 for lo, _ in head) and head[-1][1] == 32000
    assert all(hi - lo <= (32 << 20) // (4 * 2049) for lo, hi in head)  # within the budget (a row: weight and bias)
    assert rows(nn.Linear(WIDTH, VOCAB), 4096)[:2] == [(0, 40), (40, 80)]  # fewer rows than 64: as the budget cuts

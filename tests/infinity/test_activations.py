"""Saved activations moved off the compute device ([activations] tier; [Note: activations
offloaded] in infinity/_activations.py): bit-identical training, the memory bound, the files."""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

import infinity
from infinity.swap import SwapCorruption
from infinity._activations import dense_span

sys.path.insert(0, os.path.dirname(__file__))
from _common import config  # noqa: E402

transformers = pytest.importorskip("transformers")
import test_model_zoo as zoo  # noqa: E402


def _zoo_run(tmp_path, family, dtype, tier, checkpointing, tiles=False, overlap=False, steps=3, move=None):
    """``steps`` steps of a zoo family with ``[activations] tier``: losses, weights, total stats.
    ``move``: what each batch goes through first (tests/infinity/test_gpu.py: to the GPU)."""
    make, batch = zoo.FAMILIES[family]
    torch.manual_seed(0)
    model = make()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    cfg = zoo._nvme(tmp_path / tier, dtype, tiles)
    cfg["activations"] = {"tier": tier, "min_bytes": 0}  # every saved tensor: the models are small
    cfg["optimizer"]["overlap"] = overlap
    engine = infinity.initialize(model, cfg)
    try:
        losses = []
        for step in range(steps):
            b = batch(step) if move is None else move(batch(step))
            if dtype == "bf16":
                b = zoo._cast(b, torch.bfloat16)
            loss = engine(**b).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.float().item())
            if engine.activations is not None and engine.activations.space is not None:
                assert len(engine.activations.space) == 0  # every name read back and freed
        return losses, engine.gathered_weights(), engine.stats()["total"]
    finally:
        engine.close()


def _same(a, b):
    assert a[0] == b[0]
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "t5"])
def test_transformers_with_activations_on_nvme_train_bit_identically(tmp_path, family, checkpointing, dtype):
    """HF's gradient_checkpointing_enable, reentrant or not: the checkpointed inputs of every
    block go to nvme and come back, and the run is the one with activations on the device."""
    want = _zoo_run(tmp_path, family, dtype, "device", checkpointing)
    got = _zoo_run(tmp_path, family, dtype, "nvme", checkpointing)
    _same(got, want)
    assert want[2]["activation_out_bytes"] == 0
    assert got[2]["activation_out_bytes"] > 0 and got[2]["activation_in_bytes"] > 0, got[2]


def test_every_saved_tensor_goes_without_checkpointing(tmp_path):
    want = _zoo_run(tmp_path, "llama", "fp32", "device", None)
    got = _zoo_run(tmp_path, "llama", "fp32", "nvme", None)
    _same(got, want)
    assert got[2]["activation_in_bytes"] > 0


def test_tiles_and_the_overlap_are_unaffected(tmp_path):
    want = _zoo_run(tmp_path, "llama", "fp32", "device", "non-reentrant", tiles=True, overlap=True)
    got = _zoo_run(tmp_path, "llama", "fp32", "nvme", "non-reentrant", tiles=True, overlap=True)
    _same(got, want)


class _ChangesSaved(nn.Module):
    """exp saves its output; the forward then changes it in place (an autograd error)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        y = self.lin(x).exp()
        y.add_(1)
        return y


def test_a_saved_tensor_changed_in_place_raises_as_in_plain_pytorch(tmp_path):
    """Saved-tensor hooks switch autograd's own check off: the engine's hooks check instead."""
    x = torch.randn(128, 64)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _ChangesSaved()(x).sum().backward()  # plain PyTorch
    cfg = config(tmp_path, ("nvme", "nvme", "nvme"), activations={"tier": "device", "min_bytes": 0})
    with infinity.initialize(_ChangesSaved(), cfg) as engine:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            engine.backward(engine(x).sum())


def test_a_tensor_changed_after_the_nvme_tier_copied_it_keeps_the_values_saved(tmp_path):
    """On a CPU device the tier copies a saved tensor's bytes when it is saved: a change in place
    after that cannot reach them, and backward computes with the values saved (the gradient of
    the forward as it ran), where plain PyTorch refuses to compute with the changed ones."""
    torch.manual_seed(0)
    model, x = _ChangesSaved(), torch.randn(128, 64)
    plain = copy.deepcopy(model)
    got, _ = _one_sgd_step(tmp_path, ("nvme", "nvme", "nvme"), model, x)
    # the same forward, nothing changed in place
    _same_as_one_plain_sgd_step(got, plain, (plain.lin(x).exp() + 1).sum())


def _one_sgd_step(tmp_path, tiers, model, x):
    """One SGD step (lr 0.1) of ``model`` on ``x``, its saved tensors on nvme: the weights after
    it and the totals of `engine.stats`."""
    cfg = config(tmp_path, tiers, activations={"tier": "nvme", "min_bytes": 0},
                 optimizer={"type": "sgd", "lr": 0.1, "weight_decay": 0.0})  # fmt: skip
    with infinity.initialize(model, cfg) as engine:
        engine.backward(engine(x).sum())
        engine.step()
        return engine.gathered_weights(), engine.stats()["total"]


def _same_as_one_plain_sgd_step(got: dict, plain, loss) -> None:
    """``got`` is bit for bit ``plain`` after one SGD step (lr 0.1) on ``loss``."""
    loss.backward()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0)


class _GatherRows(torch.autograd.Function):
    """Rows of ``w`` at ``idx`` (uint16), the indices saved for backward as they are."""

    @staticmethod
    def forward(ctx, w, idx):
        ctx.save_for_backward(idx)
        ctx.rows = w.shape[0]
        return w[idx.long()]

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        return torch.zeros(ctx.rows, g.shape[1], dtype=g.dtype).index_add_(0, idx.long(), g), None


class _Rows(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 32))
        self.lin = nn.Linear(32, 4)

    def forward(self, idx):
        return self.lin(_GatherRows.apply(self.w, idx))


def test_a_saved_tensor_of_a_dtype_the_swap_space_cannot_store_stays_with_autograd(tmp_path):
    """uint16 has no name in a swap space: the nvme tier leaves such a tensor where it is (the
    forward failed in the pack with "cannot be swapped"), moves the rest, and trains as plain."""
    torch.manual_seed(0)
    model, idx = _Rows(), torch.randint(0, 64, (4096,)).to(torch.uint16)
    plain = copy.deepcopy(model)
    got, total = _one_sgd_step(tmp_path, ("device", "device", "device"), model, idx)
    # the gathered rows (the linear's input) went, the indices stayed
    assert total["activation_out_bytes"] == 4096 * 32 * 4
    _same_as_one_plain_sgd_step(got, plain, plain(idx).sum())


def test_names_of_activations_never_read_back_go_at_the_next_pass(tmp_path):
    """A forward with grad whose backward never runs leaves its saved tensors behind: their
    names are freed once the graph goes, by the next pass; close removes the directory's files."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    cfg = config(tmp_path, ("nvme", "nvme", "nvme"), activations={"tier": "nvme", "min_bytes": 0})
    engine = infinity.initialize(model, cfg)
    try:
        space = engine.activations.space
        out = engine(torch.randn(32, 64))
        space.flush()  # the writes behind done: their names are in the space
        assert len(space) > 0
        del out  # the graph and its saved tensors go
        engine(torch.randn(32, 64)).sum()  # the next pass frees the names, saves its own
        loss = engine(torch.randn(32, 64)).sum()
        engine.backward(loss)
        engine.step()
        assert len(space) == 0
    finally:
        engine.close()
    assert not any(f for _, _, files in os.walk(tmp_path / "activations") for f in files)


class _SavesItsOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)

    def forward(self, x):
        h = torch.sigmoid(self.a(x))  # sigmoid saves its output
        self.last = weakref.ref(h)
        return (h * torch.tanh(h)).sum()


@pytest.mark.parametrize("tier,min_bytes", [("device", 0), ("nvme", 1 << 20)], ids=["device", "nvme-kept"])
def test_a_forward_without_backward_leaves_no_graph_behind(tmp_path, tier, min_bytes):
    """A grad-enabled forward whose output is dropped (a validation loss without no_grad): its
    graph goes, as in plain PyTorch. A tensor kept as it is held the output its own op saved,
    whose node held it back: a cycle through C++ that the collector cannot see, so every such
    graph stayed (20 of 20 in an audit helper's repro)."""
    model = _SavesItsOutput()
    cfg = config(tmp_path, ("nvme", "nvme", "nvme"), activations={"tier": tier, "min_bytes": min_bytes})
    with infinity.initialize(model, cfg) as engine:
        refs = []
        for _ in range(5):
            engine(torch.randn(8, 64))  # dropped unused
            refs.append(model.last)
        gc.collect()
        assert [r() for r in refs] == [None] * 5
        engine.backward(engine(torch.randn(8, 64)))  # and training goes on
        engine.step()


def test_dense_span():
    t = torch.randn(4, 6)
    assert dense_span(t) and dense_span(t.t()) and dense_span(t.permute(1, 0).contiguous())
    assert not dense_span(t[:, :3])  # a gap between rows
    assert not dense_span(torch.randn(4, 1).expand(4, 6))  # the same element several times
    assert dense_span(torch.randn(1, 5)[:, 1:])  # a stretch inside the storage


def test_activation_settings_are_checked():
    with pytest.raises(ValueError, match="activations.tier"):
        infinity.TierConfig.from_dict({"activations": {"tier": "disk"}})
    with pytest.raises(ValueError, match="nvme.paths: empty, but activations.tier is 'nvme'"):
        infinity.TierConfig.from_dict({"activations": {"tier": "nvme"}})


ACT = 16384 * 256 * 4  # one block's input: 16K tokens of hidden 256 in fp32, 16 MiB


def _child(tmp_path, tier: str, layers: int) -> dict:
    path = tmp_path / f"{tier}-{layers}"
    path.mkdir()
    child = os.path.join(os.path.dirname(__file__), "_activations_child.py")
    out = subprocess.run([sys.executable, child, str(path), tier, str(layers), "16384", "256"], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_rss_of_a_long_sequence_does_not_grow_with_depth_on_nvme(tmp_path):
    """16 against 4 checkpointed blocks at 16K tokens, hidden 256 (each block's input 16 MiB).
    On the device every input stays until backward: 12 blocks more hold 12 x 16 MiB more. On
    nvme the step's peak is what a few blocks hold at once, whatever the depth: in forward the
    block running (its input, output and two intermediates) and `MAX_IN_FLIGHT` (2) inputs being
    written; in backward the input read back, the recomputed block's three tensors, and the
    gradients flowing through it (three): at most 8 inputs' worth."""
    device = {n: _child(tmp_path, "device", n) for n in (4, 16)}
    nvme = {n: _child(tmp_path, "nvme", n) for n in (4, 16)}
    assert device[16]["growth"] - device[4]["growth"] >= 0.9 * 12 * ACT, device  # the test can fail
    assert nvme[16]["growth"] - nvme[4]["growth"] <= ACT, nvme  # no growth with depth (one input of noise)
    assert nvme[16]["growth"] <= 8 * ACT, nvme
    for n in (4, 16):  # every block's input went out; all but those still being written came back
        assert nvme[n]["out"] == n * ACT, nvme[n]
        assert (n - 2) * ACT <= nvme[n]["in"] <= n * ACT, nvme[n]


def test_activations_alone_on_nvme_make_the_swap_directory_and_remove_it(tmp_path):
    """Every tier of the state in memory, the activations on nvme: nvme.paths' last component
    is made (as the state's space would make it) and removed again at close."""
    torch.manual_seed(0)
    swap = tmp_path / "swap"
    cfg = config(swap, ("device", "device", "device"), activations={"tier": "nvme", "min_bytes": 0})
    with infinity.initialize(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)), cfg) as engine:
        engine.backward(engine(torch.randn(32, 64)).sum())
        engine.step()
        assert engine.stats()["step"]["activation_in_bytes"] > 0
        assert swap.is_dir()
    assert not swap.exists()


def _run_with_a_flipped_activation(tmp_path, dtype, verify=None):
    """One step of the zoo's Llama with checkpointed activations on nvme, one bit of a saved
    float activation flipped on disk between forward and backward: the weights, or the error
    backward raised, and (file, chunk name, its first extent's offset)."""
    make, batch = zoo.FAMILIES["llama"]
    torch.manual_seed(0)
    model = make()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = zoo._nvme(tmp_path / f"{dtype}-{verify}", dtype)
    cfg["activations"] = {"tier": "nvme", "min_bytes": 0}
    if verify is not None:
        cfg["nvme"]["verify"] = verify
    b = batch(0) if dtype == "fp32" else zoo._cast(batch(0), torch.bfloat16)
    with infinity.initialize(model, cfg) as engine:
        loss = engine(**b).loss
        space = engine.activations.space
        space.flush()  # the writes behind done: every saved tensor is on disk
        name = max((n for n in space.names() if space.info(n).dtype in ("float32", "bfloat16")),
                   key=lambda n: space.info(n).nbytes)  # fmt: skip
        first = space.info(name).extents[0]
        arena = space.files[first.file].path
        with open(arena, "r+b") as f:
            f.seek(first.offset + 2)
            byte = f.read(1)
            f.seek(first.offset + 2)
            f.write(bytes([byte[0] ^ 0x40]))
        try:
            engine.backward(loss)
        except SwapCorruption as e:
            return e, (arena, name, first.offset)
        engine.step()
        return engine.gathered_weights(), (arena, name, first.offset)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_flipped_byte_in_the_activation_file_raises_in_backward_naming_it(tmp_path, dtype):
    """At the default nvme.verify the chunk read back is checked before backward computes with
    it: the error names the file, the chunk, its offset, and the saved tensor it belongs to."""
    err, (arena, name, offset) = _run_with_a_flipped_activation(tmp_path, dtype)
    assert isinstance(err, SwapCorruption), err
    assert (err.filename, err.tensor, err.offset) == (arena, name, offset)
    message = str(err)
    assert arena in message and repr(name) in message and f"offset {offset}" in message
    assert "activation" in message


def test_verify_off_trains_on_a_flipped_activation_without_a_word(tmp_path):
    """The opt-out, and what it risks: the step runs on the bytes as the drive has them."""
    got, _ = _run_with_a_flipped_activation(tmp_path, "fp32", verify="off")
    assert isinstance(got, dict), got
    want = _zoo_run(tmp_path, "llama", "fp32", "nvme", "non-reentrant", steps=1)[1]
    assert any(not torch.equal(got[k], want[k]) for k in want)

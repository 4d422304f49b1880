"""nvme.verify through the engine: at the default every read of the state's swap file
(parameters in forward, gradients and optimizer states in the step, the optimizer's reads under
backward) is checked, and a flipped byte raises SwapCorruption naming the file, the tensor and
its offset instead of training on; verification changes no number; ``verify = "off"`` reads
without checking. The activation file's case is in test_activations.py."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import infinity
from infinity.swap import SwapCorruption

sys.path.insert(0, os.path.dirname(__file__))
from _common import config, make_model, train  # noqa: E402

NVME = ("nvme", "nvme", "nvme")


def _engine(tmp_path, verify=None, **sections):
    tmp_path.mkdir(exist_ok=True)
    cfg = config(tmp_path / f"swap-{verify}", NVME, **sections)
    if verify is not None:
        cfg["nvme"]["verify"] = verify
    return infinity.initialize(make_model(width=256), cfg)


def _flip(engine, name: str) -> tuple[str, int]:
    """Flip one bit of ``name``'s bytes in the arena; the (file, offset) of its first extent."""
    space = engine.space
    space.flush()
    first = space.info(name).extents[0]
    path = space.files[first.file].path
    with open(path, "r+b") as f:
        f.seek(first.offset + 9)
        byte = f.read(1)
        f.seek(first.offset + 9)
        f.write(bytes([byte[0] ^ 0x04]))
    return path, first.offset


def _batch(seed: int = 100):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _assert_names(err: SwapCorruption, name: str, path: str, offset: int) -> None:
    assert (err.tensor, err.filename, err.offset) == (name, path, offset)
    message = str(err)
    assert repr(name) in message and path in message and f"offset {offset}" in message


def test_the_default_config_checks_every_swap_read():
    assert infinity.TierConfig().nvme.verify == "always"


def test_a_flipped_parameter_byte_raises_in_the_forward_that_reads_it(tmp_path):
    engine = _engine(tmp_path)
    try:
        train(engine, 1)
        path, offset = _flip(engine, "3/param")
        x, _ = _batch()
        with pytest.raises(SwapCorruption) as info:
            engine(x)
        _assert_names(info.value, "3/param", path, offset)
    finally:
        try:
            engine.close()
        except SwapCorruption:
            pass  # the scheduler raises a failed fetch's error again when close drops it


def test_a_flipped_gradient_byte_raises_in_the_step(tmp_path):
    # No gradient held in memory ([Note: gradients held]) and no update under backward: each
    # is written in backward and read in the step.
    with _engine(tmp_path, memory={"host_budget": "4MiB"}, optimizer={"overlap": False}) as engine:
        engine.plan.held = 0
        x, y = _batch()
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.space.flush()  # the gradients' writes go on behind backward
        assert "3/grad" in engine.space
        path, offset = _flip(engine, "3/grad")
        with pytest.raises(SwapCorruption) as info:
            engine.step()
        _assert_names(info.value, "3/grad", path, offset)


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "under-backward"])
def test_a_flipped_optimizer_state_byte_raises_before_the_update_uses_it(tmp_path, overlap):
    """Read in the step, or under backward by the overlap's early updates."""
    with _engine(tmp_path, optimizer={"overlap": overlap}) as engine:
        train(engine, 1)
        name = "optimizer.0/exp_avg"
        path, offset = _flip(engine, name)
        with pytest.raises(SwapCorruption) as info:
            train(engine, 1, start=1)
        _assert_names(info.value, name, path, offset)


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "under-backward"])
def test_verification_changes_no_number(tmp_path, overlap):
    runs = {}
    for verify in ("always", "off"):
        with _engine(tmp_path, verify, optimizer={"overlap": overlap}) as engine:
            losses = train(engine, 3)
            runs[verify] = losses, engine.gathered_weights()
    assert runs["always"][0] == runs["off"][0]
    for k, v in runs["off"][1].items():
        assert torch.equal(runs["always"][1][k], v), k


def test_verify_off_reads_a_flipped_byte_without_checking(tmp_path):
    """The opt-out, and what it risks: the forward computes with the flipped parameter."""
    x, _ = _batch()
    outs = {}
    for flip in (False, True):
        with _engine(tmp_path / str(flip), "off") as engine:
            train(engine, 1)
            if flip:
                _flip(engine, "3/param")
            outs[flip] = engine(x).detach()
    assert not torch.equal(outs[True], outs[False])

"""An engine's life around the user's model: initialize twice, drop without close."""

from __future__ import annotations

import os
import sys

import pytest

import infinity

sys.path.insert(0, os.path.dirname(__file__))
from _common import config, make_model, train  # noqa: E402

NVME = ("nvme", "nvme", "nvme")


@pytest.mark.parametrize("closed", [True, False])
def test_a_module_given_to_an_engine_is_refused_by_a_second_initialize(tmp_path, closed):
    """Its parameters are the engine's placeholders (empty): a second engine would train them."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model = make_model()
    engine = infinity.initialize(model, config(tmp_path / "a", NVME))
    train(engine, 1)
    if closed:
        engine.close()
    with pytest.raises(ValueError, match="already given to infinity.initialize .*'0.weight'.*build the model again"):
        infinity.initialize(model, config(tmp_path / "b", NVME))
    engine.close()


def test_an_engine_dropped_with_its_model_unlocks_its_swap_directory(tmp_path, caplog):
    """Without close(), once nothing refers to the engine or its model, the garbage collector
    closes its swap space: a new engine opens the same directory in the same process."""
    import gc

    (tmp_path / "a").mkdir()
    model = make_model()
    engine = infinity.initialize(model, config(tmp_path / "a", NVME))
    train(engine, 1)
    del engine, model
    gc.collect()
    assert "garbage-collected without engine.close()" in caplog.text
    again = infinity.initialize(make_model(), config(tmp_path / "a", NVME))
    train(again, 1)
    again.close()


def test_a_second_engine_on_the_directory_of_a_live_one_names_the_cause(tmp_path):
    """The first engine was dropped, but its model (whose hooks hold it) is alive: its swap
    directory is still in use, and the message says so and what to do."""
    (tmp_path / "a").mkdir()
    model = make_model()
    infinity.initialize(model, config(tmp_path / "a", NVME))  # dropped at once, model kept
    with pytest.raises(RuntimeError, match="another swap space of this process .*engine.close\\(\\).*while its model is alive"):
        infinity.initialize(make_model(), config(tmp_path / "a", NVME))
    del model


@pytest.mark.parametrize("keep", [True, False])
def test_what_close_leaves_on_disk(tmp_path, keep):
    """keep = true: the swap files, no larger than the state they hold; false: nothing the
    space made (the directory the user named stays)."""
    model = make_model()
    (tmp_path / "swap").mkdir()
    cfg = config(tmp_path / "swap", NVME)
    cfg["nvme"]["keep"] = keep
    engine = infinity.initialize(model, cfg)
    train(engine, 2)
    state = sum(u.numel for u in engine.units) * (4 + 4 + 12)  # params, grads, master and two moments (fp32)
    engine.close()
    files = [p for p in (tmp_path / "swap").rglob("*") if p.is_file()]
    if keep:
        used = sum(p.stat().st_blocks * 512 for p in files)
        assert 0 < used <= state + 64 * 4096 * len(files)  # alignment of each tensor to 4 KiB
    else:
        assert files == [] and (tmp_path / "swap").is_dir()

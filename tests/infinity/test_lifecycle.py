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

"""infinity.build: a model constructed straight into the params tier, and what it opened."""

import os
import sys

import pytest
import torch
from torch import nn

import infinity
from infinity.swap import SwapSpace

sys.path.insert(0, os.path.dirname(__file__))
from _common import config, train  # noqa: E402


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


def test_a_model_from_a_build_whose_block_raised_is_refused_by_initialize(tmp_path):
    cfg = config(tmp_path, ("nvme", "nvme", "nvme"))
    holder = {}
    with pytest.raises(_Boom):
        with infinity.build(cfg):
            holder["model"] = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
            raise _Boom()
    with pytest.raises(ValueError, match="build the model again"):
        infinity.initialize(holder["model"], cfg)

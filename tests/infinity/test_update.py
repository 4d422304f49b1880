"""The optimizer step's accounting (`_update`, `_substates`): what ``engine.stats()["step"]``
counts equals what the step moves.

On this machine the compute device is the host: placement device,device,cpu puts the
parameters and gradients in host memory beside the optimizer's states, nothing crosses to a
GPU (``h2d_bytes``, ``d2h_bytes`` stay 0) and the resident tiers' bytes are what the update
reads and writes there. tests/infinity/test_gpu.py holds the same placement on a GPU, where
the gradients and parameters cross.
"""

import os
import sys

import pytest
import torch

import infinity

sys.path.insert(0, os.path.dirname(__file__))
from _common import config, make_model, train  # noqa: E402

HOST = ("device", "device", "cpu")
needs_host_device = pytest.mark.skipif(torch.cuda.is_available(),
                                       reason="the compute device is a GPU here: test_gpu.py holds this placement")  # fmt: skip


def _engine(tmp_path, tiers=HOST, dtype="fp32", overlap=False, state_dtype="fp32"):
    cfg = config(tmp_path, tiers, precision={"param_dtype": dtype},
                 optimizer={"overlap": overlap, "state_dtype": state_dtype})  # fmt: skip
    return infinity.initialize(make_model(), cfg)


def _numel(engine) -> int:
    return sum(u.shard_numel for g in engine.optimizer.groups for u in g.units)


@needs_host_device
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_host_step_counts_the_bytes_it_reads_and_writes(tmp_path, dtype):
    """Per parameter: the fp32 gradient read (4 B) from the device tier; the master weights and
    both moments read and written (4 B each way each) in the cpu tier; the new parameters written
    in their dtype."""
    engine = _engine(tmp_path, dtype=dtype)
    n = _numel(engine)
    train(engine, 2, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    step = engine.stats()["step"]
    device, cpu = step["device"]["by_kind"], step["cpu"]["by_kind"]
    assert device["grad"] == {"read_bytes": 4 * n, "write_bytes": 0}
    assert device["param"] == {"read_bytes": 0, "write_bytes": (2 if dtype == "bf16" else 4) * n}
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        assert cpu[kind] == {"read_bytes": 4 * n, "write_bytes": 4 * n}, kind
    assert step["cpu"]["read_bytes"] == 12 * n and step["cpu"]["write_bytes"] == 12 * n
    assert step["h2d_bytes"] == step["d2h_bytes"] == 0  # the device is the host: nothing crosses
    assert step["nvme"]["read_bytes"] == step["nvme"]["write_bytes"] == 0
    assert 0 < step["optimizer_seconds"] <= step["update_seconds"] <= step["seconds"]
    total = engine.stats()["total"]
    assert total["device"]["by_kind"]["grad"]["read_bytes"] == 2 * 4 * n
    assert total["optimizer_seconds"] >= step["optimizer_seconds"]
    engine.close()


@needs_host_device
def test_int8_states_count_their_codes_and_scales(tmp_path):
    """Compact states: each moment's codes (1 B a parameter) and its scales (4 B a block of
    each unit's part) are read and written, the master weights in fp32."""
    engine = _engine(tmp_path, state_dtype="int8")
    n = _numel(engine)
    blocks = sum(-(-u.shard_numel // 256) for g in engine.optimizer.groups for u in g.units)
    train(engine, 1)
    cpu = engine.stats()["step"]["cpu"]["by_kind"]
    assert cpu["master"] == {"read_bytes": 4 * n, "write_bytes": 4 * n}
    for moment in ("exp_avg", "exp_avg_sq"):
        assert cpu[moment] == {"read_bytes": n, "write_bytes": n}
        assert cpu[moment + ".scale"] == {"read_bytes": 4 * blocks, "write_bytes": 4 * blocks}
    engine.close()


def test_optimizer_time_counts_the_early_updates_too(tmp_path):
    """Under backward (the overlap, states in host memory) the kernels run before the step:
    their time is the step's all the same."""
    engine = _engine(tmp_path, tiers=("cpu", "cpu", "cpu"), overlap=True)
    train(engine, 2)
    step = engine.stats()["step"]
    assert engine.optimizer.overlap is not None and engine.optimizer.overlap.committed > 0
    assert step["optimizer_seconds"] > 0
    engine.close()

"""The optimizer step's accounting and its one copy of fp32 weights in memory (`_update`,
`_substates`): what ``engine.stats()["step"]`` counts equals what the step moves, and the
parameters shared with the master weights train bit-identically to the two copies.

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
from infinity._substates import SubGroupStates

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
    in their dtype (bf16: 2 B; fp32: none, they are the master weights the kernel wrote)."""
    engine = _engine(tmp_path, dtype=dtype)
    n = _numel(engine)
    train(engine, 2, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    step = engine.stats()["step"]
    device, cpu = step["device"]["by_kind"], step["cpu"]["by_kind"]
    assert device["grad"] == {"read_bytes": 4 * n, "write_bytes": 0}
    if dtype == "bf16":
        assert device["param"] == {"read_bytes": 0, "write_bytes": 2 * n}
    else:
        assert "param" not in device
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
    assert engine.overlap is not None and engine.overlap.committed > 0
    assert step["optimizer_seconds"] > 0
    engine.close()


def _weights(engine) -> dict:
    return {k: v.clone() for k, v in engine.gathered_weights().items()}


def _no_sharing(monkeypatch):
    monkeypatch.setattr(SubGroupStates, "may_share", lambda self: False)


@pytest.mark.parametrize("tiers", [HOST, ("cpu", "cpu", "cpu"), ("device", "device", "device")])
def test_parameters_shared_with_the_master_weights_train_bit_identically(tmp_path, monkeypatch, tiers):
    """fp32 parameters resident beside the master weights become them at the first step
    ([Note: one copy of the fp32 weights] in `_onecopy`): the same losses and weights, bit for
    bit, as the engine keeping two copies."""
    shared = _engine(tmp_path / "a", tiers=tiers)
    losses = train(shared, 4)
    opt = shared.optimizer
    assert opt.substates.sharing == {g.index for g in opt.groups}
    for g in opt.groups:  # one memory: the parameters are views of the master weights
        master = opt.states["master"].get(g.record.name_for()).result().tensor
        for u in g.units:
            param = shared.param_store.get(u.name).result().tensor
            assert param.data_ptr() == master[g.slices[u.index]].data_ptr()
    with monkeypatch.context() as m:
        _no_sharing(m)
        two = _engine(tmp_path / "b", tiers=tiers)
        assert two.optimizer.substates.sharing == set()
        assert train(two, 4) == losses
    a, b = _weights(shared), _weights(two)
    assert all(torch.equal(a[k], b[k]) for k in a)
    shared.close()
    two.close()


@pytest.mark.parametrize("when", [0, 1], ids=["before-the-first-step", "after"])
def test_a_write_to_resident_fp32_parameters_is_trained_on_as_in_plain_pytorch(tmp_path, when):
    """A layer zeroed in place (a re-init, a zero-init head) while fp32 parameters are resident
    beside the master weights: the parameters are what the optimizer steps, as in plain PyTorch,
    before the first step as after it (before it, the first step's sharing took the master
    weights' values and the write was lost: 0.17 off after 3 steps)."""
    import copy

    model = make_model()
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01, fused=True)  # the engine's kernel
    engine = infinity.initialize(model, config(tmp_path, ("device",) * 3, optimizer={"overlap": False}))
    try:
        for step in range(3):
            if step == when:
                with torch.no_grad():
                    engine.module[3].weight.zero_()
                    plain[3].weight.zero_()
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            for m, stepper, zero in ((engine, engine.step, engine.zero_grad), (plain, opt.step, opt.zero_grad)):
                torch.manual_seed(step)  # the same dropout masks
                ((m(x) - y) ** 2).mean().backward()
                stepper()
                zero()
        got = engine.gathered_weights()
        assert all(torch.equal(got[k], p.detach()) for k, p in plain.named_parameters())
        assert engine.optimizer.substates.sharing == {g.index for g in engine.optimizer.groups}
    finally:
        engine.close()


def test_no_sharing_under_the_overlap_in_host_memory(tmp_path, monkeypatch):
    """The overlap's commit swaps staged copies in for the master weights: they stay apart from
    the parameters, and it trains as the engine that never shares."""
    engine = _engine(tmp_path / "a", overlap=True)
    losses = train(engine, 3)
    assert engine.overlap is not None and engine.optimizer.substates.sharing == set()
    with monkeypatch.context() as m:
        _no_sharing(m)
        other = _engine(tmp_path / "b", overlap=True)
        assert train(other, 3) == losses
    a, b = _weights(engine), _weights(other)
    assert all(torch.equal(a[k], b[k]) for k in a)
    engine.close()
    other.close()


def test_shared_weights_resume_from_a_checkpoint_exactly(tmp_path):
    """A checkpoint of shared weights loads into an engine that shares them and trains on as
    the one that saved it."""
    engine = _engine(tmp_path / "a")
    train(engine, 2)
    engine.save_checkpoint(tmp_path / "ckpt")
    ahead = train(engine, 2, start=2)
    resumed = _engine(tmp_path / "b")
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert train(resumed, 2, start=2) == ahead
    assert resumed.optimizer.substates.sharing == {g.index for g in resumed.optimizer.groups}
    a, b = _weights(engine), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    engine.close()
    resumed.close()



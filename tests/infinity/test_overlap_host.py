"""The optimizer under backward with its states in host memory (the cpu tier, ZeRO-Offload's
placement): the same numbers as the step after backward.

As in test_overlap.py (whose model, batches and training loop these tests share, and whose
test_overlap_matches_torch_adamw[host] compares this overlap with torch.optim.AdamW), every test
trains twice on the same data, with overlap and without, and asserts bit-identical losses and
weights; and how many sub-groups were committed early, so that a test whose early updates
silently never ran (or always ran) fails. See [Note: staged in host memory] in
infinity/_overlap_host.py.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import infinity
from infinity._overlap_host import InMemory

sys.path.insert(0, os.path.dirname(__file__))
from test_overlap import _batch, _cfg, _mlp, _same, _train  # noqa: E402

# (params, grads, optimizer): the states in host memory, the parameters and gradients anywhere.
HOST = [("cpu", "cpu", "cpu"), ("nvme", "cpu", "cpu"), ("device", "device", "cpu"), ("nvme", "nvme", "cpu")]
ids = ["-".join(t) for t in HOST]


@pytest.mark.parametrize("tiers", HOST, ids=ids)
def test_bit_identical_and_every_sub_group_committed(tmp_path, tiers):
    off = _train(tmp_path / "off", False, tiers=tiers)
    on = _train(tmp_path / "on", True, tiers=tiers)
    _same(off, on)
    assert off[2] == [0] * 4
    assert on[2] == [4] * 4  # 4 units, one sub-group each (1KiB), all updated under backward


@pytest.mark.parametrize("clip, committed", [(1e-3, [0, 0, 0, 0]), (1e3, [4, 4, 4, 4])])
def test_clipping(tmp_path, clip, committed):
    """A step that clips discards its early updates (and the next does not try); one under the
    limit commits them."""
    off = _train(tmp_path / "off", False, tiers=HOST[1], optimizer={"max_grad_norm": clip})
    on = _train(tmp_path / "on", True, tiers=HOST[1], optimizer={"max_grad_norm": clip})
    _same(off, on)
    assert on[2] == committed


def test_clip_grad_norm_called_between_backward_and_step(tmp_path):
    """What Trainer and accelerate loops do: the clip is known only after backward."""

    def clip(engine, step):
        engine.clip_grad_norm_(1e-3 if step % 2 else 1e3)

    off = _train(tmp_path / "off", False, tiers=HOST[0], between=clip)
    on = _train(tmp_path / "on", True, tiers=HOST[0], between=clip)
    _same(off, on)
    assert on[2][0] == 4 and on[2][1] == 0  # step 0 under the limit; step 1 clipped


def test_fp16_overflow(tmp_path):
    """An overflow is known only at the step: the early updates are discarded, the step skipped."""

    def loss_fn(step, out, y):
        loss = ((out - y) ** 2).float().mean()
        return loss * 1e30 if step == 1 else loss  # scaled by the loss scale: inf in fp16

    kw = dict(tiers=HOST[1], dtype=torch.float16, precision={"param_dtype": "fp16", "initial_scale": 1024},
              loss_fn=loss_fn)  # fmt: skip
    off = _train(tmp_path / "off", False, **kw)
    on = _train(tmp_path / "on", True, **kw)
    _same(off, on)
    assert on[2][1] == 0 and on[2][0] == 4 and on[2][2] == 4


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_low_precision_parameters(tmp_path, dtype):
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    kw = dict(tiers=HOST[2], dtype=torch_dtype, precision={"param_dtype": dtype})
    off = _train(tmp_path / "off", False, **kw)
    on = _train(tmp_path / "on", True, **kw)
    _same(off, on)
    assert on[2] == [4] * 4


@pytest.mark.parametrize("tiers", [HOST[0], HOST[3]], ids=[ids[0], ids[3]])
def test_gradient_accumulation(tmp_path, tiers):
    kw = dict(tiers=tiers, micro=3, optimizer={"gradient_accumulation_steps": 3})
    off = _train(tmp_path / "off", False, **kw)
    on = _train(tmp_path / "on", True, **kw)
    _same(off, on)
    assert on[2] == [4] * 4  # only the third backward updated early


def test_more_micro_batches_than_configured_discards_the_stale_updates(tmp_path):
    off = _train(tmp_path / "off", False, tiers=HOST[0], micro=2)
    on = _train(tmp_path / "on", True, tiers=HOST[0], micro=2)
    _same(off, on)
    assert on[2] == [0] * 4


def test_a_hyperparameter_changed_between_backward_and_step(tmp_path):
    def change(engine, step):
        if step == 2:
            for group in engine.optimizer.param_groups:
                group["lr"] = 0.5

    off = _train(tmp_path / "off", False, tiers=HOST[0], between=change)
    on = _train(tmp_path / "on", True, tiers=HOST[0], between=change)
    _same(off, on)
    assert on[2] == [4, 4, 0, 4]


def test_the_parameters_change_only_at_the_step_and_zero_grad_discards(tmp_path):
    """Parameters in host memory are what the modules compute with: an early update must not
    show through before the step (a forward run again inside backward would see it), and
    zero_grad drops it without a trace."""
    os.makedirs(tmp_path / "a")
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "a", True, tiers=HOST[0]))
    assert isinstance(engine.overlap.staging, InMemory)
    before = engine.gathered_weights()
    states = {k: s._resident.copy() for k, s in engine.optimizer.states.items()}
    x, y = _batch(0)
    engine.backward(((engine(x) - y) ** 2).mean())
    assert engine.overlap.pending == 4
    assert all(torch.equal(before[k], v) for k, v in engine.gathered_weights().items())
    engine.zero_grad()
    assert engine.overlap.pending == 0
    assert all(torch.equal(before[k], v) for k, v in engine.gathered_weights().items())
    for k, store in engine.optimizer.states.items():  # the same tensors, unchanged
        assert all(store._resident[n] is t for n, t in states[k].items())
    assert all(float(s) == 0 for s in engine.optimizer.steps.values())
    engine.close()


def test_staging_stays_within_its_budget_and_the_rest_is_left_to_the_step(tmp_path):
    """A budget that stages only some sub-groups: those are committed, the others updated by
    the step, the numbers the same; the staging tensors never exceed the bytes planned."""
    from infinity import _bytes

    small = {"sub_group_size": "4KiB"}
    off = _train(tmp_path / "off", False, tiers=HOST[0], optimizer=small)
    os.makedirs(tmp_path / "on")
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "on", True, HOST[0], optimizer=small))
    opt = engine.optimizer
    sizes = sorted(_bytes.host_staged_bytes(opt, g) for g in opt.groups)
    assert len(sizes) >= 2
    engine.overlap.staging.tensors.budget = sizes[-1]  # room for one sub-group at a time
    losses, committed = [], []
    for step in range(4):
        x, y = _batch(step)
        loss = ((engine(x) - y) ** 2).float().mean()
        engine.backward(loss)
        assert engine.overlap.staging.tensors.bytes <= sizes[-1]
        engine.step()
        losses.append(loss.item())
        committed.append(engine.overlap.committed)
    on = losses, engine.gathered_weights(), committed
    engine.close()
    _same(off, on)
    assert all(0 < c < len(sizes) for c in committed), committed


def test_staging_makes_no_buffer_after_the_first_step_where_the_budget_stages_part(tmp_path):
    """Sub-groups of several sizes and a budget that stages about half of them: the first step
    makes the staging buffers, later steps reuse them and make none (on a GPU each is pinned and
    later unpinned under backward: [Note: staging without churn]); the numbers the same."""
    from infinity import _bytes

    def model():
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 32), nn.LayerNorm(32)) for _ in range(4)]
        return nn.Sequential(nn.Embedding(300, 32), *blocks, nn.Linear(32, 300))

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randint(0, 300, (8,), generator=g), torch.randn(8, 300, generator=g)

    def train(path, overlap, budget_fraction=None):
        os.makedirs(path)
        cfg = _cfg(path, overlap, HOST[2], optimizer={"sub_group_size": "64KiB"})
        with infinity.initialize(model(), cfg) as engine:
            if overlap:
                sizes = [_bytes.host_staged_bytes(engine.optimizer, g) for g in engine.optimizer.groups]
                assert len(set(sizes)) >= 3, sizes
                engine.overlap.staging.tensors.budget = int(sum(sizes) * budget_fraction)
            losses, made, committed, groups = [], [], [], len(engine.optimizer.groups)
            for step in range(5):
                x, y = batch(step)
                loss = ((engine(x) - y) ** 2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                if overlap:
                    made.append(engine.overlap.staging.tensors.allocated)
                    committed.append(engine.overlap.committed)
            return losses, engine.gathered_weights(), made, committed, groups

    off = train(tmp_path / "off", False)
    for fraction in (0.3, 0.6):
        losses, weights, made, committed, groups = train(tmp_path / f"on{fraction}", True, fraction)
        assert losses == off[0] and all(torch.equal(weights[k], off[1][k]) for k in weights)
        assert all(0 < c < groups for c in committed) and len(set(committed)) == 1, (committed, groups)
        assert made[0] > 0 and made[1:] == [made[1]] * 4 and made[1] == made[0], made


def test_staging_that_cannot_be_allocated_leaves_the_updates_to_the_step(tmp_path, monkeypatch, caplog):
    """Staging memory that cannot be had (on a GPU: pinning refused by cudaHostRegister) is as no
    room: every update is the step's, said once, the numbers the same; nothing fails backward."""
    from infinity import _overlap_host

    def refused(*args, **kwargs):
        raise RuntimeError("cudaHostRegister(0x7f0000000000, 4096) failed with CUDA error 2")

    off = _train(tmp_path / "off", False, tiers=HOST[0])
    monkeypatch.setattr(_overlap_host, "empty_aligned", refused)
    on = _train(tmp_path / "on", True, tiers=HOST[0])
    _same(off, on)
    assert on[2] == [0] * 4  # none committed early
    said = [r for r in caplog.records if "staging could not be allocated" in r.getMessage()]
    assert len(said) == 1 and "CUDA error 2" in said[0].getMessage()


@pytest.mark.parametrize("opt", [{"type": "sgd", "momentum": 0.9, "lr": 0.05}, {"type": "adagrad"}],
                         ids=["sgd", "adagrad"])  # fmt: skip
def test_other_algorithms(tmp_path, opt):
    off = _train(tmp_path / "off", False, tiers=HOST[1], optimizer=opt)
    on = _train(tmp_path / "on", True, tiers=HOST[1], optimizer=opt)
    _same(off, on)
    assert on[2] == [4] * 4


@pytest.mark.parametrize("state_dtype", ["int8", "bf16"])
def test_compact_states(tmp_path, state_dtype):
    kw = dict(tiers=HOST[0], optimizer={"state_dtype": state_dtype})
    off = _train(tmp_path / "off", False, **kw)
    on = _train(tmp_path / "on", True, **kw)
    _same(off, on)
    assert on[2] == [4] * 4


def test_does_not_apply_to_a_torch_optimizer_or_without_overlap(tmp_path):
    os.makedirs(tmp_path / "a")
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "a", False, tiers=HOST[0]))
    assert engine.overlap is None
    engine.close()
    model = _mlp()  # an optimizer the engine has no kernel for (every tier on the device) steps as it is
    engine = infinity.initialize(model, _cfg(tmp_path / "a", True, tiers=("device",) * 3),
                                 optimizer=torch.optim.RMSprop(model.parameters(), lr=0.01))  # fmt: skip
    assert engine.optimizer.kind == "torch" and engine.overlap is None
    engine.close()


def _hf_llama(path, dtype: str, overlap: bool, tiers):
    """A transformers Llama called as Trainer calls it (``model(input_ids, labels).loss``, a
    plain ``loss.backward()``, ``clip_grad_norm_`` between backward and step), two
    micro-batches a step: losses, weights, and sub-groups committed early per step."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    engine = infinity.initialize(model, _cfg(path, overlap, tiers, precision={"param_dtype": dtype},
                                             optimizer={"gradient_accumulation_steps": 2, "sub_group_size": "64KiB"}))  # fmt: skip
    try:
        losses, committed = [], []
        for step in range(3):
            for micro in range(2):
                g = torch.Generator().manual_seed(step * 2 + micro)
                ids = torch.randint(0, 512, (2, 16), generator=g)
                loss = engine.module(input_ids=ids, labels=ids).loss
                loss.backward()
                losses.append(loss.item())
            engine.clip_grad_norm_(1e-2 if step == 1 else 1e3)  # the second step clips
            engine.step()
            committed.append(engine.overlap.committed if overlap else 0)
        return losses, engine.gathered_weights(), committed
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("tiers", [HOST[1], HOST[2]], ids=[ids[1], ids[2]])
def test_a_transformers_model_as_trainer_calls_it(tmp_path, dtype, tiers):
    off = _hf_llama(tmp_path / "off", dtype, False, tiers)
    on = _hf_llama(tmp_path / "on", dtype, True, tiers)
    _same(off, on)
    assert on[2][0] > 0 and on[2][1] == 0, on[2]  # the clipped step discards; the first commits


@pytest.mark.parametrize("tiers", [HOST[0], ("nvme", "nvme", "nvme")], ids=["host", "nvme"])
def test_backward_hands_the_updates_to_a_worker_and_does_not_wait_for_them(tmp_path, monkeypatch, tiers):
    """The hooks only hand each sub-group over ([Note: early updates on a worker]): backward
    returns while every update is held back on the worker, the updates run there, and the step
    waits for them and commits them all, with the weights of the step after backward. (The
    worker serves a GPU's compute, `_overlap.on_worker`: on the host too here, the same code.)"""
    import threading

    import infinity._overlap as overlap_module

    monkeypatch.setattr(overlap_module, "on_worker", lambda device: True)

    x, y = _batch(0)
    os.makedirs(tmp_path / "off")
    with infinity.initialize(_mlp(), _cfg(tmp_path / "off", False, tiers=tiers)) as engine:
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()
        want = engine.gathered_weights()
    os.makedirs(tmp_path / "on")
    with infinity.initialize(_mlp(), _cfg(tmp_path / "on", True, tiers=tiers)) as engine:
        assert engine.overlap.threaded
        gate, threads = threading.Event(), []
        apply = engine.optimizer.apply

        def held_back(*args, **kwargs):
            threads.append(threading.current_thread().name)
            if not gate.wait(30):
                raise TimeoutError("the gate was never opened")
            return apply(*args, **kwargs)

        monkeypatch.setattr(engine.optimizer, "apply", held_back)
        engine.backward(((engine(x) - y) ** 2).mean())  # would wait 30 s and fail in a hook
        assert engine.overlap.pending == 4
        assert all(t.startswith("infinity-optimizer") for t in threads), threads
        gate.set()
        engine.step()
        assert engine.overlap.committed == 4
        assert threads and all(t.startswith("infinity-optimizer") for t in threads), threads
        got = engine.gathered_weights()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_an_early_update_that_fails_on_the_worker_is_raised_at_the_step(tmp_path, monkeypatch):
    """An error in a job (here the kernel's) reaches the caller of step, every early update is
    discarded, and the engine refuses to train on, as after any step that failed."""
    os.makedirs(tmp_path / "a")
    with infinity.initialize(_mlp(), _cfg(tmp_path / "a", True, tiers=HOST[0])) as engine:

        def broken(*args, **kwargs):
            raise RuntimeError("kernel failed")

        monkeypatch.setattr(engine.optimizer, "apply", broken)
        x, y = _batch(0)
        engine.backward(((engine(x) - y) ** 2).mean())
        assert engine.overlap.pending == 4
        with pytest.raises(RuntimeError, match="kernel failed"):
            engine.step()
        assert engine.overlap.pending == 0
        staging = engine.overlap.staging.tensors  # every staging tensor went back, for reuse
        free = sum(n for n, _ in staging._free)
        assert free == staging.bytes > 0
        with pytest.raises(RuntimeError, match="step failed part-way.*kernel failed"):
            engine(x)


def _staged_params(engine) -> list[str]:
    """The parameters staged on nvme, once the writes in flight are done."""
    for futures, _ in engine.overlap.staging._param_writes.values():
        for f in futures:
            f.result()
    return [n for n in engine.space.names() if n.endswith("~next/param")]


@pytest.fixture
def params_staged(monkeypatch):
    """Parameters written under backward with the compute on the host too (on its own it
    does so only on a GPU: `_overlap_host.stages_params`): the same code, tested here."""
    import infinity._overlap_host as overlap_host

    monkeypatch.setattr(overlap_host, "stages_params", lambda device, store: store.uses_pool)


def test_parameters_on_nvme_are_written_under_backward_and_updates_on_a_worker_only_with_a_gpu(tmp_path):
    os.makedirs(tmp_path / "a")
    with infinity.initialize(_mlp(), _cfg(tmp_path / "a", True, tiers=("nvme", "cpu", "cpu"))) as engine:
        assert isinstance(engine.overlap.staging, InMemory)
        assert engine.overlap.staging.disk_room == 0  # the compute is on the host here
        assert not engine.overlap.threaded


def test_parameters_on_nvme_are_written_under_backward_and_renamed_at_the_step(tmp_path, params_staged):
    """nvme,cpu,cpu: once a sub-group's job is done, its new parameters are written under
    their staged names while backward goes on ([Note: parameters written under backward]); the
    step renames them, and the run is the one without overlap, bit for bit. zero_grad deletes
    them and changes nothing."""
    tiers = ("nvme", "cpu", "cpu")
    off = _train(tmp_path / "off", False, tiers=tiers, steps=2)
    os.makedirs(tmp_path / "on")
    with infinity.initialize(_mlp(), _cfg(tmp_path / "on", True, tiers=tiers)) as engine:
        assert engine.overlap.staging.disk_room is None  # overlap_disk 1.0: every sub-group's fit
        losses = []
        for step in range(2):
            x, y = _batch(step, 0, torch.float32)
            loss = ((engine(x) - y) ** 2).float().mean()
            engine.backward(loss)
            for job in list(engine.overlap.staging._jobs.values()):
                job.result()
            engine.overlap.pump()  # what the next hook would do: the done jobs' parameters written
            assert len(_staged_params(engine)) == 4, engine.space.names()
            engine.step()
            assert engine.overlap.committed == 4
            assert _staged_params(engine) == []
            losses.append(loss.item())
        assert losses == off[0]
        got = engine.gathered_weights()
        assert all(torch.equal(off[1][k], got[k]) for k in off[1])
        before = got
        x, y = _batch(2, 0, torch.float32)
        engine.backward(((engine(x) - y) ** 2).float().mean())
        for job in list(engine.overlap.staging._jobs.values()):
            job.result()
        engine.overlap.pump()
        assert _staged_params(engine)
        engine.zero_grad()
        assert _staged_params(engine) == []
        after = engine.gathered_weights()
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_parameters_staged_on_nvme_stay_within_the_disk_room(tmp_path, params_staged):
    """optimizer.overlap_disk 0 leaves no disk beside the state: no parameter is written under
    backward, every sub-group is still updated early, and written at the step."""
    tiers = ("nvme", "cpu", "cpu")
    os.makedirs(tmp_path / "a")
    cfg = _cfg(tmp_path / "a", True, tiers=tiers, optimizer={"overlap_disk": 0.0})
    with infinity.initialize(_mlp(), cfg) as engine:
        assert engine.overlap.staging.disk_room == 0
        x, y = _batch(0, 0, torch.float32)
        engine.backward(((engine(x) - y) ** 2).float().mean())
        for job in list(engine.overlap.staging._jobs.values()):
            job.result()
        engine.overlap.pump()
        assert _staged_params(engine) == []
        engine.step()
        assert engine.overlap.committed == 4


def test_parameters_written_under_backward_are_staged_page_aligned(tmp_path, monkeypatch, params_staged):
    """States' former tensors, exchanged into staging at commit, are aligned as torch's
    allocator left them (64 bytes for 128 KiB and more); a new parameter's staging is written to
    nvme from the hook, directly only where page-aligned (else through a pool buffer the hook
    would wait for). So parameters take page-aligned buffers only, step after step (found by an
    audit: 8 of 48 were not, and the hook waited on the pool 8 times); the numbers the same."""
    import mmap

    def model():
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)) for _ in range(3)]
        return nn.Sequential(nn.Embedding(300, 128), *blocks, nn.Linear(128, 300))

    def train(path, overlap):
        os.makedirs(path)
        cfg = _cfg(path, overlap, ("nvme", "cpu", "cpu"), memory={"host_budget": "256MiB"},
                   optimizer={"sub_group_size": "64KiB"})  # fmt: skip
        offsets = []
        with infinity.initialize(model(), cfg) as engine:
            if overlap:
                commit = InMemory.commit_one

                def looked_at(self, ov, index, early):
                    offsets.extend(t.data_ptr() % mmap.PAGESIZE for t in self._copies[index][1].values())
                    return commit(self, ov, index, early)

                monkeypatch.setattr(InMemory, "commit_one", looked_at)
            losses = []
            for step in range(6):
                g = torch.Generator().manual_seed(step)
                x, y = torch.randint(0, 300, (8,), generator=g), torch.randn(8, 300, generator=g)
                loss = ((engine(x) - y) ** 2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            return losses, engine.gathered_weights(), offsets

    off, on = train(tmp_path / "off", False), train(tmp_path / "on", True)
    assert off[0] == on[0] and all(torch.equal(off[1][k], on[1][k]) for k in off[1])
    assert len(on[2]) >= 24 and not any(on[2]), on[2]

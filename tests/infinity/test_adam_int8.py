"""The one-pass Adam update of int8 moments (infinity/_adam_int8.py, infinity/csrc/adam_int8.h).

Against torch: where torch's fused kernel runs its vector loop over every element (parameters
of a multiple of 16 elements), the one pass gives the bytes of decoding both moments, running
``torch._fused_adamw_`` / ``_fused_adam_`` and encoding them back, for every branch of the
arithmetic (AdamW and Adam, with and without weight decay, a gradient scale, beta1 over 0.5).
Then what torch's layout does not: the result is the same however the parameters are cut
(segments, threads), and an engine with int8 states gives the same states with the one pass as
with the three.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import infinity
from infinity import _adam_int8, _compact

sys.path.insert(0, os.path.dirname(__file__))
from _common import config, train  # noqa: E402

pytestmark = pytest.mark.skipif(_compact.native_module() is None, reason="infinity._compact_native was not built "
                                "(no C++ compiler at install, or INFINITY_BUILD_NATIVE=0)")  # fmt: skip


class _Unit:
    def __init__(self, index: int):
        self.index = index


def _moments(n: int, seed: int):
    """exp_avg-like and exp_avg_sq-like fp32 values, encoded: (codes, scales) of each."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g) * 1e-3
    v = torch.rand(n, generator=g) * 1e-6
    out = []
    for x, signed in ((m, True), (v, False)):
        codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(_compact.blocks(n))
        _compact.encode_int8(x, codes, scales, signed)
        out += [codes, scales]
    return out


def _reference(master, states, sizes, hps, grad, step, grad_scale, adamw):
    """Decode, torch's fused kernel per parameter, encode: the three passes."""
    n = master.numel()
    m, v = torch.empty(n), torch.empty(n)
    _compact.decode_int8(states[0], states[1], True, m)
    _compact.decode_int8(states[2], states[3], False, v)
    kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
    pos = 0
    for size, hp in zip(sizes, hps):
        s = slice(pos, pos + size)
        pos += size
        kernel([master[s]], [grad[s]], [m[s]], [v[s]], [], [torch.tensor(float(step))], lr=hp["lr"],
               beta1=hp["betas"][0], beta2=hp["betas"][1], weight_decay=hp["weight_decay"], eps=hp["eps"],
               amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=None)  # fmt: skip
    _compact.encode_int8(m, states[0], states[1], True)
    _compact.encode_int8(v, states[2], states[3], False)


def _one_pass(master, states, cuts, hps, grad, step, grad_scale, adamw, groups_of=None):
    """The one pass over one unit whose parameters are ``cuts`` elements long."""
    unit = _Unit(0)
    per_group, pos = {}, 0
    for k, size in enumerate(cuts):
        gi = groups_of[k] if groups_of else k
        per_group.setdefault(gi, []).append((unit, slice(pos, pos + size), slice(pos, pos + size), k))
        pos += size
    _adam_int8.update(master, states, {0: slice(0, master.numel())}, per_group, hps, {0: grad},
                      {0: torch.tensor(float(step))}, grad_scale, adamw)  # fmt: skip


def _case(n, seed):
    g = torch.Generator().manual_seed(seed + 100)
    return torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2, _moments(n, seed)


_SERVED = _adam_int8.served  # before any test replaces it
HP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("variant", ["plain", "no_decay", "grad_scale", "beta1_low"])
def test_one_pass_gives_the_bytes_of_torch_between_decode_and_encode(isa, adamw, variant):
    # Three parameters of 1024, 272 and 4096 elements (multiples of 16: torch's vector loop
    # covers them whole), blocks straddling the cuts, the second with its own hyperparameters.
    sizes = [1024, 272, 4096]
    n = sum(sizes)
    hp = dict(HP)
    if variant == "no_decay":
        hp["weight_decay"] = 0.0
    if variant == "beta1_low":
        hp["betas"] = (0.3, 0.95)  # 1 - beta1 over 0.5: lerp's other branch
    hps = [hp, dict(hp, lr=3e-3, weight_decay=0.1), hp]
    scale = torch.tensor(1024.0) if variant == "grad_scale" else None
    master, grad, states = _case(n, seed=len(variant))
    if scale is not None:
        grad = grad * 1024
    ours = [master.clone(), [t.clone() for t in states], grad.clone()]
    for step in (1, 7):
        _reference(master, states, sizes, hps, grad, step, scale, adamw)
        _one_pass(ours[0], ours[1], sizes, hps, ours[2], step, scale, adamw)
        assert torch.equal(ours[0], master), f"weights differ at step {step}"
        for a, b in zip(ours[1], states):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"states differ at step {step}"
        assert torch.equal(ours[2], grad)  # unscaled in place, as torch's kernel does


def test_the_result_does_not_depend_on_where_parameters_are_cut(isa):
    # 3001 elements under one set of hyperparameters: as one parameter, and cut in three at
    # odd places (torch's kernel would round the tail of each cut its other way).
    n = 3001
    master, grad, states = _case(n, seed=5)
    whole = [master.clone(), [t.clone() for t in states]]
    _one_pass(whole[0], whole[1], [n], [HP], grad.clone(), 3, None, True)
    _one_pass(master, states, [7, 1990, 1004], [HP], grad.clone(), 3, None, True, groups_of=[0, 0, 0])
    assert torch.equal(whole[0], master)
    assert all(torch.equal(a, b) for a, b in zip(whole[1], states))


def test_threads_give_the_bytes_of_one(monkeypatch, isa):
    # 2.1M elements: three chunks of tiles (1M elements each, the last short) that two threads
    # take in turn, against one thread.
    n = (1 << 21) + 77
    master, grad, states = _case(n, seed=9)
    one = [master.clone(), [t.clone() for t in states]]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    _one_pass(one[0], one[1], [n], [HP], grad.clone(), 2, None, True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    _one_pass(master, states, [n], [HP], grad.clone(), 2, None, True)
    assert torch.equal(one[0], master)
    assert all(torch.equal(a, b) for a, b in zip(one[1], states))


def test_a_sub_group_s_units_in_one_call_give_the_bytes_of_one_call_each(monkeypatch, isa):
    # Four units of a sub-group (one empty, one under a block, two whose last block is short),
    # stepped in one call whose threads take chunks of tiles from any unit, against each unit
    # on one thread alone. The units' parts start where the previous ends, as in a sub-group.
    sizes = [300_000 + 5, 0, 17, 420_000 + 201]
    n = sum(sizes)
    master, grad, _ = _case(n, seed=13)
    slices, pos = {}, 0
    for i, size in enumerate(sizes):
        slices[i] = slice(pos, pos + size)
        pos += size
    bslices = _compact.block_slices(slices)
    codes_at = {i: _moments(size, seed=20 + i) for i, size in enumerate(sizes)}  # each unit's, its blocks from its start
    # the sub-group's states as the engine holds them: the units' codes one after another, and their scales
    flat = [torch.cat([codes_at[i][k] for i in slices]) for k in range(4)]
    one_each = {i: [master[s].clone(), [t.clone() for t in codes_at[i]]] for i, s in slices.items()}
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    for i, s in slices.items():
        unit = _Unit(0)
        _adam_int8.update(one_each[i][0], one_each[i][1], {0: slice(0, s.stop - s.start)},
                          {0: [(unit, slice(0, s.stop - s.start), slice(0, s.stop - s.start), 0)]}, [HP],
                          {0: grad[s].clone()}, {0: torch.tensor(4.0)}, None, True)  # fmt: skip
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    units = [_Unit(i) for i in slices]
    per_group = {0: [(units[i], s, slice(0, s.stop - s.start), i) for i, s in slices.items()]}
    _adam_int8.update(master, flat, slices, per_group, [HP], {i: grad[s].clone() for i, s in slices.items()},
                      {i: torch.tensor(4.0) for i in slices}, None, True)  # fmt: skip
    for i, s in slices.items():
        assert torch.equal(master[s], one_each[i][0])
        b = bslices[i]
        assert torch.equal(flat[0][s], one_each[i][1][0]) and torch.equal(flat[1][b], one_each[i][1][1])
        assert torch.equal(flat[2][s], one_each[i][1][2]) and torch.equal(flat[3][b], one_each[i][1][3])


def test_elements_of_no_parameter_keep_their_codes():
    # A unit whose second run of elements belongs to no parameter group (frozen): its codes
    # and its block's scale come back byte for byte.
    n = 1024
    master, grad, states = _case(n, seed=11)
    before = [t.clone() for t in states]
    unit = _Unit(0)
    per_group = {0: [(unit, slice(0, 256), slice(0, 256), 0), (unit, slice(768, 1024), slice(768, 1024), 2)]}
    kept = master[256:768].clone()
    _adam_int8.update(master, states, {0: slice(0, n)}, per_group, [HP], {0: grad}, {0: torch.tensor(1.0)}, None, True)
    assert torch.equal(master[256:768], kept)
    assert torch.equal(states[0][256:768], before[0][256:768]) and torch.equal(states[1][1:3], before[1][1:3])
    assert not torch.equal(states[0][:256], before[0][:256])  # the stepped part did change


def _model():
    # Every parameter a multiple of 16 elements: torch's kernel then rounds as the one pass.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 16))


@pytest.mark.parametrize("tiers", [("device", "device", "device"), ("nvme", "nvme", "nvme")], ids=["device", "nvme"])
def test_engine_states_are_those_of_the_three_passes(tmp_path, monkeypatch, tiers):
    # Five steps of an int8 engine with the one pass, and with the codec's three passes (the
    # one pass turned off): the same losses, weights and states, byte for byte.
    calls = []
    real = _adam_int8.update
    monkeypatch.setattr(_adam_int8, "update", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = {}
    for one_pass in (True, False):
        monkeypatch.setattr(_adam_int8, "served", lambda *a, on=one_pass: on and _SERVED(*a))
        cfg = config(tmp_path / str(one_pass), tiers, optimizer={"state_dtype": "int8", "sub_group_size": "16KiB"})
        engine = infinity.initialize(_model(), cfg)
        try:
            losses = train(engine, 5, out=16)
            opt = engine.optimizer
            states = {}
            for g in opt.groups:
                for kind in opt.kinds:
                    lease = opt.states[kind].get(g.record.name_for()).result()
                    try:
                        states[(g.index, kind)] = lease.tensor.detach().clone()
                    finally:
                        lease.release()
            out[one_pass] = (losses, engine.gathered_weights(), states)
        finally:
            engine.close()
        if one_pass:
            assert calls, "the engine did not take the one pass"
    (l1, w1, s1), (l3, w3, s3) = out[True], out[False]
    assert l1 == l3
    assert all(torch.equal(w1[k], w3[k]) for k in w3)
    assert s1.keys() == s3.keys() and all(torch.equal(s1[k], s3[k]) for k in s3)


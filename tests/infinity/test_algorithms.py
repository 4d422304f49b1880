"""The optimizer algorithms' records and the state keys: what generic code asks them."""

import pytest
import torch

from infinity import _algorithms
from infinity._substates import StateRecord, state_key
from infinity.config import ADAM_STATE_BYTES


def test_state_keys_keep_the_on_disk_names():
    """Swap spaces and checkpoints written before the records must read the same names."""
    record = StateRecord("optimizer.3", 10, {"master": 4, "exp_avg": 4})
    assert record.key("exp_avg") == "optimizer.3/exp_avg" == state_key("optimizer.3", "exp_avg")
    assert record.key("master", staged=True) == "optimizer.3~next/master"
    assert record.name_for(staged=True) == "optimizer.3~next" and record.name_for() == "optimizer.3"
    assert record.nbytes("exp_avg") == 40 and record.state_bytes(("master", "exp_avg")) == 80
    with pytest.raises(ValueError, match="no state 'sum'"):
        record.nbytes("sum")


def test_the_config_floor_of_sub_group_size_holds_one_parameter_of_every_algorithm():
    # config.py loads no torch, so it keeps the figure itself
    assert ADAM_STATE_BYTES == max(a.bytes_per_parameter for a in _algorithms.ALGORITHMS.values())


def test_adagrad_sum_starts_at_each_groups_initial_accumulator_value():
    sum_kind = _algorithms.ALGORITHMS["adagrad"].kind("sum")
    value = sum_kind.initial(torch.zeros(6), {0: [(None, slice(0, 2), None, 0)], 1: [(None, slice(4, 6), None, 0)]},
                             [{"initial_accumulator_value": 0.5}, {"initial_accumulator_value": 2.0}])  # fmt: skip
    assert value.tolist() == [0.5, 0.5, 0.0, 0.0, 2.0, 2.0]


def test_a_cut_gives_the_views_indexing_gives_and_none_for_overlapping_entries(tmp_path):
    """Every entry's piece of a sub-group's flat tensor is the view its slice indexes (same
    memory, size and stride), over a model with two parameter groups (a no-decay one, as the
    Trainer makes), tied and untied; entries that overlap get no cut."""
    import infinity
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    cfg = {"tiers": {"params": "device", "grads": "device", "optimizer": "device"},
           "nvme": {"paths": [str(tmp_path)]}, "optimizer": {"sub_group_size": "4KiB"}}  # fmt: skip
    with infinity.initialize(model, cfg, optimizer=optimizer) as engine:
        st = engine.optimizer.substates
        assert len(st.groups) > 1 and all(c is not None for c in st.cuts)
        for sg, per_group, cut in zip(st.groups, st.slices, st.cuts):
            flat = torch.arange(sg.numel, dtype=torch.float32)
            pieces = cut.pieces(flat)
            for gi, entries in per_group.items():
                for (_, s, _, _), k in zip(entries, cut.at[gi]):
                    want, got = flat[s], pieces[k]
                    assert (got.data_ptr(), got.shape, got.stride()) == (want.data_ptr(), want.shape, want.stride())
            assert cut.pieces(flat[1:]) is None  # another length: indexed instead
        assert any(len(per_group) == 2 for per_group in st.slices)  # a sub-group in both groups
    overlapping = {0: [(None, slice(0, 8), None, 0)], 1: [(None, slice(4, 12), None, 0)]}
    assert _algorithms.Cut.of(overlapping, 16) is None


def test_a_cut_keeps_a_slots_pieces_only_for_the_same_tensor_over_the_same_memory():
    """The pieces kept under a slot (a resident tier's tensors, from step to step) serve that
    tensor again, and never another tensor, nor the same one moved to other memory."""
    per_group = {0: [(None, slice(0, 3), None, 0), (None, slice(3, 8), None, 1)]}
    cut = _algorithms.Cut.of(per_group, 8)
    a = torch.arange(8, dtype=torch.float32)
    first = cut.pieces(a, 0)
    assert cut.pieces(a, 0) is first  # kept: no split
    assert cut.pieces(a) is not first  # no slot: cut afresh, nothing kept
    b = torch.arange(8, dtype=torch.float32) + 100
    assert [p.tolist() for p in cut.pieces(b, 0)] == [[100.0, 101.0, 102.0], [103.0, 104.0, 105.0, 106.0, 107.0]]
    assert cut.pieces(a, 1)[1].data_ptr() == a[3:].data_ptr()  # another slot, its own
    a.data = torch.zeros(8)  # the same tensor over other memory
    moved = cut.pieces(a, 1)
    assert moved[0].data_ptr() == a.data_ptr() and moved[1].tolist() == [0.0] * 5


@pytest.mark.parametrize("overlap", [True, False])
def test_the_views_a_cut_keeps_are_of_the_tiers_tensors_after_every_step(tmp_path, overlap):
    """The kernels' views kept from step to step view the tier's own tensors of each kind,
    also after the optimizer under backward swapped its staged copies in (the tensors they
    replace go to its staging: kept views would hold their memory): the first step clips,
    which discards its early updates, and the next does not try them (both update at the
    step and keep views); the third commits them. The training equals plain torch's."""
    import copy

    import infinity
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    cfg = {"tiers": {"params": "device", "grads": "device", "optimizer": "cpu"},
           "optimizer": {"lr": 1e-2, "weight_decay": 0.01, "overlap": overlap, "sub_group_size": "4KiB"}}  # fmt: skip
    x = torch.randn(8, 16)
    with infinity.initialize(model, cfg) as engine:
        st = engine.optimizer.substates
        assert len(st.groups) > 1
        kept_any = False
        for step in range(5):
            engine.backward(engine(x).square().mean())
            plain(x).square().mean().backward()
            if step == 0:  # clipped: the early updates are discarded, and the next step does not try them
                engine.clip_grad_norm_(1e-3)
                torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e-3)
            engine.step()
            engine.zero_grad()
            opt.step()
            opt.zero_grad()
            for sg, cut in zip(st.groups, st.cuts):
                own = [st.stores[k].get(sg.record.name_for()).result().tensor for k in st.kinds]
                kept_any |= step < 2 and bool(cut._kept)  # the steps that updated at the step kept some
                for slot, (t, _, pieces) in cut._kept.items():
                    assert t is own[slot] and pieces[0].data_ptr() == own[slot].data_ptr()
        assert kept_any
        for got, want in zip(engine.module.parameters(), plain.parameters()):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)

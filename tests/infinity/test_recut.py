"""The re-cut plan (`infinity._recut`): a unit of one cut of a module into row tiles, made of
the runs of another cut's units, is exactly that unit, whatever the two cuts."""

from __future__ import annotations

import itertools
from collections import OrderedDict

import pytest
import torch
from torch import nn

from infinity._recut import plan
from infinity._units import build_units
from infinity.checkpoint import CheckpointError

SIZES = [None, 4096, 5000, 8192, 12288]  # tile bytes: no tiles, and cuts whose rows do not line up


def _model(vocab: int = 300) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(vocab, 24), nn.Linear(24, 24), nn.Linear(24, vocab))


def _meta(units) -> dict:
    return {"units": [{"name": u.name, "numel": u.numel, "params": [[r.name, list(r.shape)] for r in u.records]}
                      for u in units], "config": {"memory": {"tile_size": 4096}}}  # fmt: skip


@pytest.mark.parametrize(("saved", "loaded"), list(itertools.permutations(SIZES, 2)))
def test_every_unit_is_made_exactly_of_the_saved_units_rows(saved, loaded):
    model = _model()
    before, _, _ = build_units(model, tile_bytes=saved)
    after, _, _ = build_units(model, tile_bytes=loaded)
    flats = {u.name: u.flat(torch.float32) for u in before}
    cut = plan(after, _meta(before), "ckpt")
    for u in after:
        made = torch.full((u.numel,), float("nan"))
        for run in cut.runs[u.index]:
            made[run.at : run.at + run.n] = flats[run.name][run.start : run.start + run.n]
        assert torch.equal(made, u.flat(torch.float32)[: u.numel]), u.name
        assert sum(run.n for run in cut.runs[u.index]) == u.numel
    # A module cut alike (the hidden layer, whole in both, say) is read unit by unit.
    cuts = [{path: [u.name for u in units if u.path == path] for path in ("0", "1", "2")} for units in (before, after)]
    assert cut.recut == [path for path in ("0", "1", "2") if cuts[0][path] != cuts[1][path]]
    hidden = next(u for u in after if u.path == "1")
    assert cut.runs[hidden.index] == [(0, "1", hidden.numel, 0, hidden.numel)]


def test_step_counts_of_the_saved_units_become_the_units_own():
    model = _model()
    before, _, _ = build_units(model, tile_bytes=4096)
    after, _, _ = build_units(model, tile_bytes=None)
    cut = plan(after, _meta(before), "ckpt")
    steps = cut.steps(after, torch.tensor([3.0] * len(before)), "rank0")
    assert steps.tolist() == [3.0] * len(after)


def test_a_module_of_another_shape_is_refused_naming_its_unit():
    before, _, _ = build_units(_model(300), tile_bytes=4096)
    after, _, _ = build_units(_model(301), tile_bytes=8192)
    with pytest.raises(CheckpointError, match=r"ckpt: unit '0#0' of '0' \(weight \[301, 24\]\) was saved as 8 units "
                                              r"'0#0'..'0#294' of weight \[300, 24\]: not the same model"):  # fmt: skip
        plan(after, _meta(before), "ckpt")


def test_a_model_with_other_modules_is_refused_naming_the_unit():
    before, _, _ = build_units(_model(), tile_bytes=4096)
    renamed = nn.Sequential(OrderedDict(zip(("0", "h", "2"), _model().children())))
    after, _, _ = build_units(renamed, tile_bytes=4096)
    with pytest.raises(CheckpointError, match=r"^ckpt: unit 'h' was saved as '1': not the same model$"):
        plan(after, _meta(before), "ckpt")
    after, _, _ = build_units(_model()[:2], tile_bytes=4096)
    with pytest.raises(CheckpointError, match=r"^ckpt: saved from a model with 17 parameter units \(3 modules\), this "
                                              r"one has 9 \(2 modules\) and its unit '2#0' is not in this model"):  # fmt: skip
        plan(after, _meta(before), "ckpt")

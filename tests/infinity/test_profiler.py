"""The engine's record_function ranges show in a user's torch.profiler trace."""

import os
import sys

from torch.profiler import ProfilerActivity, profile

import infinity

sys.path.insert(0, os.path.dirname(__file__))
from _common import config, make_model, train  # noqa: E402


def test_a_step_and_a_checkpoint_show_their_ranges(tmp_path):
    (tmp_path / "swap").mkdir()
    # overlap_disk 1.0: the disk for every sub-group's staged copies (the default stages 0.3 x
    # the state, which for this small model is less than one sub-group's)
    cfg = config(tmp_path / "swap", ("nvme", "nvme", "nvme"), optimizer={"overlap_disk": 1.0})
    with infinity.initialize(make_model(), cfg) as engine:
        train(engine, 1)  # the first step predicts the order; the profiled one prefetches
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train(engine, 1, start=1)
            engine.save_checkpoint(tmp_path / "ck")
            engine.load_checkpoint(tmp_path / "ck")
    names = {e.name for e in prof.events()}
    # All nvme, overlap on: the sub-groups are updated under backward ("optimizer.early"); a
    # step after backward ("optimizer.subgroup") shows with overlap off (test below).
    expected = {"infinity::fetch", "infinity::grad_write", "infinity::optimizer.early",
                "infinity::checkpoint.save", "infinity::checkpoint.load"}  # fmt: skip
    assert expected <= names, sorted(n for n in names if n.startswith("infinity::"))


def test_the_step_after_backward_shows_its_range(tmp_path):
    (tmp_path / "swap").mkdir()
    cfg = config(tmp_path / "swap", ("nvme", "nvme", "nvme"), optimizer={"overlap": False})
    with infinity.initialize(make_model(), cfg) as engine:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train(engine, 1)
    names = {e.name for e in prof.events()}
    assert "infinity::optimizer.subgroup" in names and "infinity::optimizer.early" not in names

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

"""What a run opens and the memory checks at initialize; the cpu tier's bytes in stats()."""

import os
import re
import subprocess
import sys

import pytest
import torch

import infinity
from infinity import _resources

sys.path.insert(0, os.path.dirname(__file__))
from _common import config, make_model, train  # noqa: E402


def test_import_infinity_config_loads_neither_torch_nor_the_engine():
    code = "import sys, infinity.config; print(sorted(m for m in ('torch', 'infinity.engine') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_mem_available_reads_proc_meminfo():
    value = _resources.mem_available()
    assert isinstance(value, int) and value > 0


def test_a_cpu_tier_the_machine_cannot_hold_is_refused_at_initialize_naming_the_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(_resources, "mem_available", lambda: 4096)
    with pytest.raises(ValueError, match=r"keeps .* in host memory \(params .*optimizer .*\).*4KiB available \(MemAvailable"):
        infinity.initialize(make_model(), config(tmp_path, ("cpu", "nvme", "cpu")))
    # Everything on nvme keeps nothing resident: accepted on the same machine.
    with infinity.initialize(make_model(), config(tmp_path, ("nvme", "nvme", "nvme"))) as engine:
        train(engine, 1)


def test_the_cpu_tier_reports_the_bytes_it_holds(tmp_path):
    model = make_model()
    n = sum(p.numel() for p in model.parameters())
    with infinity.initialize(model, config(tmp_path, ("cpu", "cpu", "cpu"))) as engine:
        # fp32 params (4 bytes) and master, exp_avg, exp_avg_sq (12 bytes) per parameter
        assert engine.stats()["resident_bytes"]["cpu"] == 16 * n
        train(engine, 1)
        # the fp32 gradients, and from the first step the parameters are the master weights
        # ([Note: one copy of the fp32 weights] in infinity/_onecopy.py): one copy of them
        assert engine.stats()["resident_bytes"]["cpu"] == 16 * n
        if torch.cuda.is_available():  # pinned, so the copies to the device are asynchronous
            lease = engine.param_store.get(engine.units[0].name).result()
            assert lease.tensor.is_pinned()


def test_a_small_host_budget_is_refused_with_figures_that_differ_and_are_not_zero(tmp_path):
    """600K used to read "host_budget=1MiB is less than the 1MiB" and "largest unit 0.0MiB"."""
    with pytest.raises(ValueError) as info:
        infinity.initialize(make_model(width=128), config(tmp_path, ("nvme", "nvme", "nvme"),
                                                          memory={"host_budget": "600K"}))  # fmt: skip
    message = str(info.value)
    m = re.search(r"memory\.host_budget=(\S+) is less than the (\S+) the .* \(largest unit (\S+) in fp32", message)
    assert m, message
    budget, need, unit = m.groups()
    assert budget == "600KiB" and need != budget, message
    assert not re.fullmatch(r"0(\.0+)?[KMG]?i?B", unit), message


def test_sizes_that_would_read_the_same_are_written_in_bytes():
    cfg = infinity.TierConfig.from_dict({"memory": {"host_budget": (1 << 20) + 100}})
    with pytest.raises(ValueError, match=r"host_budget=1048676 bytes is less than the 1052672 bytes the optimizer step"):
        _resources.check_host_budget(cfg, {"optimizer step": (1 << 20) + 4096}, 100)
    assert _resources.distinct_sizes(614400, 1 << 20, 3) == ["600KiB", "1MiB", "3B"]


def test_a_run_leaves_its_arena_no_larger_than_its_state(tmp_path):
    """The arena used to stay at grow_step (256 MiB here) after close; a few dozen small runs
    filled 15 GB. It is shrunk to what the state needs."""
    cfg = config(tmp_path, ("nvme", "nvme", "nvme"), nvme={"grow_step": "256MiB"})
    with infinity.initialize(make_model(), cfg) as engine:
        train(engine, 1)
    arena = tmp_path / "rank0" / "arena-0.bin"
    assert arena.stat().st_blocks * 512 <= 1 << 20, arena.stat()


def test_a_stale_unreadable_swap_manifest_does_not_block_initialize(tmp_path):
    """The engine's swap is scratch (fresh): an old manifest it cannot parse is not a reason to stop."""
    (tmp_path / "rank0").mkdir(mode=0o700)
    (tmp_path / "rank0" / "manifest.json").write_bytes(b'{"format": "infinity-swap", "tensors": [')
    (tmp_path / "rank0" / "arena-0.bin").write_bytes(b"\0" * 4096)
    with infinity.initialize(make_model(), config(tmp_path, ("nvme", "nvme", "nvme"))) as engine:
        train(engine, 1)


def test_the_ranks_an_earlier_wider_run_left_are_removed_unless_live(tmp_path, caplog):
    """A 3-rank run's rank1 and rank2 (state and activations) stayed beside a 1-rank run's
    rank0 on the same nvme.paths, their disk never given back; a rank directory a live space
    holds stays, said in a warning; files a space did not make stay."""
    from infinity.swap import SwapSpace

    swap = tmp_path / "swap"
    for dirs, rank in (([swap], 1), ([swap], 2), ([swap / "activations"], 1)):
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        with SwapSpace([str(d) for d in dirs], rank=rank) as space:
            space.put("w", torch.ones(1000)).result()
    (swap / "rank2" / "notes.txt").write_text("mine")
    live = SwapSpace([str(swap / "activations")], rank=3)  # another process's, say: its lock held
    try:
        with infinity.initialize(make_model(), config(swap, ("nvme", "nvme", "nvme"))) as engine:
            train(engine, 1)
        assert sorted(os.listdir(swap)) == ["activations", "rank0", "rank2"]
        assert os.listdir(swap / "rank2") == ["notes.txt"]
        assert sorted(os.listdir(swap / "activations")) == ["rank3"]
        assert "left " + str(swap / "activations" / "rank3") + " of an earlier run as it is" in caplog.text
    finally:
        live.close()


def test_the_budget_a_refusal_names_is_accepted(tmp_path):
    """HostBudgetError carries the need it names, and that need is a budget initialize takes:
    what benchmarks/budget_floor.py reports as a model's floor."""
    cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}, "nvme": {"paths": [str(tmp_path)]},
           "memory": {"host_budget": 4096, "tile_size": "16KiB"}, "optimizer": {"sub_group_size": "64KiB"}}  # fmt: skip
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 32), torch.nn.Linear(32, 1000))
    with pytest.raises(infinity.HostBudgetError, match="memory.host_budget=4KiB is less than") as info:
        infinity.initialize(model, cfg)
    assert info.value.need > 4096 and info.value.what in info.value.needs
    cfg["memory"]["host_budget"] = info.value.need
    with infinity.initialize(model, cfg) as engine:
        engine.backward(engine(torch.tensor([[1, 2, 3]])).sum())
        engine.step()

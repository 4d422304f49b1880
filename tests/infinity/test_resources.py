"""What a run opens and the memory checks at initialize; the cpu tier's bytes in stats()."""

import os
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
        assert engine.stats()["resident_bytes"]["cpu"] == 20 * n  # and the fp32 gradients
        if torch.cuda.is_available():  # pinned, so the copies to the device are asynchronous
            lease = engine.param_store.get(engine.units[0].name).result()
            assert lease.tensor.is_pinned()

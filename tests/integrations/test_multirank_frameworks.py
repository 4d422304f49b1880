"""InfinityTrainer and an accelerate loop at two ranks (gloo) against one process.

Two ranks see the same global batch as one process (each its half), and the engine averages
the gradients across ranks: losses and final weights agree within 1e-5 (fp32; the all-reduce
sums in another order than one process's batch does: rounding). DistributedDataParallel around
``engine.module`` broke the first backward with a shape error; the Trainer no longer wraps it,
the README's accelerate recipe does not, and the recipe that does is refused naming the fix.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

pytestmark = pytest.mark.multirank

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "infinity"))
from _common import rank_env  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "_multirank_frameworks_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, world: int, tmp_path) -> tuple[str, list[int], list[str]]:
    """The worker as ``world`` ranks, with the environment torchrun gives them."""
    out, swap = str(tmp_path / f"{mode}-{world}"), tmp_path / f"swap-{mode}-{world}"
    swap.mkdir()
    port = _free_port()
    procs = []
    for rank in range(world):
        env = rank_env(rank, world, port, gpus_needed=2)  # both runs on the same device
        if world == 1:
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(key)
        procs.append(subprocess.Popen([sys.executable, WORKER, mode, out, str(swap)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    logs = [p.communicate(timeout=180)[0] for p in procs]
    return out, [p.returncode for p in procs], logs


def _compare(one: str, two: str) -> None:
    single, double = json.load(open(f"{one}.json")), json.load(open(f"{two}.json"))
    assert len(single["losses"]) == len(double["losses"]) == 4
    for a, b in zip(double["losses"], single["losses"]):
        assert abs(a - b) < 1e-5, (double["losses"], single["losses"])
    w1 = torch.load(f"{one}.weights.pt", weights_only=True)
    w2 = torch.load(f"{two}.weights.pt", weights_only=True)
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("mode", ["trainer", "accelerate"])
def test_two_ranks_match_one_process(tmp_path, mode):
    one, codes, logs = _launch(mode, 1, tmp_path)
    assert codes == [0], logs[0][-3000:]
    two, codes, logs = _launch(mode, 2, tmp_path)
    assert codes == [0, 0], [log[-3000:] for log in logs]
    _compare(one, two)


def test_an_accelerate_loop_that_wraps_the_module_in_ddp_is_refused_naming_the_fix(tmp_path):
    out, codes, logs = _launch("accelerate-ddp", 2, tmp_path)
    assert codes == [3, 3], [log[-3000:] for log in logs]
    for rank in (0, 1):
        error = open(f"{out}.{rank}.err").read()
        assert "DistributedDataParallel" in error and "evaluation_mode=True" in error, error

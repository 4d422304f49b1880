"""Several ranks on one machine (gloo): parity with one rank, 1/N reads, failures that name a rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.multirank

sys.path.insert(0, os.path.dirname(__file__))
from _common import cpu_unless_gpus, rank_env  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "_multirank_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, world: int, stage: int, tmp_path, timeout: float = 120, *extra: str):
    """Run the worker as ``world`` ranks (the environment torchrun would give them)."""
    swap = tmp_path / f"swap-{mode}-{world}-{stage}"
    swap.mkdir()
    out = str(tmp_path / f"{mode}-{world}-{stage}")
    port = _free_port()
    procs = []
    for rank in range(world):
        env = rank_env(rank, world, port, gpus_needed=max(world, 2))  # the 1-rank runs are references
        if world == 1:
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(key)
        procs.append(subprocess.Popen([sys.executable, WORKER, mode, out, str(stage), str(swap), *extra], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    start = time.monotonic()
    results = [p.communicate(timeout=timeout) for p in procs]
    elapsed = time.monotonic() - start
    return out, [p.returncode for p in procs], results, elapsed


# Tiles at the stage whose slices cut them (3) and one that does not (2); each stage whole.
@pytest.mark.parametrize("stage,tiles", [(1, None), (2, "4KiB"), (3, None), (3, "4KiB")],
                         ids=["1-whole", "2-tiled", "3-whole", "3-tiled"])  # fmt: skip
def test_two_ranks_match_one_rank(tmp_path, stage, tiles, monkeypatch):
    """Same global batch (each rank half of it), fp32, everything on nvme: per-step losses and
    final weights within 1e-5 of one rank; each rank reads about half of what one rank reads.
    Tiled: the two 64-row Linears in tiles of 4KiB, each tile sliced over the ranks."""
    if tiles:
        monkeypatch.setenv("INFINITY_TEST_TILE_SIZE", tiles)
    one, codes, logs, _ = _launch("parity", 1, stage, tmp_path)
    assert codes == [0], logs
    two, codes, logs, _ = _launch("parity", 2, stage, tmp_path)
    assert codes == [0, 0], logs
    single = json.load(open(f"{one}.0.json"))
    for rank in (0, 1):
        mine = json.load(open(f"{two}.{rank}.json"))
        for a, b in zip(mine["losses"], single["losses"]):
            assert abs(a - b) < 1e-5, (stage, mine["losses"], single["losses"])
        if stage == 3:  # bandwidth-centric: each rank reads its own slice of every unit
            ratio = sum(mine["reads"][1:]) / sum(single["reads"][1:])
            assert 0.4 < ratio < 0.65, (ratio, mine["reads"], single["reads"])
    w1 = torch.load(f"{one}.weights.pt", weights_only=True)
    w2 = torch.load(f"{two}.weights.pt", weights_only=True)
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=1e-5, rtol=0)


@pytest.mark.parametrize("stage", [3])  # (stage 1 the same: 7 s of the suite)
def test_ranks_that_built_other_initial_weights_train_rank_0_s_as_ddp_does(tmp_path, stage):
    """Each rank seeds its RNG with its rank before building the model (the usual way to get
    per-rank dropout): the ranks' initial weights differ, and each kept its own slice, a model
    of rank 0's first half and rank 1's second half, silently. DDP's constructor broadcasts
    rank 0's; so does initialize: the run is parity's (rank 0's seed), and says so."""
    one, codes, logs, _ = _launch("parity", 1, stage, tmp_path)
    assert codes == [0], logs
    two, codes, logs, _ = _launch("seeded", 2, stage, tmp_path)
    assert codes == [0, 0], logs
    assert all("every rank takes rank 0's" in err for _, err in logs), logs
    single = json.load(open(f"{one}.0.json"))
    for rank in (0, 1):
        mine = json.load(open(f"{two}.{rank}.json"))
        assert all(abs(a - b) < 1e-5 for a, b in zip(mine["losses"], single["losses"])), (mine, single)
    w1 = torch.load(f"{one}.weights.pt", weights_only=True)
    w2 = torch.load(f"{two}.weights.pt", weights_only=True)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=1e-5, rtol=0)


@pytest.mark.parametrize("stage", [1, 3])
def test_ranks_whose_forwards_took_other_modules_are_refused_at_the_step(tmp_path, stage):
    """Rank 0's forward takes head a, rank 1's head b, of one shape: the collectives, paired by
    order, averaged a's gradient with b's (stage 3: gathered each other's shards too), and the
    step trained on it, silently. The step is refused on both ranks, before any update."""
    out, codes, logs, _ = _launch("routed", 2, stage, tmp_path)
    assert codes == [4, 4], logs
    for rank in (0, 1):
        assert "gathered or reduced other parameter units" in open(f"{out}.{rank}.err").read()


@pytest.mark.parametrize("tiles", ["4KiB"], ids=["tiled"])  # (whole the simpler case: 6 s of the suite)
def test_two_ranks_train_alike_after_read_only_gathers(tmp_path, tiles, monkeypatch):
    """A read-only GatheredParameters of a weight (nested) before every step at stage 3, where
    gathering it is an all-gather of its slices (tile by tile where tiled): the weight is whole
    in both contexts, and the losses and weights are bit-identical to the run without them."""
    if tiles:
        monkeypatch.setenv("INFINITY_TEST_TILE_SIZE", tiles)
    plain, codes, logs, _ = _launch("parity", 2, 3, tmp_path)
    assert codes == [0, 0], logs
    gathered, codes, logs, _ = _launch("gather", 2, 3, tmp_path)
    assert codes == [0, 0], logs
    for rank in (0, 1):
        assert json.load(open(f"{gathered}.{rank}.json"))["losses"] == json.load(open(f"{plain}.{rank}.json"))["losses"]
    w1 = torch.load(f"{plain}.weights.pt", weights_only=True)
    w2 = torch.load(f"{gathered}.weights.pt", weights_only=True)
    assert w1.keys() == w2.keys() and all(torch.equal(w2[k], w1[k]) for k in w1)


def test_two_ranks_clip_through_torch_as_one_rank(tmp_path):
    """``torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.05)`` every step at stage
    3: each rank gets the global norm one rank gets (every step clipping), losses and weights
    within 1e-5 of one rank's, and every rank counts the model's full size, not its slices."""
    one, codes, logs, _ = _launch("clip", 1, 3, tmp_path)
    assert codes == [0], logs
    two, codes, logs, _ = _launch("clip", 2, 3, tmp_path)
    assert codes == [0, 0], logs
    single = json.load(open(f"{one}.0.json"))
    assert len(single["norms"]) == 5 and min(single["norms"]) > 0.05
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 64), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 4))  # the worker's parameters  # fmt: skip
    for rank in (0, 1):
        mine = json.load(open(f"{two}.{rank}.json"))
        assert mine["count"] == single["count"] == sum(p.numel() for p in model.parameters())
        assert mine["norms"] == pytest.approx(single["norms"], rel=1e-5)
        assert mine["losses"] == pytest.approx(single["losses"], abs=1e-5)
    w1 = torch.load(f"{one}.weights.pt", weights_only=True)
    w2 = torch.load(f"{two}.weights.pt", weights_only=True)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=1e-5, rtol=0)


def test_ranks_on_one_drive_share_its_free_space(tmp_path, monkeypatch):
    """Two ranks whose swap directories are on one filesystem: a free space that holds either
    rank's state but not both is refused on both, naming them; one that holds both is split in
    proportion to their states, and each arena is capped at its share ([Note: disk footprint])."""
    def launch(name: str, free: int | None):
        if free is not None:
            monkeypatch.setenv("INFINITY_TEST_DISK_FREE", str(free))
        (tmp_path / name).mkdir()
        return _launch("parity", 2, 3, tmp_path / name)

    out, codes, logs, _ = launch("real", None)
    assert codes == [0, 0], logs
    states = [next(iter(json.load(open(f"{out}.{r}.json"))["disk"].values()))["state_bytes"] for r in (0, 1)]
    total = sum(states)
    out, codes, logs, _ = launch("short", max(states) * 3 // 2 // 4096 * 4096)
    assert max(states) * 3 // 2 < total and codes == [3, 3], logs
    for r in (0, 1):
        error = open(f"{out}.{r}.err").read()
        assert "ranks 0, 1 lie on one filesystem" in error and "{local_rank}" in error, error
    room = total * 11 // 10 // 4096 * 4096
    out, codes, logs, _ = launch("enough", room)
    assert codes == [0, 0], logs
    for r in (0, 1):
        disk = next(iter(json.load(open(f"{out}.{r}.json"))["disk"].values()))
        share = room * disk["state_bytes"] // total // 4096 * 4096
        assert disk["cap_bytes"] == share and disk["arena_bytes"] <= share, (disk, share)


def test_a_failed_rank_is_named_by_the_survivors_within_the_timeout(tmp_path):
    out, codes, logs, elapsed = _launch("dead", 2, 3, tmp_path, timeout=90)
    assert codes[1] != 0 and "SimulatedFailure" in logs[1][1]  # rank 1 died of its own error
    assert codes[0] == 4, logs[0]
    error = open(f"{out}.0.err").read()
    assert "rank 1 failed: SimulatedFailure: simulated failure in the training loop" in error
    assert elapsed < 60  # partition.timeout is 10 s here


def test_configs_that_differ_are_refused_at_initialize(tmp_path):
    out, codes, logs, _ = _launch("mismatch", 2, 3, tmp_path, timeout=90)
    assert codes == [3, 3], logs
    for rank in (0, 1):
        error = open(f"{out}.{rank}.err").read()
        assert "the tier configs of the ranks differ" in error and "optimizer.lr" in error


@pytest.mark.parametrize(("stage", "tiles"), [(1, None), (2, None), (3, "4KiB")],
                         ids=["stage1", "stage2", "stage3-tiled"])  # fmt: skip
def test_state_dict_and_export_at_two_ranks_gather_to_rank_0(tmp_path, stage, tiles, monkeypatch):
    """Every rank calls ``engine.module.state_dict()`` and ``engine.export()`` (at stages 1 and 2
    too: the fp32 masters are sharded at every stage). Rank 0's state_dict holds every key of
    the plain model with exactly the weights the ranks all-gather (which the parity test holds
    to one rank's); rank 1's is empty; the export loads strictly into the plain model with rank
    0's values. Tiled (stage 3): a parameter's tiles, gathered unit by unit, joined in order.
    Inside GatheredParameters over every parameter, rank 0 alone reads the same weights
    (DeepSpeed's idiom: refused after partition.timeout before, waiting for rank 1)."""
    if tiles:
        monkeypatch.setenv("INFINITY_TEST_TILE_SIZE", tiles)
    out, codes, logs, _ = _launch("save", 2, stage, tmp_path)
    assert codes == [0, 0], logs
    state = torch.load(f"{out}.state_dict.pt", weights_only=True)
    gathered = torch.load(f"{out}.weights.pt", weights_only=True)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.LayerNorm(64), torch.nn.Linear(64, 4))  # the worker's  # fmt: skip
    assert state.keys() == gathered.keys() == plain.state_dict().keys()
    assert [json.load(open(f"{out}.{r}.keys.json"))["keys"] for r in (0, 1)] == [len(state), 0]
    for name in state:
        assert torch.equal(state[name], gathered[name]), name
    inside = torch.load(f"{out}.gathered_state_dict.pt", weights_only=True)
    assert inside.keys() == state.keys() and all(torch.equal(inside[k], state[k]) for k in state)
    from safetensors.torch import load_file

    plain.load_state_dict(load_file(f"{out}.export.safetensors"), strict=True)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, state[name]), name


@pytest.mark.parametrize("stage", [1, 3])
def test_a_load_state_dict_that_gives_some_ranks_no_weights_is_refused_and_one_file_loads(tmp_path, stage):
    """state_dict() at two ranks gives rank 1 an empty dict; loading it back (strict=False)
    wrote rank 0's slices only, a model half loaded, silently: refused on both ranks, naming
    the cause. The same file loaded on every rank loads: the gathered weights are the file's."""
    out, codes, logs, _ = _launch("load", 2, stage, tmp_path)
    assert codes == [0, 0], logs
    for rank in (0, 1):
        assert "every rank passes the same weights" in json.load(open(f"{out}.{rank}.load.json"))["refused"]
    want = torch.load(f"{out}.doubled.pt", weights_only=True)
    got = torch.load(f"{out}.weights.pt", weights_only=True)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_state_dict_on_rank_0_alone_is_refused_naming_the_rank_that_did_not_call(tmp_path):
    """DDP's ``if rank == 0: torch.save(model.state_dict(), ...)``: rank 0 raises, naming
    rank 1, after partition.timeout (10 s here), without a gather that rank 1 never joins."""
    out, codes, logs, _ = _launch("save-alone", 2, 3, tmp_path, 90)
    assert codes == [4, 0], logs
    error = open(f"{out}.0.err").read()
    assert "state_dict() of a module whose weights are sharded over the ranks is a collective that every " \
           "rank calls" in error and "rank(s) 1 did not within partition.timeout=10s" in error, error


@pytest.mark.parametrize("tiles", [None], ids=["whole"])  # tiled: the next test (23 s of the suite each)
def test_a_checkpoint_reshards_to_another_world_size(tmp_path, tiles, monkeypatch):
    """Saved by 2 ranks at stage 3, loaded by 1 rank and by 3 ranks (stage 3) and by 3 ranks
    at stage 1: the weights right after the load are exactly the saved ones, and 5 more steps
    (same global batches) match the 2-rank run within 1e-5 (optimizer moments and step counts
    came back too). Tiled: the same with the Linears in tiles, which the next test covers
    (tiles saved, loaded whole at 1 rank and in other tiles at 3)."""
    if tiles:
        monkeypatch.setenv("INFINITY_TEST_TILE_SIZE", tiles)
    ckpt = str(tmp_path / "ckpt")
    saved, codes, logs, _ = _launch("ckpt-save", 2, 3, tmp_path, 120, ckpt)
    assert codes == [0, 0], logs
    at_save = torch.load(f"{saved}.at_ckpt.pt", weights_only=True)
    final = torch.load(f"{saved}.weights.pt", weights_only=True)
    for world, stage in ((1, 3), (3, 3), (3, 1)):
        _load_and_compare(ckpt, world, stage, tmp_path, at_save, final)


def _load_and_compare(ckpt: str, world: int, stage: int, tmp_path, at_save: dict, final: dict) -> None:
    """Load ``ckpt`` with ``world`` ranks at ``stage`` and train on: the weights right after the
    load must be ``at_save`` exactly, and 5 steps on within 1e-5 of ``final``."""
    out, codes, logs, _ = _launch("ckpt-load", world, stage, tmp_path, 120, ckpt)
    assert codes == [0] * world, logs
    at_load = torch.load(f"{out}.at_ckpt.pt", weights_only=True)
    assert at_load.keys() == at_save.keys()
    for name in at_save:
        assert torch.equal(at_load[name], at_save[name]), (world, stage, os.environ.get("INFINITY_TEST_TILE_SIZE"), name)
    mine = torch.load(f"{out}.weights.pt", weights_only=True)
    for name in final:
        torch.testing.assert_close(mine[name], final[name], atol=1e-5, rtol=0)


def test_a_checkpoint_loads_into_another_tile_size_and_world_size_at_once(tmp_path, monkeypatch):
    """Saved by 2 ranks with the Linears in 4KiB tiles; loaded by 1 rank with no tiles, and by
    3 ranks at stage 1 in 8KiB tiles (the first Linear whole, the second in 3 tiles whose rows
    are not the saved tiles'): the weights right after the load are exactly the saved ones, and
    5 more steps match the 2-rank run within 1e-5, as resharding alone does."""
    monkeypatch.setenv("INFINITY_TEST_TILE_SIZE", "4KiB")
    ckpt = str(tmp_path / "ckpt")
    saved, codes, logs, _ = _launch("ckpt-save", 2, 3, tmp_path, 120, ckpt)
    assert codes == [0, 0], logs
    at_save = torch.load(f"{saved}.at_ckpt.pt", weights_only=True)
    final = torch.load(f"{saved}.weights.pt", weights_only=True)
    for world, stage, tiles in ((1, 3, None), (3, 1, "8KiB")):
        if tiles is None:
            monkeypatch.delenv("INFINITY_TEST_TILE_SIZE")
        else:
            monkeypatch.setenv("INFINITY_TEST_TILE_SIZE", tiles)
        _load_and_compare(ckpt, world, stage, tmp_path, at_save, final)


def test_the_demo_runs_under_torchrun(tmp_path):
    """What a new user would type: torchrun with 2 ranks runs the same demo."""
    pytest.importorskip("transformers")
    swap = tmp_path / "swap"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "infinity.tools.demo",
           "--size", "tiny", "--steps", "6", "--block-size", "32", "--batch-size", "2", "--log-every", "3",
           "--sample-bytes", "8", "--swap-dir", str(swap)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **cpu_unless_gpus(2)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "2 ranks" in out.stdout and "val loss" in out.stdout
    assert out.stdout.count("step 6/6") == 1  # rank 0 speaks for all
    assert "rank 0:" in out.stdout and "rank 1:" in out.stdout  # swap-inspect of both ranks


def test_more_ranks_than_gpus_is_refused_with_the_counts(monkeypatch):
    """Two ranks on one GPU (torchrun --nproc-per-node 2 on an H100 machine): set_device died
    with "invalid device ordinal", which names neither the counts nor the way out; the engine
    says both before it makes the group."""
    from infinity import _dist

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=1 but this process sees 1 CUDA device\(s\) "
                                           r"\(CUDA_VISIBLE_DEVICES=0\)"):  # fmt: skip
        _dist._own_gpu()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert _dist._own_gpu() == 0


def test_a_collective_s_failure_names_the_timeout_that_bounds_it(tmp_path):
    """partition.timeout is the timeout of a process group the engine makes; one made before
    it (as DDP scripts, accelerate and the Trainer make theirs) keeps its own, and a failed
    collective quoted partition.timeout all the same (an audit helper's repro: "after
    partition.timeout=10s" where gloo had waited its group's 45 s). The message names the
    group's own now, and says what mismatched collectives come from."""
    import datetime

    import torch.distributed as dist

    from infinity._dist import Dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=45))  # fmt: skip
    try:
        why = Dist(10)._why("gradient reduction of layer", RuntimeError("gloo's own words"))
    finally:
        dist.destroy_process_group()
    assert "after the process group's own timeout of 45s" in why and "partition.timeout=10s" not in why, why
    assert "gave gradients to other parameters" in why and "gloo's own words" in why

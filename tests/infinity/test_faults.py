"""The engine under faults and bad input: each refusal names its cause, and nothing is lost.

A fault here is something a user's machine does to a run (no io_uring, a tmpfs swap
directory, a full drive, a read-only or missing directory, a directory another run holds, a
tampered manifest); each case asserts the error's type, that its message names the cause (the
key, the path, the bytes, the errno, the process), and that what the user had survives: the
model's values after a refused initialize, a running engine after a refused second one, files
outside the swap directory. Checkpoint faults are tested with the checkpoint code.

Weights are compared bit for bit: the I/O path (backend, O_DIRECT or buffered, the filesystem,
one drive or two) moves bytes and never changes arithmetic, so any difference is a bug.

Mounts (a small tmpfs, a read-only bind mount) need root; those cases skip with the reason
elsewhere. A full drive also has injected variants (posix_fallocate, pwritev) that run
anywhere; an unwritable directory is simulated in tests/infinity/test_config.py.

"""

from __future__ import annotations

import ast
import errno
import importlib
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import infinity
import infinity.aio as aio
import infinity.swap as swap
from infinity import _footprint
from infinity.swap import _manifest, human_size

_files = importlib.import_module("infinity.aio._files")

STEPS = 4
NVME = ("nvme", "nvme", "nvme")
DEVICE = ("device", "device", "device")


# -- a tiny run -------------------------------------------------------------------------------
def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))


def _config(paths, tiers=NVME, **sections) -> dict:
    paths = [str(p) for p in paths] if isinstance(paths, (list, tuple)) else [str(paths)]
    cfg = {"tiers": dict(zip(("params", "grads", "optimizer"), tiers)),
           "nvme": {"paths": paths, "grow_step": "1MiB"}, "memory": {"host_budget": "64MiB"},
           "precision": {"param_dtype": "fp32"}, "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}  # fmt: skip
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value)
    return cfg


def _batches(steps: int, first: int = 0):
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(first + steps)]
    return batches[first:]


def _train(engine: infinity.Engine, steps: int = STEPS, first: int = 0) -> None:
    """Steps ``first`` .. ``first + steps - 1`` of one fixed sequence of batches."""
    for x, y in _batches(steps, first):
        engine.backward(((engine(x) - y) ** 2).mean())
        assert engine.step()


def _run(config, model: nn.Module | None = None, steps: int = STEPS):
    """Train a fresh (or the given) model ``steps`` steps: (final fp32 weights, aio backend)."""
    engine = infinity.initialize(_model() if model is None else model, config)
    try:
        _train(engine, steps)
        return engine.gathered_weights(), engine.aio.backend
    finally:
        engine.close()


def _assert_identical(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    differ = [k for k in expected if not torch.equal(actual[k], expected[k])]
    assert not differ, f"weights differ in {differ}: max |diff| " + ", ".join(
        f"{k}={(actual[k] - expected[k]).abs().max().item():.3g}" for k in differ
    )


def _values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def device_weights():
    """The all-device run: no swap, no I/O; every other run must end bit-identical to it."""
    weights, _ = _run(_config([], DEVICE))
    return weights


@pytest.fixture
def no_env_backend(monkeypatch):
    """The config, not the caller's INFINITY_AIO_BACKEND, decides the backend."""
    monkeypatch.delenv(aio.ENV_BACKEND, raising=False)


@pytest.fixture
def uring_here():
    status = aio.probe()["uring"]
    if not status.available:
        pytest.skip(f"aio backend 'uring' unavailable: {status.reason}")


def _aio_warnings(caplog, about: str) -> list[logging.LogRecord]:
    """infinity.aio's warnings that mention ``about`` (a machine may have others to say: no
    O_DIRECT under tmp_path, no io_uring)."""
    return [r for r in caplog.records
            if r.name == "infinity.aio" and r.levelno >= logging.WARNING and about in r.getMessage()]  # fmt: skip


# -- 1. io_uring unavailable ------------------------------------------------------------------
@pytest.mark.uring
def test_threads_forced_by_the_environment_gives_the_uring_weights(tmp_path, no_env_backend, uring_here,
                                                                   monkeypatch, caplog, device_weights):  # fmt: skip
    (tmp_path / "uring").mkdir()
    (tmp_path / "threads").mkdir()
    uring, backend = _run(_config(tmp_path / "uring", aio={"backend": "uring"}))
    assert backend == "uring"
    monkeypatch.setenv(aio.ENV_BACKEND, "threads")
    with caplog.at_level(logging.INFO, logger="infinity.aio"):
        threads, backend = _run(_config(tmp_path / "threads", aio={"backend": "auto"}))
    assert backend == "threads"
    assert any(f"{aio.ENV_BACKEND}=threads overrides backend='auto'" in r.getMessage() for r in caplog.records)
    _assert_identical(threads, uring)
    _assert_identical(uring, device_weights)


@pytest.fixture
def uring_extension_missing(monkeypatch, no_env_backend):
    """As on a machine where the extension was not built: importing infinity.aio._uring fails
    (None in sys.modules makes the import raise), and the fallback log is fresh."""
    monkeypatch.delattr(aio, "_uring", raising=False)  # `from . import _uring` would find it
    monkeypatch.setitem(sys.modules, "infinity.aio._uring", None)
    monkeypatch.setattr(aio, "_fallback_logged", set())


def test_auto_falls_back_to_threads_without_the_extension(tmp_path, uring_extension_missing, caplog,
                                                          device_weights):  # fmt: skip
    status = aio.probe()["uring"]
    assert not status.available and "infinity.aio._uring is not built" in status.reason
    with caplog.at_level(logging.WARNING, logger="infinity.aio"):
        weights, backend = _run(_config(tmp_path, aio={"backend": "auto"}))
    assert backend == "threads"
    (record,) = _aio_warnings(caplog, "io_uring")  # one line for the whole run
    assert "io_uring unavailable" in record.getMessage()
    assert "infinity.aio._uring is not built" in record.getMessage()  # says why
    _assert_identical(weights, device_weights)


def test_explicit_uring_without_the_extension_is_refused_at_initialize(tmp_path, uring_extension_missing):
    model = _model()
    before = _values(model)
    with pytest.raises(aio.BackendUnavailable, match=r"uring aio backend cannot run here: .*_uring is not built"):
        infinity.initialize(model, _config(tmp_path, aio={"backend": "uring"}))
    _assert_identical(_values(model), before)
    assert os.listdir(tmp_path) == []  # refused before anything was written


# -- 2. a swap directory on tmpfs ---------------------------------------------------------------
def test_a_tmpfs_swap_directory_gives_the_device_weights(shm_dir, device_weights):
    weights, _ = _run(_config(shm_dir))
    _assert_identical(weights, device_weights)
    assert os.path.getsize(shm_dir / "rank0" / "arena-0.bin") > 0  # the state did go there


def test_o_direct_refused_warns_once_and_changes_nothing(shm_dir, o_direct_refused, caplog, device_weights):
    # Two drives on one filesystem, every tensor striped: two arena files, one warning.
    drives = [shm_dir / "a", shm_dir / "b"]
    for d in drives:
        d.mkdir()
    with caplog.at_level(logging.WARNING, logger="infinity.aio"):
        weights, _ = _run(_config(drives, nvme={"stripe_threshold": 0, "stripe_size": "4KiB"}))
    (record,) = _aio_warnings(caplog, "O_DIRECT")
    message = record.getMessage()
    assert "O_DIRECT refused (EINVAL)" in message and "buffered" in message
    assert str(drives[0] / "rank0" / "arena-0.bin") in message  # names where
    _assert_identical(weights, device_weights)
    assert all(os.path.getsize(d / "rank0" / "arena-0.bin") > 0 for d in drives)


# -- mounts: the `mount` and `engines` fixtures are in conftest.py ------------------------------
def _read_only(mount, source, target) -> str:
    """``source`` again at ``target``, read-only (root ignores mode bits, not a ro mount)."""
    mount("--bind", source=str(source), target=target)
    mount("-o", "remount,bind,ro", source=str(source), target=target)
    return str(target)


# -- 3. ENOSPC while swapping -------------------------------------------------------------------
def _fails(err: int):
    def fail(*args):
        raise OSError(err, os.strerror(err))

    return fail


def _big_model() -> nn.Module:
    torch.manual_seed(0)
    # 1.6M parameters: 6 MiB per fp32 copy; parameters, master weights and two moments
    # need 24 MiB of swap, three times the 8 MiB drive.
    return nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 1024))


def _one_big_step(model: nn.Module, config) -> dict[str, torch.Tensor]:
    engine = infinity.initialize(model, config)
    try:
        x = torch.randn(2, 512, generator=torch.Generator().manual_seed(2))
        engine.backward(engine(x).square().mean())
        assert engine.step()
        return engine.gathered_weights()
    finally:
        engine.close()


def test_a_full_drive_is_refused_at_initialize_naming_the_directory_and_the_bytes(tmp_path, tmpfs, engines):
    small = tmpfs(tmp_path / "small", "8m")
    model = _big_model()
    before = _values(model)
    roomy = {"memory": {"host_budget": "256MiB"}}
    with pytest.raises(ValueError) as info:  # before anything is written: [Note: disk footprint]
        engines.append(infinity.initialize(model, _config(small, **roomy)))
    m = re.search(r"under '([^']+)' needs (\S+) for the state on nvme, but its filesystem has (\S+) free", str(info.value))
    assert m, str(info.value)
    assert m.group(1) == os.path.join(small, "rank0")
    fs = os.statvfs(small)
    free = fs.f_bavail * fs.f_frsize
    # The arena was empty: the free space read then was all there is now, less the pages of
    # the space's own small files (.lock, manifest, space.json), removed with the refused run.
    assert m.group(3) in {human_size(free - k * fs.f_frsize) for k in range(8)}, (m.group(3), free)
    assert os.listdir(small) == []  # nothing left behind
    # Nothing lost: the model keeps its values and trains on a drive with room to the weights
    # device tiers give it; and the refused engine let go of the small drive, where a model
    # that fits starts afresh.
    _assert_identical(_values(model), before)
    (tmp_path / "big").mkdir()
    weights = _one_big_step(model, _config(tmp_path / "big", **roomy))
    _assert_identical(weights, _one_big_step(_big_model(), _config([], DEVICE, **roomy)))
    _run(_config(small))


def test_enospc_from_fallocate_is_reported_the_same_without_a_mount(tmp_path, monkeypatch, device_weights):
    model = _model()
    before = _values(model)
    with monkeypatch.context() as patch:
        patch.setattr(os, "posix_fallocate", _fails(errno.ENOSPC))
        with pytest.raises(OSError) as info:
            infinity.initialize(model, _config(tmp_path))
    e = info.value
    arena = str(tmp_path / "rank0" / "arena-0.bin")
    assert e.errno == errno.ENOSPC and e.filename == arena
    # The first tensor written (Linear(16, 32)'s 544 fp32 parameters, 2176 bytes, one 4 KiB
    # unit) needs the first growth of the empty arena: 1MiB, or less where the arena's cap (the
    # state and optimizer.overlap_disk of it more: [Note: disk footprint]) is smaller.
    grown = re.search(r"cannot grow the arena file from 0 to (\d+) bytes \(\1 more\) for a tensor of 4096 bytes", str(e))
    assert grown and 4096 <= int(grown.group(1)) <= 1 << 20, str(e)
    _assert_identical(_values(model), before)
    weights, _ = _run(_config(tmp_path), model)  # the same directory, once there is room
    _assert_identical(weights, device_weights)


def test_enospc_on_write_names_the_arena_and_the_bytes(tmp_path, monkeypatch):
    """Where space runs out at the write, not at the fallocate (a filesystem without fallocate
    gets a sparse arena): the engine's write error names the file, the bytes and the offset."""
    model = _model()
    before = _values(model)
    with monkeypatch.context() as patch:
        patch.setattr(os, "posix_fallocate", _fails(errno.EOPNOTSUPP))  # sparse arena
        patch.setattr(os, "pwritev", _fails(errno.ENOSPC))  # the threads backend's write
        with pytest.raises(OSError) as info:
            infinity.initialize(model, _config(tmp_path, aio={"backend": "threads"}))
    e = info.value
    assert e.errno == errno.ENOSPC and e.filename == str(tmp_path / "rank0" / "arena-0.bin")
    assert re.search(r"No space left on device \(pwrite of \d+ bytes at offset \d+\)", str(e)), str(e)
    _assert_identical(_values(model), before)


def test_a_full_drive_under_a_sparse_arena_reports_the_failed_write(tmp_path, tmpfs, monkeypatch):
    small = tmpfs(tmp_path / "small", "8m")
    monkeypatch.setattr(os, "posix_fallocate", _fails(errno.EOPNOTSUPP))  # sparse: writes find the end
    # free space that is gone by the time it is written (another writer): the write reports it
    monkeypatch.setattr(_footprint, "disk_free", lambda path: 1 << 40)
    model = _big_model()
    before = _values(model)
    with pytest.raises(OSError) as info:
        infinity.initialize(model, _config(small, memory={"host_budget": "256MiB"}))
    e = info.value
    assert e.errno == errno.ENOSPC and e.filename == os.path.join(small, "rank0", "arena-0.bin"), repr(e)
    assert re.search(r"pwrite of \d+ bytes at offset \d+", str(e)), str(e)
    _assert_identical(_values(model), before)


class _Drive:
    """os.posix_fallocate through a switch: ``full`` makes it fail with ENOSPC, as on a drive
    that something else filled up after initialize."""

    def __init__(self):
        self.full = False
        self._real = os.posix_fallocate

    def __call__(self, fd, offset, length):
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._real(fd, offset, length)


@pytest.fixture
def drive(monkeypatch) -> _Drive:
    switch = _Drive()
    monkeypatch.setattr(os, "posix_fallocate", switch)
    return switch


def _grads_on_full_drive(tmp_path, drive, engines) -> infinity.Engine:
    """An engine whose arena grows a page at a time, so the first backward's gradient writes
    grow it; the drive fills up between initialize and that backward."""
    engine = infinity.initialize(_model(), _config(tmp_path, nvme={"grow_step": "4KiB"}))
    engines.append(engine)
    engine.plan.held = 0  # every gradient written in backward, none held for the step
    drive.full = True
    return engine


def test_enospc_in_the_first_backward_is_the_error_raised(tmp_path, drive, engines):
    engine = _grads_on_full_drive(tmp_path, drive, engines)
    x, y = _batches(1)[0]
    with pytest.raises(OSError) as info:
        engine.backward(((engine(x) - y) ** 2).mean())
    e = info.value
    assert e.errno == errno.ENOSPC and e.filename == str(tmp_path / "rank0" / "arena-0.bin")
    assert re.search(r"cannot grow the arena file from \d+ to \d+ bytes \(4096 more\)", str(e)), str(e)


def test_the_engine_trains_on_after_a_failed_backward_once_there_is_room(tmp_path, drive, engines, device_weights):
    engine = _grads_on_full_drive(tmp_path, drive, engines)
    x, y = _batches(1)[0]
    with pytest.raises(Exception):  # which error: the test above
        engine.backward(((engine(x) - y) ** 2).mean())
    drive.full = False  # room again: the failed step is redone from the start
    engine.zero_grad()
    _train(engine)
    _assert_identical(engine.gathered_weights(), device_weights)


# -- 4. read-only, missing, and busy swap directories -------------------------------------------
def test_a_read_only_swap_directory_is_refused_naming_it(tmp_path, mount):
    (tmp_path / "drive").mkdir()
    ro = _read_only(mount, tmp_path / "drive", tmp_path / "ro")
    model = _model()
    before = _values(model)
    with pytest.raises(ValueError, match=rf"nvme\.paths\[0\]: '{re.escape(ro)}' is not writable"):
        infinity.initialize(model, _config(ro))
    _assert_identical(_values(model), before)
    assert os.listdir(tmp_path / "drive") == []


@pytest.mark.parametrize("previous_run", [False, True], ids=["empty", "previous-run"])
def test_a_drive_remounted_read_only_after_the_config_was_checked(tmp_path, mount, previous_run):
    """The config was checked while the drive was writable; initialize meets it read-only
    (empty, or holding the rank directory of an earlier run)."""
    (tmp_path / "drive").mkdir()
    target = mount("--bind", source=str(tmp_path / "drive"), target=tmp_path / "ro")
    config = infinity.TierConfig.from_dict(_config(target))
    if previous_run:
        _run(config, steps=1)
    left = sorted(os.listdir(tmp_path / "drive"))
    mount("-o", "remount,bind,ro", source=str(tmp_path / "drive"), target=target)
    model = _model()
    before = _values(model)
    # initialize checks the directories again (they may have changed since the config was made)
    with pytest.raises(ValueError, match=rf"nvme\.paths\[0\]: '{re.escape(str(target))}' is not writable"):
        infinity.initialize(model, config)
    _assert_identical(_values(model), before)
    assert sorted(os.listdir(tmp_path / "drive")) == left


def test_a_full_drive_at_open_leaks_no_fd_and_names_the_lock_file(tmp_path, tmpfs):
    """A drive so full that not even the lock file can take the pid: each failed open used to
    leak the lock's descriptor, and its ENOSPC named no file."""
    full = tmpfs(tmp_path / "full", "64k")
    os.makedirs(os.path.join(full, "swap", "rank0"))
    fd = os.open(os.path.join(full, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):  # until every block is taken
            pass
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(OSError) as info:
            swap.SwapSpace(os.path.join(full, "swap"), grow_step=1 << 20, host_budget=1 << 20)
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename == os.path.join(full, "swap", "rank0", ".lock"), repr(info.value)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_missing_swap_directory_is_created_private_and_a_missing_parent_is_named(tmp_path):
    """As DeepSpeed does with its swap folder: a missing directory whose parent exists is made
    (0700); a missing parent stays an error naming it, and nothing is created."""
    missing = tmp_path / "missing"
    engine = infinity.initialize(_model(), _config(str(missing)))
    _train(engine, 1)
    engine.close()
    assert missing.is_dir() and (missing.stat().st_mode & 0o777) == 0o700
    deeper = tmp_path / "absent" / "swap"
    with pytest.raises(ValueError, match=rf"nvme\.paths\[0\]: '{re.escape(str(deeper))}' does not exist, nor does its "
                                         rf"parent '{re.escape(str(deeper.parent))}'"):
        infinity.initialize(_model(), _config(str(deeper)))
    assert not deeper.parent.exists()


def test_a_swap_directory_gone_after_the_config_was_checked_is_made_again(tmp_path):
    drive = tmp_path / "drive"
    drive.mkdir()
    config = infinity.TierConfig.from_dict(_config(drive))
    drive.rmdir()  # gone between loading the config and initialize: its parent is still there
    engine = infinity.initialize(_model(), config)
    _train(engine, 1)
    engine.close()
    assert drive.is_dir()


def test_a_second_engine_on_the_same_directory_is_refused_and_the_first_keeps_training(tmp_path, engines,
                                                                                        device_weights):  # fmt: skip
    first = infinity.initialize(_model(), _config(tmp_path))
    engines.append(first)
    _train(first, STEPS - 1)
    manifest = (tmp_path / "rank0" / "manifest.json").read_bytes()
    second = _model(seed=1)
    before = _values(second)
    rank_dir = str(tmp_path / "rank0")
    with pytest.raises(RuntimeError, match=rf"swap directory {re.escape(rank_dir)} is in use by another "
                                           rf"swap space of this process \({os.getpid()}\)"):  # fmt: skip
        infinity.initialize(second, _config(tmp_path))
    _assert_identical(_values(second), before)
    assert (tmp_path / "rank0" / "manifest.json").read_bytes() == manifest  # the refused one wrote nothing
    _train(first, 1, first=STEPS - 1)  # the last step, after the refusal
    _assert_identical(first.gathered_weights(), device_weights)


@pytest.fixture
def held_elsewhere(tmp_path):
    """A swap space on tmp_path opened by another process; yields that process's id."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, infinity.swap as s\n"
         "space = s.SwapSpace(sys.argv[1], grow_step=1 << 20, host_budget=1 << 20)\n"
         "print('ready', flush=True)\nsys.stdin.readline()\nspace.close()\n", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "ready"
        yield child.pid
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def test_the_lock_error_names_the_process_that_holds_the_directory(tmp_path, held_elsewhere):
    assert held_elsewhere != os.getpid()
    with pytest.raises(RuntimeError, match=rf"{re.escape(str(tmp_path / 'rank0'))} is in use by another swap "
                                           rf"space \(process {held_elsewhere}\)"):  # fmt: skip
        infinity.initialize(_model(), _config(tmp_path))


# -- 6. a tampered swap manifest --------------------------------------------------------------
# tests/swap/test_manifest.py refuses every bad field in Manifest.from_json (version 99, an
# absolute or "../" arena name included) and a "../" name on reopening with SwapSpace and
# SpaceReader. Here: an unknown version and an absolute name on reopening, and what matters
# most to the engine: it opens its swap with fresh=True, which removes the files a manifest
# lists, so a tampered manifest is never followed: the engine's swap is scratch, so it starts
# over, removing only the files in its rank directory whose names only a swap space makes.
def _tampered_space(root: Path, edit: str) -> tuple[str, Path]:
    """A closed space with one tensor in root/drive; its manifest edited. (rank dir, victim)."""
    drive = root / "drive"
    drive.mkdir()
    with swap.SwapSpace(str(drive), grow_step=1 << 20, host_budget=16 << 20) as space:
        space.put("w/param", torch.arange(1000, dtype=torch.float32)).result()
    victim = root / "victim.bin"
    victim.write_bytes(b"the user's data")
    rank_dir = str(drive / "rank0")
    path = os.path.join(rank_dir, "manifest.json")
    data = _manifest.read_json(path)
    if edit == "version":
        data["version"] = _manifest.VERSION + 1
    elif edit == "absolute":
        data["files"][0]["name"] = str(victim)
    else:  # "dotdot"
        data["files"][0]["name"] = "../../victim.bin"
    _manifest.write_json_atomic(path, data)
    return rank_dir, victim


_KEYS = {"version": rf"version: unknown version {_manifest.VERSION + 1} \(this infinity reads version 1 and 2\)",
         "absolute": r"files\[0\]\.name: '/.*/victim\.bin' is not an arena file name",
         "dotdot": r"files\[0\]\.name: '\.\./\.\./victim\.bin' is not an arena file name"}  # fmt: skip


@pytest.mark.parametrize("edit", ["version", "absolute"])
@pytest.mark.parametrize("opener", ["resume", "reader"])
def test_reopening_a_tampered_manifest_is_refused_naming_the_key(tmp_path, edit, opener):
    rank_dir, victim = _tampered_space(tmp_path, edit)
    manifest = Path(rank_dir, "manifest.json").read_bytes()
    with pytest.raises(swap.ManifestError, match=_KEYS[edit]) as info:
        if opener == "resume":
            swap.SwapSpace(str(tmp_path / "drive"), grow_step=1 << 20, host_budget=16 << 20)
        else:
            swap.SpaceReader(rank_dir)
    assert os.path.join(rank_dir, "manifest.json") in str(info.value)  # which file
    assert Path(rank_dir, "manifest.json").read_bytes() == manifest
    assert victim.read_bytes() == b"the user's data"
    assert os.path.getsize(os.path.join(rank_dir, "arena-0.bin")) > 0


@pytest.mark.parametrize("edit", ["version", "absolute", "dotdot"])
def test_a_fresh_engine_never_removes_what_a_tampered_manifest_lists(tmp_path, edit, caplog, device_weights):
    """The manifest is not followed (the victim stays); it does not block the run either."""
    rank_dir, victim = _tampered_space(tmp_path, edit)
    with caplog.at_level(logging.WARNING, logger="infinity.swap"):
        weights, _ = _run(_config(tmp_path / "drive"))
    assert re.search(_KEYS[edit], caplog.text), caplog.text  # said why it was not used
    _assert_identical(weights, device_weights)
    assert victim.read_bytes() == b"the user's data"
    assert sorted(os.listdir(rank_dir)) == [".lock", "arena-0.bin", "manifest.json", "space.json"]


# -- 7. no pickle in the load path ------------------------------------------------------------
_PICKLERS = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "shelve"}


def _unsafe_loads(source: str, filename: str) -> list[str]:
    """``file:line: what`` for every pickle import, and every torch.load without
    weights_only=True (or numpy.load with allow_pickle=True), in ``source``."""
    out = []
    tree = ast.parse(source, filename)
    torch_names, load_names = {"torch"}, set()  # aliases: `import torch as t`, `from torch import load`
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch":
                    torch_names.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.serialization"):
            load_names |= {a.asname or a.name for a in node.names if a.name == "load"}

    def is_true(call: ast.Call, key: str) -> bool:
        return any(k.arg == key and isinstance(k.value, ast.Constant) and k.value.value is True
                   for k in call.keywords)  # fmt: skip

    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in _PICKLERS]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _PICKLERS:
            out.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            dotted = ast.unparse(f)
            if dotted in ("__import__", "importlib.import_module") and node.args and isinstance(
                node.args[0], ast.Constant) and str(node.args[0].value).split(".")[0] in _PICKLERS:  # fmt: skip
                out.append(f"{where}: {ast.unparse(node)}")
            torch_load = (isinstance(f, ast.Attribute) and f.attr == "load" and (
                dotted.rsplit(".", 1)[0] in torch_names or dotted.rsplit(".", 1)[0].endswith("serialization"))
            ) or (isinstance(f, ast.Name) and f.id in load_names)  # fmt: skip
            if torch_load and not is_true(node, "weights_only"):
                out.append(f"{where}: {dotted}(...) without weights_only=True")
            if isinstance(f, ast.Attribute) and f.attr == "load" and dotted.split(".")[0] in ("np", "numpy") \
                    and is_true(node, "allow_pickle"):  # fmt: skip
                out.append(f"{where}: {dotted}(..., allow_pickle=True)")
            if isinstance(f, ast.Attribute) and f.attr == "read_pickle":
                out.append(f"{where}: {dotted}(...)")
    return sorted(out, key=lambda hit: int(hit.split(":")[1]))


def _package_dirs() -> list[Path]:
    import infinity.tools

    return [Path(m.__file__).parent for m in (infinity, aio, swap, infinity.tools)]


def test_the_package_sources_never_unpickle():
    """A checkpoint or swap file is data: loading one must not run code it carries."""
    files = sorted(p for d in _package_dirs() for p in d.rglob("*.py"))
    assert len(files) > 20  # the scan found the sources
    found = [hit for p in files for hit in _unsafe_loads(p.read_text(), str(p))]
    assert found == [], "pickle in the load path:\n" + "\n".join(found)


def test_the_pickle_scan_finds_what_it_looks_for():
    planted = ("import pickle\nfrom dill import loads\nimport torch as t\nfrom torch import load as tl\n"
               "t.load('a')\ntorch.load('b', weights_only=False)\ntorch.load('ok', weights_only=True)\n"
               "tl('c')\nnp.load('d', allow_pickle=True)\nimportlib.import_module('cloudpickle')\n")  # fmt: skip
    lines = [hit.split(":")[1] for hit in _unsafe_loads(planted, "x.py")]
    assert lines == ["1", "2", "5", "6", "8", "9", "10"], lines

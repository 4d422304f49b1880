"""The checkpoint root shared by saves: another run's save in progress is never touched (the
root's lock), leftovers of saves that were killed are collected by the next save, and a kill
while pruning never leaves something that looks like a checkpoint without being one."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import re
import stat
import subprocess
import sys
import time

import pytest
import torch

import infinity
from infinity.checkpoint import list_checkpoints, resolve
from infinity.tools import swap_inspect

sys.path.insert(0, os.path.dirname(__file__))
from _common import config, make_model, train  # noqa: E402

CHILD = os.path.join(os.path.dirname(__file__), "_checkpoint_root_child.py")


def _engine(tmp_path):
    swap = tmp_path / f"swap-{time.monotonic_ns()}"
    swap.mkdir()
    return infinity.initialize(make_model(seed=0), config(str(swap), ["device"] * 3))


@contextlib.contextmanager
def _other_run(tmp_path, mode: str, root, *args: str):
    """The child process ``mode`` of _checkpoint_root_child.py saving to ``root``; killed if the
    test leaves it running."""
    swap = tmp_path / f"swap-{mode}-{time.monotonic_ns()}"
    swap.mkdir()
    proc = subprocess.Popen([sys.executable, CHILD, mode, str(root), str(swap), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()


def _expect(proc, word: str) -> str:
    """The path the child printed after ``word`` (its stderr in the failure message otherwise)."""
    line = proc.stdout.readline()
    if not line.startswith(word + " "):
        proc.kill()
        pytest.fail(f"expected {word!r} from the other run, got {line!r}; its stderr:\n{proc.stderr.read()[-3000:]}")
    return line.split(" ", 1)[1].strip()


def _files(root) -> dict[str, int]:
    """Every file under ``root`` with its size: what a save that must touch nothing may not change."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            path = os.path.join(d, f)
            out[os.path.relpath(path, root)] = os.path.getsize(path)
    return out


def test_a_save_to_a_root_another_run_is_saving_to_fails_naming_it_and_touches_nothing(tmp_path, caplog):
    """While another process's save holds the root, a save (of the same tag) fails at once
    naming the root and that process, and leaves its save in progress whole; that save then
    completes and verifies. Saving the same tag afterwards replaces it, with a warning that
    names the run that saved it."""
    root = tmp_path / "ck"
    engine = _engine(tmp_path)
    with _other_run(tmp_path, "pause-in-save", root, "shared") as other:
        other_tmp = _expect(other, "paused")
        before = _files(root)
        assert any(name.startswith(os.path.basename(other_tmp) + "/rank0/arena") for name in before), before
        with pytest.raises(RuntimeError, match=rf"checkpoint root {re.escape(str(root))} is in use by another "
                                               rf"save \(process {other.pid} on "):  # fmt: skip
            engine.save_checkpoint(root, tag="shared")
        assert _files(root) == before
        other.stdin.write("go\n")
        other.stdin.flush()
        assert _expect(other, "saved") == str(root / "shared")
        assert other.wait(timeout=60) == 0, other.stderr.read()[-3000:]
    assert resolve(root) == str(root / "shared")
    assert swap_inspect.main([str(root / "shared"), "--verify"]) == 0
    with caplog.at_level(logging.WARNING, logger="infinity"):
        engine.save_checkpoint(root, tag="shared")
    assert f"replacing tag 'shared', which another run saved (process {other.pid} on " in caplog.text
    assert sorted(os.listdir(root)) == [".lock", "latest", "shared"]
    assert [(step, tag) for step, _, tag in list_checkpoints(root)] == [(0, "shared")]  # this run's, step 0
    engine.close()


def test_a_dead_saves_leftovers_are_collected_and_a_live_saves_are_not(tmp_path):
    """A save killed mid-write leaves its temporary directory; the next save (another run's,
    which then stays paused mid-write) removes it; a third save meanwhile removes nothing."""
    root = tmp_path / "ck"
    with _other_run(tmp_path, "die-in-save", root) as dead:
        dead_tmp = _expect(dead, "dying")
        assert dead.wait(timeout=60) == 9, dead.stderr.read()[-3000:]
    assert os.path.isfile(os.path.join(dead_tmp, "rank0", "arena-0.bin"))  # a real leftover, with data
    engine = _engine(tmp_path)
    with _other_run(tmp_path, "pause-in-save", root, "live") as live:
        live_tmp = _expect(live, "paused")
        assert not os.path.exists(dead_tmp)
        before = _files(root)
        assert any(name.startswith(os.path.basename(live_tmp) + "/") for name in before), before
        with pytest.raises(RuntimeError, match=f"is in use by another save \\(process {live.pid} "):
            engine.save_checkpoint(root)
        assert _files(root) == before
        live.stdin.write("go\n")
        live.stdin.flush()
        assert _expect(live, "saved") == str(root / "live")
        assert live.wait(timeout=60) == 0, live.stderr.read()[-3000:]
    assert sorted(os.listdir(root)) == [".lock", "latest", "live"]
    engine.close()


def test_a_kill_while_pruning_leaves_no_half_checkpoint_and_the_next_save_collects_it(tmp_path):
    """Killed while keep_last removes step-0 (its meta.json already gone, its arena not): no
    directory with a tag's name lacks its meta.json, only step-1 is listed and `latest`; the
    next save removes what is left of step-0."""
    root = tmp_path / "ck"
    with _other_run(tmp_path, "die-in-prune", root) as other:
        assert other.wait(timeout=120) == 9, other.stderr.read()[-3000:]
    assert resolve(root) == str(root / "step-1")
    assert [tag for _, _, tag in list_checkpoints(root)] == ["step-1"]
    for name in os.listdir(root):
        if not name.startswith(".") and (root / name).is_dir():
            assert (root / name / "meta.json").is_file(), f"{name} looks like a checkpoint and is not one"
    left = [n for n in os.listdir(root) if n.startswith(".trash-")]
    assert left and os.path.isfile(root / left[0] / "rank0" / "arena-0.bin")  # the kill landed mid-removal
    engine = _engine(tmp_path)
    train(engine, 2)
    engine.save_checkpoint(root, keep_last=1)
    assert sorted(os.listdir(root)) == [".lock", "latest", "step-2"]
    engine.close()


def test_a_save_removes_what_saves_left_and_nothing_else(tmp_path):
    """Leftovers of every kind a save can leave (temporary and trash directories, a temporary
    `latest`) are removed by the next save; a directory that is not a checkpoint is not ours."""
    root = tmp_path / "ck"
    left = [".tmp-step-3.4242.0badf00d", ".trash-step-1.4242.deadbeef", ".tmp-step-2"]
    for name in left:
        (root / name / "rank0").mkdir(parents=True)
        (root / name / "rank0" / "arena-0.bin").write_bytes(b"\0" * 4096)
    (root / ".latest.k3j2h1.tmp").write_text("step-3\n")
    (root / "notes" / "rank0").mkdir(parents=True)  # the user's: no meta.json, not a checkpoint
    engine = _engine(tmp_path)
    engine.save_checkpoint(root)
    assert sorted(os.listdir(root)) == [".lock", "latest", "notes", "step-0"]
    assert os.listdir(root / "notes") == ["rank0"]
    engine.close()


def test_a_filesystem_without_flock_fails_the_save_naming_the_lock(tmp_path, monkeypatch):
    engine = _engine(tmp_path)
    root = tmp_path / "ck"

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(OSError) as info:
        engine.save_checkpoint(root)
    assert info.value.errno == errno.ENOLCK and info.value.filename == str(root / ".lock")
    assert "support flock" in str(info.value)
    assert sorted(os.listdir(root)) == [".lock"]
    engine.close()


@pytest.mark.parametrize("state, why", [(functools.reduce(lambda x, _: [x], range(150), 0), "nested more than")])
def test_a_client_state_that_would_not_load_back_is_refused_at_save(tmp_path, state, why):
    (tmp_path / "swap").mkdir()
    engine = infinity.initialize(make_model(), config(tmp_path / "swap", ("nvme", "nvme", "nvme")))
    with pytest.raises(ValueError, match=f"client_state would not load back: client_state: {why}"):
        engine.save_checkpoint(tmp_path / "ckpt", client_state=state)
    assert not (tmp_path / "ckpt").exists() or list_checkpoints(tmp_path / "ckpt") == []
    engine.close()


def test_a_latest_file_that_is_not_utf8_names_itself(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_bytes(b"\xffstep\n")
    with pytest.raises(infinity.checkpoint.CheckpointError, match="latest: not a tag: byte 0xff at offset 0"):
        infinity.checkpoint.resolve(tmp_path / "ckpt")


def test_a_full_disk_while_locking_the_root_names_the_lock_file_and_releases_it(tmp_path, monkeypatch):
    """On a full disk the first write to a new ``.lock`` (the holder's name) fails with ENOSPC
    and no file name: the error names the lock file and the errno, the lock is not kept (a
    later save in this process once failed "in use by another save (process ? on ?)"), and
    that later save, with space again, succeeds and loads exactly."""
    engine = _engine(tmp_path)
    root = tmp_path / "ck"
    real = os.pwrite

    def full(fd, data, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(os.sep + ".lock"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as the kernel reports it: no path
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError) as info:
        engine.save_checkpoint(root)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(root / ".lock")
    monkeypatch.setattr(os, "pwrite", real)
    saved = engine.gathered_weights()
    where = engine.save_checkpoint(root)
    assert sorted(os.listdir(root)) == [".lock", "latest", "step-0"]
    train(engine, 1)
    engine.load_checkpoint(root)
    assert engine.gathered_weights().keys() == saved.keys()
    assert all(torch.equal(w, saved[n]) for n, w in engine.gathered_weights().items())
    assert where == str(root / "step-0")
    engine.close()


def test_an_io_error_that_names_no_file_is_given_the_checkpoint_being_written(tmp_path, monkeypatch):
    """A directory's fsync fails with EIO, which the kernel reports with no file name: the
    save's error names the directory it was writing and the errno, leaves no temporary
    directory, and the next save to the root succeeds."""
    engine = _engine(tmp_path)
    root = tmp_path / "ck"
    real = os.fsync

    def failing(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError) as info:
        engine.save_checkpoint(root)
    assert info.value.errno == errno.EIO
    assert os.path.dirname(info.value.filename) == str(root), info.value
    assert os.path.basename(info.value.filename).startswith(".tmp-step-0."), info.value
    assert "writing the checkpoint" in str(info.value)
    assert sorted(os.listdir(root)) == [".lock"]
    monkeypatch.setattr(os, "fsync", real)
    assert engine.save_checkpoint(root) == str(root / "step-0")
    assert swap_inspect.main([str(root / "step-0"), "--verify"]) == 0
    engine.close()


def test_a_root_that_is_a_file_is_refused_naming_it(tmp_path):
    """save_checkpoint given a file's path: refused naming it and what it takes (a bare
    FileExistsError before, from making the directory)."""
    root = tmp_path / "afile"
    root.write_text("mine")
    with infinity.initialize(make_model(), config(tmp_path, ("cpu", "cpu", "cpu"))) as engine:
        with pytest.raises(NotADirectoryError, match="the checkpoint root is a file: save_checkpoint takes a directory"):
            engine.save_checkpoint(root)
    assert root.read_text() == "mine"

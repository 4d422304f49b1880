"""What a swap space opens and leaves on disk: only regular files, every fd closed on a failed
open, one directory given twice named as such, stale manifests that do not block a fresh
space, missing directories made, and arenas no larger than what they hold."""

from __future__ import annotations

import errno
import json
import os
import re

import pytest
import torch

import infinity.swap as swap
from infinity.swap import _arenas

MiB = 1 << 20


def _closed_space(open_space, dirs, tensors=None) -> str:
    (path,) = dirs(1)
    space = open_space(paths=[path])
    for name, t in (tensors or {"x/param": torch.arange(5000, dtype=torch.float32)}).items():
        space.put(name, t).result()
    space.close()
    return path


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- only regular files ---------------------------------------------------------------------------
def test_a_fifo_in_place_of_the_arena_is_refused_not_waited_on(open_space, dirs, no_hang):
    path = _closed_space(open_space, dirs)
    rank_dir = os.path.join(path, "rank0")
    arena = os.path.join(rank_dir, "arena-0.bin")
    os.unlink(arena)
    os.mkfifo(arena, 0o600)
    # What a checkpoint load and swap-inspect read with:
    with swap.SpaceReader(rank_dir) as reader, pytest.raises(OSError, match=r"tensor 'x/param': is a FIFO") as info:
        reader.read("x/param")
    assert info.value.filename == arena
    with pytest.raises(OSError, match="is a FIFO") as info:
        open_space(paths=[path])
    assert info.value.filename == arena


def test_a_symlinked_arena_is_refused_and_its_target_untouched(open_space, dirs, tmp_path, no_hang):
    path = _closed_space(open_space, dirs)
    rank_dir = os.path.join(path, "rank0")
    arena = os.path.join(rank_dir, "arena-0.bin")
    target = tmp_path / "precious.bin"
    os.rename(arena, target)
    before = target.read_bytes()
    os.symlink(target, arena)
    with swap.SpaceReader(rank_dir) as reader, pytest.raises(OSError, match="is a symbolic link, not a regular") as info:
        reader.read("x/param")
    assert info.value.filename == arena
    with pytest.raises(OSError, match="is a symbolic link") as info:
        space = open_space(paths=[path])
        space.put("x/param", torch.zeros(5000)).result()  # (what it did: wrote into the target)
    assert info.value.filename == arena
    assert target.read_bytes() == before


@pytest.mark.parametrize("name", ["manifest.json", "space.json"])
@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_manifest_or_marker_that_is_not_a_regular_file_is_refused(open_space, dirs, tmp_path, name, kind, no_hang):
    path = _closed_space(open_space, dirs)
    file = os.path.join(path, "rank0", name)
    if kind == "symlink":
        copy = tmp_path / name
        os.rename(file, copy)
        os.symlink(copy, file)
    else:
        os.unlink(file)
        os.mkfifo(file, 0o600)
    with pytest.raises((OSError, swap.ManifestError), match=re.escape(file)):
        swap.SpaceReader(os.path.join(path, "rank0"))
    with pytest.raises((OSError, swap.ManifestError), match=re.escape(file)):
        open_space(paths=[path])


def test_a_symlinked_lock_file_is_refused(open_space, dirs, tmp_path):
    path = _closed_space(open_space, dirs)
    lock = os.path.join(path, "rank0", ".lock")
    os.unlink(lock)
    (tmp_path / "elsewhere").write_text("keep")
    os.symlink(tmp_path / "elsewhere", lock)
    with pytest.raises(OSError, match="is a symbolic link") as info:
        open_space(paths=[path])
    assert info.value.filename == lock
    assert (tmp_path / "elsewhere").read_text() == "keep"  # not truncated to hold a pid


# -- a failed open closes every fd and names the file ----------------------------------------------
def test_a_full_disk_at_the_lock_leaks_no_fd_and_names_the_file(open_space, dirs, monkeypatch):
    (path,) = dirs(1)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_arenas.os, "pwrite", full)
    before = _fds()
    for _ in range(5):
        with pytest.raises(OSError) as info:
            open_space(paths=[path])
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename == os.path.join(path, "rank0", ".lock")
    assert _fds() == before


def test_a_full_disk_at_the_arena_leaks_no_fd_and_leaves_no_half_made_space(open_space, dirs, monkeypatch):
    (path,) = dirs(1)
    real = _arenas.write_json_atomic

    def full(target, data, **kw):
        raise OSError(errno.ENOSPC, "No space left on device: cannot write", target)

    monkeypatch.setattr(_arenas, "write_json_atomic", full)
    before = _fds()
    for _ in range(3):
        with pytest.raises(OSError, match="No space left"):
            open_space(paths=[path])
    assert _fds() == before
    monkeypatch.setattr(_arenas, "write_json_atomic", real)
    assert open_space(paths=[path]).names() == []  # not fresh, yet not blocked by leftovers


# -- one directory given twice -----------------------------------------------------------------------
def test_an_entry_that_is_a_symlink_to_another_is_named_as_the_same_directory(open_space, dirs, tmp_path):
    (real,) = dirs(1)
    alias = str(tmp_path / "alias")
    os.symlink(real, alias)
    with pytest.raises(ValueError, match=rf"'{re.escape(real)}' and '{re.escape(alias)}' are the same directory"):
        open_space(paths=[real, alias])
    assert not os.path.exists(os.path.join(real, "rank0"))  # refused before anything was made


# -- a stale manifest does not block a fresh space -----------------------------------------------------
@pytest.mark.parametrize("garbage", [b"{not json", b"\xff\xfe", b'{"format": "infinity-swap", "version": 99}'])
def test_fresh_opens_over_an_unreadable_manifest_removing_only_space_files(open_space, dirs, garbage, caplog):
    (path,) = dirs(1)
    space = open_space(paths=[path], allow_foreign=True)
    space.put("x/param", torch.ones(1000)).result()
    space.close()
    rank_dir = os.path.join(path, "rank0")
    with open(os.path.join(rank_dir, "manifest.json"), "wb") as f:
        f.write(garbage)
    with open(os.path.join(rank_dir, "notes.txt"), "w") as f:
        f.write("the user's")
    with pytest.raises(swap.ManifestError):
        open_space(paths=[path], allow_foreign=True)  # not fresh: the space cannot be trusted
    with caplog.at_level("WARNING", logger="infinity.swap"):
        space = open_space(paths=[path], fresh=True, allow_foreign=True)
    assert space.names() == []
    assert "cannot be read" in caplog.text and "manifest.json" in caplog.text
    assert open(os.path.join(rank_dir, "notes.txt")).read() == "the user's"


# -- what is left on disk -------------------------------------------------------------------------------
def _disk_bytes(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_a_small_space_does_not_take_a_whole_grow_step(open_space, dirs):
    (path,) = dirs(1)
    space = open_space(paths=[path], grow_step=256 * MiB)
    space.put("x", torch.zeros(1000)).result()
    assert space.stats()["arena_bytes"] == 1 * MiB  # the floor, not 256 MiB
    for i in range(3):
        space.put(f"y{i}", torch.zeros(MiB // 4)).result()  # 1 MiB each: the arena doubles
    assert space.stats()["arena_bytes"] == 4 * MiB


def test_close_shrinks_the_arena_to_the_end_of_its_last_tensor(open_space, dirs):
    (path,) = dirs(1)
    arena = os.path.join(path, "rank0", "arena-0.bin")
    space = open_space(paths=[path], grow_step=64 * MiB)
    t = torch.arange(3 * MiB, dtype=torch.float32)  # 12 MiB
    space.put("big", t).result()
    space.put("small", torch.ones(10)).result()
    assert os.path.getsize(arena) >= 16 * MiB
    space.delete("big")  # freed: the end of the arena is now "small"'s
    space.put("small", torch.ones(10)).result()
    end = max(e.offset + 4096 for e in space.info("small").extents)
    space.close()
    assert os.path.getsize(arena) == end
    assert _disk_bytes(arena) <= end
    manifest = json.load(open(os.path.join(path, "rank0", "manifest.json")))
    assert manifest["files"][0]["size"] == end
    reopened = open_space(paths=[path])  # resumes over the shrunk file and grows it again
    assert torch.equal(reopened.get("small", torch.empty(10)).result(), torch.ones(10))
    reopened.put("big", t).result()
    assert torch.equal(reopened.get("big", torch.empty_like(t)).result(), t)


def test_an_empty_space_closes_to_an_empty_arena(open_space, dirs):
    (path,) = dirs(1)
    space = open_space(paths=[path])
    space.put("x", torch.ones(100)).result()
    space.delete("x")
    space.close()
    assert _disk_bytes(os.path.join(path, "rank0", "arena-0.bin")) == 0


def test_keep_false_removes_what_the_space_made_and_nothing_else(open_space, dirs, tmp_path):
    (kept,) = dirs(1)
    made = str(tmp_path / "made")  # missing: the space creates it
    with open(os.path.join(kept, "notes.txt"), "w") as f:
        f.write("the user's")
    space = open_space(paths=[kept, made], keep=False)
    space.put("x", torch.ones(10_000)).result()
    space.close()
    assert os.listdir(kept) == ["notes.txt"]
    assert not os.path.exists(made)


def test_keep_false_leaves_foreign_files_and_their_directory(open_space, dirs):
    (path,) = dirs(1)
    os.makedirs(os.path.join(path, "rank0"))
    with open(os.path.join(path, "rank0", "mine.txt"), "w") as f:
        f.write("x")
    space = open_space(paths=[path], keep=False, allow_foreign=True)
    space.put("x", torch.ones(10)).result()
    space.close()
    assert os.listdir(os.path.join(path, "rank0")) == ["mine.txt"]


def test_a_space_opened_after_one_closed_with_keep_false_holds_its_lock(open_space, dirs):
    (path,) = dirs(1)
    open_space(paths=[path], keep=False).close()
    second = open_space(paths=[path])
    with pytest.raises(RuntimeError, match="in use by another swap space"):
        open_space(paths=[path])
    second.close()

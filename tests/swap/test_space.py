"""SwapSpace: round trips, placement, reuse, reopening, crash safety, corruption, guards."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import infinity.swap as swap
from infinity.swap import _manifest

from ._common import sigint_at_line

MiB = 1 << 20

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]


def _random(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


@pytest.mark.parametrize("n_dirs", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (0, 5), (1,), (1023,), (4096,), (3, 1001), (3 * MiB + 7,)], ids=str)
def test_round_trip(open_space, n_dirs, dtype, shape):
    """Every dtype, 0-d and empty tensors, and sizes whose tail is not a whole 4 KiB unit."""
    space = open_space(n_dirs, stripe_threshold=1 * MiB)
    t = _random(shape, dtype)
    space.put("t/param", t).result()
    out = space.get("t/param", torch.empty_like(t)).result()
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, t)
    with space.get("t/param").result() as buf:  # into a pool buffer
        assert torch.equal(buf.view(dtype, t.shape), t)


def test_striped_tensor_is_split_over_every_directory(open_space):
    space = open_space(3, stripe_threshold=1 * MiB, stripe_size=1 * MiB)
    t = _random((10 * MiB // 4 + 3,), torch.float32)
    space.put("big/param", t).result()
    extents = space.info("big/param").extents
    assert [e.file for e in extents] == [0, 1, 2]
    assert all(e.nbytes % (1 * MiB) == 0 for e in extents[:-1])  # whole stripe units but the last
    assert sum(e.nbytes for e in extents) == t.numel() * 4
    assert torch.equal(space.get("big/param", torch.empty_like(t)).result(), t)


def test_small_tensors_go_where_there_is_least_data(open_space):
    space = open_space(2, stripe_threshold=64 * MiB)
    for i in range(8):
        space.put(f"p{i}/param", torch.zeros(1000)).result()
    files = [space.info(f"p{i}/param").extents[0].file for i in range(8)]
    assert files.count(0) == files.count(1) == 4


def test_unaligned_tensor_memory_round_trips(open_space):
    """A tensor whose data does not start on an O_DIRECT boundary goes through staging."""
    space = open_space()
    base = _random((1 * MiB + 100,), torch.int64).view(torch.uint8)
    t = base[3 : 3 + 5 * 4096 + 11]  # odd address, odd length
    assert t.data_ptr() % 512
    space.put("u/param", t).result()
    out = torch.empty(t.shape, dtype=torch.uint8)[:]
    out_unaligned = torch.empty(t.numel() + 1, dtype=torch.uint8)[1:]
    assert torch.equal(space.get("u/param", out).result(), t)
    assert torch.equal(space.get("u/param", out_unaligned).result(), t)


def test_non_contiguous_tensor_is_refused(open_space):
    with pytest.raises(ValueError, match="contiguous"):
        open_space().put("x", torch.zeros(8, 8).t())


def test_get_into_wrong_shape_is_refused(open_space):
    space = open_space()
    space.put("x", torch.zeros(8)).result()
    with pytest.raises(ValueError, match=r"out is torch.float32 \(9,\), tensor 'x' is torch.float32 \(8,\)"):
        space.get("x", torch.zeros(9))


def test_unknown_name_raises_key_error(open_space):
    space = open_space()
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        space.get("nope")
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        space.delete("nope")


def test_rewriting_every_step_does_not_grow_the_arena(open_space):
    """DeepSpeed names swap files by id() and they grow run after run; names here are stable
    and freed space is reused."""
    space = open_space(2, stripe_threshold=2 * MiB, grow_step=4 * MiB)
    sizes = [3000, 1 * MiB + 5, 3 * MiB, 70_000, 8]

    def step(seed):
        for i, n in enumerate(sizes):
            space.put(f"m{i}/exp_avg", _random((n,), torch.float32, seed + i)).result()

    step(0)
    after_first = space.stats()["arena_bytes"]
    for s in range(1, 30):
        step(s)
        if s % 3 == 0:  # sizes change too: delete and re-put elsewhere
            space.delete("m0/exp_avg")
            space.put("m0/exp_avg", _random((5000 + s,), torch.float32)).result()
    assert space.stats()["arena_bytes"] == after_first
    assert torch.equal(space.get("m2/exp_avg", torch.empty(3 * MiB)).result(), _random((3 * MiB,), torch.float32, 29 + 2))


def test_delete_frees_space_for_reuse(open_space):
    space = open_space(grow_step=4 * MiB)
    space.put("a", torch.zeros(MiB // 4)).result()
    used = space.stats()["allocated_bytes"]
    space.delete("a")
    assert space.stats()["allocated_bytes"] == 0
    space.put("b", torch.zeros(MiB // 4)).result()
    assert space.stats()["allocated_bytes"] == used
    assert space.names() == ["b"]


def test_reopening_resumes_the_space(open_space, dirs):
    paths = dirs(2)
    tensors = {f"l{i}.weight/param": _random((i * 10007 + 1,), torch.bfloat16, i) for i in range(6)}
    space = open_space(paths=paths, stripe_threshold=64 * 1024, verify="always")
    for name, t in tensors.items():
        space.put(name, t)
    space.close()
    space = open_space(paths=paths, stripe_threshold=64 * 1024, verify="always")
    assert sorted(space.names()) == sorted(tensors)
    for name, t in tensors.items():
        assert torch.equal(space.get(name, torch.empty_like(t)).result(), t)
    # New writes go into free space, never over what the manifest holds.
    space.put("new/param", torch.ones(50_000)).result()
    for name, t in tensors.items():
        assert torch.equal(space.get(name, torch.empty_like(t)).result(), t)
    assert space.info("l1.weight/param").generation == 1


def test_directories_in_another_order_are_refused(open_space, dirs):
    a, b = dirs(2)
    open_space(paths=[a, b]).close()
    with pytest.raises(swap.ManifestError, match="no manifest|original order"):
        open_space(paths=[b, a])


def test_crash_before_the_manifest_rename_keeps_the_old_manifest(open_space, dirs, monkeypatch):
    (path,) = dirs(1)
    space = open_space(paths=[path])
    old = torch.arange(10_000, dtype=torch.float32)
    space.put("w/param", old).result()
    space.flush()

    def crash(src, dst):
        raise OSError(5, "simulated crash before rename")

    space.put("v/param", torch.ones(10)).result()
    monkeypatch.setattr(_manifest.os, "rename", crash)
    with pytest.raises(OSError, match="simulated crash"):
        space.flush()
    monkeypatch.undo()
    manifest = _manifest.load_manifest(os.path.join(path, "rank0", "manifest.json"))
    assert sorted(manifest.tensors) == ["w/param"]  # the previous manifest, intact
    space._release()  # the process "dies": no final flush
    space._closed = True
    reopened = open_space(paths=[path])
    assert reopened.names() == ["w/param"]
    assert torch.equal(reopened.get("w/param", torch.empty(10_000)).result(), old)


def test_corruption_is_found_on_get_with_verify_always(open_space, dirs):
    (path,) = dirs(1)
    space = open_space(paths=[path], verify="always")
    t = _random((50_000,), torch.float32)
    space.put("w/param", t).result()
    space.flush()
    extent = space.info("w/param").extents[0]
    arena = os.path.join(path, "rank0", "arena-0.bin")
    with open(arena, "r+b") as f:
        f.seek(extent.offset + 1234)
        byte = f.read(1)
        f.seek(extent.offset + 1234)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(swap.SwapCorruption) as info:
        space.get("w/param", torch.empty_like(t)).result()
    err = info.value
    assert isinstance(err, OSError)
    assert err.tensor == "w/param" and err.filename == arena and err.offset == extent.offset
    assert "w/param" in str(err) and arena in str(err)


@pytest.mark.parametrize("verify", swap.VERIFY_MODES)
def test_every_put_records_a_checksum_whatever_verify_says(open_space, dirs, verify):
    (path,) = dirs(1)
    space = open_space(paths=[path], verify=verify)
    space.put("a", torch.zeros(10)).result()
    space.put("b", torch.zeros(10), checksum=True).result()  # the old way of asking: still fine
    space.put("empty", torch.zeros(0)).result()
    space.flush()
    data = json.load(open(os.path.join(path, "rank0", "manifest.json")))
    assert data["version"] == 2
    assert all(t["checksum"].startswith("xxh3-64:") for t in data["tensors"].values())


def test_a_put_without_a_checksum_is_refused(open_space):
    with pytest.raises(ValueError, match="checksum=False: every put records"):
        open_space().put("a", torch.zeros(10), checksum=False)


@pytest.mark.parametrize("verify", ["off", "checkpoint"])
def test_get_checks_the_checksum_when_asked_or_under_verify_always(open_space, dirs, verify):
    (path,) = dirs(1)
    space = open_space(paths=[path], verify=verify)
    t = _random((50_000,), torch.float32)
    space.put("w/param", t).result()
    space.flush()
    _flip(os.path.join(path, "rank0", "arena-0.bin"), space.info("w/param").extents[0].offset + 99)
    space.get("w/param", torch.empty_like(t)).result()  # not checked under off and checkpoint
    with pytest.raises(swap.SwapCorruption, match="w/param"):
        space.get("w/param", torch.empty_like(t), verify=True).result()


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_fresh_removes_only_the_space_files(open_space, dirs):
    (path,) = dirs(1)
    open_space(paths=[path]).close()
    mine = os.path.join(path, "user-notes.txt")  # the user's own file beside the rank directory
    with open(mine, "w") as f:
        f.write("keep me")
    space = open_space(paths=[path], fresh=True)
    assert space.names() == []
    assert open(mine).read() == "keep me"
    assert sorted(os.listdir(os.path.join(path, "rank0"))) == [".lock", "arena-0.bin", "manifest.json", "space.json"]


def test_foreign_files_in_the_rank_directory_are_an_error(open_space, dirs):
    (path,) = dirs(1)
    os.makedirs(os.path.join(path, "rank0"))
    with open(os.path.join(path, "rank0", "thesis.tex"), "w") as f:
        f.write("x")
    with pytest.raises(ValueError, match="thesis.tex"):
        open_space(paths=[path])
    assert open_space(paths=[path], allow_foreign=True).names() == []


def test_a_directory_in_use_is_refused(open_space, dirs):
    (path,) = dirs(1)
    open_space(paths=[path])
    with pytest.raises(RuntimeError, match=rf"in use by another swap space of this process \({os.getpid()}\)"):
        open_space(paths=[path])


def test_a_missing_directory_whose_parent_exists_is_created_private(open_space, tmp_path):
    space = open_space(paths=[str(tmp_path / "swap")])
    space.put("x", torch.zeros(10)).result()
    assert os.stat(tmp_path / "swap").st_mode & 0o777 == 0o700


def test_a_missing_parent_is_an_error_naming_it(open_space, tmp_path):
    parent = str(tmp_path / "not-mounted")
    with pytest.raises(ValueError, match=rf"nor does its parent '{re.escape(parent)}'"):
        open_space(paths=[os.path.join(parent, "swap")])
    assert not os.path.exists(parent)


def test_files_and_directories_are_private(open_space, dirs):
    (path,) = dirs(1)
    open_space(paths=[path]).put("x", torch.zeros(10)).result()
    rank_dir = os.path.join(path, "rank0")
    assert os.stat(rank_dir).st_mode & 0o777 == 0o700
    for name in os.listdir(rank_dir):
        assert os.stat(os.path.join(rank_dir, name)).st_mode & 0o777 == 0o600, name


def test_a_failed_write_forgets_the_name_and_says_why(open_space, monkeypatch):
    space = open_space()
    space.put("x", torch.zeros(4096)).result()
    real = space.engine.pwrite

    def failing(buffer, file, offset):
        return real(buffer, os.open("/dev/null", os.O_RDONLY), offset)  # EBADF on write

    monkeypatch.setattr(space.engine, "pwrite", failing)
    fut = space.put("x", torch.ones(4096))
    with pytest.raises(OSError) as info:
        fut.result()
    assert info.value.errno == 9
    monkeypatch.undo()
    with pytest.raises(KeyError, match="last write failed"):
        space.info("x")
    space.put("x", torch.ones(4096)).result()  # the space still works
    assert torch.equal(space.get("x", torch.empty(4096)).result(), torch.ones(4096))


def test_read_after_write_without_waiting(open_space):
    """The engine does not order requests; the space does, per name."""
    space = open_space()
    t = _random((2 * MiB,), torch.float32)
    space.put("x", t)  # not waited
    assert torch.equal(space.get("x", torch.empty_like(t)).result(), t)


def test_a_name_whose_write_is_in_flight_is_there(open_space, monkeypatch):
    """info and `in` finish the name's write first: a store that fills a buffer shaped from
    info while the same name's write is behind (the one-copy master weights, written under
    the parameters' own names, then the parameters: a checkpoint load) finds the name."""
    space = open_space()
    space.put("x", torch.zeros(4096)).result()
    space.put("x", torch.ones(8192))  # not waited
    assert "x" in space
    assert space.info("x").shape == (8192,)
    space.put("y", torch.ones(4096))  # the first write of a name
    assert space.info("y").nbytes == 4 * 4096
    real = space.engine.pwrite
    monkeypatch.setattr(space.engine, "pwrite", lambda b, f, o: real(b, os.open("/dev/null", os.O_RDONLY), o))
    fut = space.put("x", torch.zeros(8192))
    monkeypatch.undo()
    assert "x" not in space  # its write failed: gone, and info says why
    with pytest.raises(KeyError, match="last write failed"):
        space.info("x")
    with pytest.raises(OSError):
        fut.result()  # the error stays with the write's owner


def test_manifest_lists_what_was_written(open_space, dirs):
    (path,) = dirs(1)
    space = open_space(paths=[path], verify="always")
    space.put("enc.layers.0.weight/param", torch.zeros(3, 5, dtype=torch.float16)).result()
    space.flush()
    data = json.load(open(os.path.join(path, "rank0", "manifest.json")))
    assert data["format"] == "infinity-swap" and data["version"] == 2
    entry = data["tensors"]["enc.layers.0.weight/param"]
    assert entry["dtype"] == "float16" and entry["shape"] == [3, 5] and entry["nbytes"] == 30
    assert entry["checksum"].startswith("xxh3-64:")
    assert swap.SpaceReader(os.path.join(path, "rank0")).info("enc.layers.0.weight/param").kind == "param"


def test_a_truncated_arena_file_is_refused_on_reopen(open_space, dirs):
    (path,) = dirs(1)
    space = open_space(paths=[path])
    space.put("x", torch.zeros(MiB)).result()
    space.close()
    arena = os.path.join(path, "rank0", "arena-0.bin")
    os.truncate(arena, 12345)
    with pytest.raises(swap.ManifestError, match="truncated or changed outside the space"):
        open_space(paths=[path])


@pytest.mark.parametrize("op", ["put", "rename"])
def test_a_ctrl_c_at_any_line_of_put_or_rename_never_leaves_a_name_on_another_tensors_bytes(tmp_path, op):
    """SIGINT raised at each line of `put` (a rewrite at another size: new extents, the old
    freed) or `rename`, caught as a training loop catches it: a name is then its own value or
    gone, never another's. Freed before it was forgotten, a name stayed on free space that the
    next tensor took, and read back that tensor's bytes (silently with verify="off"; an audit
    helper's repro)."""
    code = getattr(swap.SwapSpace, op).__code__
    k = 1
    while True:
        space = swap.SwapSpace(str(tmp_path / f"s{k}"), verify="off")
        space.put("a", torch.full((1024,), 1.0)).result()
        space.put("b", torch.full((512,), 3.0)).result()
        try:
            with sigint_at_line(k, lambda c: c is code) as seen:
                if op == "put":
                    space.put("a", torch.full((2048,), 2.0)).result()
                else:
                    space.rename("b", "a")
        except KeyboardInterrupt:
            pass
        space.put("c", torch.full((1024,), 7.0)).result()  # takes the room a freed
        want = {"a": {1.0, 2.0, 3.0}, "b": {3.0}, "c": {7.0}}
        for name in space.names():
            shape = space.info(name).shape
            got = space.get(name, torch.empty(shape)).result()
            assert set(got.unique().tolist()) <= want[name], (k, name)
        space.close()
        if seen[0] < k:
            break
        k += 1
    assert k > 10

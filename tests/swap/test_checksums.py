"""Checksums are part of the record: a manifest of this version without one is damage, and an
older manifest without them opens only for a reader that accepts unchecked tensors."""

from __future__ import annotations

import json
import os

import pytest
import torch

import infinity.swap as swap


def _space_with(open_space, dirs, tensors: dict[str, torch.Tensor]) -> str:
    (path,) = dirs(1)
    space = open_space(paths=[path])
    for name, t in tensors.items():
        space.put(name, t).result()
    space.close()
    return os.path.join(path, "rank0")


def _edit_manifest(rank_dir: str, edit) -> None:
    path = os.path.join(rank_dir, "manifest.json")
    data = json.load(open(path))
    edit(data)
    with open(path, "w") as f:
        json.dump(data, f)


def _null_checksum(name: str, version: int):
    def edit(data):
        data["version"] = version
        data["tensors"][name]["checksum"] = None

    return edit


def test_a_manifest_of_this_version_without_a_checksum_is_refused_naming_the_tensor(open_space, dirs):
    rank_dir = _space_with(open_space, dirs, {"0/param": torch.ones(100), "1/param": torch.zeros(7)})
    _edit_manifest(rank_dir, _null_checksum("1/param", 2))
    manifest = os.path.join(rank_dir, "manifest.json")
    expected = rf"{manifest}: tensors\['1/param'\]\.checksum: missing: a version-2 manifest records a checksum"
    with pytest.raises(swap.ManifestError, match=expected):
        swap.SpaceReader(rank_dir)
    with pytest.raises(swap.ManifestError, match=expected):
        swap.SpaceReader(rank_dir, allow_unchecked=True)  # accepting version 1's gaps is not accepting damage
    with pytest.raises(swap.ManifestError, match=expected):
        open_space(paths=[os.path.dirname(rank_dir)])  # the space does not resume over it either


def test_a_version_1_manifest_without_checksums_opens_only_where_accepted(open_space, dirs):
    t = torch.arange(50, dtype=torch.float32)
    rank_dir = _space_with(open_space, dirs, {"0/param": t, "1/param": torch.zeros(7)})
    _edit_manifest(rank_dir, _null_checksum("0/param", 1))
    with pytest.raises(swap.ManifestError, match=r"tensors\['0/param'\]\.checksum: none recorded \(a version-1"):
        swap.SpaceReader(rank_dir)
    with pytest.raises(swap.ManifestError, match=r"'0/param'.*version-1"):
        open_space(paths=[os.path.dirname(rank_dir)])
    with swap.SpaceReader(rank_dir, allow_unchecked=True) as reader:
        assert reader.manifest.version == 1 and reader.manifest.unchecked() == ["0/param"]
        assert torch.equal(reader.read("0/param", verify=True), t)  # nothing to check it against


def test_fresh_starts_over_a_version_1_manifest_without_checksums(open_space, dirs):
    rank_dir = _space_with(open_space, dirs, {"0/param": torch.ones(100)})
    _edit_manifest(rank_dir, _null_checksum("0/param", 1))
    space = open_space(paths=[os.path.dirname(rank_dir)], fresh=True)
    assert space.names() == []


def test_a_version_1_manifest_with_checksums_resumes_and_is_written_as_version_2(open_space, dirs):
    t = torch.arange(50, dtype=torch.float32)
    rank_dir = _space_with(open_space, dirs, {"0/param": t})
    _edit_manifest(rank_dir, lambda data: data.update(version=1))
    space = open_space(paths=[os.path.dirname(rank_dir)], verify="always")
    assert torch.equal(space.get("0/param", torch.empty_like(t)).result(), t)
    space.close()
    assert json.load(open(os.path.join(rank_dir, "manifest.json")))["version"] == 2


def test_space_json_keeps_version_1(open_space, dirs):
    rank_dir = _space_with(open_space, dirs, {})
    assert json.load(open(os.path.join(rank_dir, "space.json")))["version"] == 1


def test_a_short_arena_read_names_the_tensor_the_file_and_the_offsets(open_space, dirs):
    """What a checkpoint load meets on a truncated arena (SpaceReader does not check sizes)."""
    rank_dir = _space_with(open_space, dirs, {"a/param": torch.ones(1024), "b/param": torch.ones(3000)})
    reader = swap.SpaceReader(rank_dir)
    extent = reader.info("b/param").extents[0]
    arena = os.path.join(rank_dir, "arena-0.bin")
    os.truncate(arena, extent.offset + 4096)
    with pytest.raises(OSError) as info:
        reader.read("b/param", verify=True)
    reader.close()
    e = info.value
    assert e.filename == arena
    # One request or two (the tail unit staged when the memory is aligned): either starts here.
    assert "tensor 'b/param'" in str(e) and f"at offset {extent.offset} (to " in str(e)
    assert f"the file ends at byte {extent.offset + 4096}" in str(e)
    assert "shorter than its manifest says" in str(e)


def test_a_truncated_arena_on_reopen_names_a_tensor_it_held(open_space, dirs):
    rank_dir = _space_with(open_space, dirs, {"a/param": torch.ones(1024), "b/param": torch.ones(3000)})
    os.truncate(os.path.join(rank_dir, "arena-0.bin"), 4096)
    with pytest.raises(swap.ManifestError, match=r"truncated .*tensor 'b/param' \(bytes 4096 to 16096\) lies past its end"):
        open_space(paths=[os.path.dirname(rank_dir)])

"""The manifest: what a loader refuses, and the atomic write."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import infinity.swap as swap
from infinity.swap import _manifest


@pytest.fixture
def manifest_data(open_space, dirs):
    (path,) = dirs(1)
    space = open_space(paths=[path])
    space.put("a/param", torch.zeros(5000)).result()
    space.put("b/exp_avg", torch.zeros(3)).result()
    space.flush()
    return _manifest.read_json(os.path.join(path, "rank0", "manifest.json"))


def test_a_good_manifest_loads(manifest_data):
    m = swap.Manifest.from_json(manifest_data, "m")
    assert sorted(m.tensors) == ["a/param", "b/exp_avg"]
    assert m.tensors["a/param"].extents[0].nbytes == 20000
    assert swap.Manifest.from_json(m.to_json(), "again").to_json() == m.to_json()


def _edit(data, fn):
    data = copy.deepcopy(data)
    fn(data)
    return data


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda d: d.update(version=99), "version"),
        (lambda d: d.update(format="deepspeed"), "format"),
        (lambda d: d["files"][0].update(name="../../etc/passwd"), "files[0].name"),
        (lambda d: d["files"][0].update(name="/etc/passwd"), "files[0].name"),
        (lambda d: d["files"][0].update(name="sub/arena-0.bin"), "files[0].name"),
        (lambda d: d["files"][0].update(dir=5), "files[0].dir"),
        (lambda d: d.update(members=["relative/dir"]), "members"),
        (lambda d: d.update(members=["/a/../b"]), "members"),
        (lambda d: d["tensors"]["a/param"].update(dtype="float128"), "dtype"),
        (lambda d: d["tensors"]["a/param"].update(nbytes=4), "nbytes"),
        (lambda d: d["tensors"]["a/param"].update(shape=[-1]), "shape"),
        (lambda d: d["tensors"]["a/param"]["extents"][0].__setitem__(1, 100), "extents[0]"),
        (lambda d: d["tensors"]["a/param"]["extents"][0].__setitem__(0, 7), "extents[0]"),
        (lambda d: d["tensors"]["a/param"].update(checksum="md5:abc"), "checksum"),
        (lambda d: d.update(alignment=3000), "alignment"),
        (lambda d: d.pop("space_id"), "space_id"),
        (lambda d: d.update(rank="0"), "rank"),
    ],
)
def test_an_untrustworthy_manifest_is_refused(manifest_data, edit, key):
    with pytest.raises(swap.ManifestError, match=key.replace("[", r"\[").replace("]", r"\]")):
        swap.Manifest.from_json(_edit(manifest_data, edit), "m.json")


def test_opening_a_space_with_an_escaping_manifest_is_refused(open_space, dirs):
    (path,) = dirs(1)
    open_space(paths=[path]).close()
    mpath = os.path.join(path, "rank0", "manifest.json")
    data = _manifest.read_json(mpath)
    data["files"][0]["name"] = "../../../etc/shadow"
    _manifest.write_json_atomic(mpath, data)
    with pytest.raises(swap.ManifestError, match="outside its directory"):
        open_space(paths=[path])
    with pytest.raises(swap.ManifestError, match="outside its directory"):
        swap.SpaceReader(os.path.join(path, "rank0"))


def test_not_json_is_refused(tmp_path):
    p = tmp_path / "manifest.json"
    p.write_text("{not json")
    with pytest.raises(swap.ManifestError, match="not valid JSON"):
        _manifest.load_manifest(str(p))


def test_atomic_write_leaves_the_old_file_when_interrupted(tmp_path):
    path = str(tmp_path / "m.json")
    _manifest.write_json_atomic(path, {"v": 1})

    def crash(tmp):
        raise KeyboardInterrupt  # killed between fsync and rename

    with pytest.raises(KeyboardInterrupt):
        _manifest.write_json_atomic(path, {"v": 2}, before_rename=crash)
    assert _manifest.read_json(path) == {"v": 1}
    assert os.listdir(tmp_path) == ["m.json"]  # the temporary file is gone too
    assert os.stat(path).st_mode & 0o777 == 0o600

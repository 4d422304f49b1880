"""The manifest: what a loader refuses, and the atomic write."""

from __future__ import annotations

import copy
import os
import re

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


# -- read_json: what every reader of the swap and checkpoint formats parses with ---------------
def _closed_space(open_space, dirs) -> str:
    (path,) = dirs(1)
    open_space(paths=[path]).close()
    return path


@pytest.mark.parametrize("name", [swap.MANIFEST_NAME, swap.SPACE_NAME])
def test_bytes_that_are_not_utf8_are_refused_naming_the_file_and_offset(open_space, dirs, name):
    path = _closed_space(open_space, dirs)
    file = os.path.join(path, "rank0", name)
    with open(file, "rb") as f:
        raw = f.read()
    at = raw.index(b'"space_id"') + 1
    with open(file, "wb") as f:
        f.write(raw[:at] + b"\xff" + raw[at + 1 :])
    with pytest.raises(swap.ManifestError, match=rf"^{re.escape(file)}: not UTF-8: byte 0xff at offset {at}$"):
        open_space(paths=[path])  # what the engine's resume opens


def test_a_key_twice_is_refused(open_space, dirs):
    """json keeps the last of two equal keys; a tampered manifest could hide a value behind it."""
    path = _closed_space(open_space, dirs)
    file = os.path.join(path, "rank0", swap.MANIFEST_NAME)
    with open(file) as f:
        text = f.read()
    with open(file, "w") as f:
        f.write(text.replace("{", '{"rank":1,', 1))
    with pytest.raises(swap.ManifestError, match=rf"^{re.escape(file)}: key 'rank' appears twice in one object$"):
        open_space(paths=[path])


@pytest.mark.parametrize("depth", [_manifest.MAX_JSON_DEPTH + 1, 100_000])  # the limit; past the recursion limit
def test_nesting_deeper_than_the_limit_is_refused(tmp_path, depth):
    p = tmp_path / "manifest.json"
    p.write_text('{"a":' + "[" * (depth - 1) + "]" * (depth - 1) + "}")
    limit = _manifest.MAX_JSON_DEPTH
    with pytest.raises(swap.ManifestError, match=f"manifest.json: nested more than {limit} levels deep"):
        _manifest.load_manifest(str(p))


def test_nesting_up_to_the_limit_reads_and_brackets_in_strings_do_not_count(tmp_path):
    p = tmp_path / "m.json"
    inner = '"[[[{{ \\" [[["'  # brackets and an escaped quote inside a string
    p.write_text('{"a":' + "[" * (_manifest.MAX_JSON_DEPTH - 1) + inner + "]" * (_manifest.MAX_JSON_DEPTH - 1) + "}")
    data = _manifest.read_json(str(p))
    for _ in range(_manifest.MAX_JSON_DEPTH):
        data = data["a"] if isinstance(data, dict) else data[0]
    assert data == '[[[{{ " [[['


def test_invalid_json_names_the_line_and_column(tmp_path):
    p = tmp_path / "manifest.json"
    p.write_text('{\n  "format": "infinity-swap",\n  "version": 1,\n}\n')
    with pytest.raises(swap.ManifestError, match=r"manifest.json: not valid JSON: .* \(at line 4, column 1\)$"):
        _manifest.load_manifest(str(p))


def test_a_fifo_is_refused_not_waited_on(tmp_path, no_hang):
    fifo = tmp_path / "meta.json"  # meta.json has no loader of its own: read_json guards it
    os.mkfifo(fifo)
    with pytest.raises(swap.ManifestError, match=r"meta.json: is a FIFO.*, not a regular file"):
        _manifest.read_json(str(fifo))

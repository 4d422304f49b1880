"""Engine.export: one safetensors file that a fresh, unwrapped model loads strictly.

Tolerances: the file holds the engine's fp32 master weights (cast to each parameter's dtype),
so against `Engine.gathered_weights` the comparison is exact. Against plain torch.optim.AdamW
(same model, data and seed) it is 1e-6: the engine's fused AdamW and torch's default kernel
differ by float rounding, a few ULPs of weights of magnitude ~1 after three steps.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import socket
import struct
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

import infinity

sys.path.insert(0, os.path.dirname(__file__))
from _common import rank_env  # noqa: E402

safetensors_torch = pytest.importorskip("safetensors.torch")

PLACEMENTS = {"device": ("device",) * 3, "nvme": ("nvme",) * 3, "nvme-params-cpu-optimizer": ("nvme", "nvme", "cpu")}


class _Tied(nn.Module):
    """An embedding tied to the output head, a persistent fp32 buffer, a persistent 0-dim int64
    one and a non-persistent one (not in the state dict, so not in the file)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))
        self.register_buffer("version", torch.tensor(7))
        self.register_buffer("mask", torch.arange(16) % 5 != 0, persistent=False)

    def forward(self, ids):
        h = self.block(self.embed(ids))
        return self.head((h * self.scale.to(h.dtype)).masked_fill(~self.mask, 0))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))


MODELS = {"mlp": _mlp, "tied": _Tied}


def open_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _loss(kind, model, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(step)
    if kind == "mlp":
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        return ((model(x.to(dtype)).float() - y) ** 2).mean()
    ids = torch.randint(0, 32, (4, 8), generator=g)
    target = torch.randint(0, 32, (4, 8), generator=g)
    return nn.functional.cross_entropy(model(ids).float().flatten(0, 1), target.flatten())


def _engine(tmp_path, model, placement="nvme", param_dtype="fp32"):
    """The engine's default optimizer config: the export is what is tested, not the step."""
    params, grads, optimizer = PLACEMENTS[placement]
    (tmp_path / "swap").mkdir(exist_ok=True)
    return infinity.initialize(model, {"tiers": {"params": params, "grads": grads, "optimizer": optimizer},
                                       "nvme": {"paths": [str(tmp_path / "swap")], "grow_step": "4MiB"},
                                       "precision": {"param_dtype": param_dtype}})  # fmt: skip


def _trained(tmp_path, kind, placement="nvme", param_dtype="fp32", steps=3):
    torch.manual_seed(0)
    model = MODELS[kind]()
    initial = copy.deepcopy(model)
    engine = _engine(tmp_path, model, placement, param_dtype)
    for step in range(steps):
        engine.backward(_loss(kind, engine, step, engine.dtype))
        engine.step()
    return engine, initial


@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", MODELS)
def test_a_fresh_model_loads_the_export_strictly_with_the_engines_weights(tmp_path, kind, placement, param_dtype):
    engine, _ = _trained(tmp_path, kind, placement, param_dtype)
    path = engine.export(tmp_path / "model.safetensors")
    gathered = engine.gathered_weights()
    tensors = safetensors_torch.load_file(path)
    fresh = MODELS[kind]()
    fresh.load_state_dict(tensors)  # strict
    for name, p in fresh.named_parameters():  # tied: once, under the owner's name, as gathered
        assert torch.equal(tensors[name], gathered[name].to(tensors[name].dtype)), name
        assert torch.equal(p.detach(), tensors[name].to(p.dtype)), name
    for name, buf in engine.module.state_dict().items():
        if name not in gathered and "head.weight" not in name:  # persistent buffers, as they are
            assert tensors[name].dtype == buf.dtype and torch.equal(tensors[name], buf.cpu()), name
    if kind == "tied":
        assert "mask" not in tensors and tensors["version"].item() == 7
        assert torch.equal(tensors["head.weight"], tensors["embed.weight"])
    engine.close()


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", MODELS)
def test_the_export_reproduces_plain_pytorch_training(tmp_path, kind, placement):
    engine, initial = _trained(tmp_path, kind, placement)
    opt_cfg = engine.config.optimizer
    opt = torch.optim.AdamW(initial.parameters(), lr=opt_cfg.lr, betas=opt_cfg.betas, eps=opt_cfg.eps,
                            weight_decay=opt_cfg.weight_decay)  # fmt: skip
    fresh = copy.deepcopy(initial)
    for step in range(3):
        opt.zero_grad()
        _loss(kind, initial, step).backward()
        opt.step()
    fresh.load_state_dict(safetensors_torch.load_file(engine.export(tmp_path / "m.safetensors")))
    for (name, p), ref in zip(fresh.named_parameters(), initial.parameters()):
        torch.testing.assert_close(p.detach(), ref.detach(), atol=1e-6, rtol=0, msg=name)
    engine.close()


@pytest.mark.parametrize("placement", ["device", "nvme"])
def test_parameters_are_written_in_their_original_dtype_under_bf16(tmp_path, placement):
    engine, _ = _trained(tmp_path, "mlp", placement, "bf16")
    tensors = safetensors_torch.load_file(engine.export(tmp_path / "m.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    engine.close()


def test_a_model_made_in_bf16_is_written_in_bf16(tmp_path):
    torch.manual_seed(0)
    engine = _engine(tmp_path, _mlp().to(torch.bfloat16), param_dtype="bf16")
    tensors = safetensors_torch.load_file(engine.export(tmp_path / "m.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    engine.close()


def test_gpt2_loads_strictly_and_computes_the_engines_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    engine = _engine(tmp_path, transformers.GPT2LMHeadModel(cfg))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    fresh = transformers.GPT2LMHeadModel(cfg).eval()
    fresh.load_state_dict(safetensors_torch.load_file(engine.export(tmp_path / "gpt2.safetensors")))
    engine.eval()
    with torch.no_grad():
        expected = engine(input_ids=ids).logits
        torch.testing.assert_close(fresh(input_ids=ids).logits, expected, atol=1e-6, rtol=0)
    engine.close()


def test_the_header_is_aligned_and_describes_contiguous_data(tmp_path):
    engine, _ = _trained(tmp_path, "tied", steps=1)
    path = engine.export(tmp_path / "m.safetensors")
    with safetensors_torch.safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", "producer": "infinity"}
        assert set(f.keys()) == set(engine.module.state_dict())
    raw = open_bytes(path)
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0 and raw[8 + n - 1 : 8 + n] in (b"}", b" ")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__")
    assert list(header) == list(engine.module.state_dict())  # data in the state dict's order
    end = 0
    for key, entry in header.items():
        begin, stop = entry["data_offsets"]
        itemsize = {"F32": 4, "I64": 8}[entry["dtype"]]
        assert begin == end and stop - begin == itemsize * torch.Size(entry["shape"]).numel(), key
        end = stop
    assert 8 + n + end == len(raw)
    engine.close()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_file_mode_honours_the_umask(tmp_path, umask):
    engine, _ = _trained(tmp_path, "mlp", steps=1)
    old = os.umask(umask)
    try:
        path = engine.export(tmp_path / "m.safetensors")
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask
    engine.close()


def test_a_relative_path_is_returned_absolute_and_an_existing_file_replaced(tmp_path, monkeypatch):
    engine, _ = _trained(tmp_path, "mlp", steps=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "m.safetensors").write_bytes(b"an older export")
    monkeypatch.chdir(out)
    assert engine.export("m.safetensors") == str(out / "m.safetensors")
    assert os.listdir(out) == ["m.safetensors"]
    safetensors_torch.load_file(out / "m.safetensors")
    engine.close()


def test_one_line_is_logged_with_the_size(tmp_path, caplog):
    engine, _ = _trained(tmp_path, "mlp", steps=1)
    with caplog.at_level("INFO", logger="infinity"):
        path = engine.export(tmp_path / "m.safetensors")
    lines = [r.getMessage() for r in caplog.records if r.name == "infinity"]
    assert len(lines) == 1 and lines[0].startswith(f"exported {path}: {os.path.getsize(path) / 1e6:.1f} MB in ")
    engine.close()


def test_a_failed_export_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    engine, _ = _trained(tmp_path, "mlp", steps=1)
    out = tmp_path / "out"
    out.mkdir()
    old = os.urandom(4096)
    (out / "m.safetensors").write_bytes(old)
    calls, real = [], os.pwrite

    def pwrite(fd, data, offset):
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OSError) as info:
        engine.export(out / "m.safetensors")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(out / "m.safetensors")
    assert (out / "m.safetensors").read_bytes() == old
    assert os.listdir(out) == ["m.safetensors"]
    engine.close()


def test_a_killed_exports_temporary_file_is_removed_by_the_next_and_a_live_ones_is_not(tmp_path):
    """A kill -9 during an export left its temporary file, preallocated to the whole file's size,
    and no later export to the path removed it (an audit helper's repro). One whose writer is
    alive (holding its flock) is left to it."""
    import fcntl

    engine, _ = _trained(tmp_path, "mlp", steps=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".m.safetensors.tmp-killed").write_bytes(b"\0" * 65536)
    live = out / ".m.safetensors.tmp-alive"
    live.write_bytes(b"\0" * 4096)
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        engine.export(out / "m.safetensors")
        assert sorted(os.listdir(out)) == [".m.safetensors.tmp-alive", "m.safetensors"]
    finally:
        os.close(fd)
    engine.export(out / "m.safetensors")  # its writer gone now: collected
    assert os.listdir(out) == ["m.safetensors"]
    engine.close()


def test_short_writes_are_resumed(tmp_path, monkeypatch):
    """pwrite may write less than asked (Linux: 2 GiB at most a call); here 5 bytes at most."""
    engine, _ = _trained(tmp_path, "tied", steps=1)
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: real(fd, memoryview(data)[:5], offset))
    path = engine.export(tmp_path / "m.safetensors")
    monkeypatch.undo()
    expected = engine.export(tmp_path / "expected.safetensors")
    assert open_bytes(path) == open_bytes(expected)
    engine.close()


def test_a_missing_directory_is_named(tmp_path):
    engine, _ = _trained(tmp_path, "mlp", steps=1)
    with pytest.raises(FileNotFoundError) as info:
        engine.export(tmp_path / "missing" / "m.safetensors")
    assert info.value.filename == str(tmp_path / "missing")
    engine.close()


def test_a_dtype_safetensors_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    torch.manual_seed(0)
    model = _mlp()
    model.register_buffer("phase", torch.zeros(3, dtype=torch.complex64))
    engine = _engine(tmp_path, model)
    (tmp_path / "out").mkdir()
    with pytest.raises(TypeError, match=r"'phase' has dtype torch.complex64"):
        engine.export(tmp_path / "out" / "m.safetensors")
    assert os.listdir(tmp_path / "out") == []
    engine.close()


def test_one_unit_is_held_at_a_time(tmp_path, monkeypatch):
    """When a unit's weights arrive, the previous units' are gone (weak references): the export
    streams instead of collecting the model."""
    engine, _ = _trained(tmp_path, "tied", steps=1)
    real, seen, alive = engine.unit_weights, [], []

    def recording(**kwargs):
        for unit, full in real(**kwargs):
            alive.append(sum(ref() is not None for ref in seen))
            seen.append(weakref.ref(full))
            yield unit, full
            del full

    monkeypatch.setattr(engine, "unit_weights", recording)
    engine.export(tmp_path / "m.safetensors")
    assert len(alive) == len(engine.units) > 2 and alive == [0] * len(alive)
    engine.close()


_WORKER = r"""
import errno, json, os, sys
import torch
from torch import nn
import infinity

mode, swap, out = sys.argv[1:4]
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 33), nn.GELU(), nn.Linear(33, 4))  # 33: units padded per rank
engine = infinity.initialize(model, {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
                                     "nvme": {"paths": [swap], "grow_step": "4MiB"}, "partition": {"stage": 3, "timeout": 60}})
engine.backward(engine(torch.randn(4, 16)).pow(2).mean())
engine.step()
if mode == "fail" and rank == 0:
    real = os.pwrite
    calls = []
    def pwrite(fd, data, offset):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "no space")
        return real(fd, data, offset)
    os.pwrite = pwrite
try:
    result = {"path": engine.export(os.path.join(out, "m.safetensors"))}
except Exception as e:
    result = {"error": f"{type(e).__name__}: {e}"}
weights = engine.gathered_weights()  # the ranks still agree on what to call next
if rank == 0:
    torch.save(weights, os.path.join(out, "gathered.pt"))
with open(os.path.join(out, f"{rank}.json"), "w") as f:
    json.dump(result, f)
"""


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_two_ranks_export_one_file_from_rank_0(tmp_path, mode):
    """Stage 3 (each rank holds half of each unit): the file is whole; rank 1 writes nothing;
    a write failing on rank 0 raises on both ranks (rank 1 names rank 0) instead of hanging."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "swap").mkdir()  # the ranks' configs must agree: one path, a directory per rank in it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = rank_env(rank, 2, port)
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, mode, str(tmp_path / "swap"), str(out)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    logs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    results = [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]
    if mode == "ok":
        assert results == [{"path": str(out / "m.safetensors")}] * 2
        tensors = safetensors_torch.load_file(out / "m.safetensors")
        gathered = torch.load(out / "gathered.pt", weights_only=True)
        assert tensors.keys() == gathered.keys()
        assert all(torch.equal(tensors[k], gathered[k]) for k in tensors)
    else:
        assert results[0]["error"].startswith("OSError: [Errno 28]"), results
        assert results[1]["error"] == (
            f"RuntimeError: the export to {out / 'm.safetensors'} failed on rank 0; its error says why"
        )
        assert not (out / "m.safetensors").exists()
    assert sorted(os.listdir(out)) == sorted(["0.json", "1.json", "gathered.pt"] + ["m.safetensors"] * (mode == "ok"))

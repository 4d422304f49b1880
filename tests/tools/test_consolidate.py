"""infinity-consolidate: a checkpoint's weights, offline, against engine.export of the same state.

Every comparison is exact (keys in order, dtypes, values bit for bit): the tool reads the same
fp32 master weights the export gathers and casts them with the same cast. The CLI runs
in-process through main() for speed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

import infinity
from infinity import _consolidate
from infinity.swap import human_size
from infinity.tools.consolidate import main

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "infinity"))
from _common import rank_env  # noqa: E402

safetensors_torch = pytest.importorskip("safetensors.torch")


class _Tied(nn.Module):
    """An embedding tied to the output head (two keys, one parameter), a tileable 24 -> 300
    layer (29 KiB of fp32 weight: 8 tiles of 4 KiB) and a non-persistent buffer (in no file)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(300, 24)
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 300, bias=False)
        self.head.weight = self.embed.weight
        self.wide = nn.Linear(24, 300)
        self.register_buffer("mask", torch.ones(24), persistent=False)

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        h = h * self.mask.to(h.dtype)
        return self.head(h) + self.wide(h)


def _engine(tmp_path, model, *, param_dtype="fp32", tiers=("nvme",) * 3, **sections):
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    cfg = {"tiers": dict(zip(("params", "grads", "optimizer"), tiers)),
           "nvme": {"paths": [str(swap)], "grow_step": "4MiB"}, "precision": {"param_dtype": param_dtype},
           "optimizer": {"lr": 1e-2}}  # fmt: skip
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value)
    return infinity.initialize(model, cfg)


def _train(engine, steps=2):
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 300, (4, 8), generator=g)
        loss = nn.functional.cross_entropy(engine(ids).float().flatten(0, 1), ids.flatten())
        engine.backward(loss)
        engine.step()


def _saved(tmp_path, model=None, **kw):
    """A trained engine's checkpoint and export of the same state."""
    torch.manual_seed(0)
    engine = _engine(tmp_path, model if model is not None else _Tied(), **kw)
    _train(engine)
    engine.save_checkpoint(tmp_path / "ckpt")
    export = engine.export(tmp_path / "export.safetensors")
    engine.close()
    return str(tmp_path / "ckpt"), export


def _assert_same_file(path, reference, without=()):
    got, want = safetensors_torch.load_file(path), safetensors_torch.load_file(reference)
    want = {k: v for k, v in want.items() if k not in without}
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        assert torch.equal(got[key].reshape(-1).view(torch.uint8), want[key].reshape(-1).view(torch.uint8)), key


def _run(capsys, *argv):
    code = main([*map(str, argv), "--quiet"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
def test_one_file_is_the_export_bit_for_bit(tmp_path, capsys, param_dtype):
    """Tied head (both keys), tiles of a module put back together, fp32 masters cast as the export casts."""
    ckpt, export = _saved(tmp_path, param_dtype=param_dtype, memory={"tile_size": "4KiB"})
    code, out, err = _run(capsys, ckpt, tmp_path / "out.safetensors")
    assert code == 0, err
    _assert_same_file(tmp_path / "out.safetensors", export)
    assert out.startswith(f"wrote {tmp_path / 'out.safetensors'}: 6 tensors") and "note:" not in out


def test_the_checkpoint_names_tiles_that_the_file_puts_back_together(tmp_path, capsys):
    """The test above reassembles tiles only if the checkpoint holds them: it does."""
    ckpt, _ = _saved(tmp_path, memory={"tile_size": "4KiB"})
    names = [u["name"] for u in json.loads(open(os.path.join(ckpt, "step-2", "meta.json")).read())["units"]]
    assert sum(n.startswith("wide#") for n in names) > 1, names


def test_a_model_made_in_bf16_is_written_in_bf16(tmp_path, capsys):
    ckpt, export = _saved(tmp_path, _Tied().to(torch.bfloat16), param_dtype="bf16")
    assert _run(capsys, ckpt, tmp_path / "out.safetensors")[0] == 0
    _assert_same_file(tmp_path / "out.safetensors", export)
    assert {t.dtype for t in safetensors_torch.load_file(tmp_path / "out.safetensors").values()} == {torch.bfloat16}


def test_int8_optimizer_states_do_not_change_the_weights_written(tmp_path, capsys):
    ckpt, export = _saved(tmp_path, optimizer={"state_dtype": "int8"})
    assert _run(capsys, ckpt, tmp_path / "out.safetensors")[0] == 0
    _assert_same_file(tmp_path / "out.safetensors", export)


def test_frozen_parameters_are_written_from_their_saved_parameters(tmp_path, capsys):
    """A frozen unit has no master weights in the checkpoint: its bf16 parameters, cast, as the
    export takes them; --exclude-frozen-parameters leaves it out."""
    model = _Tied()
    model.norm.requires_grad_(False)
    ckpt, export = _saved(tmp_path, model, param_dtype="bf16")
    assert _run(capsys, ckpt, tmp_path / "out.safetensors")[0] == 0
    _assert_same_file(tmp_path / "out.safetensors", export)
    code, out, _ = _run(capsys, ckpt, tmp_path / "trainable.safetensors", "--exclude_frozen_parameters")
    assert code == 0 and "2 frozen parameter(s) left out" in out
    assert not any(k.startswith("norm.") for k in safetensors_torch.load_file(tmp_path / "trainable.safetensors"))


def test_dtype_casts_every_parameter(tmp_path, capsys):
    ckpt, export = _saved(tmp_path)
    assert _run(capsys, ckpt, tmp_path / "out.safetensors", "--dtype", "bf16")[0] == 0
    got, want = safetensors_torch.load_file(tmp_path / "out.safetensors"), safetensors_torch.load_file(export)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)


def test_a_torch_save_file_holds_the_exports_tensors(tmp_path, capsys):
    ckpt, export = _saved(tmp_path)
    assert _run(capsys, ckpt, tmp_path / "pytorch_model.bin")[0] == 0
    got, want = torch.load(tmp_path / "pytorch_model.bin", weights_only=True), safetensors_torch.load_file(export)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert got["head.weight"].data_ptr() == got["embed.weight"].data_ptr()  # tied, as torch.save keeps them


def test_one_unit_is_held_at_a_time(tmp_path):
    """When a unit's weights are handed on, the previous unit's are gone (weak references)."""
    ckpt, _ = _saved(tmp_path, memory={"tile_size": "4KiB"})
    seen, alive = [], []
    with _consolidate.CheckpointWeights(ckpt) as weights:
        for _, full in weights.unit_weights():
            alive.append(sum(ref() is not None for ref in seen))
            seen.append(weakref.ref(full))
            del full
    assert len(alive) > 8 and alive == [0] * len(alive)


class _WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.norm = nn.Embedding(300, 24), nn.BatchNorm1d(24)

    def forward(self, ids):
        return self.norm(self.embed(ids).transpose(1, 2)).transpose(1, 2) @ self.embed.weight.T


def test_persistent_buffers_are_written_as_saved(tmp_path, capsys):
    """A checkpoint holds the persistent buffers (version 2): the file is the export's, buffers
    (BatchNorm's running statistics, trained) included, bit for bit; in a torch.save file too
    (which wrote the parameters alone: a strict load_state_dict failed, a loose one kept fresh
    statistics)."""
    ckpt, export = _saved(tmp_path, _WithBuffer())
    code, _, err = _run(capsys, ckpt, tmp_path / "out.safetensors")
    assert code == 0, err
    _assert_same_file(tmp_path / "out.safetensors", export)
    want = safetensors_torch.load_file(export)
    assert want["norm.num_batches_tracked"].item() > 0
    code, _, err = _run(capsys, ckpt, tmp_path / "out.bin")
    assert code == 0, err
    got = torch.load(tmp_path / "out.bin", weights_only=True)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    _WithBuffer().load_state_dict(got)  # strict


def test_persistent_buffers_a_checkpoint_lacks_are_refused_by_name_or_skipped(tmp_path, capsys):
    """A checkpoint of version 1 holds no buffer values."""
    ckpt, export = _saved(tmp_path, _WithBuffer())
    meta_path = os.path.join(ckpt, "step-2", "meta.json")
    meta = json.loads(open(meta_path).read())
    meta["version"] = 1
    del meta["buffers"]
    os.chmod(meta_path, 0o600)
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    code, _, err = _run(capsys, ckpt, tmp_path / "out.safetensors")
    assert code == 2 and "norm.running_mean, norm.running_var, norm.num_batches_tracked" in err
    assert "--skip-buffers" in err and not (tmp_path / "out.safetensors").exists()
    code, out, _ = _run(capsys, ckpt, tmp_path / "out.safetensors", "--skip-buffers")
    assert code == 0 and "note: persistent buffers not written" in out
    got, want = safetensors_torch.load_file(tmp_path / "out.safetensors"), safetensors_torch.load_file(export)
    assert list(got) == [k for k in want if "norm.running" not in k and "batches" not in k]
    assert all(torch.equal(got[k], want[k]) for k in got)


def test_a_checkpoint_without_the_key_list_writes_its_parameters_and_says_what_it_lacks(tmp_path, capsys):
    """A checkpoint saved before meta.json listed the model's keys: the parameters under their
    own names in fp32 (the tied head under its owner's name only), and a note saying so."""
    ckpt, export = _saved(tmp_path, param_dtype="bf16")
    meta_path = os.path.join(ckpt, "step-2", "meta.json")
    meta = json.loads(open(meta_path).read())
    meta["version"] = 2  # (an older save: not checksummed)
    del meta["state_dict"]
    os.chmod(meta_path, 0o600)
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    code, out, _ = _run(capsys, ckpt, tmp_path / "out.safetensors")
    assert code == 0 and "tied aliases and persistent buffers" in out
    got, want = safetensors_torch.load_file(tmp_path / "out.safetensors"), safetensors_torch.load_file(export)
    assert sorted(got) == sorted(k for k in want if k != "head.weight")
    assert all(torch.equal(got[k], want[k]) for k in got)


def test_a_save_whose_keys_cannot_be_listed_still_saves(tmp_path, capsys, monkeypatch, caplog):
    """The key list is for this tool only: a module whose state_dict fails does not fail the
    save; the checkpoint then consolidates as an older one does, saying so."""

    def fail(engine):
        raise RuntimeError("state_dict hook failed")

    monkeypatch.setattr(_consolidate, "_layout_of", fail)
    ckpt, export = _saved(tmp_path)
    assert "state_dict keys are not recorded (RuntimeError: state_dict hook failed)" in caplog.text
    code, out, _ = _run(capsys, ckpt, tmp_path / "out.safetensors")
    assert code == 0 and "tied aliases and persistent buffers" in out
    got, want = safetensors_torch.load_file(tmp_path / "out.safetensors"), safetensors_torch.load_file(export)
    assert sorted(got) == sorted(k for k in want if k != "head.weight")


def test_a_flipped_byte_is_named_and_nothing_is_written(tmp_path, capsys):
    ckpt, _ = _saved(tmp_path)
    rank_dir = os.path.join(ckpt, "step-2", "rank0")
    manifest = json.loads(open(os.path.join(rank_dir, "manifest.json")).read())
    extent = manifest["tensors"]["norm/master"]["extents"][0]
    arena = os.path.join(rank_dir, manifest["files"][extent[0]]["name"])
    with open(arena, "r+b") as f:
        f.seek(extent[1])
        byte = f.read(1)
        f.seek(extent[1])
        f.write(bytes([byte[0] ^ 1]))
    for out in ("out.safetensors", "hf"):
        code, _, err = _run(capsys, ckpt, tmp_path / out)
        assert code == 1 and "norm/master" in err and arena in err
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "export.safetensors", "swap"]


def test_a_missing_rank_is_named(tmp_path, capsys):
    ckpt, _ = _saved(tmp_path)
    shutil.rmtree(os.path.join(ckpt, "step-2", "rank0"))
    code, _, err = _run(capsys, ckpt, tmp_path / "out.safetensors")
    assert code == 1 and f"{os.path.join(ckpt, 'step-2', 'rank0')}: rank 0 of 1 is missing" in err


def test_bad_input_is_named(tmp_path, capsys):
    code, _, err = _run(capsys, tmp_path / "nothing", tmp_path / "out.safetensors")
    assert code == 1 and str(tmp_path / "nothing") in err
    ckpt, _ = _saved(tmp_path)
    code, _, err = _run(capsys, ckpt, tmp_path / "out.safetensors", "--config", tmp_path / "config.json")
    assert code == 2 and "--config is for a Hugging Face directory" in err
    (tmp_path / "config.json").write_text("{not json")
    code, _, err = _run(capsys, ckpt, tmp_path / "hf", "--config", tmp_path / "config.json")
    assert code == 2 and f"{tmp_path / 'config.json'}: not a JSON config" in err
    assert not (tmp_path / "hf").exists()


def test_an_infinity_trainer_checkpoint_is_read_with_its_config(tmp_path, capsys):
    """checkpoint-N/infinity/state is the engine's state (InfinityTrainer's layout), and
    checkpoint-N/config.json the config a directory gets."""
    torch.manual_seed(0)
    engine = _engine(tmp_path, _Tied())
    _train(engine)
    engine.save_checkpoint(tmp_path / "checkpoint-2" / "infinity", tag="state")
    export = engine.export(tmp_path / "export.safetensors")
    engine.close()
    (tmp_path / "checkpoint-2" / "config.json").write_text('{"model_type": "tied"}')
    code, out, err = _run(capsys, tmp_path / "checkpoint-2", tmp_path / "hf")
    assert code == 0, err
    code, _, err = _run(capsys, tmp_path / "checkpoint-2", tmp_path / "hf16", "--dtype", "bf16")
    assert code == 0, err
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert f"note: config.json taken from {tmp_path / 'checkpoint-2' / 'config.json'}" in out
    # as it is, but for the dtype of the weights written (transformers' from_pretrained loads in it)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {"model_type": "tied", "dtype": "float32"}
    # a directory holds a tied weight once, under its first key, as transformers' save_pretrained writes it
    _assert_same_file(tmp_path / "hf" / "model.safetensors", export, without=("head.weight",))


def test_the_summary_counts_what_the_reader_takes(tmp_path, capsys):
    """A directory holds the tied head once (5 tensors, where it said 6), and a stale shard
    already there is not counted in the size (it added every .safetensors and .json there);
    a torch.save file holds both tied keys (6)."""
    ckpt, _ = _saved(tmp_path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model-00001-of-00009.safetensors").write_bytes(b"x" * (1 << 20))  # another run's
    code, out, err = _run(capsys, ckpt, tmp_path / "hf")
    assert code == 0, err
    size = sum((tmp_path / "hf" / n).stat().st_size for n in ("model.safetensors", "config.json")
               if (tmp_path / "hf" / n).exists())  # fmt: skip
    assert out.startswith(f"wrote {tmp_path / 'hf'}: 5 tensors, {human_size(size)},"), out
    assert "note: no config.json written (--config PATH): from_pretrained needs the model's" in out
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "another"}')
    code, out, err = _run(capsys, ckpt, tmp_path / "hf")
    assert "the one in the directory is as it was, not this checkpoint's" in out, out
    code, out, err = _run(capsys, ckpt, tmp_path / "out.bin")
    assert code == 0, err
    assert out.startswith(f"wrote {tmp_path / 'out.bin'}: 6 tensors, {human_size((tmp_path / 'out.bin').stat().st_size)},")


def test_progress_lines_name_each_unit(tmp_path, capsys):
    ckpt, _ = _saved(tmp_path)
    assert main([ckpt, str(tmp_path / "out.safetensors")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("1/") and err[-1].split()[0] == f"{len(err)}/{len(err)}"


def test_a_llama_directory_loads_in_transformers_with_the_engines_logits(tmp_path, capsys):
    """The directory matches engine.save_pretrained's (same keys, dtypes and bytes) and
    AutoModelForCausalLM.from_pretrained gives the engine's logits (fp32: exactly)."""
    transformers = pytest.importorskip("transformers")
    from infinity._safetensors import Shards, checkpoint_files

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                                   tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    engine = _engine(tmp_path, transformers.LlamaForCausalLM(cfg))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.save_pretrained(tmp_path / "saved", max_shard_size="100KB")
    engine.eval()
    with torch.no_grad():
        expected = engine(input_ids=ids).logits
    engine.close()
    code, _, err = _run(capsys, tmp_path / "ckpt", tmp_path / "hf", "--config", tmp_path / "saved",
                        "--max_shard_size", "100KB")  # fmt: skip
    assert code == 0, err
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    got, want = checkpoint_files(str(tmp_path / "hf")), checkpoint_files(str(tmp_path / "saved"))
    assert list(got) == list(want)
    a, b = Shards(got), Shards(want)
    assert all(torch.equal(a.tensor(k).view(torch.uint8), b.tensor(k).view(torch.uint8)) for k in want)
    assert (tmp_path / "hf" / "config.json").read_text() == (tmp_path / "saved" / "config.json").read_text()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=0, rtol=0)


_WORKER = r"""
import os, sys
import torch
from torch import nn
import infinity

swap, out = sys.argv[1:3]
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(64, 33), nn.LayerNorm(33), nn.Linear(33, 301))  # odd sizes: padded slices
engine = infinity.initialize(model, {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
                                     "nvme": {"paths": [swap], "grow_step": "4MiB"}, "memory": {"tile_size": "8KiB"},
                                     "partition": {"stage": 3, "timeout": 60}})
rank = int(os.environ["RANK"])
ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(rank))
engine.backward(engine(ids).float().pow(2).mean())
engine.step()
engine.save_checkpoint(os.path.join(out, "ckpt"))
engine.export(os.path.join(out, "export.safetensors"))
"""


@pytest.mark.multirank
def test_a_checkpoint_saved_at_two_ranks_is_their_export(tmp_path, capsys):
    """Stage 3, each rank holding half of every unit (tiles of the 301-row head included)."""
    (tmp_path / "swap").mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path / "swap"), str(tmp_path)],
                              env=rank_env(rank, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]  # fmt: skip
    logs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    meta = json.loads(next((tmp_path / "ckpt").glob("step-*/meta.json")).read_text())
    assert meta["world_size"] == 2 and any("#" in u["name"] for u in meta["units"])
    code, _, err = _run(capsys, tmp_path / "ckpt", tmp_path / "out.safetensors")
    assert code == 0, err
    _assert_same_file(tmp_path / "out.safetensors", tmp_path / "export.safetensors")


def test_the_installed_command_runs(tmp_path):
    ckpt, export = _saved(tmp_path)
    exe = os.path.join(os.path.dirname(sys.executable), "infinity-consolidate")
    if not os.path.exists(exe):
        pytest.skip("infinity-consolidate is not installed in this environment (pip install -e . installs it)")
    r = subprocess.run([exe, ckpt, str(tmp_path / "out.safetensors"), "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    _assert_same_file(tmp_path / "out.safetensors", export)

"""Hugging Face checkpoint directories in (streamed into the tiers) and out (save_pretrained).

Round trip: a plain model's save_pretrained (sharded; bf16 and fp32) -> infinity.from_pretrained
into nvme tiers -> the weights bit-equal -> 3 steps equal plain torch (1e-5: fused AdamW against
torch's default kernel) -> engine.save_pretrained -> AutoModelForCausalLM.from_pretrained gives
the engine's logits.
"""

import copy
import json
import os
import re
import shutil
import stat
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import infinity  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _common import rank_env  # noqa: E402


def _llama(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def _nvme(tmp_path, **sections):
    (tmp_path / "swap").mkdir(exist_ok=True)
    cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
           "nvme": {"paths": [str(tmp_path / "swap")], "grow_step": "4MiB"},
           "optimizer": {"lr": 1e-3, "weight_decay": 0.01}}  # fmt: skip
    cfg.update(sections)
    return cfg


def _ids(step):
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_round_trip_through_hugging_face_directories(tmp_path, dtype):
    plain = _llama(dtype)
    plain.save_pretrained(tmp_path / "in", max_shard_size="20KB")  # several shards and an index
    assert (tmp_path / "in" / "model.safetensors.index.json").is_file()
    saved = {k: v.clone() for k, v in plain.state_dict().items()}

    engine = infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "in", _nvme(tmp_path))
    got = engine.gathered_weights()
    for key, value in saved.items():
        if key in got:  # tied weights appear once
            assert torch.equal(got[key], value.float()), key

    ref = copy.deepcopy(plain).float()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for step in range(3):
        loss = engine(input_ids=_ids(step), labels=_ids(step)).loss
        engine.backward(loss)
        engine.step()
        ref_loss = ref(input_ids=_ids(step), labels=_ids(step)).loss
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        assert abs(loss.item() - ref_loss.item()) < 1e-5

    out = engine.save_pretrained(tmp_path / "out", max_shard_size="20KB")
    index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
    assert len(set(index["weight_map"].values())) > 1 and (tmp_path / "out" / "config.json").is_file()
    with torch.no_grad():
        want = engine(input_ids=_ids(9)).logits
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert next(back.parameters()).dtype == dtype  # saved in the dtype the model was made in
    with torch.no_grad():
        logits = back.float()(input_ids=_ids(9)).logits
    torch.testing.assert_close(logits, want.float(), atol=0, rtol=0) if dtype == torch.float32 else \
        torch.testing.assert_close(logits, want.float(), atol=5e-2, rtol=0)  # fmt: skip
    engine.close()


def test_one_shard_when_it_fits_and_stale_shards_go(tmp_path):
    engine = infinity.initialize(_llama(), _nvme(tmp_path))
    engine.save_pretrained(tmp_path / "out", max_shard_size="20KB")
    engine.save_pretrained(tmp_path / "out")  # 2GB: one file; the shards and index of before go
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "generation_config.json",
                                                                    "model.safetensors"]  # fmt: skip
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    got = engine.gathered_weights()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in got.items())
    engine.close()


def test_missing_and_mis_shaped_keys_are_errors_that_name_them(tmp_path):
    from safetensors.torch import load_file, save_file

    _llama().save_pretrained(tmp_path / "in")
    tensors = load_file(tmp_path / "in" / "model.safetensors")
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, tmp_path / "in" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"mis-shaped tensors: model.layers.0.mlp.up_proj.weight: \[3, 3\]"):
        infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "in", _nvme(tmp_path))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 32)
    save_file(tensors, tmp_path / "in" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing from the checkpoint: model.norm.weight"):
        infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "in", _nvme(tmp_path))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path, _nvme(tmp_path))


_WORKER = r"""
import json, os, sys
import torch, transformers
import infinity
path, swap, out = sys.argv[1:4]
rank = int(os.environ["RANK"])
cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
       "nvme": {"paths": [os.path.join(swap, "{rank}")], "grow_step": "4MiB"},
       "partition": {"stage": 3, "timeout": 60}}
engine = infinity.from_pretrained(transformers.LlamaForCausalLM, path, cfg)
weights = engine.gathered_weights()
ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    loss = engine(input_ids=ids, labels=ids).loss.item()
if rank == 0:
    torch.save(weights, os.path.join(out, "weights.pt"))
with open(os.path.join(out, f"{rank}.json"), "w") as f:
    json.dump({"read": engine.pretrained_bytes_read, "loss": loss}, f)
engine.close()
"""


@pytest.mark.multirank
def test_two_ranks_at_stage_3_each_read_only_their_slice(tmp_path):
    import socket
    import subprocess
    import sys

    plain = _llama()
    plain.save_pretrained(tmp_path / "in", max_shard_size="20KB")
    total = sum(p.numel() * p.element_size() for p in plain.parameters())  # tied weights once
    (tmp_path / "out").mkdir()
    (tmp_path / "swap").mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = rank_env(rank, 2, port)
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path / "in"), str(tmp_path / "swap"),
                                       str(tmp_path / "out")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
    logs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    results = [json.loads((tmp_path / "out" / f"{r}.json").read_text()) for r in range(2)]
    # Each rank reads its half, and at most one row more per parameter where a slice starts mid-row.
    for r in results:
        assert total / 2 <= r["read"] < total / 2 + total / 10, (r, total)
    assert sum(r["read"] for r in results) < 1.1 * total
    weights = torch.load(tmp_path / "out" / "weights.pt", weights_only=True)
    for key, value in plain.state_dict().items():
        if key in weights:
            assert torch.equal(weights[key], value), key
    with torch.no_grad():
        want = plain(input_ids=_ids_for_worker(), labels=_ids_for_worker()).loss.item()
    assert all(abs(r["loss"] - want) < 1e-5 for r in results), (results, want)


def _ids_for_worker():
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))


def test_transformers_from_pretrained_inside_build_is_a_clear_error(tmp_path):
    _llama().save_pretrained(tmp_path / "in")
    with pytest.raises(ValueError, match=r"Use infinity.from_pretrained\(ModelClass, path, config\)"):
        with infinity.build():
            transformers.LlamaForCausalLM.from_pretrained(tmp_path / "in")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "in")  # outside build: as ever
    assert not any(p.is_meta for p in model.parameters())


def test_an_engine_from_pretrained_refuses_a_foreign_optimizer_and_a_second_initialize(tmp_path):
    """Its placeholders carry the engine's mark as an initialized model's do (they lacked it: a
    torch AdamW stepped them silently and a second initialize was accepted)."""
    _llama().save_pretrained(tmp_path / "in")
    engine = infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "in", _nvme(tmp_path))
    opt = torch.optim.AdamW(engine.module.parameters())
    engine.module(input_ids=_ids(0), labels=_ids(0)).loss.backward()
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) on parameters that an infinity engine manages"):
        opt.step()
    engine.zero_grad()
    (tmp_path / "again").mkdir()
    with pytest.raises(ValueError, match="already given to infinity.initialize .parameter 'model.embed_tokens.weight'"):
        infinity.initialize(engine.module, _nvme(tmp_path / "again"))
    engine.close()


def _replace_mlp(model):
    """A wrapper that swaps a block's MLP for a fresh one: the base's weights there are gone."""
    model.model.layers[1].mlp = transformers.models.llama.modeling_llama.LlamaMLP(model.config)
    return model


@pytest.mark.parametrize("wrap, returned, lost", [
    (lambda m: torch.nn.Linear(4, 4), "torch.nn.modules.linear.Linear", "21 of the base's 21"),
    (lambda m: transformers.LlamaForCausalLM(m.config), "LlamaForCausalLM", "21 of the base's 21"),
    (_replace_mlp, "LlamaForCausalLM", "3 of the base's 21"),
], ids=["unrelated", "another-model", "a-module-replaced"])  # fmt: skip
def test_a_wrapper_that_does_not_keep_the_base_is_refused_naming_what_it_returned(tmp_path, wrap, returned, lost):
    """Accepted before with a logged warning, the checkpoint loaded into nothing (or a module the
    wrapper made trained from no values): the wrapped model must hold the base's parameters."""
    _llama().save_pretrained(tmp_path / "in")
    with pytest.raises(ValueError, match=rf"wrap\(model\) returned a \S*{returned} that does not hold {lost} "
                                         r"parameters.*'model\.\S+'"):
        infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "in", _nvme(tmp_path), wrap=wrap)
    assert not any((tmp_path / "swap").iterdir())  # nothing was made


def test_a_wrapper_that_returns_the_base_itself_loads_it(tmp_path):
    plain = _llama()
    plain.save_pretrained(tmp_path / "in")
    with infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "in", _nvme(tmp_path),
                                  wrap=lambda m: m) as engine:  # fmt: skip
        got = engine.gathered_weights()
        for key, value in plain.state_dict().items():
            if key in got:
                assert torch.equal(got[key], value), key


# -- what from_pretrained reads: files, index, dtypes, damage -------------------------------
_KEY = "model.layers.0.mlp.up_proj.weight"  # [64, 32] in _llama
_INDEX = "model.safetensors.index.json"


def _resident():
    return {"tiers": {"params": "device", "grads": "device", "optimizer": "device"}}


def _edit_index(directory, edit):
    index = directory / _INDEX
    data = json.loads(index.read_text())
    edit(data)
    index.write_text(json.dumps(data))


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink", "single-symlink"])
def test_a_weights_file_outside_the_directory_is_refused(tmp_path, where):
    """An index naming ../evil/x.safetensors or an absolute path, or a file in the directory that
    is a symlink out of it, was opened (and its tensor loaded into the weights)."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "in"
    _llama().save_pretrained(directory, max_shard_size="2GB" if where == "single-symlink" else "20KB")
    (tmp_path / "evil").mkdir()
    evil = tmp_path / "evil" / "x.safetensors"
    if where == "single-symlink":
        os.replace(directory / "model.safetensors", evil)
        os.symlink(evil, directory / "model.safetensors")
    else:
        save_file({_KEY: torch.full((64, 32), 7.0)}, evil)
        name = {"dotdot": "../evil/x.safetensors", "absolute": str(evil), "symlink": "x.safetensors"}[where]
        if where == "symlink":
            os.symlink(evil, directory / "x.safetensors")
        _edit_index(directory, lambda d: d["weight_map"].__setitem__(_KEY, name))
    assert load_file(evil)  # a valid file: the refusal is about where it is
    with pytest.raises(ValueError, match=f"outside {directory}"):
        infinity.from_pretrained(transformers.LlamaForCausalLM, directory, _resident())


def test_a_hub_cache_snapshot_loads_through_its_blob_symlinks(tmp_path):
    """huggingface_hub's cache links snapshots/<rev>/<file> to ../../blobs/<hash>: not 'outside'."""
    plain = _llama()
    plain.save_pretrained(tmp_path / "saved", max_shard_size="20KB")
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted((tmp_path / "saved").iterdir())):
        os.replace(f, repo / "blobs" / f"{i:040x}")
        os.symlink(f"../../blobs/{i:040x}", snapshot / f.name)
    engine = infinity.from_pretrained(transformers.LlamaForCausalLM, snapshot, _resident())
    got = engine.gathered_weights()
    assert all(torch.equal(got[k], v) for k, v in plain.state_dict().items() if k in got)
    engine.close()


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float8_e4m3fn], ids=["I32", "BOOL", "F8_E4M3"])
def test_a_parameter_stored_as_integers_booleans_or_float8_is_refused(tmp_path, dtype):
    """They were cast into the weights silently (up_proj became [-5., 38., 45.])."""
    from safetensors.torch import load_file, save_file

    _llama().save_pretrained(tmp_path / "in")
    tensors = load_file(tmp_path / "in" / "model.safetensors")
    tensors[_KEY] = (torch.randn(64, 32) * 50).to(dtype)
    save_file(tensors, tmp_path / "in" / "model.safetensors", metadata={"format": "pt"})
    name = {torch.int32: "I32", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3"}[dtype]
    with pytest.raises(ValueError, match=rf"{re.escape(_KEY)}: {name}"):
        infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "in", _resident())


@pytest.mark.parametrize("index", [{"weight_map": ["x.safetensors"]}, {"weight_map": {_KEY: 3}}, [], "{"],
                         ids=["list", "not-a-name", "not-an-object", "not-json"])  # fmt: skip
def test_an_index_of_the_wrong_shape_is_an_error_naming_it(tmp_path, index):
    """A weight_map that is a list raised AttributeError; a name that is not a string, TypeError."""
    directory = tmp_path / "in"
    _llama().save_pretrained(directory, max_shard_size="20KB")
    (directory / _INDEX).write_text(index if isinstance(index, str) else json.dumps(index))
    with pytest.raises(ValueError, match=re.escape(str(directory / _INDEX))):
        infinity.from_pretrained(transformers.LlamaForCausalLM, directory, _resident())


def test_model_safetensors_wins_over_an_index_as_in_transformers(tmp_path):
    """transformers loads model.safetensors where a directory holds it and an index; infinity
    loaded the index."""
    _llama().save_pretrained(tmp_path / "in", max_shard_size="20KB")
    torch.manual_seed(1)
    other = transformers.LlamaForCausalLM(_llama().config)
    other.save_pretrained(tmp_path / "other")
    os.replace(tmp_path / "other" / "model.safetensors", tmp_path / "in" / "model.safetensors")
    want = other.state_dict()
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "in").state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in want.items())
    engine = infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "in", _resident())
    got = engine.gathered_weights()
    assert all(torch.equal(got[k], want[k]) for k in got)
    engine.close()


@pytest.mark.parametrize("damage", ["single-truncated", "shard-truncated", "key-not-in-its-shard"])
def test_a_damaged_weights_file_is_an_error_naming_it(tmp_path, damage):
    """safetensors' own errors (SafetensorError: ... incomplete metadata) name no file."""
    directory = tmp_path / "in"
    _llama().save_pretrained(directory, max_shard_size="2GB" if damage == "single-truncated" else "20KB")
    if damage == "key-not-in-its-shard":
        weight_map = json.loads((directory / _INDEX).read_text())["weight_map"]
        bad = next(f for f in sorted(set(weight_map.values())) if f != weight_map[_KEY])
        _edit_index(directory, lambda d: d["weight_map"].__setitem__(_KEY, bad))
    else:
        bad = "model.safetensors" if damage == "single-truncated" else "model-00002-of-00006.safetensors"
        assert (directory / bad).is_file()
        (directory / bad).write_bytes((directory / bad).read_bytes()[:100])
    with pytest.raises(ValueError, match=re.escape(str(directory / bad))):
        infinity.from_pretrained(transformers.LlamaForCausalLM, directory, _resident())


# -- what save_pretrained leaves: atomic saves, modes, concurrent saves ------------------------
_CHANGES = ("replace", "rename", "unlink", "remove")


def _snapshot_each_change(monkeypatch, directory, into):
    """Before each change the save makes to ``directory``'s entries (a rename, an unlink), and
    after the last, a copy of it: what a reader finds if the save is killed at that point."""
    taken = []

    def take():
        taken.append(into / str(len(taken)))
        shutil.copytree(directory, taken[-1], symlinks=True)

    for name in _CHANGES:
        real = getattr(os, name)

        def change(src, *args, _real=real, **kwargs):
            if os.path.dirname(os.path.abspath(src)) == str(directory):
                take()
            return _real(src, *args, **kwargs)

        monkeypatch.setattr(os, name, change)
    return taken, take


def _same(got, want):
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("old, new", [("40KB", "40KB"), ("2GB", "40KB"), ("40KB", "2GB")],
                         ids=["sharded-to-sharded", "single-to-sharded", "sharded-to-single"])  # fmt: skip
def test_a_save_killed_at_any_point_leaves_the_old_checkpoint_or_the_new(tmp_path, monkeypatch, old, new):
    """Killed between shard renames, the directory mixed old and new shards (1 new and 20 old
    tensors of 21), and transformers and infinity loaded it without complaint."""
    out = tmp_path / "out"
    first = infinity.initialize(_llama(), _resident())
    first.save_pretrained(out, max_shard_size=old)
    before = {k: v.clone() for k, v in first.gathered_weights().items()}
    first.close()
    torch.manual_seed(1)
    engine = infinity.initialize(transformers.LlamaForCausalLM(_llama().config), _resident())
    after = engine.gathered_weights()
    assert not _same(after, before)
    (tmp_path / "seen").mkdir()
    with monkeypatch.context() as m:
        seen, take = _snapshot_each_change(m, out, tmp_path / "seen")
        engine.save_pretrained(out, max_shard_size=new)
        take()
    engine.close()
    assert len(seen) >= 4, seen
    for snapshot in seen:
        theirs = transformers.LlamaForCausalLM.from_pretrained(snapshot).state_dict()
        theirs = {k: theirs[k] for k in before}
        ours = infinity.from_pretrained(transformers.LlamaForCausalLM, snapshot, _resident())
        got = ours.gathered_weights()
        ours.close()
        assert _same(theirs, before) or _same(theirs, after), (snapshot, sorted(os.listdir(snapshot)))
        assert _same(got, theirs), snapshot
    assert _same(theirs, after)  # the last: the save's result
    left = sorted(os.listdir(out))
    weights = [n for n in left if n.endswith(".safetensors")]
    assert left == sorted(["config.json", "generation_config.json", *weights] +
                          (["model.safetensors.index.json"] if len(weights) > 1 else [])), left  # fmt: skip


_KILLED = r"""
import os, signal, sys
import torch, transformers
import infinity
out, at = sys.argv[1:3]
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
torch.manual_seed(2)
engine = infinity.initialize(transformers.LlamaForCausalLM(cfg),
                             {"tiers": {"params": "device", "grads": "device", "optimizer": "device"}})
real = getattr(os, at)
def change(path, *args, **kwargs):
    if os.path.dirname(path) == out and (at == "unlink" or ".safetensors" in os.path.basename(path)):
        os.kill(os.getpid(), signal.SIGKILL)  # the first shard rename, or the first unlink
    return real(path, *args, **kwargs)
setattr(os, at, change)
engine.save_pretrained(out, max_shard_size="40KB")
"""


@pytest.mark.parametrize("at", ["replace", "unlink"], ids=["first-shard-rename", "first-unlink"])
def test_what_a_killed_save_leaves_is_collected_by_the_next(tmp_path, at):
    """Preallocated temporary shards of killed saves stayed (6 full-size files after later
    successful saves), and so did shards that no index names."""
    import subprocess

    out = tmp_path / "out"
    engine = infinity.initialize(_llama(), _resident())
    engine.save_pretrained(out, max_shard_size="40KB")
    mine = engine.gathered_weights()
    killed = subprocess.run([sys.executable, "-c", _KILLED, str(out), at], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    left = set(os.listdir(out))
    shards = {n for n in left if n.endswith(".safetensors")}
    temporary = {n for n in left if n.startswith(".")}
    assert (temporary if at == "replace" else shards - set(json.loads((out / _INDEX).read_text())["weight_map"].values()))
    if at == "replace":  # killed before the commit: the old checkpoint
        back = transformers.LlamaForCausalLM.from_pretrained(out).state_dict()
        assert _same({k: back[k] for k in mine}, mine)
    engine.save_pretrained(out, max_shard_size="40KB")
    engine.close()
    now = sorted(os.listdir(out))
    named = set(json.loads((out / _INDEX).read_text())["weight_map"].values())
    assert now == sorted({"config.json", "generation_config.json", _INDEX, *named}), now
    back = transformers.LlamaForCausalLM.from_pretrained(out).state_dict()
    assert _same({k: back[k] for k in mine}, mine)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_file_save_pretrained_writes_has_the_mode_the_umask_gives(tmp_path, umask):
    """Shards followed the umask while config.json and the index were 0600."""
    engine = infinity.initialize(_llama(), _resident())
    before = os.umask(umask)
    try:
        engine.save_pretrained(tmp_path / "out", max_shard_size="40KB")
    finally:
        os.umask(before)
    engine.close()
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in (tmp_path / "out").iterdir()}
    assert len(modes) >= 5 and set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_a_second_save_into_a_directory_being_saved_is_refused_naming_it(tmp_path):
    """Each save collects the temporary files it finds: two at once would delete each other's."""
    import fcntl

    engine = infinity.initialize(_llama(), _resident())
    (tmp_path / "out").mkdir()
    fd = os.open(tmp_path / "out", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a save in another process holds it
        with pytest.raises(OSError, match=f"another save_pretrained is writing this directory.*{tmp_path / 'out'}"):
            engine.save_pretrained(tmp_path / "out")
    finally:
        os.close(fd)
    assert os.listdir(tmp_path / "out") == []
    engine.save_pretrained(tmp_path / "out")
    engine.close()


def test_a_save_id_an_earlier_save_drew_is_drawn_again(tmp_path, monkeypatch):
    """Shards under the names of the checkpoint in place would replace it one by one."""
    import infinity._hf_save

    draws = iter(["aaaaaaaa", "aaaaaaaa", "bbbbbbbb"])
    monkeypatch.setattr(infinity._hf_save.secrets, "token_hex", lambda n: next(draws))
    out = tmp_path / "out"
    first = infinity.initialize(_llama(), _resident())
    first.save_pretrained(out, max_shard_size="40KB")
    before = first.gathered_weights()
    first.close()
    torch.manual_seed(1)
    engine = infinity.initialize(transformers.LlamaForCausalLM(_llama().config), _resident())
    after = engine.gathered_weights()
    (tmp_path / "seen").mkdir()
    with monkeypatch.context() as m:
        seen, take = _snapshot_each_change(m, out, tmp_path / "seen")
        engine.save_pretrained(out, max_shard_size="40KB")
        take()
    engine.close()
    for snapshot in seen:
        theirs = transformers.LlamaForCausalLM.from_pretrained(snapshot).state_dict()
        assert _same({k: theirs[k] for k in before}, before) or _same({k: theirs[k] for k in after}, after), snapshot
    assert {n.split("-")[1] for n in os.listdir(out) if n.endswith(".safetensors")} == {"bbbbbbbb"}


def test_the_config_says_the_dtype_written_and_the_generation_settings_come_through(tmp_path):
    """A bf16 checkpoint trained in fp32 (``.float()`` after transformers' from_pretrained): the
    weights written are fp32, and the config says so (it kept bfloat16, so from_pretrained
    rounded them to bf16 on the way back, silently). infinity.from_pretrained keeps the
    checkpoint's generation_config (it took the defaults of config.json, and a save_pretrained
    wrote them over the user's sampling settings) and returns the model in eval mode, as
    transformers' does."""
    plain = _llama(torch.bfloat16)
    plain.generation_config = transformers.GenerationConfig(eos_token_id=[2, 7], do_sample=True, temperature=0.6,
                                                            top_p=0.9, max_new_tokens=5)  # fmt: skip
    plain.save_pretrained(tmp_path / "in")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "in").float()
    with infinity.initialize(loaded, _nvme(tmp_path)) as engine:
        loss = engine(input_ids=_ids(0), labels=_ids(0)).loss
        engine.backward(loss)
        engine.step()
        engine.save_pretrained(tmp_path / "out")
        want = engine.module.state_dict()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert back.dtype == torch.float32
    assert all(torch.equal(back.state_dict()[k], v) for k, v in want.items())

    (tmp_path / "swap2").mkdir()
    cfg = _nvme(tmp_path)
    cfg["nvme"] = {**cfg["nvme"], "paths": [str(tmp_path / "swap2")]}
    with infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "in", cfg) as engine:
        assert not engine.module.training
        g = engine.module.generation_config
        assert (g.eos_token_id, g.do_sample, g.temperature, g.top_p, g.max_new_tokens) == ([2, 7], True, 0.6, 0.9, 5)
        engine.save_pretrained(tmp_path / "again")
    kept = transformers.GenerationConfig.from_pretrained(tmp_path / "again")
    assert (kept.eos_token_id, kept.do_sample, kept.temperature) == ([2, 7], True, 0.6)


def test_tied_embeddings_are_written_once_as_transformers_writes_them(tmp_path):
    """A tied GPT-2's save_pretrained wrote lm_head.weight beside transformer.wte.weight, a
    second copy of the vocabulary matrix; transformers leaves the tied key out and ties it again
    at from_pretrained. The same keys now, and the model loads back equal."""
    import safetensors.torch

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)  # fmt: skip
    plain = transformers.GPT2LMHeadModel(cfg)
    plain.save_pretrained(tmp_path / "plain")
    with infinity.initialize(copy.deepcopy(plain), _nvme(tmp_path)) as engine:
        engine.save_pretrained(tmp_path / "ours")
    ours = safetensors.torch.load_file(tmp_path / "ours" / "model.safetensors")
    assert ours.keys() == safetensors.torch.load_file(tmp_path / "plain" / "model.safetensors").keys()
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours")
    assert back.lm_head.weight is back.transformer.wte.weight
    assert all(torch.equal(back.state_dict()[k], v) for k, v in plain.state_dict().items())


def test_a_checkpoint_with_other_values_under_tied_keys_is_refused_naming_them(tmp_path):
    """A tied GPT-2 whose checkpoint holds its own lm_head.weight beside transformer.wte.weight
    (an older or hand-merged save): the load read one and dropped the other, silently, where
    transformers keeps them apart (an audit helper's repro: other logits). Refused, naming both;
    the same values under both keys load, as one of them alone does."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "in")
    tensors = load_file(tmp_path / "in" / "model.safetensors")
    assert "lm_head.weight" not in tensors  # transformers saves a tied model's weight once
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 1
    save_file(tensors, tmp_path / "in" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'transformer.wte.weight' and 'lm_head.weight' hold different values"):
        infinity.from_pretrained(transformers.GPT2LMHeadModel, tmp_path / "in", _nvme(tmp_path))
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    save_file(tensors, tmp_path / "in" / "model.safetensors", metadata={"format": "pt"})
    with infinity.from_pretrained(transformers.GPT2LMHeadModel, tmp_path / "in", _nvme(tmp_path)) as engine:
        want = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "in")
        with torch.no_grad():
            torch.testing.assert_close(engine(input_ids=_ids(0)).logits, want(input_ids=_ids(0)).logits, atol=0, rtol=0)


def test_dtypes_transformers_gives_a_checkpoint_are_the_ones_it_is_made_and_saved_in(tmp_path):
    """transformers keeps T5's ``wo`` (``_keep_in_fp32_modules``) in fp32 in an fp16 model, and
    takes the weights' dtype where config.json names none: the engine made every parameter in
    the config's dtype (or fp32), and save_pretrained wrote wo rounded to fp16, or a bf16
    checkpoint in fp32, without a step (an audit helper's repros). Both are saved as loaded."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                decoder_start_token_id=0)  # fmt: skip
    transformers.T5ForConditionalGeneration(cfg).save_pretrained(tmp_path / "fp32")
    half = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "fp32", dtype=torch.float16)
    half.save_pretrained(tmp_path / "t5")
    wo = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    saved = load_file(tmp_path / "t5" / "model.safetensors")
    assert saved[wo].dtype == torch.float32 and saved["shared.weight"].dtype == torch.float16
    with infinity.from_pretrained(transformers.T5ForConditionalGeneration, tmp_path / "t5", _nvme(tmp_path)) as engine:
        engine.save_pretrained(tmp_path / "t5-out")
    out = load_file(tmp_path / "t5-out" / "model.safetensors")
    assert out[wo].dtype == torch.float32 and torch.equal(out[wo], saved[wo])

    _llama(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    config = json.load(open(tmp_path / "bf16" / "config.json"))
    for key in ("dtype", "torch_dtype"):
        config.pop(key, None)
    json.dump(config, open(tmp_path / "bf16" / "config.json", "w"))
    (tmp_path / "b").mkdir()
    cfg = _nvme(tmp_path / "b", precision={"param_dtype": "bf16"})
    with infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "bf16", cfg) as engine:
        engine.save_pretrained(tmp_path / "bf16-out")
    assert {t.dtype for t in load_file(tmp_path / "bf16-out" / "model.safetensors").values()} == {torch.bfloat16}


def test_an_auto_class_loads_the_class_it_picks_for_the_checkpoint(tmp_path):
    """``infinity.from_pretrained(AutoModelForCausalLM, path, config)`` failed with "no attribute
    'config_class'" (an audit helper); it takes the class transformers' own picks."""
    _llama().save_pretrained(tmp_path / "in")
    with infinity.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "in", _nvme(tmp_path)) as engine:
        assert type(engine.module) is transformers.LlamaForCausalLM
        want = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "in")
        with torch.no_grad():
            torch.testing.assert_close(engine(input_ids=_ids(0)).logits, want(input_ids=_ids(0)).logits, atol=0, rtol=0)

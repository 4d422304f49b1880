"""Hugging Face checkpoint directories in (streamed into the tiers) and out (save_pretrained).

Round trip: a plain model's save_pretrained (sharded; bf16 and fp32) -> infinity.from_pretrained
into nvme tiers -> the weights bit-equal -> 3 steps equal plain torch (1e-5: fused AdamW against
torch's default kernel) -> engine.save_pretrained -> AutoModelForCausalLM.from_pretrained gives
the engine's logits.
"""

import copy
import json
import os
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

"""LoRA through peft on a Llama whose frozen base lives on nvme: only the adapters train.

Against plain torch + peft, 5 steps, AdamW over the trainable parameters, within 1e-5 (the
fused kernel against torch's default: float rounding). The frozen base has no optimizer state
and is never written after initialize: each of its tensors in the swap space keeps generation
1, and the bytes a step writes are exactly the adapters' (gradients, optimizer state, params).
"""

import copy

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import infinity  # noqa: E402


def _lora_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    base = transformers.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, lora)
    for name, p in model.named_parameters():  # peft starts lora_B at zero; move off it to test more
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def test_lora_on_a_frozen_nvme_base_matches_plain_peft_and_never_writes_the_base(tmp_path):
    model = _lora_llama()
    ref = copy.deepcopy(model)
    cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
           "nvme": {"paths": [str(tmp_path)], "grow_step": "4MiB"},
           "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}  # fmt: skip
    engine = infinity.initialize(model, cfg)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    frozen = engine.optimizer.frozen
    trainable = [u for g in engine.optimizer.groups for u in g.units]
    assert frozen and trainable and all("lora_" in u.name for u in trainable)
    assert not any(u.name.endswith(f"/{k}") for u in frozen for k in ("master", "exp_avg"))
    names = set(engine.space.names())
    assert not any(f"{u.name}/master" in names or f"{u.name}/grad" in names for u in frozen)
    n = sum(u.shard_numel for u in trainable)
    per_step = 4 * n + 3 * 4 * n + engine.dtype.itemsize * n  # grads, master + moments, params
    for step in range(5):
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        assert abs(loss.item() - ref_loss.item()) < 1e-5
        if step > 0:  # the first step's counters also hold initialize's writes
            assert engine.stats()["step"]["nvme"]["write_bytes"] == per_step
    for u in frozen:
        assert engine.space.info(f"{u.name}/param").generation == 1, u.name  # written at initialize only
    got = engine.gathered_weights()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), atol=1e-5, rtol=0)
    engine.close()

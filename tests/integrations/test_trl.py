"""InfinitySFTTrainer against plain trl.SFTTrainer: same tiny Llama, data and schedule.

TRL's SFTTrainer computes the loss with a fused LM head that reads ``lm_head.weight`` outside
``lm_head``'s forward; the engine gathers it there (`infinity.GatheredParameters`). Tolerance
1e-5 on every logged loss: both run AdamW in fp32 on the same data order, so they differ by
float rounding only (the engine's fused CPU kernel, its sums over tiles).
"""

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from infinity.integrations.trl import InfinitySFTTrainer  # noqa: E402

STEPS = 6
VOCAB = 64


def _tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _dataset():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(6, 16, (24,), generator=g).tolist()
    return datasets.Dataset.from_dict({"input_ids": [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]})


def _llama(tied=False):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attention_dropout=0.0, tie_word_embeddings=tied)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _args(out):
    return trl.SFTConfig(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.1, max_grad_norm=1.0,
                         logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                         dataloader_num_workers=0, disable_tqdm=True, bf16=False)  # fmt: skip


def _losses(trainer):
    return {h["step"]: (h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h}


def _nvme(tmp_path, **memory):
    (tmp_path / "swap").mkdir(exist_ok=True)
    return {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
            "nvme": {"paths": [str(tmp_path / "swap")], "grow_step": "4MiB"},
            "memory": {"host_budget": "256MiB", **memory}}  # fmt: skip


# lm_head is 64 x 32 fp32 (8 KiB): a 4 KiB tile_size cuts it (and the embedding) into tiles.
@pytest.mark.parametrize(("tied", "memory"), [(False, {}), (True, {}), (False, {"tile_size": 4096})],
                         ids=["whole", "tied", "tiled"])  # fmt: skip
def test_sft_trainer_on_nvme_logs_the_losses_of_plain_sft_trainer(tmp_path, tied, memory):
    plain = trl.SFTTrainer(model=_llama(tied), args=_args(tmp_path / "plain"), train_dataset=_dataset(),
                           processing_class=_tokenizer())  # fmt: skip
    plain.train()
    want = _losses(plain)

    ours = InfinitySFTTrainer(model=_llama(tied), args=_args(tmp_path / "ours"), train_dataset=_dataset(),
                              processing_class=_tokenizer(), infinity_config=_nvme(tmp_path, **memory))  # fmt: skip
    try:
        ours.train()
        got = _losses(ours)
        assert got.keys() == want.keys() and len(got) == STEPS
        for step in want:
            (loss, norm), (ref_loss, ref_norm) = got[step], want[step]
            assert abs(loss - ref_loss) < 1e-5, (step, loss, ref_loss)
            assert abs(norm - ref_norm) < 1e-4 * max(1.0, ref_norm), (step, norm, ref_norm)
        if memory:
            assert any(u.is_tile for u in ours.engine.units if u.path == "lm_head")
    finally:
        if ours.engine is not None:
            ours.engine.close()


def test_dpo_s_sync_ref_model_on_nvme_mixes_the_policy_in_as_plain_dpo_does(tmp_path):
    """DPO's sync_ref_model mixes the policy's weights into the reference model after each
    step, reading every parameter outside any forward: with the parameters on nvme the first
    step's callback was refused (an audit helper's repro). `install` reads them one module at a
    time under GatheredParameters: the losses (which the reference model enters from the second
    step on) and the synced reference model are plain DPO's."""
    from infinity.integrations.transformers import InfinityTrainer
    from infinity.integrations.trl import install

    install()

    class DPO(InfinityTrainer, trl.DPOTrainer):
        pass

    g = torch.Generator().manual_seed(0)

    def words():
        return " ".join(f"t{i}" for i in torch.randint(2, VOCAB, (4,), generator=g).tolist())

    data = datasets.Dataset.from_dict({k: [words() for _ in range(8)] for k in ("prompt", "chosen", "rejected")})

    def run(cls, out, **kw):
        args = trl.DPOConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=2, learning_rate=3e-3,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, bf16=False, sync_ref_model=True, ref_model_sync_steps=1,
                             ref_model_mixup_alpha=0.5)  # fmt: skip
        ref = _llama()
        trainer = cls(model=_llama(), ref_model=ref, args=args, train_dataset=data, processing_class=_tokenizer(), **kw)
        trainer.train()
        if cls is DPO:
            trainer.engine.close()
        return _losses(trainer), {n: p.detach().clone() for n, p in ref.named_parameters()}

    want, want_ref = run(trl.DPOTrainer, tmp_path / "plain")
    got, got_ref = run(DPO, tmp_path / "ours", infinity_config=_nvme(tmp_path))
    assert got.keys() == want.keys() and len(want) == 2
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-7), step
    for name in want_ref:
        torch.testing.assert_close(got_ref[name], want_ref[name], atol=1e-6, rtol=0, msg=name)

"""One rank of tests/integrations/test_multirank_frameworks.py; also run alone (1 process).

argv: mode, output path prefix, swap directory, and for ``trainer-save`` the partition stage.
Modes:

- ``trainer``: InfinityTrainer, as run_clm.py runs it under torchrun (TrainingArguments make the
  process group, the Trainer shards the data).
- ``trainer-save``: the same with a checkpoint every 2 steps (``save_steps``), then
  ``trainer.save_model(f"{out}-final")``; then, at several ranks, in the same processes (no
  second start-up), a new Trainer resumed from ``checkpoint-2`` runs to the end and writes
  ``{out}-resumed.json`` and ``{out}-resumed.weights.pt``.
- ``trainer-peft``: ``trainer`` on a LoRA model with ``modules_to_save`` (lm_head), then
  ``trainer.save_model(f"{out}-final")``: the adapters peft writes.
- ``accelerate``: a plain accelerate loop with the README's recipe.
- ``accelerate-ddp``: the same loop with ``accelerator.prepare(engine.module, ...)``, which wraps
  the module in DistributedDataParallel at several processes: expected refused.

The global batch of every step is the same whatever the world size (4 sequences: 4 on one
process, 2 on each of two). Rank 0 writes ``{out}.json``: the losses (the Trainer's logged ones,
averaged over ranks; the loop's, averaged with an all-reduce) and the final weights.
"""

import json
import os
import sys

import torch
import transformers

import infinity
from infinity.integrations.transformers import InfinityTrainer

mode, out, swap = sys.argv[1], sys.argv[2], sys.argv[3]
stage = int(sys.argv[4]) if len(sys.argv) > 4 else 3
world = int(os.environ.get("WORLD_SIZE", "1"))
torch.set_num_threads(1)
STEPS, GLOBAL_BATCH = 4, 4


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    if mode != "trainer-peft":
        return model
    import peft

    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0, modules_to_save=["lm_head"]))  # fmt: skip


# Sequences of one length, no padding: each rank's mean loss over its tokens, averaged over the
# ranks, is the mean over the global batch, as is the engine's averaged gradient.
IDS = torch.randint(0, 64, (GLOBAL_BATCH * STEPS, 12), generator=torch.Generator().manual_seed(0))
DATA = [{"input_ids": x, "labels": x} for x in IDS]
CONFIG = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
          "nvme": {"paths": [swap], "grow_step": "4MiB"}, "partition": {"stage": stage, "timeout": 30}}  # fmt: skip


def write(losses, weights, prefix=out):
    if int(os.environ.get("RANK", "0")) == 0:
        json.dump({"losses": losses}, open(f"{prefix}.json", "w"))
        torch.save(weights, f"{prefix}.weights.pt")


def train(prefix, resume=None):
    saving = {"save_strategy": "steps", "save_steps": 2} if mode == "trainer-save" else {"save_strategy": "no"}
    args = transformers.TrainingArguments(
        output_dir=f"{prefix}-trainer", max_steps=STEPS, per_device_train_batch_size=GLOBAL_BATCH // world,
        learning_rate=3e-3, weight_decay=0.1, max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True,
        seed=0, dataloader_num_workers=0, disable_tqdm=True, train_sampling_strategy="sequential", **saving)  # fmt: skip
    trainer = InfinityTrainer(model=llama(), args=args, train_dataset=DATA, infinity_config=CONFIG)
    trainer.train(resume_from_checkpoint=resume)
    assert trainer.model_wrapped is trainer.model, type(trainer.model_wrapped)  # not DDP
    if mode in ("trainer-save", "trainer-peft"):
        trainer.save_model(f"{prefix}-final")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    write(losses, trainer.engine.gathered_weights(), prefix)
    trainer.engine.close()


if mode.startswith("trainer"):
    train(out)
    if mode == "trainer-save" and world > 1:
        train(f"{out}-resumed", resume=f"{out}-trainer/checkpoint-2")
else:
    import accelerate

    accelerator = accelerate.Accelerator(cpu=True)  # makes the process group under torchrun
    model = llama()
    engine = infinity.initialize(model, CONFIG, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3,
                                                                           weight_decay=0.1))  # fmt: skip
    loader = torch.utils.data.DataLoader(DATA, batch_size=GLOBAL_BATCH // world)
    if mode == "accelerate":  # the README's recipe
        model = accelerator.prepare_model(engine.module, device_placement=False, evaluation_mode=True)
        optimizer, loader = accelerator.prepare(engine.optimizer, loader)
    else:  # no device placement: what this tests is the DDP wrapping alone
        model, optimizer, loader = accelerator.prepare(engine.module, engine.optimizer, loader,
                                                       device_placement=[False, True, True])  # fmt: skip
    losses = []
    try:
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            engine.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    except RuntimeError as e:
        open(f"{out}.{os.environ.get('RANK', '0')}.err", "w").write(str(e))
        engine.close()
        sys.exit(3)
    write(losses, engine.gathered_weights())
    engine.close()

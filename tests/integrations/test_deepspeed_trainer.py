"""A script written for DeepSpeed through transformers' Trainer, on the engine: its
``TrainingArguments(deepspeed=...)`` with one changed import, or unchanged under
``python -m infinity.integrations.launch``; and the engine's figures in the Trainer's logs."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import infinity  # noqa: E402
from infinity.integrations import transformers as integration  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_transformers import _Tokens, _llama  # noqa: E402

STEPS = 6


def _ds(tmp_path, **extra) -> dict:
    (tmp_path / "nvme").mkdir(exist_ok=True)
    return {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")},
                                  "stage3_prefetch_bucket_size": "auto", "sub_group_size": 1e9},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}, **extra}  # fmt: skip


def _kw(out) -> dict:
    return dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                learning_rate=3e-3, weight_decay=0.1, lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=1.0,
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
                disable_tqdm=True)  # fmt: skip


def _history(trainer) -> dict:
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h}


class _DecayAll(integration.InfinityTrainer):
    """The Trainer's optimizer over one group that decays every parameter: what transformers
    gives DeepSpeed for a config's optimizer section (a flat list of the trainable ones)."""

    def get_decay_parameter_names(self, model) -> list[str]:
        return [n for n, _ in model.named_parameters()]


def test_a_deepspeed_optimizer_section_decays_every_parameter_as_under_deepspeed(tmp_path):
    """transformers gives DeepSpeed the trainable parameters as one flat list
    (DummyOptim(params=model_parameters)), so a config's optimizer section decays biases and
    norms too; the engine ran it over the Trainer's groups, no decay on them, and trained other
    weights than DeepSpeed's with nothing said (an audit helper's repro)."""
    args = integration.TrainingArguments(**{**_kw(tmp_path / "a"), "max_steps": 1}, deepspeed=_ds(tmp_path))
    ours = integration.InfinityTrainer(model=_llama(), args=args, train_dataset=_Tokens())
    ours.train()
    groups = ours.engine.optimizer.param_groups
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.1
    assert len(groups[0]["params"]) == sum(1 for p in ours.model.parameters() if p.requires_grad)
    ours.engine.close()


def test_training_arguments_deepspeed_trains_as_the_native_config_it_means(tmp_path):
    """One changed import: the DeepSpeed config's tiers, its "auto" values from the arguments,
    the Trainer's own schedule (the config has none), bit for bit the native config's run (with
    every parameter decayed, as the config's optimizer section decays them)."""
    ds = _ds(tmp_path)
    ours = integration.InfinityTrainer(model=_llama(), args=integration.TrainingArguments(**_kw(tmp_path / "a"),
                                                                                          deepspeed=ds),
                                       train_dataset=_Tokens())  # fmt: skip
    ours.train()
    cfg = ours.engine.config
    assert (cfg.tiers.params, cfg.tiers.grads, cfg.tiers.optimizer) == ("nvme", "cpu", "nvme")
    assert cfg.optimizer.lr == 3e-3 and cfg.optimizer.max_grad_norm == 1.0 and cfg.partition.stage == 3
    (tmp_path / "swap").mkdir()
    native = {"tiers": {"params": "nvme", "grads": "cpu", "optimizer": "nvme"},
              "nvme": {"paths": [str(tmp_path / "swap")]}, "prefetch": cfg.to_dict()["prefetch"],
              "optimizer": {"sub_group_size": cfg.optimizer.sub_group_size, "max_grad_norm": 1.0}}  # fmt: skip
    plain = _DecayAll(model=_llama(), args=transformers.TrainingArguments(**_kw(tmp_path / "b")),
                      train_dataset=_Tokens(), infinity_config=native)
    plain.train()
    got, want = _history(ours), _history(plain)
    assert len(got) == STEPS
    for step in want:
        assert (got[step]["loss"], got[step]["learning_rate"]) == (want[step]["loss"], want[step]["learning_rate"])
    a, b = ours.engine.gathered_weights(), plain.engine.gathered_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ours.engine.close()
    plain.engine.close()


def test_a_deepspeed_schedule_is_the_trainers_schedule(tmp_path):
    """WarmupDecayLR with transformers' "auto" values: from 0 to the learning rate over the
    arguments' warm-up by DeepSpeed's log formula, then linearly to 0 at the last step."""
    ds = _ds(tmp_path, scheduler={"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                       "warmup_num_steps": "auto",
                                                                       "total_num_steps": "auto"}})  # fmt: skip
    kw = dict(_kw(tmp_path / "a"), warmup_steps=3)
    trainer = integration.InfinityTrainer(model=_llama(), args=integration.TrainingArguments(**kw, deepspeed=ds),
                                          train_dataset=_Tokens())  # fmt: skip
    trainer.train()
    assert isinstance(trainer.lr_scheduler, infinity.deepspeed_lr_scheduler.__globals__["DeepSpeedWarmup"])
    import math

    def rate(k):  # DeepSpeed's at its iteration k
        gamma = math.log(k + 1) / math.log(3) if k < 3 else (STEPS - k) / (STEPS - 3)
        return 3e-3 * gamma

    # The Trainer logs the rate step s ran at: the minimum for the first, then DeepSpeed's at
    # iteration s - 2 (its first step() computes iteration 0).
    logged = [h["learning_rate"] for _, h in sorted(_history(trainer).items())]
    assert logged == pytest.approx([0.0] + [rate(s - 2) for s in range(2, STEPS + 1)], rel=1e-9, abs=1e-15)
    trainer.engine.close()


def test_transformers_own_deepspeed_arguments_are_refused_naming_ours():
    class Args:  # what transformers.TrainingArguments(deepspeed=...) is when deepspeed is installed
        deepspeed = {"zero_optimization": {"stage": 3}}

    with pytest.raises(ValueError, match=r"infinity.integrations.transformers.TrainingArguments"):
        integration.InfinityTrainer(model=_llama(), args=Args())


_SCRIPT = '''
import json, sys, torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

(args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": x, "labels": x} for x in ids]
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
engine = getattr(trainer, "engine", None)
print("RESULT", json.dumps({"trainer": type(trainer).__name__, "tiers": engine and engine.config.to_dict()["tiers"],
                            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}))
'''


def test_an_unchanged_script_runs_on_the_engine_under_the_launcher(tmp_path):
    (tmp_path / "train.py").write_text(_SCRIPT)
    (tmp_path / "ds_config.json").write_text(json.dumps(_ds(tmp_path)))
    out = subprocess.run([sys.executable, "-m", "infinity.integrations.launch", str(tmp_path / "train.py"),
                          "--output_dir", str(tmp_path / "out"), "--max_steps", "3", "--per_device_train_batch_size",
                          "2", "--learning_rate", "1e-3", "--logging_steps", "1", "--save_strategy", "no",
                          "--report_to", "none", "--use_cpu", "--deepspeed", str(tmp_path / "ds_config.json")],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["trainer"] == "InfinityTrainer"
    assert result["tiers"] == {"params": "nvme", "grads": "cpu", "optimizer": "nvme"}
    assert len(result["losses"]) == 3 and all(x == x for x in result["losses"])


def test_the_engines_figures_reach_the_logs_and_what_reports_them(tmp_path):
    """Each training log carries the engine's bytes and rates since the previous one; a
    callback after it (where report_to's go) sees them, and so does log_history."""
    seen = []

    class Reporter(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                seen.append(dict(logs))

    (tmp_path / "swap").mkdir()
    cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}, "nvme": {"paths": [str(tmp_path / "swap")]}}
    trainer = integration.InfinityTrainer(model=_llama(), args=transformers.TrainingArguments(**_kw(tmp_path / "a")),
                                          train_dataset=_Tokens(), infinity_config=cfg, callbacks=[Reporter()])  # fmt: skip
    start = None

    class First(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            nonlocal start
            start = trainer.engine.stats()["total"]["nvme"]["write_bytes"]

    trainer.add_callback(First())
    trainer.train()
    history = list(_history(trainer).values())
    assert len(seen) == len(history) == STEPS
    for logs in (*seen, *history):
        for key in ("infinity/nvme_read_gb", "infinity/nvme_write_gb", "infinity/nvme_read_gbps", "infinity/stall_s",
                    "infinity/pool_peak_mib"):
            assert key in logs, (key, logs)
    end = trainer.engine.stats()["total"]["nvme"]["write_bytes"]
    written = sum(logs["infinity/nvme_write_gb"] for logs in history[1:])  # the first also holds initialize's
    assert written == pytest.approx((end - start) / 1e9 - history[0]["infinity/nvme_write_gb"] + (start / 1e9),
                                    abs=STEPS * 1e-6)  # fmt: skip
    trainer.engine.close()


def test_a_deepspeed_config_without_gradient_clipping_clips_at_deepspeeds_default(tmp_path):
    """Under DeepSpeed the config's gradient_clipping clips and max_grad_norm only fills its
    "auto" (accelerate's clip_grad_norm_ returns DeepSpeed's norm, clipping nothing); a config
    without the key clips at 1.0, DeepSpeed's default since its PR #8068 (0 before: it trained
    unclipped here, where DeepSpeed 0.19.8 clipped), whatever max_grad_norm says (0 here). The
    same run clipped at 1.0 natively is bit for bit this one."""
    ds = _ds(tmp_path)
    del ds["gradient_clipping"]
    kw = {**_kw(tmp_path / "a"), "learning_rate": 0.3}  # norms above 1 (clipping shows)
    ours = integration.InfinityTrainer(model=_llama(), args=integration.TrainingArguments(
        **{**kw, "max_grad_norm": 0.0}, deepspeed=ds), train_dataset=_Tokens())  # fmt: skip
    ours.train()
    assert ours.engine.config.optimizer.max_grad_norm == 1.0
    norms = [h["grad_norm"] for h in _history(ours).values()]
    assert max(norms) > 1.0, norms
    (tmp_path / "swap").mkdir()
    cfg = ours.engine.config
    native = {"tiers": {"params": "nvme", "grads": "cpu", "optimizer": "nvme"},
              "nvme": {"paths": [str(tmp_path / "swap")]}, "prefetch": cfg.to_dict()["prefetch"],
              "optimizer": {"sub_group_size": cfg.optimizer.sub_group_size}}  # fmt: skip
    plain = _DecayAll(model=_llama(), args=transformers.TrainingArguments(
        **{**kw, "output_dir": str(tmp_path / "b"), "max_grad_norm": 1.0}), train_dataset=_Tokens(),
        infinity_config=native)  # fmt: skip
    plain.train()
    a, b = ours.engine.gathered_weights(), plain.engine.gathered_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ours.engine.close()
    plain.engine.close()

"""DeepSpeed configs read as tier configs (infinity/_deepspeed.py): the configs of DeepSpeed's
ZeRO-Infinity and ZeRO-Offload tutorials and of transformers' DeepSpeed docs, written out here,
train bit for bit as the native config they mean; every key is mapped, ignored or refused as
docs/config.md's table (the module's own) says; the schedule is DeepSpeed's formula."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import sys

import pytest
import torch
from torch import nn

import infinity
from infinity import _deepspeed

sys.path.insert(0, os.path.dirname(__file__))
from _common import make_model, train  # noqa: E402

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "config.md")

# DeepSpeed's ZeRO-Infinity tutorial ("Offloading to CPU and NVMe with ZeRO-Infinity").
ZERO_INFINITY = {
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": True,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5,
        "reduce_bucket_size": 1e7,
        "sub_group_size": 1e9,
        "offload_optimizer": {"device": "nvme", "nvme_path": "NVME", "pin_memory": True},
        "offload_param": {"device": "nvme", "nvme_path": "NVME", "pin_memory": True},
    }
}
# DeepSpeed's ZeRO-Offload tutorial.
ZERO_OFFLOAD = {
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "contiguous_gradients": True,
                          "overlap_comm": True},  # fmt: skip
}
# transformers' DeepSpeed docs: ZeRO-3 with its "auto" values, offloaded to the CPU ...
HF_ZERO3_CPU = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},  # fmt: skip
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                  "warmup_num_steps": "auto"}},  # fmt: skip
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
# ... and to NVMe, with its aio section.
HF_ZERO3_NVME = {
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "NVME", "pin_memory": True, "buffer_count": 4,
                              "fast_init": False},  # fmt: skip
        "offload_param": {"device": "nvme", "nvme_path": "NVME", "pin_memory": True, "buffer_count": 5,
                          "buffer_size": 1e8, "max_in_cpu": 1e9},  # fmt: skip
        "aio": None,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False,
            "overlap_events": True},  # fmt: skip
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
del HF_ZERO3_NVME["zero_optimization"]["aio"]  # (aio is top-level; the line above keeps the docs' order)


def _with_path(ds: dict, path) -> dict:
    return json.loads(json.dumps(ds).replace('"NVME"', json.dumps(str(path))))


class _Args:
    """The TrainingArguments values transformers fills "auto" from."""

    learning_rate, adam_beta1, adam_beta2, adam_epsilon, weight_decay = 3e-3, 0.8, 0.99, 1e-7, 0.05
    max_grad_norm, gradient_accumulation_steps, bf16, fp16 = 0.5, 2, False, False

    def get_warmup_steps(self, total):
        return 4


NATIVE = {
    "zero-infinity": {"tiers": {"params": "nvme", "grads": "cpu", "optimizer": "nvme"},
                      "partition": {"stage": 3},
                      "optimizer": {"sub_group_size": 128 << 20, "accumulation": "engine",
                                    "max_grad_norm": 1.0},  # no gradient_clipping: DeepSpeed's default
                      "prefetch": {"bytes": 4 * 10**7}},  # fmt: skip
    "zero-offload": {"tiers": {"params": "device", "grads": "cpu", "optimizer": "cpu"}, "partition": {"stage": 2},
                     "optimizer": {"accumulation": "engine", "max_grad_norm": 1.0}},
    "hf-zero3-cpu": {"tiers": {"params": "cpu", "grads": "cpu", "optimizer": "cpu"}, "partition": {"stage": 3},
                     "optimizer": {"lr": 3e-3, "betas": [0.8, 0.99], "eps": 1e-7, "weight_decay": 0.05,
                                   "max_grad_norm": 0.5, "gradient_accumulation_steps": 2,
                                   "sub_group_size": 128 << 20, "accumulation": "engine"}},  # fmt: skip
    "hf-zero3-nvme": {"tiers": {"params": "nvme", "grads": "cpu", "optimizer": "nvme"}, "partition": {"stage": 3},
                      "aio": {"block_size": 262144, "queue_depth": 32},
                      "optimizer": {"lr": 3e-3, "betas": [0.8, 0.99], "eps": 1e-7, "weight_decay": 0.05,
                                    "max_grad_norm": 0.5, "gradient_accumulation_steps": 2,
                                    "sub_group_size": 128 << 20, "accumulation": "engine"}},  # fmt: skip
}
def test_a_config_without_gradient_clipping_clips_at_deepspeeds_default():
    """DeepSpeed clips at 1.0 where the config has no gradient_clipping (its default since its
    PR #8068; 0 before): the engine did not clip, and trained elsewhere than DeepSpeed 0.19.8
    from the second step on (an audit helper's repro). 0 still turns clipping off."""
    ds = {"zero_optimization": {"stage": 2}}
    assert infinity.TierConfig.from_deepspeed(ds).optimizer.max_grad_norm == 1.0
    assert infinity.TierConfig.from_deepspeed({**ds, "gradient_clipping": 0}).optimizer.max_grad_norm is None
    assert infinity.TierConfig.from_deepspeed({**ds, "gradient_clipping": 0.3}).optimizer.max_grad_norm == 0.3


CONFIGS = {"zero-infinity": (ZERO_INFINITY, None), "zero-offload": (ZERO_OFFLOAD, None),
           "hf-zero3-cpu": (HF_ZERO3_CPU, _Args()), "hf-zero3-nvme": (HF_ZERO3_NVME, _Args())}  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_deepspeed_config_means_its_native_config_and_trains_bit_for_bit_as_it(tmp_path, name):
    ds, args = CONFIGS[name]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    native = copy.deepcopy(NATIVE[name])
    native.setdefault("nvme", {})["paths"] = [str(tmp_path / "b")]
    got = infinity.TierConfig.from_deepspeed(_with_path(ds, tmp_path / "a"), training_args=args)
    want = infinity.TierConfig.from_dict(native)
    assert got.replace(nvme={"paths": want.nvme.paths}) == want
    engines = [infinity.initialize(make_model(), got), infinity.initialize(make_model(), want)]
    losses = []
    for engine in engines:
        torch.manual_seed(3)  # the model's dropout
        losses.append(train(engine, 3))
    assert losses[0] == losses[1]
    a, b = (e.gathered_weights() for e in engines)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for engine in engines:
        engine.close()


def test_initialize_takes_a_ds_config_json_and_its_schedule(tmp_path):
    """``infinity.initialize(model, "ds_config.json")``: the tiers it means and DeepSpeed's
    WarmupDecayLR, whose rates are DeepSpeed's formula (log warm-up, then linear decay)."""
    ds = _with_path(ZERO_INFINITY, tmp_path)
    ds["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3}}
    ds["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3,
                                                            "warmup_num_steps": 4, "total_num_steps": 8}}  # fmt: skip
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    engine = infinity.initialize(make_model(), tmp_path / "ds_config.json")
    assert engine.config.tiers.on_nvme == ("params", "optimizer") and engine.config.optimizer.type == "adamw"
    used = []
    for step in range(8):
        used.append(engine.optimizer.param_groups[0]["lr"])
        train(engine, 1, start=step)

    def ds_lr(k):  # DeepSpeed's rate at its iteration k; the first two steps run at the minimum
        gamma = math.log(k + 1) / math.log(4) if k < 4 else (8 - k) / (8 - 4)
        return 1e-4 + (1e-3 - 1e-4) * gamma

    assert used == pytest.approx([1e-4, ds_lr(0), ds_lr(1), ds_lr(2), ds_lr(3), ds_lr(4), ds_lr(5), ds_lr(6)],
                                 rel=1e-12, abs=0)  # fmt: skip
    engine.close()


def test_deepspeeds_adam_is_adamw_unless_adam_w_mode_is_false():
    """[Note: DeepSpeed's Adam]: read as torch's Adam, "type": "Adam" would train other weights."""
    base = {"zero_optimization": {"stage": 2}}
    assert infinity.TierConfig.from_deepspeed({**base, "optimizer": {"type": "Adam"}}).optimizer.type == "adamw"
    off = {**base, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}
    assert infinity.TierConfig.from_deepspeed(off).optimizer.type == "adam"
    assert infinity.TierConfig.from_deepspeed({**base, "optimizer": {"type": "sgd"}}).optimizer.type == "sgd"


@pytest.mark.parametrize("ds, message", [
    ({"zero_optimization": {"stage": 3, "offload_parm": {}}}, r"key 'zero_optimization.offload_parm' is not one "
                                                                r"this engine knows \(under 'zero_optimization': .*"
                                                                r"offload_param"),
    ({"zero_optimization": {"stage": 0}}, r"'zero_optimization.stage' = 0 is refused: .*plain data parallelism"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, r"needs 'zero_optimization.stage' = 3"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     r"'zero_optimization.offload_param.nvme_path': needed with device 'nvme'"),
    ({"fp16": {"enabled": True, "loss_scale": 1024}}, r"'fp16.loss_scale' = 1024 is refused: a static loss scale"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}, "zero_optimization": {"stage": 1}}, r"both true"),
    ({"optimizer": {"type": "Lamb"}, "train_batch_size": 8}, r"'optimizer.type' = \"Lamb\" is refused"),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}, "train_batch_size": 8},
     r"'optimizer.params.bias_correction' = false is refused"),
    ({"scheduler": {"type": "OneCycle"}, "zero_optimization": {"stage": 1}}, r"'scheduler.type' = \"OneCycle\" is refused"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, r"ZeRO\+\+ quantized weights"),
    ({"pipeline": {"stages": 2}, "train_batch_size": 8}, r"'pipeline' = .* is refused: pipeline parallelism"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     r"partial optimizer offload"),
], ids=["typo", "stage-0", "param-offload-below-3", "no-nvme-path", "static-scale", "bf16-and-fp16", "lamb",
        "no-bias-correction", "one-cycle", "zero++", "pipeline", "partial-offload"])  # fmt: skip
def test_what_cannot_carry_over_is_refused_naming_the_key(ds, message):
    with pytest.raises(ValueError, match=message):
        infinity.TierConfig.from_deepspeed(ds)


def test_a_config_without_zero_is_refused_as_plain_data_parallelism():
    with pytest.raises(ValueError, match=r"'zero_optimization.stage' = 0 is refused"):
        infinity.TierConfig.from_deepspeed({"train_batch_size": 8, "bf16": {"enabled": True}})


def test_disabled_features_and_monitoring_are_accepted():
    ds = {"zero_optimization": {"stage": 1}, "amp": {"enabled": False}, "tensorboard": {"enabled": True},
          "flops_profiler": {"enabled": False}, "autotuning": {"enabled": False}, "steps_per_print": 10,
          "communication_data_type": "fp32", "activation_checkpointing": {"cpu_checkpointing": True}}  # fmt: skip
    cfg = infinity.TierConfig.from_deepspeed(ds)
    assert cfg.partition.stage == 1 and cfg.activations.tier == "cpu"


def test_docs_config_md_holds_the_table_of_every_key():
    """docs/config.md's table is `_deepspeed.RULES` as `table_markdown` writes it."""
    with open(DOCS, encoding="utf-8") as f:
        assert _deepspeed.table_markdown() in f.read()


def test_a_key_twice_in_a_ds_config_json_is_refused_naming_it(tmp_path):
    """json keeps the last of two silently; the tier config's reader refuses it, naming it."""
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3, "stage": 2}}')
    with pytest.raises(ValueError, match=r"ds.json: key 'zero_optimization.stage' appears twice"):
        infinity.TierConfig.from_deepspeed(tmp_path / "ds.json")


def _ds_loop_config(path, **batch) -> dict:
    return {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(path)},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(path)}},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "weight_decay": 0}},
            "gradient_clipping": 0, **batch}  # the plain loops it is held against do not clip  # fmt: skip


@pytest.mark.parametrize("batch", [{"gradient_accumulation_steps": 4},
                                   {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}],
                         ids=["steps", "batch-sizes"])  # fmt: skip
def test_deepspeeds_loop_takes_deepspeeds_steps(tmp_path, batch):
    """A script written for DeepSpeed calls engine.backward and engine.step after every
    micro-batch; DeepSpeed updates on every 4th, on the mean of the four gradients. So does a
    DeepSpeed config here (optimizer.accumulation = "engine"): it updated on every call before,
    on one micro-batch's gradient at full weight, 8 updates instead of 2, and said nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    plain = copy.deepcopy(model)
    engine = infinity.initialize(model, _ds_loop_config(tmp_path, **batch))
    assert engine.config.optimizer.gradient_accumulation_steps == 4
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)) for _ in range(8)]
    stepped = []
    for x, y in batches:
        engine.backward(((engine(x) - y) ** 2).mean())
        stepped.append(engine.step())
    got = engine.gathered_weights()
    engine.close()
    assert stepped == [False, False, False, True] * 2
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for k in range(2):
        opt.zero_grad()
        for x, y in batches[4 * k : 4 * k + 4]:
            (((plain(x) - y) ** 2).mean() / 4).backward()
        opt.step()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-6, atol=1e-7)


def test_deepspeeds_engine_members_a_loop_reads_answer_as_deepspeeds(tmp_path):
    """global_steps, get_lr(), get_global_grad_norm(), was_step_applied(),
    is_gradient_accumulation_boundary() and gradient_accumulation_steps(): a script written for
    DeepSpeed reads them to log and to decide, and each raised AttributeError (audit D). The
    norm is torch's clip_grad_norm_'s of the step's mean gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    plain = copy.deepcopy(model)
    engine = infinity.initialize(model, {**_ds_loop_config(tmp_path, gradient_accumulation_steps=2),
                                         "gradient_clipping": 0.5})  # fmt: skip
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)) for _ in range(4)]
    seen = []
    assert engine.gradient_accumulation_steps() == 2 and engine.get_lr() == [0.1]
    assert engine.get_global_grad_norm() is None  # no step yet
    for x, y in batches:
        boundary = engine.is_gradient_accumulation_boundary()
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()
        seen.append((boundary, engine.was_step_applied(), engine.global_steps, engine.get_global_grad_norm()))
    engine.close()
    assert [s[:3] for s in seen] == [(False, False, 0), (True, True, 1), (False, False, 1), (True, True, 2)]
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    norms = []
    for k in range(2):
        opt.zero_grad()
        for x, y in batches[2 * k : 2 * k + 2]:
            (((plain(x) - y) ** 2).mean() / 2).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)))
        opt.step()
    assert norms[0] > 0.5  # it clipped
    assert seen[1][3] == pytest.approx(norms[0], rel=1e-5) and seen[3][3] == pytest.approx(norms[1], rel=1e-5)
    assert engine.skipped_steps == 0


def test_the_global_grad_norm_is_the_steps_without_clipping_too(tmp_path):
    """DeepSpeed's ZeRO computes the norm at every step, clipping or not; the engine's
    get_global_grad_norm() was None without gradient_clipping, and a script formatting it
    raised a TypeError (an audit helper, against DeepSpeed 0.19.8)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    plain = copy.deepcopy(model)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    with infinity.initialize(model, _ds_loop_config(tmp_path)) as engine:  # gradient_clipping 0
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()
        got = engine.get_global_grad_norm()
    ((plain(x) - y) ** 2).mean().backward()
    assert got == pytest.approx(float(torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()])), rel=1e-5)


@pytest.mark.parametrize("how", ["zero_grad", "load_checkpoint"])
def test_a_step_redone_from_its_first_micro_batch_takes_deepspeeds_steps(tmp_path, how, caplog):
    """A DeepSpeed loop that drops a step part-way (one micro-batch of four, then
    engine.zero_grad(), as the engine's own refusals advise; or a load of the checkpoint saved
    at the last step) and runs the step again from its first micro-batch updates where the
    uninterrupted run does: the count of micro-batches starts over with the step (it went on
    from where the dropped one stopped: an update one micro-batch early, on part of a gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)) for _ in range(8)]

    def micro(engine, x, y):
        engine.backward(((engine(x) - y) ** 2).mean())
        return engine.step()

    with infinity.initialize(copy.deepcopy(model), _ds_loop_config(tmp_path / "a", gradient_accumulation_steps=4)) as e:
        want_steps = [micro(e, x, y) for x, y in batches]
        want = e.gathered_weights()
    with infinity.initialize(model, _ds_loop_config(tmp_path / "b", gradient_accumulation_steps=4)) as e:
        steps = [micro(e, x, y) for x, y in batches[:4]]
        e.save_checkpoint(tmp_path / "ckpt")
        assert micro(e, *batches[4]) is False  # one micro-batch of the second step, then dropped
        with pytest.raises(RuntimeError, match=r"engine.step\(\) updates at the last of 4; 1 counted"):
            e.save_checkpoint(tmp_path / "mid")  # its advice: not "call step()", which would not update
        if how == "zero_grad":
            e.zero_grad()
            assert "starts over from its first micro-batch" in caplog.text
        else:  # (a load between backward and step is refused: the gradients are dropped first)
            e.zero_grad()
            e.load_checkpoint(tmp_path / "ckpt")
        steps += [micro(e, x, y) for x, y in batches[4:]]
        got = e.gathered_weights()
    assert steps == want_steps == [False, False, False, True] * 2
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_deepspeeds_batch_sizes_give_the_steps_at_the_world_size_and_must_agree(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = {"zero_optimization": {"stage": 2}, "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}
    assert infinity.TierConfig.from_deepspeed(ds).optimizer.gradient_accumulation_steps == 4
    with pytest.raises(ValueError, match=r"'train_batch_size' = 32, 'train_micro_batch_size_per_gpu' = 4 and "
                                         r"'gradient_accumulation_steps' = 2 disagree at world size 2"):  # fmt: skip
        infinity.TierConfig.from_deepspeed({**ds, "gradient_accumulation_steps": 2})


@pytest.mark.parametrize("kind, params, want", [
    ("AdamW", {"lr": 3e-4}, {"type": "adamw", "lr": 3e-4, "weight_decay": 0.0, "eps": 1e-8, "betas": (0.9, 0.999)}),
    ("Adam", {}, {"type": "adamw", "lr": 1e-3, "weight_decay": 0.0}),
    ("SGD", {"lr": 0.5}, {"type": "sgd", "lr": 0.5, "weight_decay": 0.0, "momentum": 0.0}),
    ("Adagrad", {}, {"type": "adagrad", "lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0}),
    # torch_adam builds torch.optim.AdamW from the params: its weight decay 0.01 (Adam's 0)
    ("AdamW", {"torch_adam": True}, {"type": "adamw", "lr": 1e-3, "weight_decay": 0.01}),
    ("Adam", {"torch_adam": True, "adam_w_mode": False}, {"type": "adam", "weight_decay": 0.0}),
])  # fmt: skip
def test_what_deepspeeds_optimizer_params_leave_out_is_deepspeeds_default(kind, params, want):
    """DeepSpeed's optimizers have no weight decay unless asked (this engine's default is 0.01),
    Adam's lr is 1e-3 (here 1e-4), Adagrad's eps 1e-10: a params section that leaves them out
    trained otherwise than under DeepSpeed, with nothing said."""
    ds = {"zero_optimization": {"stage": 2}, "optimizer": {"type": kind, "params": params}}
    got = infinity.TierConfig.from_deepspeed(ds).optimizer
    assert {k: getattr(got, k) for k in want} == want


def test_values_that_disagree_with_the_training_arguments_are_refused_naming_them():
    """transformers refuses a DeepSpeed config whose set values disagree with its arguments;
    here the config's lr won, the arguments' accumulation and clipping, with nothing said."""
    ds = {"zero_optimization": {"stage": 2}, "gradient_clipping": 5.0, "gradient_accumulation_steps": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": "auto"}}}  # fmt: skip
    with pytest.raises(ValueError) as info:
        infinity.TierConfig.from_deepspeed(ds, training_args=_Args())
    said = str(info.value)
    assert "'optimizer.params.lr' = 0.01 but TrainingArguments' learning_rate = 0.003" in said
    assert "'optimizer.params.betas' = [0.9, 0.95] but TrainingArguments' adam_beta1, adam_beta2 = 0.8, 0.99" in said
    assert "'gradient_clipping' = 5.0 but TrainingArguments' max_grad_norm = 0.5" in said
    agreed = {**ds, "gradient_clipping": 0.5, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.8, 0.99]}}}
    assert infinity.TierConfig.from_deepspeed(agreed, training_args=_Args()).optimizer.lr == 3e-3


def test_a_ds_config_without_an_optimizer_needs_one_given(tmp_path):
    """DeepSpeed builds no optimizer from a config without an "optimizer" section where none is
    given (its backward refuses); the engine trained on an AdamW of its own defaults (lr 1e-4,
    weight decay 0.01), with nothing said (an audit helper's repro). Refused, saying what to
    give; an optimizer given, or a frozen model (inference), is taken."""
    ds = {"zero_optimization": {"stage": 3}}
    with pytest.raises(ValueError, match=r'no "optimizer" section and initialize was given no optimizer='):
        infinity.initialize(make_model(), ds)
    model = make_model()
    infinity.initialize(model, ds, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).close()
    infinity.initialize(make_model().requires_grad_(False), ds).close()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_precision_section_left_out_is_the_training_arguments_mixed_precision(precision):
    """Under the Trainer, accelerate adds the section a DeepSpeed config leaves out from the
    arguments' bf16 or fp16 (DeepSpeedPlugin.set_mixed_precision), so DeepSpeed trains 16-bit
    parameters; the engine kept fp32 ones, with nothing said (an audit helper's repro). A
    section the config has is its own, and one that disagrees is refused, as before."""
    args = type("Args", (_Args,), {precision: True})()
    ds = {"zero_optimization": {"stage": 3}}
    assert infinity.TierConfig.from_deepspeed(ds, training_args=args).precision.param_dtype == precision
    assert infinity.TierConfig.from_deepspeed(ds, training_args=_Args()).precision.param_dtype == "fp32"
    assert infinity.TierConfig.from_deepspeed({**ds, precision: {"enabled": "auto"}},
                                              training_args=args).precision.param_dtype == precision  # fmt: skip
    with pytest.raises(ValueError, match=rf"'{precision}.enabled' = false but TrainingArguments' {precision} = True"):
        infinity.TierConfig.from_deepspeed({**ds, precision: {"enabled": False}}, training_args=args)


def test_deepspeeds_step_after_a_plain_backward_is_refused_and_the_optimizers_step_steps(tmp_path):
    """engine.step() counts the micro-batches for engine.backward, which divides each loss: after
    a plain loss.backward() (nothing divided) the step would take the sum of the gradients, so it
    is refused, naming the fix. engine.optimizer.step() (what accelerate and the Trainer call,
    once per step, the loss divided by their own count) updates whenever it is called."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    plain = copy.deepcopy(model)
    engine = infinity.initialize(model, _ds_loop_config(tmp_path, gradient_accumulation_steps=2))
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    ((engine(x) - y) ** 2).mean().backward()
    with pytest.raises(RuntimeError, match=r"came from a plain loss.backward\(\).*Call engine.backward\(loss\)"):
        engine.step()
    engine.zero_grad()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)) for _ in range(4)]
    for i, (x, y) in enumerate(batches):  # accelerate's loop: the loss divided by its count, one step per two
        (((engine(x) - y) ** 2).mean() / 2).backward()
        if i % 2:
            assert engine.optimizer.step()
            engine.optimizer.zero_grad()
    got = engine.gathered_weights()
    engine.close()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches):
        (((plain(x) - y) ** 2).mean() / 2).backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-6, atol=1e-7)


def _lrs(ds: dict, steps: int, lr: float = 5e-2, **kwargs) -> list[float]:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = infinity.deepspeed_lr_scheduler(ds, **kwargs)(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    return out


@pytest.mark.parametrize("warmup, total", [(5, 3), (1, 1), (0, 1)])
def test_a_decay_shorter_than_its_warmup_trains_as_deepspeeds(warmup, total, caplog):
    """DeepSpeed's WarmupDecayLR with total_num_steps under warmup_num_steps (at least 2) warns
    and trains: the warm-up, then the minimum. The engine refused it, which stopped a Trainer run
    with max_steps=1 and every value "auto" (an audit helper's repro)."""
    ds = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                                             "warmup_num_steps": warmup, "total_num_steps": total}}}
    with caplog.at_level(logging.WARNING, logger="infinity"):
        got = _lrs(ds, 8)
    assert "is less than warmup_num_steps" in caplog.text
    steps = max(2, warmup)
    want = [0.0] + [0.1 * math.log(k + 1) / math.log(steps) for k in range(steps)] + [0.0] * (7 - steps)
    assert got == pytest.approx(want, rel=1e-12, abs=0)


def test_a_warmup_without_its_maximum_takes_deepspeeds_default():
    """DeepSpeed's WarmupLR without warmup_max_lr warms up to the optimizer's lr (its
    lr_schedules.py); the engine went to 1e-3 (20x a 5e-5 lr, silently). WarmupDecayLR keeps
    DeepSpeed's 1e-3."""
    warmup = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}
    assert _lrs(warmup, 4) == [0.0, 0.0, 5e-2, 5e-2]
    decay = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 10}}}
    assert _lrs(decay, 3)[2] == 1e-3


def test_set_batch_sizes_and_schedule_values_that_disagree_with_the_training_arguments_are_refused():
    """transformers refuses these too (HfTrainerDeepSpeedConfig.fill_match); the engine took the
    Trainer's batch sizes and the config's schedule values, with nothing said."""

    class Args(_Args):
        per_device_train_batch_size, world_size = 4, 1

    ds = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 8, "train_batch_size": 16}
    with pytest.raises(ValueError) as info:
        infinity.TierConfig.from_deepspeed(ds, training_args=Args())
    assert "'train_micro_batch_size_per_gpu' = 8 but TrainingArguments' per_device_train_batch_size = 4" in str(info.value)
    assert "'train_batch_size' = 16 but TrainingArguments' train_batch_size (calculated) = 8" in str(info.value)
    agreed = {**ds, "train_micro_batch_size_per_gpu": 4, "train_batch_size": 8}
    infinity.TierConfig.from_deepspeed(agreed, training_args=Args())  # (the Trainer counts the micro-batches)
    sched = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 5,
                                                                "total_num_steps": 20}}}  # fmt: skip
    with pytest.raises(ValueError) as info:
        infinity.deepspeed_lr_scheduler(sched, training_args=Args(), num_training_steps=10)
    said = str(info.value)
    assert "'scheduler.params.warmup_max_lr' = 0.01 but TrainingArguments' learning_rate = 0.003" in said
    assert "'scheduler.params.warmup_num_steps' = 5 but TrainingArguments' warmup_steps = 4" in said
    assert "'scheduler.params.total_num_steps' = 20 but TrainingArguments' num_training_steps (calculated) = 10" in said
    auto = {"scheduler": {"type": "WarmupDecayLR", "params": dict.fromkeys(
        ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"), "auto")}}  # fmt: skip
    assert max(_lrs(auto, 10, training_args=Args(), num_training_steps=10)) == 3e-3


def test_the_accumulation_steps_derived_from_the_batch_sizes_take_the_process_groups_world_size(monkeypatch):
    """train_batch_size = micro x steps x world: the world is the process group's, as DeepSpeed
    takes it. From WORLD_SIZE alone, ranks that torch.multiprocessing.spawn started (no such
    variable) took 1, and 2 ranks accumulated 4 micro-batches where DeepSpeed does 2, each loss
    divided by 4 (an audit helper's repro)."""
    import torch.distributed as dist

    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "zero_optimization": {"stage": 2}}
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert infinity.TierConfig.from_deepspeed(ds).optimizer.gradient_accumulation_steps == 4  # one rank
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert infinity.TierConfig.from_deepspeed(ds).optimizer.gradient_accumulation_steps == 2

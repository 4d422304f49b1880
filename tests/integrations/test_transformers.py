"""InfinityTrainer against plain transformers.Trainer: same model, data, schedule, logged losses.

Tolerance 1e-5 on every logged loss: both run AdamW in fp32 (the engine with torch's fused CPU
kernel, the Trainer with its default), the same clipping formula and the same data order, so
they differ by float rounding only.
"""

import contextlib

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from infinity.integrations.transformers import ENGINE_DIR, InfinityTrainer  # noqa: E402

STEPS = 20


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=48, length=16):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attention_dropout=0.0)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _args(out, **over):
    kw = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
              learning_rate=3e-3, weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=4, max_grad_norm=1.0,
              logging_steps=1, save_steps=10, save_strategy="steps", report_to=[], use_cpu=True, seed=0,
              dataloader_num_workers=0, disable_tqdm=True)  # fmt: skip
    kw.update(over)
    return transformers.TrainingArguments(**kw)


def _losses(trainer):
    return {h["step"]: (h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history if "loss" in h}


def _nvme(tmp_path):
    (tmp_path / "swap").mkdir(exist_ok=True)
    return {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
            "nvme": {"paths": [str(tmp_path / "swap")], "grow_step": "4MiB"}, "memory": {"host_budget": "256MiB"}}


def test_the_trainer_on_nvme_logs_the_losses_of_plain_trainer_and_resumes_identically(tmp_path):
    plain = transformers.Trainer(model=_llama(), args=_args(tmp_path / "plain"), train_dataset=_Tokens())
    plain.train()
    want = _losses(plain)

    ours = InfinityTrainer(model=_llama(), args=_args(tmp_path / "ours"), train_dataset=_Tokens(),
                           infinity_config=_nvme(tmp_path))  # fmt: skip
    ours.train()
    got = _losses(ours)
    assert got.keys() == want.keys() and len(got) == STEPS
    for step in want:
        (loss, norm, lr), (ref_loss, ref_norm, ref_lr) = got[step], want[step]
        assert abs(loss - ref_loss) < 1e-5, (step, loss, ref_loss)
        assert abs(norm - ref_norm) < 1e-4 * max(1.0, ref_norm), (step, norm, ref_norm)
        assert lr == pytest.approx(ref_lr, rel=1e-12), step
    # The Trainer's accumulation reaches the engine: the optimizer overlaps the second micro-batch.
    assert ours.engine.config.optimizer.gradient_accumulation_steps == 2
    assert ours.engine.overlap is not None
    checkpoint = tmp_path / "ours" / "checkpoint-10"
    assert (checkpoint / ENGINE_DIR / "state" / "meta.json").is_file()
    ours.engine.close()

    resumed = InfinityTrainer(model=_llama(), args=_args(tmp_path / "resumed"), train_dataset=_Tokens(),
                              infinity_config=_nvme(tmp_path))  # fmt: skip
    resumed.train(resume_from_checkpoint=str(checkpoint))
    after = {s: v for s, v in _losses(resumed).items() if s > 10}  # the history before is the checkpoint's
    assert sorted(after) == list(range(11, STEPS + 1))
    assert all(after[s] == got[s] for s in after), [(s, after[s], got[s]) for s in after if after[s] != got[s]]
    resumed.engine.close()


def test_model_init_trains_the_new_model_at_each_train_call(tmp_path):
    """Trainer.train makes a new model at each call with model_init (hyperparameter_search's
    trials): the second trained on the first's engine, which held the old model, so the new
    one trained on nothing (grad_norm 0.0) and save_model wrote the old weights (an audit
    helper's repro). Each call now logs plain Trainer's losses and saves the live weights."""
    from safetensors.torch import load_file

    args = dict(max_steps=4, gradient_accumulation_steps=1, save_strategy="no")
    plain = transformers.Trainer(model_init=_llama, args=_args(tmp_path / "plain", **args), train_dataset=_Tokens())
    ours = InfinityTrainer(model_init=_llama, args=_args(tmp_path / "ours", **args), train_dataset=_Tokens(),
                           infinity_config=_nvme(tmp_path))  # fmt: skip
    for call in range(2):
        plain.train()
        want = _losses(plain)
        ours.train()
        got = _losses(ours)
        assert got.keys() == want.keys(), call
        for step in want:
            assert got[step][:2] == pytest.approx(want[step][:2], abs=1e-4), (call, step, got[step], want[step])
    ours.save_model(str(tmp_path / "final"))
    saved, live = load_file(str(tmp_path / "final" / "model.safetensors")), ours.engine.gathered_weights()
    assert all(torch.equal(saved[k], live[k]) for k in saved)
    ours.engine.close()


def test_a_trainer_given_its_own_optimizer_is_refused(tmp_path):
    model = _llama()
    with pytest.raises(ValueError, match="makes its optimizer from TrainingArguments"):
        InfinityTrainer(model=model, args=_args(tmp_path), train_dataset=_Tokens(),
                        optimizers=(torch.optim.AdamW(model.parameters()), None))  # fmt: skip


@pytest.mark.parametrize("how", ["initialize", "build", "from_pretrained"])
def test_plain_trainer_on_an_engine_module_is_refused_not_trained_silently(tmp_path, how):
    """Whatever made the engine (a built or streamed model's placeholders once lacked the mark,
    and plain Trainer "trained" them: loss fixed, grad_norm 0, weights unchanged)."""
    import infinity

    if how == "from_pretrained":
        _llama().save_pretrained(tmp_path / "in")
        engine = infinity.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "in", _nvme(tmp_path))
    else:
        with infinity.build() if how == "build" else contextlib.nullcontext():
            model = _llama()
        engine = infinity.initialize(model, _nvme(tmp_path))
    with engine:
        trainer = transformers.Trainer(model=engine.module, args=_args(tmp_path / "out", max_steps=1),
                                       train_dataset=_Tokens())  # fmt: skip
        with pytest.raises(RuntimeError, match="on parameters that an infinity engine manages"):
            trainer.train()


@pytest.mark.parametrize("resume", ["path", "last"])
def test_a_resume_from_a_checkpoint_without_the_engines_state_is_refused_naming_the_directory(tmp_path, resume):
    """Without ``<checkpoint>/infinity`` the run went on with fresh Adam moments and step counts
    (its steps differed from the uninterrupted run's) and said nothing. ``resume=True`` picks
    the last checkpoint in output_dir: the same check."""
    import shutil

    out = tmp_path / "out"
    first = InfinityTrainer(model=_llama(), args=_args(out, max_steps=2, save_steps=2), train_dataset=_Tokens(),
                            infinity_config=_nvme(tmp_path))  # fmt: skip
    first.train()
    first.engine.close()
    missing = out / "checkpoint-2" / ENGINE_DIR
    shutil.rmtree(missing)

    again = InfinityTrainer(model=_llama(), args=_args(out, max_steps=4, save_steps=2), train_dataset=_Tokens(),
                            infinity_config=_nvme(tmp_path))  # fmt: skip
    with pytest.raises(FileNotFoundError, match=str(missing)) as refused:
        again.train(resume_from_checkpoint=str(out / "checkpoint-2") if resume == "path" else True)
    assert "save_only_model=True" in str(refused.value)  # the likely cause, named
    assert again.engine is None  # refused before an engine (and its swap space) was made


def test_the_trainer_trains_fp16_parameters_with_the_engines_loss_scale(tmp_path):
    """The Trainer calls a plain loss.backward(); in fp16 the engine needs its loss scale in the
    gradient (it refused the first backward, naming engine.backward). InfinityTrainer passes
    the loss through engine.scale_backward: it trains, and reports the loss, not the scaled one."""
    trainer = InfinityTrainer(model=_llama(), args=_args(tmp_path / "a", max_steps=4, save_strategy="no"),
                                          train_dataset=_Tokens(),
                                          infinity_config={"precision": {"param_dtype": "fp16"}})  # fmt: skip
    trainer.train()
    losses = [loss for loss, _, _ in _losses(trainer).values()]
    assert len(losses) == 4 and all(2.0 < x < 6.0 for x in losses), losses  # ln(64) ~ 4.2: not x 65536
    assert trainer.engine.stats()["steps"] == 4
    trainer.engine.close()


def test_accelerates_fp16_grad_scaler_is_not_put_over_the_engines(tmp_path, monkeypatch):
    """With fp16 on a GPU accelerate makes a GradScaler; over the engine's it scaled the loss
    twice and, stepping, found no .grad to unscale ("No inf checks were recorded": an audit
    helper's repro). Here accelerate's GPU scaler is put where it puts it: the run trains as
    the one without."""
    made = transformers.Trainer.create_accelerator_and_postprocess

    def as_on_a_gpu(self):
        made(self)
        self.accelerator.scaler = torch.amp.GradScaler("cpu")

    def run(out):
        trainer = InfinityTrainer(model=_llama(), args=_args(out, max_steps=3, save_strategy="no"), train_dataset=_Tokens(),
                                  infinity_config={"precision": {"param_dtype": "fp16"}})  # fmt: skip
        trainer.train()
        trainer.engine.close()
        return _losses(trainer)

    want = run(tmp_path / "cpu")
    monkeypatch.setattr(transformers.Trainer, "create_accelerator_and_postprocess", as_on_a_gpu)
    assert run(tmp_path / "gpu") == want


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fp16_autocast_over_parameters_the_engine_does_not_scale_is_refused(tmp_path, monkeypatch, dtype):
    """fp16=True on a GPU: accelerate's fp16 autocast and GradScaler, which the engine drops.
    With fp32 or bf16 parameters the engine scales nothing, and the backward ran unscaled:
    small gradients flushed to zero (an audit helper's repro, a GradScaler put where accelerate
    puts it on a GPU: grad_norm 0.0 and no weight moved, where plain Trainer trained). Refused
    before training, naming the key. Without accelerate's scaler (fp16=True on the CPU, no
    autocast) nothing is refused."""
    made = transformers.Trainer.create_accelerator_and_postprocess

    def as_on_a_gpu(self):
        made(self)
        self.accelerator.scaler = torch.amp.GradScaler("cpu")

    def trainer(out):
        return InfinityTrainer(model=_llama(), args=_args(out, max_steps=1, save_strategy="no", fp16=True),
                               train_dataset=_Tokens(), infinity_config={"precision": {"param_dtype": dtype}})  # fmt: skip

    on_cpu = trainer(tmp_path / "cpu")
    on_cpu.train()
    on_cpu.engine.close()
    monkeypatch.setattr(transformers.Trainer, "create_accelerator_and_postprocess", as_on_a_gpu)
    with pytest.raises(ValueError, match=f"fp16 autocast.*param_dtype = '{dtype}'.*param_dtype = \"fp16\""):
        trainer(tmp_path / "gpu").train()


def test_a_step_the_engine_skips_does_not_step_the_lr_schedule(tmp_path):
    """fp16 from a loss scale that overflows: the engine skips those steps, and the Trainer
    does not step the LR schedule for them, as under torch's GradScaler or DeepSpeed (it did:
    the schedule ran ahead of the weights, accelerate knowing of skips only through its own
    scaler)."""
    config = {"precision": {"param_dtype": "fp16", "initial_scale": 2.0 ** 24}}
    trainer = InfinityTrainer(model=_llama(), args=_args(tmp_path / "a", max_steps=10, save_strategy="no",
                                                         lr_scheduler_type="linear"),
                              train_dataset=_Tokens(), infinity_config=config)  # fmt: skip
    trainer.train()
    skipped = trainer.engine.stats()["total"]["skipped_steps"]
    assert 0 < skipped < 10  # some skipped, some taken
    assert trainer.lr_scheduler.last_epoch == 10 - skipped
    trainer.engine.close()


@pytest.mark.parametrize("key,value,arg", [("lr", 1e-2, "learning_rate"), ("max_grad_norm", 0.1, "max_grad_norm"),
                                           ("betas", (0.5, 0.6), "adam_beta1"), ("type", "sgd", "optim")])  # fmt: skip
def test_an_engine_config_s_optimizer_key_the_trainer_sets_is_refused_where_it_disagrees(tmp_path, key, value, arg):
    """Under InfinityTrainer the TrainingArguments make the optimizer and clip; the engine
    config's [optimizer] values for them were ignored (lr, betas, the type) or applied on top
    (max_grad_norm: a second clip), with nothing said. Refused by name, as a DeepSpeed config's
    disagreeing values are."""
    cfg = _nvme(tmp_path)
    cfg["optimizer"] = {key: value}
    trainer = InfinityTrainer(model=_llama(), args=_args(tmp_path / "out", max_steps=1), train_dataset=_Tokens(),
                              infinity_config=cfg)  # fmt: skip
    with pytest.raises(ValueError, match=f"optimizer.{key} = .*TrainingArguments.{arg}"):
        trainer.train()


def test_an_engine_config_s_clip_that_agrees_leaves_clipping_to_the_trainer(tmp_path):
    cfg = _nvme(tmp_path)
    cfg["optimizer"] = {"max_grad_norm": 1.0, "lr": 3e-3}  # both as the arguments have them
    trainer = InfinityTrainer(model=_llama(), args=_args(tmp_path / "out", max_steps=1), train_dataset=_Tokens(),
                              infinity_config=cfg)  # fmt: skip
    trainer.train()
    assert trainer.engine.config.optimizer.max_grad_norm is None  # once, by the Trainer's _clip_grad_norm
    trainer.engine.close()


def test_full_eval_in_another_dtype_than_the_engine_s_is_refused_before_training(tmp_path):
    """bf16_full_eval casts the model before evaluating: with parameters on nvme the cast
    reached only the empty placeholders, and evaluation ran in fp32 with nothing said."""
    trainer = InfinityTrainer(model=_llama(), args=_args(tmp_path / "out", max_steps=1, bf16_full_eval=True),
                              train_dataset=_Tokens(), infinity_config=_nvme(tmp_path))  # fmt: skip
    with pytest.raises(ValueError, match="bf16_full_eval casts the model to bf16"):
        trainer.train()


def test_parameters_a_model_keeps_in_fp32_are_named_when_bf16_casts_them(tmp_path, caplog):
    """transformers keeps a model's _keep_in_fp32_modules (T5's ``wo``) in fp32 beside bf16
    weights; the engine computes every parameter in precision.param_dtype, as DeepSpeed does,
    which no error shows (an audit helper: the update's direction 0.98 of plain's): said at
    initialize, naming them, whether the model came mixed or all in fp32. A model without such
    modules, made in fp32, is cast without a word."""
    import infinity

    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    fp32 = transformers.T5ForConditionalGeneration(cfg)
    mixed = transformers.T5ForConditionalGeneration(cfg).to(torch.bfloat16)
    for name, module in mixed.named_modules():
        if name.endswith(".wo"):
            module.float()
    tiers = {"tiers": {"params": "device", "grads": "device", "optimizer": "cpu"}, "precision": {"param_dtype": "bf16"}}
    for model, what in ((mixed, "holds in another dtype"), (fp32, "of the modules the model keeps in fp32")):
        caplog.clear()
        with caplog.at_level("WARNING", logger="infinity"), infinity.initialize(model, tiers):
            pass
        said = [r.getMessage() for r in caplog.records if "computes every parameter" in r.getMessage()]
        assert len(said) == 1 and what in said[0], said
        assert "'encoder.block.0.layer.1.DenseReluDense.wo.weight'" in said[0] and "['wo']" in said[0], said
    caplog.clear()
    with caplog.at_level("WARNING", logger="infinity"), infinity.initialize(_llama(), tiers):
        pass
    assert not [r for r in caplog.records if "computes every parameter" in r.getMessage()]

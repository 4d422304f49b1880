"""transformers' Trainer with params, grads and optimizer state in infinity's tiers.

    from infinity.integrations.transformers import InfinityTrainer

    trainer = InfinityTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                              infinity_config="tiers.toml")
    trainer.train()                                  # or train(resume_from_checkpoint=...)

Everything the Trainer does stays the Trainer's: its data loading, logging, evaluation,
gradient accumulation, LR schedule (``lr_scheduler_type``, ``warmup_steps``), weight-decay
groups (no decay on biases and norms; a DeepSpeed config's optimizer section decays every
parameter, as under DeepSpeed), ``save_steps`` and ``resume_from_checkpoint``. What
changes, when training starts:

- the optimizer the Trainer would make (``TrainingArguments.optim``: the adamw_torch family,
  sgd or adagrad, with its ``learning_rate``, betas, eps and groups) is given to
  `infinity.initialize`, and the Trainer uses ``engine.optimizer``;
- fp16 parameters (``precision.param_dtype = "fp16"``, a DeepSpeed config's ``fp16``) train with
  the engine's loss scale, brought in by the loss the Trainer backpropagates
  (`Engine.scale_backward`: its value, which the Trainer reports, unchanged); ``fp16=True`` on
  a GPU (fp16 autocast, whose gradients need a loss scale) over fp32 or bf16 parameters is
  refused, as the engine scales none;
- gradient clipping (``max_grad_norm``; with a DeepSpeed config its ``gradient_clipping``, as
  under DeepSpeed) is the engine's, at its step, on the gradients in the tiers; the logged
  ``grad_norm`` is their global norm before clipping;
- a checkpoint's optimizer state is the engine's checkpoint in ``<checkpoint>/infinity``
  (every tensor in the tiers, checksummed, resharded on load), beside the Trainer's own files;
  ``resume_from_checkpoint`` (a path, or True: the last checkpoint in ``output_dir``) naming a
  checkpoint without it is refused, since the run would go on with fresh optimizer state;
- the model is not wrapped in DistributedDataParallel under ``torchrun``: the engine reduces
  the gradients across ranks itself (accelerate still applies its autocast).

The model's weights (``save_model``, and each checkpoint's) are written by
``engine.save_pretrained``, on every rank: each unit is gathered to rank 0, which writes it, so
no rank holds the whole model, whatever the world size. A PEFT model is saved as the Trainer
saves it, through the module's ``state_dict()``, which every rank calls and rank 0 gets whole:
of the keys peft keeps alone (the adapters, not the frozen base: `_peft`).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import transformers
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import get_last_checkpoint

import infinity

from .. import _deepspeed
from . import _peft
from .._resources import as_config
from ..config import OptimizerConfig

ENGINE_DIR = "infinity"  # inside a Trainer checkpoint directory
_SCHEDULER_NAME = "scheduler.pt"  # the Trainer's name for it


@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers' TrainingArguments whose ``deepspeed`` (a ds_config.json or its dict) is
    the engine's config, read by `TierConfig.from_deepspeed` with these arguments filling its
    "auto" values, instead of turning DeepSpeed on (which needs the deepspeed package): a script
    written for ``TrainingArguments(deepspeed=...)`` and Trainer runs on the engine with one
    changed import, ``from infinity.integrations.transformers import InfinityTrainer as
    Trainer, TrainingArguments``, or with none under ``python -m infinity.integrations.launch``."""

    def __post_init__(self):
        # Kept beside the arguments, not in ``deepspeed``: transformers would start DeepSpeed.
        self.infinity_deepspeed, self.deepspeed = self.deepspeed, None
        super().__post_init__()
        if self.infinity_deepspeed is not None:
            self.infinity_deepspeed = _deepspeed.load(self.infinity_deepspeed)  # a bad file: said now, not at train()


class _SkippedSteps(transformers.TrainerCallback):
    """Tells accelerate's optimizer wrapper when the engine skipped a step (an fp16 overflow, a
    non-finite gradient), so that the Trainer does not step the LR schedule for it, as it does
    not under torch's GradScaler or DeepSpeed: the schedule ran ahead of the weights before
    (accelerate knows of skips only through its own scaler)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        wrapper, engine = self.trainer.optimizer, self.trainer.engine
        if engine is not None and hasattr(wrapper, "_is_overflow"):  # accelerate's AcceleratedOptimizer
            wrapper._is_overflow = engine.optimizer.step_was_skipped


class InfinityTrainer(transformers.Trainer):
    """`transformers.Trainer` whose model is trained by an infinity engine
    (``infinity_config``: what `infinity.initialize` takes, a DeepSpeed config included; by
    default the ``deepspeed`` of this module's `TrainingArguments`). ``engine`` is None until
    training starts. ``log_engine_stats``: the engine's figures in the Trainer's logs
    (`EngineStatsCallback`)."""

    def __init__(self, *args, infinity_config=None, log_engine_stats: bool = True, **kwargs):
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers and optimizers[0] is not None:
            raise ValueError("InfinityTrainer makes its optimizer from TrainingArguments (optim, learning_rate, "
                             "weight_decay, ...) and runs it in the engine: pass optimizers=(None, scheduler)")  # fmt: skip
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(given, "deepspeed", None):
            raise ValueError("transformers.TrainingArguments(deepspeed=...) starts DeepSpeed itself; with "
                             "InfinityTrainer use infinity.integrations.transformers.TrainingArguments, whose "
                             "deepspeed is the engine's config, or pass infinity_config=")  # fmt: skip
        self.infinity_config = infinity_config
        self.engine = None
        super().__init__(*args, **kwargs)
        if infinity_config is None:
            self.infinity_config = getattr(self.args, "infinity_deepspeed", None)
        # Under DeepSpeed its config's gradient_clipping clips, not max_grad_norm (`_clip_grad_norm`).
        self._config_clips = _deepspeed.is_deepspeed(self.infinity_config)
        self.add_callback(_SkippedSteps(self))
        if log_engine_stats:
            log_stats(self, lambda: self.engine)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # fp16 on a GPU: accelerate makes a GradScaler (this Trainer is not in DeepSpeed mode),
        # which scaled the loss on top of the engine's scale and then, stepping the engine's
        # optimizer, found no .grad to unscale ("No inf checks were recorded for this
        # optimizer": an audit helper's repro, a GradScaler put where accelerate puts it on a
        # GPU). The engine scales fp16 losses itself (`compute_loss`), as
        # DeepSpeed's engine does under the Trainer: accelerate's goes. Whether it made one is
        # kept: its fp16 autocast still runs, and without fp16 parameters the engine scales
        # nothing (`_refuse_unscaled_fp16`).
        self._autocast_scaled = self.accelerator.scaler is not None
        self.accelerator.scaler = None

    def _deepspeed_config(self) -> dict | None:
        return _deepspeed.load(self.infinity_config) if _deepspeed.is_deepspeed(self.infinity_config) else None

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:
            # Resolved here so that the check below sees the directory the Trainer will load.
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True  # True: the Trainer says none
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            _engine_state(resume_from_checkpoint)  # before an engine and its swap space are made
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # -- the optimizer is the engine's ------------------------------------------------------
    def create_optimizer(self, model=None):
        if self.engine is not None and self.engine.module is not self.model:
            # model_init made a new model (Trainer.train does at each call with one, as
            # hyperparameter_search's trials do): the last engine's is not it. Kept, the new
            # model trained on nothing (grad_norm 0.0, weights unchanged) and save_model wrote
            # the old one's weights (an audit helper's repro). Its engine goes, the new one's comes.
            self.engine.close()
            self.engine = None
        if self.engine is None:
            # The engine overlaps the optimizer with the last micro-batch's backward: it needs
            # the Trainer's accumulation to know which that is.
            ds = self._deepspeed_config()
            if ds is not None:
                cfg = infinity.TierConfig.from_deepspeed(ds, training_args=self.args)
            else:
                cfg = _trainer_owned(as_config(self.infinity_config), self.args)
            _refuse_full_eval_cast(cfg, self.args)
            _refuse_unscaled_fp16(cfg, self._autocast_scaled)
            # The Trainer counts the micro-batches (and scales the loss): the engine steps when told.
            cfg = cfg.replace(optimizer={"gradient_accumulation_steps": self.args.gradient_accumulation_steps,
                                         "accumulation": "caller"})  # fmt: skip
            # A DeepSpeed config's optimizer section is the optimizer (its "auto" values the
            # arguments'), over every trainable parameter with its weight decay, as transformers
            # gives DeepSpeed a flat list (DummyOptim(params=model_parameters)); it ran over the
            # Trainer's groups, no decay on biases and norms, other weights than DeepSpeed's (an
            # audit helper's repro). Without a section, the Trainer's optimizer and groups.
            opt = self._torch_optimizer() if ds is None or "optimizer" not in ds else None
            self.engine = infinity.initialize(self.model, cfg, optimizer=opt)
        self.optimizer = self.engine.optimizer
        return self.optimizer

    def _groups(self) -> list[dict]:
        """The Trainer's parameter groups: decay on what it decays (the arguments' weight
        decay), none on biases and norms."""
        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        return [g for g in groups if g["params"]]

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        ds = self._deepspeed_config() if self.lr_scheduler is None else None
        if ds is not None and ds.get("scheduler"):  # the DeepSpeed config's own schedule
            make = _deepspeed.lr_scheduler(ds, training_args=self.args, num_training_steps=num_training_steps)
            self.lr_scheduler = make(optimizer if optimizer is not None else self.optimizer)
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer plain Trainer would make (its groups, class and hyperparameters)."""
        groups = self._groups()
        cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        if cls not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad):
            raise ValueError(f"TrainingArguments.optim={self.args.optim!r} ({getattr(cls, '__name__', cls)}) cannot "
                             "run on offloaded state; use adamw_torch, adamw_torch_fused, sgd or adagrad")  # fmt: skip
        kwargs = {k: v for k, v in kwargs.items() if k not in ("fused", "foreach")}  # the engine's kernels are fused
        return cls(groups, **kwargs)

    # -- no DistributedDataParallel: the engine reduces the gradients ----------------------
    def _wrap_model(self, model, training=True, dataloader=None):
        model = super()._wrap_model(model, training, dataloader)
        if training and model is self.model and self.engine is not None:
            # DDP's reducer keeps each placeholder's gradient accumulator, with the placeholder's
            # empty shape, so the first backward fails (and it would reduce what the engine
            # already reduces). Prepared as transformers prepares a model that owns its placement
            # and gradient reduction: autocast and compilation only. The accelerator.prepare that
            # follows finds it prepared and leaves it so.
            model = self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        return model

    # -- clipping and the logged norm: the engine's -----------------------------------------
    def compute_loss(self, model, inputs, *args, **kwargs):
        # The Trainer calls a plain loss.backward(): in fp16 the engine's loss scale enters
        # through the loss itself (its value, which the Trainer reports, unchanged).
        out = super().compute_loss(model, inputs, *args, **kwargs)
        loss = out[0] if isinstance(out, tuple) else out
        if self.engine is None or not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return out
        loss = self.engine.scale_backward(loss)
        return (loss, *out[1:]) if isinstance(out, tuple) else loss

    def _clip_grad_norm(self, model):
        if self._config_clips:
            # As under DeepSpeed: its config's gradient_clipping clips (the engine's
            # optimizer.max_grad_norm, at the step); max_grad_norm only fills an "auto" there
            # (accelerate's clip_grad_norm_ returns DeepSpeed's norm and clips nothing).
            return torch.tensor(self.engine.grad_norm())
        return self.engine.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # max_grad_norm = 0: no clipping
            grad_norm = torch.tensor(self.engine.grad_norm())
        return grad_norm

    # -- the model's weights: gathered to rank 0 one unit at a time ---------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # Trainer calls this on every rank and returns at once on all but the writer, which
        # then reads model.state_dict() alone: at several ranks that is a gather the others
        # never join ([Note: state_dict at several ranks] in infinity/_statedict.py).
        if self.engine is None or state_dict is not None:
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not isinstance(self.model, transformers.PreTrainedModel):  # a PeftModel: it picks its keys
            # Every rank; rank 0's holds what peft keeps, the adapters, not the frozen base. peft
            # then reads keys alone of the model (`placeholders`: no gather rank 0 would run alone).
            state = _peft.adapter_state_dict(self.engine, self.model)
            if state is None:
                return super()._save(output_dir, self.model.state_dict())
            with self.engine._state_hooks.placeholders():
                return super()._save(output_dir, state)
        # Streamed to rank 0's files one unit at a time (every rank calls it), never whole in
        # memory; then what Trainer._save writes beside the weights.
        self.engine.save_pretrained(output_dir)
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    # -- checkpoints: the engine's state beside the Trainer's files -------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_DIR), tag="state")  # every rank
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if self.engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.engine.load_checkpoint(_engine_state(checkpoint), tag="state")
        scheduler = os.path.join(checkpoint, _SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


# [optimizer] keys that TrainingArguments sets under InfinityTrainer, with the argument that does.
_OWNED = {"type": "optim", "lr": "learning_rate", "betas": "adam_beta1, adam_beta2", "eps": "adam_epsilon",
          "weight_decay": "weight_decay", "max_grad_norm": "max_grad_norm",
          "gradient_accumulation_steps": "gradient_accumulation_steps"}  # fmt: skip


def _trainer_owned(cfg, args):
    """``cfg`` (an engine config, not DeepSpeed's) with clipping left to the Trainer: it builds
    the optimizer from ``args`` (its class, groups and hyperparameters), steps the schedule and
    clips. A key of the config's [optimizer] that those set, given a value of its own that
    disagrees, is refused by name, as a DeepSpeed config's is; it was ignored, and the config's
    max_grad_norm clipped a second time at the step."""
    given, default = cfg.optimizer, OptimizerConfig()
    trainer = {"type": getattr(args.optim, "value", args.optim), "lr": args.learning_rate,
               "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon, "weight_decay": args.weight_decay,
               "max_grad_norm": args.max_grad_norm or None,
               "gradient_accumulation_steps": args.gradient_accumulation_steps}  # fmt: skip
    for key, arg in _OWNED.items():
        value = getattr(given, key)
        if value == getattr(default, key):
            continue
        if key == "type" or value != trainer[key]:  # (a type is refused whatever optim names: they differ in kind)
            raise ValueError(
                f"infinity_config optimizer.{key} = {value!r}, but under InfinityTrainer TrainingArguments.{arg} = "
                f"{trainer[key]!r} sets it (the "
                "Trainer builds the optimizer and clips): set it in the TrainingArguments and leave it out of the "
                "engine's config"
            )
    return cfg.replace(optimizer={"max_grad_norm": None})  # the Trainer's _clip_grad_norm clips


def _refuse_full_eval_cast(cfg, args) -> None:
    """bf16_full_eval / fp16_full_eval cast the model before evaluating: a cast the engine
    refuses ([`_wrap.ParameterCast`]), said here before training rather than at the first eval."""
    for flag, dtype in (("bf16_full_eval", "bf16"), ("fp16_full_eval", "fp16")):
        if getattr(args, flag, False) and cfg.precision.param_dtype != dtype:
            raise ValueError(
                f"TrainingArguments.{flag} casts the model to {dtype} to evaluate, but the engine keeps its "
                f"parameters in precision.param_dtype = {cfg.precision.param_dtype!r} and cannot change that "
                f"mid-run: set precision.param_dtype = {dtype!r} in the engine's config to train and evaluate in "
                f"it, or evaluate without {flag} (bf16=True / fp16=True evaluate under autocast)"
            )


def _refuse_unscaled_fp16(cfg, autocast_scaled: bool) -> None:
    """fp16=True on a GPU: accelerate runs the forward under fp16 autocast, whose backward
    needs a loss scale, and makes a GradScaler for it, which cannot step the engine's optimizer
    (`create_accelerator_and_postprocess` drops it). The engine scales the loss only with fp16
    parameters: with fp32 or bf16 ones the backward ran unscaled and small gradients flushed to
    zero with nothing said (an audit helper's repro: grad_norm 0.0 and no weight moved, where
    plain Trainer's GradScaler trained)."""
    if autocast_scaled and cfg.precision.param_dtype != "fp16":
        raise ValueError(
            f"TrainingArguments(fp16=True) runs the forward under fp16 autocast, whose gradients need a loss "
            f"scale, but the engine keeps its parameters in precision.param_dtype = {cfg.precision.param_dtype!r} "
            "and scales losses only with fp16 parameters (accelerate's GradScaler cannot step the engine's "
            "optimizer): set precision.param_dtype = \"fp16\" in the engine's config (the engine's dynamic loss "
            "scale, as DeepSpeed's fp16), or train with bf16=True, which needs no scale"
        )


def _engine_state(checkpoint) -> str:
    """``<checkpoint>/infinity``, or the refusal: without it a resume restores the weights and
    the schedule but starts the Adam moments and step counts afresh, and the steps after it
    differ from the uninterrupted run's with nothing said."""
    if not os.path.isdir(checkpoint):
        raise FileNotFoundError(f"resume_from_checkpoint={os.fspath(checkpoint)!r}: no such directory")
    saved = os.path.join(os.fspath(checkpoint), ENGINE_DIR)
    if not os.path.isdir(saved):
        raise FileNotFoundError(
            f"resume_from_checkpoint: {saved} is missing, which holds the engine's optimizer state (moments, step "
            f"counts, master weights) that InfinityTrainer saves in every checkpoint but with save_only_model=True; "
            f"{os.fspath(checkpoint)} was saved with save_only_model=True (no optimizer, scheduler or RNG state: "
            "transformers documents it as not resumable), or not by InfinityTrainer, or has lost it, and resuming "
            "would restart the optimizer state silently")
    return saved


# -- the engine's figures in the Trainer's logs ------------------------------------------------
class EngineStatsCallback(transformers.TrainerCallback):
    """Adds the engine's figures since the previous log to each training log, beside the loss:
    per tier that moved bytes (nvme, cpu) the GB read and written and their GB/s (bytes over
    the seconds its transfers were busy), the seconds compute stalled waiting for data, H2D
    and D2H GB/s where there is a GPU, and the host pool's peak (MiB), all under
    ``infinity/``. ``engine``: the engine, or a callable giving it (None before it exists).
    It must run before the reporting callbacks (TensorBoard, W&B, ...) to reach them: `log_stats`
    puts it first; it also adds its keys to ``state.log_history``."""

    def __init__(self, engine):
        self._engine = engine if callable(engine) else (lambda: engine)
        self._last: dict | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        engine = self._engine()
        if engine is None or logs is None or "loss" not in logs or getattr(engine, "_closed", False):
            return
        stats = engine.stats()
        figures = engine_figures(self._last, stats["total"], stats)
        self._last = stats["total"]
        logs.update(figures)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)


def engine_figures(before: dict | None, total: dict, stats: dict) -> dict[str, float]:
    """The figures `EngineStatsCallback` logs: ``total`` (``engine.stats()["total"]``) less
    ``before`` (the previous log's, or nothing)."""

    def delta(*path):
        now, then = total, before or {}
        for key in path:
            now, then = now.get(key, 0) if isinstance(now, dict) else 0, then.get(key, 0) if isinstance(then, dict) else 0
        return (now or 0) - (then or 0)

    out: dict[str, float] = {}
    for tier in ("nvme", "cpu"):
        for way in ("read", "write"):
            nbytes, seconds = delta(tier, f"{way}_bytes"), delta(tier, f"{way}_seconds")
            if nbytes:
                out[f"infinity/{tier}_{way}_gb"] = round(nbytes / 1e9, 6)
                if seconds > 0:
                    out[f"infinity/{tier}_{way}_gbps"] = round(nbytes / seconds / 1e9, 3)
    out["infinity/stall_s"] = round(delta("stall_seconds"), 4)
    for way in ("h2d", "d2h"):
        nbytes, seconds = delta(f"{way}_bytes"), delta(f"{way}_seconds")
        if nbytes and seconds > 0:
            out[f"infinity/{way}_gbps"] = round(nbytes / seconds / 1e9, 3)
    peak = stats.get("peak_host_pool_bytes")
    if peak is not None:
        out["infinity/pool_peak_mib"] = round(peak / 2**20, 1)
    return out


def log_stats(trainer: transformers.Trainer, engine) -> EngineStatsCallback:
    """Log ``engine``'s figures (an engine, or a callable giving it) in ``trainer``'s logs,
    before its reporting callbacks see them: any Trainer. `InfinityTrainer` does this itself."""
    callback = EngineStatsCallback(engine)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback

"""transformers' Trainer with params, grads and optimizer state in infinity's tiers.

    from infinity.integrations.transformers import InfinityTrainer

    trainer = InfinityTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                              infinity_config="tiers.toml")
    trainer.train()                                  # or train(resume_from_checkpoint=...)

Everything the Trainer does stays the Trainer's: its data loading, logging, evaluation,
gradient accumulation, LR schedule (``lr_scheduler_type``, ``warmup_steps``), weight-decay
groups (no decay on biases and norms), ``save_steps`` and ``resume_from_checkpoint``. What
changes, when training starts:

- the optimizer the Trainer would make (``TrainingArguments.optim``: the adamw_torch family,
  sgd or adagrad, with its ``learning_rate``, betas, eps and groups) is given to
  `infinity.initialize`, and the Trainer uses ``engine.optimizer``;
- gradient clipping (``max_grad_norm``) is the engine's, at its step, on the gradients in the
  tiers; the logged ``grad_norm`` is their global norm before clipping;
- a checkpoint's optimizer state is the engine's checkpoint in ``<checkpoint>/infinity``
  (every tensor in the tiers, checksummed, resharded on load), beside the Trainer's own files;
  ``resume_from_checkpoint`` (a path, or True: the last checkpoint in ``output_dir``) naming a
  checkpoint without it is refused, since the run would go on with fresh optimizer state;
- the model is not wrapped in DistributedDataParallel under ``torchrun``: the engine reduces
  the gradients across ranks itself (accelerate still applies its autocast).

The model's weights (``save_model``, and each checkpoint's) are written by
``engine.save_pretrained``, on every rank: each unit is gathered to rank 0, which writes it, so
no rank holds the whole model, whatever the world size. A PEFT model is saved as the Trainer
saves it, through the module's ``state_dict()``, which every rank calls and rank 0 gets whole.
"""

from __future__ import annotations

import os

import torch
import transformers
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import get_last_checkpoint

import infinity

from .._resources import as_config

ENGINE_DIR = "infinity"  # inside a Trainer checkpoint directory
_SCHEDULER_NAME = "scheduler.pt"  # the Trainer's name for it


class InfinityTrainer(transformers.Trainer):
    """`transformers.Trainer` whose model is trained by an infinity engine
    (``infinity_config``: what `infinity.initialize` takes). ``engine`` is None until
    training starts."""

    def __init__(self, *args, infinity_config=None, **kwargs):
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers and optimizers[0] is not None:
            raise ValueError("InfinityTrainer makes its optimizer from TrainingArguments (optim, learning_rate, "
                             "weight_decay, ...) and runs it in the engine: pass optimizers=(None, scheduler)")  # fmt: skip
        self.infinity_config = infinity_config
        self.engine = None
        super().__init__(*args, **kwargs)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:
            # Resolved here so that the check below sees the directory the Trainer will load.
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True  # True: the Trainer says none
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            _engine_state(resume_from_checkpoint)  # before an engine and its swap space are made
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # -- the optimizer is the engine's ------------------------------------------------------
    def create_optimizer(self, model=None):
        if self.engine is None:
            # The engine overlaps the optimizer with the last micro-batch's backward: it needs
            # the Trainer's accumulation to know which that is.
            cfg = as_config(self.infinity_config).replace(
                optimizer={"gradient_accumulation_steps": self.args.gradient_accumulation_steps})
            self.engine = infinity.initialize(self.model, cfg, optimizer=self._torch_optimizer())
        self.optimizer = self.engine.optimizer
        return self.optimizer

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer plain Trainer would make (its groups, class and hyperparameters)."""
        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
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
    def _clip_grad_norm(self, model):
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
            return super()._save(output_dir, self.model.state_dict())  # every rank; rank 0's is whole
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
            f"counts, master weights) that InfinityTrainer saves in every checkpoint; {os.fspath(checkpoint)} was not "
            "saved by InfinityTrainer or has lost it, and resuming would restart the optimizer state silently")
    return saved

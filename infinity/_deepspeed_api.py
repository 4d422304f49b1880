"""What DeepSpeed's engine gives a training script beside backward, step and its checkpoints,
under DeepSpeed's names: a script written for it reads them to log and to decide (``if
engine.is_gradient_accumulation_boundary():``), and each raised AttributeError here before
(an audit helper's list, against DeepSpeed 0.19.8's ``DeepSpeedEngine``).

A mixin of `Engine`, which owns the state each reads: the step counts (`_stats`), the
micro-batch count (`_accumulation`), the optimizer's groups and last norm, the config. The engine's own
names for the same things stay: ``engine.stats()``, ``engine.step()``'s return, ``engine.grad_norm()``.
"""

from __future__ import annotations


_LOAD_DEFAULTS = {"load_module_strict": True, "load_optimizer_states": True, "load_lr_scheduler_states": True,
                  "load_module_only": False}  # fmt: skip


def refuse_partial_load(**given) -> None:
    """``engine.load_checkpoint``'s DeepSpeed keywords: their defaults load everything, as the
    engine does; another value (a fine-tune's ``load_module_only=True``) raised TypeError
    before, naming nothing to do instead (an audit helper's repro)."""
    other = {k: v for k, v in given.items() if v != _LOAD_DEFAULTS[k]}
    if other:
        said = ", ".join(f"{k}={v!r}" for k, v in other.items())
        raise ValueError(
            f"engine.load_checkpoint({said}): DeepSpeed's partial loads are not supported; a checkpoint loads "
            "whole (weights, optimizer states, schedule, step counts). For the weights alone: write them with "
            "infinity-consolidate CHECKPOINT_DIR model.safetensors (or engine.export) and load that file with "
            "engine.module.load_state_dict(safetensors.torch.load_file(...))"
        )


class DeepSpeedEngineAPI:
    """DeepSpeed's ``DeepSpeedEngine`` members a training loop reads, with its meanings."""

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken, skipped ones included, as DeepSpeed counts them (restored by
        `load_checkpoint`)."""
        return self._stats.steps

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on a non-finite gradient (fp16 overflows) in this process."""
        return self._stats.total.skipped_steps

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group, as the next step takes it."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the last step's gradients (unscaled, before clipping), as
        DeepSpeed's ZeRO computes it at every step, clipping or not; None before the first step
        and after a skipped one (a non-finite gradient). Before a step, `grad_norm` gives it."""
        return self.optimizer.updater.last_norm

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the parameters: False for one that only counted a
        micro-batch (``optimizer.accumulation = "engine"``) or was skipped."""
        return self._step_applied

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` updates (not only counts a micro-batch): with
        ``optimizer.accumulation = "engine"`` (a DeepSpeed config) on the last micro-batch of a
        step; otherwise every call steps."""
        return self._accumulation.next_is_boundary()

    def gradient_accumulation_steps(self) -> int:
        """The micro-batches of a step (``optimizer.gradient_accumulation_steps``)."""
        return self.config.optimizer.gradient_accumulation_steps

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine (torchrun's LOCAL_RANK; 0 alone)."""
        return self.dist.local_rank

    def fp16_enabled(self) -> bool:
        return self.config.precision.param_dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision.param_dtype == "bf16"

    def zero_optimization_stage(self) -> int:
        return self.config.partition.stage

    def gradient_clipping(self) -> float:
        """The norm every step clips to (0: none), as DeepSpeed's config gives it."""
        return self.config.optimizer.max_grad_norm or 0.0

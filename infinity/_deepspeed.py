"""A DeepSpeed config (``ds_config.json``) read as a tier config.

Owns: the table of every DeepSpeed key this engine knows (`RULES`: mapped to which key of the
tier config, ignored and why, or refused and why) and the reading of a DeepSpeed config through
it (`to_tier_config`), with Hugging Face's ``"auto"`` values filled from ``TrainingArguments``
as transformers fills them. docs/config.md's table is this one (a test holds them equal).
Touches: nothing but `infinity.config`.

[Note: DeepSpeed's placements]
DeepSpeed places state by ZeRO stage and two offload sections; this engine by a tier per kind
of state. ``offload_param.device`` is where parameters rest (``tiers.params``);
``offload_optimizer.device`` where the optimizer states live (``tiers.optimizer``), and with
it the gradients: ZeRO-Offload and ZeRO-Infinity move each gradient partition to host memory
for the CPU optimizer, so an offloaded optimizer puts ``tiers.grads`` on "cpu". Without either
section everything stays on the device. The stage is the partitioning over ranks
(``partition.stage``): DeepSpeed's 1, 2 and 3 mean the same here.

[Note: DeepSpeed's Adam]
DeepSpeed's ``"type": "Adam"`` runs AdamW (decoupled weight decay) unless its params say
``"adam_w_mode": false``: read as torch's Adam it would train other weights with nothing said.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from torch.optim.lr_scheduler import LRScheduler

from .config import TierConfig, _loads_json

logger = logging.getLogger("infinity")

MAP, IGNORE, REFUSE = "mapped", "ignored", "refused"


@dataclass(frozen=True)
class Rule:
    """What happens to one DeepSpeed key: ``action`` is MAP (to ``target``), IGNORE (``why``)
    or REFUSE (``why``; for a key whose value matters only when set, ``when`` says which values
    are refused: "enabled" a section whose ``enabled`` is true, "set" any value but the default)."""

    action: str
    target: str = ""
    why: str = ""
    when: str = ""
    allowed: tuple = ()  # for when="set": the values that are not refused (the default, "off")


def _m(target: str, why: str = "") -> Rule:
    return Rule(MAP, target, why)


def _i(why: str) -> Rule:
    return Rule(IGNORE, why=why)


def _r(why: str, when: str = "set", allowed: tuple = (None, False, 0)) -> Rule:
    return Rule(REFUSE, why=why, when=when, allowed=allowed)


_BUDGET = "host buffers are bounded as a whole by memory.host_budget"
_PIPELINED = "reads, writes and the update are always pipelined here"
_MONITOR = "monitoring: engine.stats(), and InfinityTrainer's logs through report_to"
_NOT_HERE = "a DeepSpeed feature this engine does not have"
_COMM = "gradients are reduced in fp32 unit by unit as backward produces them"

RULES: dict[str, Rule] = {
    # -- batch -----------------------------------------------------------------------------
    "train_batch_size": _m("optimizer.gradient_accumulation_steps",
                           "with train_micro_batch_size_per_gpu and the world size, as DeepSpeed derives the steps "
                           "(they must agree); with TrainingArguments the Trainer's"),
    "train_micro_batch_size_per_gpu": _m("optimizer.gradient_accumulation_steps", "as train_batch_size"),
    "gradient_accumulation_steps": _m("optimizer.gradient_accumulation_steps",
                                      'with optimizer.accumulation = "engine": DeepSpeed\'s loop'),
    "gradient_clipping": _m("optimizer.max_grad_norm", "1.0 when absent, DeepSpeed's default (since its PR #8068; 0 before); 0: no clipping"),
    # -- precision -------------------------------------------------------------------------
    "fp16": _i("the section: its keys below"),
    "fp16.enabled": _m("precision.param_dtype", '"fp16" when true'),
    "fp16.auto_cast": _i("the model computes in its parameters' dtype"),
    "fp16.loss_scale": _r("a static loss scale: the scaling here is dynamic (0, the default, maps)", allowed=(0,)),
    "fp16.initial_scale_power": _m("precision.initial_scale", "2 ** power"),
    "fp16.loss_scale_window": _m("precision.growth_interval", "counted as DeepSpeed counts it (`precision.deepspeed_growth`, set with fp16)"),
    "fp16.hysteresis": _m("precision.hysteresis", "2 when absent, DeepSpeed's default"),
    "fp16.consecutive_hysteresis": _m("precision.consecutive_hysteresis"),
    "fp16.min_loss_scale": _m("precision.min_scale", "an overflow there raises, as DeepSpeed's "
                                                      "(`precision.stop_at_min_scale`, set with fp16)"),
    "bf16": _i("the section: its keys below"),
    "bf16.enabled": _m("precision.param_dtype", '"bf16" when true'),
    "bf16.immediate_grad_update": _i("gradients are accumulated in fp32 as they arrive"),
    "bfloat16": _i("DeepSpeed's older name of bf16: its keys below"),
    "bfloat16.enabled": _m("precision.param_dtype", '"bf16" when true'),
    "amp": _r("NVIDIA apex amp: use bf16 or fp16", "enabled"),
    "amp.enabled": _r("NVIDIA apex amp: use bf16 or fp16"),
    "data_types": _i("the section: its keys below"),
    "data_types.grad_accum_dtype": _r("gradients are always accumulated in fp32 here", allowed=(None, "fp32")),
    "communication_data_type": _r(_COMM, allowed=(None, "fp32")),
    "prescale_gradients": _i(_COMM),
    "gradient_predivide_factor": _i(_COMM),
    "sparse_gradients": _r(_NOT_HERE),
    # -- optimizer -------------------------------------------------------------------------
    "optimizer": _i("the section: its keys below"),
    "optimizer.type": _m("optimizer.type", "Adam and AdamW: adamw (unless adam_w_mode is false), SGD, Adagrad; "
                         "others refused"),  # fmt: skip
    "optimizer.params": _i("the section: its keys below"),
    "optimizer.params.lr": _m("optimizer.lr"),
    "optimizer.params.betas": _m("optimizer.betas"),
    "optimizer.params.eps": _m("optimizer.eps"),
    "optimizer.params.weight_decay": _m("optimizer.weight_decay"),
    "optimizer.params.momentum": _m("optimizer.momentum"),
    "optimizer.params.nesterov": _m("optimizer.nesterov"),
    "optimizer.params.adam_w_mode": _m("optimizer.type", 'false: "adam" (L2 weight decay)'),
    "optimizer.params.torch_adam": _m("optimizer.weight_decay", "true: torch's AdamW, whose weight decay left out "
                                      "is 0.01; the update is torch's fused CPU kernel either way"),  # fmt: skip
    "optimizer.params.bias_correction": _r("Adam without bias correction", allowed=(True,)),
    "optimizer.params.amsgrad": _r("AMSGrad"),
    "optimizer.params.dampening": _r("SGD with dampening"),
    "optimizer.params.lr_decay": _r("Adagrad's lr_decay"),
    "optimizer.params.initial_accumulator_value": _r("Adagrad's initial_accumulator_value"),
    "scheduler": _i("the section: its keys below"),
    "scheduler.type": _m("lr_scheduler=", "WarmupLR and WarmupDecayLR, as DeepSpeed computes them "
                         "(`infinity.deepspeed_lr_scheduler`); the others refused"),  # fmt: skip
    "scheduler.params": _i("the section: its keys below"),
    "scheduler.params.warmup_min_lr": _m("lr_scheduler="),
    "scheduler.params.warmup_max_lr": _m("lr_scheduler="),
    "scheduler.params.warmup_num_steps": _m("lr_scheduler="),
    "scheduler.params.warmup_type": _m("lr_scheduler=", "log or linear"),
    "scheduler.params.total_num_steps": _m("lr_scheduler=", "WarmupDecayLR"),
    "scheduler.params.last_batch_iteration": _r("a schedule started part-way: a checkpoint keeps the schedule "
                                                "(engine.load_checkpoint)", allowed=(None, -1)),  # fmt: skip
    "zero_allow_untested_optimizer": _i("the engine runs the optimizers it knows and refuses the rest"),
    "zero_force_ds_cpu_optimizer": _i("the engine's own optimizer is the one that runs"),
    # -- ZeRO ------------------------------------------------------------------------------
    "zero_optimization": _i("the section: its keys below"),
    "zero_optimization.stage": _m("partition.stage", "1, 2 or 3; 0 refused (nothing partitioned)"),
    "zero_optimization.offload_param": _i("the section: its keys below"),
    "zero_optimization.offload_param.device": _m("tiers.params", 'none: "device"; cpu; nvme '
                                                 "([Note: DeepSpeed's placements])"),  # fmt: skip
    "zero_optimization.offload_param.nvme_path": _m("nvme.paths", "with offload_optimizer's, striped over both"),
    "zero_optimization.offload_param.pin_memory": _i("host buffers are pinned whenever a GPU is there"),
    "zero_optimization.offload_param.buffer_count": _i(_BUDGET + " (prefetch.depth sets how far ahead)"),
    "zero_optimization.offload_param.buffer_size": _i(_BUDGET),
    "zero_optimization.offload_param.max_in_cpu": _i(_BUDGET + "; parameters stay in it between steps where it "
                                                    "has room (memory.keep_params)"),
    "zero_optimization.offload_optimizer": _i("the section: its keys below"),
    "zero_optimization.offload_optimizer.device": _m("tiers.optimizer", 'and tiers.grads = "cpu" when offloaded '
                                                     "([Note: DeepSpeed's placements])"),  # fmt: skip
    "zero_optimization.offload_optimizer.nvme_path": _m("nvme.paths", "with offload_param's, striped over both"),
    "zero_optimization.offload_optimizer.pin_memory": _i("host buffers are pinned whenever a GPU is there"),
    "zero_optimization.offload_optimizer.buffer_count": _i(_BUDGET),
    "zero_optimization.offload_optimizer.fast_init": _i("the states are written as initialize makes them"),
    "zero_optimization.offload_optimizer.pipeline": _i(_PIPELINED),
    "zero_optimization.offload_optimizer.pipeline_read": _i(_PIPELINED),
    "zero_optimization.offload_optimizer.pipeline_write": _i(_PIPELINED),
    "zero_optimization.offload_optimizer.ratio": _r("a partial optimizer offload (ratio < 1)", allowed=(1,)),
    "zero_optimization.sub_group_size": _m("optimizer.sub_group_size", "12 bytes an element (master and two "
                                           "moments), at most the default 128MiB: a sub-group is held in the "
                                           "host budget for its update"),  # fmt: skip
    "zero_optimization.stage3_prefetch_bucket_size": _m("prefetch.bytes", "elements x the parameters' bytes"),
    "zero_optimization.stage3_max_live_parameters": _i(_BUDGET),
    "zero_optimization.stage3_max_reuse_distance": _i("units forward used last are kept for backward as the "
                                                      "budget allows (prefetch.keep)"),  # fmt: skip
    "zero_optimization.stage3_param_persistence_threshold": _i("every managed parameter is fetched by its unit"),
    "zero_optimization.stage3_model_persistence_threshold": _i("as stage3_param_persistence_threshold"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": _i("save_pretrained and Trainer.save_model "
                                                                      "always gather the weights, one unit at a "
                                                                      "time"),  # fmt: skip
    "zero_optimization.gather_16bit_weights_on_model_save": _i("as stage3_gather_16bit_weights_on_model_save"),
    "zero_optimization.overlap_comm": _i(_COMM),
    "zero_optimization.contiguous_gradients": _i("each unit's gradient is one flat buffer here"),
    "zero_optimization.reduce_bucket_size": _i(_COMM),
    "zero_optimization.reduce_scatter": _i(_COMM),
    "zero_optimization.allgather_partitions": _i("parameters are all-gathered unit by unit"),
    "zero_optimization.allgather_bucket_size": _i("parameters are all-gathered unit by unit"),
    "zero_optimization.round_robin_gradients": _i(_COMM),
    "zero_optimization.elastic_checkpoint": _i("a checkpoint loads into any world size here"),
    "zero_optimization.load_from_fp32_weights": _i("a checkpoint keeps the fp32 master weights, which it loads"),
    "zero_optimization.ignore_unused_parameters": _i("a parameter with no gradient in a step is stepped on zeros when others of its module have one (as in DeepSpeed, and said in a warning; torch skips it), and left alone when none of its module has"),
    "zero_optimization.memory_efficient_linear": _i("Linear layers run torch's own"),
    "zero_optimization.cpu_offload": _m("tiers.optimizer", 'DeepSpeed\'s older name: true is offload_optimizer '
                                        '"cpu"'),  # fmt: skip
    "zero_optimization.zero_hpz_partition_size": _r("ZeRO++ hierarchical partitioning", allowed=(None, 1)),
    "zero_optimization.zero_quantized_weights": _r("ZeRO++ quantized weights (other numbers)"),
    "zero_optimization.zero_quantized_gradients": _r("ZeRO++ quantized gradients (other numbers)"),
    "zero_optimization.mics_shard_size": _r("MiCS sharding", allowed=(None, -1)),
    # -- aio -------------------------------------------------------------------------------
    "aio": _i("the section: its keys below"),
    "aio.block_size": _m("aio.block_size"),
    "aio.queue_depth": _m("aio.queue_depth"),
    "aio.thread_count": _i("io_uring: one ring per engine, no I/O threads"),
    "aio.single_submit": _i("requests are submitted in batches"),
    "aio.overlap_events": _i("completions are reaped while others are in flight"),
    "aio.intra_op_parallelism": _i("as thread_count"),
    "aio.use_gds": _r("GPUDirect Storage: reads land in pinned host memory, then on the GPU"),
    # -- activations -----------------------------------------------------------------------
    "activation_checkpointing": _i("the section: its keys below (checkpointing itself is the model's: "
                                   "gradient_checkpointing_enable())"),  # fmt: skip
    "activation_checkpointing.cpu_checkpointing": _m("activations.tier", 'true: "cpu"'),
    "activation_checkpointing.partition_activations": _i("model parallelism, which this engine does not have"),
    "activation_checkpointing.contiguous_memory_optimization": _i("saved tensors go to their tier one by one"),
    "activation_checkpointing.number_checkpoints": _i("as contiguous_memory_optimization"),
    "activation_checkpointing.synchronize_checkpoint_boundary": _i("no synchronisation is needed"),
    "activation_checkpointing.profile": _i(_MONITOR),
    # -- monitoring and the rest -------------------------------------------------------------
    "steps_per_print": _i(_MONITOR),
    "wall_clock_breakdown": _i(_MONITOR),
    "dump_state": _i(_MONITOR),
    "memory_breakdown": _i(_MONITOR),
    "flops_profiler": _i(_MONITOR),
    "tensorboard": _i(_MONITOR),
    "wandb": _i(_MONITOR),
    "csv_monitor": _i(_MONITOR),
    "comet": _i(_MONITOR),
    "comms_logger": _i(_MONITOR),
    "checkpoint": _i("checkpoints are written atomically by every rank; a tag is engine.save_checkpoint's"),
    "seed": _i("the loop's (torch.manual_seed, TrainingArguments.seed)"),
    "autotuning": _r(_NOT_HERE, "enabled"),
    "elasticity": _r(_NOT_HERE, "enabled"),
    "compression_training": _r(_NOT_HERE, "present"),
    "quantize_training": _r(_NOT_HERE, "enabled"),
    "sparse_attention": _r(_NOT_HERE, "present"),
    "pipeline": _r("pipeline parallelism: " + _NOT_HERE, "present"),
    "data_efficiency": _r(_NOT_HERE, "enabled"),
    "curriculum_learning": _r(_NOT_HERE, "enabled"),
    "eigenvalue": _r(_NOT_HERE, "enabled"),
    "progressive_layer_drop": _r(_NOT_HERE, "enabled"),
}
"""Every key read, by its dotted name; a key not here is refused naming it (docs/config.md)."""

# The sections whose own keys (below them) are not listed one by one: everything in them
# follows the section's rule.
_OPAQUE = {"checkpoint", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
           "autotuning", "elasticity", "compression_training", "quantize_training", "sparse_attention",
           "pipeline", "data_efficiency", "curriculum_learning", "eigenvalue", "progressive_layer_drop",
           "amp"}  # fmt: skip

_OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd", "adagrad": "adagrad"}
# What DeepSpeed's optimizers take where the config's params leave a value out (DeepSpeedCPUAdam
# and FusedAdam: lr 1e-3, no weight decay; torch's SGD; DeepSpeedCPUAdagrad and torch's
# Adagrad: lr 1e-2, eps 1e-10), not this engine's own defaults (lr 1e-4, weight decay 0.01).
_OPTIMIZER_DEFAULTS = {
    "adamw": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
    "adam": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
    "sgd": {"lr": 1e-3, "weight_decay": 0.0, "momentum": 0.0},
    "adagrad": {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0},
}
_PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GRADIENT_CLIPPING_DEFAULT = 1.0  # DeepSpeed's, where the config has no gradient_clipping
_SUB_GROUP_CAP = 128 << 20


def load(source) -> dict:
    """A DeepSpeed config as a dict: ``source`` is a dict, or a path to its JSON file."""
    if isinstance(source, dict):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"a DeepSpeed config is a dict or a path to its JSON file, got {type(source).__name__}")
    path = os.fspath(source)
    try:
        with open(path, "rb") as f:
            data = _loads_json(f.read())  # the tier config's reader: a key twice is refused, not the last kept
    except FileNotFoundError:
        raise FileNotFoundError(2, "DeepSpeed config file not found", path) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e.msg} (at line {e.lineno}, column {e.colno})") from None
    except ValueError as e:  # a key twice; bad UTF-8
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a DeepSpeed config is a JSON object, got {type(data).__name__}")
    return data


_ONLY_DEEPSPEED = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "fp16", "bf16",
                   "bfloat16", "gradient_clipping", "steps_per_print", "gradient_accumulation_steps",
                   "activation_checkpointing", "scheduler")  # fmt: skip


def is_deepspeed(config) -> bool:
    """Whether what an entry point was given (a dict, or a path to a .json file) is a DeepSpeed
    config rather than a tier config: it has a top-level key only DeepSpeed's have (the two
    share only "optimizer" and "aio")."""
    if isinstance(config, (str, os.PathLike)):
        if not os.fspath(config).lower().endswith(".json"):
            return False
        try:
            config = load(config)
        except (OSError, ValueError):
            return False  # the tier config's loader says what is wrong with it
    return isinstance(config, dict) and any(k in config for k in _ONLY_DEEPSPEED)


def to_tier_config(source, *, training_args=None, base=None) -> TierConfig:
    """The tier config a DeepSpeed config means (see `RULES` and the notes above).

    ``training_args``: transformers' ``TrainingArguments`` (or anything with its attribute
    names), whose values fill the ``"auto"`` entries as transformers fills them for DeepSpeed;
    without it an ``"auto"`` keeps this engine's default. ``base``: a tier config (or its dict)
    for what DeepSpeed has no key for (``memory.host_budget``, say); the defaults otherwise."""
    ds = load(source)
    where = os.fspath(source) if isinstance(source, (str, os.PathLike)) else "the DeepSpeed config"
    try:
        values = _read(ds, training_args)
        out = base.to_dict() if isinstance(base, TierConfig) else json.loads(json.dumps(base or {}))
        for key, value in values.items():
            section, name = key.split(".")
            out.setdefault(section, {})[name] = value
        return TierConfig.from_dict(out)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


class _Reader:
    """The walk over a DeepSpeed config: every key checked against `RULES`, values read with
    ``"auto"`` filled from the training arguments."""

    def __init__(self, ds: dict, args):
        self.ds, self.args = ds, args
        self.mismatches: list[str] = []  # values set that disagree with the training arguments
        self._check(ds, "")

    def _check(self, table: dict, prefix: str) -> None:
        for key, value in table.items():
            name = f"{prefix}{key}"
            rule = RULES.get(name)
            if rule is None:
                parent = prefix.rstrip(".")
                known = sorted(k.rsplit(".", 1)[-1] for k in RULES if k.startswith(prefix) and k.count(".") == prefix.count("."))
                raise ValueError(f"DeepSpeed key {name!r} is not one this engine knows"
                                 + (f" (under {parent!r}: {', '.join(known)})" if parent else "")
                                 + "; docs/config.md lists every key it maps, ignores or refuses")  # fmt: skip
            if rule.action == REFUSE and self._refused(rule, value):
                raise ValueError(f"DeepSpeed key {name!r} = {json.dumps(value)} is refused: {rule.why}")
            if isinstance(value, dict) and key and name not in _OPAQUE:
                self._check(value, f"{name}.")

    @staticmethod
    def _refused(rule: Rule, value) -> bool:
        if rule.when == "enabled":
            return isinstance(value, dict) and value.get("enabled", False) not in (False, None)
        if rule.when == "present":
            return value is not None and value != {}
        return value != "auto" and not any(value == a and type(value) is not bool or value is a
                                           for a in rule.allowed)  # fmt: skip

    def get(self, dotted: str, default=None, auto=None, *, arg: str | tuple[str, ...] | None = None):
        """The value at ``dotted``; ``"auto"`` is ``auto`` (or the training argument ``arg``'s
        value; of several names, the list of their values, where each is set) or the default;
        an absent key is ``default``. A value set that disagrees with the argument ``arg`` is
        noted in ``mismatches`` (transformers refuses such a config)."""
        if isinstance(arg, tuple):
            values = [self.arg(a) for a in arg]
            auto = values if all(v is not None for v in values) else None
            arg = ", ".join(arg)
        elif arg is not None:
            auto = self.arg(arg)
        table = self.ds
        *path, last = dotted.split(".")
        for part in path:
            table = table.get(part)
            if not isinstance(table, dict):
                return default
        value = table.get(last, default)
        if value == "auto":
            return auto if auto is not None else default
        if arg is not None and auto is not None and last in table and not _same(value, auto):
            shown = ", ".join(map(repr, auto)) if isinstance(auto, list) else repr(auto)
            self.mismatches.append(f"{dotted!r} = {json.dumps(value)} but TrainingArguments' {arg} = {shown}")
        return value

    def arg(self, name: str):
        return getattr(self.args, name, None) if self.args is not None else None

    def match(self, dotted: str, value, what: str):
        """The value at ``dotted`` where it is set (not ``"auto"``), noted in ``mismatches``
        where it disagrees with ``value``, the training arguments' ``what`` (computed: a batch,
        the warm-up or total steps); ``value`` where ``"auto"`` or absent."""
        set_to = self.get(dotted, None)
        if set_to is None or self.args is None or value is None:
            return value if set_to is None else set_to
        if not _same(set_to, value):
            self.mismatches.append(f"{dotted!r} = {json.dumps(set_to)} but TrainingArguments' {what} = {value!r}")
        return set_to


def _same(value, arg) -> bool:
    """Whether a DeepSpeed value says what a training argument says (numbers as numbers)."""
    if isinstance(value, (list, tuple)) and isinstance(arg, (list, tuple)):
        return len(value) == len(arg) and all(_same(a, b) for a, b in zip(value, arg))
    if isinstance(value, bool) or isinstance(arg, bool):
        return bool(value) == bool(arg)
    if isinstance(value, (int, float)) and isinstance(arg, (int, float)):
        return float(value) == float(arg)
    return value == arg


def _number(key: str, value, kind=float):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"DeepSpeed key {key!r}: expected a number, got {type(value).__name__} {value!r}")
    if kind is int:
        if value != int(value):
            raise ValueError(f"DeepSpeed key {key!r}: expected a whole number, got {value!r}")
        return int(value)
    return float(value)


def _read(ds: dict, args) -> dict[str, Any]:
    """The tier config's dotted keys and values the DeepSpeed config ``ds`` sets."""
    r = _Reader(ds, args)
    out: dict[str, Any] = {}

    # -- precision
    bf16 = r.get("bf16.enabled", False, arg="bf16") or r.get("bfloat16.enabled", False)
    fp16 = r.get("fp16.enabled", False, arg="fp16")
    # A section the config leaves out is the training arguments' mixed precision, as accelerate's
    # DeepSpeedPlugin.set_mixed_precision adds it under the Trainer (without, a TrainingArguments(bf16=True)
    # run kept fp32 parameters, twice the bytes on every tier and other numerics, saying nothing).
    if r.arg("bf16") and "bf16" not in ds and "bfloat16" not in ds:
        bf16 = True
    if r.arg("fp16") and "fp16" not in ds:
        fp16 = True
    if bf16 and fp16:
        raise ValueError("DeepSpeed keys 'bf16.enabled' and 'fp16.enabled' are both true: choose one")
    dtype = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    out["precision.param_dtype"] = dtype
    if fp16:
        power = r.get("fp16.initial_scale_power")
        if power is not None:
            out["precision.initial_scale"] = 2.0 ** _number("fp16.initial_scale_power", power)
        window = r.get("fp16.loss_scale_window")
        if window is not None:
            out["precision.growth_interval"] = _number("fp16.loss_scale_window", window, int)
        low = r.get("fp16.min_loss_scale")
        if low is not None:
            out["precision.min_scale"] = _number("fp16.min_loss_scale", low)
        out["precision.hysteresis"] = _number("fp16.hysteresis", r.get("fp16.hysteresis", 2), int)
        # DeepSpeed's DynamicLossScaler raises at an overflow at its minimum (raise_error_at_min_scale,
        # which its config cannot turn off); skipping on, the run stood still where DeepSpeed's stops.
        out["precision.stop_at_min_scale"] = True
        out["precision.deepspeed_growth"] = True
        consecutive = r.get("fp16.consecutive_hysteresis", False)
        if not isinstance(consecutive, bool):
            raise ValueError(f"DeepSpeed key 'fp16.consecutive_hysteresis': expected true or false, got {consecutive!r}")
        out["precision.consecutive_hysteresis"] = consecutive

    # -- the step: DeepSpeed's engine counts the micro-batches ([Note: DeepSpeed's accumulation])
    out["optimizer.accumulation"] = "engine"
    accumulate = _accumulation_steps(r)
    if accumulate is not None:
        out["optimizer.gradient_accumulation_steps"] = accumulate
    # Absent, DeepSpeed clips at 1.0 (its default since its PR #8068, June 2026; 0, no clipping,
    # before): a config that leaves the key out trained unclipped here, and DeepSpeed's clipped
    # run went elsewhere from its second step (an audit helper's repro against DeepSpeed 0.19.8).
    clip = _number("gradient_clipping", r.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT, arg="max_grad_norm"))
    out["optimizer.max_grad_norm"] = clip if clip > 0 else None
    _read_optimizer(r, out)

    if r.mismatches:  # as transformers' HfTrainerDeepSpeedConfig refuses them
        raise ValueError("values that disagree with the TrainingArguments (set them to \"auto\", or make them "
                         "agree): " + "; ".join(r.mismatches))  # fmt: skip

    # -- ZeRO and the tiers ([Note: DeepSpeed's placements])
    stage = _number("zero_optimization.stage", r.get("zero_optimization.stage", 0), int)
    if stage == 0:
        raise ValueError("DeepSpeed key 'zero_optimization.stage' = 0 is refused: nothing partitioned and nothing "
                         "offloaded is plain data parallelism (torch DDP); use 1, 2 or 3")  # fmt: skip
    if stage not in (1, 2, 3):
        raise ValueError(f"DeepSpeed key 'zero_optimization.stage' = {stage}: expected 1, 2 or 3")
    out["partition.stage"] = stage
    params = _device(r, "zero_optimization.offload_param.device")
    optimizer = _device(r, "zero_optimization.offload_optimizer.device")
    if r.get("zero_optimization.cpu_offload") is True and optimizer == "device":
        optimizer = "cpu"
    if params != "device" and stage != 3:
        raise ValueError(f"DeepSpeed key 'zero_optimization.offload_param.device' = {params!r} needs "
                         f"'zero_optimization.stage' = 3 (DeepSpeed's rule too), got {stage}")  # fmt: skip
    out["tiers.params"] = params
    out["tiers.optimizer"] = optimizer
    out["tiers.grads"] = "cpu" if optimizer != "device" else "device"
    paths = []
    for section, device in (("offload_param", params), ("offload_optimizer", optimizer)):
        path = r.get(f"zero_optimization.{section}.nvme_path")
        if device == "nvme":
            if not isinstance(path, str) or not path:
                raise ValueError(f"DeepSpeed key 'zero_optimization.{section}.nvme_path': needed with device "
                                 f"'nvme', got {path!r}")  # fmt: skip
            if os.path.normpath(path) not in map(os.path.normpath, paths):
                paths.append(path)
    if paths:
        out["nvme.paths"] = paths
    size = r.get("zero_optimization.sub_group_size")
    if size is not None:
        out["optimizer.sub_group_size"] = min(12 * _number("zero_optimization.sub_group_size", size, int),
                                              _SUB_GROUP_CAP)  # fmt: skip
    bucket = r.get("zero_optimization.stage3_prefetch_bucket_size")
    if bucket is not None:
        elements = _number("zero_optimization.stage3_prefetch_bucket_size", bucket, int)
        out["prefetch.bytes"] = max(elements * _PARAM_BYTES[dtype], 1)

    scheduler = ds.get("scheduler")
    if scheduler and scheduler.get("type") not in _SCHEDULES:
        _refuse_schedule(scheduler.get("type"))

    # -- aio and activations
    for key in ("block_size", "queue_depth"):
        value = r.get(f"aio.{key}")
        if value is not None:
            out[f"aio.{key}"] = _number(f"aio.{key}", value, int)
    if r.get("activation_checkpointing.cpu_checkpointing") is True:
        out["activations.tier"] = "cpu"
    return out


def _device(r: _Reader, key: str) -> str:
    value = r.get(key, "none")
    value = "none" if value is None else value
    if value not in ("none", "cpu", "nvme"):
        raise ValueError(f"DeepSpeed key {key!r} = {value!r}: expected none, cpu or nvme")
    return "device" if value == "none" else value


# [Note: DeepSpeed's accumulation]
# DeepSpeed's training loop calls engine.backward(loss) and engine.step() after every
# micro-batch: backward divides the loss by gradient_accumulation_steps, and step updates only
# on every gradient_accumulation_steps-th call. So a DeepSpeed config sets
# optimizer.accumulation = "engine", which does the same here; a script written for DeepSpeed
# then takes as many updates, of the same averaged gradients. (Left as this engine's "caller",
# it would update after every micro-batch, on one micro-batch's gradient at full weight:
# silently another training.) The steps come from gradient_accumulation_steps, or as DeepSpeed
# derives them from train_batch_size = train_micro_batch_size_per_gpu x steps x world size
# (WORLD_SIZE, as the launcher sets it), and the three must agree, as DeepSpeed asserts. With
# transformers' arguments the Trainer counts: InfinityTrainer sets "caller" and its own steps.


def _world_size() -> int:
    """The ranks the config is for: the process group's where one is up, as DeepSpeed takes it
    (dist.get_world_size()), else torchrun's WORLD_SIZE, else 1. WORLD_SIZE alone missed the
    ranks torch.multiprocessing.spawn starts (init_process_group(rank=, world_size=) sets no
    variable): 2 ranks derived twice DeepSpeed's accumulation steps (an audit helper's repro)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _accumulation_steps(r: _Reader) -> int | None:
    """The micro-batches per step a DeepSpeed config means (None: not said)."""
    steps = r.get("gradient_accumulation_steps", None, arg="gradient_accumulation_steps")
    steps = None if steps is None else _number("gradient_accumulation_steps", steps, int)
    if r.args is not None:  # transformers' arguments: the Trainer's loop, its batch sizes
        # Set values must agree with the Trainer's, as transformers' HfTrainerDeepSpeedConfig asserts.
        micro = r.arg("per_device_train_batch_size")
        r.match("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
        world = getattr(r.args, "world_size", None)
        accumulate = steps if steps is not None else r.arg("gradient_accumulation_steps")
        if micro is not None and world is not None and accumulate is not None:
            r.match("train_batch_size", micro * accumulate * world, "train_batch_size (calculated)")
        return steps
    batch, micro = r.get("train_batch_size"), r.get("train_micro_batch_size_per_gpu")
    batch = None if batch is None else _number("train_batch_size", batch, int)
    micro = None if micro is None else _number("train_micro_batch_size_per_gpu", micro, int)
    world = _world_size()
    if batch is not None and micro is not None:
        derived = batch // (micro * world) if micro * world else 0
        if steps is None:
            steps = derived
        if steps < 1 or batch != micro * steps * world:
            raise ValueError(f"DeepSpeed keys 'train_batch_size' = {batch}, 'train_micro_batch_size_per_gpu' = {micro} "
                             f"and 'gradient_accumulation_steps' = {steps} disagree at world size {world}: "
                             "train_batch_size must be micro batch x accumulation steps x world size")  # fmt: skip
    return steps


def micro_batch_size(ds: dict) -> int | None:
    """The batch of one micro-step at one rank a DeepSpeed config means, as DeepSpeed derives
    it: ``train_micro_batch_size_per_gpu``, or ``train_batch_size`` over the accumulation steps
    (1 when not said) and the world size; None where it says neither."""
    micro = ds.get("train_micro_batch_size_per_gpu")
    if micro is not None and micro != "auto":
        return _number("train_micro_batch_size_per_gpu", micro, int)
    batch = ds.get("train_batch_size")
    if batch is None or batch == "auto":
        return None
    steps = ds.get("gradient_accumulation_steps")
    steps = 1 if steps is None or steps == "auto" else _number("gradient_accumulation_steps", steps, int)
    per = _number("train_batch_size", batch, int) // (steps * _world_size())
    if per < 1:
        raise ValueError(f"DeepSpeed key 'train_batch_size' = {batch} is less than one sample per micro-batch at "
                         f"{steps} accumulation step(s) and world size {_world_size()}")  # fmt: skip
    return per


def _read_optimizer(r: _Reader, out: dict) -> None:
    if "optimizer" not in r.ds:
        return
    kind = r.get("optimizer.type")
    if not isinstance(kind, str) or kind.lower() not in _OPTIMIZERS:
        raise ValueError(f"DeepSpeed key 'optimizer.type' = {json.dumps(kind)} is refused: the engine runs "
                         "Adam, AdamW, SGD and Adagrad (Lamb, OneBitAdam, Lion and the others are DeepSpeed's)")  # fmt: skip
    name = _OPTIMIZERS[kind.lower()]
    # [Note: DeepSpeed's Adam]
    if kind.lower() == "adam" and r.get("optimizer.params.adam_w_mode", True) is False:
        name = "adam"
    out["optimizer.type"] = name
    lr = r.get("optimizer.params.lr", None, arg="learning_rate")
    if lr is not None:
        out["optimizer.lr"] = _number("optimizer.params.lr", lr)
    betas = r.get("optimizer.params.betas", None, arg=("adam_beta1", "adam_beta2"))
    if betas is not None:
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ValueError(f"DeepSpeed key 'optimizer.params.betas': expected two numbers, got {betas!r}")
        out["optimizer.betas"] = [_number("optimizer.params.betas", b) for b in betas]
    for key, arg in (("eps", "adam_epsilon"), ("weight_decay", "weight_decay"), ("momentum", None)):
        value = r.get(f"optimizer.params.{key}", None, arg=arg)
        if value is not None:
            out[f"optimizer.{key}"] = _number(f"optimizer.params.{key}", value)
    nesterov = r.get("optimizer.params.nesterov")
    if nesterov is not None:
        out["optimizer.nesterov"] = nesterov
    if name == "adamw" and r.get("optimizer.params.torch_adam", False) is True:
        # DeepSpeed's torch_adam builds torch.optim.AdamW from the params, with its weight decay 0.01.
        out.setdefault("optimizer.weight_decay", 0.01)
    for key, value in _OPTIMIZER_DEFAULTS[name].items():
        out.setdefault(f"optimizer.{key}", value)
    if r.get("optimizer.params.bias_correction", True) is False:
        raise ValueError("DeepSpeed key 'optimizer.params.bias_correction' = false is refused: Adam without bias "
                         "correction")  # fmt: skip


def table_markdown() -> str:
    """docs/config.md's table of every DeepSpeed key, from `RULES`."""
    rows = ["| DeepSpeed key | here | |", "| --- | --- | --- |"]
    for key, rule in RULES.items():
        if rule.action == MAP:
            rows.append(f"| `{key}` | mapped to `{rule.target}` | {rule.why} |")
        elif rule.action == IGNORE:
            rows.append(f"| `{key}` | ignored | {rule.why} |")
        else:
            when = {"enabled": " when enabled", "present": "", "set": " when set"}[rule.when]
            rows.append(f"| `{key}` | refused{when} | {rule.why} |")
    return "\n".join(rows)



# -- the LR schedule -------------------------------------------------------------------------
_SCHEDULES = ("WarmupLR", "WarmupDecayLR")


class DeepSpeedWarmup(LRScheduler):
    """DeepSpeed's WarmupLR (``total_num_steps`` None) and WarmupDecayLR, as a torch LR
    scheduler: from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` steps
    (log: by log(k + 1) / log(steps); linear: by k / steps), then constant, or falling
    linearly to 0 at ``total_num_steps``. The optimizer's first two steps run at
    ``warmup_min_lr``, as DeepSpeed's do (it sets the minimum when made, and its first
    ``step()`` computes the warm-up at iteration 0)."""

    def __init__(self, optimizer, *, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type="log", total_num_steps=None):  # fmt: skip
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"DeepSpeed key 'scheduler.params.warmup_type' = {warmup_type!r}: expected log or linear")
        if warmup_max_lr is None:  # DeepSpeed's WarmupLR: the optimizer's lr
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lr, self.max_lr = float(warmup_min_lr), float(warmup_max_lr)
        self.warmup = max(2, int(warmup_num_steps))
        self.kind = warmup_type
        self.total = None if total_num_steps is None else int(total_num_steps)
        if self.total is not None and self.total < self.warmup:
            # DeepSpeed's WarmupDecayLR warns and trains: the warm-up, then the minimum from its
            # end on (`gamma`). Refused, it stopped a Trainer run with max_steps=1 and every
            # value "auto" (the warm-up is at least 2; an audit helper's repro).
            logger.warning("DeepSpeed key 'scheduler.params.total_num_steps' = %d is less than warmup_num_steps (%d%s): "
                           "the lr warms up, then stays at warmup_min_lr, as DeepSpeed's does",
                           self.total, self.warmup, ", at least 2" if int(warmup_num_steps) < 2 else "")  # fmt: skip
        super().__init__(optimizer)

    def gamma(self, k: int) -> float:
        """DeepSpeed's factor at its iteration ``k`` (0 after the first step)."""
        if k < self.warmup:
            return math.log(k + 1) / math.log(self.warmup) if self.kind == "log" else k / self.warmup
        if self.total is None:
            return 1.0
        return max(0.0, (self.total - k) / max(1.0, self.total - self.warmup))

    def get_lr(self):
        e = self.last_epoch  # optimizer steps taken
        gamma = 0.0 if e == 0 else self.gamma(e - 1)
        return [self.min_lr + (self.max_lr - self.min_lr) * gamma for _ in self.optimizer.param_groups]


def _refuse_schedule(kind) -> None:
    raise ValueError(f"DeepSpeed key 'scheduler.type' = {json.dumps(kind)} is refused: the engine computes "
                     f"{' and '.join(_SCHEDULES)}; pass lr_scheduler= yourself for another "
                     "(transformers' get_*_schedule_with_warmup)")  # fmt: skip


def refuse_without_optimizer(source, model) -> None:
    """DeepSpeed builds no optimizer from a config without an ``"optimizer"`` section where the
    caller gives none (its backward then refuses to run): training on here, on an AdamW at this
    engine's defaults, would be another run than any DeepSpeed one, with nothing said (an audit
    helper's repro). Refused where ``model`` has a parameter to train; a frozen model (inference
    only) needs no optimizer."""
    if load(source).get("optimizer") or not any(p.requires_grad for p in model.parameters()):
        return
    raise ValueError(
        "the DeepSpeed config has no \"optimizer\" section and initialize was given no optimizer=: DeepSpeed builds "
        "no optimizer then (its engine.backward refuses), and this engine would train on an AdamW of defaults of its "
        "own. Add an \"optimizer\" section ({\"type\": \"AdamW\", \"params\": {\"lr\": ...}}), pass optimizer= "
        "(a torch optimizer, its class, or parameter groups), or freeze the model (model.requires_grad_(False)) to "
        "run it for inference only"
    )


def lr_scheduler(source, *, training_args=None, num_training_steps=None):
    """The DeepSpeed config's ``scheduler`` as what `infinity.initialize` takes for
    ``lr_scheduler=`` (a callable of the optimizer), or None where it has none. Its ``"auto"``
    values are filled as transformers fills them: the minimum 0, the maximum the learning
    rate, the warm-up ``TrainingArguments``' warm-up steps and the total ``num_training_steps``."""
    ds = load(source)
    section = ds.get("scheduler")
    if not section:
        return None
    r = _Reader({"scheduler": section}, training_args)
    kind = section.get("type")
    if kind not in _SCHEDULES:
        _refuse_schedule(kind)
    args = training_args
    warmup = None
    if args is not None and num_training_steps is not None and hasattr(args, "get_warmup_steps"):
        warmup = max(1, args.get_warmup_steps(num_training_steps))  # as transformers fills it
    # An absent (or, without TrainingArguments, "auto") warmup_max_lr: DeepSpeed's WarmupLR takes
    # the optimizer's (first group's) lr, its WarmupDecayLR keeps 1e-3 (deepspeed/runtime/lr_schedules.py).
    max_lr = None if kind == "WarmupLR" else 0.001
    kwargs = {"warmup_min_lr": r.get("scheduler.params.warmup_min_lr", 0.0, 0.0 if args is not None else None),
              "warmup_max_lr": r.get("scheduler.params.warmup_max_lr", max_lr, arg="learning_rate"),
              "warmup_num_steps": r.match("scheduler.params.warmup_num_steps", warmup, "warmup_steps"),
              "warmup_type": r.get("scheduler.params.warmup_type", "log")}  # fmt: skip
    if kwargs["warmup_num_steps"] is None:
        kwargs["warmup_num_steps"] = 1000
    if kind == "WarmupDecayLR":
        total = r.match("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
        if total is None:
            raise ValueError("DeepSpeed key 'scheduler.params.total_num_steps': WarmupDecayLR needs it (\"auto\" "
                             "takes the Trainer's number of steps)")  # fmt: skip
        kwargs["total_num_steps"] = _number("scheduler.params.total_num_steps", total, int)
    if r.mismatches:  # as transformers' HfTrainerDeepSpeedConfig refuses them
        raise ValueError("values that disagree with the TrainingArguments (set them to \"auto\", or make them "
                         "agree): " + "; ".join(r.mismatches))  # fmt: skip
    for key in ("warmup_min_lr", "warmup_max_lr"):
        if kwargs[key] is not None:
            kwargs[key] = _number(f"scheduler.params.{key}", kwargs[key])
    kwargs["warmup_num_steps"] = _number("scheduler.params.warmup_num_steps", kwargs["warmup_num_steps"], int)
    return lambda optimizer: DeepSpeedWarmup(optimizer, **kwargs)


deepspeed_lr_scheduler = lr_scheduler  # infinity.deepspeed_lr_scheduler

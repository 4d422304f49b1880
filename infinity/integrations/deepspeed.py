"""DeepSpeed's module API for a training script written for it, on the engine.

    import infinity.integrations.deepspeed as deepspeed      # in place of `import deepspeed`
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=net,
        model_parameters=net.parameters(), training_data=trainset, config="ds_config.json")
    for batch in loader:
        loss = engine(batch); engine.backward(loss); engine.step()

or the script unchanged, ``import deepspeed`` and all, under the launcher, which puts this
module in its place (`install`)::

    python -m infinity.integrations.launch train.py --deepspeed --deepspeed_config ds_config.json
    torchrun --nproc-per-node 2 -m infinity.integrations.launch train.py --deepspeed_config ds_config.json

What such scripts call: `initialize` (its four results, DeepSpeed's arguments), `add_config_arguments`,
`init_distributed`, ``zero.Init`` (`infinity.build`: the model is made without memory and
filled into the tiers at `initialize`), ``zero.GatheredParameters``, ``comm`` (torch.distributed's
functions), ``accelerator.get_accelerator()`` (the device names), ``ops.adam``'s
``DeepSpeedCPUAdam`` and ``FusedAdam`` (torch's AdamW or Adam, which the engine runs) and
``utils``' ``logger`` and ``log_dist``. The engine answers
DeepSpeed's engine's members a loop reads (``engine.global_steps``, ``get_lr()``,
``is_gradient_accumulation_boundary()``, ``local_rank``, ...: `infinity._deepspeed_api`). The
config is read as docs/config.md's "A DeepSpeed config" says; the deepspeed package is not needed.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.machinery
import logging
import os
import socket
import sys
import types

import torch

import infinity

from .. import _deepspeed

__all__ = ["initialize", "add_config_arguments", "init_distributed", "zero", "comm", "accelerator", "ops", "utils",
           "install"]  # fmt: skip
__version__ = f"{infinity.__version__}+infinity"  # (what a script prints; not DeepSpeed's own)


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):  # fmt: skip
    """``deepspeed.initialize``: ``(engine, engine.optimizer, a data loader of training_data
    or None, engine.lr_scheduler)``.

    The config is ``config`` (or ``config_params``, its older name), or ``args.deepspeed_config``
    (`add_config_arguments`), not both, as DeepSpeed refuses both. ``model_parameters``: the
    parameters or parameter groups the config's optimizer updates (DeepSpeed's; None: every
    trainable one); ``optimizer``: a client optimizer (a torch.optim one, or a callable
    building it from the parameters), which takes the config's place; ``lr_scheduler``: a
    scheduler built on that optimizer, or a callable building one from ``engine.optimizer``,
    which takes the config's ``scheduler``'s place. The data loader takes
    ``train_micro_batch_size_per_gpu`` samples a batch, each rank its own share of
    ``training_data`` in the order DeepSpeed's loader draws (a DistributedSampler of seed 0,
    the same order every epoch)."""
    if model is None:
        raise ValueError("deepspeed.initialize: model= is required (DeepSpeed's too)")
    for name, value in (("mpu", mpu), ("mesh_param", mesh_param)):
        if value is not None:
            raise ValueError(f"deepspeed.initialize: {name}= (model or sequence parallelism) is not supported by this "
                             f"engine: it shards by ZeRO stage over every rank")  # fmt: skip
    ds = _deepspeed.load(_config_of(args, config if config is not None else config_params))
    spec = optimizer if optimizer is not None else _parameters_spec(model, model_parameters)
    engine = infinity.initialize(model, ds, optimizer=spec, lr_scheduler=lr_scheduler)
    loader = None
    if training_data is not None:
        try:
            loader = _data_loader(ds, training_data, collate_fn, engine.rank, engine.world_size)
        except BaseException:
            engine.close()
            raise
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _config_of(args, config):
    """The config given to `initialize`, or the one its ``args`` name (DeepSpeed refuses both)."""
    named = None
    for attr in ("deepspeed_config", "deepscale_config"):
        if getattr(args, attr, None) is not None:
            named = getattr(args, attr)
            break
    if named is not None and config is not None:
        raise ValueError("deepspeed.initialize: a config is given both as config= and as args.deepspeed_config "
                         f"({named!r}): give one, as DeepSpeed asks")  # fmt: skip
    config = config if config is not None else named
    if config is None:
        raise ValueError("deepspeed.initialize: no DeepSpeed config: pass config= (a dict or a path to ds_config.json) "
                         "or --deepspeed_config (deepspeed.add_config_arguments(parser))")  # fmt: skip
    return config


def _parameters_spec(model: torch.nn.Module, model_parameters):
    """What `infinity.initialize` takes as ``optimizer=`` for DeepSpeed's ``model_parameters``:
    None where they are every trainable parameter (the config's optimizer over all of them),
    else the groups or the parameters themselves."""
    if model_parameters is None:
        return None
    given = list(model_parameters)
    if given and all(isinstance(g, dict) for g in given):
        return given
    trainable = [p for p in model.parameters() if p.requires_grad]
    return None if {id(p) for p in given} == {id(p) for p in trainable} else given


def _data_loader(ds: dict, data, collate_fn, rank: int, world: int) -> torch.utils.data.DataLoader:
    micro = _deepspeed.micro_batch_size(ds)
    if micro is None:
        raise ValueError("deepspeed.initialize(training_data=...): the config sets neither "
                         "train_micro_batch_size_per_gpu nor train_batch_size, so the loader has no batch size")  # fmt: skip
    # DeepSpeed's DeepSpeedDataLoader: a DistributedSampler at any world size (its local rank is
    # never negative), its epoch never set: every epoch draws the same order.
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank)
    return torch.utils.data.DataLoader(data, batch_size=micro, sampler=sampler, collate_fn=collate_fn,
                                       drop_last=bool(ds.get("dataloader_drop_last", False)))  # fmt: skip


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``deepspeed.add_config_arguments``: ``--deepspeed`` and ``--deepspeed_config`` (and
    their older names ``--deepscale``, ``--deepscale_config``)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="train with the engine")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the DeepSpeed json config file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery=True, distributed_port=None, verbose=True,
                     timeout=None, init_method=None, dist_init_required=None, config=None, rank=-1, world_size=-1):
    """``deepspeed.init_distributed``: the process group (gloo on the CPU, nccl on GPUs) of
    torchrun's environment, or of this process alone where there is none, as DeepSpeed's
    launcher would start it (a script then asks ``deepspeed.comm.get_rank()``; it failed
    with "Default process group has not been initialized", an audit helper's repro). Nothing
    where a group is made already."""
    if torch.distributed.is_initialized():
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs = {} if timeout is None else {"timeout": timeout}
    if "WORLD_SIZE" in os.environ:  # torchrun's (one without MASTER_ADDR is torch's error, naming it)
        local = int(os.environ.get("LOCAL_RANK", "0"))
    else:
        with socket.socket() as s:  # a free port for a group of one
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                           ("MASTER_PORT", str(port))):  # fmt: skip
            os.environ.setdefault(key, value)
        local = 0
    if backend == "nccl":
        torch.cuda.set_device(local)
    torch.distributed.init_process_group(backend=backend, init_method=init_method, **kwargs)
    atexit.register(_destroy)  # (gloo's threads, left to the interpreter's exit, abort it now and then)


def _destroy() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class _Init(contextlib.AbstractContextManager):
    """``deepspeed.zero.Init``: the model made inside takes no memory (`infinity.build`) and is
    filled into the tiers at `initialize`, with its own initialisation. DeepSpeed's arguments
    are taken and not needed (the tiers come from the config given to `initialize`)."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 **kwargs):  # fmt: skip
        self._enabled = enabled
        self._build = None

    def __enter__(self):
        if self._enabled:
            self._build = infinity.build()
            self._build.__enter__()
        return self

    def __exit__(self, *exc):
        if self._build is not None:
            return self._build.__exit__(*exc)
        return None


zero = types.ModuleType("deepspeed.zero", "deepspeed.zero: Init and GatheredParameters on the engine")
zero.Init = _Init
zero.GatheredParameters = infinity.GatheredParameters


def _adam(params, lr, betas, eps, weight_decay, decoupled: bool, bias_correction: bool, amsgrad: bool, who: str):
    if not bias_correction or amsgrad:
        raise ValueError(f"deepspeed.ops.adam.{who}: bias_correction=False and amsgrad=True are not supported by "
                         "this engine's Adam (torch's, with bias correction)")  # fmt: skip
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def DeepSpeedCPUAdam(model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                     amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):  # noqa: N802 - DeepSpeed's name
    """``deepspeed.ops.adam.DeepSpeedCPUAdam``: torch's AdamW (``adamw_mode``, the default) or
    Adam with its arguments, which the engine runs on its own kernel."""
    return _adam(model_params, lr, betas, eps, weight_decay, adamw_mode, bias_correction, amsgrad, "DeepSpeedCPUAdam")


def FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
              weight_decay=0.0, amsgrad=False, set_grad_none=True):  # noqa: N802 - DeepSpeed's name
    """``deepspeed.ops.adam.FusedAdam``: torch's AdamW (``adam_w_mode``, the default) or Adam."""
    return _adam(params, lr, betas, eps, weight_decay, adam_w_mode, bias_correction, amsgrad, "FusedAdam")


ops = types.ModuleType("deepspeed.ops", "deepspeed.ops: the Adam optimizers, as torch's")
ops.adam = types.ModuleType("deepspeed.ops.adam", "deepspeed.ops.adam: DeepSpeedCPUAdam and FusedAdam, as torch's")
ops.adam.DeepSpeedCPUAdam = DeepSpeedCPUAdam
ops.adam.FusedAdam = FusedAdam


class _Comm(types.ModuleType):
    """``deepspeed.comm``: torch.distributed's functions (DeepSpeed's are its wrappers), and
    its ``get_local_rank``."""

    @staticmethod
    def get_local_rank() -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def __getattr__(self, name):
        return getattr(torch.distributed, name)


comm = _Comm("deepspeed.comm", "deepspeed.comm: torch.distributed")


class _Accelerator:
    """What ``deepspeed.accelerator.get_accelerator()`` gives a script: the device it trains on
    (CUDA where there is one, else the CPU), by DeepSpeed's method names."""

    def _name(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def device_name(self, device_index=None) -> str:
        return self._name() if device_index is None or self._name() == "cpu" else f"cuda:{device_index}"

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name() == "cuda" else "cpu"

    def current_device(self):
        return torch.cuda.current_device() if self._name() == "cuda" else 0

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name() == "cuda" else 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index=None) -> None:
        if self._name() == "cuda":
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._name() == "cuda" else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name() == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return self._name() == "cuda"

    def set_device(self, device_index) -> None:
        if self._name() == "cuda":
            torch.cuda.set_device(device_index)

    def manual_seed(self, seed) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed) -> None:
        torch.manual_seed(seed)  # (every device's generator: torch's seeds CUDA's too)

    def random(self):
        return torch.random

    def pin_memory(self, tensor, align_bytes=1):
        return tensor.pin_memory() if self._name() == "cuda" else tensor

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name() == "cuda" else 0

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._name() == "cuda" else 0

    def empty_cache(self) -> None:
        if self._name() == "cuda":
            torch.cuda.empty_cache()


def log_dist(message: str, ranks=None, level=logging.INFO) -> None:
    """``deepspeed.utils.log_dist``: ``message`` logged on the ranks in ``ranks`` (None or
    containing -1: every rank)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        utils.logger.log(level, "[Rank %d] %s", rank, message)


utils = types.ModuleType("deepspeed.utils", "deepspeed.utils: logger and log_dist")
utils.logger = logging.getLogger("DeepSpeed")
utils.log_dist = log_dist

_ACCELERATOR = _Accelerator()
accelerator = types.ModuleType("deepspeed.accelerator", "deepspeed.accelerator: get_accelerator()")
accelerator.get_accelerator = lambda: _ACCELERATOR


def install() -> None:
    """Make ``import deepspeed`` this module (and its ``zero``, ``comm``, ``accelerator``,
    ``ops.adam`` and ``utils`` these), for a script run unchanged
    (`infinity.integrations.launch`). transformers and accelerate still find no deepspeed
    package (they read its installed metadata), so their own DeepSpeed paths stay off."""
    this = sys.modules[__name__]
    names = {"deepspeed": this, "deepspeed.zero": zero, "deepspeed.comm": comm, "deepspeed.accelerator": accelerator,
             "deepspeed.ops": ops, "deepspeed.ops.adam": ops.adam, "deepspeed.utils": utils}  # fmt: skip
    for name, module in names.items():
        if module is not this:
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module

"""A training script written for DeepSpeed itself (deepspeed.initialize, engine.backward,
engine.step), on the engine through infinity.integrations.deepspeed, against the same training
in plain torch; and the script unchanged, `import deepspeed` and all, under the launcher."""

import argparse
import copy
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import infinity
import infinity.integrations.deepspeed as deepspeed


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g))


def _ds(path, **extra) -> dict:
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(path)},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(path)}},
            **extra}  # fmt: skip


def _plain(net, data, optimizer, schedule, epochs: int = 2) -> list[float]:
    """DeepSpeed's loop written out: 4 micro-batches of 2 a step (8 / (2 x 1 rank)), each loss
    divided by 4, the mean gradient clipped to 1.0, the schedule stepped after each step; the
    batches in the order DeepSpeed's loader draws them (a DistributedSampler of seed 0 whose
    epoch is never set: one order every epoch)."""
    losses = []
    order = list(torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0))
    assert order != sorted(order)  # shuffled
    for epoch in range(epochs):
        loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=order)
        for i, (x, y) in enumerate(loader):
            loss = ((net(x) - y) ** 2).mean()
            (loss / 4).backward()
            losses.append(loss.item())
            if i % 4 == 3:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                schedule.step()
    return losses


def _run(engine, loader, epochs: int = 2) -> list[float]:
    losses = []
    for epoch in range(epochs):
        for x, y in loader:
            loss = ((engine(x) - y) ** 2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def test_deepspeeds_initialize_trains_as_deepspeeds_loop_in_plain_torch(tmp_path):
    """The config's optimizer and schedule over model_parameters, its batch sizes for the
    loader of training_data, the config named by --deepspeed_config: the four results
    DeepSpeed gives, and the weights of the loop written out in torch."""
    config = tmp_path / "ds_config.json"
    ds = _ds(tmp_path, optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
             scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 3}})  # fmt: skip
    config.write_text(json.dumps(ds))
    net = _net()
    plain = copy.deepcopy(net)
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(
        ["--deepspeed", "--deepspeed_config", str(config)])  # fmt: skip
    engine, optimizer, loader, schedule = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters(),
                                                               training_data=_data())  # fmt: skip
    try:
        assert optimizer is engine.optimizer and schedule is engine.lr_scheduler and loader.batch_size == 2
        got = _run(engine, loader)
        assert engine.global_steps == 4 and engine.gradient_accumulation_steps() == 4
        weights = engine.gathered_weights()
    finally:
        engine.close()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    want = _plain(plain, _data(), opt, infinity.deepspeed_lr_scheduler(ds)(opt))
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=1e-6, atol=1e-7)


def test_a_client_optimizer_and_its_scheduler_train_as_in_plain_torch(tmp_path):
    """DeepSpeed takes the script's own optimizer and a scheduler built on it (the config has
    neither): the engine took the optimizer, and refused the scheduler as built on another
    optimizer, though it changes the very groups the engine steps with."""
    net = _net()
    plain = copy.deepcopy(net)

    def make(params):
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))

    opt, sched = make(net.parameters())
    engine, optimizer, loader, schedule = deepspeed.initialize(model=net, optimizer=opt, lr_scheduler=sched,
                                                               training_data=_data(), config=_ds(tmp_path))  # fmt: skip
    try:
        assert schedule is sched
        got = _run(engine, loader)
        assert engine.get_lr() == [1e-2 / 5]  # four steps taken
        weights = engine.gathered_weights()
    finally:
        engine.close()
    want = _plain(plain, _data(), *make(plain.parameters()))
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=1e-6, atol=1e-7)


def test_a_config_given_twice_or_not_at_all_is_refused(tmp_path):
    args = argparse.Namespace(deepspeed_config=str(tmp_path / "a.json"))
    with pytest.raises(ValueError, match="both as config= and as args.deepspeed_config"):
        deepspeed.initialize(args=args, model=_net(), config={"zero_optimization": {"stage": 3}})
    with pytest.raises(ValueError, match="no DeepSpeed config"):
        deepspeed.initialize(model=_net())


_SCRIPT = '''
import argparse, json, sys
import torch
from torch import nn
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
deepspeed.init_distributed()
with deepspeed.zero.Init():
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g))
engine, optimizer, loader, _ = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters(),
                                                    training_data=data)
device = get_accelerator().device_name(engine.local_rank)
losses, boundaries, applied = [], [], []
for x, y in loader:
    loss = ((engine(x.to(device)) - y.to(device)) ** 2).mean()
    engine.backward(loss)
    boundaries.append(engine.is_gradient_accumulation_boundary())
    engine.step()
    applied.append(engine.was_step_applied())
    losses.append(loss.item())
assert deepspeed.comm.get_rank() == 0 and deepspeed.comm.get_world_size() == 1  # (a group of one)
assert deepspeed.comm.get_local_rank() == 0 and engine.zero_optimization_stage() == 3
assert engine.gradient_clipping() == 1.0 and get_accelerator().memory_allocated() >= 0
from deepspeed.utils import log_dist, logger
log_dist(f"steps {engine.global_steps}", ranks=[0])
engine.save_checkpoint(args.out, client_state={"epoch": 1, "note": "x"})
path, client = engine.load_checkpoint(args.out)
print("RESULT " + json.dumps({"module": deepspeed.__name__, "losses": losses, "steps": engine.global_steps,
                              "client": client, "lr": engine.get_lr(), "boundaries": boundaries, "applied": applied,
                              "adam": type(DeepSpeedCPUAdam(nn.Linear(2, 2).parameters())).__name__}))
engine.close()
'''


def test_a_deepspeed_script_runs_unchanged_under_the_launcher(tmp_path):
    (tmp_path / "train.py").write_text(_SCRIPT)
    (tmp_path / "swap").mkdir()
    ds = _ds(tmp_path / "swap", optimizer={"type": "Adam", "params": {"lr": 1e-3}})
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    out = subprocess.run([sys.executable, "-m", "infinity.integrations.launch", str(tmp_path / "train.py"),
                          "--out", str(tmp_path / "ckpt"), "--deepspeed", "--deepspeed_config",
                          str(tmp_path / "ds_config.json")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["module"] == "infinity.integrations.deepspeed"
    assert len(result["losses"]) == 8 and all(x == x for x in result["losses"])
    assert result["steps"] == 2 and result["client"] == {"epoch": 1, "note": "x"} and result["lr"] == [1e-3]
    assert result["adam"] == "AdamW"
    assert result["boundaries"] == result["applied"] == [False, False, False, True] * 2  # 8 / (2 x 1 rank)


def test_deepspeeds_adam_classes_are_torchs_with_their_arguments():
    params = list(_net().parameters())
    cpu = deepspeed.ops.adam.DeepSpeedCPUAdam(params, lr=3e-3, betas=(0.8, 0.9), weight_decay=0.1)
    assert type(cpu) is torch.optim.AdamW
    assert {k: cpu.defaults[k] for k in ("lr", "betas", "weight_decay")} == {"lr": 3e-3, "betas": (0.8, 0.9),
                                                                             "weight_decay": 0.1}  # fmt: skip
    assert type(deepspeed.ops.adam.FusedAdam(params, adam_w_mode=False)) is torch.optim.Adam
    with pytest.raises(ValueError, match="bias_correction=False"):
        deepspeed.ops.adam.FusedAdam(params, bias_correction=False)

"""The CUDA path: parameters copied to the GPU on a side stream, gradients brought back."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch import nn

import infinity
from infinity import _update

sys.path.insert(0, os.path.dirname(__file__))
from _common import adopted_gradients, bias_free_mlp  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)"),
]


@pytest.mark.parametrize("tiers", [("device", "device", "device"), ("device", "device", "cpu")], ids=["ddd", "ddc"])
def test_on_the_gpu_the_gradients_backward_made_are_dropped_at_the_step(tmp_path, tiers):
    """The grads tier on the GPU adopts the gradients backward made (one parameter a unit); the
    step drops them, as zero_grad(set_to_none=True) does, so none is held through the next
    forward beside its activations (tests/infinity/test_grads.py holds the host's policy)."""
    cfg = {"tiers": dict(zip(("params", "grads", "optimizer"), tiers)), "nvme": {"paths": [str(tmp_path)]},
           "optimizer": {"overlap": False}}  # fmt: skip
    engine = infinity.initialize(bias_free_mlp(), cfg)
    try:
        assert engine.device.type == "cuda"
        alive = adopted_gradients(engine, 3)
        assert not any(any(a) for a in alive)
    finally:
        engine.close()


def _against_plain(tmp_path, tiers, steps: int, clip: float | None = None):
    """``steps`` steps of a small MLP on the GPU, the engine with ``tiers`` against plain
    PyTorch's AdamW (clipped to ``clip`` on both sides where given), the losses held within
    1e-4 (TF32 and kernel choice differ between runs on the GPU: not CPU's 1e-5). Returns the
    engine (open) and the plain model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    ref = copy.deepcopy(model).cuda()
    cfg = {"tiers": dict(zip(("params", "grads", "optimizer"), tiers)), "nvme": {"paths": [str(tmp_path)]},
           "optimizer": {"lr": 1e-3, "max_grad_norm": clip}}  # fmt: skip
    engine = infinity.initialize(model, cfg)
    assert engine.device.type == "cuda"
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(steps):
        x = torch.randn(32, 64, device="cuda")
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        ref_loss = ref(x).pow(2).mean()
        opt.zero_grad()
        ref_loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        assert abs(loss.item() - ref_loss.item()) < 1e-4
    return engine, ref


@pytest.mark.parametrize("tiers", [("device", "nvme", "device"), ("cpu", "nvme", "device")])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
def test_optimizer_on_the_gpu_with_gradients_on_nvme_matches_plain_pytorch(tmp_path, tiers, clip):
    """The step reads the gradients from nvme into host memory and its kernel runs on the GPU:
    each gradient goes over on the side stream (counted), and a clipped step's divisor is made
    on the GPU. The CPU suite runs the same placements with the device on the host, where
    nothing crosses, so only here does a gradient on the wrong device show."""
    engine, ref = _against_plain(tmp_path, tiers, 4, clip)
    grads = 4 * 4 * sum(u.shard_numel for u in engine.units)
    assert engine.stats()["total"]["h2d_bytes"] >= grads  # every gradient back to the GPU, counted
    got = engine.gathered_weights()
    for name, q in ref.named_parameters():
        torch.testing.assert_close(got[name].float().cpu(), q.detach().cpu(), rtol=1e-3, atol=1e-4, msg=name)
    engine.close()


@pytest.mark.parametrize("tiers", [("device", "device", "device"), ("device", "device", "cpu")])
def test_whole_unit_gradients_stay_where_autograd_made_them_on_the_gpu(tmp_path, tiers):
    """The grads tier on the GPU: a gradient that is all of its unit becomes the tier's tensor
    as autograd made it, and a later micro-batch's is added to it, so backward copies nothing
    ([Note: gradient hand-over] in infinity/_schedule.py); the weights are plain PyTorch's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:
                Copies.elements += args[0].numel()
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256, bias=False), nn.GELU(), nn.Linear(256, 8, bias=False))
    ref = copy.deepcopy(model).cuda()
    cfg = {"tiers": dict(zip(("params", "grads", "optimizer"), tiers)), "nvme": {"paths": [str(tmp_path)]},
           "optimizer": {"lr": 1e-3, "overlap": False}}  # fmt: skip
    engine = infinity.initialize(model, cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(3):
        for _ in range(2):
            x = torch.randn(32, 64, device="cuda")
            with Copies():
                engine.backward(engine(x).pow(2).mean())
            ref(x).pow(2).mean().backward()
        engine.step()
        opt.step()
        opt.zero_grad()
    assert Copies.elements == 0
    got = engine.gathered_weights()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach().cpu(), atol=1e-4, rtol=0)
    engine.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("tiers", [("device", "device", "cpu"), ("nvme", "cpu", "cpu"), ("nvme", "nvme", "nvme")])
def test_whole_steps_make_no_host_synchronisation(tmp_path, tiers, dtype):
    """Forward, backward and step of every placement under torch.cuda.set_sync_debug_mode: no
    operation that makes the host wait for the GPU (a blocking copy, ``.item()``, a stream or
    device synchronize) anywhere in a step. The engine's own waits are on CUDA events where a
    result is consumed (a gradient the host kernel reads), which the mode does not count. Every
    place that synchronised is listed with the Python stack that led to it (mode "warn",
    recorded, so that one run names them all; the issue's "error" fails on the first)."""
    import os
    import traceback
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)], nn.Linear(256, 8))
    cfg = {"tiers": dict(zip(("params", "grads", "optimizer"), tiers)), "nvme": {"paths": [str(tmp_path)]},
           "precision": {"param_dtype": dtype}, "optimizer": {"lr": 1e-3}}  # fmt: skip
    xs = [torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(i)) for i in range(4)]
    if dtype == "bf16":
        xs = [x.to(torch.bfloat16) for x in xs]
    seen: dict = {}
    package = os.path.dirname(infinity.__file__) + os.sep

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message) or "prototype feature" in str(message):
            return  # (the second: set_sync_debug_mode's own notice, once a process)
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if f.filename.startswith(package)]
        where = ours[-1] if ours else stack[-1]  # the engine's last frame: where it synchronised
        key = f"{where.filename}:{where.lineno} ({where.name}): {message}"
        seen.setdefault(key, "".join(traceback.format_list(stack[-10:])))

    with infinity.initialize(model, cfg) as engine:
        losses = []
        engine.backward(engine(xs[0]).float().pow(2).mean())  # the first step: lazy setup may wait
        engine.step()
        old = warnings.showwarning
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for x in xs[1:]:
                    loss = engine(x).float().pow(2).mean()
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.detach())
            finally:
                torch.cuda.set_sync_debug_mode(0)
                warnings.showwarning = old
        torch.cuda.synchronize()
        assert all(torch.isfinite(v).item() for v in losses)
    assert not seen, "host synchronisations in a step:\n" + "\n".join(f"{k}\n{v}" for k, v in seen.items())


@pytest.mark.parametrize("tiers", [("nvme", "nvme", "nvme"), ("cpu", "cpu", "cpu"), ("device", "device", "device")])
def test_gpu_training_matches_plain_pytorch(tmp_path, tiers):
    engine, ref = _against_plain(tmp_path, tiers, 5)
    total = engine.stats()["total"]
    if tiers[0] == "device":
        assert total["h2d_bytes"] == 0  # nothing to copy
    else:  # every step copies each parameter in at least once (forward; backward again unless kept)
        assert total["h2d_bytes"] >= 5 * sum(p.numel() * 4 for p in ref.parameters())
        assert total["h2d_gbps"] > 0
    if tiers[1] == "device":
        assert total["d2h_bytes"] == 0  # gradients stay on the GPU
    else:  # every gradient comes back on the side stream, once a step ([Note: gradients copied back])
        assert total["d2h_bytes"] == 5 * 4 * sum(u.padded_numel for u in engine.units)
        assert total["d2h_gbps"] > 0
    engine.close()


def _zoo():
    import os
    import sys

    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.dirname(__file__))
    import test_model_zoo  # the families, batches and config of the CPU parity tests

    return test_model_zoo


def _on_gpu(batch):
    return {k: v.cuda() for k, v in batch.items()}


@pytest.mark.parametrize("tiles", [False, True], ids=["whole", "tiled"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "t5", "mixtral"])
def test_transformers_fp32_on_gpu_match_plain_pytorch_on_gpu(tmp_path, family, tiles):
    """Every tier on nvme, computing on the GPU: losses within 1e-4 of the same model resident
    on the GPU with torch.optim.AdamW, weights within 1e-3 (kernels and reductions differ)."""
    zoo = _zoo()
    make, batch = zoo.FAMILIES[family]
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model).cuda()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    engine = infinity.initialize(model, zoo._nvme(tmp_path, "fp32", tiles))
    for step in range(zoo.STEPS):
        loss = engine(**_on_gpu(batch(step))).loss
        engine.backward(loss)
        engine.step()
        ref_loss = ref(**_on_gpu(batch(step))).loss
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        assert loss.device.type == "cuda"
        assert abs(loss.item() - ref_loss.item()) < 1e-4, (family, step, loss.item(), ref_loss.item())
    got = engine.gathered_weights()
    for name, p in ref.named_parameters():
        if name in got:
            torch.testing.assert_close(got[name], p.detach().cpu(), atol=1e-3, rtol=0, msg=f"{family} {name}")
    assert engine.stats()["total"]["h2d_bytes"] > 0
    engine.close()


@pytest.mark.parametrize("tiles", [False, True], ids=["whole", "tiled"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "t5", "mixtral"])
def test_transformers_bf16_on_gpu_match_mixed_precision_on_gpu(tmp_path, family, tiles):
    """bf16 parameters streamed from nvme to the GPU against the same mixed precision written in
    plain torch on the GPU (bf16 parameters, fp32 masters, AdamW, cast back): losses within
    two bf16 ulps (on the CPU, tests/infinity/test_model_zoo.py asks for the same bits: on the
    GPU the tiles' kernels and the fused step may round otherwise; not yet measured there)."""
    zoo = _zoo()
    make, batch = zoo.FAMILIES[family]
    torch.manual_seed(0)
    model = make()
    ref = zoo.MixedPrecision(model, "cuda")
    engine = infinity.initialize(model, zoo._nvme(tmp_path, "bf16", tiles))
    for step in range(zoo.STEPS):
        loss = engine(**_on_gpu(zoo._cast(batch(step), torch.bfloat16))).loss
        engine.backward(loss)
        engine.step()
        ref_loss = ref.step(_on_gpu(zoo._cast(batch(step), torch.bfloat16)))
        got, want = loss.float().item(), ref_loss.float().item()
        assert abs(got - want) <= 2 * 2**-7 * abs(want), (family, step, got, want)
    engine.close()


@pytest.mark.parametrize("grads", ["cpu", "nvme"])
def test_gradients_copied_back_asynchronously_match_plain_pytorch_with_accumulation(tmp_path, grads):
    """Gradients leave the GPU on a side stream into pinned buffers; the second micro-batch's
    are added on the host once landed, under the optimizer's overlap: against plain PyTorch."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(6)], nn.Linear(256, 8))
    ref = copy.deepcopy(model).cuda()
    cfg = {"tiers": {"params": "nvme", "grads": grads, "optimizer": grads}, "nvme": {"paths": [str(tmp_path)]},
           "optimizer": {"lr": 1e-3, "gradient_accumulation_steps": 2, "sub_group_size": "256KiB"}}  # fmt: skip
    engine = infinity.initialize(model, cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(4):
        opt.zero_grad()
        for _ in range(2):
            x = torch.randn(64, 256, device="cuda")
            loss = engine(x).pow(2).mean() / 2
            engine.backward(loss)
            ref_loss = ref(x).pow(2).mean() / 2
            ref_loss.backward()
            assert abs(loss.item() - ref_loss.item()) < 1e-4
        engine.step()
        opt.step()
    got = engine.gathered_weights()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach().cpu(), atol=1e-3, rtol=0, msg=name)
    assert engine.stats()["total"]["d2h_bytes"] == 4 * 2 * 4 * sum(u.padded_numel for u in engine.units)
    engine.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_activations_off_the_gpu_train_bit_identically(tmp_path, tier, dtype):
    """HF checkpointing on the GPU: the block inputs copied back on the side stream to pinned
    host tensors (cpu) or through pool buffers to nvme, and copied in again for backward: the
    run with them on the GPU."""
    _zoo()  # transformers, and this directory on sys.path
    import test_activations

    def run(where):
        return test_activations._zoo_run(tmp_path, "llama", dtype, where, "non-reentrant", move=_on_gpu)

    want, got = run("device"), run(tier)
    assert got[0] == want[0]
    for k in want[1]:
        assert torch.equal(got[1][k], want[1][k]), k
    assert got[2]["activation_out_bytes"] > 0 and got[2]["activation_in_bytes"] > 0
    assert got[2]["d2h_bytes"] > want[2]["d2h_bytes"]  # the activations' copies back


def test_activations_larger_than_the_budget_go_through_the_gpu_in_chunks(tmp_path):
    """16 MiB block inputs at an 8MiB budget: each leaves the GPU and comes back a chunk at a
    time through pool buffers within the tier's share; the run is the one on the GPU."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    import test_admission as adm  # its model and config

    def run(where):
        torch.manual_seed(0)
        model, x = adm._Stack(256, 4), torch.randn(16384, 256, device="cuda")
        with infinity.initialize(model, adm._cfg(tmp_path / where, where, "8MiB")) as engine:
            losses = []
            for _ in range(2):
                loss = engine(x).pow(2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            return losses, engine.gathered_weights(), engine.stats()

    want, got = run("device"), run("nvme")
    assert got[0] == want[0]
    for k in want[1]:
        assert torch.equal(got[1][k], want[1][k]), k
    pool = got[2]["pool"]
    assert 0 < pool["by_traffic"]["activation"]["peak_bytes"] <= pool["shares"]["activation"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_host_step_copies_are_counted_and_pipelined_bit_identically(tmp_path, monkeypatch, dtype):
    """Placement device,device,cpu (ZeRO-Offload's), the optimizer after backward: each step
    brings every fp32 gradient to the host (4 B a parameter, D2H) and sends every new parameter
    back in its dtype (H2D), through pinned pool buffers on side streams ([Note: the host step
    on a GPU] in `_update`); stats() counts exactly those bytes, with their GPU time. The same
    steps with blocking copies instead (no staging) give the same weights, bit for bit: the
    arithmetic is the host kernel's either way."""
    from infinity._transport import Transport

    def run(where, pipelined):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(4)], nn.Linear(256, 8))
        cfg = {"tiers": {"params": "device", "grads": "device", "optimizer": "cpu"}, "nvme": {"paths": [str(where)]},
               "precision": {"param_dtype": dtype},
               "optimizer": {"lr": 1e-3, "overlap": False, "sub_group_size": "256KiB"}}  # fmt: skip
        with monkeypatch.context() as m:
            if not pipelined:
                m.setattr(Transport, "pipelined", property(lambda self: False))
            with infinity.initialize(model, cfg) as engine:
                st = engine.optimizer.substates
                assert _update.stages_grads(engine.transport, engine.grads.store, st) == pipelined
                assert st.stages_params(engine.transport) == pipelined
                losses, stats = [], []
                for step in range(3):
                    x = torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
                    if dtype == "bf16":
                        x = x.to(torch.bfloat16)
                    loss = engine(x).float().pow(2).mean()
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
                    stats.append(engine.stats()["step"])
                n = sum(u.shard_numel for g in engine.optimizer.groups for u in g.units)
                return losses, engine.gathered_weights(), stats, n

    want = run(tmp_path / "blocking", pipelined=False)
    got = run(tmp_path / "pipelined", pipelined=True)
    assert got[0] == want[0]
    for k in want[1]:
        assert torch.equal(got[1][k], want[1][k]), k
    itemsize = 2 if dtype == "bf16" else 4
    for losses, weights, stats, n in (want, got):
        for step in stats:
            assert step["d2h_bytes"] == 4 * n  # the gradients, fp32, once each
            assert step["h2d_bytes"] == itemsize * n  # the new parameters, converted on the host
            assert step["d2h_seconds"] > 0 and step["h2d_seconds"] > 0
            assert step["device"]["by_kind"]["grad"]["read_bytes"] == 4 * n
            assert step["device"]["by_kind"]["param"]["write_bytes"] == itemsize * n
            assert step["cpu"]["by_kind"]["master"] == {"read_bytes": 4 * n, "write_bytes": 4 * n}
            assert 0 < step["optimizer_seconds"] <= step["update_seconds"]


@pytest.mark.parametrize("device_budget", [None, 0])
def test_bf16_on_nvme_moves_28_bytes_a_parameter_with_units_kept_on_the_gpu(tmp_path, device_budget):
    """memory.device_budget keeps the parameters fetched for forward on the GPU until backward
    has used them, and the host budget holds the gradients off nvme: params read once (2 bytes),
    new params written (2), master weights and moments read and written (24). With a device
    budget of 0 backward reads every unit again (2 bytes more), and the losses are the same."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}, "nvme": {"paths": [str(tmp_path)]},
           "precision": {"param_dtype": "bf16"}, "memory": {"host_budget": "64MiB", "device_budget": device_budget},
           "optimizer": {"lr": 1e-3, "overlap": False}}  # fmt: skip
    engine = infinity.initialize(model, cfg)
    n = sum(u.numel for u in engine.units)
    for _ in range(3):
        x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    nvme = engine.stats()["step"]["nvme"]
    per_param = (nvme["read_bytes"] + nvme["write_bytes"]) / n
    engine.close()
    assert per_param <= (28.0 if device_budget is None else 30.0) + 0.01, nvme["by_kind"]


@pytest.mark.parametrize("tiers", [("device", "device", "cpu"), ("nvme", "cpu", "cpu")])
def test_early_updates_on_the_worker_match_the_step_after_backward_bit_for_bit(tmp_path, tiers):
    """The optimizer under backward with its states in host memory, on a GPU: gradients copied
    to pinned buffers on the copy-back stream, updated on the worker thread, the new parameters
    sent back on the side stream at the step (device) or written to nvme under backward (nvme):
    the weights of the step after backward, bit for bit, every sub-group committed early."""

    def run(where, overlap):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(4)], nn.Linear(256, 8))
        cfg = {"tiers": dict(zip(("params", "grads", "optimizer"), tiers)), "nvme": {"paths": [str(where)]},
               "precision": {"param_dtype": "bf16"},
               "optimizer": {"lr": 1e-3, "overlap": overlap, "sub_group_size": "256KiB", "overlap_disk": 1.0}}  # fmt: skip
        with infinity.initialize(model, cfg) as engine:
            losses, committed = [], []
            for step in range(3):
                x = torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
                loss = engine(x.to(torch.bfloat16)).float().pow(2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                committed.append(engine.overlap.committed if engine.overlap is not None else 0)
            return losses, engine.gathered_weights(), committed, len(engine.optimizer.groups)

    want = run(tmp_path / "off", False)
    got = run(tmp_path / "on", True)
    assert got[0] == want[0]
    for k in want[1]:
        assert torch.equal(got[1][k], want[1][k]), k
    assert want[2] == [0, 0, 0] and all(c == got[3] for c in got[2]), got[2]


@pytest.mark.parametrize("tiers", [("nvme", "cpu", "cpu"), ("device", "device", "cpu")], ids=["tiles", "whole"])
def test_a_tiled_linear_multiplies_on_the_tensor_cores(tmp_path, tiers):
    """bf16 tiles on the GPU. Fetched from nvme, tile by tile: the input gradient's products
    are torch.mm's bf16 -> fp32 ([Note: the input gradient's matmul on a GPU] in `_tiled`), not
    fp32 matmuls of upcast factors. With the parameters on the GPU: the whole weight's products,
    as the untiled Linear's ([Note: tiles computed whole]), no tile-by-tile product. Either way
    no farther from the fp32 computation (the same bf16 weights and input) than the untiled
    bf16 Linears' are, but by bf16 rounding (tile by tile, the two differed by 2 ulps on an
    H200, as the whole matmuls round differently)."""
    from infinity import _tiled

    assert _tiled._mm_out_dtype(), "this torch has no bf16 -> fp32 torch.mm on the GPU: the fp32 matmul runs"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 256))
    ref = copy.deepcopy(model).cuda().to(torch.bfloat16)
    cfg = {"tiers": dict(zip(("params", "grads", "optimizer"), tiers)), "nvme": {"paths": [str(tmp_path)]},
           "precision": {"param_dtype": "bf16"}, "memory": {"tile_size": "512KiB"}}  # fmt: skip
    calls = []
    real = torch.mm

    def counting(*args, **kwargs):
        calls.append(kwargs.get("out_dtype"))
        return real(*args, **kwargs)

    with infinity.initialize(model, cfg) as engine:
        assert any(u.is_tile for u in engine.units)
        x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        torch.mm = counting
        try:
            engine(x).float().pow(2).sum().backward()
        finally:
            torch.mm = real
        ref(xr).float().pow(2).sum().backward()
        exact = copy.deepcopy(ref).float()
        xe = x.detach().float().requires_grad_(True)
        exact(xe).pow(2).sum().backward()
        assert (torch.float32 in calls) == (tiers[0] == "nvme"), calls
        ours, theirs = (x.grad.float() - xe.grad).abs().max(), (xr.grad.float() - xe.grad).abs().max()
        assert ours <= 2 * theirs + 2**-10, (ours, theirs)


@pytest.mark.parametrize("tiers", [("device", "device", "cpu"), ("nvme", "cpu", "cpu")], ids=["ddc", "ncc"])
def test_tiled_modules_make_no_host_synchronisation(tmp_path, tiers):
    """A vocabulary-sized embedding and output layer cut into tiles, whole steps in bf16 under
    torch.cuda.set_sync_debug_mode("error"): the tiled embedding's lookups and gradient and the
    tiled Linear's products never wait for the GPU ([Note: a tiled embedding without host
    synchronisation] in `_tiled`)."""
    import warnings

    torch.manual_seed(0)
    vocab, width = 4096, 128
    model = nn.Sequential(nn.Embedding(vocab, width, padding_idx=0), nn.Linear(width, width), nn.Tanh(),
                          nn.Linear(width, vocab))  # fmt: skip
    cfg = {"tiers": dict(zip(("params", "grads", "optimizer"), tiers)), "nvme": {"paths": [str(tmp_path)]},
           "precision": {"param_dtype": "bf16"}, "memory": {"tile_size": "512KiB"}, "optimizer": {"lr": 1e-3}}  # fmt: skip
    ids = [torch.randint(0, vocab, (8, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(i))
           for i in range(4)]  # fmt: skip
    with infinity.initialize(model, cfg) as engine:
        assert sum(u.is_tile for u in engine.units) >= 4
        losses = []
        try:
            for i, x in enumerate(ids):
                if i == 1:  # the first step may set up lazily
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # set_sync_debug_mode's own "prototype feature" notice
                        torch.cuda.set_sync_debug_mode("error")
                loss = nn.functional.cross_entropy(engine(x).float().reshape(-1, vocab), x.reshape(-1))
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach())
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert all(torch.isfinite(v).item() for v in losses)

"""infinity-estimate (infinity.tools.estimate, infinity._estimate): every figure it prints held to
what a real `initialize` and `engine.stats()` then report for the same model and config, and
its command line."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import infinity
from infinity import _estimate
from infinity.swap import human_size
from infinity.tools import estimate as tool

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ROOT = Path(__file__).resolve().parents[2]
# A Llama of 210K parameters (0.8 MB in fp32): small tiles and sub-groups give it 21 units in 3
# sub-groups, so the figures add up over several of each, as a large model's do.
SHAPE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4)  # fmt: skip
SMALL = {"memory": {"host_budget": "64MiB", "tile_size": "256KiB"}, "optimizer": {"sub_group_size": "1MiB"}}


def make_model():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))


def config(tmp_path, tiers, **sections):
    cfg = {**SMALL, **sections, "tiers": dict(zip(_estimate.KINDS, tiers))}
    cfg["nvme"] = {"paths": [str(tmp_path / "swap")], **sections.get("nvme", {})}
    cfg["memory"] = {**SMALL["memory"], **sections.get("memory", {})}
    cfg["optimizer"] = {**SMALL["optimizer"], **sections.get("optimizer", {})}
    (tmp_path / "swap").mkdir(exist_ok=True)
    return cfg


def estimated(cfg, name="nvme"):
    (e,) = _estimate.estimate(make_model, cfg, placements={name: tuple(cfg["tiers"].values())})
    return e


def trained(cfg, steps=2):
    """engine.stats() after ``steps`` steps of the model, and the engine's overlap_from. The
    stats' resident_bytes are those at the end of the last backward, when the tiers hold the
    most (on a GPU the step drops the gradients backward made, as zero_grad(set_to_none=True)
    does)."""
    torch.manual_seed(0)
    with infinity.build(cfg):
        model = make_model()
    with infinity.initialize(model, cfg) as engine:
        ids = torch.randint(0, SHAPE["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))
        for _ in range(steps):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            resident = engine.stats()["resident_bytes"]
            engine.step()
        return {**engine.stats(), "resident_bytes": resident}, engine.overlap_from


def moved(stats) -> dict:
    """The last step's nvme bytes by kind, read and written together."""
    return {k: v["read_bytes"] + v["write_bytes"] for k, v in stats["step"]["nvme"]["by_kind"].items()}


# -- against a real initialize ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_tier_on_nvme_matches_the_engine(tmp_path, dtype):
    """All on nvme with a budget that holds everything: the disk footprint, the plan's shares and
    the overlap's budget are the engine's, and the step moves the floor, kind by kind (fp32: one
    copy of the weights, 28 bytes a parameter; bf16: 2-byte parameters read and written)."""
    cfg = config(tmp_path, ("nvme",) * 3, precision={"param_dtype": dtype})
    e = estimated(cfg)
    stats, overlap_from = trained(cfg)
    disk = list(stats["disk"].values())
    assert [{k: d[k] for k in ("state_bytes", "peak_bytes", "cap_bytes")} for d in disk] == \
        [{k: d[k] for k in ("state_bytes", "peak_bytes", "cap_bytes")} for d in e.disk]  # fmt: skip
    assert sum(e.state["nvme"].values()) == sum(d["state_bytes"] for d in disk)
    assert e.shares == stats["pool"]["shares"]
    assert e.overlap_from == overlap_from and e.overlap
    assert {k: v for k, v in e.step_floor.items() if v} == moved(stats)
    assert e.step_expected == e.step_floor  # 64MiB holds every gradient


def test_parameters_written_under_backward_take_the_engine_s_disk(tmp_path, monkeypatch):
    """Parameters on nvme, the optimizer states in host memory under backward, the new
    parameters written under backward under staged names (what a GPU does: forced here on the
    host): the disk the estimate plans for them (peak, cap) is the engine's."""
    import infinity._overlap_host as overlap_host

    monkeypatch.setattr(overlap_host, "stages_params", lambda device, store: store.uses_pool)
    cfg = config(tmp_path, ("nvme", "cpu", "cpu"), optimizer={"overlap": True, "overlap_disk": 1.0})
    e = estimated(cfg, "params-nvme")
    stats, _ = trained(cfg, steps=1)
    keys = ("state_bytes", "peak_bytes", "cap_bytes")
    disk = list(stats["disk"].values())
    assert disk[0]["peak_bytes"] > disk[0]["state_bytes"]  # the staged parameters are counted
    assert [[d[k] for k in keys] for d in disk] == [[d[k] for k in keys] for d in e.disk]


def test_two_drives_match_the_engine(tmp_path):
    """With two nvme paths the state spreads over both as the swap space places it: each
    drive's state, peak and cap are the engine's."""
    cfg = config(tmp_path, ("nvme",) * 3, nvme={"paths": [str(tmp_path / "a"), str(tmp_path / "b")],
                                                 "stripe_threshold": "256KiB", "stripe_size": "64KiB"})  # fmt: skip
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    e = estimated(cfg)
    stats, _ = trained(cfg, steps=1)
    keys = ("state_bytes", "peak_bytes", "cap_bytes")
    assert [[d[k] for k in keys] for d in stats["disk"].values()] == [[d[k] for k in keys] for d in e.disk]
    assert len(e.disk) == 2 and all(d["state_bytes"] for d in e.disk)


def test_int8_states_move_their_codes_and_scales(tmp_path):
    cfg = config(tmp_path, ("nvme",) * 3, optimizer={"state_dtype": "int8"})
    e = estimated(cfg)
    stats, _ = trained(cfg)
    assert {k: v for k, v in e.step_floor.items() if v} == moved(stats)
    assert "exp_avg.scale" in e.step_floor
    assert [d["state_bytes"] for d in stats["disk"].values()] == [d["state_bytes"] for d in e.disk]


def test_zero_infinity_matches_the_engine(tmp_path):
    """Parameters and optimizer on nvme, gradients in host memory: no gradient on the disk or
    in the step's bytes, the gradients resident in the cpu tier."""
    cfg = config(tmp_path, ("nvme", "cpu", "nvme"))
    e = estimated(cfg, "zero-infinity")
    stats, _ = trained(cfg)
    assert [d["state_bytes"] for d in stats["disk"].values()] == [d["state_bytes"] for d in e.disk]
    assert [d["peak_bytes"] for d in stats["disk"].values()] == [d["peak_bytes"] for d in e.disk]
    # With the optimizer under backward and no gradient in the pool, the plan keeps no unit for
    # backward (`_admission.finish`): the parameters are read again, as the expected figure says.
    assert e.overlap and e.shares.get("kept", 0) == 0
    assert {k: v for k, v in e.step_expected.items() if v} == moved(stats)
    assert e.state["cpu"]["grads"] == stats["resident_bytes"]["cpu"]


@pytest.mark.parametrize("tiers", [("device", "cpu", "cpu"), ("cpu", "cpu", "cpu"), ("device",) * 3])
def test_resident_state_matches_the_engine(tmp_path, tiers):
    """The device and cpu tiers hold what the estimate says (on this machine the device tier is
    host memory when there is no GPU: the engine's resident_bytes still names it "device")."""
    cfg = config(tmp_path, tiers)
    e = estimated(cfg, "x")
    stats, _ = trained(cfg, steps=2)  # (the parameters become the master weights at the first step)
    assert {t: sum(e.state[t].values()) for t in ("device", "cpu")} == stats["resident_bytes"]
    assert not e.disk and not e.step_floor


def test_floor_is_the_smallest_budget_initialize_accepts(tmp_path):
    cfg = config(tmp_path, ("nvme",) * 3)
    floor = estimated(cfg).floor
    with infinity.build(cfg):
        model = make_model()
    with pytest.raises(infinity.HostBudgetError):
        infinity.initialize(model, {**cfg, "memory": {**cfg["memory"], "host_budget": floor - 1}})
    infinity.initialize(model, {**cfg, "memory": {**cfg["memory"], "host_budget": floor}}).close()


def test_a_tight_budget_moves_between_the_floor_and_the_most(tmp_path):
    """At the floor nothing spare is held: the step moves more than the floor, never more than
    the most (every unit read again for backward, every gradient written and read back)."""
    cfg = config(tmp_path, ("nvme",) * 3)
    floor = estimated(cfg).floor
    cfg["memory"]["host_budget"] = floor
    e = estimated(cfg)
    stats, _ = trained(cfg)
    total = sum(moved(stats).values())
    assert sum(e.step_floor.values()) < total <= sum(e.step_most.values())
    assert e.step_expected["grad"] > 0  # the plan at the floor holds fewer than all the gradients


def test_below_the_floor_is_marked(tmp_path):
    cfg = config(tmp_path, ("nvme",) * 3, memory={"host_budget": "8KiB"})
    e = estimated(cfg)
    assert e.fits["budget"] is False and not e.fits_all and e.floor > 8192


def test_machine_too_small_is_marked(tmp_path):
    cfg = config(tmp_path, ("nvme",) * 3)
    small = _estimate.Machine(disk_free=[1 << 20], ram=1 << 20, gpu=1 << 20)
    (e,) = _estimate.estimate(make_model, cfg, placements={"nvme": ("nvme",) * 3}, machine=small)
    assert e.fits["disk"] is False and e.fits["ram"] is False
    assert e.fits["gpu"] is True  # nothing of this placement rests on the device
    big = _estimate.Machine(disk_free=[1 << 40], ram=1 << 40, gpu=None)
    (e,) = _estimate.estimate(make_model, cfg, placements={"device": ("device",) * 3}, machine=big)
    assert e.fits_all and e.fits["gpu"] is None


def test_nothing_is_left_on_the_disk(tmp_path):
    cfg = config(tmp_path, ("nvme",) * 3)
    _estimate.estimate(make_model, cfg)
    assert list((tmp_path / "swap").iterdir()) == []


# -- the documented figures of benchmarks/scale.py's Llamas -----------------------------------
def scale_llama(hidden, layers, intermediate, **cfg):
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                                      max_position_embeddings=64)  # fmt: skip
    return _estimate.estimate(lambda: transformers.LlamaForCausalLM(config), cfg,
                              placements={"nvme": ("nvme",) * 3},
                              machine=_estimate.Machine(disk_free=[1 << 50], ram=None, gpu=None))[0]  # fmt: skip


def per_param(e, key):
    return sum(getattr(e, key).values()) / e.params


def test_the_953m_llama_as_documented(tmp_path):
    """docs/config.md: floor 544MiB and overlap from 1115MiB at the defaults; README and
    docs/architecture.md: the fp32 floor of 28 bytes a parameter, 29.9 measured at 4GiB, and the
    arena within 1.3 x the state."""
    e = scale_llama(2048, 16, 5632, nvme={"paths": [str(tmp_path)]})
    assert e.params == 953_223_168
    assert round(e.floor / 2**20) == 544 and round(e.overlap_from / 2**20) == 1115
    assert round(per_param(e, "step_floor"), 2) == 28.0
    assert per_param(e, "step_floor") < 29.9 < per_param(e, "step_most")
    assert abs(per_param(e, "step_expected") / 29.9 - 1) < 0.03  # estimated 30.3
    assert round(e.disk[0]["peak_bytes"] / e.disk[0]["state_bytes"], 3) == 1.3


@pytest.mark.slow
@pytest.mark.parametrize("state_dtype, budget, overlap, measured", [
    ("fp32", "4GiB", False, 30.1), ("int8", "4GiB", True, 18.3), ("int8", "4GiB", False, 18.2),
    ("int8", "6GiB", True, 16.1),
])  # fmt: skip
def test_the_953m_llama_moves_what_was_measured(tmp_path, state_dtype, budget, overlap, measured):
    """docs/architecture.md's table of the bytes of a step (benchmarks/scale.py --steps 3): the
    expected figure within 3% of each measured one, between the floor and the most."""
    e = scale_llama(2048, 16, 5632, nvme={"paths": [str(tmp_path)]}, memory={"host_budget": budget},
                    optimizer={"state_dtype": state_dtype, "overlap": overlap})  # fmt: skip
    assert per_param(e, "step_floor") - 0.05 < measured < per_param(e, "step_most")
    assert abs(per_param(e, "step_expected") / measured - 1) < 0.03


def test_the_106m_llama_as_measured(tmp_path):
    """README: 28.0 bytes a parameter at 4GiB. Measured here to the byte with `python
    benchmarks/scale.py --hidden 768 --layers 8 --intermediate 2048 --steps 2 --json` (its
    config: 4GiB, 32MiB tiles, 128MiB sub-groups, overlap on): each step read and wrote
    2962138112 bytes; engine.stats()["disk"]: state 1692680192, peak and cap 2200485888."""
    e = scale_llama(768, 8, 2048, nvme={"paths": [str(tmp_path)]})
    assert e.params == 105_788_160
    assert sum(e.step_expected.values()) == 2962138112
    assert round(per_param(e, "step_expected"), 1) == 28.0
    assert {k: e.disk[0][k] for k in ("state_bytes", "peak_bytes", "cap_bytes")} == \
        {"state_bytes": 1692680192, "peak_bytes": 2200485888, "cap_bytes": 2200485888}  # fmt: skip


# -- the command line -------------------------------------------------------------------------
def run_json(capsys, *args):
    assert tool.main([*map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_config_json_and_a_pretrained_directory(tmp_path, capsys):
    transformers.LlamaConfig(**SHAPE).save_pretrained(tmp_path / "model")
    for model in (tmp_path / "model", tmp_path / "model" / "config.json"):
        out = run_json(capsys, model, "--nvme", tmp_path, "--placement", "nvme")
        assert out["model"]["params"] == sum(p.numel() for p in make_model().parameters())
        assert "LlamaForCausalLM" in out["model"]["what"]


def test_the_command_gives_the_library_figures(tmp_path, capsys):
    cfg = config(tmp_path, ("nvme",) * 3)
    (tmp_path / "tiers.json").write_text(json.dumps(cfg))
    out = run_json(capsys, "--hidden", 64, "--layers", 2, "--intermediate", 128, "--vocab", 1000, "--heads", 4,
                   "--config", tmp_path / "tiers.json", "--placement", "config")  # fmt: skip
    (e,) = out["placements"]
    ref = estimated(cfg)
    assert e["floor"] == ref.floor and e["disk"] == ref.as_dict()["disk"]
    assert e["step_floor"] == ref.step_floor


def test_a_deepspeed_config_is_its_placement(tmp_path, capsys):
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}  # fmt: skip
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    out = run_json(capsys, "--params", "200K", "--hidden", 64, "--vocab", 1000, "--config", tmp_path / "ds_config.json",
                   "--placement", "config", "zero-infinity")  # fmt: skip
    config_e, infinity_e = out["placements"]
    assert config_e["tiers"] == infinity_e["tiers"] == {"params": "nvme", "grads": "cpu", "optimizer": "nvme"}
    assert config_e["floor"] == infinity_e["floor"]


def test_options_set_the_config(tmp_path, capsys):
    out = run_json(capsys, "--hidden", 64, "--layers", 2, "--vocab", 1000, "--nvme", tmp_path, "--host-budget",
                   "32MiB", "--param-dtype", "bf16", "--state-dtype", "bf16", "--placement", "nvme",
                   "--disk-free", "1MiB", "--ram", "1TiB", "--gpu-memory", "80GiB")  # fmt: skip
    assert out["config"] == {**out["config"], "host_budget": 32 << 20, "param_dtype": "bf16", "state_dtype": "bf16"}
    assert out["machine"] == {"paths": [str(tmp_path)], "disk_free": [1 << 20], "ram": 1 << 40, "gpu": 80 << 30}
    (e,) = out["placements"]
    assert e["fits"] == {"budget": True, "gpu": True, "ram": True, "disk": False}
    assert e["disk_refused"].startswith(f"the swap space under {str(tmp_path)!r} needs ")  # initialize's refusal
    assert f"has {human_size(1 << 20)} free" in e["disk_refused"]


def test_text_output_names_every_placement(tmp_path, capsys):
    assert tool.main(["--hidden", "64", "--layers", "2", "--vocab", "1000", "--nvme", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    for name in _estimate.PLACEMENTS:
        assert f"\n{name} (params " in text
    assert "initialize accepts" in text and "B/param expected" in text
    # the tensors' bytes, which the arena (grown in preallocated steps) may pass, up to its cap
    assert f"of tensors at most under {tmp_path} (state " in text and "in an arena grown in steps to at most" in text


def test_params_choose_a_llama_shape():
    """--params alone: the 953M Llama of benchmarks/scale.py comes out of 953M."""
    args = tool._parser().parse_args(["--params", "953M"])
    assert tool.llama_shape(args) == dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                          num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16)  # fmt: skip


@pytest.mark.parametrize("args, says", [
    (["--params", "lots"], "--params 'lots'"),
    ([], "give the model"),
    (["/no/such/config.json"], "does not exist"),
    (["--hidden", "64", "--layers", "1", "--placement", "zero"], "--placement 'zero'"),
    (["--hidden", "64", "--layers", "1", "--nvme", "{tmp}/a", "{tmp}/b", "--disk-free", "1G", "2G", "3G"], "3 sizes for 2"),
    (["--hidden", "64", "--layers", "1", "--host-budget", "lots"], "size 'lots'"),
    (["{tmp}", "--hidden", "64"], "--hidden describe a Llama"),
    # initialize refuses a swap directory whose parent is missing; the estimate said "fits" (audit T)
    (["--hidden", "64", "--layers", "1", "--nvme", "{tmp}/no/such"], "does not exist, nor does its parent"),
])  # fmt: skip
def test_bad_input_exits_2(args, says, capsys, tmp_path):
    assert tool.main([a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("infinity-estimate: error: ") and says in err


def test_a_size_is_positive(capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(["--hidden", "64", "--layers", "0"])
    assert e.value.code == 2 and "0 is not a positive size" in capsys.readouterr().err


def test_the_installed_command_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["infinity-estimate"] == "infinity.tools.estimate:main"


def test_help_reads_like_a_man_page():
    script = Path(sys.executable).parent / "infinity-estimate"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "infinity.tools.estimate"]
    proc = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for section in ("usage: infinity-estimate", "output:", "exit status:"):
        assert section in proc.stdout


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    """A Ctrl-C printed KeyboardInterrupt's traceback, where the other tools exit 130 (audit T)."""

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(tool, "run", interrupted)
    assert tool.main(["--hidden", "64", "--layers", "1"]) == 130
    assert capsys.readouterr().err == "infinity-estimate: interrupted\n"

"""The tier config: defaults, the file formats, and a ValueError naming the key for each bad value."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re

import pytest

from infinity.config import (
    AioConfig,
    NvmeConfig,
    OptimizerConfig,
    PrecisionConfig,
    TierConfig,
    TiersConfig,
    parse_size,
)

try:
    import tomllib  # noqa: F401

    HAVE_TOML = True
except ImportError:  # Python 3.10 without tomli
    HAVE_TOML = False
needs_toml = pytest.mark.skipif(not HAVE_TOML, reason="reading TOML needs Python >= 3.11 (tomllib)")


@pytest.fixture
def drives(tmp_path):
    """Two directories standing for two drives."""
    out = []
    for k in range(2):
        (tmp_path / f"nvme{k}").mkdir()
        out.append(str(tmp_path / f"nvme{k}"))
    return out


# -- bad values ----------------------------------------------------------------------------
# (a config dict, the text the error must contain): every field with a wrong type and an
# impossible value. bool is not an int here, and a number is not a size unless it is an int.
BAD = [
    ({"tiers": {"params": "disk"}}, "tiers.params: 'disk' is not one of device, cpu, nvme"),
    ({"tiers": {"params": 1}}, "tiers.params: expected a string, got int 1"),
    ({"tiers": {"grads": "gpu"}}, "tiers.grads"),
    ({"tiers": {"grads": ["cpu"]}}, "tiers.grads: expected a string, got list ['cpu']"),
    ({"tiers": {"optimizer": None}}, "tiers.optimizer"),
    ({"tiers": {"optimizer": "ssd"}}, "tiers.optimizer: 'ssd' is not one of device, cpu, nvme"),
    ({"tiers": "nvme"}, "tiers: expected a table"),
    ({"nvme": {"paths": 5}}, "nvme.paths"),
    ({"nvme": {"paths": ["/a", 1]}}, "nvme.paths[1]"),
    ({"nvme": {"paths": [""]}}, "nvme.paths[0]"),
    ({"nvme": {"paths": ["/a/{node}"]}}, "nvme.paths[0]: '/a/{node}' has a placeholder"),
    ({"nvme": {"paths": ["/a/{rank"]}}, "nvme.paths[0]"),
    ({"nvme": {"paths": ["/a/{rank[0]}"]}}, "nvme.paths[0]"),
    # A NUL, or a format spec that makes control characters ({rank:c} is NUL for rank 0), an
    # unbounded width (MemoryError) or a float: each passed, and failed later naming no key.
    ({"nvme": {"paths": ["/a/b\0c"]}}, "nvme.paths[0]: '/a/b\\x00c' holds a NUL character"),
    ({"nvme": {"paths": ["/a", "/a/{rank:c}"]}}, "nvme.paths[1]: '/a/{rank:c}' formats {rank} with 'c'"),
    ({"nvme": {"paths": ["/a/{rank:99999999999}"]}}, "nvme.paths[0]: '/a/{rank:99999999999}' formats {rank}"),
    ({"nvme": {"paths": ["/a/{local_rank:%}"]}}, "nvme.paths[0]: '/a/{local_rank:%}' formats {local_rank}"),
    ({"nvme": {"paths": ["/a/{rank!a}"]}}, "nvme.paths[0]: '/a/{rank!a}' converts {rank} with !a"),
    ({"nvme": {"paths": ["/a", "/b", "/a/"]}}, "nvme.paths[2]: '/a/' repeats nvme.paths[0]"),
    ({"nvme": {"stripe_size": 1.5}}, "nvme.stripe_size: expected a size"),
    ({"nvme": {"stripe_size": 0}}, "nvme.stripe_size"),
    ({"nvme": {"stripe_size": 1000}}, "nvme.stripe_size: 1000 bytes must be at least 1 and a multiple of 4096"),
    ({"nvme": {"stripe_threshold": -1}}, "nvme.stripe_threshold"),
    ({"nvme": {"stripe_threshold": True}}, "nvme.stripe_threshold: expected a size"),
    ({"nvme": {"grow_step": 0}}, "nvme.grow_step"),
    ({"nvme": {"grow_step": "4K1"}}, "nvme.grow_step: size '4K1'"),
    ({"nvme": {"grow_step": "6K"}}, "nvme.grow_step: 6144 bytes must be at least 1 and a multiple of 4096"),
    ({"nvme": {"grow_step": 4096.0}}, "nvme.grow_step: expected a size (int bytes, or a string such as '1MiB')"),
    ({"nvme": {"disk_budget": 1024}}, "nvme.disk_budget: 1024 bytes must be at least 4096"),
    ({"nvme": {"disk_budget": 4096.0}}, "nvme.disk_budget: expected a size (int bytes, or a string such as '1MiB')"),
    ({"nvme": {"verify": "sometimes"}}, "nvme.verify: 'sometimes' is not one of off, checkpoint, always"),
    ({"nvme": {"verify": 1}}, "nvme.verify"),
    ({"aio": {"backend": "spdk"}}, "aio.backend: 'spdk' is not one of auto, uring, threads"),
    ({"aio": {"backend": None}}, "aio.backend"),
    ({"aio": {"block_size": 0}}, "aio.block_size"),
    ({"aio": {"block_size": 4097}}, "aio.block_size"),
    ({"aio": {"block_size": "2GiB"}}, "aio.block_size: 2GiB is more than 1GiB"),
    ({"aio": {"block_size": 1.0}}, "aio.block_size"),
    ({"aio": {"queue_depth": 0}}, "aio.queue_depth: 0 must be in [1, 4096]"),
    ({"aio": {"queue_depth": 4097}}, "aio.queue_depth"),
    ({"aio": {"queue_depth": "32"}}, "aio.queue_depth: expected an int, got str '32'"),
    ({"aio": {"queue_depth": True}}, "aio.queue_depth: expected an int, got bool True"),
    ({"aio": {"queue_depth": 32.0}}, "aio.queue_depth"),
    ({"memory": {"host_budget": 0}}, "memory.host_budget"),
    ({"memory": {"host_budget": -1}}, "memory.host_budget"),
    ({"memory": {"host_budget": "4 gigs"}}, "memory.host_budget"),
    ({"memory": {"host_budget": "-4GiB"}}, "memory.host_budget"),
    ({"memory": {"host_budget": []}}, "memory.host_budget"),
    ({"memory": {"tile_size": 1024}}, "memory.tile_size: 1024 bytes must be at least 4096"),
    ({"memory": {"tile_size": [1]}}, "memory.tile_size: expected a size"),
    ({"memory": {"device_budget": -1}}, "memory.device_budget: -1 bytes must be at least 0"),
    ({"memory": {"device_budget": "half"}}, "memory.device_budget"),
    ({"memory": {"device_budget": 1.5}}, "memory.device_budget: expected a size"),
    ({"prefetch": {"depth": -1}}, "prefetch.depth"),
    ({"prefetch": {"depth": 1.5}}, "prefetch.depth"),
    ({"prefetch": {"depth": True}}, "prefetch.depth"),
    ({"prefetch": {"bytes": 0}}, "prefetch.bytes"),
    ({"prefetch": {"bytes": "lots"}}, "prefetch.bytes"),
    ({"prefetch": {"bytes": 1.5}}, "prefetch.bytes"),
    ({"precision": {"param_dtype": "float16"}}, "precision.param_dtype: 'float16' is not one of bf16, fp16, fp32"),
    ({"precision": {"param_dtype": 16}}, "precision.param_dtype"),
    ({"precision": {"initial_scale": 0}}, "precision.initial_scale"),
    ({"precision": {"initial_scale": "big"}}, "precision.initial_scale: expected a number, got str 'big'"),
    ({"precision": {"initial_scale": float("inf")}}, "precision.initial_scale"),
    ({"precision": {"growth_interval": 0}}, "precision.growth_interval"),
    ({"precision": {"growth_interval": 1.5}}, "precision.growth_interval"),
    ({"precision": {"min_scale": 0}}, "precision.min_scale"),
    ({"precision": {"min_scale": 2.0**20}}, "precision.min_scale"),  # above initial_scale
    ({"precision": {"min_scale": "1"}}, "precision.min_scale: expected a number, got str '1'"),
    ({"precision": {"backoff_factor": 1.0}}, "precision.backoff_factor"),
    ({"precision": {"backoff_factor": 0}}, "precision.backoff_factor"),
    ({"precision": {"backoff_factor": True}}, "precision.backoff_factor"),
    ({"precision": {"growth_factor": 1.0}}, "precision.growth_factor"),
    ({"precision": {"growth_factor": "2"}}, "precision.growth_factor"),
    ({"precision": {"hysteresis": 0}}, "precision.hysteresis: 0 must be at least 1"),
    ({"precision": {"hysteresis": 2.0}}, "precision.hysteresis: expected an int"),
    ({"precision": {"consecutive_hysteresis": 1}}, "precision.consecutive_hysteresis: expected true or false"),
    ({"precision": {"stop_at_min_scale": "yes"}}, "precision.stop_at_min_scale: expected true or false"),
    ({"precision": {"deepspeed_growth": 0}}, "precision.deepspeed_growth: expected true or false"),
    ({"optimizer": {"lr": -1e-4}}, "optimizer.lr: -0.0001 must be in [0.0, inf)"),
    ({"optimizer": {"lr": "fast"}}, "optimizer.lr"),
    ({"optimizer": {"lr": True}}, "optimizer.lr: expected a number, got bool True"),
    ({"optimizer": {"lr": float("nan")}}, "optimizer.lr"),
    ({"optimizer": {"betas": [0.9]}}, "optimizer.betas: expected two numbers"),
    ({"optimizer": {"betas": "0.9"}}, "optimizer.betas"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas[1]"),
    ({"optimizer": {"betas": [-0.1, 0.9]}}, "optimizer.betas[0]"),
    ({"optimizer": {"betas": [True, 0.9]}}, "optimizer.betas[0]"),
    ({"optimizer": {"eps": 0}}, "optimizer.eps"),
    ({"optimizer": {"eps": "1e-8"}}, "optimizer.eps"),
    ({"optimizer": {"weight_decay": -0.1}}, "optimizer.weight_decay"),
    ({"optimizer": {"weight_decay": None}}, "optimizer.weight_decay"),
    ({"optimizer": {"max_grad_norm": 0}}, "optimizer.max_grad_norm"),
    ({"optimizer": {"max_grad_norm": "1"}}, "optimizer.max_grad_norm"),
    ({"optimizer": {"sub_group_size": 0}}, "optimizer.sub_group_size"),
    ({"optimizer": {"sub_group_size": "1X"}}, "optimizer.sub_group_size"),
    ({"optimizer": {"sub_group_size": 11}}, "optimizer.sub_group_size: 11 bytes must be at least 12"),
    ({"optimizer": {"sub_group_size": 12.0}}, "optimizer.sub_group_size: expected a size"),
    ({"optimizer": {"gradient_accumulation_steps": 0}}, "optimizer.gradient_accumulation_steps: 0 must be at least 1"),
    ({"optimizer": {"gradient_accumulation_steps": 2.0}}, "optimizer.gradient_accumulation_steps: expected an int"),
    ({"optimizer": {"accumulation": "loop"}}, "optimizer.accumulation: 'loop' is not one of caller, engine"),
    ({"optimizer": {"accumulation": 1}}, "optimizer.accumulation: expected a string, got int 1"),
    ({"optimizer": {"overlap": 1}}, 'optimizer.overlap: expected true, false or "auto"'),
    ({"optimizer": {"overlap": "yes"}}, 'optimizer.overlap: expected true, false or "auto", got str'),
    ({"optimizer": {"overlap_disk": -0.1}}, "optimizer.overlap_disk: -0.1 must be in [0.0, inf)"),
    ({"optimizer": {"overlap_disk": "30%"}}, "optimizer.overlap_disk: expected a number"),
    ({"nvme": {"keep": "no"}}, "nvme.keep: expected true or false"),
    ({"prefetch": {"keep": 1}}, "prefetch.keep: expected true or false"),
    ({"memory": {"keep_params": "yes"}}, "memory.keep_params: expected true or false"),
    ({"optimizer": {"type": "lamb"}}, "optimizer.type: 'lamb' is not one of adamw, adam, sgd, adagrad"),
    ({"optimizer": {"type": 1}}, "optimizer.type"),
    ({"optimizer": {"state_dtype": "fp8"}}, "optimizer.state_dtype: 'fp8' is not one of fp32, bf16, int8"),
    ({"optimizer": {"state_dtype": 8}}, "optimizer.state_dtype: expected a string"),
    ({"optimizer": {"momentum": -0.5}}, "optimizer.momentum"),
    ({"optimizer": {"momentum": "0.9"}}, "optimizer.momentum"),
    ({"optimizer": {"nesterov": "yes"}}, "optimizer.nesterov: expected true or false"),
    ({"optimizer": {"nesterov": True}}, "optimizer.nesterov: needs optimizer.momentum > 0"),
    ({"activations": {"tier": "disk"}}, "activations.tier: 'disk' is not one of device, cpu, nvme"),
    ({"activations": {"tier": 1}}, "activations.tier: expected a string"),
    ({"activations": {"min_bytes": -1}}, "activations.min_bytes: -1 bytes must be at least 0"),
    ({"activations": {"min_bytes": [1]}}, "activations.min_bytes: expected a size"),
    ({"activations": {"depth": -1}}, "activations.depth: -1 must be at least 0"),
    ({"activations": {"depth": "2"}}, "activations.depth: expected an int"),
    ({"partition": {"stage": 0}}, "partition.stage: 0 must be in [1, 3]"),
    ({"partition": {"stage": 4}}, "partition.stage"),
    ({"partition": {"stage": "3"}}, "partition.stage"),
    ({"partition": {"stage": True}}, "partition.stage"),
    ({"partition": {"timeout": 0}}, "partition.timeout"),
    ({"partition": {"timeout": "60"}}, "partition.timeout"),
]


@pytest.mark.parametrize("data, message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_a_bad_value_names_its_key(data, message):
    with pytest.raises(ValueError) as info:
        TierConfig.from_dict(data)
    assert message in str(info.value)


def test_the_table_covers_every_key():
    covered = {m.split(":")[0].split("[")[0] for _, m in BAD}
    every = {f"{name}.{key}" for name, section in TierConfig().to_dict().items() for key in section}
    assert every - covered == set()


def _number(value, kinds) -> bool:
    return isinstance(value, kinds) and not isinstance(value, bool)


def _all(value, right) -> bool:
    return isinstance(value, (list, tuple)) and all(right(v) for v in value)


# What a field of each annotation accepts by type; any other value is a wrong type (a value of
# the right type that is refused is out of range: a bad choice, a bound, an unparseable size).
_RIGHT_TYPE = {
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "bool | str": lambda v: isinstance(v, (bool, str)),
    "int": lambda v: _number(v, int),
    "float": lambda v: _number(v, (int, float)),
    "float | None": lambda v: v is None or _number(v, (int, float)),
    "Size": lambda v: isinstance(v, str) or _number(v, int),
    "Size | None": lambda v: v is None or isinstance(v, str) or _number(v, int),
    "tuple[str, ...]": lambda v: isinstance(v, str) or _all(v, lambda p: isinstance(p, str)),
    "tuple[float, float]": lambda v: _all(v, lambda b: _number(b, (int, float))),  # [0.9]: a bad length
}


_EVERY_VALUE_IN_RANGE = {"nvme.keep", "prefetch.keep", "memory.keep_params", "precision.consecutive_hysteresis",
                         "precision.stop_at_min_scale", "precision.deepspeed_growth"}


def test_the_table_has_a_wrong_type_and_an_out_of_range_value_for_every_key():
    config, kinds = TierConfig(), {}
    for data, _ in BAD:
        ((section, values),) = data.items()
        if not isinstance(values, dict):  # a whole section of the wrong type
            continue
        ((key, value),) = values.items()
        annotation = {f.name: f.type for f in dataclasses.fields(getattr(config, section))}[key]
        assert annotation in _RIGHT_TYPE, f"{section}.{key}: add its annotation {annotation!r} to _RIGHT_TYPE"
        kind = "out of range" if _RIGHT_TYPE[annotation](value) else "wrong type"
        kinds.setdefault(f"{section}.{key}", set()).add(kind)
    every = [f"{name}.{key}" for name, section in config.to_dict().items() for key in section]
    for key in _EVERY_VALUE_IN_RANGE:  # any value of the right type is valid: no out-of-range row
        kinds.setdefault(key, set()).add("out of range")
    missing = [f"{k}: {kind}" for k in every for kind in ("wrong type", "out of range") if kind not in kinds.get(k, ())]
    assert missing == [], "rows missing from BAD: " + "; ".join(missing)


def test_constructors_check_too():
    with pytest.raises(ValueError, match=r"aio\.queue_depth"):
        AioConfig(queue_depth=0)
    with pytest.raises(ValueError, match="optimizer: expected a OptimizerConfig, got dict"):
        TierConfig(optimizer={"lr": 1.0})
    with pytest.raises(TypeError):  # keyword-only
        TiersConfig("nvme")


@pytest.mark.parametrize(
    "data, message",
    [({"optimizer": {"learning_rate": 1e-3}},
      "unknown key 'optimizer.learning_rate' (known: type, lr, betas, eps, weight_decay, momentum, nesterov, "
      "max_grad_norm, sub_group_size, gradient_accumulation_steps, accumulation, overlap, overlap_disk, state_dtype)"),
     ({"offload": {}}, "unknown section 'offload' (known: tiers, nvme, aio, memory, prefetch, activations, precision"),
     ([1, 2], "a tier config is a table of sections, got list")],
)  # fmt: skip
def test_unknown_names_are_errors(data, message):
    with pytest.raises(ValueError) as info:
        TierConfig.from_dict(data)
    assert message in str(info.value)


# -- defaults and files --------------------------------------------------------------------
def _assert_all_on_device(config):
    assert config == TierConfig()
    assert (config.tiers.params, config.tiers.grads, config.tiers.optimizer) == ("device",) * 3
    assert config.tiers.on_nvme == ()
    assert config.nvme.paths == ()
    assert config.memory.host_budget == 4 << 30
    assert config.aio.block_size == 4 << 20 and config.aio.queue_depth == 32
    assert config.precision.param_dtype == "fp32" and not config.precision.loss_scaling
    assert config.partition.stage == 3


def test_an_empty_dict_is_everything_on_the_device():
    _assert_all_on_device(TierConfig.from_dict({}))
    _assert_all_on_device(TierConfig.from_dict({"tiers": {}, "nvme": {}}))


@needs_toml
def test_an_empty_toml_file_is_everything_on_the_device(tmp_path):
    (tmp_path / "tiers.toml").write_text("")
    _assert_all_on_device(TierConfig.load(tmp_path / "tiers.toml"))


DOCS_EXAMPLE = """\
[tiers]
params = "nvme"        # device | cpu | nvme
grads = "cpu"
optimizer = "nvme"

[nvme]
paths = [{paths}]   # striped; "{{rank}}" may appear

[aio]
backend = "auto"       # auto | uring | threads
block_size = "1MiB"
queue_depth = 32

[memory]
host_budget = "4GiB"   # all host buffers the engine may hold, pinned or not

[prefetch]
depth = 2              # modules ahead

[precision]
param_dtype = "bf16"   # bf16 | fp16 | fp32; fp16 gets dynamic loss scaling

[optimizer]
lr = 1e-4
betas = [0.9, 0.999]
weight_decay = 0.01

[partition]
stage = 3              # ZeRO stage 1 | 2 | 3
"""


def _assert_design_example(config, drives):
    assert (config.tiers.params, config.tiers.grads, config.tiers.optimizer) == ("nvme", "cpu", "nvme")
    assert config.tiers.on_nvme == ("params", "optimizer")
    assert config.nvme.paths == tuple(drives)
    assert config.aio == AioConfig(backend="auto", block_size=1 << 20, queue_depth=32)
    assert config.memory.host_budget == 4 << 30
    assert config.prefetch.depth == 2 and config.prefetch.bytes is None
    assert config.precision.param_dtype == "bf16"
    assert config.optimizer.lr == 1e-4 and config.optimizer.betas == (0.9, 0.999)
    assert config.optimizer.weight_decay == 0.01
    assert config.partition.stage == 3 and config.partition.partition_params


@needs_toml
def test_the_design_example_loads(tmp_path, drives):
    path = tmp_path / "tiers.toml"
    path.write_text(DOCS_EXAMPLE.format(paths=", ".join(json.dumps(d) for d in drives)))
    _assert_design_example(TierConfig.load(path), drives)


@needs_toml
def test_json_loads_the_same(tmp_path, drives):
    toml_path, json_path = tmp_path / "tiers.toml", tmp_path / "tiers.json"
    toml_path.write_text(DOCS_EXAMPLE.format(paths=", ".join(json.dumps(d) for d in drives)))
    json_path.write_text(json.dumps(tomllib.loads(toml_path.read_text())))
    _assert_design_example(TierConfig.load(json_path), drives)
    assert TierConfig.load(json_path) == TierConfig.load(toml_path)


@needs_toml
def test_another_extension_is_tried_as_toml_then_json(tmp_path):
    (tmp_path / "a.cfg").write_text('[aio]\nqueue_depth = 8\n')
    (tmp_path / "b.cfg").write_text('{"aio": {"queue_depth": 8}}')
    (tmp_path / "c.cfg").write_text("queue_depth: 8\n")
    assert TierConfig.load(tmp_path / "a.cfg").aio.queue_depth == 8
    assert TierConfig.load(tmp_path / "b.cfg").aio.queue_depth == 8
    with pytest.raises(ValueError, match=r"c\.cfg: not valid TOML.* and not valid JSON.*TOML \(\.toml\) or JSON"):
        TierConfig.load(tmp_path / "c.cfg")


@needs_toml
def test_a_toml_syntax_error_names_the_file_and_line(tmp_path):
    path = tmp_path / "tiers.toml"
    path.write_text('[aio]\nqueue_depth = 32\nbackend = uring\n')
    with pytest.raises(ValueError, match=rf"{path}: not valid TOML: .*line 3"):
        TierConfig.load(path)


def test_a_json_syntax_error_names_the_file_and_line(tmp_path):
    path = tmp_path / "tiers.json"
    path.write_text('{"aio": {\n"queue_depth": 32,\n}}')
    with pytest.raises(ValueError, match=rf"{path}: not valid JSON: .*line 3"):
        TierConfig.load(path)


def test_a_bad_value_in_a_file_names_the_file_and_key(tmp_path):
    path = tmp_path / "tiers.json"
    path.write_text('{"tiers": {"params": "disk"}}')
    with pytest.raises(ValueError, match=rf"{path}: tiers\.params: 'disk'"):
        TierConfig.load(path)


def test_a_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        TierConfig.load(tmp_path / "nope.toml")


@needs_toml
def test_the_nvme_bench_snippet_loads_as_is(tmp_path):
    from infinity.tools.nvme_bench import toml_snippet

    path = tmp_path / "tiers.toml"
    path.write_text(toml_snippet(("uring", 1 << 20, 32), "basis"))
    assert TierConfig.load(path).aio == AioConfig(backend="uring", block_size=1 << 20, queue_depth=32)


# -- sizes ---------------------------------------------------------------------------------
SIZES = [("4096", 4096), ("64K", 64 << 10), ("128KiB", 128 << 10), ("1MiB", 1 << 20), ("512MiB", 512 << 20),
         ("4GiB", 4 << 30), ("1g", 1 << 30), ("1.5G", 3 << 29), (" 2 MiB ", 2 << 20), ("512B", 512)]  # fmt: skip


@pytest.mark.parametrize("text, nbytes", SIZES)
def test_sizes_parse(text, nbytes):
    assert parse_size(text) == nbytes
    assert _host_budget_of(text) == nbytes


def _host_budget_of(text):
    return TierConfig.from_dict({"memory": {"host_budget": text}}).memory.host_budget


def test_nvme_bench_parses_sizes_with_the_config_grammar():
    """One grammar for a size, so what nvme-bench prints pastes into a config: the tool uses
    this module's parser and formatter, not a copy that could drift."""
    from infinity import config
    from infinity.tools import nvme_bench

    assert nvme_bench.parse_size is config.parse_size
    assert nvme_bench.format_size is config.format_size


def test_ints_are_bytes_and_floats_are_taken_for_float_keys():
    config = TierConfig.from_dict({"memory": {"host_budget": 12288}, "optimizer": {"lr": 1, "betas": [0, 0]}})
    assert config.memory.host_budget == 12288
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)
    assert config.optimizer.betas == (0.0, 0.0)


# -- nvme paths ----------------------------------------------------------------------------
def test_rank_placeholders_are_substituted():
    nvme = NvmeConfig(paths=["/mnt/nvme{local_rank}/run/{rank}", "/mnt/{{literal}}/{rank:03d}"])
    assert nvme.resolve_paths(5, 1) == ("/mnt/nvme1/run/5", "/mnt/{literal}/005")
    assert nvme.resolve_paths() == ("/mnt/nvme0/run/0", "/mnt/{literal}/000")


def test_a_single_path_is_a_tuple_of_one(tmp_path):
    assert NvmeConfig(paths=str(tmp_path)).paths == (str(tmp_path),)
    assert NvmeConfig(paths=tmp_path).paths == (str(tmp_path),)


@pytest.mark.parametrize("tier", ["params", "grads", "optimizer"])
def test_an_nvme_tier_needs_paths(tier):
    with pytest.raises(ValueError, match=rf"nvme\.paths: empty, but tiers\.{tier} is 'nvme'"):
        TierConfig.from_dict({"tiers": {tier: "nvme"}})


def test_a_missing_directory_is_fine_but_a_missing_parent_is_an_error(tmp_path, drives):
    missing = str(tmp_path / "missing")  # the swap space creates it
    TierConfig.from_dict({"tiers": {"params": "nvme"}, "nvme": {"paths": [drives[0], missing]}})
    deeper = str(tmp_path / "absent" / "swap")
    with pytest.raises(ValueError, match=rf"nvme\.paths\[1\]: '{deeper}' does not exist, nor does its parent"):
        TierConfig.from_dict({"tiers": {"params": "nvme"}, "nvme": {"paths": [drives[0], deeper]}})
    (tmp_path / "afile").write_text("")  # a parent that is a file is said as such (it said "does not exist")
    under = str(tmp_path / "afile" / "swap")
    with pytest.raises(ValueError, match=rf"'{under}' does not exist, and its parent '.*afile' is a file, not a dir"):
        TierConfig.from_dict({"tiers": {"params": "nvme"}, "nvme": {"paths": [under]}})


def test_a_file_is_not_a_directory(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"nvme\.paths\[0\]: .* is not a directory"):
        TierConfig.from_dict({"tiers": {"grads": "nvme"}, "nvme": {"paths": str(tmp_path / "f")}})


def test_an_unwritable_directory_is_an_error(drives, monkeypatch):
    # root passes access(2) for any mode bits, so the refusal is simulated
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if p == drives[1] else real(p, mode))
    with pytest.raises(ValueError, match=rf"nvme\.paths\[1\]: '{drives[1]}' is not writable"):
        TierConfig.from_dict({"tiers": {"optimizer": "nvme"}, "nvme": {"paths": drives}})


def test_a_templated_path_is_checked_up_to_its_placeholder(tmp_path, drives):
    """rank 5's directory lives on its own node; what every rank shares must exist here."""
    config = TierConfig.from_dict({"tiers": {"params": "nvme"}, "nvme": {"paths": [f"{drives[0]}/{{rank}}/x"]}})
    assert config.nvme.resolve_paths(5, 0) == (f"{drives[0]}/5/x",)
    with pytest.raises(ValueError, match=r"nvme\.paths\[0\]: '.*/missing' \(the fixed part of .*\) is not a directory"):
        TierConfig.from_dict({"tiers": {"params": "nvme"}, "nvme": {"paths": [f"{tmp_path}/missing/{{rank}}"]}})


def test_paths_are_not_checked_when_no_tier_is_on_nvme(tmp_path):
    config = TierConfig.from_dict({"tiers": {"params": "cpu"}, "nvme": {"paths": [str(tmp_path / "missing")]}})
    assert config.nvme.paths == (str(tmp_path / "missing"),)


# -- the objects ---------------------------------------------------------------------------
def test_to_dict_round_trips(drives):
    config = TierConfig.from_dict({
        "tiers": {"params": "nvme", "grads": "cpu", "optimizer": "nvme"},
        "nvme": {"paths": drives, "stripe_size": "2MiB", "stripe_threshold": 0, "verify": "always"},
        "aio": {"backend": "threads", "block_size": "512K", "queue_depth": 64},
        "memory": {"host_budget": "8GiB"},
        "prefetch": {"depth": 0, "bytes": "1GiB"},
        "precision": {"param_dtype": "fp16", "initial_scale": 1024, "min_scale": 2},
        "optimizer": {"lr": 3e-4, "betas": (0.8, 0.95), "max_grad_norm": 1, "sub_group_size": 12 << 20},
        "partition": {"stage": 2},
    })  # fmt: skip
    plain = config.to_dict()
    assert json.loads(json.dumps(plain)) == plain  # JSON-able, sizes as ints
    assert plain["memory"]["host_budget"] == 8 << 30 and plain["nvme"]["paths"] == drives
    assert TierConfig.from_dict(plain) == config
    assert pickle.loads(pickle.dumps(config)) == config  # it travels to spawned workers
    assert config.optimizer.sub_group_numel == 1 << 20
    assert config.precision.loss_scaling and not config.partition.partition_params


def test_sections_are_frozen():
    config = TierConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.aio.queue_depth = 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.aio = AioConfig()
    hash(config)  # frozen and hashable: usable as a cache key


def test_replace_changes_only_the_named_keys():
    config = TierConfig().replace(optimizer={"lr": 3e-4}, aio=AioConfig(queue_depth=8))
    assert config.optimizer == OptimizerConfig(lr=3e-4)
    assert config.aio.queue_depth == 8
    with pytest.raises(ValueError, match="unknown key 'optimizer.learnrate'"):
        config.replace(optimizer={"learnrate": 1.0})


def test_torch_dtype():
    import torch

    expected = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    assert {k: PrecisionConfig(param_dtype=k).torch_dtype for k in expected} == expected


def test_choices_match_the_layers_that_use_them():
    """The config names the same backends and verify modes as infinity.aio and infinity.swap."""
    from infinity import aio, config
    from infinity.swap import _space

    assert config.AIO_BACKENDS == ("auto", *aio.BACKENDS)
    assert config.VERIFY_MODES == _space.VERIFY_MODES


# -- what load refuses to read ----------------------------------------------------------------
@pytest.mark.parametrize("text", ["１GiB", "١٢٨MiB", "4\u212a"])  # fullwidth 1, Arabic-Indic 128, Kelvin sign K
def test_sizes_take_only_ascii_digits_and_units(text):
    with pytest.raises(ValueError, match=re.escape(f"memory.host_budget: size {text!r}") + ".*only ASCII"):
        _host_budget_of(text)


def test_dev_null_is_not_a_config():
    """It reads as an empty file, which would mean every default: refused instead."""
    with pytest.raises(ValueError, match="^/dev/null: is a character device, not a regular file"):
        TierConfig.load("/dev/null")


def test_a_fifo_is_not_a_config_and_is_not_waited_on(tmp_path, no_hang):
    fifo = tmp_path / "tiers.toml"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=f"^{re.escape(str(fifo))}: is a FIFO, not a regular file"):
        TierConfig.load(fifo)


def test_a_directory_is_not_a_config(tmp_path):
    (tmp_path / "tiers.toml").mkdir()
    with pytest.raises(ValueError, match="tiers.toml: is a directory, not a regular file"):
        TierConfig.load(tmp_path / "tiers.toml")


def test_an_empty_json_file_is_not_valid_json(tmp_path):
    """An empty TOML file is every default (an empty table); JSON has no empty document."""
    path = tmp_path / "tiers.json"
    path.write_text("")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: not valid JSON: the file is empty"):
        TierConfig.load(path)


@pytest.mark.parametrize("text, key", [
    ('{"aio": {"queue_depth": 8, "queue_depth": 64}}', "aio.queue_depth"),
    ('{"aio": {"queue_depth": 8}, "aio": {}}', "aio"),
])  # fmt: skip
def test_a_key_twice_in_a_json_config_names_it_and_the_file(tmp_path, text, key):
    """TOML refuses a key twice; json would keep the last one silently."""
    path = tmp_path / "tiers.json"
    path.write_text(text)
    message = f"{path}: not valid JSON: key '{key}' appears twice"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        TierConfig.load(path)

"""infinity-estimate: what a model needs on each tier, for each placement, before a run.

The figures are the engine's own: the model is built on the meta device (`infinity.build`:
nothing is allocated) and each placement's engine is made as `initialize` makes it, up to its
memory check, where the host budget is planned and the disk footprint checked by the same code
(`infinity._estimate`); nothing is written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

from infinity.swap import human_size
from infinity.tools._cli import BadInput

SYNOPSIS = """infinity-estimate [MODEL | --params N] [--hidden H --layers L --intermediate I --vocab V]
                         [--config FILE] [--nvme PATH ...] [--host-budget SIZE]
                         [--param-dtype fp32|bf16|fp16] [--state-dtype fp32|bf16|int8]
                         [--placement NAME ...] [--disk-free SIZE ...] [--ram SIZE] [--gpu-memory SIZE]
                         [--json]"""

DESCRIPTION = """\
For a model and this machine, prints for each placement of the state (params, grads,
optimizer on device, cpu or nvme; the ones DeepSpeed users pick: device, zero-offload,
params-cpu, zero-infinity, nvme, and the --config file's own):

  - the state each tier holds (device, cpu, nvme), by kind, at the end of backward (on a
    GPU the gradients backward made are dropped at the step, as zero_grad(set_to_none=True)
    does);
  - the smallest memory.host_budget initialize accepts, and the budget from which the
    optimizer runs under backward (optimizer.overlap);
  - the disk each swap directory takes at most: the tensors' bytes (the state and
    optimizer.overlap_disk of it for the overlap's staged copies), and the most its arena
    file may grow to (it grows in preallocated steps, never past that cap), as initialize
    checks them;
  - the nvme bytes of one step, by kind: the floor (every unit kept for backward, every
    gradient held), the most (none), and the expected figure (what the plan at --host-budget
    holds and keeps is not moved again);
  - whether it fits: the budget (at least the floor), the GPU's memory (the state on the
    device; activations come on top), the host memory (the state on the cpu, and on the
    device where there is no GPU, plus 1.25 x host_budget + 128MiB, the bound of the process's
    RSS growth) and each drive's free space.

The model: MODEL, a transformers config.json or a from_pretrained directory (its config.json;
no weights are read), built as its architecture names it; or a Llama of --params N parameters
(1.3B, 350M) whose shape --hidden, --layers, --intermediate and --vocab set or, left out,
are chosen for N; or a Llama of the shape given.

The machine: free space under each nvme path (--nvme, or the config's nvme.paths, or the
current directory), MemAvailable of /proc/meminfo, the GPU's total memory; --disk-free, --ram
and --gpu-memory replace what was read. A directory of the estimate's own is made under each
path for the dry engine's swap space and removed after.

Figures are for one process (one rank) and one micro-batch a step: gradient accumulation adds
its gradients' bytes a micro-batch (docs/architecture.md, "The bytes of a step"), and the
activations (the [activations] tier, or the GPU's memory) come on top of every figure."""

EPILOG = """\
output:
  text, or with --json one object: "model", "machine" and "placements" (per placement:
  tiers, state, floor, overlap_from, disk, step_floor / step_most / step_expected by kind,
  fits, needs).

exit status:
  0  the estimate was printed
  1  an nvme path could not be written (the estimate makes a directory there and removes it)
  2  bad input (an option, a model config that cannot be read, a path initialize refuses:
     missing with its parent, or not writable)
  130 interrupted (Ctrl-C)"""

# A Llama's hidden sizes by model size, with the layers that take it to N: the smallest hidden
# whose layers stay under hidden / 64 (the proportions of Llama 1 and 2, and of the 953M model
# of benchmarks/scale.py: 2048 and 16).
_HIDDEN = (256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6656, 8192)
_COUNT = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([kmbt]?)", re.IGNORECASE)


def parse_count(text: str) -> int:
    """Parameters in "1.3B", "350M", "7b", "125000": decimal units, as model names use them."""
    m = _COUNT.fullmatch(text.strip())
    if not m:
        raise BadInput(f"--params {text!r}: expected a number with an optional K, M, B or T (1.3B, 350M)")
    n = float(m.group(1)) * 10 ** {"": 0, "k": 3, "m": 6, "b": 9, "t": 12}[m.group(2).lower()]
    if n < 1:
        raise BadInput(f"--params {text!r}: a model has at least one parameter")
    return int(n)


def llama_shape(args) -> dict:
    """The Llama shape of the options: the given sizes, the others chosen for --params."""
    vocab = args.vocab or 32000
    hidden, layers = args.hidden, args.layers

    def per_layer(h: int, inter: int) -> int:  # attention (4 h x h) and the MLP (3 h x inter), norms
        return 4 * h * h + 3 * h * inter + 2 * h

    def inter_of(h: int) -> int:  # 2.75 h rounded to 256, as the 953M model's 5632 for 2048
        return args.intermediate or math.ceil(2.75 * h / 256) * 256

    if args.params is not None:
        n = parse_count(args.params)
        for h in [hidden] if hidden else _HIDDEN:
            fixed = 2 * vocab * h + h  # embedding, output layer, final norm
            fit = layers or max(1, round((n - fixed) / per_layer(h, inter_of(h))))
            if hidden or fit <= h // 64 or h == _HIDDEN[-1]:
                hidden, layers = h, fit
                break
    if not hidden or not layers:
        raise BadInput("give the model: MODEL (a config.json or a from_pretrained directory), --params N, "
                       "or a shape (--hidden and --layers)")  # fmt: skip
    heads = max(1, hidden // 128) if hidden % 128 == 0 else 1
    if args.heads:
        heads = args.heads
    if hidden % heads:
        raise BadInput(f"--hidden {hidden} is not a multiple of --heads {heads}")
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter_of(hidden),
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads)  # fmt: skip


def model_maker(args):
    """(a description, a function making the model): from MODEL or the Llama options."""
    import transformers

    transformers.logging.set_verbosity_error()
    if args.model is None:
        shape = llama_shape(args)
        config = transformers.LlamaConfig(**shape, max_position_embeddings=64)
        names = ("vocab", "hidden", "intermediate", "layers", "heads", "kv heads")  # in llama_shape's order
        text = ", ".join(f"{name} {v}" for name, v in zip(names, shape.values()))
        return f"a Llama ({text})", lambda: transformers.LlamaForCausalLM(config)
    if not os.path.exists(args.model):
        raise BadInput(f"MODEL {args.model!r} does not exist (a config.json or a from_pretrained directory)")
    if os.path.isdir(args.model) and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise BadInput(f"MODEL {args.model!r} is a directory without a config.json")
    try:
        config = transformers.AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError, KeyError) as e:
        raise BadInput(f"MODEL {args.model!r}: transformers cannot read it as a model config: {e}") from None
    names = getattr(config, "architectures", None) or []
    cls = next((getattr(transformers, n) for n in names if hasattr(transformers, n)), None)
    if cls is not None:
        return f"{cls.__name__} from {args.model}", lambda: cls(config)
    # No architecture named: a causal LM where the config has one, else the base model.
    auto = transformers.AutoModelForCausalLM
    if type(config) not in auto._model_mapping:
        auto = transformers.AutoModel
    try:
        name = auto._model_mapping[type(config)].__name__
    except (KeyError, ValueError) as e:
        raise BadInput(f"MODEL {args.model!r}: transformers has no model for {type(config).__name__}: {e}") from None
    return f"{name} from {args.model}", lambda: auto.from_config(config)


def tier_config(args):
    """The tier config of --config (a tier config or a ds_config.json) with the options."""
    import infinity
    from infinity import _resources

    try:
        cfg = _resources.as_config(args.config) if args.config else infinity.TierConfig()
        if args.param_dtype:
            cfg = cfg.replace(precision={"param_dtype": args.param_dtype})
        if args.state_dtype:
            cfg = cfg.replace(optimizer={"state_dtype": args.state_dtype})
        if args.host_budget:
            cfg = cfg.replace(memory={"host_budget": args.host_budget})
        if args.nvme:
            cfg = cfg.replace(nvme={"paths": args.nvme})
    except (OSError, ValueError, TypeError) as e:
        raise BadInput(str(e)) from None
    return cfg


def sizes(values, what: str) -> list[int] | None:
    from infinity.config import parse_size

    if values is None:
        return None
    try:
        return [parse_size(v) for v in values]
    except ValueError as e:
        raise BadInput(f"{what}: {e}") from None


def run(args) -> dict:
    """The estimate of ``args`` as one JSON-able dict."""
    from infinity import _estimate

    what, make = model_maker(args)
    cfg = tier_config(args)
    paths = [p.format(rank=0, local_rank=0) for p in cfg.nvme.paths] or [os.getcwd()]
    for p in paths:
        if not os.path.isdir(_estimate._existing(p)):
            raise BadInput(f"nvme path {p!r}: no directory there or above it")
    if cfg.nvme.paths:
        try:  # initialize's own check: a missing directory's parent must exist (it said "fits" where initialize refuses)
            cfg.nvme.check_paths()
        except ValueError as e:
            raise BadInput(str(e)) from None
    disk = sizes(args.disk_free, "--disk-free")
    if disk is not None and len(disk) == 1 and len(paths) > 1:
        disk = disk * len(paths)
    if disk is not None and len(disk) != len(paths):
        raise BadInput(f"--disk-free: {len(disk)} sizes for {len(paths)} nvme paths ({', '.join(paths)})")
    ram, gpu = (sizes([v], o)[0] if v else None for v, o in ((args.ram, "--ram"), (args.gpu_memory, "--gpu-memory")))
    machine = _estimate.Machine.detect(paths, disk_free=disk, ram=ram, gpu=gpu)
    placements = dict(_estimate.PLACEMENTS)
    if args.config:
        placements = {"config": (cfg.tiers.params, cfg.tiers.grads, cfg.tiers.optimizer), **placements}
    if args.placement:
        unknown = [p for p in args.placement if p not in placements]
        if unknown:
            raise BadInput(f"--placement {unknown[0]!r}: expected one of {', '.join(placements)}")
        placements = {p: placements[p] for p in args.placement}
    try:
        found = _estimate.estimate(make, cfg, placements=placements, machine=machine)
    except (ValueError, TypeError) as e:  # what initialize refuses before its memory check
        raise BadInput(f"the model and config: {e}") from None
    return {
        "model": {"what": what, "params": found[0].params},
        "config": {"host_budget": cfg.memory.host_budget, "param_dtype": cfg.precision.param_dtype,
                   "state_dtype": cfg.optimizer.state_dtype, "optimizer": cfg.optimizer.type,
                   "tile_size": cfg.memory.tile_size, "sub_group_size": cfg.optimizer.sub_group_size},
        "machine": {"paths": paths, "disk_free": machine.disk_free, "ram": machine.ram, "gpu": machine.gpu},
        "placements": [e.as_dict() for e in found],
    }  # fmt: skip


def _size(n: int | None) -> str:
    return "-" if not n else human_size(n)


def _yes(v) -> str:
    return {True: "yes", False: "NO", None: "?"}[v]


def print_text(out: dict) -> None:
    m, c, mach = out["model"], out["config"], out["machine"]
    print(f"model: {m['what']}: {m['params'] / 1e6:.1f}M parameters")
    print(f"config: host_budget {human_size(c['host_budget'])}, param_dtype {c['param_dtype']}, "
          f"state_dtype {c['state_dtype']}, {c['optimizer']}, tile_size {_size(c['tile_size'])}, "
          f"sub_group_size {human_size(c['sub_group_size'])}")  # fmt: skip
    gpu = human_size(mach["gpu"]) if mach["gpu"] else "none (the device tier is host memory)"
    disk = ", ".join(f"{human_size(f)} free under {p}" for p, f in zip(mach["paths"], mach["disk_free"]))
    print(f"machine: GPU {gpu}; RAM {_size(mach['ram'])} available; disk {disk}")
    for e in out["placements"]:
        n = max(e["params"], 1)
        t = e["tiers"]
        verdict = "fits" if e["fits_all"] else "does not fit: " + ", ".join(k for k, v in e["fits"].items() if v is False)
        print(f"\n{e['name']} (params {t['params']}, grads {t['grads']}, optimizer {t['optimizer']}): {verdict}")
        tiers = []
        for tier, kinds in e["state"].items():
            total = sum(kinds.values())
            parts = ", ".join(f"{k} {human_size(v)}" for k, v in kinds.items() if v)
            tiers.append(f"{tier} {_size(total)}" + (f" ({parts})" if parts else ""))
        print(f"  state: {'; '.join(tiers)}")
        overlap = "never" if e["overlap_from"] is None else f"from {human_size(e['overlap_from'])}"
        floor = f"{human_size(e['floor'])} or more (set by the {e['floor_what']})" if e["shares"] else "any"
        print(f"  host budget: {human_size(e['host_budget'])} ({_yes(e['fits']['budget'])}); initialize accepts "
              f"{floor}; optimizer under backward {overlap}{' (on here)' if e['overlap'] else ''}")  # fmt: skip
        for d, free in zip(e["disk"], mach["disk_free"]):
            # The tensors' bytes, not the arena's: it grows in preallocated steps (by doubling
            # from 1 MiB up to nvme.grow_step), holes and alignment on top, never past the cap.
            print(f"  disk: {human_size(d['peak_bytes'])} of tensors at most under {d['path']} (state "
                  f"{human_size(d['state_bytes'])}), in an arena grown in steps to at most {human_size(d['cap_bytes'])}"
                  f"; {human_size(free)} free ({_yes(e['fits']['disk'])})")  # fmt: skip
        if e["disk_refused"]:
            print(f"  disk: initialize would refuse it: {e['disk_refused']}")
        if e["step_floor"]:
            kinds = ", ".join(f"{k} {v / n:.2f}" for k, v in e["step_floor"].items() if v)
            print(f"  nvme a step: {e['step_expected_bytes_per_param']:.2f} B/param expected "
                  f"({human_size(sum(e['step_expected'].values()))}); floor {e['step_floor_bytes_per_param']:.2f} "
                  f"({kinds}), at most {e['step_most_bytes_per_param']:.2f}")  # fmt: skip
        else:
            print("  nvme a step: nothing")
        ram = f"RAM {human_size(e['needs']['ram'])} of {_size(mach['ram'])} ({_yes(e['fits']['ram'])})"
        gpu = f"GPU {human_size(e['needs']['gpu'])} of {human_size(mach['gpu'])} ({_yes(e['fits']['gpu'])})" \
            if mach["gpu"] else "no GPU"  # fmt: skip
        print(f"  memory: {ram}; {gpu}")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive size")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infinity-estimate", usage=SYNOPSIS, description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("model", metavar="MODEL", nargs="?", help="a transformers config.json or a from_pretrained directory")
    p.add_argument("--params", metavar="N", help="a Llama of about N parameters (1.3B, 350M)")
    for flag, what in (("hidden", "hidden size"), ("layers", "layers"), ("intermediate", "MLP size (2.75 x hidden)"),
                       ("vocab", "vocabulary (32000)"), ("heads", "attention heads (hidden / 128)")):
        p.add_argument(f"--{flag}", type=_positive, metavar=flag[0].upper(), help=f"the Llama's {what}")
    p.add_argument("--config", metavar="FILE", help="a tier config (.toml, .json) or a DeepSpeed ds_config.json")
    p.add_argument("--nvme", metavar="PATH", nargs="+", help="the swap directories (nvme.paths)")
    p.add_argument("--host-budget", metavar="SIZE", help="memory.host_budget (the config's, else 4GiB)")
    p.add_argument("--param-dtype", choices=("fp32", "bf16", "fp16"), help="precision.param_dtype")
    p.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), help="optimizer.state_dtype")
    p.add_argument("--placement", metavar="NAME", nargs="+",
                   help="only these: device, zero-offload, params-cpu, zero-infinity, nvme (and config)")
    p.add_argument("--disk-free", metavar="SIZE", nargs="+", help="free space per nvme path instead of statvfs")
    p.add_argument("--ram", metavar="SIZE", help="host memory available instead of MemAvailable")
    p.add_argument("--gpu-memory", metavar="SIZE", help="GPU memory instead of the device's")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        shaped = [f"--{k}" for k in ("params", "hidden", "layers", "intermediate", "vocab", "heads")
                  if getattr(args, k) is not None]  # fmt: skip
        if args.model is not None and shaped:
            raise BadInput(f"MODEL's config.json gives its shape: {', '.join(shaped)} describe a Llama without one")
        out = run(args)
    except BadInput as e:
        print(f"infinity-estimate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (its scratch directories are removed on the way out)
        print("infinity-estimate: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # the scratch directory under an nvme path, the swap space opened there
        where = f"{e.filename}: " if e.filename else ""
        print(f"infinity-estimate: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        print_text(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

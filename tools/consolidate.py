"""infinity-consolidate: a checkpoint's weights as a Hugging Face model or one state dict file,
offline (no GPU, no engine, no training script): what DeepSpeed's ``zero_to_fp32.py`` does.

Everything is read through the engine's own checkpoint reader (every saved rank's slice of a
unit, checked against its checksum) and written through the writers of `Engine.export` and
`Engine.save_pretrained`, one unit in memory at a time: the files are those the engine would
write from the same state ([Note: consolidated checkpoint] in `infinity._consolidate`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

from infinity import aio
from infinity._consolidate import BuffersNotSaved, CheckpointWeights, JsonConfig, to_state_dict
from infinity._export import _AtomicFile, export_safetensors
from infinity._hf_save import save_pretrained, shard_bytes
from infinity.checkpoint import LATEST_NAME, META_NAME
from infinity.swap import SwapCorruption, human_size
from infinity.tools._cli import BadInput, Progress

PROG = "infinity-consolidate"
# Where InfinityTrainer saves the engine's checkpoint in its own: its ENGINE_DIR, not imported
# from infinity.integrations.transformers, which imports transformers.
TRAINER_ENGINE_DIR = "infinity"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

SYNOPSIS = f"""\
{PROG} CHECKPOINT OUTPUT [-t TAG] [--config PATH] [--dtype fp32|bf16|fp16]
                            [--max-shard-size SIZE] [--skip-buffers] [--exclude-frozen-parameters]
                            [--quiet]"""

DESCRIPTION = """\
description:
  Writes the weights of a checkpoint that engine.save_checkpoint saved (at any number of
  ranks, any stage, tiers and optimizer.state_dtype) as the engine's own export would write
  them: every key of the model's state_dict, in its order, a tied parameter under each of
  its keys, each parameter the fp32 master weights cast to the dtype the model was made in.
  It needs neither a GPU nor the model's code, and holds one parameter unit at a time.
  CHECKPOINT is a checkpoint root (the checkpoint its "latest" file names, or -t TAG), one
  checkpoint's directory, or an InfinityTrainer checkpoint (checkpoint-N: its "infinity"
  directory, and its config.json for a directory OUTPUT). Every tensor read is checked
  against its checksum.

  OUTPUT, by its name:
    DIR                 a Hugging Face directory, as engine.save_pretrained writes it
                        (model.safetensors, or shards of at most --max-shard-size and
                        model.safetensors.index.json), with --config's config.json (and a
                        generation_config.json beside it) so that
                        AutoModelForCausalLM.from_pretrained(DIR) loads it;
    FILE.safetensors    one safetensors file, as engine.export writes it;
    FILE.bin, FILE.pt   one torch.save'd state dict (zero_to_fp32's pytorch_model.bin): the
                        whole model is in memory at once.

  A checkpoint holds the model's persistent buffers (since version 2), written as saved. One
  saved by infinity before that holds no buffer values: a model with persistent buffers is
  refused, naming them, unless --skip-buffers (a model made from its config then has the
  buffers it is made with). A checkpoint saved by an older infinity still does not list the
  model's keys: its parameters are written under their own names in fp32 (unless --dtype),
  without tied aliases, and a note says so.
"""

EPILOG = """\
DeepSpeed's zero_to_fp32.py spellings are accepted: -t/--tag, --max_shard_size,
--exclude_frozen_parameters, --safe_serialization (a directory is always safetensors) and
-d/--debug (the progress lines are shown anyway). zero_to_fp32 writes fp32 whatever the model
was made in; here that is --dtype fp32, and the default is the model's own dtypes.

output:
  Progress on stderr, one line per unit redrawn where stderr is a terminal (else a line every
  5% of the units); then one line: what was written, its size, and the checkpoint's tag, step
  and ranks; then a "note:" line for each thing the output lacks or takes from elsewhere.

exit status:
  0 written; 1 the checkpoint cannot be read (missing, incomplete, a tensor that does not
  match its checksum) or the output cannot be written: nothing is left at OUTPUT but what
  was there; 2 a bad option or path, a --config that is not JSON, a model with persistent
  buffers without --skip-buffers; 130 interrupted.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, usage=SYNOPSIS, description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint root, or one checkpoint's directory")
    p.add_argument("output", metavar="OUTPUT", help="a directory, FILE.safetensors, or FILE.bin / FILE.pt")
    p.add_argument("-t", "--tag", default=LATEST_NAME, help="the checkpoint of the root to read (default: latest)")
    p.add_argument("--config", metavar="PATH",
                   help="config.json (or a directory holding it) to write beside a Hugging Face directory's weights")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="every floating-point parameter in this dtype (default: the dtype the model was made in)")
    p.add_argument("--max-shard-size", "--max_shard_size", default="2GB", metavar="SIZE",
                   help="a Hugging Face directory's largest shard, as in save_pretrained (default: 2GB)")
    p.add_argument("--skip-buffers", action="store_true",
                   help="a checkpoint of version 1, which holds no buffer values: write the parameters of a model "
                        "that has persistent buffers")
    p.add_argument("--exclude-frozen-parameters", "--exclude_frozen_parameters", action="store_true",
                   help="leave out the parameters that did not train")
    p.add_argument("--safe_serialization", "--safe-serialization", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-d", "--debug", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return p


def _output_kind(output: str) -> str:
    lower = output.lower()
    if lower.endswith(".safetensors"):
        return "safetensors"
    if lower.endswith((".bin", ".pt", ".pth")):
        return "torch"
    return "directory"


def _configs(path: str | None) -> tuple[JsonConfig | None, JsonConfig | None]:
    """config.json (and generation_config.json where it lies beside it) from ``--config``."""
    if path is None:
        return None, None
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise BadInput(f"--config {path}: no such file")
    try:
        config = JsonConfig(path)
        beside = os.path.join(os.path.dirname(path), "generation_config.json")
        generation = JsonConfig(beside) if os.path.isfile(beside) else None
    except ValueError as e:
        raise BadInput(f"--config: {e}") from None
    except OSError as e:
        raise BadInput(f"--config: cannot read {e.filename}: {e.strerror}") from None
    return config, generation


def consolidate(args) -> tuple[str, CheckpointWeights]:
    kind = _output_kind(args.output)
    if args.config is not None and kind != "directory":
        raise BadInput(f"--config is for a Hugging Face directory; {args.output!r} is a single {kind} file")
    try:
        limit = shard_bytes(args.max_shard_size)
    except ValueError as e:
        raise BadInput(str(e)) from None
    checkpoint, config_path = args.checkpoint, args.config
    trainer = os.path.join(checkpoint, TRAINER_ENGINE_DIR)
    own = any(os.path.exists(os.path.join(checkpoint, n)) for n in (META_NAME, LATEST_NAME))
    if not own and os.path.isdir(trainer):
        # An InfinityTrainer checkpoint: the engine's state is in its "infinity" directory,
        # and the model's config.json (save_pretrained's) beside it.
        checkpoint = trainer
        if config_path is None and kind == "directory" and os.path.isfile(os.path.join(args.checkpoint, "config.json")):
            config_path = args.checkpoint
    config, generation = _configs(config_path)
    output = os.path.abspath(args.output)
    if kind != "directory" and os.path.isdir(output):
        raise BadInput(f"{output} is a directory, and {kind} output is one file")
    if kind == "directory" and os.path.exists(output) and not os.path.isdir(output):
        raise BadInput(f"{output} exists and is not a directory (a file name ending in .safetensors, .bin or .pt "
                       "writes one file)")  # fmt: skip
    with aio.open_engine() as engine:
        weights = CheckpointWeights(checkpoint, args.tag, dtype=DTYPES.get(args.dtype),
                                    buffers="skip" if args.skip_buffers else "refuse",
                                    exclude_frozen=args.exclude_frozen_parameters, config=config,
                                    generation_config=generation, aio_engine=engine)  # fmt: skip
        total = len(weights.units)
        progress = None if args.quiet else Progress(total, live=sys.stderr.isatty(), log_every=max(1, total // 20))
        try:
            if progress is not None:
                weights.on_unit = lambda done, unit: progress.show(unit.name, done)
            if kind == "directory":
                made = not os.path.exists(output)
                try:
                    save_pretrained(weights, output, max_shard_size=limit)
                except BaseException:
                    if made:  # a failed run leaves nothing behind, not even the directory it made
                        with contextlib.suppress(OSError):
                            os.rmdir(output)
                    raise
            elif kind == "safetensors":
                export_safetensors(weights, output)
            else:
                tensors = to_state_dict(weights)
                _save_atomic(tensors, output)
        finally:
            weights.close()
            if progress is not None:
                progress.clear()
    if config is not None and config_path != args.config:
        weights.notes.append(f"config.json taken from {config.path}")
    return output, weights


def _save_atomic(tensors: dict, path: str) -> None:
    """torch.save to a temporary file beside ``path``, renamed over it when whole."""
    out = _AtomicFile(path, 0)
    try:
        with open(out.fd, "wb", closefd=False) as f:
            torch.save(tensors, f)
        out.commit()
    finally:
        out.discard()


def _written(output: str, kind: str) -> tuple[int, int]:
    """The tensors and bytes of what was written: the files a reader takes (a directory's
    single model.safetensors, else the shards its index names, and its configs), not other
    files already there; each file's tensors as it holds them (tied aliases once where the
    writer drops them)."""
    from safetensors import safe_open

    def tensors_in(path: str) -> int:
        with safe_open(path, framework="pt") as f:
            return len(list(f.keys()))

    if kind == "safetensors":
        return tensors_in(output), os.path.getsize(output)
    if kind != "directory":
        return len(torch.load(output, mmap=True, weights_only=True)), os.path.getsize(output)
    single = os.path.join(output, "model.safetensors")
    if os.path.isfile(single):  # it wins over an index (infinity/_hf_save.py)
        files, count = [single], tensors_in(single)
    else:
        index = os.path.join(output, "model.safetensors.index.json")
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = [index] + [os.path.join(output, n) for n in sorted(set(weight_map.values()))]
        count = len(weight_map)
    files += [p for p in (os.path.join(output, n) for n in ("config.json", "generation_config.json")) if os.path.isfile(p)]
    return count, sum(os.path.getsize(p) for p in files)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        output, weights = consolidate(args)
    except (BadInput, BuffersNotSaved) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    # CheckpointError, ManifestError, a dtype safetensors cannot hold; I/O and checksum failures
    except (ValueError, OSError, SwapCorruption, TypeError, aio.BackendUnavailable) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    meta = weights.meta
    keys, size = _written(output, _output_kind(args.output))
    print(f"wrote {output}: {keys} tensors, {human_size(size)}, from checkpoint {meta.get('tag', '?')} "
          f"(step {meta['step']}, saved by {meta['world_size']} rank(s))")  # fmt: skip
    notes = list(weights.notes)
    if _output_kind(args.output) == "directory" and weights.module.config is None:
        if os.path.isfile(os.path.join(output, "config.json")):  # another save's, maybe another model's
            notes.append("no config.json written (--config PATH): the one in the directory is as it was, "
                         "not this checkpoint's")  # fmt: skip
        else:
            notes.append("no config.json written (--config PATH): from_pretrained needs the model's")
    for note in notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

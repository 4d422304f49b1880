"""Run a transformers training script on the engine, unchanged:

    python -m infinity.integrations.launch run_clm.py --deepspeed ds_config.json ...
    torchrun --nproc-per-node 2 -m infinity.integrations.launch run_clm.py --deepspeed ds_config.json ...

Before the script runs (as ``__main__``, with its own arguments), transformers' ``Trainer`` and
``TrainingArguments`` are replaced by `InfinityTrainer` and this package's `TrainingArguments`,
whose ``deepspeed`` is the engine's config (`TierConfig.from_deepspeed`): a script written for
DeepSpeed ZeRO through the Trainer trains on the engine without an edit or the deepspeed package.
A script that names another Trainer subclass (Seq2SeqTrainer, TRL's) is not changed by this.

A script written for DeepSpeed itself (``import deepspeed``, ``deepspeed.initialize(...)``,
``engine.backward``, ``engine.step``) finds `infinity.integrations.deepspeed` under that name:
it trains on the engine unchanged too (``--deepspeed_config ds_config.json``, as it would run).
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m infinity.integrations.launch SCRIPT.py [SCRIPT'S ARGUMENTS ...]"


def install() -> None:
    """Make ``import deepspeed`` the engine's (`infinity.integrations.deepspeed`), and replace
    transformers' Trainer and TrainingArguments, where scripts import them from (where
    transformers is installed)."""
    from . import deepspeed

    deepspeed.install()
    try:
        import transformers
    except ImportError:
        return
    import transformers.trainer
    import transformers.training_args

    from . import transformers as ours

    for module in (transformers, transformers.trainer):
        module.Trainer = ours.InfinityTrainer
    for module in (transformers, transformers.training_args):
        module.TrainingArguments = ours.TrainingArguments


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    script = argv[0]
    if not os.path.isfile(script):
        print(f"infinity.integrations.launch: error: {script}: no such file", file=sys.stderr)
        return 2
    install()
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A separate process for tests/infinity/test_checkpoint_root.py: another run saving to the
same checkpoint root, stopped or killed at a chosen point of its save.

argv: mode ROOT SWAP [TAG]. Each mode trains one step on a small engine, then:
- ``pause-in-save``: saves as TAG; once its state is written (the root locked, its temporary
  directory full), prints "paused <temporary directory>" and waits for a line on stdin, then
  finishes the save and prints "saved <checkpoint directory>".
- ``die-in-save``: saves; once its state is written, prints "dying <temporary directory>" and
  exits at once with status 9, as a kill would leave it (no cleanup, no finally).
- ``die-in-prune``: saves step-0, trains a step, saves step-1 with keep_last=1; the removal of
  step-0 deletes its meta.json and the process then exits at once with status 9.
"""

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _common import config, make_model, train  # noqa: E402

import infinity  # noqa: E402
from infinity import _checkpoint  # noqa: E402

mode, root, swap = sys.argv[1:4]
engine = infinity.initialize(make_model(seed=1), config(swap, ["device"] * 3))
real_save_rank = _checkpoint._save_rank


def paused(engine, tmp):
    nbytes = real_save_rank(engine, tmp)
    print(f"paused {tmp}", flush=True)
    sys.stdin.readline()
    return nbytes


def dying(engine, tmp):
    real_save_rank(engine, tmp)
    print(f"dying {tmp}", flush=True)
    os._exit(9)


if mode == "pause-in-save":
    train(engine, 1)
    _checkpoint._save_rank = paused
    print(f"saved {engine.save_checkpoint(root, tag=sys.argv[4])}", flush=True)
elif mode == "die-in-save":
    train(engine, 1)
    _checkpoint._save_rank = dying
    engine.save_checkpoint(root)
elif mode == "die-in-prune":
    engine.save_checkpoint(root)
    train(engine, 1)
    real_rmtree = shutil.rmtree

    def killed_while_removing(path, *args, **kwargs):
        if "step-0" in os.path.basename(path):  # the checkpoint keep_last removes (whatever its name now)
            meta = os.path.join(path, "meta.json")
            if os.path.exists(meta):
                os.unlink(meta)
            os._exit(9)
        return real_rmtree(path, *args, **kwargs)

    shutil.rmtree = killed_while_removing
    engine.save_checkpoint(root, keep_last=1)
    sys.exit("the save finished: the removal of step-0 was meant to be killed")
else:
    sys.exit(f"unknown mode {mode!r}")

"""python -m infinity.tools.demo: train a GPT-2 whose training state is many times the host
memory it is given, with that state on NVMe; save it as a Hugging Face directory, stream it
back in, and show the swap space.

The model is `transformers.GPT2LMHeadModel` built from a config (random init, nothing is
downloaded) over a byte vocabulary, trained on `infinity/data/corpus.txt`. Everything the
engine moves is reported from `engine.stats()`, so the figures on screen are the engine's own;
the process's peak RSS comes from /proc/self/status.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

import infinity
from infinity.checkpoint import LATEST_NAME
from infinity.config import TIERS
from infinity.tools import swap_inspect
from infinity.tools._cli import BadInput, Progress

_PACKAGE = Path(infinity.__file__).resolve().parent
CORPUS = _PACKAGE / "data" / "corpus.txt"  # package data of `infinity`
# The repository root when run from a checkout (the default swap dir sits beside the code and
# is ignored by git); the current directory when installed elsewhere.
_ROOT = _PACKAGE.parent if (_PACKAGE.parent / "pyproject.toml").is_file() else Path.cwd()
VOCAB = 256  # bytes: every UTF-8 text is already tokenized
SIZES = {
    "tiny": dict(n_layer=2, n_embd=64, n_head=4),
    "small": dict(n_layer=4, n_embd=128, n_head=4),
    "medium": dict(n_layer=6, n_embd=256, n_head=8),
    "large": dict(n_layer=14, n_embd=384, n_head=6),  # 25.0M parameters: 381 MiB of fp32 state
}
DEFAULT_SIZE = "large"
# Per size, the defaults of --steps, --host-budget, --sample-bytes, --log-every and
# --gradient-checkpointing (host_budget None: the engine's own memory.host_budget). Recomputing
# the activations in backward keeps the process's memory far below the state it trains.
# "large" runs in a few minutes on 2 CPU cores with a budget 8.3 times below its state. Its
# largest unit (an MLP projection, 0.59M parameters) sets the floor: the optimizer step holds 3
# sub-groups of it (12 bytes a parameter) and its gradient and parameter write-behinds, 33 MiB
# (what initialize checks); the recomputing backward has held up to 41 MiB of the pool, and
# 40 MiB has run out there, hence 46 MiB.
SIZE_DEFAULTS = {
    "large": dict(steps=40, host_budget="46MiB", sample_bytes=40, log_every=5, gradient_checkpointing=True),
}
DEFAULTS = dict(steps=500, host_budget=None, sample_bytes=120, log_every=50, gradient_checkpointing=False)
# Optimizer sub-groups small enough for a budget of tens of MiB (a unit larger than this is a
# sub-group of its own); the engine lowers its read-ahead to what the budget holds.
SUB_GROUP_SIZE = "4MiB"
# At the full --lr from the first step and with no clipping, one step of the large model's 30
# threw its loss from about 3 to 8-12 (in plain PyTorch as well: the optimization, not the
# engine). The usual remedies: the learning rate rises linearly to --lr over the first
# WARMUP_STEPS steps, and the gradients are clipped to a global norm of MAX_GRAD_NORM
# (optimizer.max_grad_norm). A warmup of 10 or 20 steps still spiked once the rate passed about
# 5e-4 near step 10; over 30 the loss fell without a spike through step 50. A fixed number, not
# a fraction of --steps, so that a run stopped early and --resume'd follows the schedule of one
# that did not stop.
WARMUP_STEPS = 30
MAX_GRAD_NORM = 1.0
FP32_STATE_BYTES = 16  # a parameter's fp32 value and gradient (4 + 4) and AdamW's master and moments (12)
VAL_FRACTION = 0.1


# -- data -------------------------------------------------------------------------------------
def load_corpus(path: str | os.PathLike = CORPUS) -> torch.Tensor:
    """The file's bytes as token ids: 1-D int64, values in [0, 256)."""
    return torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()


def split_corpus(data: torch.Tensor, val_fraction: float = VAL_FRACTION) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the first 1 - val_fraction of the bytes and the rest; no byte is in both."""
    n = int(len(data) * (1 - val_fraction))
    return data[:n], data[n:]


def _check_fits(data: torch.Tensor, block_size: int, what: str) -> None:
    if len(data) < block_size + 1:
        raise ValueError(f"--block-size {block_size} needs {block_size + 1} bytes; the {what} text has {len(data)}")


def random_batches(data: torch.Tensor, block_size: int, batch_size: int, seed: int) -> Iterator[tuple]:
    """Endless (x, y) batches of random windows of block_size + 1 bytes, y = x shifted by one.
    Its own generator, so the batches depend on the seed alone, not on the model's draws."""
    _check_fits(data, block_size, "training")  # here, not at the first next()
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(block_size + 1)

    def batches():
        while True:
            starts = torch.randint(0, len(data) - block_size, (batch_size,), generator=gen)
            w = data[starts[:, None] + offsets]  # (batch, block + 1), int64
            yield w[:, :-1], w[:, 1:]

    return batches()


def eval_batches(data: torch.Tensor, block_size: int, batch_size: int) -> list[tuple]:
    """Every non-overlapping window of the text, in order: the same val loss on every run."""
    _check_fits(data, block_size, "validation")
    n = (len(data) - 1) // block_size
    x = data[: n * block_size].view(n, block_size)
    y = data[1 : n * block_size + 1].view(n, block_size)
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, n, batch_size)]


# -- model and config ------------------------------------------------------------------------
def build_model(size: str, block_size: int, seed: int, meta: bool = False) -> torch.nn.Module:
    """The GPT-2 of ``size``; with ``meta``, built inside `infinity.build`: its parameters take
    no memory until `infinity.initialize` gives them their values (the same as without)."""
    from transformers import GPT2Config, GPT2LMHeadModel, logging

    logging.set_verbosity_error()  # its notes about a config built from scratch are noise here
    torch.manual_seed(seed)
    # No dropout: a few hundred steps over 40 KB do not overfit, and dropout only slows the
    # fall of the loss. GPT-2's token ids 50256 for bos/eos do not exist in a byte vocabulary.
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=block_size, bos_token_id=None, eos_token_id=None,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **SIZES[size])  # fmt: skip
    if meta:
        with infinity.build():
            return GPT2LMHeadModel(cfg)
    return GPT2LMHeadModel(cfg)


def _default(args: argparse.Namespace, name: str):
    """The value of option ``name``: as given, else the default of --size."""
    value = getattr(args, name)
    return SIZE_DEFAULTS.get(args.size, DEFAULTS).get(name, DEFAULTS[name]) if value is None else value


def tier_config(args: argparse.Namespace):
    """The TierConfig for the run: --config's file, else one built from the flags."""
    if args.config:  # the file's settings; an explicit --host-budget replaces its memory.host_budget
        cfg = infinity.TierConfig.load(args.config)
        return cfg.replace(memory={"host_budget": args.host_budget}) if args.host_budget else cfg
    budget = _default(args, "host_budget")
    return infinity.TierConfig.from_dict({
        "tiers": {"params": args.params, "grads": args.grads, "optimizer": args.optimizer},
        "nvme": {"paths": [os.path.abspath(args.swap_dir)]},
        "precision": {"param_dtype": args.param_dtype},
        "optimizer": {"lr": args.lr, "sub_group_size": SUB_GROUP_SIZE, "max_grad_norm": MAX_GRAD_NORM},
        **({"memory": {"host_budget": budget}} if budget else {}),
    })  # fmt: skip


def reload_config(cfg, args: argparse.Namespace):
    """``cfg`` for the engine that streams the saved model back in: its nvme swap space in
    <--swap-dir>/reload, since the trained engine's space is kept for swap-inspect."""
    if cfg is None or not cfg.tiers.on_nvme:
        return cfg
    where = os.path.abspath(os.path.join(args.swap_dir, "reload"))
    os.makedirs(where, exist_ok=True)
    return cfg.replace(nvme={"paths": [where]})


# -- host memory -----------------------------------------------------------------------------
def _status_kib(field: str) -> int | None:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM), or None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class PeakRSS:
    """The growth of the process's peak resident memory (VmHWM) from the moment it is made:
    the peak is reset there (/proc/self/clear_refs) where the kernel allows it, else the peak
    is the one since the process started (``since_start``)."""

    def __init__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.since_start = False
        except OSError:
            self.since_start = True
        self.base = _status_kib("VmRSS")

    def growth(self) -> int | None:
        """Bytes the peak RSS is above the RSS at the start, or None without /proc."""
        peak = _status_kib("VmHWM")
        return None if peak is None or self.base is None else max(peak - self.base, 0) * 1024


def state_bytes(nparams: int) -> int:
    """The fp32 training state of ``nparams`` parameters as the engine keeps it with AdamW:
    value and gradient (4 + 4 bytes) and the optimizer's master weight and two moments (12)."""
    return nparams * FP32_STATE_BYTES


def format_memory(nparams: int, budget: int | None, pool_peak: int | None, rss_growth: int | None,
                  since_start: bool = False) -> list[str]:  # fmt: skip
    """The lines that show the point of the engine: the training state against the host
    budget and against what the process's peak resident memory grew by."""
    state = state_bytes(nparams)
    lines = [f"  training state: {state / 2**20:.1f} MiB ({nparams / 1e6:.2f}M parameters x {FP32_STATE_BYTES} "
             "bytes: fp32 param 4, grad 4, AdamW master and moments 12)"]  # fmt: skip
    ratios = []
    if budget:
        used = f", of which the engine's buffer pool held at most {pool_peak / 2**20:.1f} MiB" if pool_peak else ""
        lines.append(f"  host budget (memory.host_budget): {budget / 2**20:.1f} MiB{used}")
        ratios.append(f"state / host budget {state / budget:.1f}x")
    if rss_growth is not None:
        since = "process start" if since_start else "just before the model was built"
        lines.append(f"  peak RSS growth: {rss_growth / 2**20:.1f} MiB (VmHWM of /proc/self/status, from {since})")
        if rss_growth:
            ratios.append(f"state / peak RSS growth {state / rss_growth:.1f}x")
    if ratios:
        lines.append("  " + ", ".join(ratios))
    return lines


# -- what the engine reports -----------------------------------------------------------------
def _total(stats) -> dict:
    return stats.get("total", stats) if isinstance(stats, dict) else {}


def tier_bytes(stats: dict) -> dict[str, dict]:
    """{tier: its counters} for every entry of stats["total"] that has moved bytes; names and
    other keys are the engine's, and whatever is absent or idle is simply not shown."""
    return {k: v for k, v in _total(stats).items()
            if isinstance(v, dict) and (v.get("read_bytes") or v.get("write_bytes"))}  # fmt: skip


def format_rates(before: dict, after: dict, seconds: float) -> str:
    """Per tier, GB/s (1e9 bytes/s) read and written over the wall time between two stats()."""
    old, parts = _total(before), []
    for tier, c in tier_bytes(after).items():
        moved = [c.get(k, 0) - old.get(tier, {}).get(k, 0) for k in ("read_bytes", "write_bytes")]
        parts.append(f"{tier} r {moved[0] / seconds / 1e9:.2f} w {moved[1] / seconds / 1e9:.2f} GB/s")
    return " | ".join(parts)


def format_totals(stats: dict) -> list[str]:
    """The end-of-run lines: bytes and busy-time GB/s per tier, fetches, stall time, peak host
    memory; each only where the engine reports it."""
    lines = []
    for tier, c in tier_bytes(stats).items():
        row = []
        for op, verb in (("read", "read"), ("write", "written")):
            nbytes, secs = c.get(f"{op}_bytes"), c.get(f"{op}_seconds")
            if nbytes is not None:
                rate = f" at {nbytes / secs / 1e9:.2f} GB/s while busy" if secs else ""
                row.append(f"{nbytes / 1e9:.3f} GB {verb}{rate}")
        lines.append(f"  {tier}: " + ", ".join(row))
    total = _total(stats)
    if total.get("fetches"):
        how = [f"{total[k]} {what}" for k, what in (("prefetch_hits", "prefetched"), ("on_demand", "on demand"))
               if k in total]  # fmt: skip
        lines.append(f"  parameter fetches: {total['fetches']}" + (f" ({', '.join(how)})" if how else ""))
    if "stall_seconds" in total:
        lines.append(f"  stalled waiting for data: {total['stall_seconds']:.2f} s")
    peak = stats.get("peak_host_pool_bytes", total.get("peak_host_pool_bytes"))
    if peak is not None:
        budget = stats.get("host_budget_bytes")
        of = f" of its {budget / 2**20:.0f} MiB budget" if budget else ""
        lines.append(f"  peak host buffer pool: {peak / 2**20:.1f} MiB{of}")
    return lines


# -- the run ---------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(engine, batches: list[tuple]) -> float:
    engine.eval()
    total, count = 0.0, 0
    for x, y in batches:
        logits = engine(input_ids=x.to(engine.device)).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), y.to(engine.device).flatten(), reduction="sum").item()
        count += y.numel()
    engine.train()
    return total / count


@torch.no_grad()
def sample(engine, prompt: str, nbytes: int, block_size: int, seed: int, top_k: int = 5) -> str:
    """Top-k sampling, one forward per byte through the engine (so the bytes come off NVMe)."""
    engine.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt.encode()) or [ord("\n")]  # the model needs at least one byte to go on
    for _ in range(nbytes):
        ctx = torch.tensor([ids[-block_size:]], device=engine.device)
        logits = engine(input_ids=ctx).logits[0, -1].float().cpu()
        top = torch.topk(logits, top_k)
        ids.append(int(top.indices[torch.multinomial(top.values.softmax(-1), 1, generator=gen)]))
    engine.train()
    return bytes(ids).decode(errors="replace")


class StopFlag:
    """Ctrl-C asks the loop to stop after the current step instead of raising inside engine
    I/O; a second Ctrl-C raises as usual. Outside the main thread (no signals) it does nothing."""

    def __init__(self):
        self.set, self._old = False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.set = True
        signal.signal(signal.SIGINT, self._old)

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def train(args: argparse.Namespace) -> int:
    """The whole run: set up, train, report, then swap-inspect the space; the exit status."""
    engine, batches, val, first, say, memory = _setup(args)
    rank, world = engine.rank, engine.world_size
    try:
        losses = _train_loop(engine, args, batches, first, say)
        if losses is None:  # Ctrl-C: the loop has said where it stopped
            return 130
        if args.export:
            path = engine.export(args.export)
            say(f"exported the weights to {path}")
        if not losses:
            say(f"nothing to train: the checkpoint is at step {first - 1} of --steps {args.steps}")
            return 0
        val_loss = _report(engine, args, val, losses, say, memory)
        saved = engine.save_pretrained(_pretrained_dir(args))
    finally:
        # Closing flushes the manifest, so swap-inspect below reads the space as it ends.
        engine.close()
    _check_reload(args, saved, val, val_loss, say)
    if world > 1:
        torch.distributed.barrier()  # every rank's manifest is written before rank 0 looks
    if rank != 0:
        return 0
    status = _inspect_swap_space(engine.swap_dirs, world)
    _say_what_is_left(args)
    return status


def _say_what_is_left(args: argparse.Namespace) -> None:
    """The demo's files stay for a look (swap-inspect, the saved model): say where, how much
    disk they take and how to remove them."""
    where = Path(args.swap_dir)
    if not where.is_dir():
        return
    used = sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(where) for f in files)
    remove = f"rm -r {where}"
    if where.resolve() == (_ROOT / "demo-swap").resolve():
        remove = f"make clean (or {remove})"
    print(f"\nleft in {where}: {used / 2**20:.0f} MiB on disk (the swap files and the saved model); "
          f"{remove} removes them")


def _pretrained_dir(args: argparse.Namespace) -> str:
    return args.save_pretrained or os.path.join(args.swap_dir, "pretrained")


def _check_reload(args: argparse.Namespace, saved: str, val: list[tuple], val_loss: float, say) -> None:
    """Stream the saved directory back in with infinity.from_pretrained and say whether the
    reloaded engine gives the trained engine's validation loss."""
    from transformers import GPT2LMHeadModel

    say(f"saved the trained model to {saved} (save_pretrained: config.json + safetensors)")
    try:
        cfg = reload_config(tier_config(args), args)
    except (ValueError, FileNotFoundError) as e:
        raise BadInput(str(e)) from e
    engine = infinity.from_pretrained(GPT2LMHeadModel, saved, cfg)
    try:
        again = evaluate(engine, val)
    finally:
        engine.close()
    same = "the same" if again == val_loss else ("the same within 1e-6" if abs(again - val_loss) <= 1e-6 else "DIFFERENT")
    say(f"reloaded with infinity.from_pretrained(GPT2LMHeadModel, {saved!r}): val loss {again:.6f}, "
        f"trained engine {val_loss:.6f}: {same}")  # fmt: skip
    if same == "DIFFERENT":
        raise RuntimeError(f"the reloaded model's val loss {again!r} is not the trained one's {val_loss!r}")


def _setup(args: argparse.Namespace) -> tuple:
    """Build the data, model and engine, say what is trained, and go on from a checkpoint with
    --resume. Returns (engine, training batches, validation batches, first step, print of
    rank 0); BadInput for what the user can fix, the engine closed."""
    # Everything up to a built engine checks the user's input: a ValueError here is theirs to
    # fix (a window longer than the text, a config key, a host budget the machine lacks); one
    # raised later is a bug and keeps its traceback.
    try:
        train_data, val_data = split_corpus(load_corpus())
        val = eval_batches(val_data, args.block_size, args.batch_size)
        cfg = tier_config(args)
        import transformers.models.gpt2.modeling_gpt2  # noqa: F401  (its import is not the model's memory)

        memory = PeakRSS()  # from here: the model, the engine, training
        model = build_model(args.size, args.block_size, args.seed, meta=True)
        if _default(args, "gradient_checkpointing"):
            # Activations recomputed in backward, layer by layer (transformers 5 renamed the method).
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        nparams = sum(p.numel() for p in model.parameters())  # before the engine swaps them out
        engine = infinity.initialize(model, cfg, lr_scheduler=warmup)
    except (ValueError, FileNotFoundError) as e:
        raise BadInput(str(e)) from e
    memory.nparams = nparams
    # Under torchrun: data parallel, each rank its own windows; rank 0 speaks for all.
    rank, world = engine.rank, engine.world_size
    batches = random_batches(train_data, args.block_size, args.batch_size, args.seed + 1000 * rank)
    say = print if rank == 0 else _silent
    where = "" if args.config else f" (params {args.params}, grads {args.grads}, optimizer {args.optimizer})"
    ranks = f", {world} ranks" if world > 1 else ""
    shape = SIZES[args.size]
    say(f"model: a GPT-2-shaped transformers model with random weights, demo size {args.size!r} ({shape['n_layer']} "
        f"layers of width {shape['n_embd']}, a byte vocabulary): {nparams / 1e6:.2f}M parameters{where}{ranks}")
    say(f"text: {len(train_data):,} bytes to train on and {len(val_data):,} to validate on ({CORPUS.name})")
    budget = engine.stats().get("host_budget_bytes")
    of = f", {state_bytes(nparams) / budget:.1f}x its host budget of {budget / 2**20:.1f} MiB" if budget else ""
    say(f"training state {state_bytes(nparams) / 2**20:.1f} MiB{of}")
    first = 1
    try:
        if args.resume:
            first = resume(engine, args, batches, say) + 1
    except (ValueError, FileNotFoundError) as e:  # a checkpoint of another run or model
        engine.close()
        raise BadInput(str(e)) from e
    except BaseException:
        engine.close()
        raise
    return engine, batches, val, first, say, memory


def lr_factor(step: int) -> float:
    """The learning rate of step ``step + 1`` (0-based, as LambdaLR counts) over --lr."""
    return min(1.0, (step + 1) / WARMUP_STEPS)


def warmup(optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule (engine.step() steps it; checkpoints keep it): linear warmup, then --lr."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def _silent(*args, **kwargs) -> None:
    """The print of ranks other than 0."""


def _train_loop(engine, args: argparse.Namespace, batches: Iterator, first: int, say) -> list[float] | None:
    """Steps first to --steps, with the progress line and the checkpoints of --checkpoint-dir.
    Returns the loss of every step (the mean over ranks), or None when Ctrl-C stopped the loop
    (after saying so)."""
    rank, world = engine.rank, engine.world_size
    # On a terminal the line is redrawn in place; in a log, a line every --log-every steps.
    speaks = rank == 0
    progress = Progress(args.steps, live=speaks and sys.stdout.isatty(), log_every=args.log_every if speaks else 0,
                        stream=sys.stdout, width=20, counter=False)  # fmt: skip
    losses: list[float] = []
    with StopFlag() as stop:
        stats, t = engine.stats(), time.perf_counter()
        for step in range(first, args.steps + 1):
            x, y = next(batches)
            x, y = x.to(engine.device), y.to(engine.device)  # where compute runs: the GPU if any
            logits = engine(input_ids=x).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            engine.backward(loss)
            engine.step()
            losses.append(_mean_over_ranks(loss.detach(), world))
            now, new = time.perf_counter(), engine.stats()
            rates = format_rates(stats, new, now - t)
            progress.show(f"step {step}/{args.steps} loss {losses[-1]:.3f} {x.numel() / (now - t):,.0f} tok/s"
                          + (f" | {rates}" if rates else ""), done=step)  # fmt: skip
            stats, t = new, now
            if args.checkpoint_dir and (step % args.save_every == 0 or step == args.steps or stop.set):
                where = engine.save_checkpoint(args.checkpoint_dir, client_state={"data_seed": args.seed},
                                               keep_last=args.keep_last)  # fmt: skip
                progress.close()
                say(f"checkpoint {where}", flush=True)
                stats, t = engine.stats(), time.perf_counter()  # the save is not training time
            if stop.set:
                progress.close()
                saved = " (checkpoint saved: --resume goes on from it)" if args.checkpoint_dir else ""
                say(f"interrupted after step {step} of {args.steps}; the swap space is left as it is{saved}")
                return None
    progress.close()
    return losses


def _report(engine, args: argparse.Namespace, val: list[tuple], losses: list[float], say, memory=None) -> float:
    """The end of the run: train and validation loss, the engine's totals, a sample, host
    memory against the training state; returns the validation loss."""
    window = losses[-train_loss_window(args.steps, args.log_every) :]
    val_loss = evaluate(engine, val)
    which = f"mean of the last {len(window)} steps; the last step {losses[-1]:.3f}"
    which = which if len(window) > 1 else "the last step"
    say(f"train loss {sum(window) / len(window):.3f} ({which}), "
        f"val loss {val_loss:.3f} (uniform guessing: {math.log(VOCAB):.3f})")  # fmt: skip
    stats = engine.stats()
    say("\n".join(["engine totals:", *format_totals(stats)]))
    if args.sample_bytes:
        text = sample(engine, args.prompt, args.sample_bytes, args.block_size, args.seed)
        say(f"sample: {text!r}")
    if memory is not None:
        lines = format_memory(memory.nparams, stats.get("host_budget_bytes"), stats.get("peak_host_pool_bytes"),
                              memory.growth(), memory.since_start)  # fmt: skip
        say("\n".join(["host memory:", *lines]))
    return val_loss


def _inspect_swap_space(swap_dirs: list[str], world: int) -> int:
    """Rank 0, once every rank has closed its engine: swap-inspect's summary of the space."""
    if not swap_dirs:  # one rank directory per nvme path; none without nvme
        print("no swap space to inspect: nothing was placed on nvme")
        return 0
    # With several ranks, the parent of the rank directories shows them all.
    where = os.path.dirname(swap_dirs[0]) if world > 1 else swap_dirs[0]
    print(f"\nswap-inspect --summary {where}", flush=True)
    return 1 if swap_inspect.main(["--summary", where]) else 0


def resume(engine, args: argparse.Namespace, batches: Iterator, say) -> int:
    """Load the newest checkpoint of --checkpoint-dir, if there is one, and skip the batches
    its steps used (the data order goes on as if never stopped); returns its step."""
    if not os.path.isfile(os.path.join(args.checkpoint_dir, LATEST_NAME)):
        say(f"no checkpoint in {args.checkpoint_dir} yet: starting from step 1")
        return 0
    _, state = engine.load_checkpoint(args.checkpoint_dir)
    if state.get("data_seed") != args.seed:
        raise ValueError(f"the checkpoint was trained with --seed {state.get('data_seed')}, not {args.seed}")
    step = engine.stats()["steps"]
    for _ in range(step):
        next(batches)
    say(f"resumed from {args.checkpoint_dir} at step {step}")
    return step


def train_loss_window(steps: int, log_every: int) -> int:
    """How many of the last steps the reported train loss averages: --log-every, but at most a
    tenth of the run, so that the mean is of where the curve ended, not of its first steps."""
    return max(1, min(log_every, steps // 10))


def _mean_over_ranks(loss: torch.Tensor, world: int) -> float:
    if world > 1:
        loss = loss.clone()
        torch.distributed.all_reduce(loss)
        loss /= world
    return loss.item()


# -- command line ----------------------------------------------------------------------------
SYNOPSIS = """python -m infinity.tools.demo [--size tiny|small|medium|large] [--steps N]
                                     [--host-budget SIZE] [--batch-size 8] [--block-size 128]
                                     [--params T] [--grads T] [--optimizer T] [--swap-dir DIR]
                                     [--param-dtype fp32|bf16|fp16] [--lr 1e-3] [--seed 0]
                                     [--[no-]gradient-checkpointing] [--log-every N] [--sample-bytes N] [--prompt TEXT]
                                     [--config FILE] [--checkpoint-dir DIR [--save-every 100]
                                     [--keep-last 2] [--resume]] [--export FILE]
                                     [--save-pretrained DIR]"""

DESCRIPTION = """\
description:
  Trains a GPT-2-shaped transformers model, built from a config with random weights
  (nothing is downloaded), on the essay in infinity/data/corpus.txt with a byte vocabulary
  (256 tokens). The first 90% of the bytes is for training (random windows, drawn from
  --seed), the last 10% for the validation loss. Params, grads and optimizer state are
  placed on the tiers T (device, cpu or nvme) given by the flags, all nvme by default, in
  swap files under --swap-dir, which is created where its parent exists (as any swap directory:
  a mistyped path is not made). --config FILE takes a TOML tier config
  (docs/config.md) instead of the tier, dtype, --lr and --swap-dir flags and the clipping
  (its optimizer.lr and max_grad_norm apply, with the same warmup; an explicit --host-budget
  still replaces its memory.host_budget). Ctrl-C stops after the current step.

  The default size, large (14 layers x 384, 25.0M parameters), has 381 MiB of fp32 training
  state (16 bytes a parameter: value, gradient, AdamW's master weight and two moments) and
  trains with a host budget (memory.host_budget, --host-budget) of 46 MiB, 8.3 times less;
  the model is built with infinity.build(), so not even its initial weights are ever whole
  in memory. At the end the state is set against the budget and against the growth of the
  process's peak RSS (VmHWM) since just before the model was built. The trained model is
  then saved with engine.save_pretrained (a Hugging Face directory, --save-pretrained) and
  streamed back in with infinity.from_pretrained, whose validation loss must be the same.

  With --checkpoint-dir, a checkpoint is saved every --save-every steps, at the end and on
  Ctrl-C (the newest --keep-last are kept); a run killed in any way, even in the middle of a
  save, goes on from the newest complete one with --resume (same flags), exactly as if it had
  not stopped. --export FILE writes the trained weights as safetensors, loadable by
  GPT2LMHeadModel(config).load_state_dict(safetensors.torch.load_file(FILE)).
"""

EPILOG = """\
output:
  A progress line per step (redrawn in place on a terminal; every --log-every steps
  otherwise): step, loss, tokens/s and, per tier that the engine reports, GB/s (1e9 bytes/s
  of wall time) read and written since the previous step. Then the train loss (mean of
  the last --log-every steps, at most the last tenth of the run, and the last step's loss),
  the validation loss over every window of the held-out text,
  the engine's totals (bytes and busy-time GB/s per tier, stall time, peak host buffer
  pool), a sample of --sample-bytes bytes generated from --prompt, the host memory lines
  (training state, host budget, peak RSS growth and the ratios of the state to both), the
  reload check (the val loss of the model streamed back from --save-pretrained) and the
  swap-inspect summary of the rank directory of the swap space.

exit status:
  0 trained; 1 an I/O error, or swap-inspect found the swap space unreadable; 2 bad input
  (an option out of range, a tier config that does not load or does not fit the machine);
  130 interrupted (the swap space is left as it is; a second Ctrl-C stops at once).
"""


def _positive(kind, zero: bool = False):
    def parse(text: str):
        value = kind(text)
        if value < 0 or value == 0 and not zero:
            raise argparse.ArgumentTypeError(f"{text!r} is {'negative' if value < 0 else 'not positive'}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid ... value" message
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infinity.tools.demo", usage=SYNOPSIS, description=DESCRIPTION,
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sizes = ", ".join(f"{k} {v['n_layer']}x{v['n_embd']}" for k, v in SIZES.items())
    big = ", ".join(f"{k} {v['steps']}" for k, v in SIZE_DEFAULTS.items())
    p.add_argument("--size", choices=SIZES, default=DEFAULT_SIZE,
                   help=f"layers x width: {sizes} (default {DEFAULT_SIZE})")  # fmt: skip
    p.add_argument("--steps", metavar="N", type=_positive(int),
                   help=f"optimizer steps (default {DEFAULTS['steps']}; {big})")  # fmt: skip
    budgets = ", ".join(f"{k} {v['host_budget']}" for k, v in SIZE_DEFAULTS.items())
    p.add_argument("--host-budget", metavar="SIZE",
                   help=f"memory.host_budget, e.g. 46MiB (default: {budgets}; the engine's own otherwise)")
    p.add_argument("--batch-size", metavar="N", type=_positive(int), default=8, help="windows per step (default 8)")
    p.add_argument("--block-size", metavar="N", type=_positive(int), default=128, help="bytes per window (default 128)")
    for state in ("params", "grads", "optimizer"):
        p.add_argument(f"--{state}", choices=TIERS, default="nvme", help=f"tier of the {state} (default nvme)")
    p.add_argument("--swap-dir", metavar="DIR", default=str(_ROOT / "demo-swap"),
                   help="nvme swap directory (default demo-swap in the checkout)")
    p.add_argument("--param-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="dtype of the training weights (default fp32)")  # fmt: skip
    p.add_argument("--lr", metavar="LR", type=_positive(float), default=1e-3,
                   help=f"AdamW learning rate, reached by a linear warmup over the first {WARMUP_STEPS} steps; "
                        f"gradients are clipped to norm {MAX_GRAD_NORM} (default 1e-3)")  # fmt: skip
    p.add_argument("--seed", metavar="N", type=int, default=0, help="seeds weights, batches and sample (default 0)")
    logs = ", ".join(f"{k} {v['log_every']}" for k, v in SIZE_DEFAULTS.items())
    p.add_argument("--log-every", metavar="N", type=_positive(int),
                   help=f"steps per log line off a terminal, and of the train loss (default {DEFAULTS['log_every']}; {logs})")
    samples = ", ".join(f"{k} {v['sample_bytes']}" for k, v in SIZE_DEFAULTS.items())
    p.add_argument("--sample-bytes", metavar="N", type=_positive(int, zero=True),
                   help=f"bytes to generate at the end, 0 for none (default {DEFAULTS['sample_bytes']}; {samples})")
    p.add_argument("--prompt", metavar="TEXT", default="The ", help="text the sample starts from (default 'The ')")
    checkpointed = ", ".join(k for k, v in SIZE_DEFAULTS.items() if v.get("gradient_checkpointing"))
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction,
                   help=f"recompute each layer's activations in backward (default: on for {checkpointed})")
    p.add_argument("--config", metavar="FILE", help="a TOML tier config instead of the tier flags")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints here (default: none)")
    p.add_argument("--save-every", metavar="N", type=_positive(int), default=100,
                   help="steps between checkpoints (default 100)")
    p.add_argument("--keep-last", metavar="N", type=_positive(int), default=2,
                   help="checkpoints kept in --checkpoint-dir (default 2)")
    p.add_argument("--resume", action="store_true", help="go on from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--export", metavar="FILE", help="write the trained weights to FILE (safetensors)")
    p.add_argument("--save-pretrained", metavar="DIR",
                   help="the Hugging Face directory the trained model is saved to and reloaded from "
                        "(default: pretrained in --swap-dir)")  # fmt: skip
    return p


def _quiet_foreign_imports() -> None:
    """transformers imports torchao (for its quantizers) when it is installed, and torchao's
    optional CUDA kernels do not load beside a CPU build of torch: it logs a warning per
    kernel, and torch one per deprecated registration. The demo uses none of them; their lines
    came before its own (errors still show)."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    _quiet_foreign_imports()
    parser = _parser()
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    for name in ("steps", "sample_bytes", "log_every"):
        setattr(args, name, _default(args, name))
    try:
        return train(args)
    except BadInput as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # outside the training loop: building, evaluating, sampling
        print("\ndemo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

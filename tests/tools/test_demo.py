"""The training demo (python -m infinity.tools.demo): its data pipeline, its command line, and a short
real run through the engine."""

import math
import os
import signal
import subprocess
import sys

import pytest
import torch

import infinity
from infinity.tools import demo


# -- data -------------------------------------------------------------------------------------
def test_corpus_is_bytes_of_utf8_text():
    data = demo.load_corpus()
    assert data.dtype == torch.int64 and data.dim() == 1
    assert 0 <= int(data.min()) and int(data.max()) < demo.VOCAB == 256
    assert len(data) > 30_000  # enough text that a minute of training does not just memorize it
    bytes(data.tolist()).decode("utf-8")  # raises if the shipped text is not UTF-8


def test_split_is_disjoint_and_covers_the_text():
    data = torch.arange(1000)
    train, val = demo.split_corpus(data)
    assert len(val) == 100
    assert torch.equal(torch.cat([train, val]), data)


def test_training_windows_never_reach_validation_bytes():
    train, val = demo.split_corpus(torch.arange(1000))  # values are positions
    batches = demo.random_batches(train, block_size=32, batch_size=4, seed=0)
    for _ in range(500):
        x, y = next(batches)
        assert int(y.max()) < int(val[0])


def test_windows_are_deterministic_for_a_seed():
    data = demo.load_corpus()
    a, b, c = (demo.random_batches(data, 32, 4, seed) for seed in (7, 7, 8))
    for _ in range(3):
        (xa, ya), (xb, yb), (xc, _) = next(a), next(b), next(c)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(xa, xc)


def test_targets_are_the_next_bytes_of_one_window():
    data = torch.arange(500)
    x, y = next(demo.random_batches(data, block_size=16, batch_size=3, seed=1))
    assert x.shape == y.shape == (3, 16)
    assert torch.equal(y, x + 1)  # arange: each window is contiguous and y is x shifted by one


def test_eval_batches_are_every_window_of_the_text_in_order():
    val = torch.arange(100)
    batches = demo.eval_batches(val, block_size=10, batch_size=4)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert [len(b[0]) for b in batches] == [4, 4, 1]  # 99 // 10 windows with a next byte each
    assert torch.equal(x.flatten(), torch.arange(90)) and torch.equal(y, x + 1)


def test_a_window_longer_than_the_text_is_refused():
    with pytest.raises(ValueError, match="--block-size 200"):
        demo.random_batches(torch.arange(100), block_size=200, batch_size=1, seed=0)
    with pytest.raises(ValueError, match="validation"):
        demo.eval_batches(torch.arange(100), block_size=100, batch_size=1)


# -- model and engine figures -----------------------------------------------------------------
def test_model_starts_near_uniform_over_bytes():
    pytest.importorskip("transformers")
    model = demo.build_model("tiny", block_size=32, seed=0)
    again = demo.build_model("tiny", block_size=32, seed=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    assert model.config.vocab_size == 256 and model.config.n_positions == 32
    x, y = next(demo.random_batches(demo.load_corpus(), 32, 4, seed=0))
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
    assert abs(loss.item() - math.log(256)) < 0.3  # GPT-2 init: small weights, near-uniform logits


def test_rates_show_what_the_engine_reports_and_skip_the_rest():
    before = {"total": {"nvme": {"read_bytes": 0, "write_bytes": 1_000_000_000}, "stall_seconds": 0.0}}
    after = {"total": {"nvme": {"read_bytes": 4_000_000_000, "write_bytes": 3_000_000_000}, "stall_seconds": 1.0,
                       "cpu": {"read_bytes": 500_000_000}, "device": {"read_bytes": 0, "write_bytes": 0}}}  # fmt: skip
    # the idle device tier is left out
    assert demo.format_rates(before, after, 2.0) == "nvme r 2.00 w 1.00 GB/s | cpu r 0.25 w 0.00 GB/s"
    assert demo.format_rates({}, {}, 1.0) == ""
    assert demo.format_totals({}) == []
    lines = demo.format_totals({"total": {"nvme": {"read_bytes": 2e9, "read_seconds": 1.0}, "stall_seconds": 0.5},
                                "peak_host_pool_bytes": 3 << 20})  # fmt: skip
    assert lines == ["  nvme: 2.000 GB read at 2.00 GB/s while busy", "  stalled waiting for data: 0.50 s",
                     "  peak host buffer pool: 3.0 MiB"]  # fmt: skip


# -- command line -----------------------------------------------------------------------------
def test_help_reads_like_a_man_page(capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for word in ("--size", "--steps", "--batch-size", "--block-size", "--params", "--grads", "--optimizer",
                 "--swap-dir", "--param-dtype", "--lr", "--seed", "--log-every", "--config",
                 "description:", "output:", "exit status:"):  # fmt: skip
        assert word in out


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--size", "huge"], ["--params", "tape"], ["--lr", "-1"]])
def test_bad_options_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.main(argv)
    assert exit_.value.code == 2


class _PlainEngine:
    """Just enough of the engine's API to drive the loop, in plain PyTorch."""

    def __init__(self, model, config, interrupt_at=None):
        if any(p.is_meta for p in model.parameters()):  # built inside infinity.build: give it values
            model = demo.build_model("tiny", model.config.n_positions, seed=0)
        self.module, self.steps, self.interrupt_at, self.swap_dirs = model, 0, interrupt_at, []
        self.device = torch.device("cpu")
        self.rank, self.world_size = 0, 1
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.opt.step()
        self.opt.zero_grad()
        self.steps += 1
        if self.steps == self.interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, in the middle of a step

    def stats(self):
        return {"total": {"nvme": {"read_bytes": 4096 * self.steps, "write_bytes": 0}}}

    def eval(self):
        self.module.eval()

    def train(self):
        self.module.train()

    def close(self):
        pass


def test_ctrl_c_stops_after_the_current_step(monkeypatch, tmp_path, capsys):
    pytest.importorskip("transformers")
    monkeypatch.setattr(infinity, "initialize", lambda m, c, **kw: _PlainEngine(m, c, interrupt_at=2), raising=False)
    monkeypatch.setattr(demo, "tier_config", lambda args: None)
    code = demo.main(["--size", "tiny", "--steps", "50", "--block-size", "32", "--batch-size", "2",
                      "--log-every", "1", "--swap-dir", str(tmp_path / "swap")])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 130
    assert "step 2/50 loss" in out and "step 3/50" not in out
    assert "interrupted after step 2 of 50" in out


def test_the_learning_rate_warms_up_and_the_gradients_are_clipped(monkeypatch, tmp_path):
    """The remedies for the step that threw the default run's loss from 3 to 12: initialize gets
    a warmup schedule (to --lr in WARMUP_STEPS steps, then --lr) and a max_grad_norm."""
    pytest.importorskip("transformers")
    seen = {}

    def initialize(model, config, **kwargs):
        seen.update(kwargs, config=config)
        return _PlainEngine(model, config, interrupt_at=1)

    monkeypatch.setattr(infinity, "initialize", initialize, raising=False)
    code = demo.main(["--size", "tiny", "--steps", "50", "--block-size", "32", "--batch-size", "2", "--lr", "2e-3",
                      "--swap-dir", str(tmp_path / "swap")])  # fmt: skip
    assert code == 130  # stopped after step 1: only the setup is looked at
    assert seen["config"].optimizer.max_grad_norm == demo.MAX_GRAD_NORM == 1.0
    assert seen["config"].optimizer.lr == 2e-3
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=2e-3)
    schedule = seen["lr_scheduler"](opt)
    lrs = []
    for _ in range(demo.WARMUP_STEPS + 2):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    warm = [2e-3 * (i + 1) / demo.WARMUP_STEPS for i in range(demo.WARMUP_STEPS)]
    assert lrs == pytest.approx([*warm, 2e-3, 2e-3], rel=1e-12, abs=0)


@pytest.mark.parametrize(("steps", "log_every", "window"), [(50, 50, 5), (30, 5, 3), (500, 50, 50), (6, 2, 1)])
def test_the_train_loss_is_the_mean_of_where_the_run_ended(steps, log_every, window):
    """Not of the first steps' high losses: at most a tenth of the run, at most --log-every."""
    assert demo.train_loss_window(steps, log_every) == window


# -- a real run -------------------------------------------------------------------------------
def test_demo_trains_on_nvme_and_shows_the_swap_space(tmp_path, capsys):
    pytest.importorskip("transformers")
    code = demo.main(["--size", "tiny", "--steps", "3", "--block-size", "32", "--batch-size", "2",
                      "--log-every", "1", "--sample-bytes", "4", "--swap-dir", str(tmp_path / "swap")])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "step 3/3 loss" in out and "val loss" in out
    assert "train loss" in out and "(the last step)" in out  # 3 steps: a window of one
    assert "swap-inspect --summary" in out and "tensors:" in out  # the summary of the rank directory
    assert "checksum" not in out  # ... without its table of every tensor
    assert f"left in {tmp_path / 'swap'}: " in out and f"rm -r {tmp_path / 'swap'} removes them" in out


def test_the_demos_first_lines_are_its_own(tmp_path):
    """What a newcomer sees first, in a process of its own (imports included): the demo's
    header, not the warnings of packages it does not use (torchao's CUDA kernels beside a CPU
    torch, torch's deprecations), nor its own size label read as a model's name."""
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "-m", "infinity.tools.demo", "--size", "tiny", "--steps", "1",
                          "--block-size", "32", "--batch-size", "2", "--sample-bytes", "0",
                          "--swap-dir", str(tmp_path / "swap")],  # fmt: skip
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout[-3000:]
    assert lines[0].startswith("model: a GPT-2-shaped transformers model with random weights, demo size 'tiny' "
                               "(2 layers of width 64, a byte vocabulary): 0.12M parameters"), lines[:5]
    assert lines[1].startswith("text: ") and "bytes to train on" in lines[1], lines[:5]
    assert lines[2].startswith("training state "), lines[:5]


def test_the_default_run_goes_past_its_warm_up():
    assert demo.SIZE_DEFAULTS[demo.DEFAULT_SIZE]["steps"] > demo.WARMUP_STEPS


def test_demo_resumes_exactly_and_exports_what_transformers_loads(tmp_path, capsys):
    """What the README shows: stop a run, --resume it, --export the weights. The resumed run
    ends with the same losses as one that never stopped, and the export loads strictly."""
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    common = ["--size", "tiny", "--block-size", "32", "--batch-size", "2", "--log-every", "2",
              "--sample-bytes", "0"]  # fmt: skip
    assert demo.main([*common, "--steps", "6", "--swap-dir", str(tmp_path / "s1")]) == 0
    straight = capsys.readouterr().out
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "2"]
    assert demo.main([*common, "--steps", "3", "--swap-dir", str(tmp_path / "s2"), *ck]) == 0
    first = capsys.readouterr().out
    assert "checkpoint " in first and os.path.isdir(tmp_path / "ck" / "step-3")
    export = tmp_path / "model.safetensors"
    assert demo.main([*common, "--steps", "6", "--swap-dir", str(tmp_path / "s2"), *ck, "--resume",
                      "--export", str(export)]) == 0  # fmt: skip
    resumed = capsys.readouterr().out
    assert "resumed from" in resumed and "at step 3" in resumed

    def tail(out):
        lines = [line for line in out.splitlines() if line.startswith(("step 4/", "step 6/", "train loss"))]
        return [" ".join(line.split()[:4]) if line.startswith("step") else line for line in lines]

    assert tail(resumed) == tail(straight) and len(tail(straight)) == 3
    model = demo.build_model("tiny", 32, seed=123)
    model.load_state_dict(safetensors_torch.load_file(export))  # strict: every key, no extra
    assert isinstance(model, transformers.GPT2LMHeadModel)
    # --resume with another --seed is someone else's run: refused, exit 2
    code = demo.main([*common, "--steps", "8", "--seed", "5", "--swap-dir", str(tmp_path / "s2"), *ck, "--resume"])
    assert code == 2 and "--seed 0, not 5" in capsys.readouterr().err


def test_the_default_size_trains_at_least_8_times_its_host_budget():
    """make demo's claim: the large model's fp32 training state is >= 8x the default host budget."""
    pytest.importorskip("transformers")
    args = demo._parser().parse_args([])
    assert args.size == demo.DEFAULT_SIZE == "large"
    model = demo.build_model("large", block_size=128, seed=0, meta=True)  # no memory, no init
    assert all(p.is_meta for p in model.parameters())
    nparams = sum(p.numel() for p in model.parameters())
    budget = infinity.TierConfig.from_dict({"memory": {"host_budget": demo._default(args, "host_budget")}})
    assert 20e6 < nparams < 30e6
    assert demo.state_bytes(nparams) == 16 * nparams
    assert demo.state_bytes(nparams) / budget.memory.host_budget >= 8


def test_memory_lines_show_state_budget_peak_rss_and_ratios():
    lines = demo.format_memory(1_000_000, budget=2 << 20, pool_peak=1 << 20, rss_growth=4 << 20)
    assert lines == [
        "  training state: 15.3 MiB (1.00M parameters x 16 bytes: fp32 param 4, grad 4, AdamW master and moments 12)",
        "  host budget (memory.host_budget): 2.0 MiB, of which the engine's buffer pool held at most 1.0 MiB",
        "  peak RSS growth: 4.0 MiB (VmHWM of /proc/self/status, from just before the model was built)",
        "  state / host budget 7.6x, state / peak RSS growth 3.8x",
    ]
    assert demo.format_memory(10, None, None, None) == [lines[0].replace("1.00M", "0.00M").replace("15.3", "0.0")]


def test_peak_rss_grows_with_what_the_process_holds():
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc")
    peak = demo.PeakRSS()
    held = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    assert peak.growth() >= 60 << 20
    del held


@pytest.mark.skipif(not hasattr(infinity, "from_pretrained"), reason="infinity.from_pretrained is not written yet")
def test_a_short_run_shows_state_against_budget_and_reloads_what_it_saved(tmp_path, capsys):
    """The tiny model with a small host budget: the state/budget line and the reload check are
    printed (a ratio under 8 is fine for a small size), and the save_pretrained directory loads
    both through the streaming loader and into transformers."""
    transformers = pytest.importorskip("transformers")
    saved = tmp_path / "hf"
    code = demo.main(["--size", "tiny", "--steps", "2", "--block-size", "32", "--batch-size", "2",
                      "--host-budget", "8MiB", "--sample-bytes", "0", "--swap-dir", str(tmp_path / "swap"),
                      "--save-pretrained", str(saved)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "host budget (memory.host_budget): 8.0 MiB" in out
    assert "training state: " in out and "peak RSS growth: " in out
    assert "state / host budget " in out and "x, state / peak RSS growth " in out
    assert "reloaded with infinity.from_pretrained(GPT2LMHeadModel" in out and ": the same" in out
    assert (saved / "config.json").is_file() and (saved / "model.safetensors").is_file()
    # the directory is a Hugging Face checkpoint: transformers itself loads it, with the demo's weights
    model = transformers.GPT2LMHeadModel.from_pretrained(saved)
    assert model.config.n_layer == demo.SIZES["tiny"]["n_layer"] and model.config.vocab_size == demo.VOCAB
    val = demo.eval_batches(demo.split_corpus(demo.load_corpus())[1], 32, 2)
    with torch.no_grad():
        x, y = val[0]
        loss = torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
    assert loss.item() < math.log(256)  # trained a little from near-uniform


def test_a_budget_too_small_for_the_model_is_bad_input(tmp_path, capsys):
    pytest.importorskip("transformers")
    code = demo.main(["--size", "large", "--steps", "1", "--host-budget", "8MiB", "--sample-bytes", "0",
                      "--swap-dir", str(tmp_path / "swap")])  # fmt: skip
    assert code == 2
    assert "memory.host_budget=8MiB is less than" in capsys.readouterr().err

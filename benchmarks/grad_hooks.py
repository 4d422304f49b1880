"""What a gradient hook costs backward on the host, apart from the engine. Not run by CI.

`benchmarks/small_layers.py` leaves the engine's backward over plain PyTorch's; this splits what
a per-parameter hook does there. Plain copies of the same Llama-shaped model (the 17.8M
24-layer one of small_layers.py, 1 x 32 tokens), each with a post-accumulate-grad hook on every
parameter that does one thing more than the last:

- ``none``: no hook (plain backward);
- ``empty``: a Python hook that returns (autograd's call into Python, 219 times);
- ``read``: the hook reads its gradient once: the sum of its squares by the engine's native
  kernel (``_compact_native.sum_squares``, one thread, the GIL released), what the engine's
  overflow check and clipping need of each gradient ([Note: gradient norms] in
  `infinity/_grad_norms.py`);
- ``clip``: no hook; ``torch.nn.utils.clip_grad_norm_`` after backward (the Trainer's default
  1.0), which reads every gradient once more, cold, and scales them.

Backward is timed for each (the ``clip`` row: backward and the clip), interleaved (none, empty,
read, clip, none, ...), ``--repeat`` passes of one variant at a time, ``--pairs`` rounds after
a warm-up round; reported as medians and as the median ratio to ``none`` per round.

    python benchmarks/grad_hooks.py [--pairs 15] [--repeat 5]
        [--hidden 256 --layers 24 --intermediate 512 --vocab 4096] [--batch 1 --tokens 32]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from scale import add_model_args, llama_config  # this directory: the same model
from small_layers import MODEL


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p)
    p.set_defaults(**MODEL)
    p.add_argument("--pairs", type=int, default=15)
    p.add_argument("--repeat", type=int, default=5, help="backward passes of one variant in a row")
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args(argv)

    import transformers

    from infinity import _compact_native as native

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(llama_config(args))
    ids = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    squares = []

    def empty(param):
        pass

    def read(param):
        g = param.grad
        squares.append(native.sum_squares(g.data_ptr(), g.numel()))

    models = {name: copy.deepcopy(base) for name in ("none", "empty", "read", "clip")}
    for name, hook in (("empty", empty), ("read", read)):
        for q in models[name].parameters():
            q.register_post_accumulate_grad_hook(hook)

    def backward(name: str) -> float:
        model = models[name]
        loss = model(**batch).loss
        start = time.perf_counter()
        loss.backward()
        if name == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        seconds = time.perf_counter() - start
        for q in model.parameters():
            q.grad = None
        squares.clear()
        return seconds

    times = {name: [] for name in models}
    for pair in range(args.pairs + 1):
        for name in models:
            out = [backward(name) for _ in range(args.repeat)]
            if pair:  # the first round warms up
                times[name].append(statistics.median(out))
    n = sum(t.numel() for t in base.parameters())
    hooks = sum(1 for _ in base.parameters())
    print(f"{n / 1e6:.1f}M parameters in {hooks} tensors, {args.batch}x{args.tokens} tokens, {args.pairs} rounds "
          f"of {args.repeat} passes a variant (medians)")  # fmt: skip
    for name, ts in times.items():
        ratio = statistics.median(t / b for t, b in zip(ts, times["none"]))
        print(f"{name:>6}: backward {statistics.median(ts) * 1e3:.2f} ms, {ratio:.3f} x none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

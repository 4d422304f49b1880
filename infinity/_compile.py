"""The engine's hooks under ``torch.compile``.

[Note: hooks under torch.compile]
The engine's module hooks fetch and release units: they read files, wait on futures, swap a
parameter's storage and class, and keep Python state across calls, none of which dynamo can
put in a graph (traced, they failed inside dynamo on guards it could not keep). So every hook
the scheduler installs on a module, and a tiled module's forward, is wrapped by `eager`:
dynamo breaks the graph at the hook, runs it as plain Python, and compiles the module bodies
between hooks, where the parameters are materialised views of their units. Autograd's
saved-tensor hooks still see what a compiled region saves for backward (it saves through one
autograd Function), so [Note: saved parameter views] holds there too. What cannot be had is
one graph of the whole model: ``fullgraph=True`` fails at the first hook with the reason below.
Where every unit is always bound, modules below the root get no hooks but a tiled module's
([Note: always-ready units' uses] in `_schedule`), and a block compiles as one graph.
"""

from __future__ import annotations

import torch

REASON = ("an infinity engine's hook fetches or releases parameters from its tiers and runs "
          "outside the graph: compile without fullgraph=True (the graph breaks at each module "
          "that holds parameters), or compile the blocks, e.g. `block.compile()` for each block")  # fmt: skip


def eager(fn):
    """``fn`` run as plain Python under torch.compile, with a graph break around its call."""
    return torch.compiler.disable(fn, reason=REASON)

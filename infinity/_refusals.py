"""Models the engine cannot train exactly, refused at `initialize` before anything moves.

Owns: the checks of the module as the user hands it over, each error naming the module or
parameter, the cause and what to do instead. Touches: the module (read only).

- A module already given to an engine holds placeholders, not weights.
- A buffer on the meta device has no values (one computed in `infinity.build` from a
  parameter's values, which exist only at `initialize`): moving it to the device would fail
  later, naming nothing.
- ``nn.Embedding(sparse=True)`` gives sparse gradients; the engine's gradient buffers are dense.
- ``nn.Embedding(max_norm=...)`` renormalises the rows it looks up in place inside forward. Where
  the params tier lends its tensors to the module (`_inplace` carries the write into the
  masters, as any write in place) that is kept as plain PyTorch keeps it; where the parameters
  are released after each use (nvme, or sharded at stage 3) the write would go with the
  released buffer, and the step would train the rows as they were, silently.
- A parameter that is not floating point (complex, integer): the tiers keep real fp32, bf16 or
  fp16 state, and casting a complex one dropped its imaginary part, training another model with
  only torch's cast warning (an audit helper's repro).
- peft's DoRA (``use_dora=True``) reads its base layer's weight and its adapters' shapes in the
  LoRA layer's forward, outside the modules that hold them (the weight's column norm): where
  the parameters are released between uses those are empty placeholders, and peft failed deep
  inside with an IndexError (an audit helper's repro).
"""

from __future__ import annotations

from torch import nn


def refuse_modules(module: nn.Module, *, released: str | None) -> None:
    """Raise ValueError for the first module in ``module`` the engine cannot train exactly.
    ``released``: why the module's parameters are placeholders between uses (a phrase naming
    the config), or None where the params tier lends the module its own tensors."""
    for name, m in module.named_modules():
        dora = getattr(m, "use_dora", None)  # peft's LoRA layers: adapter name -> bool
        if released is not None and isinstance(dora, dict) and any(v is True for v in dora.values()):
            raise ValueError(
                f"module {name!r} is a peft LoRA layer with use_dora=True: DoRA reads its base layer's weight and its "
                f"adapters' shapes in this layer's forward, outside the modules that hold them; {released}, so it "
                "would read an empty placeholder. Keep the parameters where the modules hold them (tiers.params = "
                "'device', below partition.stage 3 at several ranks), or train LoRA without DoRA"
            )
        if not isinstance(m, nn.Embedding):
            continue
        if m.sparse:
            raise ValueError(
                f"module {name!r} is an nn.Embedding with sparse=True: its sparse gradients have no place in the "
                "engine's dense gradient buffers (as in DeepSpeed's ZeRO-3); build it with sparse=False, which "
                "trains the same values"
            )
        if m.max_norm is not None and released is not None:
            raise ValueError(
                f"module {name!r} is an nn.Embedding with max_norm={m.max_norm}, which renormalises the rows it looks "
                f"up in place inside forward; {released}, so that write would be lost and the step would train the "
                "rows as they were. Keep the parameters where the module holds them (tiers.params = 'device' below "
                "partition.stage 3, where the write is kept), or renormalise out of place in the model's forward "
                "(F.embedding without max_norm, then scale the looked-up rows)"
            )


def refuse_managed(module: nn.Module) -> None:
    """A module already given to an engine holds placeholders, not weights: initializing it
    again would train empty tensors. Say where its weights are instead."""
    for name, p in module.named_parameters():
        if getattr(p, "_infinity_managed", False):
            raise ValueError(
                f"this module was already given to infinity.initialize (parameter {name!r} is an engine's "
                "placeholder, not a weight): use that engine, or, once it is closed, build the model again and "
                "load its weights from a checkpoint (engine.save_checkpoint / load_checkpoint) or an export "
                "(engine.save_pretrained / infinity.from_pretrained)"
            )


def refuse_meta_buffers(module: nn.Module) -> None:
    """A buffer on the meta device has no values to compute with: `infinity.build` keeps the
    buffers a constructor makes real, but one computed from a built parameter
    (``register_buffer("ref", layer.weight.detach().clone())``) is on the meta device with it."""
    for name, b in module.named_buffers():
        if b.is_meta:
            raise ValueError(
                f"buffer {name!r} {tuple(b.shape)} is on the meta device, without values: inside infinity.build a "
                "buffer computed from a parameter's values (which exist only once initialize has made them) is "
                "made there. Compute it after initialize (engine.module, under infinity.GatheredParameters), from "
                "real tensors in the constructor, or construct the model outside build()"
            )


def refuse_non_float(module: nn.Module) -> None:
    """Raise ValueError naming the first parameter of ``module`` that is not floating point."""
    for name, p in module.named_parameters():
        if not p.is_floating_point():
            raise ValueError(
                f"parameter {name!r} is {str(p.dtype).removeprefix('torch.')}: the engine keeps parameters as real "
                "floating-point values (its tiers hold fp32 master weights and fp32, bf16 or fp16 parameters), and a "
                "cast would lose what they hold (a complex one's imaginary part). Hold a complex weight as a real "
                "parameter of twice the size and torch.view_as_complex it in the forward; register an integer "
                "tensor as a buffer (module.register_buffer)"
            )

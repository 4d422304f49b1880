"""The state_dict a PEFT model's save needs, without its frozen base in memory.

Owns: `adapter_state_dict`, what `InfinityTrainer` gives ``PeftModel.save_pretrained`` at
``save_model`` and every checkpoint. Touches: peft's ``get_peft_model_state_dict`` (asked
which keys it keeps), `_statedict.state_dict_of` (which gathers only those).

peft's save reads the whole model's state_dict and keeps the adapters' keys (and any embedding
layers it saves beside them). Gathered whole, that is the whole frozen base in host memory at
every save: an audit helper's repro held 241 MiB for a 0.5 MiB adapter, at a host budget of
128 MiB. The keys peft keeps are found by giving it the model's placeholders
(``state_dict(keep_vars=True)``: nothing gathered) and following the tensors it returns back
to their keys by identity; then only those are gathered. Where peft returns a tensor that is
not one of those it was given (a copy, a computed prompt embedding), the keys cannot be told,
and the whole state_dict is gathered, as before.
"""

from __future__ import annotations

import json

from .._statedict import state_dict_of


def adapter_state_dict(engine, model) -> dict | None:
    """The part of ``model.state_dict()`` (``model``: ``engine.module``, a PeftModel) that
    ``model.save_pretrained`` keeps, gathered as `state_dict_of` does (every rank calls it);
    None where peft's choice of keys cannot be told. The keys are rank 0's on every rank:
    peft reads a ``modules_to_save`` copy's keys from its own ``state_dict()``, a collective
    whose other ranks get an empty dict, so theirs missed it, and the ranks gathered other units
    (a 2-rank save hung)."""
    keys = _kept_keys(model)
    if engine.world_size > 1:
        texts = engine.dist.gather_text(json.dumps(None if keys is None else sorted(keys)), "the keys a PEFT save keeps")
        keys = json.loads(texts[0])
    return None if keys is None else state_dict_of(engine, keys)


def _kept_keys(model) -> set[str] | None:
    try:
        from peft.utils import get_peft_model_state_dict
    except ImportError:
        return None
    probe = model.state_dict(keep_vars=True)  # placeholders and buffers: nothing gathered
    keys_of: dict[int, list[str]] = {}
    for key, value in probe.items():
        keys_of.setdefault(id(value), []).append(key)
    kept: set[str] = set()
    try:
        for adapter in model.peft_config:  # save_pretrained's default: every adapter
            out = get_peft_model_state_dict(model, state_dict=probe, adapter_name=adapter)
            for value in out.values():
                if id(value) not in keys_of:
                    return None
                kept.update(keys_of[id(value)])
    except Exception:  # noqa: BLE001 - a read of a placeholder (a prompt embedding computed): gather all
        return None
    return kept

"""Python state as JSON that loads back equal: an LR scheduler's ``state_dict()`` and a
checkpoint's ``client_state`` in ``meta.json`` (docs/formats.md, "Checkpoints").

Owns: `encode` (what JSON cannot say, tagged), `decode` (its inverse) and `round_trip`, which
checks at save that what a load will give back equals what was saved. Plain JSON turns a
`collections.Counter` into a dict and its int keys into strings (MultiStepLR's milestones: a
resumed schedule never decayed), any dict's int keys into strings and tuples into lists,
silently; here those are tagged:

    {"__infinity_type__": "Counter" | "dict" | "tuple", "items": [...]}
    {"__infinity_type__": "tensor", "dtype": "float32", "shape": [], "items": [0.01]}

("dict": one whose keys are not all strings, as [key, value] pairs; "tensor": one of a single
element, as a scheduler over a tensor learning rate keeps its ``base_lrs``, loaded back on the
CPU in its dtype and shape). Anything else JSON cannot hold (a larger tensor, a numpy scalar, a
function) is refused, naming where it is.
"""

from __future__ import annotations

import collections
import json
import math
import sys

TAG = "__infinity_type__"


def encode(obj, where: str = "state"):
    """``obj`` as JSON values, tagged where JSON would change it (see the module docstring)."""
    if obj is None or isinstance(obj, (bool, str)) or type(obj) in (int, float):
        return obj
    if isinstance(obj, collections.Counter):
        return {TAG: "Counter", "items": [[encode(k, where), encode(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    if type(obj) is tuple:
        return {TAG: "tuple", "items": [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if type(obj) is list:
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):  # an OrderedDict, a defaultdict: loaded back as a dict, equal to it
        if all(type(k) is str for k in obj) and TAG not in obj:
            return {k: encode(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return {TAG: "dict", "items": [[encode(k, where), encode(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    if _scalar_tensor(obj):
        return {TAG: "tensor", "dtype": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape),
                "items": [obj.item()]}  # fmt: skip
    raise TypeError(f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}{_size(obj)}, which a checkpoint's "
                    "JSON cannot hold (checkpoints hold no pickle): convert tensors of more than one element with "
                    ".tolist() and numpy values with .item()")


def _scalar_tensor(obj) -> bool:
    """A real-valued tensor of one element (torch is loaded where there is one)."""
    torch = sys.modules.get("torch")
    return (torch is not None and isinstance(obj, torch.Tensor) and obj.numel() == 1
            and not obj.is_complex() and obj.layout == torch.strided)  # fmt: skip


def _size(obj) -> str:
    shape = getattr(obj, "shape", None)
    return f" of shape {tuple(shape)}" if shape is not None else ""


def decode(obj):
    """What `encode` was given (plain JSON, as older checkpoints hold, is itself)."""
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    kind = obj.get(TAG)
    if kind is None:
        return {k: decode(v) for k, v in obj.items()}
    items = obj.get("items")
    if not isinstance(items, list):
        raise ValueError(f"a tagged {kind!r} value without its items list")
    if kind == "tuple":
        return tuple(decode(v) for v in items)
    if kind in ("Counter", "dict"):
        pairs = {_key(decode(k)): decode(v) for k, v in items}
        return collections.Counter(pairs) if kind == "Counter" else pairs
    if kind == "tensor":
        import torch

        dtype = getattr(torch, str(obj.get("dtype")), None)
        if not isinstance(dtype, torch.dtype) or len(items) != 1 or not isinstance(obj.get("shape"), list):
            raise ValueError(f"a tagged tensor {obj!r} is not one element of a torch dtype")
        return torch.tensor(items[0], dtype=dtype).reshape(obj["shape"])
    raise ValueError(f"unknown tagged value {kind!r} (a checkpoint written by a newer infinity?)")


def _key(k):
    return tuple(_key(x) for x in k) if isinstance(k, list) else k


def round_trip(obj, what: str):
    """``obj`` encoded, after checking that a load gives back a value equal to it (same types,
    NaN equal to NaN): a ValueError naming ``what`` otherwise."""
    encoded = encode(obj, what)
    back = decode(json.loads(json.dumps(encoded, allow_nan=True)))
    if not same(back, obj):
        raise ValueError(f"{what} would not load back as it was saved (JSON changed it): {obj!r} -> {back!r}")
    return encoded


def same(a, b) -> bool:
    """``a == b`` with NaN equal to NaN and the types compared too (1 is not 1.0 or True)."""
    if type(a) is not type(b) and not (isinstance(a, dict) and isinstance(b, dict)
                                        and isinstance(a, collections.Counter) == isinstance(b, collections.Counter)):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if _scalar_tensor(a) or _scalar_tensor(b):  # (back on the CPU: the device is not compared)
        return (_scalar_tensor(a) and _scalar_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and same(a.item(), b.item()))  # fmt: skip
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b

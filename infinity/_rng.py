"""RNG states: capture and restore python's, numpy's, torch's and (when initialised) CUDA's.

Owns nothing but the format: a JSON-able dict (bytes as base64), so a checkpoint's meta.json
holds every rank's state without pickle.
"""

from __future__ import annotations

import base64
import random

import torch

from .checkpoint import CheckpointError


def state_dict() -> dict:
    """This process's RNG states."""
    import numpy as np

    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out = {
        "python": [version, list(state), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return out


def load_state_dict(state: dict, where: str) -> None:
    """Restore what `state_dict` captured (``where`` names the file it came from, for errors)."""
    import numpy as np

    try:
        version, inner, gauss = state["python"]
        random.setstate((version, tuple(inner), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            states = [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
            torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{where}: rng: not a saved RNG state ({type(e).__name__}: {e})") from None

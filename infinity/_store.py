"""Where one kind of state lives: flat tensors by name, on the device, in host memory or on NVMe.

The engine keeps three stores (params, grads, optimizer states), each in the tier the config
names. Device and cpu stores keep resident tensors that callers use in place; the nvme store
keeps them in a SwapSpace and hands out pool buffers. Every transfer is counted in `Stats`.
"""

from __future__ import annotations

import torch

from infinity.swap import SwapFuture, SwapSpace

from ._stats import Stats


class Pending:
    """A store operation: ``result()`` waits and returns its value (idempotent)."""

    __slots__ = ("_future", "_span", "_value", "_done")

    def __init__(self, future: SwapFuture | None, span=None, value=None):
        self._future = future
        self._span = span
        self._value = value
        self._done = future is None

    def done(self) -> bool:
        return self._done or self._future.done()

    def result(self):
        if not self._done:
            try:
                self._value = self._future.result()
            finally:
                self._done = True
                if self._span is not None:
                    self._span.done()
        return self._value


class Store:
    """Flat tensors of one kind (``kind``: "param", "grad", "master", ...) in ``tier``."""

    def __init__(self, tier: str, kind: str, *, device: torch.device, space: SwapSpace | None, stats: Stats):
        if tier == "nvme" and space is None:
            raise ValueError(f"the {kind} store is on nvme but no swap space was given")
        self.tier = tier
        self.kind = kind
        self.space = space
        self.stats = stats
        # device tier: the compute device; cpu tier: host memory (pinned by the pool with CUDA)
        self.device = device if tier == "device" else torch.device("cpu")
        self._resident: dict[str, torch.Tensor] = {}

    @property
    def resident(self) -> bool:
        return self.tier != "nvme"

    def _key(self, name: str) -> str:
        return f"{name}/{self.kind}"

    def put(self, name: str, tensor: torch.Tensor) -> Pending:
        """Store ``tensor`` under ``name``. nvme: written behind (the tensor must stay unchanged
        until the result); resident: copied now into the resident tensor."""
        if self.resident:
            dst = self._resident.get(name)
            if dst is None or dst.shape != tensor.shape or dst.dtype != tensor.dtype:
                self._resident[name] = tensor.detach().to(self.device, copy=True)
            elif dst.data_ptr() != tensor.data_ptr():
                dst.copy_(tensor)
            return Pending(None)
        nbytes = tensor.numel() * tensor.element_size()
        span = self.stats.io("nvme", True, nbytes)
        return Pending(self.space.put(self._key(name), tensor), span)

    def get(self, name: str, timeout: float | None = None) -> Pending:
        """Resident: the tensor itself (use it in place). nvme: a read into a pool buffer (waiting
        at most ``timeout`` for pool memory); the value is a `HostBuffer` the caller releases."""
        if self.resident:
            return Pending(None, value=self._resident[name])
        key = self._key(name)
        nbytes = self.space.info(key).nbytes
        future = self.space.get(key, timeout=timeout)
        return Pending(future, self.stats.io("nvme", False, nbytes))

    def tensor(self, name: str) -> torch.Tensor:
        """The resident tensor of ``name`` (device and cpu tiers only)."""
        return self._resident[name]


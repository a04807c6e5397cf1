"""Receive buffers kept from one step to the next.

The same messages arrive every step, in the same shapes and dtypes. A fresh buffer for each costs
an allocation per message; on the host, a large activation's buffer is fresh pages that the
receive then faults in. A rank keeps its buffers instead and hands one out again once nothing
else holds its memory: not the stage that read it, not autograd's saved tensors, not a `.grad`
that took a received gradient, not a view or anything a user's hook kept. Whether anything does
is read from the storage's reference count, so a buffer still in use is never written into: the
receive gets a new one.

Buffers are kept per kind of message (value, stages, direction, element; shape, dtype and
device), not per micro-batch: a kind keeps as many as were in use at once, which is what the
schedule holds anyway (1F1B holds a few micro-batches' activations, not all of them). A kind
that a step did not receive (a new batch size, a new cut) is dropped at that step's end.
Between steps the kept buffers are the memory of the receives that were in use at once, which
the step's peak holds anyway.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = ["ReceiveBuffers"]


def _storage_users(tensor: torch.Tensor) -> int | None:
    """How many hold `tensor`'s storage, the tensor itself and the one wrapper made to ask
    included; None where this torch cannot say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return int(count(tensor.untyped_storage()._cdata))


class ReceiveBuffers:
    """A rank's receive buffers, kept across steps (see the module docstring)."""

    def __init__(self) -> None:
        self._kept: dict[Hashable, list[torch.Tensor]] = {}
        self._received: set[Hashable] = set()  # kinds received since end_step
        self.allocated = 0  # buffers made, and buffers handed out again, since creation
        self.reused = 0

    def get(self, kind: Hashable, shape: Sequence[int], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        """A contiguous buffer of `shape` and `dtype` on `device` that nothing else holds: one
        kept from before when one is free, else a new one, kept from now on."""
        key = (kind, tuple(shape), dtype, device)
        self._received.add(key)
        kept = self._kept.setdefault(key, [])
        for base in kept:
            if _storage_users(base) == 2:  # the base and the wrapper that asked: free
                self.reused += 1
                return base.view(base.shape)  # whoever holds it holds the storage
        base = torch.empty(tuple(shape), dtype=dtype, device=device)
        if _storage_users(base) is not None:  # else it could not be told free: not kept
            kept.append(base)
        self.allocated += 1
        return base.view(base.shape)

    def end_step(self) -> None:
        """Drops the kinds this step did not receive: their shapes or cut are gone."""
        for key in [k for k in self._kept if k not in self._received]:
            del self._kept[key]
        self._received.clear()

    @property
    def kept_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._kept.values() for t in ts)

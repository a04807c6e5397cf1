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

from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["ReceiveBuffers"]


def _uncounted(cdata: int) -> int:
    return 0  # never free: where torch cannot count, no buffer is kept


# How many hold a storage (torch's own count; the tensor and the wrapper made to ask included)
_storage_use_count: Callable[[int], int] = getattr(torch._C, "_storage_Use_Count", _uncounted)


class ReceiveBuffers:
    """A rank's receive buffers, kept across steps (see the module docstring). This runs for
    every message: a lookup and two calls to torch when a kept buffer is free."""

    def __init__(self) -> None:
        # (kind, shape, dtype, device) -> [the last step that received it, its buffers]
        self._kept: dict[Hashable, list[Any]] = {}
        self._step = 0
        self.allocated = 0  # buffers made, and buffers handed out again, since creation
        self.reused = 0

    def get(self, kind: Hashable, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        """A contiguous buffer of `shape` and `dtype` on `device` that nothing else holds: one
        kept from before when one is free, else a new one, kept from now on."""
        key = (kind, shape, dtype, device)
        entry = self._kept.get(key)
        if entry is None:
            entry = self._kept[key] = [self._step, []]
        entry[0] = self._step
        kept: list[torch.Tensor] = entry[1]
        for base in kept:
            if _storage_use_count(base.untyped_storage()._cdata) == 2:  # the base and the ask
                self.reused += 1
                return base.view(shape)  # handed out as a view: whoever holds it holds the storage
        base = torch.empty(shape, dtype=dtype, device=device)
        if _storage_use_count is not _uncounted:
            kept.append(base)
        self.allocated += 1
        return base.view(shape)

    def end_step(self) -> None:
        """Drops the kinds this step did not receive: their shapes or cut are gone."""
        for key in [k for k, (step, _) in self._kept.items() if step != self._step]:
            del self._kept[key]
        self._step += 1

    @property
    def kept_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, ts in self._kept.values() for t in ts)

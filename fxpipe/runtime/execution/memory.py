"""Measures the activation bytes a stage keeps between forward and backward.

Autograd's saved-tensor hooks see what operations save; remat regions keep their inputs instead,
which `fxpipe.runtime.stage.checkpoint` reports here. Storages are counted once and parameters
never, so the figure is the memory a run holds for backward, comparable with the cost model's
prediction.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterable, Iterator

import torch

__all__ = ["KeptMemory", "active_tracker"]

_ACTIVE = threading.local()


def active_tracker() -> KeptMemory | None:
    return getattr(_ACTIVE, "tracker", None)


Key = Hashable  # a micro-batch, or (stage, micro-batch) where one process runs several stages


class KeptMemory:
    """Per micro-batch sets of kept storages; `peak` is the most held at any point."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        self.exclude = {p.untyped_storage().data_ptr() for p in parameters}
        self.live: dict[Key, dict[int, int]] = {}  # microbatch -> storage -> bytes
        self.peak = 0
        self.per_microbatch: dict[Key, int] = {}
        self._current: Key | None = None

    def _add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or self._current is None:
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or ptr == 0:
            return
        self.live.setdefault(self._current, {})[ptr] = storage.nbytes()

    def add_region_inputs(self, tensors: Iterable[object]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)

    @contextlib.contextmanager
    def forward(self, microbatch: Key) -> Iterator[None]:
        """Tracks what the forward of one micro-batch keeps for its backward."""
        self._current = microbatch
        _ACTIVE.tracker = self

        def pack(t: torch.Tensor) -> torch.Tensor:
            self._add(t)
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            _ACTIVE.tracker = None
            self._current = None
            self.per_microbatch[microbatch] = sum(self.live.get(microbatch, {}).values())
            self.peak = max(self.peak, self.total())

    def keep_only(self, microbatch: Key, tensors: Iterable[torch.Tensor]) -> None:
        """The micro-batch's input pass freed all it kept but the storages of `tensors` (what
        its weight pass reads)."""
        kept = {t.untyped_storage().data_ptr() for t in tensors}
        storages = self.live.get(microbatch, {})
        self.live[microbatch] = {ptr: n for ptr, n in storages.items() if ptr in kept}

    def release(self, microbatch: Key) -> None:
        """The micro-batch's backward ran: its activations are freed."""
        self.live.pop(microbatch, None)

    def total(self) -> int:
        merged: dict[int, int] = {}
        for storages in self.live.values():
            merged.update(storages)
        return sum(merged.values())

"""Counting host syncs: the calls that make the host wait for a device.

On CUDA the host runs ahead of the device, queueing kernels, until it reads a value that a
kernel computes: `.item()`, `.tolist()`, `float(t)`, `bool(t)`, a copy to the host (`.cpu()`,
`.to("cpu")`, `.numpy()`), or `synchronize()` on the device, a stream or an event. Each of these
waits for everything queued before it. `HostSyncs` counts those calls, by the line that made
them, while it is entered.

On CPU nothing waits, so a CPU run cannot show a sync by its timing; `every_tensor=True` counts
the reads of every tensor as if it lived on the device (a copy to the CPU of a CPU tensor
counts too). That is an upper bound of what the same code would sync with its stages on a GPU,
and exact for the reads of stage values. torch.cuda.set_sync_debug_mode catches only syncs made
inside CUDA ops and needs a GPU; the counter sees the Python calls on either.
"""
from __future__ import annotations

import collections
import sys
import threading
from types import TracebackType
from typing import Any

import torch

__all__ = ["HostSyncs"]

_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu")
_SYNCS = ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
          (torch.cuda.Stream, "synchronize"))


def _target_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device a `Tensor.to(...)` call copies to (None: only a dtype change)."""
    device = kwargs.get("device")
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
        if isinstance(arg, (str, torch.device, int)) and device is None:
            device = arg
            break
    return torch.device(device) if device is not None else None


class HostSyncs:
    """While entered, counts the calls that sync the host with a device (see the module
    docstring), in every thread.

    every_tensor: count the reads of CPU tensors too (a CPU stand-in for a device run).
    """

    def __init__(self, every_tensor: bool = False) -> None:
        self.every_tensor = every_tensor
        self.sites: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._inside = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def reset(self) -> None:
        with self._lock:
            self.sites.clear()

    def _counts(self, tensor: Any) -> bool:
        return self.every_tensor or not isinstance(tensor, torch.Tensor) or \
            tensor.device.type != "cpu"

    def _note(self, what: str) -> None:
        frame = sys._getframe(2)
        with self._lock:
            self.sites[f"{what} at {frame.f_code.co_filename}:{frame.f_lineno}"] += 1

    def _wrap(self, original: Any, what: str, counts: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            outer = getattr(self._inside, "on", False)
            if not outer and counts(args, kwargs):
                self._note(what)
            self._inside.on = True  # a read made inside another is not counted twice
            try:
                return original(*args, **kwargs)
            finally:
                self._inside.on = outer
        return counted

    def _patch(self, owner: Any, name: str, counts: Any) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, self._wrap(getattr(owner, name), name, counts))

    def __enter__(self) -> HostSyncs:
        for name in _READS:
            self._patch(torch.Tensor, name, lambda a, k: self._counts(a[0]))

        def to_host(a: tuple[Any, ...], k: dict[str, Any]) -> bool:
            device = _target_device(a[1:], k)
            return device is not None and device.type == "cpu" and self._counts(a[0])
        self._patch(torch.Tensor, "to", to_host)
        for owner, name in _SYNCS:
            self._patch(owner, name, lambda a, k: True)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for owner, name, original in reversed(self._saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved.clear()

    def report(self) -> str:
        """Each counted call site with its count, most first."""
        return "; ".join(f"{n}x {site}" for site, n in self.sites.most_common())

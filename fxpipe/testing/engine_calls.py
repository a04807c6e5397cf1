"""Counting autograd engine calls: every `torch.autograd.backward`, `torch.autograd.grad` and
`Tensor.backward` runs the engine once, through `torch.autograd.graph._engine_run_backward`.

Each call walks the graph below its roots to find what it must run, so a backward split into
many calls pays that walk and the call's host work many times; the split backward's tests and
measurements count them.
"""
from __future__ import annotations

from types import TracebackType
from typing import Any

import torch.autograd
import torch.autograd.graph

__all__ = ["EngineCalls"]


class EngineCalls:
    """While entered, counts the autograd engine's calls (in `count`), in every thread."""

    def __init__(self) -> None:
        self.count = 0
        self._saved: Any = None

    def __enter__(self) -> EngineCalls:
        original = torch.autograd.graph._engine_run_backward
        self._saved = original

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        # torch.autograd imported the name from torch.autograd.graph: both are looked up by callers
        torch.autograd._engine_run_backward = counted  # type: ignore[attr-defined]
        torch.autograd.graph._engine_run_backward = counted
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        torch.autograd._engine_run_backward = self._saved  # type: ignore[attr-defined]
        torch.autograd.graph._engine_run_backward = self._saved

"""Mixed precision across stages: the caller's autocast in every stage, and loss scaling that
every rank agrees on.

autocast is a per-thread state: stage forwards that run on worker threads (the local executor)
see none of the caller's `with torch.autocast(...)`. `AutocastState.capture()` reads it in the
caller's thread and `enter()` re-enters it in a worker. Remat regions recompute under the same
state (torch.utils.checkpoint records it at the forward).

NOTE [Loss scaling across ranks]
`program.step(..., scaler=torch.amp.GradScaler(...))` multiplies each micro-batch loss by the
scaler's scale before its backward, as `scaler.scale(loss).backward()` does in one process; the
gradients therefore arrive scaled, and the caller runs `scaler.step(optimizer)` and
`scaler.update()` as usual. With one stage per rank each rank's scaler sees only its own
gradients, so one rank could skip a step that another takes. After the backward the ranks
all-reduce whether any gradient anywhere is not finite; if one is, every rank marks its own
gradients non-finite (one element set to inf), so every `scaler.step` skips and every
`scaler.update` lowers the scale alike, and the ranks' scales stay equal.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["AutocastState", "AUTOCAST_DTYPES", "compiled_autocast", "loss_scale",
           "agree_on_overflow", "ScaleFollower"]

_DEVICE_TYPES = ("cpu", "cuda")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # compile(autocast=...)


@contextlib.contextmanager
def compiled_autocast(name: str | None, devices: Iterable[torch.device]) -> Iterator[None]:
    """torch.autocast with the dtype a program was compiled with (`name` from AUTOCAST_DTYPES),
    on every device type the program's stages use; nothing when `name` is None."""
    with contextlib.ExitStack() as stack:
        if name is not None:
            for device_type in sorted({d.type for d in devices}):
                stack.enter_context(torch.autocast(device_type, dtype=AUTOCAST_DTYPES[name]))
        yield


@dataclass(frozen=True)
class AutocastState:
    """Which device types autocast is on for, in which dtype, and whether it caches casts."""

    enabled: tuple[tuple[str, torch.dtype], ...] = ()
    cache: bool = True

    @classmethod
    def capture(cls) -> AutocastState:
        """The calling thread's autocast state."""
        on = tuple((d, torch.get_autocast_dtype(d)) for d in _DEVICE_TYPES
                   if torch.is_autocast_enabled(d))
        return cls(on, torch.is_autocast_cache_enabled())

    def dtype(self, device_type: str) -> torch.dtype | None:
        """The autocast dtype for `device_type`, or None when autocast is off for it."""
        return dict(self.enabled).get(device_type)

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        """Runs the block under this state (in any thread)."""
        with contextlib.ExitStack() as stack:
            for device_type, dtype in self.enabled:
                stack.enter_context(torch.autocast(device_type, dtype=dtype,
                                                   cache_enabled=self.cache))
            yield


def loss_scale(scaler: Any, device: torch.device) -> torch.Tensor | None:
    """The factor the backward runs under: the scaler's scale on `device` (None without an
    enabled scaler). Every rank calls it, which also sets up the scale its scaler.step needs."""
    if scaler is None or not scaler.is_enabled():
        return None
    scale: torch.Tensor = scaler.scale(torch.ones((), dtype=torch.float32, device=device))
    return scale


def agree_on_overflow(params: Iterable[torch.Tensor], device: torch.device,
                      group: Any = None) -> bool:
    """Whether any rank of `group` has a non-finite gradient; if so, makes this rank's gradients
    non-finite too (NOTE [Loss scaling across ranks]). Collective: every rank calls it."""
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel()]
    local = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any() if grads else \
        torch.zeros((), dtype=torch.bool, device=device)
    found = local.to(device=device, dtype=torch.float32).reshape(1)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    overflow, mine = bool(found.item()), bool(local.item())
    if overflow and not mine:
        with torch.no_grad():
            for g in grads:
                g[(0,) * g.dim()] = float("inf")
    return overflow


class ScaleFollower:
    """scaler.update() for a rank without an optimizer (its stages hold no parameters), which
    scaler.step and scaler.update need: the scale moves as the other ranks' scalers move it
    after the overflow they agreed on (NOTE [Loss scaling across ranks]), so a loss this rank
    scales is scaled as their gradients are unscaled."""

    def __init__(self) -> None:
        self.steps_taken = 0  # since the scale last changed, as GradScaler's growth tracker

    def update(self, scaler: torch.amp.GradScaler, overflow: bool) -> None:
        if not scaler.is_enabled():
            return
        scale = scaler.get_scale()
        if overflow:
            scale, self.steps_taken = scale * scaler.get_backoff_factor(), 0
        else:
            self.steps_taken += 1
            if self.steps_taken == scaler.get_growth_interval():
                scale, self.steps_taken = scale * scaler.get_growth_factor(), 0
        scaler.update(scale)

"""A GradScaler's state in a checkpoint. fp16 training skips each step whose gradients overflow
and halves the loss scale, and doubles it after `growth_interval` clean steps; a resume that
started the scale afresh would skip steps that the run that saved it took. Each saving rank
records its scaler's state; the ranks of a pipeline agree on every overflow
(fxpipe.runtime.execution.amp), so their scales are equal and a resume by any number of
processes restores the same one."""
from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from fxpipe.errors import CheckpointError

__all__ = ["scaler_state", "restore_scaler", "is_scaler_state"]

_FIELDS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def scaler_state(scaler: torch.amp.GradScaler | None,
                 steps_taken: int | None = None) -> dict[str, Any] | None:
    """The scaler's state; None without a scaler or with a disabled one. `steps_taken`: the
    growth tracker of a rank whose scale follows the others' (amp.ScaleFollower), which its
    scaler does not count itself."""
    if scaler is None or not scaler.is_enabled():
        return None
    state = dict(scaler.state_dict())
    if steps_taken is not None:
        state["_growth_tracker"] = steps_taken
    return state


def restore_scaler(scaler: torch.amp.GradScaler | None, saved: list[dict[str, Any] | None],
                   rank: int, where: str, *, strict: bool) -> int | None:
    """Loads the state rank `rank` saved (another rank's where it saved none: they are equal)
    into `scaler`, and returns its growth tracker (for a ScaleFollower). Without a saved state:
    CheckpointError when `strict`, else a warning and None (the scale starts afresh)."""
    if scaler is None or not scaler.is_enabled():
        return None
    state = saved[rank] if rank < len(saved) else None
    state = state or next((s for s in saved if s is not None), None)
    if state is None:
        message = (f"{where} holds no GradScaler state, so the loss scale starts again at "
                   f"{scaler.get_scale():g}, and a step that overflows there is skipped where "
                   "the run that saved it went on")
        if strict:
            raise CheckpointError(message, hint="save with program.save(directory, "
                                  "scaler=scaler), or load with strict=False to start the scale "
                                  "afresh")
        warnings.warn(message, UserWarning, stacklevel=3)
        return None
    scaler.load_state_dict(state)
    return int(state["_growth_tracker"])


def is_scaler_state(value: object) -> bool:
    """Whether a shard's "scaler" entry is a GradScaler's state (or absent)."""
    return value is None or (
        isinstance(value, dict) and all(k in value for k in _FIELDS)
        and all(isinstance(value[k], int | float) and math.isfinite(value[k]) for k in _FIELDS))

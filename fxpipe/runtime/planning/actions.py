"""Actions and schedules as data: what each pipeline rank runs, in order, and the checks of a
schedule's sizes and layout. Nothing here imports torch."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

from fxpipe.errors import ConfigError

__all__ = ["ActionKind", "Action", "Schedule", "check_sizes", "check_stages_per_rank"]


class ActionKind(str, Enum):
    """What an action computes. The values are the letters schedules print and files store
    ("F3" is the forward of micro-batch 3); a kind equals and hashes as its letter."""

    FORWARD = "F"
    BACKWARD = "B"
    INPUT_GRAD = "I"  # the input-gradient half of a split backward
    WEIGHT_GRAD = "W"  # the weight-gradient half: after I(s, m); nothing waits for it

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @property
    def gives_input_grad(self) -> bool:
        """Whether it takes the outputs' gradients and gives the inputs' (B, or I of a split
        backward): what the previous stage waits for."""
        return self in (ActionKind.BACKWARD, ActionKind.INPUT_GRAD)

    @property
    def accumulates_weight_grad(self) -> bool:
        """Whether it adds into the parameters' gradients (B, or W of a split backward)."""
        return self in (ActionKind.BACKWARD, ActionKind.WEIGHT_GRAD)


@dataclass(frozen=True)
class Action:
    """One unit of work: the forward or the backward of one micro-batch on one stage."""

    kind: ActionKind  # given as its letter ("F"), it becomes the kind
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            if self.kind not in tuple(ActionKind):
                letters = ", ".join(repr(k.value) for k in ActionKind)
                raise ConfigError(f"unknown action kind {self.kind!r} (stage {self.stage}, "
                                  f"micro-batch {self.microbatch})", hint=f"use one of {letters}")
            object.__setattr__(self, "kind", ActionKind(self.kind))

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


Schedule: TypeAlias = list[list[Action]]
"""schedule[r] is the list of actions pipeline rank r performs, in execution order."""


def check_sizes(num_microbatches: int, num_stages: int) -> None:
    """ConfigError unless both counts are integers >= 1."""
    for name, value in (("num_microbatches", num_microbatches), ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(
                f"{name} must be an int (got {value!r} of type {type(value).__name__})",
                hint=f"pass {name} as a positive integer",
            )
        if value < 1:
            raise ConfigError(
                f"{name} must be >= 1 (got {value})",
                hint=f"pass {name}=1 or more",
            )


def check_stages_per_rank(num_stages: int, num_ranks: int, name: str,
                          exactly: int | None = None) -> int:
    """Stages per rank of a looped schedule `name`: ConfigError unless the stages spread
    evenly over the ranks (`exactly` that many on each, where given)."""
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ConfigError(f"num_ranks must be an integer >= 1 (got {num_ranks!r})",
                          hint="pass the number of pipeline ranks")
    if num_stages % num_ranks or (exactly is not None and num_stages != exactly * num_ranks):
        need = f"exactly {exactly} stages per rank" if exactly else "the same number of " \
            "stages on every rank"
        raise ConfigError(f"{name} needs {need} ({num_stages} stages on {num_ranks} ranks)",
                          hint=f"use {(exactly or 2) * num_ranks} stages, or another schedule")
    return num_stages // num_ranks

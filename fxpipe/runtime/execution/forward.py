"""One stage forward on one micro-batch, as both executors run it, and its random stream.

The local executor (fxpipe.runtime.execution.local) and the distributed one
(fxpipe.runtime.execution.distributed) run a stage's forward alike: a comm view bound to the stage
and micro-batch (whether it recomputes comes from the remat policy), the stage's model inputs on its
device, the micro-batch's own RNG stream, the NaN/Inf check. What differs between them is given:
the modes entered around it (the local executor's worker thread re-enters the caller's grad mode,
autocast and device; the distributed one a timeline span), what tracks the activations kept for
backward, and what is done with the outputs inside all of these (the last stage's loss).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from fxpipe.runtime.comm import MicrobatchComm
from fxpipe.runtime.execution.devices import to_device
from fxpipe.runtime.execution.finite import check_finite
from fxpipe.runtime.execution.stagespec import HeldStage

__all__ = ["Forward", "run_forward", "microbatch_seed", "seeded_forward", "draw_base"]

_RNG_LOCK = threading.Lock()


def microbatch_seed(base: int, microbatch: int) -> int:
    """Where micro-batch `microbatch`'s random stream starts: the first stage seeds it, later
    stages continue it (NOTE [Random streams across stages] in fxpipe.runtime.ops), so the
    masks are the same whatever runs first."""
    return (base * 1_000_003 + microbatch) % (2**63 - 1)


def draw_base() -> int:
    """One number from the caller's generator per step, from which every micro-batch's seed
    comes: seeding torch before a step makes the step reproducible."""
    return int(torch.randint(0, 2**62, (1,)).item())


@contextlib.contextmanager
def seeded_forward(base: int | None, microbatch: int,
                   devices: Sequence[torch.device] = ()) -> Iterator[None]:
    """Runs a stage forward on its micro-batch's RNG stream (when the stage draws random
    numbers), apart from the caller's: seeded here, and continued by a later stage from the
    state the stage before it hands over (NOTE [Random streams across stages]).

    devices: the CUDA devices the stage uses (fxpipe.runtime.execution.devices.stage_devices). Each
    one's generator is forked and seeded, not only the current device's: a stage on cuda:1 would
    otherwise start every micro-batch from the same restored state, drawing the same masks.
    """
    if base is None:
        yield
        return
    indexes = [d.index for d in devices if d.type == "cuda"]
    with _RNG_LOCK, torch.random.fork_rng(devices=indexes):
        seed = microbatch_seed(base, microbatch)
        torch.default_generator.manual_seed(seed)
        for index in indexes:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


@dataclass
class Forward:
    """What a stage forward gave: its outputs and the comm view it ran with (which keeps what
    it sent and received)."""

    out: Any
    view: MicrobatchComm


def run_forward(stage: HeldStage, comm: Any, microbatch: int, inputs: Sequence[torch.Tensor], *,
                recompute: bool, seed_base: int | None, rng_devices: Sequence[torch.device],
                check: bool, check_outputs: bool,
                modes: AbstractContextManager[Any] | None = None,
                track: AbstractContextManager[Any] | None = None,
                then: Callable[[Any], None] | None = None) -> Forward:
    """Runs `stage` on micro-batch `microbatch`.

    comm: the executor's communication (LocalComm or DistComm), seen through a MicrobatchComm.
    inputs: the micro-batch's flat model inputs; the stage reads its own on its device.
    recompute: whether this micro-batch recomputes its remat regions (the remat policy).
    seed_base: the step's RNG base (draw_base), used when the stage draws random numbers;
    rng_devices: the CUDA devices whose generators it then forks.
    check / check_outputs: the NaN/Inf check of what it sends, and of its outputs too.
    modes: entered around the forward (before its RNG stream); track: entered inside it (what
    the forward keeps for backward); then: called on the outputs inside both.
    """
    view = MicrobatchComm(comm, stage.index, microbatch, recompute, stage.device)
    args = [to_device(inputs[i], stage.device) for i in stage.inputs]
    seeded = stage.random and seed_base is not None
    # only the contexts that do something are entered: this runs for every micro-batch
    with modes or _NOTHING:
        if seeded or track is not None:
            with seeded_forward(seed_base, microbatch, rng_devices) if seeded else _NOTHING, \
                    track or _NOTHING:
                out = _call(stage, view, microbatch, args, check, check_outputs, then)
        else:
            out = _call(stage, view, microbatch, args, check, check_outputs, then)
    return Forward(out, view)


_NOTHING = contextlib.nullcontext()  # reusable: enters and exits doing nothing


def _call(stage: HeldStage, view: MicrobatchComm, microbatch: int, args: list[Any],
          check: bool, check_outputs: bool, then: Callable[[Any], None] | None) -> Any:
    out = stage.module(view, *args)
    if check:
        check_finite(stage.index, microbatch, view.sent, out if check_outputs else None,
                     view.received, args, stage.graph)
    if then is not None:
        then(out)
    return out

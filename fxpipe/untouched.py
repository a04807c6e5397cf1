"""Running a block without leaving a trace: the caller's random streams, and a model's gradients
and buffers, are as they were before it.

Capture, timing, the loss probe, balancing and weight materialization all run a model (or part
of it) for what they learn, not for its effects; they use these, so that "nothing changed" means
one thing everywhere. The per-micro-batch random streams of a pipelined step are another matter
(fxpipe.runtime.execution.forward.seeded_forward).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = ["modes_kept", "rng_forked", "seeded", "untouched"]


def _cuda_devices() -> list[int]:
    """The CUDA devices whose generators a block can draw from: all of them once CUDA is up
    (none before, so that forking never initializes CUDA)."""
    initialized: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # unannotated
    return list(range(torch.cuda.device_count())) if initialized else []


@contextlib.contextmanager
def rng_forked() -> Iterator[None]:
    """The CPU and CUDA random streams are restored after the block."""
    with torch.random.fork_rng(devices=_cuda_devices()):
        yield


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """The block runs from a fixed seed; the caller's random streams are restored after it."""
    with rng_forked():
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def untouched(parameters: Iterable[torch.Tensor], buffers: Iterable[torch.Tensor]
              ) -> Iterator[None]:
    """The parameters' gradients, the buffers' values (BatchNorm statistics move when a
    train-mode forward runs) and the random streams are restored after the block, also when it
    raises."""
    grads = [(p, p.grad.clone() if p.grad is not None else None) for p in parameters]
    saved = [(b, b.detach().clone()) for b in buffers]
    try:
        with rng_forked():
            yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
        for p, grad in grads:
            p.grad = grad


@contextlib.contextmanager
def modes_kept(model: nn.Module) -> Iterator[None]:
    """Every module's train/eval flag is put back after the block, also when it raises (a
    model may hold a module in a mode of its own, such as a frozen BatchNorm)."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag

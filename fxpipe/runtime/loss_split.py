"""How the batch's loss splits over micro-batches when the last stage computes it per micro-batch.

In one process the loss runs once, on the outputs joined along the batch, so any loss trains as
in the plain model. Under torchrun the last stage computes each micro-batch's loss as soon as its
forward is done and starts that micro-batch's backward from it, times a weight: 1/M when the
batch's loss is the mean of its M micro-batches' (a mean over examples), 1 when it is their sum
(a sum over examples). Which one is found by computing the loss once more on the joined outputs
of the step itself and comparing; a loss that is neither (a standard deviation or a maximum over
the batch, a mean over padded tokens whose count differs between micro-batches) cannot be
computed per micro-batch and is refused, never approximated.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from fxpipe.errors import LossError

__all__ = ["MEAN", "SUM", "NEITHER", "KINDS", "split_kind", "weight_of", "loss_key",
           "refusal", "changed", "unchanged"]

MEAN, SUM, NEITHER = "mean", "sum", "neither"
KINDS = (MEAN, SUM, NEITHER)


def _tolerance(dtype: torch.dtype) -> float:
    """Relative difference that floating-point reordering explains for a loss of `dtype`."""
    return max(1e-5, 8 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-5


def split_kind(full: float, parts: Sequence[float], dtype: torch.dtype) -> str | None:
    """MEAN, SUM or NEITHER: how the batch's loss `full` relates to its micro-batches' `parts`;
    None when a value is not finite (nothing to compare)."""
    if not all(math.isfinite(v) for v in (full, *parts)):
        return None
    rel = _tolerance(dtype)
    size = sum(abs(p) for p in parts)
    if abs(full - sum(parts) / len(parts)) <= rel * size / len(parts) + 1e-30:
        return MEAN
    if abs(full - sum(parts)) <= rel * size + 1e-30:
        return SUM
    return NEITHER


def weight_of(kind: str, chunks: int, replicas: int = 1) -> float:
    """What each micro-batch's loss is multiplied by before its backward. Data-parallel
    replicas average their gradients, which a sum's weight undoes."""
    return {MEAN: 1.0 / chunks, SUM: float(replicas)}.get(kind, 0.0)


def loss_key(loss_fn: Callable[..., Any], with_target: bool) -> Hashable:
    """What a remembered kind belongs to: the loss's code (a lambda made anew each step is the
    same loss), and whether it gets a target."""
    code = getattr(loss_fn, "__code__", None)
    return (code if code is not None else loss_fn, with_target)


def _name(loss_fn: Callable[..., Any]) -> str:
    return getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__


_HINT = ("write the loss as a mean or a sum over examples: for a mean over the real tokens of "
         "a padded batch, count them over the whole batch first and pass e.g. "
         "loss_fn=lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), "
         "ignore_index=PAD, reduction='sum') / count; a statistic of the whole batch (std, "
         "max) needs every example at once: run the program in one process (program(x), then "
         "the loss)")


def refusal(loss_fn: Callable[..., Any], full: float, parts: Sequence[float],
            assumed: str | None) -> LossError:
    """The error every rank raises for a loss that does not split over micro-batches.

    assumed: the kind the step's backward used (None: the step added nothing to the
    gradients)."""
    values = ", ".join(f"{p:.6g}" for p in parts)
    mean = sum(parts) / len(parts)
    what = (f"the loss {_name(loss_fn)} of the whole batch is {full:.6g}, but the losses of its "
            f"{len(parts)} micro-batches are [{values}]: mean {mean:.6g}, sum {sum(parts):.6g}")
    if assumed is None:
        return LossError(f"{what}. The loss is neither a mean nor a sum over examples, so the "
                         "ranks, which compute it per micro-batch, cannot give the plain "
                         "model's loss and gradients; this step added nothing to the gradients",
                         hint=_HINT)
    kind = split_kind(full, parts, torch.float64) or NEITHER
    return LossError(f"{what}. Earlier steps found it a {assumed} over micro-batches, and in this "
                     f"one it is {'a ' + kind if kind != NEITHER else 'neither a mean nor a sum'}"
                     f": this step's gradients were scaled as a {assumed} and are not the plain "
                     "model's; zero them (optimizer.zero_grad()) before the next step",
                     hint=f"{_HINT}; or use schedule='gpipe', whose last stage finds the kind "
                          "from every step's outputs before its backward")


def changed(kind: str | None, assumed: str) -> bool:
    """Whether a step judged `kind` had its backward scaled wrongly as `assumed`."""
    return kind is not None and kind != assumed


@contextlib.contextmanager
def unchanged(parameters: Sequence[nn.Parameter], buffers: Sequence[torch.Tensor],
              devices: Sequence[int]) -> Iterator[None]:
    """A step that only finds the loss's kind leaves no trace: gradients, buffers and the RNG
    streams are restored."""
    grads = [(p, p.grad.clone() if p.grad is not None else None) for p in parameters]
    saved = [(b, b.detach().clone()) for b in buffers]
    try:
        with torch.random.fork_rng(devices=list(devices)):
            yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
        for p, grad in grads:
            p.grad = grad

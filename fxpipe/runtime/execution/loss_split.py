"""How the batch's loss splits over micro-batches when the last stage computes it per micro-batch.

In one process the loss runs once, on the outputs joined along the batch, so any loss trains as
in the plain model. Under torchrun the last stage computes each micro-batch's loss as soon as its
forward is done and starts that micro-batch's backward from it, times a weight: 1/M when the
batch's loss is the mean of its M micro-batches' (a mean over examples), 1 when it is their sum
(a sum over examples). Which one is found by computing the loss once more on the joined outputs
of the step itself and comparing (for a loss fxpipe defines, a mean over what it counts, that
value is its micro-batches' weighted by their counts: fxpipe.losses.counted); a loss that is
neither (a standard deviation or a maximum over the batch, a mean over padded tokens whose count
differs between micro-batches) cannot be computed per micro-batch and is refused, never
approximated.

A replica that runs one micro-batch per step has nothing to compare it with: its loss is then
compared with the losses of the two halves of that micro-batch, since a weight of 1 is right for
any loss only without replicas. A micro-batch of one example has no halves: only a loss known to
be a mean (fxpipe.losses.NAMED) or judged on an earlier step is accepted there. Data-parallel
replicas agree on the kind (counts of each, summed over the replicas) before they weight.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch

from fxpipe.errors import LossError
from fxpipe.losses import NAMED

__all__ = ["MEAN", "SUM", "NEITHER", "UNDECIDED", "MIXED", "KINDS", "split_kind", "weight_of",
           "WeightedLoss", "loss_key", "known_kind", "agreed", "refusal", "undecidable",
           "disagreement", "changed"]

MEAN, SUM, NEITHER = "mean", "sum", "neither"
UNDECIDED = "undecided"  # one micro-batch of one example: nothing to compare
MIXED = "mixed"  # the replicas found different kinds
KINDS = (MEAN, SUM, NEITHER, UNDECIDED, MIXED)


def _tolerance(dtype: torch.dtype) -> float:
    """Relative difference that floating-point reordering explains for a loss of `dtype`."""
    return max(1e-5, 8 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-5


def split_kind(full: float, parts: Sequence[float], dtype: torch.dtype,
               sizes: Sequence[int] | None = None) -> str | None:
    """MEAN, SUM or NEITHER: how the batch's loss `full` relates to its parts' losses `parts`
    (of `sizes` examples each; default equal); None when a value is not finite (nothing to
    compare)."""
    if not all(math.isfinite(v) for v in (full, *parts)):
        return None
    rel = _tolerance(dtype)
    size = sum(abs(p) for p in parts)
    shares = [s / sum(sizes) for s in sizes] if sizes else [1 / len(parts)] * len(parts)
    mean = sum(w * p for w, p in zip(shares, parts))
    if abs(full - mean) <= rel * sum(w * abs(p) for w, p in zip(shares, parts)) + 1e-30:
        return MEAN
    if abs(full - sum(parts)) <= rel * size + 1e-30:
        return SUM
    return NEITHER


def weight_of(kind: str, chunks: int, replicas: int = 1) -> float:
    """What each micro-batch's loss weighs in the batch's: the gradient its backward starts
    from (WeightedLoss). Data-parallel replicas average their gradients, which a sum's weight
    undoes."""
    return {MEAN: 1.0 / chunks, SUM: float(replicas)}.get(kind, 0.0)


class WeightedLoss(NamedTuple):
    """The last stage's loss of one micro-batch and the gradient its backward starts from: the
    micro-batch's weight in the batch's loss, times the loss scale (a float, or the scale's
    tensor times it)."""

    loss: torch.Tensor
    seed: float | torch.Tensor

    def start(self) -> torch.Tensor | None:
        """The seed as the loss's gradient; None for a loss that is not a scalar, which
        autograd then refuses as it would."""
        loss, seed = self.loss, self.seed
        if loss.dim() != 0:
            return None
        if isinstance(seed, torch.Tensor):
            return seed.to(dtype=loss.dtype, device=loss.device).reshape(())
        return torch.full_like(loss, seed)


def known_kind(loss_fn: Callable[..., Any]) -> str | None:
    """MEAN for the losses fxpipe defines (each a mean over examples), else None: they need no
    judging where nothing can be compared."""
    return MEAN if any(loss_fn is fn for fn in NAMED.values()) else None


def agreed(counts: Sequence[int]) -> str | None:
    """The kind every replica found, from how many found each of KINDS (None: none could
    compare), or MIXED."""
    found = {k for k, n in zip(KINDS, counts) if n}
    return found.pop() if len(found) == 1 else MIXED if found else None


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


def _class_weighted_mean(loss_fn: Callable[..., Any]) -> bool:
    """A CrossEntropyLoss or NLLLoss with class weights and reduction="mean": a mean weighted
    by the batch's own targets, not a mean over examples."""
    return isinstance(loss_fn, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)) and \
        loss_fn.weight is not None and loss_fn.reduction == "mean"


def refusal(loss_fn: Callable[..., Any], full: float, parts: Sequence[float],
            assumed: str | None, halves: bool = False,
            batch_free: Sequence[str] = ()) -> LossError:
    """The error every rank raises for a loss that does not split over micro-batches.

    assumed: the kind the step's backward used (None: the step added nothing to the
    gradients); halves: `parts` are the two halves of the replica's one micro-batch;
    batch_free: the model's outputs that are the same on every micro-batch (a term of one
    added to a summed loss is the usual cause)."""
    values = ", ".join(f"{p:.6g}" for p in parts)
    mean = sum(parts) / len(parts)
    whose = "the two halves of its one micro-batch" if halves else \
        f"its {len(parts)} micro-batches"
    what = (f"the loss {_name(loss_fn)} of the whole batch is {full:.6g}, but the losses of "
            f"{whose} are [{values}]: mean {mean:.6g}, sum {sum(parts):.6g}")
    hint = _HINT if not batch_free else (
        f"{', '.join(batch_free)} of the model is the same on every micro-batch, so a term "
        "of it added to the loss counts once per micro-batch: average the loss over examples, "
        "or add the term in proportion to the examples the loss sees (e.g. + penalty * "
        f"len(target) / batch_size); else {_HINT}")
    if _class_weighted_mean(loss_fn):
        hint = (f"{type(loss_fn).__name__}(weight=...) with reduction='mean' divides by the "
                "weights of its own targets, which differ between micro-batches: sum it and "
                "divide by the whole batch's total, e.g. total = weight[target].sum() (the "
                "batch's targets) and loss_fn=lambda out, t: F.cross_entropy(out, t, "
                "weight=weight, reduction='sum') / total")
    if assumed is None:
        return LossError(f"{what}. The loss is neither a mean nor a sum over examples, so the "
                         "ranks, which compute it per micro-batch, cannot give the plain "
                         "model's loss and gradients; this step added nothing to the gradients",
                         hint=hint)
    kind = split_kind(full, parts, torch.float64) or NEITHER
    return LossError(f"{what}. Earlier steps found it a {assumed} over micro-batches, and in this "
                     f"one it is {'a ' + kind if kind != NEITHER else 'neither a mean nor a sum'}"
                     f": this step's gradients were scaled as a {assumed} and are not the plain "
                     "model's; zero them (optimizer.zero_grad()) before the next step",
                     hint=f"{hint}; or use schedule='gpipe', whose last stage finds the kind "
                          "from every step's outputs before its backward")


def undecidable(loss_fn: Callable[..., Any], replicas: int) -> LossError:
    """The error every rank raises when each replica's batch is one example in one micro-batch
    and the loss is not known to be a mean."""
    return LossError(
        f"the loss {_name(loss_fn)} cannot be judged a mean or a sum over examples: each of the "
        f"{replicas} data-parallel replicas runs one micro-batch of one example, whose loss is "
        "the same number either way, and the replicas' gradients are combined differently for "
        "each; this step added nothing to the gradients",
        hint=f"give each replica at least 2 examples (a global batch of at least {2 * replicas}"
             "), or use a loss known to be a mean: the default (loss_fn=None), 'mse' or "
             "'cross_entropy'")


def disagreement(loss_fn: Callable[..., Any], counts: Sequence[int],
                 assumed: str | None) -> LossError:
    """The error every rank raises when the replicas found different kinds (`counts` of each
    of KINDS, then of replicas that could not compare)."""
    labels = ["a mean", "a sum", "neither a mean nor a sum", "undecided", MIXED, "not finite"]
    found = ", ".join(f"{n} found {label}" for label, n in zip(labels, counts) if n)
    scaled = "this step added nothing to the gradients" if assumed is None else \
        f"this step's gradients were scaled as a {assumed} and are not the plain model's; " \
        "zero them (optimizer.zero_grad()) before the next step"
    return LossError(f"the data-parallel replicas judge the loss {_name(loss_fn)} differently, "
                     f"each on its share of the batch: {found}. Their gradients cannot be "
                     f"combined as the plain model's; {scaled}", hint=_HINT)


def changed(kind: str | None, assumed: str) -> bool:
    """Whether a step judged `kind` had its backward scaled wrongly as `assumed`."""
    return kind is not None and kind != assumed

"""The default training loss, used when no loss_fn is given."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

__all__ = ["default_loss"]


def default_loss(output: Any, target: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy for integer targets, mean squared error for float targets, and without a
    target the mean of squares of every floating-point output.

    The first floating-point tensor of the output is the prediction (logits over its last
    dimension for cross-entropy). Every variant is a mean over the batch, so micro-batch losses
    weighted by their share of the batch add up to the full-batch loss.
    """
    floats = [t for t in pytree.tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise TypeError("the model output has no floating-point tensor to compute a loss on")
    if target is None:
        return sum(t.float().square().mean() for t in floats)
    prediction = floats[0]
    if target.is_floating_point():
        return F.mse_loss(prediction, target)
    return F.cross_entropy(prediction.reshape(-1, prediction.shape[-1]), target.reshape(-1))

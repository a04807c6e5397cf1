"""The plain model's losses for a few SGD steps: what a written program's --verify compares to.

Recorded when a program is written, on a copy of the model (the model itself is not trained),
with the same optimizer as the launcher (SGD, momentum 0.9) and the same seed per step.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from fxpipe.frontend.batching import seeded
from fxpipe.losses import LossFn
from fxpipe.runtime.amp import compiled_autocast
from fxpipe.signature import Signature

__all__ = ["reference_losses"]


def reference_losses(model: nn.Module, signature: Signature, flat: list[torch.Tensor],
                     target: torch.Tensor | None, loss: LossFn, steps: int, lr: float, *,
                     device: torch.device | None = None,
                     autocast: str | None = None) -> list[float]:
    """The losses of `steps` SGD steps of a copy of `model` on one batch, on `device` (the
    model's tensors may be spread over a pipeline's devices; the copy gathers them there) and
    under the program's autocast dtype."""
    model = copy.deepcopy(model)
    if device is not None:
        model.to(device)
        flat = [t.to(device) for t in flat]
        target = target.to(device) if target is not None else None
    args, kwargs = signature.unflatten_inputs(flat)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)  # as the launcher
    scaler = torch.amp.GradScaler(device.type if device is not None else "cpu",
                                  enabled=autocast == "fp16")
    losses = []
    for _ in range(steps):
        with seeded(0), compiled_autocast(autocast, [device or torch.device("cpu")]):
            output = model(*args, **kwargs)
            value = loss(output, target) if target is not None else loss(output)
        torch.autograd.backward(scaler.scale(value))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(float(value.detach()))
    return losses

"""The plain model's step that a pipelined step equals, for tests and for users checking a model.

    torch.manual_seed(0); loss = program.step(x, target=y)
    torch.manual_seed(0); expected = reference_step(program, copy_of_model, x, target=y)

gives the same loss, and the same gradient for every parameter of the copy as the pipeline
gives the model's: the plain model run over the program's micro-batches, each drawing random
numbers from the stream the pipeline gives it (NOTE [What equals what] in fxpipe.reference).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fxpipe.losses import LossFn, loss_function
from fxpipe.program import Program
from fxpipe.reference import microbatched_forward
from fxpipe.targets import Target

__all__ = ["reference_forward", "reference_step"]


def reference_forward(program: Program, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What `program(*args, **kwargs)` returns, computed by `model` (the plain model or a copy
    of it): each micro-batch in turn, the outputs joined."""
    built = program.built
    flat = built.signature.flatten_inputs(args, kwargs)
    draws_random = not built.spec.deterministic
    return microbatched_forward(model, built.signature, flat, built.spec.chunks, draws_random)


def reference_step(program: Program, model: nn.Module, *args: Any,
                   target: Target = None, loss_fn: LossFn | str | None = None,
                   **kwargs: Any) -> float:
    """What `program.step(*args, target=target, loss_fn=loss_fn, **kwargs)` does, done by
    `model`: its gradients accumulate as the pipeline's do; returns the loss. `loss_fn` is
    what step takes: a function, or a name of fxpipe.losses.NAMED ("mse", ...)."""
    loss_fn = loss_function(loss_fn)
    output = reference_forward(program, model, *args, **kwargs)
    value = loss_fn(output, target) if target is not None else loss_fn(output)
    torch.autograd.backward(value)
    return float(value.detach())

"""A model's own torch.autograd.Functions (a straight-through estimator, a gradient reversal
layer): fx and torch.export record what a Function's forward computes, not its backward, so a
captured graph's gradients are those of the forward's operations (`round`'s zero, a view's
identity) where the model's are the Function's own. The capture's first eager run records every
Function applied whose class is not torch's; the check of the graph then compares the graph's
parameter gradients with the model's on the example batch and refuses a graph whose gradients
differ, naming the Functions. A Function whose backward is its forward's derivative (a
memory-saving activation) compiles."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from fxpipe.errors import CaptureError
from fxpipe.frontend.regions import output_gradients

__all__ = ["custom_functions_applied", "check_custom_backward"]


@contextlib.contextmanager
def custom_functions_applied(found: list[str]) -> Iterator[None]:
    """Appends to `found` the name of each autograd.Function outside torch applied in the
    block (each once)."""
    # a classmethod, or (torch 2.14) a classmethod_descriptor of C code, which has no __func__:
    # either binds to a class through __get__
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls.__module__.split(".")[0] != "torch":
            name = f"{cls.__module__}.{cls.__qualname__}"
            if name not in found:
                found.append(name)
        return original.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[assignment, method-assign]
    try:
        yield
    finally:
        torch.autograd.Function.apply = original  # type: ignore[method-assign]


def check_custom_backward(functions: Sequence[str], model: nn.Module, run_model: Callable[[], Any],
                          run_graph: Callable[[], Any],
                          close: Callable[[torch.Tensor, torch.Tensor], bool]) -> None:
    """Raises CaptureError when the model applies `functions` and the graph's gradients of the
    sum of its outputs differ from the model's (one backward of each)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad and not p.is_meta}
    if not functions or not params:
        return
    eager = output_gradients(run_model, list(params.values()))
    graph = output_gradients(run_graph, list(params.values()))
    if eager is None or graph is None:
        return
    for name, e, g in zip(params, eager, graph):
        same = (e is None and g is None) or (e is not None and g is not None and close(e, g))
        if same:
            continue
        diff = "" if e is None or g is None else \
            f" by up to {(e.double() - g.double()).abs().max().item():.3g}"
        listed = ", ".join(functions[:3]) + (f" and {len(functions) - 3} more"
                                            if len(functions) > 3 else "")
        raise CaptureError(
            f"the model applies its own torch.autograd.Function ({listed}), whose backward a "
            f"captured graph does not keep: fx and torch.export record what its forward "
            f"computes, and the gradients of those operations are not the Function's (the "
            f"gradient of {name} differs{diff}), so the program would train otherwise than "
            f"the model",
            hint="register it as an operator with its own backward (torch.library.custom_op "
                 "with register_fake and register_autograd), which the graph keeps whole, or "
                 "pass the module that applies it in leaf_modules=[...] with capture='fx'")

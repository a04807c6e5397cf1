"""The check of a captured graph against the eager model: its outputs on the example batch and on
a smaller one, within float tolerances scaled to the outputs' magnitude, and its gradients
(fxpipe.frontend.regions; their values where the model applies its own autograd.Functions,
fxpipe.frontend.custom_functions); for a meta model, which has no values, shapes and dtypes
only."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe import ir
from fxpipe.frontend import regions
from fxpipe.frontend.batching import BatchLayout, finite_scale
from fxpipe.frontend.custom_functions import check_custom_backward
from fxpipe.frontend.meta import eager_runs
from fxpipe.signature import ModelArgs, ModelKwargs, Signature, is_tensor
from fxpipe.untouched import seeded

__all__ = ["compare_with_eager", "compare_shapes"]


def compare_with_eager(gm: fx.GraphModule, model: nn.Module, signature: Signature,
                        args: ModelArgs, kwargs: ModelKwargs, layout: BatchLayout) -> str | None:
    """None if the graph matches the model on the example batch and on a smaller batch."""
    known = layout.eager_outputs  # kept where they are what this check compares
    for trial, (batch_args, batch_kwargs) in enumerate(layout.trial_batches(args, kwargs)):
        try:
            if trial < len(known):  # computed by the layout inference (eval mode)
                expected = known[trial]
            else:
                with seeded(0), eager_runs(model):
                    expected = pytree.tree_leaves(model(*batch_args, **batch_kwargs))
            with seeded(0), eager_runs(model):
                got = pytree.tree_leaves(regions.call(gm, signature, batch_args, batch_kwargs))
        except Exception as error:  # noqa: BLE001 - a wrong trace may crash on other shapes
            first_line = str(error).splitlines()[0] if str(error) else ""
            return f"running it raised {type(error).__name__}: {first_line}"
        if len(expected) != len(got):
            return f"{len(got)} outputs instead of {len(expected)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            if is_tensor(e) != is_tensor(g):
                return f"output {i} is {type(g).__name__}, expected {type(e).__name__}"
            if is_tensor(e):
                if e.shape != g.shape:
                    return f"output {i} has shape {tuple(g.shape)}, expected {tuple(e.shape)}"
                if e.is_meta or g.is_meta:  # no values: shapes (above) and dtypes are checked
                    if e.dtype != g.dtype:
                        return f"output {i} has dtype {g.dtype}, expected {e.dtype}"
                    continue
                if not _close(e, g):
                    diff = (e.double() - g.double()).abs().max().item()
                    return f"output {i} differs by up to {diff:.3g}"
    problem = regions.gradient_difference(gm, model, signature, args, kwargs)
    if problem is None and layout.custom_functions:
        check_custom_backward(layout.custom_functions, model, lambda: model(*args, **kwargs),
                              lambda: regions.call(gm, signature, args, kwargs), _close)
    return problem


def compare_shapes(gm: fx.GraphModule, infos: dict[fx.Node, ir.ValueInfo],
                    layout: BatchLayout) -> str | None:
    """A meta model's check without running the graph again: its outputs' shapes, symbolic in
    the batch as export recorded them, and dtypes against the eager outputs on the trial batches
    (what compare_with_eager compares on meta tensors)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    got = pytree.tree_leaves(output.args[0])
    sizes = (layout.batch_size, max(1, layout.batch_size // 2))  # as trial_batches()
    for b, expected in zip(sizes, layout.eager_outputs):
        if len(expected) != len(got):
            return f"{len(got)} outputs instead of {len(expected)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            info = infos.get(g) if isinstance(g, fx.Node) else None
            if is_tensor(e) != isinstance(info, ir.TensorInfo):
                return f"output {i} is {'not ' if is_tensor(e) else ''}a tensor, expected " \
                       f"{type(e).__name__}"
            if isinstance(info, ir.TensorInfo):
                shape = info.concrete_shape(b)
                if tuple(e.shape) != shape:
                    return f"output {i} has shape {shape}, expected {tuple(e.shape)}"
                if e.dtype != info.dtype:
                    return f"output {i} has dtype {info.dtype}, expected {e.dtype}"
    return None


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    scale = finite_scale(a)
    return bool(torch.allclose(a.detach(), b.detach(), rtol=1e-4, atol=1e-5 + 1e-5 * scale,
                               equal_nan=True))


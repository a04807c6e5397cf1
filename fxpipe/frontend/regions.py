"""Grad-mode and autocast regions inside forward: `with torch.no_grad():`, `torch.autocast(...)`.

Such a region changes what autograd records (a value computed under no_grad has no gradient,
the parameters it reads get none from it) or the dtypes the operations compute in. torch.export
captures it as a higher-order operation calling a sub-graph (wrap_with_set_grad_enabled,
wrap_with_autocast); torch.fx runs the context manager while tracing and records only the
operations. Both become plain operations of the one graph here, each carrying the regions it
runs in (ir.MODE), so a stage boundary or a remat region may fall inside a region: the stage code
enters the same context managers around those operations (fxpipe.codegen), and the passes that
run operations one by one enter them too (ir.entered).

Writes: ir.MODE on the operations of a region.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe import ir
from fxpipe.errors import CaptureError
from fxpipe.signature import Signature
from fxpipe.untouched import seeded

__all__ = ["inline_regions", "ModeWatch", "RegionInterpreter", "call", "gradient_difference",
           "output_gradients", "LOST_REGION", "LOST_REGION_HINT"]

_HIGHER_ORDER = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4}  # args before submod
_DEVICES = ("cpu", "cuda")  # autocast states the fx front end watches


def _region_op(node: fx.Node) -> str | None:
    name = getattr(node.target, "__name__", None) if node.op == "call_function" else None
    return name if name in _HIGHER_ORDER else None


def inline_regions(gm: fx.GraphModule) -> int:
    """Replaces every region operation of an exported graph by the operations of its sub-graph,
    marked with the region's mode (nested regions included); returns how many it replaced."""
    count = 0
    while True:
        node = next((n for n in gm.graph.nodes if _region_op(n)), None)
        if node is None:
            break
        _inline(gm, node)
        count += 1
    if count:
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()
    return count


def _region_mode(node: fx.Node) -> ir.GradMode | ir.AutocastMode:
    if _region_op(node) == "wrap_with_set_grad_enabled":
        return ir.GradMode(bool(node.args[0]))
    device_type, dtype, enabled, cache = node.args[:4]
    return ir.AutocastMode(str(device_type), dtype if isinstance(dtype, torch.dtype) else None,
                           bool(enabled), cache if isinstance(cache, bool) else None)


def _inline(gm: fx.GraphModule, region: fx.Node) -> None:
    skip = _HIGHER_ORDER[str(_region_op(region))]
    submod_node, operands = region.args[skip], region.args[skip + 1:]
    if not isinstance(submod_node, fx.Node) or submod_node.op != "get_attr":
        raise CaptureError(f"{region.name} ({region.target}) calls no sub-graph attribute",
                           hint="please report this model")
    sub = gm.get_submodule(str(submod_node.target))
    if not isinstance(sub, fx.GraphModule):
        raise CaptureError(f"{region.name} calls {type(sub).__name__}, not a graph",
                           hint="please report this model")
    mode = (*ir.mode(region), _region_mode(region))
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for placeholder, operand in zip(placeholders, operands):
        if not isinstance(operand, fx.Node):
            raise CaptureError(f"{region.name} passes a constant {operand!r} to its sub-graph",
                               hint="please report this model")
        env[placeholder] = operand
    results: tuple[fx.node.Argument, ...] = ()
    with gm.graph.inserting_before(region):
        for node in sub.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                results = tuple(node.args[0]) if isinstance(node.args[0], (tuple, list)) \
                    else (node.args[0],)
                break
            if node.op == "get_attr":
                env[node] = _lifted_attribute(gm, sub, node, str(submod_node.target))
                continue
            copy = gm.graph.node_copy(node, lambda n: env[n])
            copy.meta[ir.MODE] = mode
            env[node] = copy
    outputs = [fx.map_arg(r, lambda n: env[n]) for r in results]
    for user in list(region.users):
        index = user.args[1] if user.target is operator.getitem else None
        value = outputs[index] if isinstance(index, int) and index < len(outputs) else None
        if not isinstance(value, fx.Node):
            raise CaptureError(f"{user.name} reads {region.name} ({region.target}) in a way "
                               "fxpipe cannot inline", hint="please report this model")
        user.replace_all_uses_with(value)
        gm.graph.erase_node(user)
    gm.graph.erase_node(region)
    if not submod_node.users:
        gm.graph.erase_node(submod_node)


def _lifted_attribute(gm: fx.GraphModule, sub: fx.GraphModule, node: fx.Node,
                      prefix: str) -> fx.Node:
    """An attribute of the sub-graph (a constant tensor, a nested region's sub-graph) as an
    attribute of the parent graph."""
    value: object = sub
    for part in str(node.target).split("."):
        value = getattr(value, part)
    target = f"{prefix}_{str(node.target).replace('.', '_')}"
    while hasattr(gm, target):
        target += "_"
    if isinstance(value, torch.nn.Module):
        gm.add_submodule(target, value)
    elif isinstance(value, torch.nn.Parameter):
        gm.register_parameter(target, value)
    elif isinstance(value, torch.Tensor):
        gm.register_buffer(target, value)
    else:
        raise CaptureError(f"{node.name} reads a {type(value).__name__} attribute inside a "
                           "grad-mode or autocast region", hint="please report this model")
    copy = gm.graph.get_attr(target)
    copy.meta = dict(node.meta)
    return copy


@dataclass
class ModeWatch:
    """The grad mode and autocast state outside forward, to tell which mode an operation traced
    by torch.fx runs in (fx runs the context managers and records only the operations)."""

    grad: bool
    autocast: tuple[ir.AutocastMode, ...]

    @staticmethod
    def now() -> ModeWatch:
        return ModeWatch(torch.is_grad_enabled(), tuple(_autocast_now()))

    def mode(self) -> ir.Mode:
        """The regions entered since `self` was taken: a mode that differs from it."""
        now = ModeWatch.now()
        grad = (ir.GradMode(now.grad),) if now.grad != self.grad else ()
        return (*grad, *(a for a, b in zip(now.autocast, self.autocast) if a != b))


def _autocast_now() -> Iterator[ir.AutocastMode]:
    for device in _DEVICES:
        yield ir.AutocastMode(device, torch.get_autocast_dtype(device),
                              torch.is_autocast_enabled(device), torch.is_autocast_cache_enabled())


class RegionInterpreter(fx.Interpreter):
    """Runs each node in its regions, as the model's forward runs it."""

    def run_node(self, n: fx.Node) -> Any:
        with ir.entered(n):
            return super().run_node(n)


def call(gm: fx.GraphModule, signature: Signature, args: Sequence[Any],
         kwargs: dict[str, Any]) -> Any:
    """Calls a captured graph like the model. The code fx writes for a graph ignores ir.MODE,
    so a graph with regions is interpreted node by node instead."""
    if not any(ir.MODE in n.meta for n in gm.graph.nodes):
        return gm(*args, **kwargs)
    flat = signature.flatten_inputs(args, kwargs)
    out = RegionInterpreter(gm).run(*flat, enable_io_processing=False)
    return signature.unflatten_outputs(out)


def output_gradients(run: Callable[[], Any], params: Sequence[torch.Tensor]
                     ) -> list[torch.Tensor | None] | None:
    """The gradients of `params` (None where unused) of the sum of what `run()` returns, seeded;
    None when no output requires grad."""
    with seeded(0), torch.enable_grad():
        outs = [t for t in pytree.tree_leaves(run())
                if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs:
            return None
        total = torch.stack([t.float().sum() for t in outs]).sum()
        return list(torch.autograd.grad(total, list(params), allow_unused=True))


LOST_REGION = "the graph gives gradients to other parameters than the model"
LOST_REGION_HINT = (
    "torch.utils.checkpoint(..., use_reentrant=True) is such a region under torch.export: pass "
    "use_reentrant=False (a transformers model: model.gradient_checkpointing_enable("
    "gradient_checkpointing_kwargs={'use_reentrant': False})), or compile with capture='fx'")


def gradient_difference(gm: fx.GraphModule, model: nn.Module, signature: Signature,
                        args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """None when the graph's regions give gradients to the parameters the model's give them to.

    Values cannot tell a lost no_grad region: torch.export (2.13) drops one nested in an
    autocast region, and the graph then trains a parameter the model does not. Checked only for
    a graph with regions, on one backward of the example batch each."""
    if not any(ir.MODE in n.meta or _region_op(n) for n in gm.graph.nodes):
        return None
    params = {n: p for n, p in model.named_parameters() if p.requires_grad and not p.is_meta}
    if not params:
        return None

    def reached(run: Callable[[], Any]) -> set[str]:
        grads = output_gradients(run, list(params.values())) or []
        return {n for n, g in zip(params, grads) if g is not None}

    try:
        eager = reached(lambda: model(*args, **kwargs))
        graph = reached(lambda: call(gm, signature, args, kwargs))
    except Exception:  # noqa: BLE001 - a backward that fails is not this check's to report
        return None
    if eager == graph:
        return None
    extra, missing = sorted(graph - eager), sorted(eager - graph)
    return f"{LOST_REGION} (a grad-mode region " \
        "lost while tracing; torch.fx keeps them, method='fx')" + \
        (f": only the graph to {', '.join(extra)}" if extra else "") + \
        (f"; only the model to {', '.join(missing)}" if missing else "")

"""Optional check for NaN/Inf: which stage, micro-batch and node produced them first.

After each stage forward the values it sends (and the model outputs of the last stage) are
checked. When one is not finite and the stage's graph is at hand, the forward is replayed node by
node on the same inputs to name the first node whose output is not finite, with its source line.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Interpreter, Node

from fxpipe import ir, source
from fxpipe.errors import PipelineRuntimeError

__all__ = ["check_finite"]


def _finite(value: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in pytree.tree_leaves(value)
               if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()))


class _Replay:
    def __init__(self, received: Mapping[str, Any]) -> None:
        self.received = received

    def recv(self, tag: str, src: int) -> Any:
        return self.received[tag]

    def send(self, value: Any, tag: str, dst: int) -> None:
        return None


class _FirstNonFinite(Interpreter):
    def run_node(self, n: Node) -> Any:
        with ir.entered(n):  # an autocast region computes in its dtype, as the stage code does
            result = super().run_node(n)
        if n.op in ("call_function", "call_method", "call_module") and not _finite(result):
            raise _Found(n)
        return result


class _Found(Exception):
    def __init__(self, node: Node) -> None:
        self.node = node


def _locate(gm: GraphModule, received: Mapping[str, Any],
            inputs: Sequence[torch.Tensor]) -> Node | None:
    try:
        with torch.no_grad():
            _FirstNonFinite(gm).run(_Replay(received), *inputs)
    except _Found as found:
        return found.node
    return None


def check_finite(stage: int, microbatch: int, sent: Mapping[str, Any], outputs: Any,
                 received: Mapping[str, Any], inputs: Sequence[torch.Tensor],
                 graph: GraphModule | None) -> None:
    """Raises PipelineRuntimeError naming where non-finite values first appeared."""
    bad = [tag for tag, value in sent.items() if not _finite(value)]
    if outputs is not None and not _finite(outputs):
        bad.append("the model's outputs")
    if not bad:
        return
    if any(not _finite(v) for v in received.values()):
        return  # an earlier stage produced them; it reports first
    where = f"stage {stage}, micro-batch {microbatch}"
    node = _locate(graph, received, inputs) if graph is not None else None
    if node is not None:
        line = source.from_stack_trace(node.meta.get("stack_trace"))
        raise PipelineRuntimeError(
            f"non-finite values (NaN/Inf) first appear in {where} at node {node.name} "
            f"({node.op} {node.target})" + (f"\n  at {line}" if line else ""),
            hint="lower the learning rate, check the inputs, or use a numerically safer op")
    raise PipelineRuntimeError(
        f"non-finite values (NaN/Inf) first appear in {where}, in {', '.join(bad)}",
        hint="lower the learning rate or check the inputs; an in-process program "
             "(program.step with check_finite=True) names the exact node")

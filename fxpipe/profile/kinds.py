"""What a graph operation pays beyond its kernels by: its kind (DeviceProfile.op_overheads).

An operation's kind is the op class of its forward's kernels (the first of OP_CLASSES among
them: a linear's matmul, not its bias add), or VIEW for glue that makes a tensor without a
kernel (a view or transpose still costs a call and records an autograd node); glue that makes
no tensor (sizes, an item of a tuple) pays nothing.
"""
from __future__ import annotations

import operator

from torch.fx import Node

from fxpipe import ir
from fxpipe.profile.device import OP_CLASSES

__all__ = ["VIEW", "is_glue", "operation_class", "overhead_kind"]

VIEW = "view"
"""The kind of glue that makes a tensor without a kernel."""


def is_glue(node: Node) -> bool:
    """Launches no kernel (views, getitem, sizes) or produces no tensor without computing."""
    cost: ir.Cost | None = node.meta.get(ir.COST)
    if cost is not None:
        return cost.fwd_kernels == 0
    return not isinstance(node.meta.get(ir.TENSOR), ir.TensorInfo)


def operation_class(cost: ir.Cost) -> str:
    """The op class an operation pays its overhead by: the first of OP_CLASSES among its
    forward kernels' (a linear's matmul, not its bias add)."""
    classes = {w.op_class for w in cost.work if not w.backward}
    return next((c for c in OP_CLASSES if c in classes), "elementwise")


def overhead_kind(node: Node) -> str | None:
    """The kind a costed node pays its overhead by: its op class, VIEW, or None (no cost, or
    glue that makes no tensor)."""
    cost: ir.Cost | None = node.meta.get(ir.COST)
    if cost is None:
        return None
    if not is_glue(node):
        return operation_class(cost)
    if node.target is operator.getitem or not isinstance(node.meta.get(ir.TENSOR), ir.TensorInfo):
        return None
    return VIEW

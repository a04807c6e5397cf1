"""The node.meta contract: fxpipe's metadata keys, their typed payloads, accessors and verify().

Every key fxpipe writes on an fx node is defined here once, with the pass that writes it:

    TENSOR = "fxpipe.tensor"  TensorInfo | ScalarInfo | tuple    fxpipe.capture
    COST   = "fxpipe.cost"    Cost (sympy in the micro-batch b)   passes.cost.annotate_costs
    TIME   = "fxpipe.time"    MeasuredTime                        passes.timing.measure_times
    STAGE  = "fxpipe.stage"   int, 0-based                        passes.partition.partition
    COMM   = "fxpipe.comm"    CommInfo                            passes.split.split_stages
    REMAT  = "fxpipe.remat"   str region id, e.g. "remat_0"       passes.remat.mark_remat
    MODE   = "fxpipe.mode"    Mode: grad mode / autocast entered  fxpipe.frontend.regions

torch.fx's own keys ("val", "tensor_meta", "stack_trace", "nn_module_stack", "recompute") are read,
never written.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import sympy  # type: ignore[import-untyped]  # sympy ships no type annotations
import torch
from torch.fx import Graph, GraphModule, Node

from fxpipe.errors import InvariantError, MissingMetaError

__all__ = [
    "TENSOR", "COST", "TIME", "STAGE", "COMM", "REMAT", "MODE", "CAPTURE", "QUALNAMES", "SAMPLED",
    "BATCH",
    "qualname",
    "TensorInfo", "ScalarInfo", "ValueInfo", "Cost", "ClassWork", "MeasuredTime", "CommInfo",
    "GradMode", "AutocastMode", "Mode", "mode", "entered",
    "value_info", "tensor_info", "cost", "measured_time", "stage", "comm", "leaves",
    "carries_grad", "differentiable",
    "is_comm", "is_inplace", "compute_nodes", "module_path", "format_shape", "dtype_abbr",
    "evaluate", "verify",
]

TENSOR = "fxpipe.tensor"
COST = "fxpipe.cost"
TIME = "fxpipe.time"
STAGE = "fxpipe.stage"
COMM = "fxpipe.comm"
REMAT = "fxpipe.remat"
MODE = "fxpipe.mode"
CAPTURE = "fxpipe.capture"  # GraphModule.meta: CaptureInfo written by fxpipe.capture
QUALNAMES = "fxpipe.qualnames"  # GraphModule.meta: {attribute alias: model qualified name}
# GraphModule.meta: frozenset of operations whose fake kernels specialise the batch size, run on
# static sizes instead (fxpipe.frontend.shapes, read by passes.cost)
SAMPLED = "fxpipe.sampled"


def qualname(gm: GraphModule, target: str) -> str:
    """The model's name for a graph attribute (unsafe names are aliased in the graph)."""
    names: dict[str, str] = gm.meta.get(QUALNAMES, {})
    return names.get(target, target)

BATCH = sympy.Symbol("b", positive=True, integer=True)
"""The micro-batch size: every shape, byte count and FLOP count is a polynomial in it."""

Expr: TypeAlias = sympy.Expr | int


def evaluate(expr: Expr, b: int) -> int | float:
    """Evaluates a cost or size expression at micro-batch size `b`."""
    if isinstance(expr, (int, float)):
        return expr
    return _evaluate(expr, b)


@functools.lru_cache(maxsize=65536)
def _evaluate(expr: sympy.Expr, b: int) -> int | float:
    value = expr.xreplace({BATCH: sympy.Integer(b)})  # much faster than subs for polynomials
    return int(value) if value.is_Integer else float(value)


@dataclass(frozen=True)
class TensorInfo:
    """Shape (sympy in b), dtype and batch dimension of a tensor value."""

    shape: tuple[sympy.Expr, ...]
    dtype: torch.dtype
    batch_dim: int | None  # the dimension that scales with b, or None (parameters, constants)
    requires_grad: bool = False

    @property
    def numel(self) -> sympy.Expr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)

    @property
    def nbytes(self) -> sympy.Expr:
        return sympy.expand(self.numel * _itemsize(self.dtype))

    def concrete_shape(self, b: int) -> tuple[int, ...]:
        # a rank allocates each received tensor at the same few sizes every step: remembered
        # beside the (frozen) fields, which alone compare and hash
        known: dict[int, tuple[int, ...]] = self.__dict__.setdefault("_concrete", {})
        shape = known.get(b)
        if shape is None:
            shape = known[b] = tuple(int(evaluate(d, b)) for d in self.shape)
        return shape

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclass(frozen=True)
class ScalarInfo:
    """A non-tensor value (int, SymInt, float, bool, None); `value` may depend on b."""

    value: Any


ValueInfo: TypeAlias = TensorInfo | ScalarInfo | tuple["ValueInfo", ...]


def leaves(info: ValueInfo) -> list[ValueInfo]:
    """The tensors and scalars of a value, tuples flattened in order (one message each)."""
    return [x for i in info for x in leaves(i)] if isinstance(info, tuple) else [info]


def differentiable(tensor: torch.Tensor) -> bool:
    """Whether autograd may track `tensor`: floating-point and complex dtypes, as is_float."""
    return tensor.is_floating_point() or tensor.is_complex()


def carries_grad(info: ValueInfo) -> bool:
    """Whether a value's leaf is a floating tensor that requires grad: its gradient crosses
    back to the stage that sent it."""
    return isinstance(info, TensorInfo) and info.is_float and info.requires_grad


@dataclass(frozen=True)
class ClassWork:
    """The part of a node's forward or backward done by one class of kernels (op classes in
    fxpipe.profile.device.OP_CLASSES: matmul, attention, ... element-wise), so that each class
    is timed at its own rate."""

    op_class: str
    backward: bool
    flops: sympy.Expr
    bytes: sympy.Expr
    kernels: int


@dataclass(frozen=True)
class Cost:
    """Per-node cost, every field a sympy polynomial in the micro-batch size b.

    fwd_flops / bwd_flops: floating-point operations of the forward and of its backward.
    param_bytes: bytes of parameters and buffers first used by this node (tied ones once);
    grad_param_bytes: the part that are parameters needing gradients; grad_param_elements
    their elements (the optimizer's state is counted per element: fxpipe.optimizers).
    output_bytes: bytes of the node's output. saved_bytes: bytes this node makes autograd keep
    until backward (its output if any consumer saves it, plus internal buffers it saves).
    fwd_bytes / bwd_bytes: memory traffic, the bandwidth side of the roofline.
    """

    fwd_flops: sympy.Expr
    bwd_flops: sympy.Expr
    param_bytes: sympy.Expr
    output_bytes: sympy.Expr
    saved_bytes: sympy.Expr
    fwd_bytes: sympy.Expr
    bwd_bytes: sympy.Expr
    grad_param_bytes: sympy.Expr = field(default=sympy.Integer(0))  # params that need grads
    grad_param_elements: sympy.Expr = field(default=sympy.Integer(0))
    grad_params: int = 0  # tensors among them (each micro-batch's gradient is added into one)
    fwd_kernels: int = 0  # aten kernels launched by the forward (per-kernel overhead)
    bwd_kernels: int = 0
    # What saved_bytes is made of, for per-stage accounting: bytes of buffers the node allocates
    # and keeps itself, and the outputs of other nodes it keeps alive (producer name, bytes).
    internal_saved_bytes: sympy.Expr = field(default=sympy.Integer(0))
    saves: tuple[tuple[str, sympy.Expr], ...] = ()
    # the forward draws random numbers (a kernel tagged nondeterministic_seeded)
    random: bool = False
    # the FLOPs, bytes and kernels above split by op class (forward and backward)
    work: tuple[ClassWork, ...] = ()

    def at(self, b: int) -> dict[str, float]:
        """The numeric fields evaluated at micro-batch size `b`."""
        return {name: evaluate(getattr(self, name), b) for name in self.__dataclass_fields__
                if name not in ("saves", "random", "work")}

@dataclass(frozen=True)
class MeasuredTime:
    """Wall time of a node measured on the device at micro-batch size `b` (seconds)."""

    fwd: float
    bwd: float
    b: int


@dataclass(frozen=True)
class CommInfo:
    """A send or recv node: what crosses a stage boundary, to or from which stage."""

    kind: str  # "send" | "recv" | "channel" (the stage's comm placeholder)
    peer: int  # the other stage
    tag: str  # the value's name, the same on both ends
    value: ValueInfo  # shape/dtype for a tensor, so buffers can be allocated up front
    # recv: the stage writes into the value in place (itself or through a view). A rank
    # receives into a leaf of the autograd graph, which autograd refuses to write into, so the
    # distributed receive hands the stage a copy (one process passes values in the graph).
    written: bool = False


@dataclass(frozen=True)
class GradMode:
    """`with torch.set_grad_enabled(enabled):` (torch.no_grad(), torch.enable_grad())."""

    enabled: bool


@dataclass(frozen=True)
class AutocastMode:
    """`with torch.autocast(device_type, dtype=..., enabled=..., cache_enabled=...):`."""

    device_type: str
    dtype: torch.dtype | None
    enabled: bool
    cache_enabled: bool | None


Mode: TypeAlias = tuple[GradMode | AutocastMode, ...]
"""The context managers a node of the model's forward runs under, outermost first; () for none."""


def mode(node: Node) -> Mode:
    """The grad mode and autocast regions a node runs in (none for most nodes)."""
    value: Mode = node.meta.get(MODE, ())
    return value


@contextlib.contextmanager
def entered(node: Node) -> Iterator[None]:
    """Runs the body in the node's regions, as the model's forward runs it (for passes that
    execute nodes one by one: shapes, costs, times)."""
    with contextlib.ExitStack() as stack:
        for m in mode(node):
            if isinstance(m, GradMode):
                stack.enter_context(torch.set_grad_enabled(m.enabled))
            else:
                stack.enter_context(torch.autocast(m.device_type, dtype=m.dtype,
                                                   enabled=m.enabled,
                                                   cache_enabled=m.cache_enabled))
        yield


def _meta(node: Node, key: str, run_first: str) -> Any:
    try:
        return node.meta[key]
    except KeyError:
        raise MissingMetaError(node, key, run_first=run_first) from None


def value_info(node: Node) -> ValueInfo:
    """What fxpipe.capture recorded about the node's value."""
    info: ValueInfo = _meta(node, TENSOR,
                            "fxpipe.capture (or fxpipe.frontend.shapes.propagate_shapes)")
    return info


def tensor_info(node: Node) -> TensorInfo:
    info = value_info(node)
    if not isinstance(info, TensorInfo):
        raise TypeError(f"node {node.name} does not produce a tensor ({info!r})")
    return info


def cost(node: Node) -> Cost:
    value: Cost = _meta(node, COST, "passes.cost.annotate_costs")
    return value


def measured_time(node: Node) -> MeasuredTime:
    value: MeasuredTime = _meta(node, TIME, "passes.timing.measure_times")
    return value


def stage(node: Node) -> int:
    value: int = _meta(node, STAGE, "passes.partition.partition")
    return value


def comm(node: Node) -> CommInfo:
    value: CommInfo = _meta(node, COMM, "passes.split.split_stages")
    return value


def is_inplace(node: Node) -> bool:
    """Whether the node writes into one of its inputs (relu_, add_, inplace=True ...)."""
    target = node.target
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        return str(target).endswith("_") and not str(target).endswith("__")
    if node.op != "call_function":
        return False
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return bool(schema.is_mutable)
    name = getattr(target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def is_comm(node: Node) -> bool:
    return COMM in node.meta


def compute_nodes(graph: Graph) -> list[Node]:
    """Nodes that do work: calls, in program order (no placeholders, attributes, outputs, comm)."""
    return [
        n for n in graph.nodes
        if n.op in ("call_function", "call_method", "call_module") and not is_comm(n)
    ]


def module_path(node: Node) -> str:
    """Qualified name of the innermost module the node came from ("" for the top level)."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    for key, path in reversed(list((stack or {}).items())):
        path = path[0] if isinstance(path, tuple) else path
        if not str(key).startswith("_empty") and not str(path).startswith("_empty"):
            return clean_module_path(str(path))
    return ""


def clean_module_path(path: str) -> str:
    # torch.export spells nested paths as "L['self'].layers[0]" in some versions; normalise.
    path = path.replace("L['self'].", "").replace("L['self']", "")
    out = []
    for part in path.replace("[", ".").replace("]", "").split("."):
        if part:
            out.append(part.strip("'\""))
    return ".".join(out)


_ABBR = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


def dtype_abbr(dtype: torch.dtype) -> str:
    return _ABBR.get(dtype, str(dtype).replace("torch.", ""))


def format_shape(info: ValueInfo) -> str:
    """FX-style annotation: "f32[b, 64]", "i64[2*b, 16]", "(f32[b, 8], f32[b, 8])", "int"."""
    if isinstance(info, TensorInfo):
        return f"{dtype_abbr(info.dtype)}[{', '.join(str(d) for d in info.shape)}]"
    if isinstance(info, tuple):
        return "(" + ", ".join(format_shape(i) for i in info) + ")"
    if isinstance(info, ScalarInfo):
        v = info.value
        if isinstance(v, sympy.Expr):
            return "int" if v.is_integer else "float"
        return type(v).__name__
    return type(info).__name__


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# --- invariants -------------------------------------------------------------------------------

def verify(gm: GraphModule, *, after: str) -> None:
    """Checks fxpipe's invariants for the passes run so far; raises once, listing every problem.

    after: "capture" | "cost" | "partition" | "split" | "remat".
    """
    problems: list[str] = []
    graph = gm.graph
    try:
        graph.lint()
    except Exception as e:  # noqa: BLE001 - lint raises plain RuntimeErrors
        problems.append(f"graph.lint failed: {e}")
    order = ("capture", "cost", "partition", "split", "remat")
    if after not in order:
        raise ValueError(f"unknown pass {after!r}; expected one of {order}")
    done = order[: order.index(after) + 1]
    for node in graph.nodes:
        if node.op in ("output",):
            continue
        if "capture" in done and TENSOR not in node.meta and node.op != "get_attr" \
                and not is_comm(node):
            problems.append(f"{node.name} ({node.op} {node.target}) has no {TENSOR}")
        if "cost" in done and node.op not in ("placeholder", "output", "get_attr") \
                and not is_comm(node) and COST not in node.meta:
            problems.append(f"{node.name} ({node.op} {node.target}) has no {COST}")
    if after in ("capture", "cost"):
        problems += list(_check_batch_symbol(gm))
    if "partition" in done and "split" not in done:
        problems += list(_check_stages(graph))
    if "split" in done or "remat" in done:
        problems += list(_check_stage_graph(graph))
    if "remat" in done:
        problems += list(_check_remat(graph))
    if problems:
        raise InvariantError(
            f"{len(problems)} invariant(s) broken after {after}:\n"
            + "\n".join(f"  - {p}" for p in problems),
            hint="this is a bug in the pass named above; please report it with the model",
        )


def _check_batch_symbol(gm: GraphModule) -> Iterator[str]:
    """Every output the model batches keeps the batch size b in its batch dimension: a size
    frozen at the example's batch would be wrong on every micro-batch."""
    signature = getattr(gm.meta.get(CAPTURE), "signature", None)
    batch_dims: tuple[int | None, ...] = getattr(signature, "out_batch_dims", ())
    output = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if output is None or not batch_dims:
        return
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    for value, dim in zip(values, batch_dims):
        info = value.meta.get(TENSOR) if isinstance(value, Node) else None
        if dim is None or not isinstance(info, TensorInfo) or dim >= len(info.shape):
            continue
        size = sympy.sympify(info.shape[dim])
        if BATCH not in size.free_symbols:
            yield (f"output {value.name} has the size {size} in its batch dimension {dim}, "
                   f"not one that follows the micro-batch size b")


def _check_stages(graph: Graph) -> Iterator[str]:
    """Every compute node has a stage and every edge goes forward (stage(u) <= stage(v)): the
    stages are contiguous intervals of a topological order, so no traffic flows backward."""
    for node in compute_nodes(graph):
        if STAGE not in node.meta:
            yield f"{node.name} ({node.op} {node.target}) has no stage"
            continue
        s = node.meta[STAGE]
        for user in node.users:
            if user.op != "output" and STAGE in user.meta and user.meta[STAGE] < s:
                yield (f"{node.name} (stage {s}) feeds {user.name} in earlier stage "
                       f"{user.meta[STAGE]}")


def _check_stage_graph(graph: Graph) -> Iterator[str]:
    """A stage graph: recvs read values, sends ship them, nothing else crosses."""
    sent: set[tuple[str, int]] = set()
    for node in graph.nodes:
        if is_comm(node):
            info = node.meta[COMM]
            if info.kind == "send":
                if (info.tag, info.peer) in sent:
                    yield f"value {info.tag} sent twice to stage {info.peer}"
                sent.add((info.tag, info.peer))
                if not node.args or not isinstance(node.args[0], Node):
                    yield f"send {node.name} carries no value"
            elif info.kind not in ("recv", "channel"):
                yield f"{node.name} has unknown comm kind {info.kind!r}"


def _check_remat(graph: Graph) -> Iterable[str]:
    regions: dict[str, list[Node]] = {}
    for node in graph.nodes:
        region = node.meta.get(REMAT)
        if region is not None:
            regions.setdefault(region, []).append(node)
            if is_comm(node):
                yield f"remat region {region} contains communication node {node.name}"
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    for region, members in regions.items():
        span = range(index[members[0]], index[members[-1]] + 1)
        inside = [nodes[i] for i in span if nodes[i].op in ("call_function", "call_method",
                                                             "call_module")]
        if len(inside) != len(members):
            yield f"remat region {region} is not contiguous"

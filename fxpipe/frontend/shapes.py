"""Symbolic shape propagation: every value's shape as a polynomial in the batch size b.

Writes TENSOR (ir.TensorInfo / ir.ScalarInfo / tuple) on every node by running the graph on fake
tensors whose batch dimension is one symbolic size, and GraphModule.meta[SAMPLED]: the operations
run on static sizes instead. torch.fx's own "val" key is left alone.

NOTE [Specialising kernels]: some fake kernels (constant padding, interpolation, im2col, GRU)
turn the symbolic batch into the example's integer: the ShapeEnv records a replacement b -> 4,
nothing raises, and every later size is the constant 4, so a size computed in one stage would be
frozen at the full batch in the next. After each node the batch symbol is checked; when an
operation specialised it, propagation starts again with that operation run on static fakes at a
few batch sizes and its output sizes interpolated (a ShapeEnv cannot be rolled back).

A stamped graph (fxpipe.frontend.stamp) runs its blocks 1 and 2 only: when every value of block
2 has the shape, strides, dtype and flags of its counterpart in block 1, block 3 reads what block
2 read, so it computes what block 2 computed, and so on down the list; the copies take block 2's
values. Anything else (a block that changes its input's shape) runs every block. A block's
parameters laid out as their twins in block 2 take their twins' fakes (one conversion each).
"""
from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Iterator, Sequence
from typing import Any, TypeAlias

import sympy  # type: ignore[import-untyped]  # sympy ships no type annotations
import torch
import torch.utils._pytree as pytree
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from fxpipe import ir, source
from fxpipe.errors import CaptureError
from fxpipe.frontend.stamp import BLOCKS, StampedBlocks

__all__ = ["propagate_shapes", "symbolic_inputs", "op_key", "specialised", "OpKey",
           "Specialised", "known_specialising", "SAMPLE_SIZES", "plain_containers",
           "export_infos", "write_infos", "known_sampled", "interpolate", "fit_line",
           "quiet_fake_tensor_log"]

OpKey: TypeAlias = object
"""What identifies an operation across nodes: a function or aten overload, ("method", name), or
the type of a called module."""


def op_key(module: torch.nn.Module, n: Node) -> OpKey:
    """The operation a node runs, independent of its inputs."""
    if n.op == "call_module":
        return type(module.get_submodule(str(n.target)))
    if n.op == "call_method":
        return ("method", str(n.target))
    return n.target


# Operations whose fake kernels specialise the batch symbol (checked on torch 2.13 and 2.14);
# starting with them routed to static samples saves a restart each. Others are found as they
# occur.
_SPECIALISING_FUNCTIONS = frozenset({
    torch.nn.functional.pad, torch.nn.functional.interpolate, torch.nn.functional.unfold,
    torch.nn.functional.fold, torch.nn.functional.upsample, torch.nn.functional.upsample_nearest,
    torch.nn.functional.upsample_bilinear})
_SPECIALISING_ATEN = ("pad", "constant_pad_nd", "upsample_", "_upsample_", "im2col", "col2im",
                      "gru", "rnn_tanh", "rnn_relu")
_SPECIALISING_MODULES = (torch.nn.modules.padding._ConstantPadNd, torch.nn.Upsample,
                         torch.nn.Unfold, torch.nn.Fold, torch.nn.GRU, torch.nn.RNN)


def known_specialising(key: OpKey) -> bool:
    """Whether an operation is known to specialise the batch symbol on fake tensors."""
    if isinstance(key, type):
        return issubclass(key, _SPECIALISING_MODULES)
    if isinstance(key, torch._ops.OpOverload):
        name = key._overloadpacket.__name__
        return any(name == m or (m.endswith("_") and name.startswith(m))
                   for m in _SPECIALISING_ATEN)
    try:
        return key in _SPECIALISING_FUNCTIONS
    except TypeError:  # an unhashable target is no known function
        return False


def specialised(shape_env: ShapeEnv, sym: sympy.Symbol) -> bool:
    """Whether the batch symbol was fixed to a constant (a kernel guarded on its value)."""
    if sym in shape_env.replacements:
        return True
    bounds = shape_env.var_to_range.get(sym)
    return bounds is not None and bounds.is_singleton()


class Specialised(Exception):  # noqa: N818 - a signal to restart, not an error
    """An operation specialised the batch symbol; the pass restarts with it sampled."""

    def __init__(self, node: Node, key: OpKey) -> None:
        super().__init__(f"{node.name} ({node.op} {node.target}) specialises the batch size")
        self.node = node
        self.key = key


class _FakeInterpreter(Interpreter):
    """Runs the graph under a fake mode, with parameters and buffers converted to fakes once.

    Ops without symbolic-shape support (e.g. aten.lstm on CPU) are run on static fakes at three
    batch sizes and their output shapes interpolated: exact for shapes polynomial in b.
    """

    def __init__(self, gm: GraphModule, mode: FakeTensorMode, sym: sympy.Symbol,
                 sampled: set[OpKey]) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.sampled = sampled
        if mode.shape_env is None:
            raise ValueError("shape propagation needs a FakeTensorMode with a ShapeEnv")
        self.mode = mode
        self.shape_env: ShapeEnv = mode.shape_env
        self.sym = sym
        self.values: dict[Node, Any] = {}
        self._fakes: dict[int, torch.Tensor] = {}
        # each operation of a stamped block 3..N-1 -> (its twin in block 2, the list)
        self._twins: dict[Node, tuple[Node, StampedBlocks]] = {
            copy: (twin, run) for run in gm.meta.get(BLOCKS, ()) for block in run.blocks[2:]
            for copy, twin in zip(block, run.blocks[1])
            if copy.op.startswith("call_") or copy.op == "get_attr"}
        self._repeating: dict[str, bool] = {}
        self.copied: dict[Node, Node] = {}  # a node whose value is its twin's -> the twin

    def _fake(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not isinstance(t, torch._subclasses.FakeTensor):
            key = id(t)
            if key not in self._fakes:
                fake = self.mode.from_tensor(t, static_shapes=True)
                self._fakes[key] = fake
            return self._fakes[key]
        return t

    def fetch_attr(self, target: str) -> Any:
        return self._fake(super().fetch_attr(target))

    def fetch_args_kwargs_from_env(self, n: Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return plain_containers(args), plain_containers(kwargs)

    def run_node(self, n: Node) -> Any:
        twin = self._twins.get(n)
        if twin is not None and (self._alike_attribute(n, twin[0]) if n.op == "get_attr"
                                 else self._repeats(twin[1])):
            self.copied[n] = twin[0]
            result = self.values[n] = self.values[twin[0]]
            return result
        key = op_key(self.module, n) if n.op.startswith("call_") else None
        try:
            if key is not None and key in self.sampled:
                result = self._interpolated(n)
            else:
                with ir.entered(n):
                    result = super().run_node(n)
                if key is not None and specialised(self.shape_env, self.sym):
                    raise Specialised(n, key)
        except Specialised:
            raise
        except Exception as e:  # noqa: BLE001 - retried on static shapes, then re-raised
            # A kernel may specialise the batch symbol and then fail (F.fold's col2im): the
            # static samples give its shapes, but every later size would be frozen.
            if key is not None and specialised(self.shape_env, self.sym):
                raise Specialised(n, key) from e
            try:
                result = self._interpolated(n)
            except Exception:  # noqa: BLE001 - report the symbolic failure, it names the op
                where = source.from_stack_trace(n.meta.get("stack_trace"))
                raise CaptureError(
                    f"cannot propagate shapes through {n.name} ({n.op} {n.target}): "
                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
                    + (f"\n  at {where}" if where else ""),
                    hint="this operation needs concrete values; mark the module that contains "
                         "it as a leaf (leaf_modules=...) or rewrite it without data-dependent "
                         "shapes",
                ) from e
        self.values[n] = result
        return result

    def _alike_attribute(self, n: Node, twin: Node) -> bool:
        """Whether a parameter or buffer of a stamped block is laid out as its twin's in
        block 2, which then stands for it (its fake is made once)."""
        if twin not in self.values:
            return False
        mine, theirs = super().fetch_attr(str(n.target)), super().fetch_attr(str(twin.target))
        return isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and \
            type(mine) is type(theirs) and _layout_of(mine) == _layout_of(theirs)

    def _repeats(self, run: StampedBlocks) -> bool:
        """Whether block 2 of `run` maps values like block 1's to values like them (then
        every later block computes what block 2 computed)."""
        if run.path not in self._repeating:
            one, two = run.blocks[0], run.blocks[1]
            self._repeating[run.path] = all(
                a in self.values and b in self.values and
                _layout_of(self.values[a]) == _layout_of(self.values[b])
                for a, b in zip(one, two))
        return self._repeating[run.path]

    def _interpolated(self, n: Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        samples: dict[int, Any] = {}
        for b in SAMPLE_SIZES:
            static = FakeTensorMode(allow_non_fake_inputs=True)
            a, k = at_size((args, kwargs), self.sym, b, static)
            with static:
                samples[b] = call_node(self.module, n, a, k)
        return symbolic_like(samples, self.shape_env, self.sym)


def _layout_of(value: Any) -> object:
    """What a value's shape propagation depends on, comparable between values: each tensor's
    sizes, strides, dtype, device and flags; numbers and symbols as such. Another kind of value
    compares unequal to everything (its blocks then all run)."""
    def one(x: Any) -> object:
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(map(_symbolic, x.shape)), tuple(map(_symbolic, x.stride())),
                    x.dtype, x.device, x.requires_grad, x.is_leaf)
        if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
            return ("symbol", _symbolic(x))
        if x is None or isinstance(x, bool | int | float | str | torch.dtype | torch.device):
            return ("value", type(x), x)
        return object()

    leaves, spec = pytree.tree_flatten(value)
    return (str(spec), tuple(one(x) for x in leaves))


def _symbolic(value: Any) -> Any:
    return value.node.expr if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool) \
        else value


@contextlib.contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """Keeps torch's fake-tensor log quiet while operations run on symbolic shapes: an
    operation whose meta kernel cannot take a symbolic size (baddbmm's broadcast bias in
    nn.MultiheadAttention with a padding mask) logs a traceback at ERROR level before torch
    falls back to another way of running it, which succeeds; one that fails raises."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def call_node(module: torch.nn.Module, n: Node, args: Sequence[Any],
              kwargs: dict[str, Any]) -> Any:
    """Runs one node's operation on the given values, in its grad-mode and autocast regions;
    its lists and dicts are plain ones (plain_containers)."""
    args, kwargs = plain_containers(tuple(args)), plain_containers(kwargs)
    target = n.target
    with ir.entered(n):
        if n.op == "call_module":
            return module.get_submodule(str(target))(*args, **kwargs)
        if n.op == "call_method":
            obj, *rest = args
            return getattr(obj, str(target))(*rest, **kwargs)
        if isinstance(target, str):  # only modules and methods are named by a string
            raise TypeError(f"{n.op} node {n.name} has the target {target!r}, "
                            "which is not callable")
        return target(*args, **kwargs)


def plain_containers(values: Any) -> Any:
    """`values` with fx's immutable lists and dicts, which an Interpreter passes, made plain
    ones, as the generated code passes them: a wrapped function may write into a list it is
    given (torchvision's `_get_window_and_shift_size` adapts a window to the input's size)."""
    if isinstance(values, list):  # fx's immutable_list is a list
        return [plain_containers(v) for v in values]
    if isinstance(values, dict):
        return {k: plain_containers(v) for k, v in values.items()}
    if type(values) is tuple:  # not torch.Size or a named tuple
        return tuple(plain_containers(v) for v in values)
    return values


def at_size(values: Any, sym: sympy.Symbol, b: int, static: FakeTensorMode) -> Any:
    """Static fake copies of (symbolic) values with the batch symbol set to `b`."""

    def concrete(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            shape = [int(ir.evaluate(_expr(d, {sym: ir.BATCH}), b)) for d in x.shape]
            with static:
                t = torch.empty(shape, dtype=x.dtype, device=x.device)
            return t.requires_grad_(x.requires_grad) if ir.differentiable(x) else t
        if isinstance(x, torch.SymInt):
            return int(ir.evaluate(_expr(x, {sym: ir.BATCH}), b))
        return x

    return torch.utils._pytree.tree_map(concrete, values)


def symbolic_like(samples: dict[int, Any], shape_env: ShapeEnv, sym: sympy.Symbol) -> Any:
    """A symbolic fake value whose sizes interpolate the static `samples` (keyed by b)."""
    sizes = sorted(samples)
    first = samples[sizes[0]]
    if isinstance(first, torch.Tensor):
        shape = [_symint(interpolate([(b, samples[b].shape[d]) for b in sizes]), shape_env, sym)
                 for d in range(first.dim())]
        out = torch.empty(shape, dtype=first.dtype, device=first.device)
        return out.requires_grad_(first.requires_grad) if ir.differentiable(first) else out
    if isinstance(first, (tuple, list)):
        return type(first)(symbolic_like({b: s[i] for b, s in samples.items()}, shape_env, sym)
                           for i in range(len(first)))
    if isinstance(first, int) and not isinstance(first, bool):
        return _symint(interpolate([(b, samples[b]) for b in sizes]), shape_env, sym)
    return first


def _symint(expr: sympy.Expr, shape_env: ShapeEnv, sym: sympy.Symbol) -> int | torch.SymInt:
    if not expr.free_symbols:
        return int(expr)
    hint = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val
    value = int(expr.subs(ir.BATCH, int(hint[sym])))
    return shape_env.create_symintnode(expr.xreplace({ir.BATCH: sym}), hint=value)


SAMPLE_SIZES = (2, 3, 5)


def interpolate(points: list[tuple[int, int | float]]) -> sympy.Expr:
    """The polynomial in b (degree < len(points)) through `points`: exact for polynomial sizes."""
    return sympy.expand(sympy.interpolate([(b, sympy.nsimplify(v)) for b, v in points], ir.BATCH))


def fit_line(points: list[tuple[int, int | float]]) -> sympy.Expr:
    """The least-squares line in b through `points`, exact in rationals. For sizes measured on
    real runs, which are near linear but not polynomial: a recurrent layer's workspace is padded
    to blocks of the batch, and the polynomial through three such points bends, negative beyond
    a few dozen samples."""
    n = len(points)
    xs = [sympy.Integer(b) for b, _ in points]
    ys = [sympy.nsimplify(v) for _, v in points]
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0
    return sympy.expand(slope * ir.BATCH + mean_y - slope * mean_x)


def symbolic_inputs(
    mode: FakeTensorMode, batch_symbol: int | torch.SymInt, tensors: Sequence[torch.Tensor],
    batch_dims: Sequence[int | None],
) -> list[torch.Tensor]:
    """Fake copies of `tensors` whose batch dimension is the one symbolic size."""
    fakes: list[torch.Tensor] = []
    with mode:
        for t, bd in zip(tensors, batch_dims):
            shape = [batch_symbol if d == bd else s for d, s in enumerate(t.shape)]
            fake = torch.empty(shape, dtype=t.dtype, device=t.device)
            if t.requires_grad:
                fake.requires_grad_(True)
            fakes.append(fake)
    return fakes


def known_sampled(gm: GraphModule) -> set[OpKey]:
    """The graph's operations known to specialise the batch symbol (run on static samples)."""
    return {k for n in gm.graph.nodes if n.op.startswith("call_")
            for k in [op_key(gm, n)] if known_specialising(k)}


def propagate_shapes(gm: GraphModule, tensors: Sequence[torch.Tensor],
                     batch_dims: Sequence[int | None]) -> dict[Node, Any]:
    """Writes ir.TENSOR on every node and gm.meta[ir.SAMPLED]; returns the fake value of each
    node. See NOTE [Specialising kernels]."""
    sampled = known_sampled(gm)
    while True:
        try:
            with quiet_fake_tensor_log():
                values = _propagate(gm, tensors, batch_dims, sampled)
            break
        except Specialised as e:
            if e.key in sampled:  # cannot happen: sampled operations run on static fakes
                raise CaptureError(f"{e}, even on static sizes",
                                   hint="please report this model") from e
            sampled.add(e.key)
    gm.meta[ir.SAMPLED] = frozenset(sampled)
    return values


def _propagate(gm: GraphModule, tensors: Sequence[torch.Tensor],
               batch_dims: Sequence[int | None], sampled: set[OpKey]) -> dict[Node, Any]:
    batch = next(t.shape[d] for t, d in zip(tensors, batch_dims) if d is not None)
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    sym = shape_env.create_symbol(batch, source=ConstantSource("fxpipe_batch"),
                                  dynamic_dim=DimDynamic.DYNAMIC)
    batch_symbol = shape_env.create_symintnode(sym, hint=batch)
    fakes = symbolic_inputs(mode, batch_symbol, tensors, batch_dims)
    interp = _FakeInterpreter(gm, mode, sym, sampled)
    with mode:
        interp.run(*fakes, enable_io_processing=False)
    substitution = {sym: ir.BATCH}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        twin = interp.copied.get(node)
        node.meta[ir.TENSOR] = twin.meta[ir.TENSOR] if twin is not None else \
            _info(interp.values.get(node), substitution)
    return interp.values


def export_infos(gm: GraphModule,
                 batch_dims: Sequence[int | None]) -> dict[Node, ir.ValueInfo] | None:
    """Every node's ir.TENSOR from the fake values torch.export recorded (node.meta["val"]), so
    that an exported graph need not run again; None where they do not determine it: a value
    missing, a batch that is not one symbol shared by the inputs, or another symbol.

    "val" is detached (requires_grad False); the flag comes from "tensor_meta", recorded before
    detaching, and for the items of a tuple from the getitem nodes that read them."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) != len(batch_dims):
        return None
    symbols = {_batch_symbol(n.meta.get("val"), d) for n, d in zip(inputs, batch_dims)
               if d is not None}
    sym = symbols.pop() if len(symbols) == 1 else None
    if sym is None:
        return None
    substitution = {sym: ir.BATCH}
    infos: dict[Node, ir.ValueInfo] = {}
    # a stamped block's nodes share their twin's value (fxpipe.frontend.stamp): one info each
    made: dict[tuple[int, tuple[bool, ...]], ir.ValueInfo] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if "val" not in node.meta:
            return None
        grads = _recorded_grads(node)
        if grads is None:
            return None
        key = (id(node.meta["val"]), tuple(grads))
        info = made.get(key)
        if info is None:
            info = _info(node.meta["val"], substitution, grads)
            if not _symbols(info) <= {ir.BATCH}:
                return None
            made[key] = info
        infos[node] = info
    return infos


def write_infos(gm: GraphModule, infos: dict[Node, ir.ValueInfo], sampled: set[OpKey]) -> None:
    """Writes ir.TENSOR and gm.meta[ir.SAMPLED] as propagate_shapes does."""
    for node, info in infos.items():
        node.meta[ir.TENSOR] = info
    gm.meta[ir.SAMPLED] = frozenset(sampled)


def _batch_symbol(value: Any, dim: int) -> sympy.Symbol | None:
    if not isinstance(value, torch.Tensor) or dim >= value.dim():
        return None
    size = value.shape[dim]
    if not isinstance(size, torch.SymInt) or not isinstance(size.node.expr, sympy.Symbol):
        return None
    return size.node.expr


def _recorded_grads(node: Node) -> list[bool] | None:
    """requires_grad of each tensor in the node's value, in order; None if one is unknown."""
    value = node.meta["val"]
    if isinstance(value, torch.Tensor):
        if node.op in ("placeholder", "get_attr"):  # their values keep the flag
            return [bool(value.requires_grad)]
        flag = getattr(node.meta.get("tensor_meta"), "requires_grad", None)
        return None if flag is None else [bool(flag)]
    if not isinstance(value, (tuple, list)):
        return []
    if any(isinstance(v, (tuple, list)) for v in value):
        return None
    read = {user.args[1]: getattr(user.meta.get("tensor_meta"), "requires_grad", None)
            for user in node.users if user.target is operator.getitem}
    flags = [read.get(i) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return None if None in flags else [bool(f) for f in flags]


def _symbols(info: ir.ValueInfo) -> set[sympy.Symbol]:
    if isinstance(info, tuple):
        return set().union(*(_symbols(i) for i in info)) if info else set()
    values = info.shape if isinstance(info, ir.TensorInfo) else (info.value,)
    return {s for v in values if isinstance(v, sympy.Basic) for s in v.free_symbols}


def _expr(value: Any, substitution: dict[sympy.Symbol, sympy.Symbol]) -> Any:
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return sympy.sympify(value.node.expr).xreplace(substitution)
    return value


def _info(value: Any, substitution: dict[sympy.Symbol, sympy.Symbol],
          grads: list[bool] | None = None) -> ir.ValueInfo:
    """`grads`, when given, are the requires_grad flags of the tensors in `value`, in order."""
    if isinstance(value, torch.Tensor):
        shape = tuple(sympy.sympify(_expr(d, substitution)) for d in value.shape)
        batch_dim = next((i for i, d in enumerate(shape) if ir.BATCH in d.free_symbols), None)
        flag = grads.pop(0) if grads else bool(value.requires_grad)
        return ir.TensorInfo(shape, value.dtype, batch_dim, flag)
    if isinstance(value, torch.Size):
        return tuple(ir.ScalarInfo(_expr(d, substitution)) for d in value)
    if isinstance(value, (tuple, list)):
        return tuple(_info(v, substitution, grads) for v in value)
    return ir.ScalarInfo(_expr(value, substitution))

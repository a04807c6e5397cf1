"""Per-node costs as exact polynomials in the micro-batch size b.

Reads:  TENSOR on placeholders (fxpipe.capture)
Writes: COST on every compute node
Graph:  unchanged (annotation only)

Each node runs once on fake tensors whose batch dimension is a symbol, under a dispatch mode that
sees every aten kernel of its forward and of its backward (autograd.grad of the node alone):
matmul, convolution and attention FLOPs come from torch's FLOP formulas (plus CPU flash
attention, which torch's counter reports as 0); every other kernel costs its elements times a
per-op factor, and its bytes read and written. Saved-for-backward bytes come from autograd's
saved-tensor hooks and are charged to the node whose output they keep alive, once per storage,
so their sum is what a real run keeps. Identical nodes (the blocks of a transformer) are
annotated once and the result reused, their output included. A graph stamped from one block
(fxpipe.frontend.stamp) is run through its first four blocks, its last and what follows; the
blocks between take block 2's costs (fxpipe/passes/cost_handover.py). Operations whose fake
kernels specialise the batch symbol (see NOTE [Specialising kernels] in fxpipe.frontend.shapes) are
costed on static samples and interpolated, so every cost stays a polynomial in b.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import sympy  # type: ignore[import-untyped]  # sympy ships no type annotations
import torch
import torch.utils._pytree as pytree
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.experimental.symbolic_shapes import DimDynamic, GuardOnDataDependentSymNode, ShapeEnv
from torch.fx.node import Argument, Target

from fxpipe import ir, source
from fxpipe.errors import CostError
from fxpipe.frontend import shapes
from fxpipe.passes.cost_handover import Handover
from fxpipe.profile.kernels import ELEMENTWISE_FACTOR, Count, KernelCounter

__all__ = ["annotate_costs", "CostSummary", "ELEMENTWISE_FACTOR", "writes_into_leaf"]

_Count: TypeAlias = Count
_Saved: TypeAlias = tuple[Literal["arg", "out", "new"], int, sympy.Expr | None]
"""("arg", flat index, None) | ("out", output index, None) | ("new", -1, nbytes)."""
_Work: TypeAlias = dict[str, tuple[sympy.Expr, sympy.Expr, int]]
"""op class -> (FLOPs, bytes, kernels) of one pass (forward or backward) of a node."""


@dataclass
class _NodeCost:
    fwd_flops: sympy.Expr
    bwd_flops: sympy.Expr
    fwd_bytes: sympy.Expr
    bwd_bytes: sympy.Expr
    fwd_kernels: int
    bwd_kernels: int
    saved: list[_Saved]  # ("arg", flat index, _) | ("out", index, _) | ("new", _, nbytes)
    random: bool = False
    fwd_work: _Work = field(default_factory=dict)
    bwd_work: _Work = field(default_factory=dict)


@dataclass
class CostSummary:
    """Totals over the graph, as polynomials in b."""

    nodes: int
    fwd_flops: sympy.Expr
    bwd_flops: sympy.Expr
    param_bytes: sympy.Expr
    saved_bytes: sympy.Expr
    cache_hits: int = 0
    by_node: dict[str, ir.Cost] = field(default_factory=dict)
    handed_over: int = 0  # nodes of stamped blocks given block 2's costs, not run


def annotate_costs(gm: GraphModule, *, batch_hint: int | None = None) -> CostSummary:
    """Writes ir.COST on every compute node of `gm` (needs ir.TENSOR on its placeholders).

    Returns totals; `ir.cost(node).at(b)` evaluates one node at a micro-batch size.
    """
    hint = batch_hint or getattr(gm.meta.get(ir.CAPTURE), "batch_size", None) or 8
    sampled: set[shapes.OpKey] = set(gm.meta.get(ir.SAMPLED, ()))
    while True:
        runner = _CostRunner(gm, hint, sampled)
        try:
            with shapes.quiet_fake_tensor_log():
                runner.run_all()
            return runner.summary()
        except shapes.Specialised as e:  # costed again, with that operation sampled
            if e.key in sampled:
                raise CostError(f"{e}, even on static sizes",
                                hint="please report this model") from e
            sampled.add(e.key)


_VALUE_READS = ("item", "tolist", "nonzero", "_local_scalar_dense")


def _data_dependent(n: Node) -> CostError:
    """The error for a node that depends on a tensor's values (`.item()` upstream): costs are
    computed on shapes alone, without values."""
    seen: set[Node] = set()
    todo = [n]
    read: Node | None = None
    while todo and read is None:
        node = todo.pop()
        seen.add(node)
        if getattr(node.target, "__name__", node.target) in _VALUE_READS or \
                str(node.target).split(".")[-1].split("(")[0] in _VALUE_READS:
            read = node
        todo += [m for m in node.all_input_nodes if m not in seen]
    culprit = read or n
    where = source.from_stack_trace(culprit.meta.get("stack_trace"))
    return CostError(
        f"{culprit.name} ({culprit.op} {culprit.target}) reads a tensor's value into Python"
        + (f" at {where}" if where else "") + f", and {n.name} depends on it: costs are computed "
        "from shapes alone, without values, so a value read inside forward cannot be costed",
        hint="keep the value a tensor (e.g. x * w.sum() instead of x * w.sum().item()), or "
             "compute it outside forward and pass it in as an input")


@dataclass
class _Cached:
    """A node's cost and its output, reused for identical nodes; an output that aliases an
    input (a view, an in-place op) is computed again so that storages stay shared."""

    cost: _NodeCost
    out: Any
    aliases_input: bool


class _CostRunner(Interpreter):
    def __init__(self, gm: GraphModule, hint: int, sampled: set[shapes.OpKey]) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.gm = gm
        self.sampled = sampled
        self.shape_env = ShapeEnv()
        self.mode = FakeTensorMode(shape_env=self.shape_env, allow_non_fake_inputs=True)
        self.sym = self.shape_env.create_symbol(hint, source=ConstantSource("fxpipe_b"),
                                                dynamic_dim=DimDynamic.DYNAMIC)
        self.hint = hint
        self.fakes: dict[int, torch.Tensor] = {}
        self.param_keys: set[int] = set()
        self.seen_params: set[int] = set()
        self.owner: dict[int, tuple[Node, _Count]] = {}  # storage -> (allocating node, nbytes)
        self.kept: set[int] = set()  # storages some node saves for backward
        self.internal: dict[Node, list[sympy.Expr]] = {}
        # saver -> {producer: bytes} it keeps alive
        self.saves: dict[Node, dict[str, sympy.Expr]] = {}
        self.raw: dict[Node, _NodeCost] = {}
        self.cache: dict[tuple[Hashable, ...], _Cached] = {}
        self.cache_hits = 0
        self.handover = Handover.of(gm)
        # Fake inputs live beside the parameters. A model built on the meta device is costed as
        # on the CPU: on meta, attention dispatches to its math kernel, which keeps the whole
        # attention matrix for backward, so the plan would differ from the one with weights.
        device = _state_device(gm)
        self.device = torch.device("cpu") if device.type == "meta" else device
        self._meta_params = device.type == "meta"

    # -- values ---------------------------------------------------------------------------------

    def _expr(self, x: _Count) -> sympy.Expr:
        if isinstance(x, torch.SymInt):
            return sympy.sympify(x.node.expr).xreplace({self.sym: ir.BATCH})
        return sympy.Integer(int(x))

    def _symint(self, expr: sympy.Expr) -> _Count:
        if not expr.free_symbols:
            return int(expr)
        return self.shape_env.create_symintnode(expr.xreplace({ir.BATCH: self.sym}),
                                                hint=int(expr.subs(ir.BATCH, self.hint)))

    def placeholder(self, target: Target, args: tuple[Argument, ...],
                    kwargs: dict[str, Any]) -> Any:
        info = ir.value_info(self._current)
        if not isinstance(info, ir.TensorInfo):
            raise CostError(f"input {self._current.name} is not a tensor ({info})",
                            hint="capture the model with fxpipe.capture first")
        with self.mode:
            t = torch.empty([self._symint(d) for d in info.shape], dtype=info.dtype,
                            device=self.device)
        return t.requires_grad_(info.requires_grad) if info.is_float else t

    def get_attr(self, target: Target, args: tuple[Argument, ...], kwargs: dict[str, Any]) -> Any:
        real = super().get_attr(target, args, kwargs)
        if not isinstance(real, torch.Tensor):
            return real
        if id(real) not in self.fakes and real.is_meta:  # no data: a fake on self.device
            with self.mode:
                fake = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype,
                                           device=self.device)
            self.fakes[id(real)] = fake.requires_grad_(real.requires_grad)
        if id(real) not in self.fakes:
            self.fakes[id(real)] = self.mode.from_tensor(real, static_shapes=True)
        fake = self.fakes[id(real)]
        self.param_keys.add(_storage(fake))
        return fake

    def run_all(self) -> None:
        skipped = self.handover.alias if self.handover else {}
        with self.mode:
            for node in self.gm.graph.nodes:
                if node in skipped:  # a stamped block costed as block 2: its values as block 3's
                    self.env[node] = self.env[skipped[node]]
                    continue
                self._current = node
                self.env[node] = self.run_node(node)
                if node.op in ("placeholder", "get_attr"):
                    self._record_outputs(node, self.env[node])

    # -- per node -------------------------------------------------------------------------------

    def run_node(self, n: Node) -> Any:
        if n.op in ("placeholder", "get_attr", "output"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if self._meta_params:  # a meta model's graph may name the meta device: cost on ours
            args, kwargs = pytree.tree_map(self._on_device, (args, kwargs))
        try:
            out, cost = self._measure(n, args, kwargs)
        except shapes.Specialised:
            raise
        except GuardOnDataDependentSymNode as e:
            raise _data_dependent(n) from e
        except Exception as e:  # noqa: BLE001 - name the node, keep the cause
            where = source.from_stack_trace(n.meta.get("stack_trace"))
            raise CostError(f"cannot cost {n.name} ({n.op} {n.target}): {type(e).__name__}: {e}"
                            + (f"\n  at {where}" if where else ""),
                            hint="mark the module as a leaf or report the operation") from e
        self.raw[n] = cost
        flat_in = [a for a in pytree.tree_leaves((args, kwargs))]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        for kind, index, nbytes in cost.saved:
            if kind == "arg":
                self._keep(_storage(flat_in[index]), n)
            elif kind == "out":
                self._keep(_storage(outs[index]), n, out=outs[index])
            else:
                self.internal.setdefault(n, []).append(nbytes)
        self._record_outputs(n, out)
        return out

    def _on_device(self, x: Any) -> Any:
        return self.device if isinstance(x, torch.device) and x.type == "meta" else x

    def _record_outputs(self, n: Node, out: Any) -> None:
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = _storage(t)
                if key not in self.owner:
                    self.owner[key] = (n, t.untyped_storage().nbytes())

    def _keep(self, key: int, by: Node, out: torch.Tensor | None = None) -> None:
        """Records that `by` saves storage `key`; `out` is given when it is `by`'s own output."""
        if key in self.param_keys:
            return
        if out is not None and key not in self.owner:
            self.owner[key] = (by, out.untyped_storage().nbytes())
        owner = self.owner.get(key)
        if owner is None or owner[0].op == "get_attr":
            return
        if owner[0].op not in ("placeholder", "get_attr") and owner[0] is not by:
            self.saves.setdefault(by, {})[owner[0].name] = self._expr(owner[1])
        if key in self.kept:
            return
        self.kept.add(key)
        if owner[0].op == "placeholder":  # a model input kept alive: charge its first saver
            self.internal.setdefault(by, []).append(self._expr(owner[1]))

    def _measure(self, n: Node, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[Any, _NodeCost]:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = self._cache_key(n, leaves)
        if key is not None and key in self.cache:
            self.cache_hits += 1
            hit = self.cache[key]
            if not hit.aliases_input:
                return pytree.tree_map(_fresh_like, hit.out), hit.cost
            # A view is taken of the inputs themselves: its output needs their storage and
            # grad flag, not a history of its own (detaching every input cost more than the view)
            call = _writable([_fresh_leaf(x) for x in leaves]) if ir.is_inplace(n) else leaves
            return shapes.call_node(self.module, n, *pytree.tree_unflatten(call, spec)), hit.cost
        op = shapes.op_key(self.module, n)
        if _needs_real_samples(n) and not self._meta_params:  # no data on meta: fakes
            out, cost = self._interpolated(n, args, kwargs, real=True)
        elif op in self.sampled:
            out, cost = self._interpolated(n, args, kwargs)
        else:
            try:
                out, cost = self._run_counted(n, leaves, spec, self.param_keys)
            except Exception:  # noqa: BLE001 - ops without symbolic shapes: sample, interpolate
                out, cost = self._interpolated(n, args, kwargs)
            if shapes.specialised(self.shape_env, self.sym):
                raise shapes.Specialised(n, op)
        if key is not None:
            inputs = {_storage(t) for t in leaves if isinstance(t, torch.Tensor)}
            aliases = any(_storage(t) in inputs for t in pytree.tree_leaves(out)
                          if isinstance(t, torch.Tensor))
            self.cache[key] = _Cached(cost, out, aliases)
        return out, cost

    def _run_counted(self, n: Node, leaves: list[Any], spec: pytree.TreeSpec,
                     params: set[int]) -> tuple[Any, _NodeCost]:
        """Runs the node once, counting its forward and backward kernels and saved tensors."""
        try:
            return self._run_counted_on(n, leaves, spec, params, copy_inputs=ir.is_inplace(n))
        except RuntimeError as e:
            if not writes_into_leaf(e):
                raise
            # A function or module that writes into an input it was given (torchvision's MViT
            # adds its relative position bias with `attn[:, :, 1:, 1:] += ...`): it writes
            # into copies, like an in-place operation.
            return self._run_counted_on(n, leaves, spec, params, copy_inputs=True)

    def _run_counted_on(self, n: Node, leaves: list[Any], spec: pytree.TreeSpec,
                        params: set[int], copy_inputs: bool) -> tuple[Any, _NodeCost]:
        fresh = [_fresh_leaf(x) for x in leaves]
        call = _writable(fresh) if copy_inputs else fresh  # written into: copies of the leaves
        a, k = pytree.tree_unflatten(call, spec)
        copies = {_storage(c): i for i, (c, f) in enumerate(zip(call, fresh))
                  if isinstance(c, torch.Tensor) and c is not f}
        saved_keys: list[tuple[int, _Count]] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved_keys.append((_storage(t), t.untyped_storage().nbytes()))
            return t

        module_state: dict[str, torch.Tensor] = {}
        if n.op == "call_module":  # its own parameters are inputs too: differentiate them
            sub = self.module.get_submodule(str(n.target))
            for name, t in [*sub.named_parameters(), *sub.named_buffers()]:
                module_state[name] = torch.empty(t.shape, dtype=t.dtype, device=t.device
                                                 ).requires_grad_(t.requires_grad)
            params = params | {_storage(t) for t in module_state.values()}
        fwd = KernelCounter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fwd:
            if module_state:
                out = torch.func.functional_call(sub, module_state, a, k)
            else:
                out = shapes.call_node(self.module, n, a, k)
        bwd = KernelCounter()
        outs = [t for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
        wrt = [t for t in [*fresh, *module_state.values()]
               if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs and wrt:
            grads = [torch.ones_like(t) for t in outs]
            with bwd:
                torch.autograd.grad(outs, wrt, grads, allow_unused=True)
        cost = _NodeCost(self._sum(fwd.flops), self._sum(bwd.flops), self._sum(fwd.bytes),
                         self._sum(bwd.bytes), fwd.kernels, bwd.kernels,
                         self._classify(saved_keys, fresh, out, params, copies), fwd.random,
                         self._work(fwd), self._work(bwd))
        return out, cost

    def _work(self, counter: KernelCounter) -> _Work:
        return {c: (self._sum(flops), self._sum(nbytes), counter.launches[c])
                for c, (flops, nbytes) in sorted(counter.by_class.items())}

    def _interpolated(self, n: Node, args: tuple[Any, ...], kwargs: dict[str, Any],
                      real: bool = False) -> tuple[Any, _NodeCost]:
        """Costs from static runs at a few batch sizes, interpolated (exact for polynomials):
        on fake tensors for ops without symbolic-shape support, on real ones for ops whose
        fake kernels under-report (recurrent layers keep a workspace for backward). A real
        run's sizes are padded, not polynomial: they are fitted with a line."""
        fit_points = shapes.fit_line if real else shapes.interpolate
        samples: dict[int, tuple[Any, _NodeCost]] = {}
        for b in shapes.SAMPLE_SIZES:
            if real:
                with unset_fake_temporarily():
                    samples[b] = self._real_sample(n, args, kwargs, b)
                continue
            static = FakeTensorMode(allow_non_fake_inputs=True)
            values = shapes.at_size((args, kwargs), self.sym, b, static)
            leaves, spec = pytree.tree_flatten(values)
            params = {_storage(v) for v, orig in zip(leaves, pytree.tree_leaves((args, kwargs)))
                      if isinstance(orig, torch.Tensor) and _storage(orig) in self.param_keys}
            with static:
                samples[b] = self._run_counted(n, leaves, spec, params)

        def fit(name: str) -> sympy.Expr:
            return fit_points([(b, int(getattr(c, name))) for b, (_, c) in samples.items()])

        def fit_saved(i: int) -> sympy.Expr:
            """The bytes of saved entry i, a buffer the node allocates (a "new" entry)."""
            points: list[tuple[int, int | float]] = []
            for b, (_, c) in samples.items():
                nbytes = c.saved[i][2]
                assert nbytes is not None, "a new buffer's entry carries its size"
                points.append((b, int(nbytes)))
            return fit_points(points)

        def fit_work(phase: str) -> _Work:
            """Each op class's FLOPs and bytes, fitted like the totals."""
            works = {b: getattr(c, phase) for b, (_, c) in samples.items()}

            def fit_part(cls: str, part: int) -> sympy.Expr:
                return fit_points([(b, int(w[cls][part]) if cls in w else 0)
                                   for b, w in works.items()])

            first_work: _Work = works[shapes.SAMPLE_SIZES[0]]
            return {cls: (fit_part(cls, 0), fit_part(cls, 1), kernels)
                    for cls, (_, _, kernels) in first_work.items()}

        first = samples[shapes.SAMPLE_SIZES[0]][1]
        saved: list[_Saved] = [(kind, index, fit_saved(i) if kind == "new" else None)
                               for i, (kind, index, _) in enumerate(first.saved)]
        cost = _NodeCost(fit("fwd_flops"), fit("bwd_flops"), fit("fwd_bytes"), fit("bwd_bytes"),
                         first.fwd_kernels, first.bwd_kernels, saved, first.random,
                         fit_work("fwd_work"), fit_work("bwd_work"))
        outs = {b: o for b, (o, _) in samples.items()}  # only their shapes are read
        out = shapes.symbolic_like(outs, self.shape_env, self.sym)
        return out, cost

    def _real_sample(self, n: Node, args: tuple[Any, ...], kwargs: dict[str, Any],
                     b: int) -> tuple[Any, _NodeCost]:
        """One real run of the node at batch size b on random data, with the real parameters."""
        real_params = {id(f): r for r, f in self._real_of_fake()}

        def real(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                if id(x) in real_params:
                    return real_params[id(x)]
                shape = [int(ir.evaluate(self._expr(d), b)) for d in x.shape]
                t = torch.randn(shape, dtype=x.dtype) if x.is_floating_point() \
                    else torch.zeros(shape, dtype=x.dtype)
                return t.requires_grad_(x.requires_grad and ir.differentiable(x))
            if isinstance(x, torch.SymInt):
                return int(ir.evaluate(self._expr(x), b))
            return x

        leaves, spec = pytree.tree_flatten(pytree.tree_map(real, (args, kwargs)))
        params = {_storage(t) for t in real_params.values()}
        return self._run_counted(n, leaves, spec, params)

    def _real_of_fake(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        for node in self.gm.graph.nodes:
            if node.op == "get_attr":
                real = super().get_attr(node.target, (), {})
                if isinstance(real, torch.Tensor) and id(real) in self.fakes:
                    out.append((real, self.fakes[id(real)]))
        return out

    def _classify(self, saved: list[tuple[int, _Count]], fresh: list[Any], out: Any,
                  params: set[int], copies: dict[int, int] | None = None) -> list[_Saved]:
        args = {_storage(t): i for i, t in enumerate(fresh) if isinstance(t, torch.Tensor)}
        args.update(copies or {})
        outs = {_storage(t): i for i, t in enumerate(
            [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)])}
        result: list[_Saved] = []
        seen: set[int] = set()
        for key, nbytes in saved:
            if key in seen or key in params:
                continue
            seen.add(key)
            if key in args:
                result.append(("arg", args[key], None))
            elif key in outs:
                result.append(("out", outs[key], None))
            else:
                result.append(("new", -1, self._expr(nbytes)))
        return result

    def _cache_key(self, n: Node, leaves: list[Any]) -> tuple[Hashable, ...] | None:
        if n.op == "call_module":
            return None
        parts: list[Hashable] = [n.op, n.target, ir.mode(n)]  # no_grad saves nothing
        storages: dict[int, int] = {}
        for x in leaves:
            if isinstance(x, torch.Tensor):
                alias = storages.setdefault(_storage(x), len(storages))
                parts.append((tuple(str(self._expr(d)) for d in x.shape), x.dtype,
                              x.requires_grad, _storage(x) in self.param_keys, alias,
                              tuple(str(self._expr(s)) for s in x.stride())))
            elif isinstance(x, torch.SymInt):
                parts.append(("sym", str(self._expr(x))))
            else:
                try:
                    hash(x)
                    parts.append(x)
                except TypeError:
                    return None
        return tuple(parts)

    def _sum(self, terms: Sequence[_Count]) -> sympy.Expr:
        if not terms:
            return sympy.Integer(0)
        return sympy.expand(sympy.Add(*[self._expr(t) for t in terms]))

    # -- results --------------------------------------------------------------------------------

    def summary(self) -> CostSummary:
        graph = self.gm.graph
        kept_by_owner: dict[Node, list[sympy.Expr]] = {}
        for key in self.kept:
            node, nbytes = self.owner[key]
            if node.op not in ("placeholder", "get_attr"):
                kept_by_owner.setdefault(node, []).append(self._expr(nbytes))
        totals: dict[str, list[sympy.Expr]] = {"fwd": [], "bwd": [], "params": [], "saved": []}
        by_node: dict[str, ir.Cost] = {}
        handover = self.handover
        handed_over = 0
        for node in ir.compute_nodes(graph):
            if handover and node in handover.source:
                handed_over += 1
                cost = handover.cost(node)
                node.meta[ir.COST] = cost
                by_node[node.name] = cost
                totals["fwd"].append(cost.fwd_flops)
                totals["bwd"].append(cost.bwd_flops)
                totals["params"].append(cost.param_bytes)
                totals["saved"].append(cost.saved_bytes)
                continue
            raw = self.raw[node]
            params, grad_params, grad_elements, grad_tensors = self._param_bytes(node)
            internal = sympy.expand(sympy.Add(*self.internal.get(node, [])))
            saved = sympy.expand(sympy.Add(*kept_by_owner.get(node, []), internal))
            info = node.meta.get(ir.TENSOR)
            cost = ir.Cost(
                fwd_flops=raw.fwd_flops, bwd_flops=raw.bwd_flops, param_bytes=params,
                output_bytes=_value_bytes(info), saved_bytes=saved, fwd_bytes=raw.fwd_bytes,
                bwd_bytes=raw.bwd_bytes, grad_param_bytes=grad_params,
                grad_param_elements=grad_elements, grad_params=grad_tensors,
                fwd_kernels=raw.fwd_kernels, bwd_kernels=raw.bwd_kernels,
                internal_saved_bytes=internal,
                saves=self._saves(node), random=raw.random, work=_class_work(raw))
            node.meta[ir.COST] = cost
            by_node[node.name] = cost
            totals["fwd"].append(cost.fwd_flops)
            totals["bwd"].append(cost.bwd_flops)
            totals["params"].append(params)
            totals["saved"].append(saved)

        def add(xs: list[sympy.Expr]) -> sympy.Expr:
            return sympy.expand(sympy.Add(*xs))

        return CostSummary(len(by_node), add(totals["fwd"]), add(totals["bwd"]),
                           add(totals["params"]), add(totals["saved"]), self.cache_hits, by_node,
                           handed_over)

    def _saves(self, node: Node) -> tuple[tuple[str, sympy.Expr], ...]:
        """The producers `node` keeps alive, by name; after skipped blocks, a producer of block
        3 (whose values stood for the skipped ones) is named as its copy in block N-2."""
        saves = self.saves.get(node, {})
        if self.handover:
            saves = self.handover.saves(node, saves)
        return tuple(sorted(saves.items()))

    def _param_bytes(self, node: Node) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr, int]:
        """Bytes of parameters and buffers this node is the first to use (tied ones once), the
        bytes of those needing gradients, their elements and how many tensors they are."""
        total, grad, elements, tensors = 0, 0, 0, 0
        for arg in node.all_input_nodes:
            if arg.op != "get_attr":
                continue
            real = self.fetch_attr(str(arg.target))
            if not isinstance(real, torch.Tensor) or id(real) in self.seen_params:
                continue
            self.seen_params.add(id(real))
            total += real.numel() * real.element_size()
            if real.requires_grad:
                grad += real.numel() * real.element_size()
                elements += real.numel()
                tensors += 1
        if node.op == "call_module":
            sub = self.fetch_attr(str(node.target))
            for p in [*sub.parameters(), *sub.buffers()]:
                if id(p) not in self.seen_params:
                    self.seen_params.add(id(p))
                    total += p.numel() * p.element_size()
                    grad += p.numel() * p.element_size() if p.requires_grad else 0
                    elements += p.numel() if p.requires_grad else 0
                    tensors += p.requires_grad
        return sympy.Integer(total), sympy.Integer(grad), sympy.Integer(elements), tensors


_REAL_SAMPLED = ("lstm", "gru", "rnn_tanh", "rnn_relu", "mkldnn_rnn")


def _needs_real_samples(n: Node) -> bool:
    name = str(n.target).lower() if n.op != "call_module" else ""
    return any(marker in name for marker in _REAL_SAMPLED)


def _state_device(gm: GraphModule) -> torch.device:
    """The device of the graph's parameters and buffers (the CPU when it has none)."""
    for tensor in [*gm.parameters(), *gm.buffers()]:
        return tensor.device
    return torch.device("cpu")


def writes_into_leaf(error: BaseException) -> bool:
    """Whether autograd refused an operation that writes into a leaf that needs gradients, or
    into a view of one: run on copies, the operation is allowed."""
    return isinstance(error, RuntimeError) and \
        "leaf Variable that requires grad is being used in an in-place operation" in str(error)


def _writable(fresh: list[Any]) -> list[Any]:
    """The arguments to call a node that writes into its inputs with: its fresh leaves that
    need gradients are leaves, which autograd does not let an operation overwrite, so it writes
    into copies (made outside the kernel counter, so they cost nothing)."""
    return [x.clone() if isinstance(x, torch.Tensor) and x.requires_grad else x for x in fresh]


def _storage(t: torch.Tensor) -> int:
    key: int = t.untyped_storage()._cdata  # the storage's address
    return key


def _fresh_leaf(x: Any) -> Any:
    """The node's own input: same storage, no history, so its backward is the node's alone."""
    if isinstance(x, torch.Tensor):
        leaf = x.detach()
        return leaf.requires_grad_(x.requires_grad) if ir.differentiable(x) else leaf
    return x


def _fresh_like(x: Any) -> Any:
    """A new fake tensor like a cached output (same sizes, strides, dtype, requires_grad)."""
    if not isinstance(x, torch.Tensor):
        return x
    t = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    return t.requires_grad_(x.requires_grad) if ir.differentiable(x) else t


def _value_bytes(info: ir.ValueInfo | None) -> sympy.Expr:
    if isinstance(info, ir.TensorInfo):
        return info.nbytes
    if isinstance(info, tuple):
        return sympy.expand(sympy.Add(*[_value_bytes(i) for i in info]))
    return sympy.Integer(0)


def _class_work(raw: _NodeCost) -> tuple[ir.ClassWork, ...]:
    return tuple(ir.ClassWork(cls, backward, flops, nbytes, kernels)
                 for backward, work in ((False, raw.fwd_work), (True, raw.bwd_work))
                 for cls, (flops, nbytes, kernels) in work.items())

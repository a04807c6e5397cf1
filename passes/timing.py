"""Measured per-node forward and backward wall times on the current device.

Reads:  CAPTURE (fxpipe.capture: the batch dimension of each input), TENSOR
Writes: TIME on every compute node
Graph:  unchanged (annotation only); the model's buffers, parameters' .grad and the caller's RNG
        state are left as they were

The graph runs once on real inputs cut to the micro-batch size, which gives every node its real
input values. Each compute node is then timed alone: its forward on those values (with autograd
recording, as in training), and its backward as autograd.grad of its floating outputs with
respect to its floating inputs that require grad and its module's parameters. Both are the
fastest of the repeated runs after warm-up (other processes on the machine can only slow a run
down, so the minimum is the node's own time), with a fixed number of threads. A forward or
backward that launches no kernel (views, getitem, shape arithmetic) gets 0 without timing: timed
alone it would show only the fixed cost of a Python call or of starting autograd.grad, which the
whole graph pays once. On CPU, per-node times add up to the whole only with one thread per
process (DESIGN.md, "CPU timing").
"""
from __future__ import annotations

import contextlib
import functools
import operator
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeAlias, TypeVar

import torch
import torch.utils._pytree as pytree
from torch._ops import OpOverload
from torch.fx import GraphModule, Node
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe import ir
from fxpipe.errors import ConfigError, CostError
from fxpipe.frontend import shapes
from fxpipe.frontend.capture import CaptureInfo
from fxpipe.frontend.regions import RegionInterpreter
from fxpipe.passes.cost import writes_into_leaf
from fxpipe.untouched import untouched

__all__ = ["measure_times"]


def measure_times(gm: GraphModule, flat_inputs: Sequence[torch.Tensor], *, microbatch_size: int,
                  warmup: int = 2, repeat: int = 5,
                  threads: int | None = 1) -> dict[str, ir.MeasuredTime]:
    """Times every compute node of `gm` alone at `microbatch_size`; writes ir.TIME on each.

    Args:
        gm: a graph captured by fxpipe.capture (flat tensor placeholders).
        flat_inputs: the graph's tensor inputs, e.g. `signature.flatten_inputs(args, kwargs)`;
            each batched input must hold at least `microbatch_size` examples.
        microbatch_size: the batch size b the nodes are timed at.
        warmup, repeat: untimed runs, then timed runs whose minimum is kept.
        threads: torch.set_num_threads for the duration (restored afterwards); None keeps it.

    Returns:
        {node name: ir.MeasuredTime(fwd, bwd, b)} in seconds, for every compute node.
    """
    if repeat < 1 or warmup < 0:
        raise ConfigError(f"repeat must be >= 1 and warmup >= 0 (got repeat={repeat}, "
                          f"warmup={warmup})", hint="use e.g. warmup=2, repeat=5")
    tensors = _microbatch(gm, flat_inputs, microbatch_size)
    cuda = sorted({t.device for t in [*tensors, *gm.parameters(), *gm.buffers()] if t.is_cuda},
                  key=str)
    sync = functools.partial(_synchronize, cuda) if cuda else None
    times: dict[str, ir.MeasuredTime] = {}
    with _threads(threads), untouched([], gm.buffers()):
        values = _record_values(gm, tensors)
        for node in ir.compute_nodes(gm.graph):
            timer = _NodeTimer(gm, node, values, warmup, repeat, sync)
            try:
                fwd, bwd = timer.run()
            except Exception as e:  # noqa: BLE001 - name the node, keep the cause
                raise CostError(f"cannot time {node.name} ({node.op} {node.target}) at "
                                f"micro-batch size {microbatch_size}: {type(e).__name__}: {e}",
                                hint="check that the graph runs on these inputs "
                                     "(fxpipe.frontend.capture.run_flat)") from e
            times[node.name] = ir.MeasuredTime(fwd, bwd, b=microbatch_size)
            node.meta[ir.TIME] = times[node.name]
    return times


def _synchronize(devices: Sequence[torch.device]) -> None:
    """Waits for the kernels of every device the graph uses (not only the current one)."""
    for device in devices:
        torch.cuda.synchronize(device)


# --- inputs and state ---------------------------------------------------------------------------

def _microbatch(gm: GraphModule, flat_inputs: Sequence[torch.Tensor], b: int) -> list[torch.Tensor]:
    """The first `b` examples of every batched input (unbatched inputs unchanged)."""
    info: CaptureInfo | None = gm.meta.get(ir.CAPTURE)
    if info is None:
        raise ConfigError("the graph has no capture information (gm.meta[ir.CAPTURE])",
                          hint="capture the model with fxpipe.capture before measuring it")
    leaves = info.signature.tensor_leaves
    if len(leaves) != len(flat_inputs):
        raise ConfigError(f"the graph takes {len(leaves)} tensor inputs "
                          f"(got {len(flat_inputs)})",
                          hint="pass signature.flatten_inputs(args, kwargs) of the example")
    if b < 1:
        raise ConfigError(f"microbatch_size must be >= 1 (got {b})", hint="use e.g. 2")
    out = []
    for leaf, t in zip(leaves, flat_inputs):
        if leaf.batch_dim is None:
            out.append(t)
            continue
        size = t.shape[leaf.batch_dim]
        if size < b:
            raise ConfigError(f"input {leaf.name} holds {size} examples along dimension "
                              f"{leaf.batch_dim}, fewer than the micro-batch size ({b})",
                              hint=f"use microbatch_size <= {size} or pass a larger batch")
        out.append(t.narrow(leaf.batch_dim, 0, b))
    return out


@contextlib.contextmanager
def _threads(threads: int | None) -> Iterator[None]:
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)



def _record_values(gm: GraphModule, tensors: Sequence[torch.Tensor]) -> dict[Node, Any]:
    """Every node's real value, detached, floating tensors keeping their requires_grad flag."""
    interp = RegionInterpreter(gm, garbage_collect_values=False)
    with torch.enable_grad():
        interp.run(*tensors, enable_io_processing=False)
    return {n: pytree.tree_map(_fresh_leaf, v) for n, v in interp.env.items()}


def _fresh_leaf(x: Any) -> Any:
    """The same storage without history: timing a node never reaches into its producers."""
    if isinstance(x, torch.nn.Parameter):
        return x  # the model's own parameter: autograd.grad w.r.t. it never touches .grad
    if isinstance(x, torch.Tensor):
        leaf = x.detach()
        return leaf.requires_grad_(x.requires_grad) if ir.differentiable(x) else leaf
    return x


# --- one node -----------------------------------------------------------------------------------

# TorchDispatchMode's __init_subclass__ and __init__ are unannotated in torch.
class _Kernels(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the aten kernels that run: views, detach and shape queries launch none."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0

    def __torch_dispatch__(self, func: OpOverload[..., Any], types: Sequence[type],
                           args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if not (func.namespace == "prim" or func.is_view or func._overloadpacket in _NO_KERNEL):
            self.count += 1
        return func(*args, **(kwargs or {}))


_NO_KERNEL = {torch.ops.aten.detach, torch.ops.aten.sym_size, torch.ops.aten.sym_numel,
              torch.ops.aten.sym_stride, torch.ops.aten.lift_fresh}


_Inputs: TypeAlias = tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor]]
"""A node's (args, kwargs, leaves to differentiate with respect to)."""
_State = TypeVar("_State")


class _NodeTimer:
    """Forward and backward times (fastest of repeats) of one node on its recorded inputs."""

    def __init__(self, gm: GraphModule, node: Node, values: dict[Node, Any], warmup: int,
                 repeat: int, sync: Callable[[], None] | None) -> None:
        self.gm, self.node = gm, node
        self.args = pytree.tree_map(lambda a: values[a] if isinstance(a, Node) else a, node.args)
        self.kwargs = pytree.tree_map(lambda a: values[a] if isinstance(a, Node) else a,
                                      dict(node.kwargs))
        self.warmup, self.repeat, self.sync = warmup, repeat, sync
        # In-place nodes (BatchNorm's num_batches_tracked.add_, relu_) change their inputs:
        # each run gets fresh copies so that repeated runs see the recorded values.
        self.inplace = ir.is_inplace(node)

    def run(self) -> tuple[float, float]:
        if self.node.op == "call_function" and self.node.target in (operator.getitem, getattr):
            return 0.0, 0.0
        probe = _Kernels()
        try:
            with probe:
                outs, wrt = self._forward(self._inputs())
        except RuntimeError as e:
            if self.inplace or not writes_into_leaf(e):
                raise
            # A function that writes into an input it was given (a helper's `attn[...] += x`)
            # runs on copies, like an in-place node; autograd refused before writing.
            self.inplace = True
            probe = _Kernels()
            with probe:
                outs, wrt = self._forward(self._inputs())
        fwd = self._fastest(self._inputs, self._forward) if probe.count else 0.0
        if not outs or not wrt:
            return fwd, 0.0
        grads = [torch.ones_like(t) for t in outs]

        def backward(state: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
            torch.autograd.grad(state[0], state[1], grads, allow_unused=True)

        probe = _Kernels()
        with probe:
            backward((outs, wrt))
        if not probe.count:  # the backward of a view is a view
            return fwd, 0.0
        return fwd, self._fastest(lambda: self._forward(self._inputs()), backward)

    def _inputs(self) -> _Inputs:
        """(args, kwargs, leaves to differentiate with respect to)."""
        leaves = [t for t in pytree.tree_leaves((self.args, self.kwargs))
                  if isinstance(t, torch.Tensor) and ir.differentiable(t) and t.requires_grad]
        if not self.inplace:
            return self.args, self.kwargs, leaves
        # An in-place node gets copies, made inside autograd so that in-place ops on them are
        # allowed, and the gradient still flows to the recorded leaves.
        with torch.enable_grad():
            copy = lambda x: x.clone() if isinstance(x, torch.Tensor) \
                and not isinstance(x, torch.nn.Parameter) else x  # noqa: E731
            return pytree.tree_map(copy, self.args), pytree.tree_map(copy, self.kwargs), leaves

    def _forward(self, inputs: _Inputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Runs the node once with autograd recording; returns (outputs to differentiate,
        tensors to differentiate them with respect to)."""
        args, kwargs, wrt = inputs
        with torch.enable_grad():
            out = shapes.call_node(self.gm, self.node, args, kwargs)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
                and ir.differentiable(t) and t.requires_grad and t.grad_fn is not None]
        if self.node.op == "call_module":
            wrt = wrt + [p for p in self.gm.get_submodule(str(self.node.target)).parameters()
                         if p.requires_grad]
        return outs, list({id(t): t for t in wrt}.values())

    def _fastest(self, setup: Callable[[], _State], timed: Callable[[_State], object]) -> float:
        """Fastest of `repeat` timings of `timed(setup())` after `warmup` untimed runs."""
        samples: list[float] = []
        for i in range(self.warmup + self.repeat):
            state = setup()
            if self.sync:
                self.sync()
            start = time.perf_counter()
            timed(state)
            if self.sync:
                self.sync()
            if i >= self.warmup:
                samples.append(time.perf_counter() - start)
        return min(samples)



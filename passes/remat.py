"""Re-materialization regions inside each stage.

Reads:  COST (passes.cost), TENSOR
Writes: REMAT (region id) on compute nodes of a stage graph
Graph:  unchanged (annotation only)

GPipe semantics ("always", "except_last"): a stage keeps only its inputs for each micro-batch and
recomputes its activations in the backward pass; the regions cover every operation of the stage
except those that mutate state (BatchNorm running statistics, in-place updates of buffers),
which must not run twice, so regions end before them and resume after. An operation that reads
a tensor written in place later in the stage (directly or through a view: an RNN filling
`output[:, t]` step by step) stays outside too: a region keeps its inputs to recompute from,
and one rewritten after the region ran would be recomputed from the wrong values (autograd
refuses it: "modified by an inplace operation"). "auto" picks, among the
stage's blocks, the set that fits the memory limit with the least recomputation (a 0-1
knapsack, `select_regions`). Whether a micro-batch actually recomputes is decided at run time
("except_last" skips the last micro-batch, whose backward follows at once).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.fx import GraphModule, Node

from fxpipe import ir
from fxpipe.passes.aliasing import rewritten_later, written_by
from fxpipe.remat_policy import RematPolicy, remat_policy

__all__ = ["mark_remat", "RematRegion", "select_regions", "is_mutating", "kept_bytes",
           "rewritten_later"]


@dataclass(frozen=True)
class RematRegion:
    name: str
    nodes: tuple[str, ...]
    saved_bytes: float  # activations the region would keep per micro-batch without remat
    kept_bytes: float  # what it keeps with remat: its inputs
    recompute_flops: float  # forward FLOPs run again in the backward pass


_BATCH_NORMS = {"batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                "_native_batch_norm_legit_functional", "cudnn_batch_norm"}


def is_mutating(node: Node) -> bool:
    """True for operations that update state and so must not be recomputed."""
    target = node.target
    if node.op == "call_module":
        return True  # an opaque module may update buffers (e.g. BatchNorm statistics)
    if ir.is_inplace(node) or written_by(node):  # rewriting a region input breaks recomputation
        return True
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if name in _BATCH_NORMS or str(target).split(".")[-2:-1] == ["batch_norm"]:
        training = node.kwargs.get("training", node.args[5] if len(node.args) > 5 else False)
        return bool(training)
    return False


def _runs(gm: GraphModule) -> list[list[Node]]:
    """Maximal runs of recomputable operations, split at communication and mutating nodes and
    at operations reading a tensor written in place after them."""
    runs: list[list[Node]] = [[]]
    keep_out = rewritten_later(gm)
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        if ir.is_comm(node) or is_mutating(node) or node in keep_out:
            runs.append([])
            continue
        runs[-1].append(node)
    return [r for r in runs if any(ir.cost(n).fwd_kernels for n in r if ir.COST in n.meta)]


def kept_bytes(nodes: Sequence[Node], b: int) -> float:
    """Bytes a set of nodes keeps for backward: the buffers they allocate and keep, plus every
    value they save, once (a value received from another stage is a copy this stage keeps)."""
    costs = [ir.cost(n) for n in nodes if ir.COST in n.meta]
    internal = sum(float(ir.evaluate(c.internal_saved_bytes, b)) for c in costs)
    values = {producer: float(ir.evaluate(nbytes, b))
              for c in costs for producer, nbytes in c.saves}
    return internal + sum(values.values())


def _region_stats(nodes: Sequence[Node], b: int) -> tuple[float, float, float]:
    inside = set(nodes)
    saved = kept_bytes(nodes, b)
    flops = sum(float(ir.evaluate(ir.cost(n).fwd_flops, b)) for n in nodes if ir.COST in n.meta)
    inputs = {a for n in nodes for a in n.all_input_nodes if a not in inside and a.op != "get_attr"}
    kept = 0.0
    for a in inputs:
        info = a.meta.get(ir.TENSOR)
        if isinstance(info, ir.TensorInfo):
            kept += float(ir.evaluate(info.nbytes, b))
    return saved, kept, flops


def mark_remat(gm: GraphModule, mode: RematPolicy | str, *, microbatch_size: int,
               inflight: int = 1, fixed_bytes: float = 0.0,
               memory_limit: float | None = None) -> list[RematRegion]:
    """Marks remat regions on a stage graph; returns them (empty for "never")."""
    policy = remat_policy(mode)
    for node in gm.graph.nodes:
        node.meta.pop(ir.REMAT, None)
    if not policy.recomputes_any:
        return []
    runs = _runs(gm)
    chooses = policy.chooses_regions
    candidates = [_split_blocks(run) for run in runs] if chooses else [[r] for r in runs]
    blocks = [block for run in candidates for block in run]
    if chooses:
        blocks = _auto(blocks, microbatch_size, inflight, fixed_bytes, memory_limit)
    regions = []
    for i, block in enumerate(blocks):
        name = f"remat_{i}"
        for node in block:
            node.meta[ir.REMAT] = name
        saved, kept, flops = _region_stats(block, microbatch_size)
        regions.append(RematRegion(name, tuple(n.name for n in block), saved, kept, flops))
    return regions


def _split_blocks(run: list[Node]) -> list[list[Node]]:
    """Splits a run at top-level module boundaries (e.g. one block per transformer layer)."""
    blocks: list[list[Node]] = []
    key = None
    for node in run:
        path = ir.module_path(node).split(".")
        k = ".".join(path[:2]) if len(path) > 1 and path[1].isdigit() else path[0]
        if not blocks or k != key:
            blocks.append([])
            key = k
        blocks[-1].append(node)
    return blocks


def _auto(blocks: list[list[Node]], b: int, inflight: int, fixed: float,
          limit: float | None) -> list[list[Node]]:
    if limit is None:
        return []
    stats = [_region_stats(block, b) for block in blocks]
    total = fixed + inflight * sum(s for s, _, _ in stats)
    need = total - limit
    if need <= 0:
        return []
    items = [(inflight * max(saved - kept, 0.0), flops) for saved, kept, flops in stats]
    chosen = select_regions(items, need)
    return [blocks[i] for i in chosen]


def select_regions(items: Sequence[tuple[float, float]], required: float,
                   resolution: int = 2000) -> list[int]:
    """0-1 knapsack: the items (saving, cost) whose savings reach `required` at least cost.

    Returns the indices in order; all items when even all of them fall short (the stage then
    saves what it can and the partition's memory check reports the shortfall).
    """
    if required <= 0:
        return []
    total = sum(s for s, _ in items)
    if total < required:
        return list(range(len(items)))
    unit = required / resolution
    weights = [min(resolution, int(s // unit)) for s, _ in items]  # round savings down: safe
    inf = float("inf")
    best = [0.0] + [inf] * resolution  # best[w] = least cost saving >= w units
    choice: list[list[int]] = [[] for _ in range(resolution + 1)]
    for i, ((_, cost), w) in enumerate(zip(items, weights)):
        if w == 0:
            continue
        for have in range(resolution, -1, -1):
            if best[have] == inf:
                continue
            to = min(resolution, have + w)
            if best[have] + cost < best[to]:
                best[to] = best[have] + cost
                choice[to] = choice[have] + [i]
    if best[resolution] == inf:
        return list(range(len(items)))
    return sorted(choice[resolution])

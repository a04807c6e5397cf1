"""The atoms of a graph and their costs: what the partition problem is made of.

An atom is one operation with work (a floating-point result) and the glue and bookkeeping that go
with it (`atoms_of`); cuts fall only between atoms, so every stage computes. `node_facts` reads
each atom's kernel seconds, overheads, bytes held and saved, and what crosses each cut position at
one micro-batch size; `measure_atoms` turns them into the problem's per-atom times and memory
under a remat policy, chunks and an optimizer. `AtomsCache` keeps both for a caller that
partitions one graph many ways (fxpipe.planner).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from fxpipe import ir
from fxpipe.optimizers import ADAM, OptimizerMemory
from fxpipe.passes.estimate import estimate_time, time_key
from fxpipe.profile import DeviceProfile
from fxpipe.profile.kinds import is_glue, overhead_kind
from fxpipe.remat_policy import RematPolicy, remat_policy

__all__ = ["Atoms", "AtomsCache", "AtomsKey", "NodeFacts", "WEIGHT_GRAD_SHARE", "accumulation",
           "atoms_of", "measure_atoms", "node_facts"]


@dataclass
class Atoms:
    """The partition problem's inputs, per atom and per cut position."""

    groups: list[list[Node]]  # compute nodes per atom, in a valid topological order
    compute: list[float]  # seconds per atom
    cut_comm: list[float]  # seconds per cut position (len n + 1)
    cut_bytes: list[float]  # forward bytes crossing each cut
    mem_fixed: list[float]
    mem_act: list[float]
    saved: list[float]
    forward: list[float]  # seconds of the forward alone, per atom
    recompute: list[float]  # seconds of recomputation in the backward, per atom
    weight: list[float]  # seconds of the backward's weight gradients, per atom
    # seconds per atom of per-operation overhead beyond kernels (in compute; recompute included)
    overhead: list[float] = field(default_factory=list)
    held: list[float] = field(default_factory=list)  # StagePlan.held_bytes, per atom
    # values crossing each cut position (len n + 1), and those whose gradients cross it back
    cut_messages: list[int] = field(default_factory=list)
    cut_gradients: list[int] = field(default_factory=list)


AtomsKey = tuple[str, int, RematPolicy, int, tuple[tuple[str, float], ...], OptimizerMemory]
"""What measured atoms depend on besides the graph and the profile: the balance mode they are
costed by, the micro-batch size, remat, chunks, the corrections (sorted) and what the optimizer
holds per parameter."""

FactsKey = tuple[str, int, tuple[tuple[str, float], ...]]


@dataclass
class AtomsCache:
    """Atoms measured by earlier partitions of one graph under one profile, for a caller that
    partitions it many ways (fxpipe.planner); partition fills it as it goes. It holds the
    measurements each problem is made from, not problems: those also depend on the stages, the
    schedule's in-flight micro-batches and the memory limit."""

    groups: list[list[Node]] | None = None
    """The graph's atoms (compute nodes per atom), the same for every measurement."""
    measured: dict[AtomsKey, Atoms] = field(default_factory=dict)
    """Atoms measured, by what they depend on."""
    facts: dict[FactsKey, NodeFacts] = field(default_factory=dict)
    """What the atoms are made of, by (balance, micro-batch size, corrections): shared by the
    atoms of every remat, chunks and optimizer at that size."""
    readers: set[Node] | None = None
    """The nodes whose backward has a weight-gradient part (_weight_readers), found once."""
    shareable: list[tuple[list[Node], int]] | None = None
    """The trainable weights more than one operation uses, and their bytes
    (passes.partition.graph.shareable_weights), found once."""

    def facts_for(self, gm: GraphModule, groups: list[list[Node]], *, balance: str,
                  profile: DeviceProfile, b: int,
                  corrections: Mapping[str, float]) -> NodeFacts:
        key: FactsKey = (balance, b, tuple(sorted(corrections.items())))
        if key not in self.facts:
            if self.readers is None:
                self.readers = _weight_readers(gm)
            self.facts[key] = node_facts(gm, groups, balance=balance, profile=profile, b=b,
                                         corrections=corrections, readers=self.readers)
        return self.facts[key]


def _has_work(node: Node) -> bool:
    """Computes a floating-point value. Integer and boolean results (a counter's add_(1), a
    mask, indices) are bookkeeping: a stage holding only those would compute nothing."""
    if is_glue(node):
        return False
    info = node.meta.get(ir.TENSOR)
    if isinstance(info, ir.TensorInfo):
        return info.is_float
    if isinstance(info, tuple):
        return any(isinstance(x, ir.TensorInfo) and x.is_float for x in info)
    return True


def atoms_of(gm: GraphModule) -> list[list[Node]]:
    """Groups compute nodes into atoms, one per node with work (_has_work). Glue and bookkeeping
    join the atom of their latest compute input; without one (constants, sizes of inputs, a
    buffer's counter) their first user's atom, or without users the next atom in program order
    (a BatchNorm's counter stays with its batch_norm)."""
    nodes = ir.compute_nodes(gm.graph)
    atom: dict[Node, int] = {}
    pending: list[tuple[Node, int]] = []  # with the index of the next atom in program order
    count = 0
    for node in nodes:
        inputs = [atom[a] for a in node.all_input_nodes if a in atom]
        if _has_work(node):
            atom[node] = count
            count += 1
        elif inputs:
            atom[node] = max(inputs)
        else:
            pending.append((node, count))
    for node, following in reversed(pending):  # users come later in program order: placed
        users = [atom[u] for u in node.users if u in atom]
        atom[node] = min(users) if users else max(min(following, count - 1), 0)
    groups: list[list[Node]] = [[] for _ in range(max(count, 1))]
    for node in nodes:
        groups[atom[node]].append(node)
    return [g for g in groups if g]


def _atom_index(groups: list[list[Node]]) -> dict[Node, int]:
    return {n: i for i, g in enumerate(groups) for n in g}


WEIGHT_GRAD_SHARE = 0.5
"""Of the backward of a node that reads trainable parameters: the weight gradient (a linear
layer's or a convolution's backward is two products of the forward's size, one for the input's
gradient, one for the weight's). Nodes without trainable parameters have no weight-gradient
part."""


def _weight_readers(gm: GraphModule) -> set[Node]:
    """The nodes whose backward has a weight-gradient part: those reading a trainable parameter,
    directly or through nodes computed from parameters alone (a transpose, a cast), tied
    parameters at every use."""
    derived: set[Node] = set()  # trainable parameters and what is computed from them alone
    readers: set[Node] = set()
    for node in gm.graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "get_attr":
            value = _attribute(gm, str(node.target))
            if isinstance(value, torch.Tensor) and value.requires_grad:
                derived.add(node)
        elif inputs and all(a in derived for a in inputs):
            derived.add(node)
        if any(a in derived for a in inputs):
            readers.add(node)
        if node.op == "call_module" and any(
                p.requires_grad for p in gm.get_submodule(str(node.target)).parameters()):
            readers.add(node)
    return readers


def _attribute(gm: GraphModule, target: str) -> object:
    value: object = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _node_time(node: Node, balance: str, profile: DeviceProfile, b: int,
               corrections: Mapping[str, float]) -> tuple[float, float]:
    factor = corrections.get(node.name, 1.0)
    if factor != 1.0:
        fwd, bwd = _node_time(node, balance, profile, b, {})
        return fwd * factor, bwd * factor
    if balance == "time":
        t = ir.measured_time(node)
        scale = b / t.b  # measured at one size; per-example time scales with b
        return t.fwd * scale, t.bwd * scale
    if balance == "params":
        return float(ir.evaluate(ir.cost(node).param_bytes, b)), 0.0
    return estimate_time(ir.cost(node), profile, b)


def _value_bytes(node: Node, b: int) -> tuple[float, float]:
    """Forward bytes of a value and the bytes of its gradient (floating tensors only)."""
    info = node.meta.get(ir.TENSOR)
    if isinstance(info, ir.TensorInfo):
        size = float(ir.evaluate(info.nbytes, b))
        return size, size if (info.is_float and info.requires_grad) else 0.0
    if isinstance(info, tuple):
        parts = [x for x in info if isinstance(x, ir.TensorInfo)]
        fwd = sum(float(ir.evaluate(x.nbytes, b)) for x in parts)
        bwd = sum(float(ir.evaluate(x.nbytes, b)) for x in parts if x.is_float and x.requires_grad)
        return fwd, bwd
    return 0.0, 0.0


@dataclass(frozen=True)
class NodeFacts:
    """What the atoms' costs are made of at one micro-batch size, before remat, chunks and the
    optimizer enter: per atom its kernels' seconds and bytes, per cut what crosses it."""

    fwd: list[float]  # seconds of the atom's forward kernels
    bwd: list[float]  # seconds of its backward kernels
    region: list[float]  # seconds a remat region's bookkeeping costs its recomputation
    paid: list[float]  # seconds its operations (and views) pay beyond kernels, fwd and bwd
    paid_forward: list[float]  # the forward's part of that
    accumulate: list[float]  # seconds adding a micro-batch's weight gradients to the earlier
    weight: list[float]  # seconds of its backward's weight gradients
    params: list[float]  # bytes of its weights and buffers
    grads: list[float]  # bytes of its trainable weights' gradients
    elements: list[float]  # elements of its trainable weights
    saved: list[float]  # bytes it saves for the backward
    cut_f: list[float]  # forward bytes crossing each cut position 0..n
    cut_b: list[float]  # backward bytes crossing each cut
    cut_m: list[int]  # values crossing each cut
    cut_g: list[int]  # values crossing each cut whose gradients cross it back


def node_facts(gm: GraphModule, groups: list[list[Node]], *, balance: str,
               profile: DeviceProfile, b: int,
               corrections: Mapping[str, float] | None = None,
               readers: set[Node] | None = None) -> NodeFacts:
    """`readers`: _weight_readers(gm), when the caller has it."""
    index = _atom_index(groups)
    n = len(groups)
    readers = _weight_readers(gm) if readers is None else readers
    corrections = corrections or {}
    costed = balance == "cost"
    facts = NodeFacts([], [], [], [], [], [], [], [], [], [], [], [0.0], [0.0], [0], [0])
    # A deep model repeats a few costs thousands of times (its blocks): each distinct one is
    # evaluated at b once.
    timed: dict[object, tuple[float, float]] = {}
    held: dict[object, tuple[float, float, float, float]] = {}

    def node_time(x: Node) -> tuple[float, float]:
        if not costed or x.name in corrections:
            return _node_time(x, balance, profile, b, corrections)
        cost = ir.cost(x)
        key = time_key(cost)
        if key not in timed:
            timed[key] = estimate_time(cost, profile, b)
        return timed[key]

    def amounts(cost: ir.Cost) -> tuple[float, float, float, float]:
        exprs = (cost.param_bytes, cost.grad_param_bytes, cost.grad_param_elements,
                 cost.saved_bytes)
        key = tuple(map(id, exprs))  # alive in the graph's costs while this runs
        if key not in held:
            p, g, e, saved = (float(ir.evaluate(x, b)) for x in exprs)
            held[key] = (p, g, e, saved)
        return held[key]

    by_kind: dict[str, tuple[float, float, float]] = {}

    def paid(x: Node) -> tuple[float, float, float]:
        kind = overhead_kind(x)
        if kind is None:
            return 0.0, 0.0, 0.0
        if kind not in by_kind:
            by_kind[kind] = (profile.operation_overhead(kind),
                             profile.operation_forward_overhead(kind),
                             profile.operation_region_overhead(kind))
        return by_kind[kind]

    sized: dict[int, tuple[float, float]] = {}

    def value_bytes(node: Node) -> tuple[float, float]:
        key = id(node.meta.get(ir.TENSOR))  # a block's copies share their twin's shapes
        if key not in sized:
            sized[key] = _value_bytes(node, b)
        return sized[key]

    for group in groups:
        times = [node_time(x) for x in group]
        pays = [paid(x) for x in group] if costed else []
        facts.paid.append(sum(p[0] for p in pays))
        facts.paid_forward.append(sum(p[1] for p in pays))
        facts.region.append(sum(p[2] for p in pays))
        facts.fwd.append(sum(t[0] for t in times))
        facts.bwd.append(sum(t[1] for t in times))
        facts.weight.append(sum(WEIGHT_GRAD_SHARE * t[1] for x, t in zip(group, times)
                                if x in readers))
        each = [amounts(ir.cost(x)) for x in group]
        facts.params.append(sum(a[0] for a in each))
        facts.grads.append(sum(a[1] for a in each))
        facts.elements.append(sum(a[2] for a in each))
        facts.saved.append(sum(a[3] for a in each))
        # a kernel time like the node's own, corrected by what its stage measured
        facts.accumulate.append(sum(accumulation(profile, g, e, ir.cost(x).grad_params)
                                    * corrections.get(x.name, 1.0)
                                    for x, (_, g, e, _) in zip(group, each)) if costed else 0.0)
    # values crossing each cut: produced in atom i, last used in atom j > i -> cuts i+1 .. j
    diff_f = [0.0] * (n + 2)
    diff_b = [0.0] * (n + 2)
    messages = [0] * (n + 2)
    gradients = [0] * (n + 2)
    for group in groups:
        for node in group:
            users = [index.get(u, n) for u in node.users]  # the output node counts as atom n
            last = max(users, default=index[node])
            if last > index[node]:
                fwd, bwd = value_bytes(node)
                diff_f[index[node] + 1] += fwd
                diff_f[last + 1] -= fwd
                diff_b[index[node] + 1] += bwd
                diff_b[last + 1] -= bwd
                messages[index[node] + 1] += 1
                messages[last + 1] -= 1
                if bwd:
                    gradients[index[node] + 1] += 1
                    gradients[last + 1] -= 1
    for c in range(1, n + 1):
        facts.cut_f.append(facts.cut_f[-1] + diff_f[c])
        facts.cut_b.append(facts.cut_b[-1] + diff_b[c])
        facts.cut_m.append(facts.cut_m[-1] + messages[c])
        facts.cut_g.append(facts.cut_g[-1] + gradients[c])
    return facts


def accumulation(profile: DeviceProfile, grad_bytes: float, elements: float,
                 tensors: int) -> float:
    """Seconds adding a micro-batch's gradients of `tensors` weights into the gradients of
    the micro-batches before (autograd's AccumulateGrad): an element-wise add each, reading
    two and writing one."""
    if not tensors:
        return 0.0
    return profile.class_time("elementwise", elements, 3 * grad_bytes, tensors)


def measure_atoms(gm: GraphModule, groups: list[list[Node]], *, balance: str,
                  profile: DeviceProfile, b: int, remat: RematPolicy | str, chunks: int,
                  corrections: Mapping[str, float] | None = None,
                  optimizer: OptimizerMemory = ADAM, facts: NodeFacts | None = None) -> Atoms:
    """The atoms' costs; `facts`: node_facts of the same graph, balance, profile, b and
    corrections, measured before (they do not depend on remat, chunks or the optimizer)."""
    if facts is None:
        facts = node_facts(gm, groups, balance=balance, profile=profile, b=b,
                           corrections=corrections)
    n = len(groups)
    policy = remat_policy(remat)
    recompute = policy.recomputed_share(chunks)
    compute: list[float] = []
    mem_fixed: list[float] = []
    mem_act: list[float] = []
    held: list[float] = []
    forward: list[float] = []
    recomputed: list[float] = []
    overhead: list[float] = []
    # what each operation pays beyond its kernels, in its forward and its backward (measured
    # per-node times and parameter bytes include or need none); a recomputed
    # operation pays its forward's share again and the checkpoint's bookkeeping; every
    # micro-batch but the step's first adds its weight gradients into the earlier ones'
    accumulated = (chunks - 1) / chunks
    for a in range(n):
        paid, region = facts.paid_forward[a], facts.region[a]
        fwd = facts.fwd[a] + paid
        bwd = facts.bwd[a] + facts.paid[a] - paid + accumulated * facts.accumulate[a]
        again = recompute * (fwd + region)
        overhead.append(facts.paid[a] + recompute * (paid + region))
        compute.append(fwd + bwd + again)
        forward.append(fwd)
        recomputed.append(again)
        act = facts.saved[a]
        held.append(optimizer.weight_bytes(facts.params[a])
                    + optimizer.held_bytes(facts.grads[a], facts.elements[a]))
        mem_fixed.append(held[-1] + (act if policy.recomputes_any else 0))
        mem_act.append(0.0 if policy.recomputes_any else act)
    if balance == "params":
        comm = [0.0] * (n + 1)
    else:
        comm = [profile.comm_time(f, m) + profile.comm_time(bw, m if bw else 0)
                for f, bw, m in zip(facts.cut_f, facts.cut_b, facts.cut_m)]
    comm[0] = comm[n] = 0.0
    inner = [0] + [1] * (n - 1) + [0]  # no messages before the first atom or after the last
    return Atoms(groups, compute, comm, list(facts.cut_f), mem_fixed, mem_act,
                 list(facts.saved), forward, recomputed,
                 [w + accumulated * g for w, g in zip(facts.weight, facts.accumulate)],
                 overhead, held,
                 [m * i for m, i in zip(facts.cut_m, inner)],
                 [g * i for g, i in zip(facts.cut_g, inner)])

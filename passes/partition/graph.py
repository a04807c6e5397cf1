"""Balanced, contiguous pipeline stages.

Reads:  COST (passes.cost), TIME (passes.timing) for balance="time", and node-time corrections
        measured by balancing (passes.partition.correct) for balance="dynamic"
Writes: STAGE on every compute node
Graph:  unchanged (annotation only)

The graph is first coarsened into atoms: glue (views, getitem, sizes, constants: nodes that launch
no kernel or produce no tensor) and bookkeeping (integer and boolean results: counters such as
BatchNorm's num_batches_tracked, masks, indices) stay with the node that produces their input, or
the operation they precede, so cuts fall between real operations and every stage computes.
Each atom gets a time (forward + backward + recompute at the micro-batch size) and each cut the
time of the values crossing it (activations forward, gradients backward); the exact solver in
passes.partition.solver minimises the slowest stage, within a memory limit.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch.fx import GraphModule, Node

from fxpipe import ir
from fxpipe.choices import BALANCE_MODES
from fxpipe.errors import ConfigError, PartitionError
from fxpipe.figures import imbalance, stage_load
from fxpipe.optimizers import ADAM, OptimizerMemory
from fxpipe.passes.cost import estimate_time, time_key
from fxpipe.passes.partition.correct import LOSS
from fxpipe.passes.partition.problem import (
    Partition,
    PartitionProblem,
    evaluate,
    partition_problem,
)
from fxpipe.passes.partition.solver import solve_partition
from fxpipe.passes.remat import is_mutating
from fxpipe.profile import DeviceProfile
from fxpipe.profile.kinds import is_glue, overhead_kind
from fxpipe.remat_policy import RematPolicy, remat_policy
from fxpipe.runtime.planning.grid import peak_inflight
from fxpipe.runtime.planning.schedule import ScheduleKind, schedule_kind
from fxpipe.runtime.planning.timeline import predicted_step

__all__ = ["partition", "StagePlan", "PartitionPlan", "Atoms", "AtomsCache", "atoms_of",
           "measure_atoms", "node_facts", "NodeFacts", "BALANCE_MODES", "WEIGHT_GRAD_SHARE",
           "is_glue"]



@dataclass(frozen=True)
class StagePlan:
    index: int
    nodes: tuple[str, ...]  # compute node names in order
    time: float  # predicted seconds per micro-batch: fwd + bwd (+ recompute) + communication
    compute_time: float
    comm_time: float
    memory: float | None  # predicted peak bytes under the memory model
    first_module: str
    last_module: str
    forward_time: float = 0.0  # the part of compute_time spent in forwards (recompute: backward)
    recompute_time: float = 0.0  # the part spent recomputing remat regions in the backward
    # the part of the backward a split backward's W runs (besides recomputing): the weight
    # gradients; the whole backward in the first stage, which has no input gradient to send
    weight_time: float = 0.0
    # the part of compute_time paid beyond kernels: per operation, per micro-batch, per region
    overhead_time: float = 0.0
    # bytes held whatever the schedule: weights and buffers, and for the trainable weights their
    # gradients and the optimizer's state (fxpipe.optimizers); part of `memory`
    held_bytes: float = 0.0
    # messages a rank running the stage sends or receives per micro-batch: in its forward (the
    # values crossing its boundaries) and in its backward (their gradients)
    forward_messages: int = 0
    backward_messages: int = 0


@dataclass(frozen=True)
class PartitionPlan:
    stages: tuple[StagePlan, ...]
    microbatch_size: int
    chunks: int
    balance: str
    bottleneck: float
    predicted_step_time: float  # the schedule simulated with the stage times (one step)
    candidates: tuple[tuple[int, float], ...] = ()  # (chunks, predicted step time) for "auto"
    # schedule="auto": (schedule, simulated step time, or None where no partition fits memory)
    schedules: tuple[tuple[str, float | None], ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    step_overhead: float = 0.0  # seconds each step pays once, beyond its micro-batches
    # seconds a pipeline rank pays beyond one process: per forward or backward of a stage and
    # micro-batch, and per message sent or received (fxpipe.profile.ranks)
    action_overhead: float = 0.0
    message_overhead: float = 0.0

    def breakdown(self) -> dict[str, float]:
        """Seconds of one step's work, all stages together (not its critical path): kernels,
        per-operation overhead, per-micro-batch overhead (both in compute_time), messages
        (each boundary once, forward and backward), what ranks pay to run each forward and
        backward and to send and receive each message, and the per-step overhead."""
        m = self.chunks
        overhead = sum(s.overhead_time for s in self.stages) * m
        kernels = sum(s.compute_time for s in self.stages) * m - overhead
        ranks = sum(2 * self.action_overhead + self.message_overhead
                    * (s.forward_messages + s.backward_messages) for s in self.stages) * m
        return {"kernels": kernels, "overhead": overhead,
                "messages": sum(s.comm_time for s in self.stages) / 2 * m,
                "ranks": ranks, "step": self.step_overhead}

    @property
    def imbalance(self) -> float:
        """Slowest / mean stage, each busy with its compute and half its boundaries' traffic
        (fxpipe.figures: the one imbalance reports print)."""
        return imbalance([stage_load(s.compute_time, s.comm_time) for s in self.stages])


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


def partition(
    gm: GraphModule,
    num_stages: int,
    *,
    microbatch_size: int,
    chunks: int,
    profile: DeviceProfile,
    balance: str | Sequence[int] = "cost",
    split_points: Sequence[str] | None = None,
    remat: RematPolicy | str = "except_last",
    memory_limit: float | None = None,
    schedule: ScheduleKind | str = "gpipe",
    ranks: int | None = None,
    loss_time: float = 0.0,
    corrections: Mapping[str, float] | None = None,
    starts: Sequence[str] | None = None,
    reuse: AtomsCache | None = None,
    optimizer: OptimizerMemory = ADAM,
    least_memory: bool = True,
) -> PartitionPlan:
    """Assigns a stage to every compute node; returns the plan with predicted times.

    schedule, ranks: the schedule (a kind, or its name) and its number of ranks (default: one
    stage per rank, two under a looped schedule), which say how many micro-batches each stage
    keeps alive.
    memory_limit: bytes per stage.
    loss_time: seconds per micro-batch of the training loss (forward and backward), which the
    last stage computes after the model's outputs.
    corrections: node name -> factor on its estimated time, learned by measuring stages
    (passes.partition.correct; "(loss)" scales loss_time).
    starts: the first node of each stage: keeps a cut measured before instead of solving.
    reuse: atoms measured by earlier calls on this graph and profile, by micro-batch size,
        remat and chunks (fxpipe.planner partitions one graph many ways); filled as it goes.
    optimizer: what training holds per trainable parameter beyond the weight (gradients,
        optimizer state, master weights), charged to each stage's fixed memory.
    least_memory: when no partition fits the limit, name the least limit that would (a search
        of its own; False for a caller that only asks whether one fits).

    Raises:
        PartitionError: more stages than operations that can start one, or no partition
            fits the memory limit.
    """
    if not isinstance(balance, str):
        cuts = _cuts_from_counts(gm, list(balance), num_stages)
        groups = [[n] for n in ir.compute_nodes(gm.graph)]
        mode = "explicit"
    else:
        if balance not in BALANCE_MODES:
            raise ConfigError(
                f"unknown balance mode {balance!r}",
                hint=f"use one of {BALANCE_MODES}, or a list of node counts per stage")
        known = reuse.groups if reuse is not None else None
        groups = known if known is not None else atoms_of(gm)
        mode = balance
        cuts = None
    b = microbatch_size
    policy = remat_policy(remat)
    corrections = corrections or {}
    loss_time *= corrections.get(LOSS, 1.0)
    costed = "cost" if mode in ("explicit", "dynamic") else mode
    key: AtomsKey = (costed, b, policy, chunks, tuple(sorted(corrections.items())), optimizer)
    if reuse is not None and mode != "explicit" and key in reuse.measured:
        atoms = reuse.measured[key]
    else:
        facts = reuse.facts_for(gm, groups, balance=costed, profile=profile, b=b,
                                corrections=corrections) \
            if reuse is not None and mode != "explicit" else None
        atoms = measure_atoms(gm, groups, balance=costed, profile=profile, b=b, remat=policy,
                              chunks=chunks, corrections=corrections, optimizer=optimizer,
                              facts=facts)
        if reuse is not None and mode != "explicit":
            reuse.measured[key] = atoms
            reuse.groups = atoms.groups
    if mode != "params":  # the last atom is always in the last stage
        atoms = replace(atoms, compute=[*atoms.compute[:-1], atoms.compute[-1] + loss_time])
    schedule = schedule_kind(schedule)
    inflight = list(_peak_inflight(schedule.name, chunks, num_stages, ranks))
    if starts is not None:
        cuts = _cuts_from_starts(groups, starts, num_stages)
    if split_points is not None:
        if cuts is not None:
            raise ConfigError("both split_points and a list of node counts (balance=[...]) "
                              "say where to cut", hint="give one of them")
        cuts = _cuts_from_split_points(groups, split_points, num_stages)
    if cuts is None:
        if len(groups) < num_stages:
            raise PartitionError(
                f"cannot split {type(gm).__name__} into {num_stages} stages: it has "
                f"{len(groups)} operations that can start a stage ({num_stages} > "
                f"{len(groups)}); a stage needs at least one operation that computes a "
                "floating-point value (a layer, an activation, an addition), and views, "
                "indexing and integer bookkeeping such as BatchNorm's batch counter go with it",
                hint=f"use at most {len(groups)} stages{_more_operations(gm)}")

    def problem_of(atoms: Atoms) -> PartitionProblem:
        """The one problem the solver and the exact costs read."""
        return partition_problem(
            atoms.compute, num_stages, cut_comm=atoms.cut_comm, memory_limit=memory_limit,
            mem_fixed=atoms.mem_fixed, mem_act=atoms.mem_act,
            cut_mem=atoms.cut_bytes if policy.recomputes_any else None,
            inflight=inflight)

    problem = problem_of(atoms)
    if cuts is None:
        cuts = solve_partition(problem, least_memory=least_memory).cuts
    if mode == "params":  # balanced on bytes; report the stages in seconds like the others
        atoms = measure_atoms(gm, groups, balance="cost", profile=profile, b=b, remat=policy,
                               chunks=chunks, optimizer=optimizer)
        atoms.compute[-1] += loss_time
        problem = problem_of(atoms)
    evaluated = evaluate(problem, cuts)
    fixed = 0.0 if mode == "params" else profile.microbatch_overhead
    # what each remat region's checkpoint call costs where a micro-batch recomputes it
    per_region = 0.0 if mode == "params" else \
        policy.recomputed_share(chunks) * profile.checkpoint_overhead
    plan = _write_stages(groups, cuts, atoms, evaluated, b, chunks, mode, num_stages, fixed,
                         per_region)
    if mode != "params":
        plan = replace(plan, step_overhead=profile.step_overhead,
                       action_overhead=profile.action_overhead,
                       message_overhead=profile.message_overhead)
    # the step as the schedule plays it: the one figure reports and chunks="auto" judge by
    return replace(plan, predicted_step_time=predicted_step(plan, schedule, ranks)[0])


@functools.lru_cache(maxsize=1024)
def _peak_inflight(schedule: str, chunks: int, num_stages: int,
                   ranks: int | None) -> tuple[int, ...]:
    """peak_inflight of the named schedule's order, once per shape (a planner partitions for
    hundreds of candidates that share a few); keyed by name, so that the cache holds no
    caller's kind and the schedules it memoises."""
    return tuple(peak_inflight(schedule_kind(schedule).build(chunks, num_stages, ranks)))


def _write_stages(groups: list[list[Node]], cuts: Sequence[int], atoms: Atoms,
                  evaluated: Partition, b: int, chunks: int, mode: str,
                  k: int, fixed: float = 0.0, per_region: float = 0.0) -> PartitionPlan:
    """The plan of these cuts; `fixed`: seconds every stage pays per micro-batch beyond its
    operations (the executor's hand-offs), half of it in the forward; `per_region`: seconds
    per micro-batch each remat region's checkpoint call costs (its recomputed share)."""
    stages: list[StagePlan] = []
    for s in range(k):
        members = [n for g in groups[cuts[s]:cuts[s + 1]] for n in g]
        for node in members:
            node.meta[ir.STAGE] = s
        comm = atoms.cut_comm[cuts[s]] + atoms.cut_comm[cuts[s + 1]]
        # the first and last named modules, found from the ends (a stage holds many nodes)
        first = next((m for m in map(ir.module_path, members) if m), "(top level)")
        last = next((m for m in map(ir.module_path, reversed(members)) if m), "(top level)")
        calls = per_region * _regions(members) if per_region else 0.0
        compute = evaluated.stage_times[s] - comm + fixed + calls
        forward = sum(atoms.forward[cuts[s]:cuts[s + 1]]) + fixed / 2
        recompute = sum(atoms.recompute[cuts[s]:cuts[s + 1]]) + calls
        # the first stage receives no gradient-carrying value: its split backward's W is the
        # whole backward (NOTE [Split backward] in fxpipe/runtime/communication/dist_comm.py)
        weight = compute - forward - recompute if s == 0 else \
            sum(atoms.weight[cuts[s]:cuts[s + 1]])
        stages.append(StagePlan(
            s, tuple(n.name for n in members), evaluated.stage_times[s] + fixed + calls,
            compute, comm, evaluated.stage_memory[s] if evaluated.stage_memory else None,
            first, last, forward, recompute, weight,
            sum(atoms.overhead[cuts[s]:cuts[s + 1]]) + fixed + calls,
            sum(atoms.held[cuts[s]:cuts[s + 1]]),
            *_messages(atoms, cuts[s], cuts[s + 1])))
    bottleneck = max(st.time for st in stages)
    return PartitionPlan(tuple(stages), b, chunks, mode, bottleneck, (chunks + k - 1) * bottleneck)


def _regions(members: Sequence[Node]) -> int:
    """How many remat regions mark_remat makes of a stage's nodes: runs of operations split at
    the ones that must not run twice (fxpipe.passes.remat.is_mutating)."""
    regions, open_run = 0, False
    for node in members:
        if is_mutating(node):
            open_run = False
        elif not is_glue(node) and not open_run:
            regions, open_run = regions + 1, True
    return regions


def _messages(atoms: Atoms, first: int, end: int) -> tuple[int, int]:
    """(forward, backward) messages per micro-batch of the stage of atoms first..end-1."""
    return (atoms.cut_messages[first] + atoms.cut_messages[end],
            atoms.cut_gradients[first] + atoms.cut_gradients[end])


def _cuts_from_counts(gm: GraphModule, counts: list[int], k: int) -> tuple[int, ...]:
    nodes = ir.compute_nodes(gm.graph)
    hint = f"give {k} positive integer counts that sum to {len(nodes)}, or use balance='cost'"
    if len(counts) != k:
        raise PartitionError(f"balance {counts} has {len(counts)} entries for {k} stages",
                             hint=hint)
    bad = [c for c in counts if not isinstance(c, int) or isinstance(c, bool) or c < 1]
    if bad:
        raise PartitionError(f"balance {counts} has entries that are not positive integers "
                             f"({bad})", hint=hint)
    if sum(counts) != len(nodes):
        raise PartitionError(f"balance {counts} must sum to the number of compute nodes "
                             f"({sum(counts)} != {len(nodes)})", hint=hint)
    cuts = [0]
    for c in counts:
        cuts.append(cuts[-1] + c)
    return tuple(cuts)


def _cuts_from_starts(groups: list[list[Node]], starts: Sequence[str],
                      k: int) -> tuple[int, ...]:
    atom = {n.name: i for i, g in enumerate(groups) for n in g}
    missing = [name for name in starts[1:] if name not in atom]
    if len(starts) != k or missing:
        raise PartitionError(f"a remembered cut {list(starts)} does not fit this graph of "
                             f"{k} stages (unknown nodes {missing})",
                             hint="clear the cache (fxpipe profile --clear) and balance again")
    return (0, *(atom[name] for name in starts[1:]), len(groups))


def _cuts_from_split_points(groups: list[list[Node]], points: Sequence[str],
                            k: int) -> tuple[int, ...]:
    if len(points) != k - 1:
        raise PartitionError(
            f"{len(points)} split points make {len(points) + 1} stages, not {k}",
            hint=f"give {k - 1} module names, or stages={len(points) + 1}")
    cuts = [0]
    for point in points:
        start = next((i for i, g in enumerate(groups)
                      if any(_in_module(ir.module_path(n), point) for n in g)), None)
        if start is None:
            known = sorted({ir.module_path(n).split(".")[0] for g in groups for n in g} - {""})
            raise PartitionError(f"split point {point!r} names no module of the model",
                                 hint=f"use qualified module names such as {known[:6]}")
        if start <= cuts[-1]:
            raise PartitionError(
                f"split point {point!r} (atom {start}) does not come after the previous cut "
                f"(atom {cuts[-1]})", hint="list split points in the order the model runs them")
        cuts.append(start)
    cuts.append(len(groups))
    return tuple(cuts)


def _in_module(path: str, point: str) -> bool:
    return path == point or path.startswith(point + ".")


def _more_operations(gm: GraphModule) -> str:
    """How to expose more operations, in options the call that captured `gm` was given:
    fxpipe.compile always inlines torch.nn modules; fxpipe.capture does on request; a module
    kept whole (leaf_modules) is one operation."""
    info = gm.meta.get(ir.CAPTURE)
    if info is not None and not info.inline_modules:
        return ", or capture with inline_modules=True to split modules into their operations"
    leaves = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_module"})
    if leaves:
        shown = ", ".join(leaves[:4]) + (", ..." if len(leaves) > 4 else "")
        return (f", or pass fewer leaf_modules: {len(leaves)} modules are kept whole, each one "
                f"operation ({shown})")
    return ""

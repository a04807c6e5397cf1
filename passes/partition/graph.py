"""Balanced, contiguous pipeline stages.

Reads:  COST (passes.cost), TIME (passes.timing) for balance="time", and node-time corrections
        measured by balancing (passes.partition.correct) for balance="dynamic"
Writes: STAGE on every compute node
Graph:  unchanged (annotation only)

The graph is first coarsened into atoms (passes.partition.atoms): glue (views, getitem, sizes,
constants: nodes that launch no kernel or produce no tensor) and bookkeeping (integer and boolean
results: counters such as BatchNorm's num_batches_tracked, masks, indices) stay with the node
that produces their input, or the operation they precede, so cuts fall between real operations
and every stage computes. Each atom gets a time (forward + backward + recompute at the
micro-batch size) and each cut the time of the values crossing it (activations forward,
gradients backward); the exact solver in passes.partition.solver minimises the slowest stage,
within a memory limit.
"""
from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import replace

from torch import nn
from torch.fx import GraphModule, Node

from fxpipe import ir
from fxpipe.choices import BALANCE_MODES
from fxpipe.errors import ConfigError, PartitionError
from fxpipe.optimizers import ADAM, OptimizerMemory
from fxpipe.passes.partition.atoms import Atoms, AtomsCache, AtomsKey, atoms_of, measure_atoms
from fxpipe.passes.partition.correct import LOSS
from fxpipe.passes.partition.plan import PartitionPlan, StagePlan
from fxpipe.passes.partition.problem import (
    Partition,
    PartitionProblem,
    evaluate,
    partition_problem,
)
from fxpipe.passes.partition.solver import solve_partition
from fxpipe.passes.remat import is_mutating
from fxpipe.profile import DeviceProfile
from fxpipe.profile.kinds import is_glue
from fxpipe.remat_policy import RematPolicy, remat_policy
from fxpipe.runtime.planning.grid import peak_inflight
from fxpipe.runtime.planning.schedule import ScheduleKind, schedule_kind
from fxpipe.runtime.planning.timeline import SharedWeight, predicted_step

__all__ = ["partition", "StagePlan", "PartitionPlan", "BALANCE_MODES"]


def _with_loss(atoms: Atoms, loss_time: float, loss_bytes: float) -> Atoms:
    """The atoms with the loss's time and kept bytes per micro-batch on the last one (the last
    stage's; new lists: measured atoms are shared through the reuse cache)."""
    return replace(atoms, compute=[*atoms.compute[:-1], atoms.compute[-1] + loss_time],
                   mem_act=[*atoms.mem_act[:-1], atoms.mem_act[-1] + loss_bytes])


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
    loss_bytes: float = 0.0,
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
    loss_bytes: bytes the loss keeps for its backward per micro-batch in flight (never
    recomputed), which the last stage holds beside its activations.
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
        atoms = _with_loss(atoms, loss_time, loss_bytes)
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

    def problem_of(atoms: Atoms, hosts: bool = False) -> PartitionProblem:
        """The one problem the exact costs read; `hosts`: the one the solver reads, whose cuts
        also cost each of their ends the host work of every message crossing them
        (profile.message_overhead) and, where the ranks' own cores move the bytes
        (profile.host_link), the whole transfer rather than half of it, as the schedule's
        simulation charges them."""
        cut_comm = atoms.cut_comm
        if hosts and mode != "params" and (profile.message_overhead or profile.host_link):
            ends = 2.0 if profile.host_link else 1.0  # a stage's load counts half a cut
            cut_comm = [c * ends + profile.message_overhead * (m + g) for c, m, g in
                        zip(atoms.cut_comm, atoms.cut_messages, atoms.cut_gradients)]
        return partition_problem(
            atoms.compute, num_stages, cut_comm=cut_comm, memory_limit=memory_limit,
            mem_fixed=atoms.mem_fixed, mem_act=atoms.mem_act,
            cut_mem=atoms.cut_bytes if policy.recomputes_any else None,
            inflight=inflight)

    problem = problem_of(atoms)
    if cuts is None:
        cuts = solve_partition(problem_of(atoms, hosts=True), least_memory=least_memory).cuts
    if mode == "params":  # balanced on bytes; report the stages in seconds like the others
        atoms = _with_loss(measure_atoms(gm, groups, balance="cost", profile=profile, b=b,
                                         remat=policy, chunks=chunks, optimizer=optimizer),
                           loss_time, loss_bytes)
        problem = problem_of(atoms)
    evaluated = evaluate(problem, cuts)
    fixed = 0.0 if mode == "params" else profile.microbatch_overhead
    # what each remat region's checkpoint call costs where a micro-batch recomputes it
    per_region = 0.0 if mode == "params" else \
        policy.recomputed_share(chunks) * profile.checkpoint_overhead
    plan = _write_stages(groups, cuts, atoms, evaluated, b, chunks, mode, num_stages, fixed,
                         per_region)
    if mode != "params":
        shareable = reuse.shareable if reuse is not None else None
        if shareable is None:
            shareable = shareable_weights(gm)
            if reuse is not None:
                reuse.shareable = shareable
        plan = replace(plan, step_overhead=profile.step_overhead,
                       action_overhead=profile.action_overhead,
                       message_overhead=profile.message_overhead,
                       host_link=profile.host_link,
                       shared=shared_weights(shareable, profile))
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


def shareable_weights(gm: GraphModule) -> list[tuple[list[Node], int]]:
    """The trainable weights that more than one operation uses, as (those operations, the
    weight's bytes): the ones a cut can leave on several stages. A weight is one Parameter
    under whichever names the graph reads it by, as passes.split.shared_parameters finds the
    stages that hold it."""
    users: dict[int, tuple[nn.Parameter, list[Node]]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(str(node.target))(gm)
            if isinstance(value, nn.Parameter) and value.requires_grad:
                users.setdefault(id(value), (value, []))[1].extend(node.users)
    return [(nodes, value.numel() * value.element_size())
            for value, nodes in users.values() if len(nodes) > 1]


def shared_weights(shareable: Sequence[tuple[Sequence[Node], int]], profile: DeviceProfile
                   ) -> tuple[SharedWeight, ...]:
    """Those of the shareable weights whose users the partition put on more than one stage
    (ir.STAGE), each with the seconds of its gradient's all-reduce over 2, 3, ... ranks: a
    ring over R ranks, 2(R-1) steps each moving 1/R of the gradient, each step a send and a
    receive on every rank."""
    found = []
    for users, nbytes in shareable:
        stages = sorted({s for s in (u.meta.get(ir.STAGE) for u in users) if isinstance(s, int)})
        if len(stages) < 2:
            continue
        seconds = []
        for ranks in range(2, len(stages) + 1):
            hops = 2 * (ranks - 1)
            seconds.append(profile.comm_time(hops * nbytes / ranks, hops)
                           + 2 * hops * profile.message_overhead)
        found.append(SharedWeight(tuple(stages), tuple(seconds)))
    return tuple(found)


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

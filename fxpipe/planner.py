"""fxpipe.plan: how many stages and replicas, micro-batches, which schedule and remat, for N
devices.

The model is captured and costed once (the costs are symbolic in the micro-batch size); then
every candidate that uses all N devices is partitioned and its step predicted:

    stages S x replicas R = N          (one stage per device; the looped schedules put
                                        stages_per_rank stages on each of a replica's S ranks)
    micro-batches M: divisors of the replica's share of the batch, B / R
    schedule x remat
    shard: with R > 1, "none" or "optimizer" (ZeRO-1: each replica holds 1/R of the state;
                                        "full" is no candidate: with one FSDP unit per stage
                                        it lowers no step's peak below "optimizer")

A candidate's step is its pipeline's step as the schedule plays the stages' costs
(passes.partition, fxpipe.runtime.planning.simulate), plus the data-parallel all-reduce of the
slowest stage's gradients (a ring over its R replicas, not overlapped with the backward: an upper
bound), over the link between devices of a node or, where a stage's replicas span nodes, the
link between nodes; under shard="optimizer" also the broadcast of each replica's updated part
of the parameters after the step. Its memory is the partition's memory model per device (its
optimizer state split over the replicas under shard="optimizer"). The fastest that fits wins;
`Plan.options` are the arguments `fxpipe.compile` takes for it, and the replicas are the
multiple of its ranks that torchrun starts.
"""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tabulate import tabulate
from torch import nn
from torch.fx import GraphModule

from fxpipe import ir
from fxpipe.built import Snapshot
from fxpipe.config import CompileConfig, check_shard
from fxpipe.errors import ConfigError, FxPipeError, PartitionError
from fxpipe.frontend.capture import CaptureInfo
from fxpipe.losses import loss_saved_bytes, loss_time
from fxpipe.optimizers import ADAM, OptimizerMemory, optimizer_memory
from fxpipe.passes.partition import PartitionPlan, partition
from fxpipe.passes.partition.atoms import AtomsCache, atoms_of
from fxpipe.pipeline import capture_and_cost
from fxpipe.planner_bounds import Bounds, Link
from fxpipe.profile import DeviceProfile, select_profile
from fxpipe.runtime.planning.schedule import (
    SCHEDULES,
    ScheduleKind,
    default_stages_per_rank,
    placement,
)
from fxpipe.units import byte_size, human_bytes

__all__ = ["plan", "planning", "Planning", "Plan", "Candidate", "PlanError"]

REMATS = ("never", "except_last", "always")
SHARDS = ("none", "optimizer")


class PlanError(FxPipeError):
    """No candidate fits the devices."""


@dataclass(frozen=True)
class Candidate:
    """One way to run the model on the devices, and what it is predicted to cost."""

    stages: int  # stage files; ranks = stages / stages_per_rank per replica
    stages_per_rank: int
    replicas: int
    chunks: int
    schedule: str
    remat: str
    shard: str = "none"  # what the replicas split (fxpipe.choices.SHARD_MODES)
    pipeline_s: float = math.inf  # one replica's step as its schedule plays it
    allreduce_s: float = 0.0  # the slowest stage's gradient all-reduce over its replicas
    memory_bytes: float = 0.0  # the most a device holds (the partition's memory model)
    problem: str = ""  # why it cannot run ("" when it can)
    # a lower bound of step_s from the graph's totals (Bounds); a candidate whose bound is no
    # better than a step already found is not partitioned, and its pipeline_s stays inf
    bound_s: float = 0.0

    @property
    def ranks(self) -> int:
        return self.stages // self.stages_per_rank

    @property
    def step_s(self) -> float:
        return self.pipeline_s + self.allreduce_s

    @property
    def fits(self) -> bool:
        return not self.problem

    @property
    def skipped(self) -> bool:
        """Not partitioned: its lower bound was no better than a step already found."""
        return self.fits and math.isinf(self.pipeline_s)


@dataclass(frozen=True)
class Plan:
    """The candidates, fastest first, and the one chosen (the fastest that fits)."""

    devices: int
    batch: int
    memory_per_device: float | None
    candidates: tuple[Candidate, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    optimizer: OptimizerMemory = ADAM  # what each device holds per parameter beyond the weight

    @property
    def choice(self) -> Candidate:
        return self.candidates[0]

    @property
    def options(self) -> dict[str, Any]:
        """The arguments of fxpipe.compile for the choice (its replicas are the multiple of its
        ranks that torchrun starts)."""
        c = self.choice
        out: dict[str, Any] = {"stages": c.stages, "chunks": c.chunks, "schedule": c.schedule,
                               "remat": c.remat}
        if c.stages_per_rank != default_stages_per_rank(c.schedule):
            out["stages_per_rank"] = c.stages_per_rank
        if self.memory_per_device is not None:
            out["memory_limit"] = self.memory_per_device
        if self.optimizer != ADAM:
            out["optimizer"] = self.optimizer
        if c.shard != "none":
            out.update(shard=c.shard, replicas=c.replicas)
        return out

    @property
    def processes(self) -> int:
        """Processes torchrun starts for the choice: its ranks times its replicas."""
        return self.choice.ranks * self.choice.replicas

    def table(self, rows: int = 12) -> str:
        """The best candidates, and why each lost or does not fit."""
        best = self.choice.step_s
        lines = []
        for c in self.candidates[:rows]:
            if not c.fits:
                why = c.problem
            elif c.skipped:
                why = f"at least {c.bound_s / best - 1:+.1%} slower (not partitioned)"
            elif c is self.choice:
                why = "chosen"
            else:
                why = f"{c.step_s / best - 1:+.1%} slower"
            lines.append([c.ranks, c.replicas, c.stages_per_rank, c.chunks, c.schedule, c.remat,
                          c.shard,
                          f"{c.pipeline_s * 1e3:.2f}" if c.fits and not c.skipped else "-",
                          f"{c.allreduce_s * 1e3:.2f}" if c.fits and not c.skipped else "-",
                          f"{c.step_s * 1e3:.2f}" if c.fits and not c.skipped else
                          (f">= {c.bound_s * 1e3:.2f}" if c.skipped else "-"),
                          human_bytes(c.memory_bytes) if c.memory_bytes else "-", why])
        limit = human_bytes(self.memory_per_device) if self.memory_per_device else "no limit"
        fitting = sum(c.fits and not c.skipped for c in self.candidates)
        skipped = sum(c.skipped for c in self.candidates)
        head = (f"fxpipe plan: {self.devices} devices ({limit} each), batch {self.batch}: "
                f"{len(self.candidates)} candidates, {fitting} fit"
                + (f", {skipped} not partitioned (cannot beat the choice)" if skipped else ""))
        text = tabulate(lines, headers=["ranks", "replicas", "stages/rank", "micro-batches",
                                        "schedule", "remat", "shard", "pipeline ms",
                                        "all-reduce ms",
                                        "step ms", "memory/device", ""], tablefmt="github")
        c = self.choice
        tail = ("choice: fxpipe.compile(model, batch, "
                + ", ".join(f"{k}={v!r}" for k, v in self.options.items())
                + f"), run on {self.processes} processes ({c.ranks} ranks x {c.replicas} "
                "replicas)")
        return "\n".join([head, "", text, "", tail, *self.notes]) + "\n"


def plan(model: nn.Module, example_inputs: Any, example_kwargs: dict[str, Any] | None = None,
         *, devices: int, memory_per_device: float | str | None = None,
         profile: DeviceProfile | str | None = None, devices_per_node: int | None = None,
         inter_node_bandwidth: float | None = None,
         schedules: Sequence[str] = tuple(SCHEDULES), remats: Sequence[str] = REMATS,
         max_chunks: int = 64, capture: str = "auto", check: Any = None,
         optimizer: Any = "adam", master_weights: bool = False,
         shards: Sequence[str] = SHARDS, stamp: bool | None = None, prune: bool = True,
         any_fit: bool = False) -> Plan:
    """Chooses stages, replicas, micro-batches, schedule and remat for `devices` devices.

    Args:
        model, example_inputs, example_kwargs: as fxpipe.compile; the example is the global
            batch, which the replicas share.
        devices: how many devices (GPUs, or CPU processes) the run has.
        memory_per_device: bytes a device may hold, or a size such as "80GB" (None: no
            limit).
        profile: the device profile (a preset name such as "h100", a DeviceProfile, or None
            to measure this machine), as fxpipe.compile takes it.
        devices_per_node: devices per machine (None: all on one); a stage's replicas that
            span machines all-reduce over `inter_node_bandwidth` (bytes/s).
        schedules, remats: the schedules and remat modes to consider.
        max_chunks: the most micro-batches per replica to consider.
        optimizer, master_weights: what training holds per parameter, as fxpipe.compile
            takes them (each device is charged its stages' gradients and optimizer state).
        shards: the shard modes to consider with several replicas ("none": each holds all
            the state; "optimizer": ZeRO-1, each holds 1/R of it).
        stamp: capture a run of alike blocks once and stamp the others, as fxpipe.compile's
            stamp (None: when the model's parameters are on the meta device, whose shapes are
            all a plan needs and whose blocks are many).
        prune: leave unpartitioned the candidates that cannot fit or cannot beat the fastest
            found, by lower bounds of their memory and step (Bounds); False partitions every
            one (the same choice, slower).
        any_fit: stop at the first candidate that fits, trying them by their memory bound
            (what fxpipe.sizing.largest_that_fits asks of each size); the plan holds those tried.

    Raises:
        PlanError: no candidate fits (the message names the smallest memory that would).
    """
    return planning(model, example_inputs, example_kwargs, devices=devices,
                    memory_per_device=memory_per_device, profile=profile,
                    devices_per_node=devices_per_node,
                    inter_node_bandwidth=inter_node_bandwidth, schedules=schedules,
                    remats=remats, max_chunks=max_chunks, capture=capture, check=check,
                    optimizer=optimizer, master_weights=master_weights, shards=shards,
                    stamp=stamp, prune=prune).plan(any_fit)


def planning(model: nn.Module, example_inputs: Any,
             example_kwargs: dict[str, Any] | None = None, *, devices: int,
             memory_per_device: float | str | None = None,
             profile: DeviceProfile | str | None = None, devices_per_node: int | None = None,
             inter_node_bandwidth: float | None = None,
             schedules: Sequence[str] = tuple(SCHEDULES), remats: Sequence[str] = REMATS,
             max_chunks: int = 64, capture: str = "auto", check: Any = None,
             optimizer: Any = "adam", master_weights: bool = False,
             shards: Sequence[str] = SHARDS, stamp: bool | None = None,
             prune: bool = True) -> Planning:
    """The model captured and costed once for plan (its arguments), to be planned one or more
    ways (Planning.plan)."""
    memory_per_device = byte_size(memory_per_device, "memory_per_device")
    if not isinstance(devices, int) or devices < 1:
        raise ConfigError(f"devices must be a positive integer (got {devices!r})",
                          hint="pass the number of devices the run has, e.g. devices=8")
    if devices_per_node is not None and (devices_per_node < 1 or devices % devices_per_node):
        raise ConfigError(f"devices_per_node={devices_per_node} does not divide devices="
                          f"{devices}", hint="pass the devices of one machine, e.g. 8")
    spans_nodes = devices_per_node is not None and devices_per_node < devices
    if spans_nodes and inter_node_bandwidth is None:
        raise ConfigError(f"{devices} devices on machines of {devices_per_node} need the "
                          "bandwidth between machines", hint="pass inter_node_bandwidth in "
                          "bytes/s per device, e.g. 25e9 for 200 Gb/s InfiniBand")
    for shard in shards:
        check_shard(shard)
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise ConfigError(f"unknown schedule(s) {unknown}", hint=f"use {tuple(SCHEDULES)}")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) \
        else (example_inputs,)
    held = optimizer_memory(optimizer, master_weights)
    if stamp is None:
        stamp = any(p.is_meta for p in model.parameters())
    config = CompileConfig(capture=capture, check=check, profile=profile, optimizer=held,
                           stamp=stamp)
    gm = capture_and_cost(model, args, dict(example_kwargs or {}), config, list[Snapshot](),
                          {}, {})
    return Planning(gm, select_profile(profile, model, "cpu"),  # as compile on CPU processes
                    held, devices, memory_per_device, devices_per_node, inter_node_bandwidth,
                    tuple(schedules), tuple(remats), max_chunks, tuple(shards), prune)


class Planning:
    """One captured, costed graph and the candidates of `devices` devices: planned once or
    more (fxpipe.sizing.largest_that_fits asks first whether any fits, then for the plan),
    sharing the atoms, the fastest cuts and the schedules' orders between the runs."""

    def __init__(self, gm: GraphModule, profile: DeviceProfile, held: OptimizerMemory,
                 devices: int, memory_per_device: float | None, devices_per_node: int | None,
                 inter_node_bandwidth: float | None, schedules: tuple[str, ...],
                 remats: tuple[str, ...], max_chunks: int, shards: tuple[str, ...],
                 prune: bool) -> None:
        self.gm, self.profile, self.held, self.devices = gm, profile, held, devices
        self.memory_per_device, self.schedules, self.remats = memory_per_device, schedules, remats
        self.max_chunks, self.shards, self.prune = max_chunks, shards, prune
        self.info: CaptureInfo = gm.meta[ir.CAPTURE]
        self.grads = _grad_bytes(gm)
        groups = atoms_of(gm)
        reuse = AtomsCache(groups=groups)  # every candidate partitions the same graph
        self.bounds = Bounds(gm, profile, groups, held, sum(self.grads.values()),
                             Link(devices_per_node, inter_node_bandwidth, profile))
        self.partitions = Partitions(gm, profile, held, reuse)

    def _bounded(self) -> tuple[list[Candidate], list[tuple[Candidate, float, float]]]:
        """Every candidate: those whose memory bound exceeds the devices' (with the reason),
        and the others with the bounds of their step and memory."""
        info, bounds, memory = self.info, self.bounds, self.memory_per_device
        out: list[Candidate] = []
        listed: list[tuple[Candidate, float, float]] = []
        for ranks, replicas in _splits(self.devices):
            if info.batch_size % replicas:
                continue  # the replicas take equal shares of the batch
            share = info.batch_size // replicas
            for chunks, schedule, remat, shard in itertools.product(
                    [m for m in range(1, min(share, self.max_chunks) + 1) if share % m == 0],
                    self.schedules, self.remats, self.shards if replicas > 1 else ("none",)):
                per_rank = default_stages_per_rank(schedule)
                c = Candidate(ranks * per_rank, per_rank, replicas, chunks, schedule, remat,
                              shard)
                least = bounds.memory(c, share // chunks)
                if self.prune and memory is not None and least > memory * (1 + 1e-9):
                    out.append(replace(c, memory_bytes=least, problem="holds at least "
                                       f"{human_bytes(least)} per device"))
                else:
                    listed.append((c, bounds.step(c, share // chunks), least))
        return out, listed

    def plan(self, any_fit: bool = False) -> Plan:
        """The candidates, fastest first (with `any_fit`, up to the first that fits).

        Raises:
            PlanError: no candidate fits.
        """
        gm, info, devices, memory_per_device = self.gm, self.info, self.devices, \
            self.memory_per_device
        pruned, listed = self._bounded()
        found = list(pruned)
        best = math.inf  # the fastest that fits so far: a candidate that cannot beat it is skipped
        # the likeliest to win first; to find any that fits, the likeliest to fit
        for c, least, _ in sorted(listed, key=lambda x: x[2] if any_fit else x[1]):
            if any_fit and best < math.inf:
                break
            if self.prune and least >= best:
                found.append(replace(c, bound_s=least))
                continue
            predicted = _predict(c, info.batch_size // c.replicas // c.chunks, memory_per_device,
                                 self.grads, self.bounds.link, self.partitions, any_fit)
            found.append(replace(predicted, bound_s=least))
            if predicted.fits:
                best = min(best, predicted.step_s)
        for node in ir.compute_nodes(gm.graph):  # the last partition tried wrote its stages
            node.meta.pop(ir.STAGE, None)
        if not found:
            raise PlanError(f"no way to share a batch of {info.batch_size} among replicas on "
                            f"{devices} devices", hint="use a batch that a divisor of the device "
                            "count divides")
        found.sort(key=lambda c: (not c.fits, c.step_s, c.memory_bytes))
        result = Plan(devices, info.batch_size, memory_per_device, tuple(found),
                      (f"profile: {self.profile.name}", f"optimizer: {self.held.describe()}"),
                      self.held)
        if not result.choice.fits:
            needs = [c.memory_bytes for c in found if c.memory_bytes]
            smallest = f" (the least a candidate's fastest cut holds: at least " \
                f"{human_bytes(min(needs))})" if needs else ""
            raise PlanError(f"none of {len(found)} candidates fits "
                            f"{human_bytes(memory_per_device or 0)} per device{smallest}: "
                            f"{found[0].problem}",
                            hint="use more devices, a smaller batch, or a model that fits")
        return result


def _splits(devices: int) -> list[tuple[int, int]]:
    """(pipeline ranks, replicas) using every device."""
    return [(r, devices // r) for r in range(1, devices + 1) if devices % r == 0]


def _grad_bytes(gm: GraphModule) -> dict[str, float]:
    """Bytes of the parameter gradients each compute node first uses."""
    return {n.name: float(ir.evaluate(ir.cost(n).grad_param_bytes, 1))
            for n in ir.compute_nodes(gm.graph) if ir.COST in n.meta}


CutKey = tuple[int, str, int, int, OptimizerMemory]
"""(micro-batch size, remat, micro-batches, stages, optimizer memory as sharded): what the
fastest cut depends on when no memory limit binds (the schedule only sets how many micro-batches
each stage holds; memory breaks ties between equally fast cuts)."""


@dataclass
class Partitions:
    """Partitions one graph for many candidates, reusing what they share: the atoms
    (AtomsCache), each (micro-batch size, remat, chunks, stages)'s fastest cut, solved once
    without a memory limit and evaluated under each schedule (solved again under the limit
    only where it does not fit), and the schedules' orders."""

    gm: GraphModule
    profile: DeviceProfile
    optimizer: OptimizerMemory
    reuse: AtomsCache
    fastest_starts: dict[CutKey, tuple[str, ...]] = field(default_factory=dict)
    """Each key's fastest cut, as the first node of each stage."""
    kinds: dict[str, ScheduleKind] = field(default_factory=dict)
    loss_bytes: dict[int, float] = field(default_factory=dict)
    """What the loss keeps per micro-batch, by micro-batch size."""

    def kind(self, name: str) -> ScheduleKind:
        """The schedule with its orders memoised (candidates differing only in remat play the
        same order)."""
        if name not in self.kinds:
            base = SCHEDULES[name]
            self.kinds[name] = replace(base, order=functools.lru_cache(maxsize=None)(base.order))
        return self.kinds[name]

    def _loss_bytes(self, b: int) -> float:
        if b not in self.loss_bytes:
            self.loss_bytes[b] = loss_saved_bytes(self.gm, b)
        return self.loss_bytes[b]

    def _cut(self, c: Candidate, b: int, limit: float | None,
             starts: tuple[str, ...] | None = None) -> PartitionPlan:
        return partition(self.gm, c.stages, microbatch_size=b, chunks=c.chunks,
                         profile=self.profile, remat=c.remat, memory_limit=limit,
                         schedule=self.kind(c.schedule), ranks=c.ranks,
                         loss_time=loss_time(self.gm, b, self.profile, False),
                         loss_bytes=self._loss_bytes(b), reuse=self.reuse,
                         optimizer=self.optimizer.sharded(c.shard, c.replicas),
                         starts=starts, least_memory=False)  # a cut that does not fit is told

    def fastest(self, c: Candidate, b: int) -> PartitionPlan:
        """The candidate's fastest cut, whatever it holds (PartitionError: none)."""
        key: CutKey = (b, c.remat, c.chunks, c.stages,
                       self.optimizer.sharded(c.shard, c.replicas))
        if key in self.fastest_starts:
            return self._cut(c, b, None, self.fastest_starts[key])
        fastest = self._cut(c, b, None)
        self.fastest_starts[key] = tuple(stage.nodes[0] for stage in fastest.stages)
        return fastest

    def within(self, c: Candidate, b: int, limit: float) -> PartitionPlan:
        """The candidate's fastest cut within `limit` bytes per stage (PartitionError: none)."""
        return self._cut(c, b, limit)


def _predict(c: Candidate, b: int, memory: float | None, grads: dict[str, float], link: Link,
             partitions: Partitions, any_fit: bool = False) -> Candidate:
    """The candidate with its predicted step and memory, or the reason it cannot run. With
    `any_fit` only a cut within the memory is sought (one solve; a candidate that fits none is
    not told what its fastest cut would hold)."""
    limit = memory / c.stages_per_rank if memory is not None else None

    def per_device(p: PartitionPlan) -> float:
        held: dict[int, float] = {}
        for rank, stage in zip(placement(c.schedule, c.stages, c.ranks), p.stages):
            held[rank] = held.get(rank, 0.0) + (stage.memory or 0.0)
        return max(held.values(), default=0.0)

    def over(p: PartitionPlan, limit: float) -> bool:
        return any((stage.memory or 0.0) > limit for stage in p.stages)

    try:
        if any_fit and limit is not None:
            p = partitions.within(c, b, limit)
        else:
            p = partitions.fastest(c, b)
            if limit is not None and over(p, limit):
                fastest = p
                try:
                    p = partitions.within(c, b, limit)
                except PartitionError:  # what its fastest cut would hold, for the table
                    needs = per_device(fastest)
                    return replace(c, memory_bytes=needs, problem="no cut fits; the fastest "
                                   f"holds {human_bytes(needs)} per device")
    except PartitionError as e:
        return replace(c, problem=str(e).splitlines()[0][:90])
    slowest = max(sum(grads.get(n, 0.0) for n in stage.nodes) for stage in p.stages) \
        * c.stages_per_rank
    return replace(c, pipeline_s=p.predicted_step_time, allreduce_s=link.all_reduce(c, slowest),
                   memory_bytes=per_device(p))

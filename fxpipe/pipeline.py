"""build(): the passes in their fixed order, each checked by ir.verify and kept as a snapshot.

    capture          any model -> GraphModule with symbolic shapes      (fxpipe.frontend.capture)
    unroll_rnns      one node per layer of a stacked RNN                 (passes.unroll_rnn)
    defer_batch_norm BatchNorm statistics once per batch, if asked      (passes.batchnorm)
    annotate_costs   FLOPs, bytes, saved activations per node           (passes.cost)
    measure_times    wall time per node, only for balance="time"        (passes.timing)
    partition        balanced contiguous stages                          (passes.partition)
    split_stages     one graph per stage, explicit send/recv            (passes.split)
    mark_remat       recompute regions inside each stage                (passes.remat)
    codegen          readable Python per stage                          (fxpipe.codegen)
"""
from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.fx import GraphModule

from fxpipe import codegen, ir
from fxpipe.built import Built, BuiltStage, Snapshot
from fxpipe.config import AUTO, CompileConfig, check_config
from fxpipe.errors import ConfigError, PartitionError
from fxpipe.frontend.capture import CaptureInfo, capture
from fxpipe.frontend.meta import is_meta_model
from fxpipe.full_gc import full_collections_deferred
from fxpipe.losses import loss_saved_bytes, loss_time
from fxpipe.optimizers import OptimizerMemory
from fxpipe.passes.batch_free import mark_batch_free_outputs
from fxpipe.passes.batchnorm import defer_batch_norm
from fxpipe.passes.cost import annotate_costs
from fxpipe.passes.freq_scaled import freq_scaled_embeddings
from fxpipe.passes.partition import PartitionPlan, choose_chunks, partition
from fxpipe.passes.remat import RematRegion, mark_remat
from fxpipe.passes.split import StageGraph, shared_parameters, split_stages
from fxpipe.passes.timing import measure_times
from fxpipe.passes.unroll_rnn import has_stacked_rnns, unroll_rnns
from fxpipe.profile import DeviceProfile, select_profile
from fxpipe.runtime.execution.amp import compiled_autocast
from fxpipe.runtime.execution.rank import devices_for_stages
from fxpipe.runtime.execution.stagespec import StageSpec
from fxpipe.runtime.planning.schedule import SCHEDULES
from fxpipe.runtime.planning.timeline import predicted_events, predicted_step
from fxpipe.runtime.program.spec import ProgramSpec
from fxpipe.stage_header import stage_header

__all__ = ["build", "rebuild", "PlanAgreement", "broadcast_plan"]

PlanAgreement = Callable[[GraphModule, PartitionPlan], PartitionPlan]
"""Makes every process use the same partition (rank 0's), writing its STAGE on the graph."""


def _debug_level() -> int:
    return int(os.environ.get("FXPIPE_DEBUG", "0") or 0)


@full_collections_deferred()
def build(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], config: CompileConfig,
          *, agree: PlanAgreement | None = None,
          cut: Callable[[GraphModule], Sequence[str]] | None = None) -> Built:
    """Runs every pass on `model` for the example batch (args, kwargs), under the program's
    autocast (config.autocast) as its stages will run: capture then records the dtypes they
    compute and send, the costs count those bytes, and the profile is chosen for that
    precision. `cut`: the first node of each stage, given the captured graph, instead of a
    solved cut."""
    check_config(config)
    devices = [torch.device("cpu"), _profile_device(config)]
    with compiled_autocast(config.autocast, [d for d in devices if d.type in ("cpu", "cuda")]):
        return _build(model, args, kwargs, config, agree, cut)


def _build(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
           config: CompileConfig, agree: PlanAgreement | None,
           cut: Callable[[GraphModule], Sequence[str]] | None) -> Built:
    if config.balance == "time" and is_meta_model(model):
        raise ConfigError("balance='time' measures every node on real tensors, and "
                          f"{type(model).__name__} is on the meta device",
                          hint="use balance='cost' (the cost model, with profile=...)")
    history: list[Snapshot] = []
    timings: dict[str, float] = {}
    cpu: dict[str, float] = {}  # CPU seconds per pass: wall time is noisy on a shared machine
    gm = capture_and_cost(model, args, kwargs, config, history, timings, cpu)
    info: CaptureInfo = gm.meta[ir.CAPTURE]
    profile = select_profile(config.profile, model, _profile_device(config))
    if config.balance == "time":
        # Measured on real tensors at the micro-batch size the partition will use.
        with _timed(timings, cpu, "measure_times"):
            _measure_where_stages_run(gm, info.signature.flatten_inputs(args, kwargs),
                                      _profile_device(config),
                                      max(1, info.batch_size // (config.fixed_chunks or 1)))
    return _stages(gm, config, profile, type(model).__name__, history, timings, agree, {},
                   cut(gm) if cut is not None else None, cpu=cpu)


@full_collections_deferred()
def capture_and_cost(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     config: CompileConfig, history: list[Snapshot], timings: dict[str, float],
                     cpu: dict[str, float]) -> GraphModule:
    """The passes before any cut: capture, unroll_rnns, defer_batch_norm and annotate_costs.
    Their graph serves every partition of the model (fxpipe.planner tries many)."""
    # The graph everything else works on; functional so that stage code is self-contained.
    with _timed(timings, cpu, "capture"):
        gm = capture(model, args, kwargs, method=config.capture,
                     leaf_modules=config.leaf_modules, inline_modules=True, check=config.check,
                     batch_dims=config.batch_dims, stamp=config.stamp)
        ir.verify(gm, after="capture")
    # the captured code is generated when first read (fxpipe.frontend.lazy_code), unless a
    # pass below is about to rewrite the graph
    changes = config.deferred_batch_norm or has_stacked_rnns(gm)
    _snapshot(history, "capture", gm, lazy=not changes)
    # Before costs and cuts: a stacked RNN is one node, which no cut could enter.
    with _timed(timings, cpu, "unroll_rnns"):
        unrolled = unroll_rnns(gm)
    if unrolled:
        _snapshot(history, "unroll_rnns", gm)
    else:  # the stage headers list the passes that changed something
        timings.pop("unroll_rnns")
        cpu.pop("unroll_rnns")
    if config.deferred_batch_norm:
        # Before costs and cuts: the rewritten op is what the stages will run.
        with _timed(timings, cpu, "defer_batch_norm"):
            defer_batch_norm(gm)
        _snapshot(history, "defer_batch_norm", gm)
    # Costs are symbolic in the micro-batch size, so chunks can be chosen without re-tracing.
    with _timed(timings, cpu, "annotate_costs"):
        annotate_costs(gm)
        ir.verify(gm, after="cost")
    mark_batch_free_outputs(gm)  # after the costs, which say which nodes draw random numbers
    return gm


@full_collections_deferred()
def rebuild(built: Built, corrections: Mapping[str, float], *,
            agree: PlanAgreement | None = None, starts: Sequence[str] | None = None) -> Built:
    """Partitions the captured graph again with node times corrected by measurement
    (node name -> factor; "(loss)" for the loss), or at the given cut (the first node of each
    stage), then splits, remats and generates as build() does. The number of micro-batches
    stays the one `built` runs with."""
    gm = built.captured
    config = replace(built.config, chunks=built.spec.chunks)
    for node in ir.compute_nodes(gm.graph):
        node.meta.pop(ir.STAGE, None)
    history = [s for s in built.history if not s.after.startswith("split_stages")]
    again = ("partition", "split_stages", "mark_remat", "codegen")
    timings = {k: v for k, v in built.timings.items() if k not in again}
    cpu = {k: v for k, v in built.cpu_timings.items() if k not in again}
    return _stages(gm, config, built.profile, built.model_name, history, timings, agree,
                   dict(corrections), starts, cpu=cpu)


def _stages(gm: GraphModule, config: CompileConfig, profile: DeviceProfile, model_name: str,
            history: list[Snapshot], timings: dict[str, float], agree: PlanAgreement | None,
            corrections: dict[str, float], starts: Sequence[str] | None = None, *,
            cpu: dict[str, float]) -> Built:
    """partition, split_stages, mark_remat and codegen on an annotated graph."""
    info: CaptureInfo = gm.meta[ir.CAPTURE]
    with _timed(timings, cpu, "partition"):
        plan, config = _partition(gm, config, info.batch_size, profile, corrections, starts)
        _check_joinable(info, plan.chunks)
        _check_gradients_split(gm, plan.chunks)
        if agree is not None:
            plan = agree(gm, plan)
        ir.verify(gm, after="partition")
    # Stage graphs are new modules: the captured graph stays whole for reports and checks.
    with _timed(timings, cpu, "split_stages"):
        graphs = split_stages(gm, config.stages)
        for g in graphs:
            ir.verify(g.graph_module, after="split")
        shared = shared_parameters(graphs)
    stages = []
    # memory_limit is per rank: each of a rank's stages fits an equal share, as partitioned
    share = config.memory_limit / config.per_rank if config.memory_limit else None
    for g in graphs:
        with _timed(timings, cpu, "mark_remat"):
            regions = mark_remat(g.graph_module, config.remat_policy,
                                 microbatch_size=plan.microbatch_size, inflight=plan.chunks,
                                 memory_limit=share,
                                 fixed_bytes=_fixed_bytes(g, config.optimizer))
            ir.verify(g.graph_module, after="remat")
        _snapshot(history, f"split_stages + mark_remat: stage {g.index}", g.graph_module,
                  lazy=True)
        ran = (*(name for name in timings if name != "codegen"), "codegen")
        with _timed(timings, cpu, "codegen"):
            stages.append(_generate(g, regions, plan, config, model_name, gm, shared, ran))
    spec = _runtime_plan(graphs, plan, config, info, model_name, shared)
    built = Built(gm, plan, stages, profile, config, spec, history, timings,
                  model_name=model_name, corrections=corrections, cpu_timings=cpu)
    if _debug_level():
        print("[fxpipe] " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
        print("[fxpipe] capture: " + ", ".join(f"{k} {v:.2f}s" for k, v in info.timings))
    return built


def _check_joinable(info: CaptureInfo, chunks: int) -> None:
    """Refuses outputs that no call could return: each call joins its micro-batches' outputs
    along the batch dimension, and a tensor without one (a loss the model computes from
    `labels=`, a mean over the batch) has no such join."""
    unjoinable = info.signature.unjoinable_outputs()
    if chunks == 1 or not unjoinable:
        return
    names = ", ".join(unjoinable[:4]) + (f" and {len(unjoinable) - 4} more"
                                         if len(unjoinable) > 4 else "")
    labels = "labels" in info.signature.keywords
    raise ConfigError(
        f"{names} of the model has no batch dimension, so the values of {chunks} micro-batches "
        "cannot be joined into the batch's (a loss over the batch is not the concatenation of "
        "its micro-batches' losses)",
        hint=("compile without labels= (a transformers model then returns its logits and no "
              "loss) and pass the targets to the step instead: program.step(inputs, "
              "target=next_tokens), the default loss being cross-entropy"
              if labels else
              "return per-example values from forward and compute the loss in the step "
              "(program.step(inputs, target=y, loss_fn=...))") + ", or compile with chunks=1")


def _check_gradients_split(gm: GraphModule, chunks: int) -> None:
    """Refuses embeddings whose gradient counts each index's occurrences in the batch: over
    several micro-batches it would count each one's (fxpipe.passes.freq_scaled)."""
    scaled = freq_scaled_embeddings(gm) if chunks > 1 else []
    if not scaled:
        return
    names = ", ".join(scaled[:4]) + (f" and {len(scaled) - 4} more" if len(scaled) > 4 else "")
    raise ConfigError(
        f"{names} scales its embedding's gradient by how often each index occurs in the batch "
        f"(scale_grad_by_freq=True); a pipeline runs the backward of each of its {chunks} "
        "micro-batches apart, so it would count each micro-batch's occurrences and give other "
        "gradients than the plain model",
        hint="construct the embedding with scale_grad_by_freq=False, or compile with chunks=1")


def _profile_device(config: CompileConfig) -> torch.device:
    """Where the stages run, which is where the profile must be measured: this rank's GPU
    under NCCL, else the first stage's device."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return devices_for_stages([0], config.devices)[0]  # the first rank's


def _measure_where_stages_run(gm: GraphModule, flat: list[torch.Tensor], device: torch.device,
                              b: int) -> None:
    """balance="time": every node timed on the device the stages run on (a copy of the graph
    there when the model is elsewhere, e.g. on the CPU for stages on GPUs)."""
    inputs = [t.to(device) for t in flat]
    if {t.device for t in [*gm.parameters(), *gm.buffers()]} <= {device}:
        measure_times(gm, inputs, microbatch_size=b)
        return
    times = measure_times(copy.deepcopy(gm).to(device), inputs, microbatch_size=b)
    for node in ir.compute_nodes(gm.graph):
        node.meta[ir.TIME] = times[node.name]


def _snapshot(history: list[Snapshot], after: str, gm: GraphModule, lazy: bool = False) -> None:
    """`lazy`: the graph is not changed afterwards, so its code can be read when asked for."""
    history.append(Snapshot(after, gm if lazy else gm.code))
    level = _debug_level()
    if level:
        print(f"[fxpipe] {after}: {len(gm.graph.nodes)} nodes")
        if level >= 2:
            print(gm.print_readable(print_output=False))


@contextlib.contextmanager
def _timed(timings: dict[str, float], cpu: dict[str, float], name: str) -> Iterator[None]:
    """Adds the block's wall seconds to timings[name] and its CPU seconds to cpu[name]."""
    start, start_cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
        cpu[name] = cpu.get(name, 0.0) + time.process_time() - start_cpu


def _partition(gm: GraphModule, config: CompileConfig, batch: int, profile: DeviceProfile,
               corrections: dict[str, float], starts: Sequence[str] | None
               ) -> tuple[PartitionPlan, CompileConfig]:
    """The plan and the config with its schedule resolved: config.schedule, or for "auto" the
    schedule whose simulated step (the stages' costs played by the schedule) is the fastest
    among those that fit the memory limit (each keeps its own number of micro-batches in
    flight), on the same number of ranks."""
    balance: str | list[int] = config.balance if isinstance(config.balance, str) \
        else list(config.balance)

    def plan_for(candidate: CompileConfig) -> PartitionPlan:
        def for_chunks(chunks: int) -> PartitionPlan:
            b = batch // chunks
            limit = config.memory_limit / candidate.per_rank if config.memory_limit else None
            return partition(gm, candidate.stages, microbatch_size=b, chunks=chunks,
                             profile=profile, balance=balance, split_points=config.split_points,
                             remat=config.remat_policy, memory_limit=limit,
                             schedule=candidate.schedule_kind, ranks=candidate.ranks,
                             loss_time=loss_time(gm, b, profile, config.balance == "time",
                                                 _profile_device(config)),
                             loss_bytes=loss_saved_bytes(gm, b),
                             corrections=corrections, starts=starts,
                             optimizer=config.optimizer)
        return choose_chunks(batch, config.chunks, for_chunks)

    if config.schedule != AUTO:
        resolved = replace(config, stages_per_rank=config.per_rank)
        return plan_for(resolved), resolved
    plans: dict[str, tuple[PartitionPlan, CompileConfig]] = {}
    times: list[tuple[str, float | None]] = []
    failure: PartitionError | None = None
    for candidate in _auto_candidates(config):
        name = candidate.schedule
        try:
            plans[name] = (plan_for(candidate), candidate)
        except PartitionError as e:  # no partition fits the memory limit, or too few atoms
            failure = failure or e
            times.append((name, None))
            continue
        times.append((name, predicted_step(plans[name][0], candidate.schedule_kind,
                                           candidate.ranks)[0]))
    fits = [(t, name) for name, t in times if t is not None]
    if not fits:
        assert failure is not None
        raise failure
    chosen = plans[min(fits)[1]][1]
    for node in ir.compute_nodes(gm.graph):  # the last partition tried wrote its stages
        node.meta.pop(ir.STAGE, None)
    plan = plan_for(chosen)
    return replace(plan, schedules=tuple(times)), chosen


def _auto_candidates(config: CompileConfig) -> list[CompileConfig]:
    """Every schedule on config's number of ranks: the flat ones with a stage per rank, the
    looped ones with stages_per_rank (if given, else 2) stages per rank."""
    ranks = config.ranks
    out = []
    for name, kind in SCHEDULES.items():
        per_rank = kind.stages_per_rank_for(config.per_rank)
        out.append(replace(config, schedule=name, stages=ranks * per_rank,
                           stages_per_rank=per_rank))
    return out


def _fixed_bytes(g: StageGraph, optimizer: OptimizerMemory) -> float:
    """What a stage holds whatever it recomputes: its parameters and buffers, and for the
    trainable ones their gradients and the optimizer's state. The partition's
    StagePlan.held_bytes is the same sum but for a weight tied across stages, which it counts
    once, in the stage that first uses it; on its own rank every stage holding one holds a copy
    with its gradient and optimizer state, so remat="auto" is charged it here wherever it is
    held (tests/test_remat.py pins the difference)."""
    module = g.graph_module
    trainable = [p for p in module.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in trainable)
    # buffers counted with the parameters, as the cost model counts them (fxpipe.ir)
    return float(optimizer.weight_bytes(sum(t.numel() * t.element_size()
                                            for t in [*module.parameters(), *module.buffers()]))
                 + optimizer.held_bytes(grads, sum(p.numel() for p in trainable)))


def _generate(g: StageGraph, regions: list[RematRegion], plan: PartitionPlan,
              config: CompileConfig, model_name: str, captured: GraphModule,
              shared: dict[str, list[int]], passes: tuple[str, ...]) -> BuiltStage:
    header = stage_header(g, regions, plan, config, model_name, shared, passes)
    text = codegen.generate_stage(g.graph_module, header, class_name=_class_name(g.index),
                                  qualnames=captured.meta.get(ir.QUALNAMES, {}))
    return BuiltStage(g, text, regions)


def _class_name(index: int) -> str:
    """The class a stage's generated code defines."""
    return f"Stage{index}"


def _runtime_plan(graphs: Sequence[StageGraph], plan: PartitionPlan, config: CompileConfig,
                  info: CaptureInfo, model_name: str,
                  shared: dict[str, list[int]]) -> ProgramSpec:
    """What everything after the compiler runs by: made here once (the runtime's one road to
    chunks, schedule and remat), written as program.json as it is."""
    names = [leaf.name for leaf in info.signature.tensor_leaves]
    stages = tuple(StageSpec(
        g.index, f"stage_{g.index}.py", _class_name(g.index),
        tuple(names.index(n) for n in g.inputs),
        g.carries_rng or any(ir.cost(n).random for n in ir.compute_nodes(g.graph_module.graph)
                             if ir.COST in n.meta),
        g.recvs, g.sends) for g in graphs)
    edges = tuple(sorted({(c.tag, st.index, c.peer) for st in stages for c in st.sends}))
    return ProgramSpec(
        model=model_name, stages=stages, chunks=plan.chunks, remat=config.remat,
        schedule=config.schedule, signature=info.signature, shared=shared, edges=edges,
        autocast=config.autocast, stages_per_rank=config.per_rank, shard=config.shard,
        predicted_events=tuple(e.to_json() for e in predicted_events(
            plan, config.schedule, config.ranks)))


def broadcast_plan(gm: GraphModule, plan: PartitionPlan) -> PartitionPlan:
    """Every rank uses rank 0's partition (measured profiles differ between processes)."""
    stages = {n.name: n.meta[ir.STAGE] for n in ir.compute_nodes(gm.graph)}
    payload: list[Any] = [stages, plan]
    dist.broadcast_object_list(payload, src=0)
    stages, agreed = payload
    for node in ir.compute_nodes(gm.graph):
        node.meta[ir.STAGE] = stages[node.name]
    result: PartitionPlan = agreed
    return result

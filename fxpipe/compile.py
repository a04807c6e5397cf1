"""compile(): the passes in their fixed order, each checked by ir.verify and kept as a snapshot.

    capture          any model -> GraphModule with symbolic shapes      (fxpipe.capture)
    annotate_costs   FLOPs, bytes, saved activations per node           (passes.cost)
    measure_times    wall time per node, only for balance="time"        (passes.timing)
    partition        balanced contiguous stages                          (passes.partition)
    split_stages     one graph per stage, explicit send/recv            (passes.split)
    mark_remat       recompute regions inside each stage                (passes.remat)
    codegen          readable Python per stage                          (fxpipe.codegen)
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from fxpipe import codegen, ir
from fxpipe.capture import METHODS, capture
from fxpipe.errors import ConfigError, PartitionError
from fxpipe.passes.batchnorm import defer_batch_norm
from fxpipe.passes.cost import annotate_costs
from fxpipe.passes.partition import BALANCE_MODES, PartitionPlan, partition
from fxpipe.passes.remat import REMAT_MODES, RematRegion, mark_remat
from fxpipe.passes.split import StageGraph, shared_parameters, split_stages
from fxpipe.profile import DeviceProfile, get_profile
from fxpipe.runtime.schedule import SCHEDULES

__all__ = ["CompileConfig", "Snapshot", "BuiltStage", "Built", "build", "check_config"]

_DEBUG = int(os.environ.get("FXPIPE_DEBUG", "0") or 0)


@dataclass(frozen=True)
class CompileConfig:
    stages: int = 2
    chunks: int | str = 4
    remat: str = "except_last"
    balance: str | tuple[int, ...] = "cost"
    split_points: tuple[str, ...] | None = None
    memory_limit: float | None = None
    devices: tuple[str, ...] | None = None
    capture: str = "auto"
    schedule: str = "gpipe"
    profile: Any = None  # DeviceProfile, preset name, or None (measured)
    leaf_modules: tuple[Any, ...] = ()
    deferred_batch_norm: bool = False
    check_finite: bool = False
    dp_bucket_mb: float = 25.0  # data-parallel gradient buckets; 0 averages after the backward
    command: str | None = None  # how to regenerate, shown in stage headers


@dataclass(frozen=True)
class Snapshot:
    """The graph after one pass, as print_readable() shows it (cf. thunder.last_traces)."""

    after: str
    text: str


@dataclass
class BuiltStage:
    index: int
    graph_module: GraphModule
    source: str
    class_name: str
    regions: list[RematRegion]
    graph: StageGraph
    random: bool
    input_indexes: tuple[int, ...]


@dataclass
class Built:
    captured: GraphModule
    plan: PartitionPlan
    stages: list[BuiltStage]
    shared: dict[str, list[int]]
    profile: DeviceProfile
    config: CompileConfig
    history: list[Snapshot] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per pass

    @property
    def signature(self) -> Any:
        return self.captured.meta[ir.CAPTURE].signature

    @property
    def edges(self) -> list[tuple[str, int, int]]:
        return sorted({(c.tag, s.index, c.peer) for s in self.stages for c in s.graph.sends})


def check_config(config: CompileConfig) -> None:
    """Rejects bad arguments before any work is done, with the values and a fix."""
    if not isinstance(config.stages, int) or isinstance(config.stages, bool) or config.stages < 1:
        raise ConfigError(f"stages must be an integer >= 1 (got {config.stages!r})",
                          hint="use stages=2 or more to pipeline, 1 to run unsplit")
    if config.chunks != "auto" and (not isinstance(config.chunks, int) or config.chunks < 1):
        raise ConfigError(f"chunks must be an integer >= 1 or 'auto' (got {config.chunks!r})",
                          hint="chunks is the number of micro-batches per batch, e.g. 4 x stages")
    if config.remat not in REMAT_MODES:
        raise ConfigError(f"unknown remat mode {config.remat!r}", hint=f"use one of {REMAT_MODES}")
    if isinstance(config.balance, str) and config.balance not in BALANCE_MODES:
        raise ConfigError(f"unknown balance mode {config.balance!r}",
                          hint=f"use one of {BALANCE_MODES} or a list of node counts per stage")
    if config.schedule not in SCHEDULES:
        raise ConfigError(f"unknown schedule {config.schedule!r}",
                          hint=f"use one of {tuple(SCHEDULES)}")
    if config.capture not in METHODS:
        raise ConfigError(f"unknown capture method {config.capture!r}", hint=f"use one of {METHODS}")
    if config.memory_limit is not None and not config.memory_limit > 0:
        raise ConfigError(f"memory_limit must be a positive number of bytes (got "
                          f"{config.memory_limit!r})", hint="e.g. memory_limit=8 * 2**30")
    if config.remat == "auto" and config.memory_limit is None:
        raise ConfigError("remat='auto' chooses what to recompute to fit memory_limit, "
                          "but no memory_limit was given",
                          hint="pass memory_limit (bytes per stage), or remat='always'")
    if not isinstance(config.dp_bucket_mb, (int, float)) or not config.dp_bucket_mb >= 0:
        raise ConfigError(f"dp_bucket_mb must be a number >= 0 (got {config.dp_bucket_mb!r})",
                          hint="use e.g. 25 (DDP's default), or 0 to average after the backward")
    if config.devices is not None and len(config.devices) < config.stages:
        raise ConfigError(f"fewer devices than stages ({len(config.devices)} < {config.stages})",
                          hint=f"give {config.stages} devices (e.g. ['cpu'] * {config.stages}), "
                               "or fewer stages")


def _snapshot(built_history: list[Snapshot], after: str, gm: GraphModule) -> None:
    text = gm.code  # generated by fx at recompile: a snapshot costs no extra work
    built_history.append(Snapshot(after, text))
    if _DEBUG:
        print(f"[fxpipe] {after}: {len(gm.graph.nodes)} nodes")
        if _DEBUG >= 2:
            print(gm.print_readable(print_output=False))


def build(model: nn.Module, args: tuple, kwargs: dict, config: CompileConfig, *,
          agree: Any = None) -> Built:
    """Runs every pass on `model` for the example batch (args, kwargs).

    agree(gm, plan) -> plan, when given, makes every process use the same partition.
    """
    check_config(config)
    history: list[Snapshot] = []
    timings: dict[str, float] = {}
    # The graph everything else works on; functional so that stage code is self-contained.
    with _timed(timings, "capture"):
        gm = capture(model, args, kwargs, method=config.capture,
                     leaf_modules=config.leaf_modules, inline_modules=True)
        ir.verify(gm, after="capture")
    _snapshot(history, "capture", gm)
    if config.deferred_batch_norm:
        # Before costs and cuts: the rewritten op is what the stages will run.
        with _timed(timings, "defer_batch_norm"):
            defer_batch_norm(gm)
        _snapshot(history, "defer_batch_norm", gm)
    # Costs are symbolic in the micro-batch size, so chunks can be chosen without re-tracing.
    with _timed(timings, "annotate_costs"):
        annotate_costs(gm)
        ir.verify(gm, after="cost")
    info = gm.meta[ir.CAPTURE]
    profile = get_profile(config.profile, _profile_device(config))
    if config.balance == "time":
        from fxpipe.passes.timing import measure_times

        with _timed(timings, "measure_times"):
            measure_times(gm, info.signature.flatten_inputs(args, kwargs),
                          microbatch_size=max(1, info.batch_size // _fixed_chunks(config, 1)))
    with _timed(timings, "partition"):
        plan = _partition(gm, config, info.batch_size, profile)
        if agree is not None:
            plan = agree(gm, plan)
        ir.verify(gm, after="partition")
    config = replace(config, chunks=plan.chunks)
    # Stage graphs are new modules: the captured graph stays whole for reports and checks.
    with _timed(timings, "split_stages"):
        graphs = split_stages(gm, config.stages)
        for g in graphs:
            ir.verify(g.graph_module, after="split")
        shared = shared_parameters(graphs)
    stages = []
    for g in graphs:
        with _timed(timings, "mark_remat"):
            regions = mark_remat(g.graph_module, config.remat,
                                 microbatch_size=plan.microbatch_size, inflight=plan.chunks,
                                 memory_limit=config.memory_limit, fixed_bytes=_fixed_bytes(g))
            ir.verify(g.graph_module, after="remat")
        _snapshot(history, f"split_stages + mark_remat: stage {g.index}", g.graph_module)
        with _timed(timings, "codegen"):
            stages.append(_generate(g, regions, plan, config, info, model, gm))
    built = Built(gm, plan, stages, shared, profile, config, history)
    built.timings = timings
    if _DEBUG:
        print("[fxpipe] " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
    return built


@contextlib.contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def _profile_device(config: CompileConfig) -> str:
    if config.devices:
        return str(config.devices[0])
    return "cpu"


def _fixed_chunks(config: CompileConfig, default: int) -> int:
    return config.chunks if isinstance(config.chunks, int) else default


def _loss_time(gm: GraphModule, b: int, profile: DeviceProfile, measured: bool) -> float:
    """Seconds per micro-batch of the default loss on the first floating output (forward and
    backward): the last stage runs it after the model, so the partition must count it."""
    outputs = next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes
    infos = [n.meta.get(ir.TENSOR) for n in outputs]
    info = next((i for i in infos if isinstance(i, ir.TensorInfo) and i.is_float), None)
    if info is None:
        return 0.0
    shape = info.concrete_shape(b)
    if measured:
        from fxpipe.losses import default_loss
        from fxpipe.profile import median_time

        logits = torch.randn(shape, requires_grad=True)
        target = torch.zeros(shape[:-1], dtype=torch.long) if len(shape) > 1 else None

        def run() -> None:
            default_loss(logits, target).backward()

        return median_time(run, warmup=2, repeat=5)
    numel = float(ir.evaluate(info.numel, b))
    # log-softmax, gather and mean forward; their gradients backward: ~3 kernels each way
    return 2 * profile.compute_time(6 * numel, 3 * numel * info.dtype.itemsize, kernels=3)


def _partition(gm: GraphModule, config: CompileConfig, batch: int,
               profile: DeviceProfile) -> PartitionPlan:
    kwargs = dict(profile=profile, balance=config.balance if isinstance(config.balance, str)
                  else list(config.balance), split_points=config.split_points,
                  remat=config.remat, memory_limit=config.memory_limit, schedule=config.schedule)

    def plan_for(chunks: int) -> PartitionPlan:
        loss = _loss_time(gm, batch // chunks, profile, config.balance == "time")
        return partition(gm, config.stages, microbatch_size=batch // chunks, chunks=chunks,
                         loss_time=loss, **kwargs)

    if config.chunks != "auto":
        chunks = config.chunks
        if chunks > batch:
            raise ConfigError(f"chunks ({chunks}) is larger than the batch size ({batch})",
                              hint=f"use chunks <= {batch}, or a larger example batch")
        if batch % chunks:
            divisors = [d for d in range(1, batch + 1) if batch % d == 0]
            raise ConfigError(f"batch size {batch} cannot be split into {chunks} equal "
                              "micro-batches", hint=f"use chunks in {divisors} (or chunks='auto')")
        return plan_for(chunks)
    candidates, best = [], None
    for chunks in [d for d in range(1, batch + 1) if batch % d == 0]:
        try:
            plan = plan_for(chunks)
        except PartitionError:
            continue
        candidates.append((chunks, plan.predicted_step_time))
        if best is None or plan.predicted_step_time < best.predicted_step_time:
            best = plan
    if best is None:
        raise PartitionError(f"no number of micro-batches (divisors of {batch}) gives a feasible "
                             "partition", hint="raise memory_limit or use more stages")
    plan = plan_for(best.chunks)  # again, so the STAGE metadata is the chosen plan's
    return replace(plan, candidates=tuple(candidates))


def _fixed_bytes(g: StageGraph) -> float:
    params = [v for v in g.graph_module.parameters()]
    return float(sum(p.numel() * p.element_size() for p in params))


_RANDOM_MARKERS = ("dropout", "bernoulli", "rand", "normal", "multinomial", "uniform")


def _is_random(gm: GraphModule) -> bool:
    """Whether a stage draws random numbers (then each micro-batch gets its own RNG stream)."""
    for node in gm.graph.nodes:
        if node.op == "call_module":
            return True  # opaque: assume it may draw random numbers
        if node.op in ("call_function", "call_method"):
            name = str(node.target).lower()
            if any(marker in name for marker in _RANDOM_MARKERS) and not _inactive_dropout(node):
                return True
    return False


def _inactive_dropout(node: Any) -> bool:
    """dropout(x, p=0) or dropout in eval mode draws nothing."""
    if "dropout" not in str(node.target).lower():
        return False
    args = list(node.args) + [None] * 4
    p = node.kwargs.get("p", args[1])
    training = node.kwargs.get("training", node.kwargs.get("train", args[2]))
    return p == 0 or training is False


def _generate(g: StageGraph, regions: list[RematRegion], plan: PartitionPlan,
              config: CompileConfig, info: Any, model: nn.Module,
              info_graph: GraphModule) -> BuiltStage:
    from fxpipe.report import stage_header

    b = plan.microbatch_size
    total = sum(float(ir.evaluate(ir.cost(n).fwd_flops, b))
                for n in ir.compute_nodes(info_graph.graph) if ir.COST in n.meta)
    header = stage_header(g, regions, plan, config, type(model).__name__, total)
    class_name = f"Stage{g.index}"
    text = codegen.generate_stage(g.graph_module, header, class_name=class_name,
                                  qualnames=info_graph.meta.get(ir.QUALNAMES, {}))
    names = [leaf.name for leaf in info.signature.tensor_leaves]
    indexes = tuple(names.index(n) for n in g.inputs)
    return BuiltStage(g.index, g.graph_module, text, class_name, regions, g,
                      _is_random(g.graph_module), indexes)


def devices_for(config: CompileConfig) -> list[torch.device]:
    """One device per stage: as given, else CUDA devices when there are enough, else CPU."""
    if config.devices is not None:
        return [torch.device(d) for d in config.devices[: config.stages]]
    if torch.cuda.is_available() and torch.cuda.device_count() >= config.stages:
        return [torch.device("cuda", i) for i in range(config.stages)]
    return [torch.device("cpu")] * config.stages


def parse_balance(balance: str | Sequence[int]) -> str | tuple[int, ...]:
    return balance if isinstance(balance, str) else tuple(balance)


def compile(  # noqa: A001 - the name users know from torch.compile
    model: nn.Module,
    example_inputs: Any = None,
    *,
    example_kwargs: dict[str, Any] | None = None,
    stages: int = 2,
    chunks: int | str = 4,
    remat: str = "except_last",
    balance: str | Sequence[int] = "cost",
    split_points: Sequence[str] | None = None,
    memory_limit: float | None = None,
    devices: Sequence[str | torch.device] | None = None,
    capture: str = "auto",  # noqa: F811 - the capture method, as users spell it
    schedule: str = "gpipe",
    profile: Any = None,
    leaf_modules: Sequence[Any] = (),
    deferred_batch_norm: bool = False,
    check_finite: bool = False,
    dp_bucket_mb: float = 25.0,
    command: str | None = None,
) -> Any:
    """Compiles `model` into a GPipe pipeline of `stages` stages.

    Args:
        model: any nn.Module (its train/eval mode is captured).
        example_inputs: a batch (tensor or tuple). Without it the program is built on its first
            call from that call's inputs, as torch.compile does.
        example_kwargs: keyword inputs of the example batch.
        stages: number of pipeline stages (devices, or processes under torchrun).
        chunks: micro-batches per batch, or "auto" to pick the divisor of the batch size with
            the best predicted step time.
        remat: "except_last" (GPipe's default), "always", "never", or "auto" (fit memory_limit
            with the least recomputation).
        balance: "cost" (cost model), "time" (measured per node), "params", or a list of node
            counts per stage.
        split_points: qualified module names where stages 1.. begin (instead of balancing).
        memory_limit: bytes per stage the partition (and remat="auto") must respect.
        devices: one device per stage for the local executor (default: CUDA if enough, else CPU).
        capture: "auto", "fx" or "export" (see fxpipe.capture).
        schedule: "gpipe" (fill-drain) or "1f1b" (same bubble, fewer activations in flight).
        profile: a DeviceProfile, a preset name ("a100", "h100", ...), or None to measure.
        leaf_modules: modules to keep opaque when tracing.
        deferred_batch_norm: update BatchNorm running statistics once per batch, from all its
            micro-batches (equal to the plain model's), instead of once per micro-batch.
        check_finite: after every stage forward, check for NaN/Inf and name the stage,
            micro-batch and node where they first appear.
        dp_bucket_mb: with data-parallel replicas (torchrun with a multiple of `stages`
            processes), gradients are averaged in buckets of this size while the last backward
            still runs, as DDP does; 0 averages them after it.
        command: the command that regenerates the program, shown in stage headers.

    Returns:
        A Program: call it like the model (drop-in, differentiable), `step()` it to train
        (locally or under torchrun), `report()` it, `write()` its code.

    Example:
        >>> model, (x,) = fxpipe.models.mlp.build()
        >>> program = fxpipe.compile(model, (x,), stages=2, chunks=4)
        >>> program(x).shape
        torch.Size([8, 10])
    """
    from fxpipe.program import Program

    config = CompileConfig(
        stages=stages, chunks=chunks, remat=remat, balance=parse_balance(balance),
        split_points=tuple(split_points) if split_points is not None else None,
        memory_limit=memory_limit,
        devices=tuple(str(d) for d in devices) if devices is not None else None,
        capture=capture, schedule=schedule, profile=profile, leaf_modules=tuple(leaf_modules),
        deferred_batch_norm=deferred_batch_norm, check_finite=check_finite,
        dp_bucket_mb=dp_bucket_mb, command=command)
    check_config(config)
    program = Program(model, config)
    program.train(model.training)
    if example_inputs is not None:
        args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) \
            else (example_inputs,)
        program.build(*args, **(example_kwargs or {}))
    return program

"""The facts at the top of a generated stage file (fxpipe.codegen.FileHeader): how the
program was compiled and what the stage computes, holds and exchanges."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from torch import nn

from fxpipe import ir
from fxpipe.codegen import FileHeader
from fxpipe.config import CompileConfig
from fxpipe.figures import remat_saving
from fxpipe.optimizers import OptimizerMemory
from fxpipe.passes.partition import PartitionPlan
from fxpipe.passes.remat import RematRegion
from fxpipe.passes.split import StageGraph
from fxpipe.profile import DeviceProfile
from fxpipe.runtime.planning.schedule import SCHEDULES, stages_on
from fxpipe.stage_facts import stage_figures
from fxpipe.units import human_bytes, human_flops

__all__ = ["compile_command", "stage_header"]


def compile_command(config: CompileConfig, model: str) -> tuple[str, bool]:
    """How the program was compiled, and whether that is a command that regenerates it: the
    command line when it came from `fxpipe compile`, else the fxpipe.compile call with every
    option that differs from its default."""
    if config.command:
        return config.command, True
    defaults = CompileConfig()
    options = []
    for f in fields(CompileConfig):
        value = getattr(config, f.name)
        always = f.name in ("stages", "chunks", "remat", "balance")
        if f.name == "command" or (not always and value == getattr(defaults, f.name)):
            continue
        if f.name == "stages_per_rank" and config.schedule in SCHEDULES \
                and value == config.schedule_kind.default_stages_per_rank:
            continue  # what the schedule places anyway
        if isinstance(value, DeviceProfile):
            value = value.name
        if isinstance(value, OptimizerMemory):
            if value.master_weights:
                options.append("master_weights=True")
            value = value.extra_bytes if value.extra_bytes is not None else value.name
        if isinstance(value, nn.Module):  # a twin that checked a meta model's capture
            options.append(f"{f.name}={type(value).__name__}(...)")
            continue
        if f.name == "leaf_modules":
            value = tuple(v if isinstance(v, str) else getattr(v, "__name__", type(v).__name__)
                          for v in value)
        options.append(f"{f.name}={value!r}")
    return f"fxpipe.compile({model}(...), {', '.join(options)})", False


def stage_header(graph: StageGraph, regions: Sequence[RematRegion], plan: PartitionPlan,
                 config: CompileConfig, model: str, shared: dict[str, list[int]],
                 passes: tuple[str, ...]) -> FileHeader:
    """The facts at the top of a generated stage file: what the stage computes, holds and
    exchanges, the same on every machine. Nothing here comes from the device profile (predicted
    or measured times): the report says what was predicted, and with which profile."""
    b, k = plan.microbatch_size, len(plan.stages)
    figures = stage_figures(graph, regions, b)
    stage_plan = plan.stages[graph.index]
    lines: list[tuple[str, str]] = []
    rank_of = config.placement
    if config.per_rank > 1:
        mine = map(str, stages_on(rank_of, rank_of[graph.index]))
        lines.append(("rank", f"{rank_of[graph.index]} of {config.ranks} ({config.schedule}: "
                              f"stages {', '.join(mine)} run on it)"))
    lines.append(("flops", f"{human_flops(figures['fwd_flops'])} forward per micro-batch"))
    lines.append(("params", f"{human_bytes(figures['params'])}; saved activations "
                            f"{human_bytes(figures['saved'])} per micro-batch"
                  + (f" ({human_bytes(figures['kept_with_remat'])} kept with remat)"
                     if regions else "")))
    def local(peer: int) -> str:
        same = config.per_rank > 1 and rank_of[peer] == rank_of[graph.index]
        return " (same rank: handed over in the process)" if same else ""

    for c in graph.recvs:
        lines.append(("recv", f"{c.tag}  {ir.format_shape(c.value)}  <- stage {c.peer}"
                              + local(c.peer)))
    for c in graph.sends:
        lines.append(("send", f"{c.tag}  {ir.format_shape(c.value)}  -> stage {c.peer}"
                              + local(c.peer)))
    for name, holders in sorted(shared.items()):
        if graph.index in holders:
            others = ", ".join(str(s) for s in holders if s != graph.index)
            if len({rank_of[s] for s in holders}) == 1:
                lines.append(("tied", f"{name} is also held by stage {others} on this rank: "
                                      "one Parameter, whose gradient both accumulate"))
                continue
            lines.append(("tied", f"{name} is also held by stage {others}; its gradient is "
                                  f"summed over stages {', '.join(map(str, holders))} after the "
                                  "backward, so every copy takes the same step"))
    for r in regions:
        lines.append(("remat", f"{r.name} = {len(r.nodes)} ops ({r.nodes[0]} .. {r.nodes[-1]}), "
                               + remat_saving(r.kept_bytes, r.saved_bytes, human_bytes)))
    lines.append(("b", f"the micro-batch size, {b} at compile time (batch {b * plan.chunks} "
                       f"in {plan.chunks} chunks)"))
    span = f"{stage_plan.first_module} -> {stage_plan.last_module} ({len(stage_plan.nodes)} ops)"
    command, runnable = compile_command(config, model)
    return FileHeader(command, runnable, model, graph.index, k, span, tuple(lines), passes)

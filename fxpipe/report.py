"""Partition reports, stage headers and cost tables (text, markdown, JSON)."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypedDict

from tabulate import tabulate
from torch import nn
from torch.fx import Node

from fxpipe import ir
from fxpipe.built import Built
from fxpipe.codegen import FileHeader
from fxpipe.config import CompileConfig
from fxpipe.errors import ConfigError
from fxpipe.figures import against, remat_saving, stage_load
from fxpipe.losses import loss_saved_bytes
from fxpipe.optimizers import ADAM, OptimizerMemory
from fxpipe.passes.partition import BalanceRound, PartitionPlan, best_round, kept_reason
from fxpipe.passes.remat import RematRegion, kept_bytes
from fxpipe.passes.split import StageGraph
from fxpipe.profile import DeviceProfile
from fxpipe.remat_policy import RematPolicy
from fxpipe.runtime.communication.mesh import Mesh
from fxpipe.runtime.planning.grid import peak_inflight, render_grid
from fxpipe.runtime.planning.schedule import SCHEDULES, ActionKind, ScheduleKind, stages_on
from fxpipe.runtime.planning.timeline import predicted_step

__all__ = ["Report", "StageRow", "build_report", "stage_header", "compile_command",
           "predicted_kept", "communication", "human_bytes", "human_flops",
           "human_time", "SCHEDULE_TITLES"]


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def human_flops(n: float) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} FLOP"


def human_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _at(expr: ir.Expr, b: int) -> float:
    return float(ir.evaluate(expr, b))


def _value_bytes(info: ir.ValueInfo, b: int) -> float:
    if isinstance(info, ir.TensorInfo):
        return _at(info.nbytes, b)
    if isinstance(info, tuple):
        return sum(_value_bytes(i, b) for i in info)
    return 8.0


def _stage_nodes(graph: StageGraph) -> list[Node]:
    return [n for n in ir.compute_nodes(graph.graph_module.graph) if ir.COST in n.meta]


def _stage_figures(graph: StageGraph, regions: Sequence[RematRegion], b: int) -> dict[str, float]:
    nodes = _stage_nodes(graph)
    saved = kept_bytes(nodes, b)
    in_region = {name for r in regions for name in r.nodes}
    outside = kept_bytes([n for n in nodes if n.name not in in_region], b)
    kept = outside + sum(r.kept_bytes for r in regions)
    params = sum(p.numel() * p.element_size() for p in graph.graph_module.parameters())
    return {
        "fwd_flops": sum(_at(ir.cost(n).fwd_flops, b) for n in nodes),
        "params": float(params),
        "param_count": float(sum(p.numel() for p in graph.graph_module.parameters())),
        "saved": saved,
        "kept_with_remat": min(kept, saved) if regions else saved,
        "recv_bytes": sum(_value_bytes(c.value, b) for c in graph.recvs),
        "send_bytes": sum(_value_bytes(c.value, b) for c in graph.sends),
    }


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
    figures = _stage_figures(graph, regions, b)
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


class StageRow(TypedDict, total=False):
    """One stage of the report, as report.json carries it (bytes and seconds)."""

    stage: int
    first_module: str
    last_module: str
    nodes: int
    param_count: float
    fwd_flops: float
    time_s: float
    compute_s: float
    comm_s: float
    params_bytes: float
    activations_bytes: float
    kept_with_remat_bytes: float
    loss_bytes: float  # what the loss keeps per micro-batch in flight (the last stage's)
    recv_bytes: float
    send_bytes: float
    memory_model_bytes: float | None
    kept_predicted_bytes: float
    kept_measured_bytes: float  # only after program.measure_activations()


BREAKDOWN = {"kernels": "kernels", "overhead": "per-operation and per-micro-batch overhead",
             "messages": "messages", "ranks": "ranks' handling of actions and messages",
             "reduce": "tied weights' gradient all-reduce", "step": "per-step"}
"""PartitionPlan.breakdown's parts as the report names them."""

SCHEDULE_TITLES = {name: kind.title for name, kind in SCHEDULES.items()}


@dataclass
class Report:
    """The partition report of a compiled program; str() gives the text form."""

    model: str
    plan: PartitionPlan
    stages: list[StageRow]
    profile: str
    schedule: ScheduleKind
    measured: dict[str, Any] = field(default_factory=dict)
    shared: dict[str, list[int]] = field(default_factory=dict)
    # (rank, replica, stages it runs)
    mesh: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    comm: dict[str, float] = field(default_factory=dict)  # bytes per step by kind
    rounds: list[BalanceRound] = field(default_factory=list)  # balancing by measurement
    stages_per_rank: int = 1
    remat: RematPolicy = RematPolicy.NEVER
    optimizer: str = ADAM.describe()  # what each stage's memory counts per parameter
    stamping: str | None = None  # capture(stamp=True): the blocks stamped, or why none
    # (schedule, ranks) -> predicted_step of the plan: a simulation of every action of a step
    # (128 stages x 32 micro-batches: 8k actions), asked for by summary(), text() and json_text()
    _steps: dict[tuple[str, int], tuple[float, float]] = field(
        default_factory=dict, repr=False, compare=False)

    @property
    def ranks(self) -> int:
        return len(self.plan.stages) // self.stages_per_rank

    def step(self, schedule: ScheduleKind, ranks: int) -> tuple[float, float]:
        """(step time, bubble) of the plan under `schedule` on `ranks` ranks, simulated once."""
        key = (schedule.name, ranks)
        if key not in self._steps:
            self._steps[key] = predicted_step(self.plan, schedule, ranks)
        return self._steps[key]

    def summary(self) -> dict[str, Any]:
        plan = self.plan
        k, m = len(plan.stages), plan.chunks
        step, simulated_bubble = self.step(self.schedule, self.ranks)
        return {
            "stages": k, "ranks": self.ranks, "stages_per_rank": self.stages_per_rank,
            "chunks": m, "microbatch_size": plan.microbatch_size,
            "balance": plan.balance, "schedule": self.schedule.name,
            "imbalance": plan.imbalance,
            "bubble": simulated_bubble,
            "predicted_step_time_s": step,  # the one predicted step (simulated)
            "simulated_step_time_s": step,
            "breakdown_s": plan.breakdown(self.schedule, self.ranks),
            "optimizer": self.optimizer,
            "chunk_candidates": [{"chunks": c, "predicted_step_time_s": t}
                                 for c, t in plan.candidates],
            "auto_schedules": [{"schedule": name, "step_time_s": t}
                               for name, t in plan.schedules],
            "schedules": [{"schedule": kind.name, "ranks": r, "step_time_s": t, "bubble": b,
                           "kept_bytes": self.kept(kind, r)}
                          for kind, r in self._layouts()
                          for t, b in [self.step(kind, r)]],
        }

    def kept(self, schedule: ScheduleKind, ranks: int) -> float:
        """The most activation bytes a stage keeps at the peak of a step of `schedule`."""
        return max(self.kept_by_stage(schedule, ranks))

    def kept_by_stage(self, schedule: ScheduleKind, ranks: int) -> list[float]:
        """Activation bytes each stage keeps at its peak in a step of `schedule`: the
        micro-batches in flight there times what each keeps (the last stage's with what the
        loss keeps)."""
        m = self.plan.chunks
        inflight = peak_inflight(schedule.build(m, len(self.plan.stages), ranks))
        return [self.remat.kept_at_peak(s["activations_bytes"], s["kept_with_remat_bytes"], n, m)
                + n * s["loss_bytes"] for s, n in zip(self.stages, inflight)]

    def kept_by_rank(self, schedule: ScheduleKind, ranks: int) -> list[float]:
        """Activation bytes each rank keeps at its peak in a step of `schedule`, its actions
        played in order: a forward adds what its micro-batch keeps at that stage (every
        activation, or its remat regions' inputs where it recomputes; the last stage's with
        what the loss keeps), its backward (W, in a split backward) frees it. With one stage
        per rank this is kept_by_stage; with several, their peaks need not coincide."""
        m = self.plan.chunks
        out = []
        for actions in schedule.build(m, len(self.plan.stages), ranks):
            live = peak = 0.0
            for a in actions:
                if a.kind == ActionKind.INPUT_GRAD:
                    continue  # the activations stay for W
                s = self.stages[a.stage]
                keeps = s["kept_with_remat_bytes"] if self.remat.recomputes(a.microbatch, m) \
                    else s["activations_bytes"]
                live += (keeps + s["loss_bytes"]) * (1 if a.kind == ActionKind.FORWARD else -1)
                peak = max(peak, live)
            out.append(peak)
        return out

    def _layouts(self) -> list[tuple[ScheduleKind, int]]:
        """Each schedule that runs these stages on this program's ranks, with that number: the
        flat ones for one stage per rank, the looped ones for several."""
        k = len(self.plan.stages)
        out = []
        for kind in SCHEDULES.values():
            try:
                if kind.check_layout(k, kind.stages_per_rank_for(self.stages_per_rank)) \
                        == self.ranks:
                    out.append((kind, self.ranks))
            except ConfigError:
                continue  # e.g. an odd number of stages under zb-v
        return out

    def rows(self) -> list[list[object]]:
        out: list[list[object]] = []
        for s in self.stages:
            out.append([s["stage"], s["first_module"], s["last_module"], s["nodes"],
                        f"{int(s['param_count']):,}", human_flops(s["fwd_flops"]),
                        human_time(s["time_s"]), human_bytes(s["params_bytes"]),
                        human_bytes(s["activations_bytes"]),
                        human_bytes(s["kept_with_remat_bytes"]),
                        human_bytes(s["recv_bytes"]), human_bytes(s["send_bytes"])]
                       + ([human_bytes(s["kept_predicted_bytes"]),
                           human_bytes(s["kept_measured_bytes"])]
                          if "kept_measured_bytes" in s else []))
        return out

    def headers(self) -> list[str]:
        h = ["stage", "first", "last", "ops", "params", "fwd FLOPs/mb", "est busy/mb",
             "param mem", "act/mb", "kept/mb (remat)", "recv/mb", "send/mb"]
        if any("kept_measured_bytes" in s for s in self.stages):
            h += ["kept/step predicted", "kept/step measured"]
        return h

    def text(self, fmt: str = "simple") -> str:
        s = self.summary()
        on = "" if s["stages_per_rank"] == 1 else \
            f" on {s['ranks']} ranks ({s['stages_per_rank']} per rank)"
        lines = [f"fxpipe partition of {self.model}: {s['stages']} stages{on} x {s['chunks']} "
                 f"micro-batches of {s['microbatch_size']} (balance={s['balance']}, "
                 f"schedule={s['schedule']})",
                 f"times predicted with device profile: {self.profile}", "",
                 tabulate(self.rows(), headers=self.headers(), tablefmt=fmt), "",
                 f"imbalance (slowest / mean stage, compute + half its traffic): "
                 f"{s['imbalance']:.3f}",
                 f"bubble (idle share of the ranks): {s['bubble']:.1%}",
                 f"predicted step time: {human_time(s['simulated_step_time_s'])} "
                 f"({s['schedule']} played with the stage costs)",
                 "predicted work per step, all stages together: " + ", ".join(
                     f"{name} {human_time(s['breakdown_s'][key])}"
                     for key, name in BREAKDOWN.items()
                     # what ranks pay: if measured; the all-reduce: if weights are tied
                     if s["breakdown_s"].get(key) or key not in ("ranks", "reduce"))]
        memory = [st.get("memory_model_bytes") for st in self.stages]
        if all(m is not None for m in memory):
            lines.append(f"memory per stage (weights, gradients, {self.optimizer}; and kept "
                         "activations): " + ", ".join(human_bytes(m or 0) for m in memory))
        if self.shared:
            lines.append("tied parameters (gradients summed across stages): "
                         + ", ".join(f"{k} in stages {v}" for k, v in self.shared.items()))
        if s["chunk_candidates"]:
            lines.append("chunks='auto' candidates: " + ", ".join(
                f"{c['chunks']}: {human_time(c['predicted_step_time_s'])}"
                for c in s["chunk_candidates"]))
        if self.mesh:
            replicas = 1 + max(r for _, r, _ in self.mesh)
            lines.append(f"mesh (dp x pp): {replicas} replica(s) x {s['ranks']} ranks; "
                         + ", ".join(f"rank {rank} = replica {rep} " + (
                             f"stage {held[0]}" if len(held) == 1 else
                             f"stages {', '.join(map(str, held))}")
                                     for rank, rep, held in self.mesh))
        if self.comm:
            lines.append("communication per step (each replica): " + ", ".join(
                f"{kind} {human_bytes(v)}" for kind, v in self.comm.items()))
        if self.stamping:
            lines.append(f"repeated blocks: {self.stamping}")
        lines += self.balance_lines()
        lines += self.kept_lines()
        for key, value in self.measured.items():
            lines.append(f"measured {key}: {value}")
        k, m = s["stages"], s["chunks"]
        if s["auto_schedules"]:
            lines.append(f"schedule='auto' chose {s['schedule']}: the fastest simulated step "
                         "that fits the memory limit (" + ", ".join(
                             f"{c['schedule']} " + (human_time(c['step_time_s'])
                                                    if c['step_time_s'] is not None
                                                    else "does not fit")
                             for c in s["auto_schedules"]) + ")")
        lines.append("simulated step time by schedule (stage costs, bubble, most activations "
                     "a stage keeps at the peak): "
                     + ", ".join(f"{c['schedule']} {human_time(c['step_time_s'])} "
                                 f"(bubble {c['bubble']:.1%}, keeps "
                                 f"{human_bytes(c['kept_bytes'])})" for c in s["schedules"]))
        lines += ["", render_grid(self.schedule.build(m, k, self.ranks),
                                  title=self.schedule.title,
                                  bubble=s["bubble"])]
        return "\n".join(lines)

    def balance_lines(self) -> list[str]:
        """Each cut balancing by measurement tried, predicted and measured, and the one kept."""
        if not self.rounds:
            return []
        kept = best_round(self.rounds)
        lines = ["balance by measurement (compute per micro-batch, predicted -> measured):"]
        for i, r in enumerate(self.rounds):
            stages = ", ".join(f"{m} {human_time(p)} -> {human_time(t)}"
                               for m, p, t in zip(r.modules, r.predicted, r.measured))
            mark = "  <- kept" if r is kept else ""
            ranks = (f", ranks {r.rank_spread:.1%} apart"
                     if len(set(r.ranks)) < len(r.ranks) else "")
            lines.append(f"  round {i + 1}: {stages}; measured {r.spread:.1%} apart{ranks}"
                         f"{mark}")
        lines.append(f"  kept {kept_reason(self.rounds)}")
        now = ", ".join(human_time(s.compute_time) for s in self.plan.stages)
        lines.append(f"  now predicted (corrected by what was measured): {now}")
        return lines

    def kept_lines(self) -> list[str]:
        """The activations program.measure_activations() measured, against the prediction."""
        measured = [s for s in self.stages if "kept_measured_bytes" in s]
        if not measured:
            return []
        return ["activations the stages keep at the peak of a GPipe step (measured, all forwards "
                "done, the loss not run): "
                + "; ".join(f"stage {s['stage']} {human_bytes(s['kept_measured_bytes'])}, "
                            f"predicted {human_bytes(s['kept_predicted_bytes'])}: "
                            + against(s["kept_measured_bytes"], s["kept_predicted_bytes"])
                            for s in measured)]

    def markdown(self) -> str:
        return self.text(fmt="github")

    def json(self) -> dict[str, Any]:
        """The report as data: what report.json holds, parsed (json_text() is the text)."""
        data: dict[str, Any] = json.loads(self.json_text())
        return data

    def json_text(self) -> str:
        """report.json's text: the report as JSON, keys sorted, values JSON lacks as strings."""
        return json.dumps({"model": self.model, "summary": self.summary(), "stages": self.stages,
                           "profile": self.profile, "measured": self.measured,
                           "balance_rounds": [r.to_json() for r in self.rounds],
                           "shared_parameters": self.shared, "mesh": self.mesh,
                           "communication_bytes_per_step": self.comm},
                          indent=2, sort_keys=True, default=str)

    def __str__(self) -> str:
        return self.text()


def predicted_kept(built: Built) -> list[float]:
    """Activation bytes each stage's forwards hold after all forwards of a GPipe step (its
    peak; what program.measure_activations measures, which runs no loss), as the remat policy
    counts them."""
    plan = built.plan
    m, b = built.spec.chunks, plan.microbatch_size
    out = []
    for st in built.stages:
        figures = _stage_figures(st.graph, st.regions, b)
        out.append(built.config.remat_policy.kept_at_peak(figures["saved"],
                                                          figures["kept_with_remat"], m, m))
    return out


def communication(built: Built, replicas: int = 1) -> dict[str, float]:
    """Bytes moved per training step: point-to-point (activations forward, gradients back) in
    one pipeline, the data-parallel gradient all-reduce per replica (ring: 2(R-1)/R of each
    stage's gradients) and the tied-weight gradient all-reduce."""
    plan = built.plan
    m = built.spec.chunks
    b = max(1, plan.microbatch_size // replicas)  # each replica pipelines its share of the batch
    rank_of = built.spec.placement
    p2p = 0.0
    for st in built.stages:
        for c in st.graph.sends:
            if rank_of[st.index] == rank_of[c.peer]:
                continue  # two stages of one rank: handed over in the process
            size = _value_bytes(c.value, b)
            grads = size if isinstance(c.value, ir.TensorInfo) and c.value.is_float \
                and c.value.requires_grad else 0.0
            p2p += m * (size + grads)
    grads = sum(float(p.numel() * p.element_size()) for st in built.stages
                for p in st.graph_module.parameters() if p.requires_grad)
    tied = sum(float(p.numel() * p.element_size()) * (len({rank_of[s] for s in stages}) - 1)
               for name, stages in built.shared.items()
               for p in [_tied_param(built, name)] if p is not None)
    out = {"point-to-point": p2p, "tied-weight all-reduce": tied}
    if replicas > 1:
        out["data-parallel all-reduce"] = 2 * (replicas - 1) / replicas * grads
    return out


def _tied_param(built: Built, name: str) -> nn.Parameter | None:
    for st in built.stages:
        for target, value in st.graph_module.named_parameters(remove_duplicate=False):
            if target == name:
                return value
    return None


def build_report(built: Built, model: str, mesh: Mesh | None = None) -> Report:
    """The report of a built program (`mesh`: where its ranks run, under torchrun)."""
    plan = built.plan
    b = plan.microbatch_size
    kept = predicted_kept(built)
    last = len(built.stages) - 1
    stages: list[StageRow] = []
    for st, sp in zip(built.stages, plan.stages):
        figures = _stage_figures(st.graph, st.regions, b)
        stages.append({
            "stage": st.index, "first_module": sp.first_module, "last_module": sp.last_module,
            "nodes": len(sp.nodes), "param_count": figures["param_count"],
            "fwd_flops": figures["fwd_flops"],
            "time_s": stage_load(sp.compute_time, sp.comm_time), "compute_s": sp.compute_time,
            "comm_s": sp.comm_time, "params_bytes": figures["params"],
            "activations_bytes": figures["saved"],
            "kept_with_remat_bytes": figures["kept_with_remat"],
            "loss_bytes": loss_saved_bytes(built.captured, b) if st.index == last else 0.0,
            "recv_bytes": figures["recv_bytes"], "send_bytes": figures["send_bytes"],
            "memory_model_bytes": sp.memory,
            "kept_predicted_bytes": kept[st.index],
        })
    replicas = mesh.replicas if mesh is not None else 1
    profile = built.profile
    which = f"{profile.name} [{profile.key}]" if profile.key else profile.name
    # A measured profile's name already says where and in which precision; its source repeats
    # that before the method ("measured on cpu, 1 thread(s) in float32: each op class ...").
    head, sep, method = profile.source.partition(": ")
    how = method if sep and head.startswith("measured on ") else profile.source
    return Report(model, plan, stages, f"{which} ({how})",
                  built.config.schedule_kind, shared=dict(built.spec.shared),
                  mesh=mesh.describe() if mesh is not None else [],
                  comm=communication(built, replicas), rounds=list(built.rounds),
                  stages_per_rank=built.spec.stages_per_rank, remat=built.config.remat_policy,
                  optimizer=built.config.optimizer.describe(),
                  stamping=built.capture_info.stamp_note)

"""The partition report of a built program (text, markdown, JSON): its stages, the predicted
step and its breakdown, the schedules compared, balancing rounds and kept memory."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, TypedDict

from tabulate import tabulate

from fxpipe.built import Built
from fxpipe.errors import ConfigError
from fxpipe.figures import against, stage_load
from fxpipe.losses import loss_saved_bytes
from fxpipe.optimizers import ADAM
from fxpipe.passes.partition import BalanceRound, PartitionPlan, best_round, kept_reason
from fxpipe.remat_policy import RematPolicy
from fxpipe.runtime.communication.mesh import Mesh
from fxpipe.runtime.planning.grid import peak_inflight, render_grid
from fxpipe.runtime.planning.schedule import SCHEDULES, ActionKind, Schedule, ScheduleKind
from fxpipe.runtime.planning.timeline import predicted_step
from fxpipe.stage_facts import communication, predicted_kept, stage_figures, weight_pass_kept
from fxpipe.units import human_bytes, human_flops, human_time

__all__ = ["Report", "StageRow", "build_report", "SCHEDULE_TITLES"]


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
    # what a micro-batch keeps from a split backward's I to its W where I frees the graph
    # (stage_facts.weight_pass_kept); None: the whole graph stays until W
    weight_pass_bytes: float | None
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
    capture: str | None = None  # how the graph was captured and checked (CaptureInfo.describe)
    # (schedule, ranks) -> predicted_step of the plan: a simulation of every action of a step
    # (128 stages x 32 micro-batches: 8k actions), asked for by summary(), text() and json_text()
    # and by every report of one compile (Built.simulated, which build_report passes)
    simulated: dict[tuple[str, int], tuple[float, float]] = field(
        default_factory=dict, repr=False, compare=False)
    # (schedule, ranks) -> its actions for this plan, built once (summary(), kept_by_stage,
    # kept_by_rank and the grid of text() each want them)
    _built: dict[tuple[str, int], Schedule] = field(
        default_factory=dict, repr=False, compare=False)

    @property
    def ranks(self) -> int:
        return len(self.plan.stages) // self.stages_per_rank

    def step(self, schedule: ScheduleKind, ranks: int) -> tuple[float, float]:
        """(step time, bubble) of the plan under `schedule` on `ranks` ranks, simulated once."""
        key = (schedule.name, ranks)
        if key not in self.simulated:
            self.simulated[key] = predicted_step(self.plan, schedule, ranks)
        return self.simulated[key]

    def built(self, schedule: ScheduleKind, ranks: int) -> Schedule:
        """The actions of `schedule` for this plan's stages and micro-batches on `ranks`."""
        key = (schedule.name, ranks)
        if key not in self._built:
            self._built[key] = schedule.build(self.plan.chunks, len(self.plan.stages), ranks)
        return self._built[key]

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
        loss keeps); under a split backward, its actions played as kept_by_rank plays them,
        since a micro-batch between I and W may keep less than a whole one."""
        built = self.built(schedule, ranks)
        if any(a.kind == ActionKind.INPUT_GRAD for actions in built for a in actions):
            return self._played(built)[0]
        m = self.plan.chunks
        inflight = peak_inflight(built)
        return [self.remat.kept_at_peak(s["activations_bytes"], s["kept_with_remat_bytes"], n, m)
                + n * s["loss_bytes"] for s, n in zip(self.stages, inflight)]

    def kept_by_rank(self, schedule: ScheduleKind, ranks: int) -> list[float]:
        """Activation bytes each rank keeps at its peak in a step of `schedule`, its actions
        played in order: a forward adds what its micro-batch keeps at that stage (every
        activation, or its remat regions' inputs where it recomputes; the last stage's with
        what the loss keeps), its backward (W, in a split backward) frees it. A split
        backward's I frees all but what W reads where the stage allows it and the micro-batch
        recomputed nothing (`weight_pass_bytes`). With one stage per rank this is
        kept_by_stage; with several, their peaks need not coincide."""
        return self._played(self.built(schedule, ranks))[1]

    def _played(self, built: Schedule) -> tuple[list[float], list[float]]:
        """(each stage's peak, each rank's peak) of kept activation bytes, the ranks' actions
        played in order (kept_by_rank)."""
        m = self.plan.chunks
        stage_live = [0.0] * len(self.stages)
        stage_peak = [0.0] * len(self.stages)
        rank_peak = []
        for actions in built:
            live = peak = 0.0
            waiting: dict[tuple[int, int], float] = {}  # (stage, mb) -> kept from I to W
            for a in actions:
                s = self.stages[a.stage]
                recomputes = self.remat.recomputes(a.microbatch, m)
                whole = (s["kept_with_remat_bytes"] if recomputes else s["activations_bytes"]) \
                    + s["loss_bytes"]
                change = 0.0
                if a.kind == ActionKind.FORWARD:
                    change = whole
                elif a.kind == ActionKind.INPUT_GRAD:
                    kept = s["weight_pass_bytes"]
                    if kept is not None and not recomputes:  # else all stays for W
                        waiting[(a.stage, a.microbatch)] = kept
                        change = kept - whole
                else:
                    change = -waiting.pop((a.stage, a.microbatch), whole)
                live += change
                stage_live[a.stage] += change
                peak = max(peak, live)
                stage_peak[a.stage] = max(stage_peak[a.stage], stage_live[a.stage])
            rank_peak.append(peak)
        return stage_peak, rank_peak

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
        if self.capture:
            lines.append(f"capture: {self.capture}")
        if self.stamping:
            lines.append(f"repeated blocks: {self.stamping}")
        lines += self.balance_lines()
        lines += self.kept_lines()
        for key, value in self.measured.items():
            lines.append(f"measured {key}: {value}")
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
        lines += ["", render_grid(self.built(self.schedule, self.ranks),
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
                           "communication_bytes_per_step": self.comm, "capture": self.capture},
                          indent=2, sort_keys=True, default=str)

    def __str__(self) -> str:
        return self.text()


def build_report(built: Built, model: str, mesh: Mesh | None = None) -> Report:
    """The report of a built program (`mesh`: where its ranks run, under torchrun)."""
    plan = built.plan
    b = plan.microbatch_size
    kept = predicted_kept(built)
    last = len(built.stages) - 1
    stages: list[StageRow] = []
    for st, sp in zip(built.stages, plan.stages):
        figures = stage_figures(st.graph, st.regions, b)
        stages.append({
            "stage": st.index, "first_module": sp.first_module, "last_module": sp.last_module,
            "nodes": len(sp.nodes), "param_count": figures["param_count"],
            "fwd_flops": figures["fwd_flops"],
            "time_s": stage_load(sp.compute_time, sp.comm_time), "compute_s": sp.compute_time,
            "comm_s": sp.comm_time, "params_bytes": figures["params"],
            "activations_bytes": figures["saved"],
            "kept_with_remat_bytes": figures["kept_with_remat"],
            "loss_bytes": loss_saved_bytes(built.captured, b) if st.index == last else 0.0,
            "weight_pass_bytes": weight_pass_kept(st.graph, b),
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
                  stamping=built.capture_info.stamp_note, capture=built.capture_info.describe(),
                  simulated=built.simulated)

"""Timelines of pipeline runs, measured or predicted, as Chrome trace JSON (Perfetto)."""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, TypedDict

from fxpipe.figures import idle_share
from fxpipe.runtime.planning.schedule import ActionKind, ScheduleKind, schedule_kind
from fxpipe.runtime.planning.simulate import TimedEvent, simulate

__all__ = ["Event", "EventJSON", "RawEvent", "Timeline", "TraceEvent", "StageTimes", "PlanTimes",
           "busy_time", "chrome_trace", "write_chrome_trace", "predicted_events", "predicted_step",
           "predicted_local_step", "SPLIT_BACKWARD", "SharedWeight", "tied_reduce"]


class EventJSON(TypedDict):
    """An Event as JSON carries it (bench results, program.json): Event(**data) reads it."""

    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    detail: str


@dataclass(frozen=True)
class Event:
    kind: str  # forward, backward, recompute, send, recv, send_grad, recv_grad, optimizer ...
    stage: int
    microbatch: int
    start: float  # seconds since the timeline started
    end: float
    detail: str = ""

    def to_json(self) -> EventJSON:
        return {"kind": self.kind, "stage": self.stage, "microbatch": self.microbatch,
                "start": self.start, "end": self.end, "detail": self.detail}


# an Event's fields, as a span records them: made into Events only when they are read
RawEvent: TypeAlias = tuple[str, int, int, float, float, str]


class Timeline:
    """Collects events of one process; `span` times a block."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.raw: list[RawEvent] = []

    @property
    def events(self) -> list[Event]:
        return [Event(*r) for r in self.raw]

    def reset(self) -> None:
        self.origin = time.perf_counter()
        self.raw.clear()

    def span(self, kind: str, stage: int, microbatch: int, detail: str = ""
             ) -> contextlib.AbstractContextManager[None]:
        """A block's event, recorded when the block ends (also by an exception)."""
        return _Span(self, kind, stage, microbatch, detail)


class _Span:
    """Timeline.span's context manager: a plain class, as a rank enters dozens per step and a
    generator-based one costs twice the Python calls."""

    __slots__ = ("timeline", "kind", "stage", "microbatch", "detail", "start")

    def __init__(self, timeline: Timeline, kind: str, stage: int, microbatch: int,
                 detail: str) -> None:
        self.timeline, self.kind, self.stage = timeline, kind, stage
        self.microbatch, self.detail, self.start = microbatch, detail, 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter() - self.timeline.origin

    def __exit__(self, *exc: object) -> None:
        timeline = self.timeline
        timeline.raw.append((self.kind, self.stage, self.microbatch, self.start,
                             time.perf_counter() - timeline.origin, self.detail))


_COMPUTE = ("forward", "backward", "recompute")
# the detail of a backward span: the input or the weight gradients
SPLIT_BACKWARD = (ActionKind.INPUT_GRAD, ActionKind.WEIGHT_GRAD)
_WAITS = ("recv", "recv_grad")


def busy_time(events: Sequence[Event], stage: int | None = None,
              kinds: Sequence[str] = _COMPUTE, detail: str | None = None) -> float:
    """Seconds a stage computed: its forward, backward and recompute spans (or those of
    `kinds`, and of `detail` where given: "W" for a split backward's weight gradients), less
    the receives nested in them (a forward that waits for its input is idle, not busy, while it
    waits)."""
    mine = [e for e in events if stage is None or e.stage == stage]
    compute = [e for e in mine if e.kind in kinds and (detail is None or e.detail == detail)]
    total = sum(e.end - e.start for e in compute)
    for wait in (e for e in mine if e.kind in _WAITS):
        for span in compute:
            overlap = min(span.end, wait.end) - max(span.start, wait.start)
            if overlap > 0:
                total -= overlap
                break
    return total


class _NameArgs(TypedDict):
    name: str


class _MetadataEvent(TypedDict):
    name: str  # "process_name" or "thread_name"
    ph: str  # "M"
    pid: int
    args: _NameArgs


class MetadataEvent(_MetadataEvent, total=False):
    """A Chrome trace metadata event: names a process (pid) or a track (pid, tid)."""

    tid: int


class _SpanArgs(TypedDict):
    microbatch: int
    detail: str


class SpanEvent(TypedDict):
    """A Chrome trace complete event ("X"): one span, times in microseconds."""

    name: str
    cat: str
    ph: str
    pid: int
    tid: int
    ts: float
    dur: float
    args: _SpanArgs


TraceEvent: TypeAlias = MetadataEvent | SpanEvent
"""One entry of a Chrome trace's traceEvents."""


_STEP_EVENTS = {"reduce": "gradient all-reduce (tied weights across stages, data-parallel "
                           "replicas)"}


def chrome_trace(events: Sequence[Event], *, name: str = "fxpipe",
                 pid: int = 0) -> list[TraceEvent]:
    """Trace events: one process `name`, one track (thread) per stage, times in microseconds."""
    out: list[TraceEvent] = [{"name": "process_name", "ph": "M", "pid": pid,
                              "args": {"name": name}}]
    for stage in sorted({e.stage for e in events}):
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": stage,
                    "args": {"name": f"stage {stage}"}})
    for e in events:
        label = {"forward": "F", "backward": "B", "recompute": "R"}.get(e.kind, e.kind)
        if e.kind == "backward" and e.detail in SPLIT_BACKWARD:  # a split backward's I or W
            label = e.detail
        # an event of the whole step (micro-batch -1) is named for what it does, not "reduce-1"
        title = f"{label}{e.microbatch}" if e.microbatch >= 0 else _STEP_EVENTS.get(e.kind, e.kind)
        out.append({"name": title, "cat": e.kind, "ph": "X", "pid": pid,
                    "tid": e.stage, "ts": round(e.start * 1e6, 3),
                    "dur": round(max(e.end - e.start, 0.0) * 1e6, 3),
                    "args": {"microbatch": e.microbatch, "detail": e.detail}})
    return out


def write_chrome_trace(path: str, runs: dict[str, Sequence[Event]]) -> None:
    """Writes several runs (e.g. "measured" and "predicted") into one trace, one process each."""
    events: list[TraceEvent] = []
    for pid, (name, run) in enumerate(runs.items()):
        events += chrome_trace(run, name=name, pid=pid)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f, indent=None)


class StageTimes(Protocol):
    """The per-micro-batch times of one stage that predicted_events reads (a StagePlan)."""

    @property
    def forward_time(self) -> float: ...

    @property
    def compute_time(self) -> float: ...

    @property
    def comm_time(self) -> float: ...

    @property
    def recompute_time(self) -> float: ...

    @property
    def weight_time(self) -> float: ...

    @property
    def forward_messages(self) -> int: ...

    @property
    def backward_messages(self) -> int: ...


class PlanTimes(Protocol):
    """What predicted_events reads of a partition plan (a PartitionPlan, from a layer above)."""

    @property
    def stages(self) -> Sequence[StageTimes]: ...

    @property
    def chunks(self) -> int: ...

    @property
    def step_overhead(self) -> float: ...

    @property
    def action_overhead(self) -> float: ...

    @property
    def message_overhead(self) -> float: ...

    @property
    def host_link(self) -> bool: ...

    @property
    def shared(self) -> Sequence[SharedWeight]: ...


@dataclass(frozen=True)
class SharedWeight:
    """A trainable weight that several stages use (an embedding and its output layer). Where
    the schedule places those stages on several ranks, an all-reduce sums its gradient across
    them after the last backward; where on one rank, autograd sums it there."""

    stages: tuple[int, ...]
    seconds: tuple[float, ...]  # the all-reduce over 2, 3, ... ranks (up to len(stages))


def tied_reduce(plan: PlanTimes, rank_of: Sequence[int]) -> tuple[float, tuple[int, ...]]:
    """Seconds per step of the plan's shared weights' all-reduces with stage s on rank
    rank_of[s], and the ranks that take part."""
    total, taking_part = 0.0, set()
    for weight in plan.shared:
        ranks = {rank_of[s] for s in weight.stages}
        if len(ranks) > 1:
            total += weight.seconds[len(ranks) - 2]
            taking_part |= ranks
    return total, tuple(sorted(taking_part))


def _simulated(plan: PlanTimes, schedule: ScheduleKind, ranks: int | None, record: bool = True
               ) -> tuple[list[TimedEvent], float, float]:
    """The schedule played with the plan's stage times as the executors run it. A split
    backward's W costs the stage's weight time and I the rest of the backward; under remat,
    W recomputes the regions again (their recomputed values live for one autograd call;
    NOTE [Split backward] in fxpipe/runtime/communication/dist_comm.py), so a split backward costs
    one recomputation more than a whole one, except where W is the whole backward (the first
    stage: I has nothing to compute); a backward the schedule runs whole (B) costs the
    backward. Returns the events (none unless `record`), the makespan
    and the ranks' work: every action's time, added up. Each action also pays what a rank pays
    for running one (the plan's action_overhead) and for each message it sends or receives
    (message_overhead); where the ranks' own cores move the bytes (host_link), also each
    transfer to or from another rank (_host_transfers)."""
    k, m = len(plan.stages), plan.chunks
    action, message = plan.action_overhead, plan.message_overhead
    comm = [s.comm_time / 2 for s in plan.stages]  # each boundary is counted by both its stages
    host = _host_transfers(comm, schedule.placement(k, ranks or schedule.ranks_for(k))) \
        if plan.host_link else [0.0] * k
    fwd = [s.forward_time + action + message * s.forward_messages + h
           for s, h in zip(plan.stages, host)]
    # recompute included; a difference of sums can round a hair below zero
    bwd = [max(s.compute_time - s.forward_time, 0.0) + action + message * s.backward_messages + h
           for s, h in zip(plan.stages, host)]
    actions = schedule.build(m, k, ranks)
    if not schedule.splits_backward:
        events, makespan = simulate(actions, forward_time=fwd, backward_time=bwd, comm_time=comm,
                                    record=record, checked=True)
        return events, makespan, m * sum(f + b for f, b in zip(fwd, bwd))
    inputs, weights = [], []
    for s, backward, h in zip(plan.stages, bwd, host):
        handling = action + message * s.backward_messages + h  # I sends the gradients
        pure = backward - handling - s.recompute_time
        if s.weight_time >= pure * (1 - 1e-9):  # W is the whole backward
            inputs.append(handling)
            weights.append(backward - handling + action)
        else:
            inputs.append(max(s.recompute_time + pure - s.weight_time, 0.0) + handling)
            weights.append(s.recompute_time + s.weight_time + action)
    events, makespan = simulate(actions, forward_time=fwd, backward_time=bwd, weight_time=weights,
                                input_time=inputs, comm_time=comm, record=record, checked=True)
    duration = {ActionKind.FORWARD: fwd, ActionKind.BACKWARD: bwd, ActionKind.INPUT_GRAD: inputs,
                ActionKind.WEIGHT_GRAD: weights}  # a schedule may split some backwards only
    return events, makespan, sum(duration[a.kind][a.stage] for acts in actions for a in acts)


def _host_transfers(edge_time: Sequence[float], rank_of: Sequence[int]) -> list[float]:
    """Seconds each stage's forward (and again its backward) spends moving the bytes of its
    messages to and from other ranks where the ranks' own cores move them (PlanTimes.host_link):
    a boundary s -> s + 1 between two ranks costs both its stages its transfer (edge_time[s]),
    in each direction; one within a rank costs nothing."""
    host = [0.0] * len(rank_of)
    for s in range(len(rank_of) - 1):
        if rank_of[s] != rank_of[s + 1]:
            host[s] += edge_time[s]
            host[s + 1] += edge_time[s]
    return host


def predicted_step(plan: PlanTimes, schedule: ScheduleKind | str, ranks: int | None = None
                   ) -> tuple[float, float]:
    """(step time, bubble) of `schedule` on `ranks` ranks (default: the schedule's stages per
    rank) simulated with the plan's stage times, plus what a step pays once; the bubble is the
    ranks' idle share of the step (fxpipe.figures.idle_share), the one bubble every report
    prints."""
    kind = schedule_kind(schedule)
    ranks = ranks or kind.ranks_for(len(plan.stages))
    _, makespan, work = _simulated(plan, kind, ranks, record=False)
    reduce, _ = tied_reduce(plan, kind.placement(len(plan.stages), ranks))
    step = makespan + reduce + plan.step_overhead
    return step, idle_share(work, ranks, step)


def predicted_local_step(plan: PlanTimes) -> float:
    """One step of the plan in one process (program.step without torchrun): every stage's
    compute of every micro-batch one after another, no messages, and the per-step cost."""
    return plan.chunks * sum(s.compute_time for s in plan.stages) + plan.step_overhead


def predicted_events(plan: PlanTimes, schedule: ScheduleKind | str = "gpipe",
                     ranks: int | None = None) -> list[Event]:
    """The schedule simulated with the plan's per-stage forward, backward and traffic times,
    then the tied weights' gradient all-reduce on the first stage of each rank taking part (as
    the executors record it)."""
    kind = schedule_kind(schedule)
    events, makespan, _ = _simulated(plan, kind, ranks)
    kinds: dict[str, str] = {ActionKind.FORWARD: "forward", ActionKind.BACKWARD: "backward",
                             ActionKind.INPUT_GRAD: "backward", ActionKind.WEIGHT_GRAD: "backward"}
    out = [Event(kinds.get(e.kind, e.kind), e.stage, e.microbatch, e.start, e.end,
                 str(e.kind) if e.kind in SPLIT_BACKWARD else "")
           for e in events]
    k = len(plan.stages)
    rank_of = kind.placement(k, ranks or kind.ranks_for(k))
    reduce, taking_part = tied_reduce(plan, rank_of)
    return out + [Event("reduce", rank_of.index(r), -1, makespan, makespan + reduce)
                  for r in taking_part]

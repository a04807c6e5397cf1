"""Timelines of pipeline runs, measured or predicted, as Chrome trace JSON (Perfetto)."""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Event", "Timeline", "busy_time", "chrome_trace", "write_chrome_trace"]


@dataclass(frozen=True)
class Event:
    kind: str  # forward, backward, recompute, send, recv, send_grad, recv_grad, optimizer ...
    stage: int
    microbatch: int
    start: float  # seconds since the timeline started
    end: float
    detail: str = ""


class Timeline:
    """Collects events of one process; `span` times a block."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.events: list[Event] = []

    def reset(self) -> None:
        self.origin = time.perf_counter()
        self.events.clear()

    @contextlib.contextmanager
    def span(self, kind: str, stage: int, microbatch: int, detail: str = "") -> Iterator[None]:
        start = time.perf_counter() - self.origin
        try:
            yield
        finally:
            self.events.append(Event(kind, stage, microbatch, start,
                                     time.perf_counter() - self.origin, detail))

    def to_dicts(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.events]


_COMPUTE = ("forward", "backward", "recompute")
_WAITS = ("recv", "recv_grad")


def busy_time(events: Sequence[Event], stage: int | None = None) -> float:
    """Seconds a stage computed: its forward, backward and recompute spans, less the receives
    nested in them (a forward that waits for its input is idle, not busy, while it waits)."""
    mine = [e for e in events if stage is None or e.stage == stage]
    compute = [e for e in mine if e.kind in _COMPUTE]
    total = sum(e.end - e.start for e in compute)
    for wait in (e for e in mine if e.kind in _WAITS):
        for span in compute:
            overlap = min(span.end, wait.end) - max(span.start, wait.start)
            if overlap > 0:
                total -= overlap
                break
    return total


def chrome_trace(events: Sequence[Event], *, name: str = "fxpipe", pid: int = 0) -> list[dict]:
    """Trace events: one process `name`, one track (thread) per stage, times in microseconds."""
    out: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": pid,
                                  "args": {"name": name}}]
    for stage in sorted({e.stage for e in events}):
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": stage,
                    "args": {"name": f"stage {stage}"}})
    for e in events:
        label = {"forward": "F", "backward": "B", "recompute": "R"}.get(e.kind, e.kind)
        out.append({"name": f"{label}{e.microbatch}", "cat": e.kind, "ph": "X", "pid": pid,
                    "tid": e.stage, "ts": round(e.start * 1e6, 3),
                    "dur": round(max(e.end - e.start, 0.0) * 1e6, 3),
                    "args": {"microbatch": e.microbatch, "detail": e.detail}})
    return out


def write_chrome_trace(path: str, runs: dict[str, Sequence[Event]]) -> None:
    """Writes several runs (e.g. "measured" and "predicted") into one trace, one process each."""
    events: list[dict] = []
    for pid, (name, run) in enumerate(runs.items()):
        events += chrome_trace(run, name=name, pid=pid)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f, indent=None)


def predicted_events(plan: Any, schedule: str = "gpipe") -> list[Event]:
    """The schedule simulated with the plan's per-stage forward, backward and traffic times."""
    from fxpipe.runtime.schedule import get_schedule, simulate

    k, m = len(plan.stages), plan.chunks
    fwd = [s.forward_time for s in plan.stages]
    bwd = [s.compute_time - s.forward_time for s in plan.stages]
    comm = [s.comm_time / 2 for s in plan.stages]  # each boundary is counted by both its stages
    events, _ = simulate(get_schedule(schedule)(m, k), forward_time=fwd, backward_time=bwd,
                         comm_time=comm)
    kinds = {"F": "forward", "B": "backward"}
    return [Event(kinds.get(e.kind, e.kind), e.stage, e.microbatch, e.start, e.end)
            for e in events]

"""A schedule played with real durations: when each action and message starts and ends.

`simulate` places every action of a schedule (fxpipe.runtime.planning.schedule) in time from
per-stage forward, backward and message times, for any stage graph (skip connections included) and
any placement of stages on ranks; the cost model's predicted step time and timeline come from it.
Nothing here imports torch.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fxpipe.errors import ConfigError
from fxpipe.runtime.planning.schedule import (
    ActionKind,
    Schedule,
    stage_ranks,
    validate,
    waiting,
)

__all__ = ["TimedEvent", "simulate"]


@dataclass(frozen=True)
class TimedEvent:
    """An action (or a message) placed in time by `simulate`.

    kind is "F", "B", "I", "W" or "send". For a send, `stage` is the sender and `peer` the receiver:
    peer > stage ships activations forward, peer < stage ships gradients backward.
    """

    stage: int
    kind: str  # an ActionKind, or "send"
    microbatch: int
    start: float
    end: float
    peer: int | None = None


_TIME_HINT = "times cannot be negative"
_GRADIENT = "G"  # the input gradient of (stage, micro-batch), given by its B or its I
_GIVES_GRADIENT = frozenset(k for k in ActionKind if k.gives_input_grad)


def _per_stage(values: Sequence[float], name: str, num_stages: int) -> list[float]:
    if isinstance(values, (int, float)) or len(values) != num_stages:
        got = values if isinstance(values, (int, float)) else f"{len(values)} values"
        raise ConfigError(
            f"{name} needs one value per stage ({num_stages} stages, got {got})",
            hint=f"pass a sequence of {num_stages} non-negative numbers",
        )
    out = [float(v) for v in values]
    for s, v in enumerate(out):
        if not v >= 0:  # also rejects NaN
            raise ConfigError(f"{name}[{s}] must be >= 0 (got {v})", hint=_TIME_HINT)
    return out


def _edges(edges: Sequence[tuple[int, int]] | None, num_stages: int) -> list[tuple[int, int]]:
    if edges is None:
        return [(s - 1, s) for s in range(1, num_stages)]
    out: list[tuple[int, int]] = []
    for edge in edges:
        src, dst = edge
        if not (0 <= src < dst < num_stages):
            raise ConfigError(
                f"edge {edge!r} is not a forward edge between stages 0..{num_stages - 1}",
                hint="edges are (src, dst) pairs of stage indexes with src < dst",
            )
        if (src, dst) not in out:
            out.append((src, dst))
    return out


def _edge_times(comm_time: Sequence[float] | float | Mapping[tuple[int, int], float],
                edges: list[tuple[int, int]], num_stages: int) -> dict[tuple[int, int], float]:
    if isinstance(comm_time, Mapping):
        comm: dict[tuple[int, int], float] = {}
        for edge, t in comm_time.items():
            if edge not in edges:
                raise ConfigError(
                    f"comm_time names edge {edge!r}, which is not among the edges {edges}",
                    hint="give comm_time only for edges listed in `edges`",
                )
            if not float(t) >= 0:
                raise ConfigError(f"comm_time[{edge!r}] must be >= 0 (got {t})", hint=_TIME_HINT)
            comm[edge] = float(t)
        return {e: comm.get(e, 0.0) for e in edges}
    if isinstance(comm_time, (int, float)):
        if not float(comm_time) >= 0:
            raise ConfigError(f"comm_time must be >= 0 (got {comm_time})", hint=_TIME_HINT)
        return {e: float(comm_time) for e in edges}
    per_stage = _per_stage(comm_time, "comm_time", num_stages)
    return {e: per_stage[e[0]] for e in edges}


def simulate(
    schedule: Schedule,
    *,
    forward_time: Sequence[float],
    backward_time: Sequence[float],
    comm_time: Sequence[float] | float | Mapping[tuple[int, int], float] = 0.0,
    edges: Sequence[tuple[int, int]] | None = None,
    weight_time: Sequence[float] | None = None,
    input_time: Sequence[float] | None = None,
    record: bool = True,
    checked: bool = False,
) -> tuple[list[TimedEvent], float]:
    """Place every action of `schedule` in time; return (events sorted by start, makespan).

    Each rank runs its actions in list order, each as soon as the rank is free and its inputs
    have arrived. Times are per stage. `edges` are the (src, dst) data edges between stages,
    src < dst (default: the chain (s-1, s)). F(s, m) needs F(p, m) + comm for every producer p
    of s; B(s, m) needs B(d, m) + comm for every consumer d of s, and F(s, m); a stage without
    consumers starts B(m) after its own F(m).

    comm_time is the time to ship one micro-batch over an edge; the gradient of an activation
    has the activation's size, so the backward message on an edge costs the same as the
    forward one. It is a scalar (every edge), a per-stage sequence (comm_time[s] for every edge
    leaving s, i.e. the size of stage s's outputs) or a mapping {(src, dst): time} (edges not
    in it cost 0). A message between two stages of one rank costs nothing (it stays in the
    process). Messages that take time appear as "send" events; they overlap compute. With
    gpipe, equal times t_f, t_b and no communication the makespan is (M+K-1)(t_f+t_b).

    A split backward (I and W) costs the backward in all: W takes weight_time[s] (default half
    the backward, as a linear layer's two matmuls), I the rest; I(s, m) waits for I of the
    consumers, W(s, m) for I(s, m).

    record=False places the actions the same way but keeps no events (returns an empty list):
    the makespan alone, as a planner comparing hundreds of candidates needs it. checked=True
    skips checking the schedule's content (validate): one a ScheduleKind built, whose orders
    the tests check, played many times with other stage times.
    """
    if not checked:
        validate(schedule)
    rank_of = stage_ranks(schedule)
    num_stages = len(rank_of)
    fwd = _per_stage(forward_time, "forward_time", num_stages)
    bwd = _per_stage(backward_time, "backward_time", num_stages)
    wgt = [b / 2 for b in bwd] if weight_time is None else \
        _per_stage(weight_time, "weight_time", num_stages)
    if input_time is None:
        for s, (b, w) in enumerate(zip(bwd, wgt)):
            if w > b:
                raise ConfigError(f"weight_time[{s}] = {w} exceeds backward_time[{s}] = {b}",
                                  hint="the weight-gradient pass is a part of the backward")
        inp = [b - w for b, w in zip(bwd, wgt)]
    else:
        inp = _per_stage(input_time, "input_time", num_stages)
    duration_of = {ActionKind.FORWARD: fwd, ActionKind.BACKWARD: bwd,
                   ActionKind.WEIGHT_GRAD: wgt, ActionKind.INPUT_GRAD: inp}
    edge_list = _edges(edges, num_stages)
    edge_comm = {e: 0.0 if rank_of[e[0]] == rank_of[e[1]] else t
                 for e, t in _edge_times(comm_time, edge_list, num_stages).items()}
    producers: list[list[int]] = [[] for _ in range(num_stages)]
    consumers: list[list[int]] = [[] for _ in range(num_stages)]
    for src, dst in edge_list:
        producers[dst].append(src)
        consumers[src].append(dst)

    Key = tuple[str, int, int]  # (kind, stage, micro-batch): an action, cheaper to hash

    def inputs(kind: str, s: int) -> list[tuple[str, int, float]]:
        """What an action of `kind` on stage s waits for, of its own micro-batch: (kind,
        stage, message time); _GRADIENT: the consumer's B or I, whichever it runs."""
        if kind == ActionKind.FORWARD:
            return [(ActionKind.FORWARD, p, edge_comm[(p, s)]) for p in producers[s]]
        if kind == ActionKind.WEIGHT_GRAD:
            return [(ActionKind.INPUT_GRAD, s, 0.0)]
        return [(ActionKind.FORWARD, s, 0.0)] + \
            [(_GRADIENT, d, edge_comm[(s, d)]) for d in consumers[s]]

    waits_for = {(kind, s): inputs(kind, s) for kind in duration_of for s in range(num_stages)}

    end: dict[Key, float] = {}
    events: list[TimedEvent] = []
    position = [0] * len(schedule)
    free = [0.0] * len(schedule)
    blocked: dict[Key, list[int]] = {}  # an action not yet placed -> the ranks waiting on it
    ready = deque(range(len(schedule)))  # ranks whose next action may be placeable
    while ready:
        r = ready.popleft()
        actions = schedule[r]
        while position[r] < len(actions):
            a = actions[position[r]]
            kind, stage, m = a.kind, a.stage, a.microbatch
            waits = waits_for[(kind, stage)]
            start = free[r]
            missing = None
            for k, s, c in waits:
                done = end.get((k, s, m))
                if done is None:
                    missing = (k, s, m)
                    break
                if done + c > start:
                    start = done + c
            if missing is not None:  # woken when it is placed
                blocked.setdefault(missing, []).append(r)
                break
            key = (kind, stage, m)
            end[key] = free[r] = start + duration_of[kind][stage]
            if kind in _GIVES_GRADIENT:
                end[(_GRADIENT, stage, m)] = end[key]
                if (_GRADIENT, stage, m) in blocked:
                    ready.extend(blocked.pop((_GRADIENT, stage, m)))
            if record:
                events.append(TimedEvent(stage, kind, m, start, end[key]))
                for k, s, c in waits:
                    if c > 0:  # the message that brought this input
                        sent = end[(k, s, m)]
                        events.append(TimedEvent(s, "send", m, sent, sent + c, peer=stage))
            position[r] += 1
            if key in blocked:
                ready.extend(blocked.pop(key))
    if any(p < len(acts) for p, acts in zip(position, schedule)):
        stuck = waiting(schedule, position)
        raise ConfigError(
            f"schedule deadlocks on the given edges; next actions wait forever ({stuck})",
            hint="F(s, m) needs its producers' F(m) first; "
            "B(s, m) needs its consumers' B(m) and F(s, m) first",
        )

    if not record:
        return events, max(free)
    order = {ActionKind.FORWARD: 0, ActionKind.BACKWARD: 1, ActionKind.INPUT_GRAD: 1,
             ActionKind.WEIGHT_GRAD: 2, "send": 3}
    events.sort(key=lambda e: (e.start, e.stage, order[e.kind], e.microbatch,
                               -1 if e.peer is None else e.peer))
    makespan = max(e.end for e in events if e.kind != "send")
    return events, makespan

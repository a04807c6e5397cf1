"""Pipeline schedules: which forward and backward each stage runs, in what order, and when.

A schedule is a list with one entry per stage: the forward ("F") and backward ("B") actions
that stage performs, in execution order. Nothing here imports torch; the executors consume
these lists, and the same lists drive the pictures and cost estimates.

* `gpipe` is fill-drain: every stage runs all forwards, then all backwards in reverse
  micro-batch order (as GPipe and torchgpipe do).
* `one_f_one_b` is PipeDream-flush (1F1B): a short warm-up of forwards, then one forward and one
  backward alternately, then the remaining backwards. It takes as many ticks as GPipe but
  stage s keeps at most min(K - s, M) micro-batches alive instead of M.
* `zb_h1` is zero-bubble ZB-H1 (Qi et al., ICLR'24): the backward is split into an
  input-gradient pass "I", which the previous stage waits for, and a weight-gradient pass "W",
  which nobody waits for and so fills the bubble. Stage s keeps at most min(K - s, M)
  micro-batches alive (forward done, W not), as in 1F1B.
* `clock_cycles` plays a schedule on a unit-time clock (each action one tick, as early as its
  dependencies allow) and so also checks that it cannot deadlock; `render_grid` draws it.
* `simulate` does the same with per-stage durations and communication times, for any stage
  graph (skip connections included), and returns timed events and the makespan.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from fxpipe.errors import ConfigError

__all__ = [
    "Action",
    "Schedule",
    "TimedEvent",
    "gpipe",
    "one_f_one_b",
    "zb_h1",
    "SCHEDULES",
    "get_schedule",
    "validate",
    "is_split",
    "clock_cycles",
    "render_grid",
    "bubble_fraction",
    "peak_inflight",
    "simulate",
]

FORWARD = "F"
BACKWARD = "B"
INPUT_GRAD = "I"  # the input-gradient half of a split backward
WEIGHT_GRAD = "W"  # the weight-gradient half: after I(s, m); nothing waits for it


@dataclass(frozen=True)
class Action:
    """One unit of work: the forward or the backward of one micro-batch on one stage."""

    kind: str  # "F", "B", or "I" and "W" (a split backward)
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


Schedule: TypeAlias = list[list[Action]]
"""schedule[s] is the list of actions stage s performs, in execution order."""


@dataclass(frozen=True)
class TimedEvent:
    """An action (or a message) placed in time by `simulate`.

    kind is "F", "B", "I", "W" or "send". For a send, `stage` is the sender and `peer` the receiver:
    peer > stage ships activations forward, peer < stage ships gradients backward.
    """

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float
    peer: int | None = None


# --------------------------------------------------------------------------- construction


def _check_sizes(num_microbatches: int, num_stages: int) -> None:
    for name, value in (("num_microbatches", num_microbatches), ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(
                f"{name} must be an int (got {value!r} of type {type(value).__name__})",
                hint=f"pass {name} as a positive integer",
            )
        if value < 1:
            raise ConfigError(
                f"{name} must be >= 1 (got {value})",
                hint=f"pass {name}=1 or more",
            )


def gpipe(num_microbatches: int, num_stages: int) -> Schedule:
    """Fill-drain: each stage runs F0..F(M-1), then B(M-1)..B0."""
    _check_sizes(num_microbatches, num_stages)
    m_all = range(num_microbatches)
    return [
        [Action(FORWARD, s, m) for m in m_all] + [Action(BACKWARD, s, m) for m in reversed(m_all)]
        for s in range(num_stages)
    ]


def one_f_one_b(num_microbatches: int, num_stages: int) -> Schedule:
    """PipeDream-flush (1F1B): min(K-s-1, M) warm-up forwards, then F/B alternately, then the rest.

    Backwards run in micro-batch order 0..M-1. Stage s never holds more than min(K - s, M)
    micro-batches whose forward is done and whose backward is not.
    """
    _check_sizes(num_microbatches, num_stages)
    schedule: Schedule = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        actions = [Action(FORWARD, s, m) for m in range(warmup)]
        next_f, next_b = warmup, 0
        while next_f < num_microbatches:  # steady state: one forward, one backward
            actions.append(Action(FORWARD, s, next_f))
            actions.append(Action(BACKWARD, s, next_b))
            next_f += 1
            next_b += 1
        actions.extend(Action(BACKWARD, s, m) for m in range(next_b, num_microbatches))
        schedule.append(actions)
    return schedule


def zb_h1(num_microbatches: int, num_stages: int) -> Schedule:
    """ZB-H1: each stage takes, tick by tick, the first ready action among I > F > W.

    Built by playing a unit-time clock (F, I and W one tick each): I as soon as the next stage's
    I(m) is done (it unblocks the stages before), F while the stage holds fewer than
    min(K - s, M) micro-batches whose W is not done (1F1B's memory), else the oldest pending W.
    The W's so fill the ticks where 1F1B's stages wait: at equal times the bubble is about a
    third of 1F1B's.
    """
    _check_sizes(num_microbatches, num_stages)
    k, m_all = num_stages, num_microbatches
    done: dict[Action, int] = {}  # action -> tick it ran
    schedule: Schedule = [[] for _ in range(k)]
    next_f, next_i, next_w = [0] * k, [0] * k, [0] * k
    tick = 0
    while any(w < m_all for w in next_w):
        for s in range(k):
            f, i, w = next_f[s], next_i[s], next_w[s]
            a: Action | None = None
            if i < f and (s == k - 1 or done.get(Action(INPUT_GRAD, s + 1, i), tick) < tick) \
                    and done[Action(FORWARD, s, i)] < tick:
                a = Action(INPUT_GRAD, s, i)
                next_i[s] += 1
            elif f < m_all and f - w < min(k - s, m_all) and \
                    (s == 0 or done.get(Action(FORWARD, s - 1, f), tick) < tick):
                a = Action(FORWARD, s, f)
                next_f[s] += 1
            elif w < i:
                a = Action(WEIGHT_GRAD, s, w)
                next_w[s] += 1
            if a is not None:
                done[a] = tick
                schedule[s].append(a)
        tick += 1
    return schedule


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1}


def get_schedule(name: str) -> Callable[[int, int], Schedule]:
    """The schedule function registered under `name` ("gpipe", "1f1b" or "zb-h1")."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        known = ", ".join(repr(k) for k in SCHEDULES)
        raise ConfigError(
            f"unknown schedule {name!r}; known schedules: {known}",
            hint=f"pass one of {known}",
        ) from None


# --------------------------------------------------------------------------- analysis


_BUILD_HINT = "build one with gpipe(M, K), one_f_one_b(M, K) or zb_h1(M, K)"
_KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)


def is_split(schedule: Schedule) -> bool:
    """Whether the schedule splits backwards into I and W (see `zb_h1`)."""
    return any(a.kind == INPUT_GRAD for acts in schedule for a in acts)


def validate(schedule: Schedule) -> tuple[int, int]:
    """Check that every stage runs F and B (or I and W, for every stage) of every micro-batch
    exactly once, and W(s, m) after I(s, m); return (M, K).

    Only the content is checked here; `clock_cycles` also checks that the order cannot deadlock.
    """
    num_stages = len(schedule)
    if num_stages == 0:
        raise ConfigError("schedule has no stages", hint=_BUILD_HINT)
    num_microbatches = 1 + max((a.microbatch for acts in schedule for a in acts), default=-1)
    if num_microbatches < 1:
        raise ConfigError("schedule has no actions", hint=_BUILD_HINT)
    backward = (INPUT_GRAD, WEIGHT_GRAD) if is_split(schedule) else (BACKWARD,)
    expected = {(k, m) for k in (FORWARD, *backward) for m in range(num_microbatches)}
    for s, actions in enumerate(schedule):
        seen: set[tuple[str, int]] = set()
        for a in actions:
            if a.stage != s:
                raise ConfigError(
                    f"action {a} of stage {a.stage} is listed under stage {s}",
                    hint="schedule[s] must only hold actions with stage == s",
                )
            if a.kind not in _KINDS or a.microbatch < 0:
                raise ConfigError(
                    f"stage {s}: invalid action {a!r}",
                    hint='kind must be "F", "B", "I" or "W" and microbatch >= 0',
                )
            if a.kind == WEIGHT_GRAD and (INPUT_GRAD, a.microbatch) not in seen:
                raise ConfigError(f"stage {s} runs {a} before I{a.microbatch}",
                                  hint="a weight gradient needs its input gradient's pass first")
            if (a.kind, a.microbatch) in seen:
                raise ConfigError(f"stage {s} runs {a} twice", hint="list each action once")
            seen.add((a.kind, a.microbatch))
        missing = sorted(expected - seen, key=lambda km: (_KINDS.index(km[0]), km[1]))
        if missing:
            names = ", ".join(f"{k}{m}" for k, m in missing)
            raise ConfigError(
                f"stage {s} never runs {names} ({num_microbatches} micro-batches in the schedule)",
                hint="every stage must run F and B (or I and W) of every micro-batch",
            )
    return num_microbatches, num_stages


def _deps(action: Action, num_stages: int) -> list[Action]:
    """What must finish before `action` may start, on the chain of stages 0 -> 1 -> ... -> K-1."""
    s, m = action.stage, action.microbatch
    if action.kind == FORWARD:
        return [Action(FORWARD, s - 1, m)] if s > 0 else []
    if action.kind == WEIGHT_GRAD:
        return [Action(INPUT_GRAD, s, m)]
    deps = [Action(FORWARD, s, m)]
    if s < num_stages - 1:
        deps.append(Action(action.kind, s + 1, m))  # B after B, I after I
    return deps


def clock_cycles(schedule: Schedule) -> list[list[Action | None]]:
    """Play `schedule` on a unit-time clock; return grid[tick][stage] (None where idle).

    Each action takes one tick and starts at the first tick when its stage has run everything
    listed before it and its dependencies finished in an earlier tick: F(s, m) after F(s-1, m);
    B(s, m) after B(s+1, m) and after F(s, m) (the last stage's B(m) only after its F(m)).
    Raises ConfigError if the schedule is incomplete or its order deadlocks.
    """
    _, num_stages = validate(schedule)
    done: set[Action] = set()
    position = [0] * num_stages
    grid: list[list[Action | None]] = []
    remaining = sum(len(acts) for acts in schedule)
    while remaining:
        row: list[Action | None] = [None] * num_stages
        for s, actions in enumerate(schedule):
            if position[s] < len(actions):
                a = actions[position[s]]
                if all(d in done for d in _deps(a, num_stages)):
                    row[s] = a
        ran = [a for a in row if a is not None]
        if not ran:
            stuck = ", ".join(
                f"stage {s}: {acts[position[s]]}"
                for s, acts in enumerate(schedule)
                if position[s] < len(acts)
            )
            raise ConfigError(
                f"schedule deadlocks at tick {len(grid)}; next actions wait forever ({stuck})",
                hint="F(s, m) needs F(s-1, m) first and B(s, m) needs B(s+1, m) and F(s, m) first",
            )
        for a in ran:
            done.add(a)
            position[a.stage] += 1
        remaining -= len(ran)
        grid.append(row)
    return grid


def bubble_fraction(num_microbatches: int, num_stages: int) -> float:
    """Idle fraction of GPipe (and 1F1B) with equal unit costs: (K-1)/(M+K-1)."""
    _check_sizes(num_microbatches, num_stages)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def peak_inflight(schedule: Schedule) -> list[int]:
    """Per stage: the most micro-batches whose forward is done and backward (W, in a split
    backward: it still reads the activations) is not, at once."""
    peaks = []
    for actions in schedule:
        live = peak = 0
        for a in actions:
            if a.kind == INPUT_GRAD:
                continue
            live += 1 if a.kind == FORWARD else -1
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def render_grid(schedule: Schedule, *, title: str = "") -> str:
    """Draw `clock_cycles(schedule)` as text, one row per tick, with notes on the right.

    The notes are "<title>, K stages x M microbatches" and the bubble, e.g.
    "bubble = (S-1)/(M+S-1) = 2/6 = 33%" (S = stages); if the schedule idles more than that
    formula says, the measured idle fraction is shown instead.
    """
    num_microbatches, num_stages = validate(schedule)
    grid = clock_cycles(schedule)
    ticks = len(grid)

    size = f"{num_stages} stages x {num_microbatches} microbatches"
    work = sum(len(acts) for acts in schedule)
    idle = ticks * num_stages - work
    ideal_num, ideal_den = num_stages - 1, num_microbatches + num_stages - 1
    if not is_split(schedule) and idle * ideal_den == ideal_num * ticks * num_stages:
        percent = 100 * ideal_num / ideal_den
        bubble = f"bubble = (S-1)/(M+S-1) = {ideal_num}/{ideal_den} = {percent:.0f}%"
    else:
        total = ticks * num_stages
        bubble = f"bubble = idle/total = {idle}/{total} = {100 * idle / total:.0f}%"
    notes = [f"{title}, {size}" if title else size, bubble]

    clock_w = max(len("clock"), len(str(ticks - 1)))
    headers = [f"stage {s}" for s in range(num_stages)]
    widths = [
        max([len(headers[s])] + [len(str(row[s])) for row in grid if row[s] is not None])
        for s in range(num_stages)
    ]
    sep, note_gap = "  ", " " * 8

    lines = ["clock".ljust(clock_w) + "".join(sep + h.ljust(w) for h, w in zip(headers, widths))]
    for tick, row in enumerate(grid):
        cells = ["" if a is None else str(a) for a in row]
        body = "".join(sep + c.ljust(w) for c, w in zip(cells, widths))
        lines.append(str(tick).rjust(clock_w) + body)
    while len(lines) < len(notes):
        lines.append(" " * len(lines[0]))
    for i, note in enumerate(notes):
        lines[i] = lines[i] + note_gap + note
    return "\n".join(line.rstrip() for line in lines)


# --------------------------------------------------------------------------- timing


_TIME_HINT = "times cannot be negative"


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


def simulate(
    schedule: Schedule,
    *,
    forward_time: Sequence[float],
    backward_time: Sequence[float],
    comm_time: Sequence[float] | float | Mapping[tuple[int, int], float] = 0.0,
    edges: Sequence[tuple[int, int]] | None = None,
    weight_time: Sequence[float] | None = None,
) -> tuple[list[TimedEvent], float]:
    """Place every action of `schedule` in time; return (events sorted by start, makespan).

    Each stage runs its actions in list order, each as soon as the stage is free and its inputs
    have arrived. `edges` are the (src, dst) data edges between stages, src < dst (default: the
    chain (s-1, s)). F(s, m) needs F(p, m) + comm for every producer p of s; B(s, m) needs
    B(d, m) + comm for every consumer d of s, and F(s, m); a stage without consumers starts
    B(m) after its own F(m).

    comm_time is the time to ship one micro-batch over an edge; the gradient of an activation
    has the activation's size, so the backward message on an edge costs the same as the
    forward one. It is a scalar (every edge), a per-stage sequence (comm_time[s] for every edge
    leaving s, i.e. the size of stage s's outputs) or a mapping {(src, dst): time} (edges not
    in it cost 0). Messages that take time appear as "send" events; they overlap compute.
    With gpipe, equal times t_f, t_b and no communication the makespan is (M+K-1)(t_f+t_b).

    A split backward (I and W) costs the backward in all: W takes weight_time[s] (default half
    the backward, as a linear layer's two matmuls), I the rest; I(s, m) waits for I of the
    consumers, W(s, m) for I(s, m).
    """
    num_microbatches, num_stages = validate(schedule)
    fwd = _per_stage(forward_time, "forward_time", num_stages)
    bwd = _per_stage(backward_time, "backward_time", num_stages)
    wgt = [b / 2 for b in bwd] if weight_time is None else \
        _per_stage(weight_time, "weight_time", num_stages)
    for s, (b, w) in enumerate(zip(bwd, wgt)):
        if w > b:
            raise ConfigError(f"weight_time[{s}] = {w} exceeds backward_time[{s}] = {b}",
                              hint="the weight-gradient pass is a part of the backward")
    duration_of = {FORWARD: fwd, BACKWARD: bwd, WEIGHT_GRAD: wgt,
                   INPUT_GRAD: [b - w for b, w in zip(bwd, wgt)]}

    if edges is None:
        edge_list = [(s - 1, s) for s in range(1, num_stages)]
    else:
        edge_list = []
        for edge in edges:
            src, dst = edge
            if not (0 <= src < dst < num_stages):
                raise ConfigError(
                    f"edge {edge!r} is not a forward edge between stages 0..{num_stages - 1}",
                    hint="edges are (src, dst) pairs of stage indices with src < dst",
                )
            if (src, dst) not in edge_list:
                edge_list.append((src, dst))

    if isinstance(comm_time, Mapping):
        comm: dict[tuple[int, int], float] = {}
        for edge, t in comm_time.items():
            if edge not in edge_list:
                raise ConfigError(
                    f"comm_time names edge {edge!r}, which is not among the edges {edge_list}",
                    hint="give comm_time only for edges listed in `edges`",
                )
            if not float(t) >= 0:
                raise ConfigError(f"comm_time[{edge!r}] must be >= 0 (got {t})", hint=_TIME_HINT)
            comm[edge] = float(t)
        edge_comm = {e: comm.get(e, 0.0) for e in edge_list}
    elif isinstance(comm_time, (int, float)):
        if not float(comm_time) >= 0:
            raise ConfigError(f"comm_time must be >= 0 (got {comm_time})", hint=_TIME_HINT)
        edge_comm = {e: float(comm_time) for e in edge_list}
    else:
        per_stage = _per_stage(comm_time, "comm_time", num_stages)
        edge_comm = {e: per_stage[e[0]] for e in edge_list}

    producers: list[list[int]] = [[] for _ in range(num_stages)]
    consumers: list[list[int]] = [[] for _ in range(num_stages)]
    for src, dst in edge_list:
        producers[dst].append(src)
        consumers[src].append(dst)

    end: dict[Action, float] = {}
    events: list[TimedEvent] = []
    position = [0] * num_stages
    free = [0.0] * num_stages
    remaining = sum(len(acts) for acts in schedule)
    while remaining:
        progressed = False
        for s, actions in enumerate(schedule):
            while position[s] < len(actions):
                a = actions[position[s]]
                m = a.microbatch
                if a.kind == FORWARD:
                    inputs = [(Action(FORWARD, p, m), edge_comm[(p, s)]) for p in producers[s]]
                elif a.kind == WEIGHT_GRAD:
                    inputs = [(Action(INPUT_GRAD, s, m), 0.0)]
                else:
                    inputs = [(Action(FORWARD, s, m), 0.0)]
                    inputs += [(Action(a.kind, d, m), edge_comm[(s, d)]) for d in consumers[s]]
                duration = duration_of[a.kind][s]
                if any(dep not in end for dep, _ in inputs):
                    break
                start = max([free[s]] + [end[dep] + c for dep, c in inputs])
                end[a] = free[s] = start + duration
                events.append(TimedEvent(s, a.kind, m, start, end[a]))
                for dep, c in inputs:
                    if c > 0:  # the message that brought this input
                        sent = end[dep]
                        events.append(TimedEvent(dep.stage, "send", m, sent, sent + c, peer=s))
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = ", ".join(
                f"stage {s}: {acts[position[s]]}"
                for s, acts in enumerate(schedule)
                if position[s] < len(acts)
            )
            raise ConfigError(
                f"schedule deadlocks on the given edges; next actions wait forever ({stuck})",
                hint="F(s, m) needs its producers' F(m) first; "
                "B(s, m) needs its consumers' B(m) and F(s, m) first",
            )

    order = {FORWARD: 0, BACKWARD: 1, INPUT_GRAD: 1, WEIGHT_GRAD: 2, "send": 3}
    events.sort(key=lambda e: (e.start, e.stage, order[e.kind], e.microbatch))
    makespan = max(e.end for e in events if e.kind != "send")
    return events, makespan

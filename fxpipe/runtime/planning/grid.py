"""A schedule played on a unit-time clock: the tick grid, its picture, and what it keeps alive.

* `play` is the one clock a schedule (fxpipe.runtime.planning.schedule) is played on: every action
takes
  one tick and starts as early as its dependencies and its rank allow, which also checks that
  the order cannot deadlock. The point-to-point plan (fxpipe.runtime.planning.plan) and the local
  executor play a schedule on it; `clock_cycles` plays one on a chain of stages and
  `render_grid` draws that as text, one column per rank.
* `bubble_fraction` is the idle share of GPipe and 1F1B at equal times; `peak_inflight` is
  what each stage keeps alive at most, the input of the memory model.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from fxpipe.errors import ConfigError
from fxpipe.figures import idle_share
from fxpipe.runtime.planning.schedule import (
    Action,
    ActionKind,
    Schedule,
    check_sizes,
    is_split,
    stage_ranks,
    validate,
    waiting,
)

__all__ = ["play", "chain", "clock_cycles", "render_grid", "bubble_fraction", "peak_inflight"]


def chain(num_stages: int) -> list[tuple[int, int]]:
    """The data edges of a chain of stages 0 -> 1 -> ... -> S-1."""
    return [(s, s + 1) for s in range(num_stages - 1)]


def play(actions_by_rank: Sequence[Sequence[Action]],
         edges: Iterable[tuple[int, int]]) -> list[list[Action | None]]:
    """The one unit-time clock every schedule is played on; grid[tick][rank] (None: idle).

    Each rank runs its list in order, one action per tick, each at the first tick when the
    actions it depends on ended in an earlier tick: F(s, m) on F(p, m) for every producer p of
    s (along `edges`, (src, dst) stage pairs); the backward of s (B, or I of a split backward)
    on F(s, m) and on the backward of every consumer of s; W(s, m) on I(s, m). Raises
    ConfigError if the order deadlocks.
    """
    producers: dict[int, set[int]] = defaultdict(set)
    consumers: dict[int, set[int]] = defaultdict(set)
    for src, dst in edges:
        if src != dst:
            producers[dst].add(src)
            consumers[src].add(dst)
    backward = {(a.stage, a.microbatch): a.kind for actions in actions_by_rank for a in actions
                if a.kind.gives_input_grad}

    def depends_on(a: Action) -> list[Action]:
        s, m = a.stage, a.microbatch
        if a.kind == ActionKind.FORWARD:
            return [Action(ActionKind.FORWARD, p, m) for p in producers[s]]
        if a.kind == ActionKind.WEIGHT_GRAD:
            return [Action(ActionKind.INPUT_GRAD, s, m)]
        return [Action(ActionKind.FORWARD, s, m)] + [
            Action(backward.get((d, m), ActionKind.BACKWARD), d, m) for d in consumers[s]]

    # Each action starts one tick after the later of its rank's previous action and the
    # actions it depends on: a rank's next action is placed as soon as those are placed, woken
    # by the last of them, so the grid costs one visit per action, not one per rank per tick.
    start: dict[Action, int] = {}
    position = [0] * len(actions_by_rank)
    ready_at = [0] * len(actions_by_rank)  # the first tick rank r's next action may take
    waiters: dict[Action, list[int]] = defaultdict(list)
    todo = list(range(len(actions_by_rank)))
    while todo:
        r = todo.pop()
        actions = actions_by_rank[r]
        while position[r] < len(actions):
            a = actions[position[r]]
            after = depends_on(a)
            missing = next((d for d in after if d not in start), None)
            if missing is not None:
                waiters[missing].append(r)
                break
            tick = max([ready_at[r], *(start[d] + 1 for d in after)])
            start[a] = tick
            ready_at[r] = tick + 1
            position[r] += 1
            todo += waiters.pop(a, ())
    if any(p < len(actions) for p, actions in zip(position, actions_by_rank)):
        stuck = waiting(actions_by_rank, position)
        raise ConfigError(
            f"the schedule deadlocks at tick {max(ready_at)}; next actions wait forever "
            f"({stuck})", hint="each rank must run an action only after the actions it "
            "depends on, on any rank: F(s, m) after its producers' F(m), a backward after "
            "F(s, m) and its consumers' backward, W after I")
    grid: list[list[Action | None]] = [[None] * len(actions_by_rank)
                                       for _ in range(max(ready_at, default=0))]
    for r, actions in enumerate(actions_by_rank):
        for a in actions:
            grid[start[a]][r] = a
    return grid


def clock_cycles(schedule: Schedule) -> list[list[Action | None]]:
    """Play `schedule` on a chain of stages (`play`); return grid[tick][rank] (None where idle).

    F(s, m) runs after F(s-1, m); B(s, m) after B(s+1, m) and after F(s, m) (the last stage's
    B(m) only after its F(m)). Raises ConfigError if the schedule is incomplete or its order
    deadlocks.
    """
    _, num_stages = validate(schedule)
    return play(schedule, chain(num_stages))


def bubble_fraction(num_microbatches: int, num_stages: int) -> float:
    """Idle fraction of GPipe (and 1F1B) with equal unit costs: (K-1)/(M+K-1)."""
    check_sizes(num_microbatches, num_stages)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def peak_inflight(schedule: Schedule) -> list[int]:
    """Per stage: the most micro-batches whose forward is done and backward (W, in a split
    backward: it still reads the activations) is not, at once."""
    num_stages = len(stage_ranks(schedule))
    live, peaks = [0] * num_stages, [0] * num_stages
    for actions in schedule:
        for a in actions:
            if a.kind == ActionKind.INPUT_GRAD:
                continue
            live[a.stage] += 1 if a.kind == ActionKind.FORWARD else -1
            peaks[a.stage] = max(peaks[a.stage], live[a.stage])
    return peaks


def _is_flat(schedule: Schedule) -> bool:
    return stage_ranks(schedule) == list(range(len(schedule)))


def render_grid(schedule: Schedule, *, title: str = "", bubble: float | None = None) -> str:
    """Draw `clock_cycles(schedule)` as text, one row per tick, with notes on the right.

    The notes are "<title>, S stages x M microbatches" (with ", R ranks" when a rank holds
    several stages) and the bubble, e.g. "bubble = (S-1)/(M+S-1) = 2/6 = 33%"; if the schedule
    idles more than that formula says, or holds several stages per rank, the idle fraction of
    the grid is shown instead; `bubble` given (the idle share simulated with the stages' real
    costs, fxpipe.figures.idle_share), that one. Flat schedules have a column per stage ("F3" =
    forward of micro-batch 3); looped ones a column per rank whose cells name the stage ("2F3").
    """
    num_microbatches, num_stages = validate(schedule)
    grid = clock_cycles(schedule)
    ticks, ranks = len(grid), len(schedule)
    flat = _is_flat(schedule)

    size = f"{num_stages} stages x {num_microbatches} microbatches"
    if not flat:
        size += f" on {ranks} ranks"
    work = sum(len(acts) for acts in schedule)
    idle = ticks * ranks - work
    ideal_num, ideal_den = num_stages - 1, num_microbatches + num_stages - 1
    if bubble is not None:
        note = f"bubble = {bubble:.1%} (idle share, simulated with the stage costs)"
    elif flat and not is_split(schedule) and idle * ideal_den == ideal_num * ticks * ranks:
        percent = 100 * ideal_num / ideal_den
        note = f"bubble = (S-1)/(M+S-1) = {ideal_num}/{ideal_den} = {percent:.0f}%"
    else:
        total = ticks * ranks  # the idle share at unit costs (fxpipe.figures, the one bubble)
        note = f"bubble = idle/total = {idle}/{total} = {100 * idle_share(work, ranks, ticks):.0f}%"
    notes = [f"{title}, {size}" if title else size, note]
    if not flat:
        notes.append("cells: stage, action, micro-batch (2F3: stage 2 forwards micro-batch 3)")

    def cell(a: Action | None) -> str:
        return "" if a is None else str(a) if flat else f"{a.stage}{a}"

    clock_w = max(len("clock"), len(str(ticks - 1)))
    headers = [f"stage {r}" if flat else f"rank {r}" for r in range(ranks)]
    widths = [max([len(headers[r])] + [len(cell(row[r])) for row in grid])
              for r in range(ranks)]
    sep, note_gap = "  ", " " * 8

    lines = ["clock".ljust(clock_w) + "".join(sep + h.ljust(w) for h, w in zip(headers, widths))]
    for tick, row in enumerate(grid):
        body = "".join(sep + cell(a).ljust(w) for a, w in zip(row, widths))
        lines.append(str(tick).rjust(clock_w) + body)
    while len(lines) < len(notes):
        lines.append(" " * len(lines[0]))
    for i, note in enumerate(notes):
        lines[i] = lines[i] + note_gap + note
    return "\n".join(line.rstrip() for line in lines)


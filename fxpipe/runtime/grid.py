"""A schedule played on a unit-time clock: the tick grid, its picture, and what it keeps alive.

* `clock_cycles` plays a schedule (fxpipe.runtime.schedule) on a clock where every action takes
  one tick and starts as early as its dependencies and its rank allow, which also checks that
  the order cannot deadlock; `render_grid` draws it as text, one column per rank.
* `bubble_fraction` is the idle share of GPipe and 1F1B at equal times; `peak_inflight` is
  what each stage keeps alive at most, the input of the memory model.
"""
from __future__ import annotations

from fxpipe.errors import ConfigError
from fxpipe.runtime.schedule import (
    Action,
    ActionKind,
    Schedule,
    check_sizes,
    is_split,
    stage_ranks,
    validate,
    waiting,
)

__all__ = ["clock_cycles", "render_grid", "bubble_fraction", "peak_inflight", "dependencies"]


def dependencies(action: Action, num_stages: int) -> list[Action]:
    """What must finish before `action` may start, on the chain of stages 0 -> 1 -> ... -> S-1."""
    s, m = action.stage, action.microbatch
    if action.kind == ActionKind.FORWARD:
        return [Action(ActionKind.FORWARD, s - 1, m)] if s > 0 else []
    if action.kind == ActionKind.WEIGHT_GRAD:
        return [Action(ActionKind.INPUT_GRAD, s, m)]
    deps = [Action(ActionKind.FORWARD, s, m)]
    if s < num_stages - 1:
        deps.append(Action(action.kind, s + 1, m))  # B after B, I after I
    return deps


def clock_cycles(schedule: Schedule) -> list[list[Action | None]]:
    """Play `schedule` on a unit-time clock; return grid[tick][rank] (None where idle).

    Each action takes one tick and starts at the first tick when its rank has run everything
    listed before it and its dependencies finished in an earlier tick: F(s, m) after F(s-1, m);
    B(s, m) after B(s+1, m) and after F(s, m) (the last stage's B(m) only after its F(m)).
    Raises ConfigError if the schedule is incomplete or its order deadlocks.
    """
    _, num_stages = validate(schedule)
    done: set[Action] = set()
    position = [0] * len(schedule)
    grid: list[list[Action | None]] = []
    remaining = sum(len(acts) for acts in schedule)
    while remaining:
        row: list[Action | None] = [None] * len(schedule)
        for r, actions in enumerate(schedule):
            if position[r] < len(actions):
                a = actions[position[r]]
                if all(d in done for d in dependencies(a, num_stages)):
                    row[r] = a
        ran = [(r, a) for r, a in enumerate(row) if a is not None]
        if not ran:
            stuck = waiting(schedule, position)
            raise ConfigError(
                f"schedule deadlocks at tick {len(grid)}; next actions wait forever ({stuck})",
                hint="F(s, m) needs F(s-1, m) first and B(s, m) needs B(s+1, m) and F(s, m) first",
            )
        for r, a in ran:
            done.add(a)
            position[r] += 1
        remaining -= len(ran)
        grid.append(row)
    return grid


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
        total = ticks * ranks
        note = f"bubble = idle/total = {idle}/{total} = {100 * idle / total:.0f}%"
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


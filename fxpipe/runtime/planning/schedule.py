"""Pipeline schedules: which forwards and backwards each rank runs, in what order.

A schedule is a list with one entry per pipeline rank: the actions that rank performs, in
execution order. An action is the forward ("F") or backward ("B") of one micro-batch on one
stage; a rank holds one stage (flat schedules, stage s on rank s) or several (looped ones).
Nothing here imports torch; the executors consume these lists, and the same lists drive the
pictures (fxpipe.runtime.planning.grid) and the time predictions (fxpipe.runtime.planning.simulate).

Flat, one stage per rank:
* `gpipe` is fill-drain: every stage runs all forwards, then all backwards in reverse
  micro-batch order (as GPipe and torchgpipe do).
* `one_f_one_b` is PipeDream-flush (1F1B): a short warm-up of forwards, then one forward and one
  backward alternately, then the remaining backwards. It takes as many ticks as GPipe but
  stage s keeps at most min(K - s, M) micro-batches alive instead of M.
* `zb_h1` is zero-bubble ZB-H1 (Qi et al., ICLR'24): the backward is split into an
  input-gradient pass "I", which the previous stage waits for, and a weight-gradient pass "W",
  which nobody waits for and so fills the bubble. Stage s keeps at most min(K - s, M)
  micro-batches alive (forward done, W not), as in 1F1B.

Looped, several stages per rank (the model cut into more, smaller stages):
* `interleaved_1f1b` (Narayanan et al., SC'21) places stage s on rank s mod R, so each rank
  holds v = S / R stages spread along the model; the pipeline fills in 1/v of the time, which
  divides the bubble by about v, for v times the messages.
* `zb_v` and `dualpipe_v` (fxpipe.runtime.planning.v_schedules) fold 2R stages in a V over R
  ranks, the last stage beside the first: ZB-V splits every backward into I and W, DualPipeV
  only those of the warm-up and cool-down.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fxpipe.errors import ConfigError
from fxpipe.runtime.planning.actions import (
    Action,
    ActionKind,
    Schedule,
    check_sizes,
    check_stages_per_rank,
)
from fxpipe.runtime.planning.v_schedules import dualpipe_v, zb_v

__all__ = [
    "Action",
    "Schedule",
    "ScheduleKind",
    "schedule_kind",
    "gpipe",
    "one_f_one_b",
    "zb_h1",
    "interleaved_1f1b",
    "zb_v",
    "dualpipe_v",
    "SCHEDULES",
    "DEFAULT_SCHEDULE",
    "LOOPED",
    "make_schedule",
    "placement",
    "default_stages_per_rank",
    "stages_per_rank_for",
    "stages_on",
    "check_layout",
    "validate",
    "stage_ranks",
    "is_split",
    "waiting",
    "check_sizes",
    "ActionKind",
]


# --------------------------------------------------------------------------- construction



def gpipe(num_microbatches: int, num_stages: int) -> Schedule:
    """Fill-drain: each stage runs F0..F(M-1), then B(M-1)..B0."""
    check_sizes(num_microbatches, num_stages)
    m_all = range(num_microbatches)
    return [
        [Action(ActionKind.FORWARD, s, m) for m in m_all]
        + [Action(ActionKind.BACKWARD, s, m) for m in reversed(m_all)]
        for s in range(num_stages)
    ]


def one_f_one_b(num_microbatches: int, num_stages: int) -> Schedule:
    """PipeDream-flush (1F1B): min(K-s-1, M) warm-up forwards, then F/B alternately, then the rest.

    Backwards run in micro-batch order 0..M-1. Stage s never holds more than min(K - s, M)
    micro-batches whose forward is done and whose backward is not.
    """
    check_sizes(num_microbatches, num_stages)
    schedule: Schedule = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        forwards = [Action(ActionKind.FORWARD, s, m) for m in range(num_microbatches)]
        backwards = [Action(ActionKind.BACKWARD, s, m) for m in range(num_microbatches)]
        schedule.append(_warm_up_then_alternate(forwards, backwards, warmup))
    return schedule


def _warm_up_then_alternate(forwards: list[Action], backwards: list[Action],
                            warmup: int) -> list[Action]:
    """`warmup` forwards, then one forward and one backward in turn, then the other backwards."""
    actions = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        actions += [f, b]
    return actions + backwards[len(forwards) - warmup:]


def zb_h1(num_microbatches: int, num_stages: int) -> Schedule:
    """ZB-H1 in the order of the zero-bubble paper: 1F1B's forwards and input gradients (I),
    each weight gradient (W) deferred by the stage's index.

    Stage s runs 1F1B's order of F and I (K-s-1 forwards to warm up, then F and I in turn), and
    W(m) right after I(m+s); the last s W's close the step. The W's so fill the ticks where
    1F1B's stages wait for the backwards to come back: at F = I = W the step is 3M + K - 1
    units against 1F1B's 3(M + K - 1), a third of its bubble. Micro-batches whose I is not
    done stay at 1F1B's K-s; counting those whose W is not done (the split backward keeps a
    micro-batch's saved tensors until its W), every stage holds min(K, M) at its peak, the
    first stage's peak under 1F1B.
    """
    check_sizes(num_microbatches, num_stages)
    schedule: Schedule = []
    for s in range(num_stages):
        forwards = [Action(ActionKind.FORWARD, s, m) for m in range(num_microbatches)]
        input_grads = [Action(ActionKind.INPUT_GRAD, s, m) for m in range(num_microbatches)]
        actions: list[Action] = []
        for a in _warm_up_then_alternate(forwards, input_grads,
                                         min(num_stages - s - 1, num_microbatches)):
            actions.append(a)
            if a.kind == ActionKind.INPUT_GRAD and a.microbatch >= s:
                actions.append(Action(ActionKind.WEIGHT_GRAD, s, a.microbatch - s))
        first_left = max(num_microbatches - s, 0)
        actions += [Action(ActionKind.WEIGHT_GRAD, s, m)
                    for m in range(first_left, num_microbatches)]
        schedule.append(actions)
    return schedule


def _rounds(num_microbatches: int, num_ranks: int) -> list[range]:
    """Micro-batches in rounds of at least `num_ranks` (as equal as possible), so a rank's
    first round keeps every rank busy before the backwards come back."""
    count = max(1, num_microbatches // num_ranks)
    size, larger = divmod(num_microbatches, count)
    rounds, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < larger else 0)
        rounds.append(range(start, end))
        start = end
    return rounds


def interleaved_1f1b(num_microbatches: int, num_stages: int, num_ranks: int) -> Schedule:
    """Interleaved 1F1B: stage s on rank s mod R, v = S / R stages per rank.

    A rank takes its (stage, micro-batch) pairs round by round (`_rounds`): within a round,
    forwards stage by stage along the model and backwards in the opposite direction. It warms
    up with the forwards the first backward needs (v - 1 rounds' worth, plus two per rank
    after it: the way down and back of micro-batch 0), then alternates one forward and one
    backward, then drains. Rank r keeps at most about (v - 1) rounds + 2(R - r) + 1 of its
    stage-micro-batches alive.
    """
    check_sizes(num_microbatches, num_stages)
    v = check_stages_per_rank(num_stages, num_ranks, "interleaved-1f1b")
    rounds = _rounds(num_microbatches, num_ranks)

    def order(kind: ActionKind, rank: int, chunks: list[int]) -> list[Action]:
        return [Action(kind, c * num_ranks + rank, m) for group in rounds for c in chunks
                for m in group]

    schedule: Schedule = []
    for r in range(num_ranks):
        forwards = order(ActionKind.FORWARD, r, list(range(v)))
        backwards = order(ActionKind.BACKWARD, r, list(reversed(range(v))))
        warmup = min(2 * (num_ranks - r - 1) + (v - 1) * len(rounds[0]), len(forwards))
        schedule.append(_warm_up_then_alternate(forwards, backwards, warmup))
    return schedule




# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ScheduleKind:
    """A schedule by name, with everything that differs between schedules: how it orders the
    actions, how many stages a rank holds, where the stages go and whether the backward is
    split. A name is resolved to its kind once (`schedule_kind`); code after that asks the kind.
    """

    name: str
    title: str  # as the report's picture names it
    order: Callable[[int, int, int], Schedule]  # (micro-batches, stages, ranks) -> the schedule
    fixed_stages_per_rank: int | None  # exactly this many stages per rank; None: any from 2
    splits_backward: bool = False  # some or every backward runs as I then W (zero-bubble)
    v_shape: bool = False  # rank r holds stages r and 2R-1-r; else stage s on rank s mod R

    def __str__(self) -> str:
        return self.name

    @property
    def looped(self) -> bool:
        """Whether a rank holds several stages."""
        return self.fixed_stages_per_rank != 1

    @property
    def default_stages_per_rank(self) -> int:
        """How many stages a rank holds unless told otherwise: 2 for the looped schedules
        (ZB-V takes exactly 2), 1 for the others."""
        return self.fixed_stages_per_rank or 2

    def stages_per_rank_for(self, requested: int) -> int:
        """The stages per rank this schedule runs when a program asks for `requested`:
        interleaving takes any number from 2 (else 2), ZB-V exactly 2, the flat schedules 1."""
        if self.fixed_stages_per_rank is None and requested > 1:
            return requested
        return self.default_stages_per_rank

    def ranks_for(self, num_stages: int) -> int:
        """The number of ranks `num_stages` stages take at the default stages per rank."""
        return max(num_stages // self.default_stages_per_rank, 1)

    def check_ranks(self, num_stages: int, num_ranks: int) -> int:
        """The stages per rank of `num_stages` stages on `num_ranks` ranks; ConfigError where
        this schedule cannot place them so."""
        return check_stages_per_rank(num_stages, num_ranks, self.name, self.fixed_stages_per_rank)

    def build(self, num_microbatches: int, num_stages: int,
              num_ranks: int | None = None) -> Schedule:
        """The schedule for M micro-batches and S stages on R ranks (default: S at the default
        stages per rank)."""
        check_sizes(num_microbatches, num_stages)
        if num_ranks is None:
            num_ranks = self.ranks_for(num_stages)
        self.check_ranks(num_stages, num_ranks)
        return self.order(num_microbatches, num_stages, num_ranks)

    def placement(self, num_stages: int, num_ranks: int) -> list[int]:
        """placement[s]: the pipeline rank that runs stage s."""
        self.check_ranks(num_stages, num_ranks)
        if self.v_shape:
            return [s if s < num_ranks else num_stages - 1 - s for s in range(num_stages)]
        return [s % num_ranks for s in range(num_stages)]

    def check_layout(self, num_stages: int, stages_per_rank: int) -> int:
        """The number of ranks of `num_stages` stages at `stages_per_rank` each; raises
        ConfigError where this schedule cannot place them so."""
        name = self.name
        if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) \
                or stages_per_rank < 1:
            raise ConfigError(f"stages_per_rank must be an integer >= 1 (got "
                              f"{stages_per_rank!r})",
                              hint="pass 1, or 2 or more for a looped schedule")
        if not self.looped and stages_per_rank != 1:
            raise ConfigError(f"schedule {name!r} runs one stage per rank (stages_per_rank="
                              f"{stages_per_rank})",
                              hint="use schedule='interleaved-1f1b' or 'zb-v' for several "
                                   "stages per rank, or stages_per_rank=1")
        fixed = self.fixed_stages_per_rank
        if self.looped and fixed is not None and stages_per_rank != fixed:
            raise ConfigError(f"{name} places exactly {fixed} stages on each rank "
                              f"(stages_per_rank={stages_per_rank})",
                              hint=f"pass stages_per_rank={fixed}, or use "
                                   "schedule='interleaved-1f1b'")
        if self.looped and stages_per_rank < 2:
            raise ConfigError(f"{name} places several stages on each rank (stages_per_rank=1)",
                              hint="pass stages_per_rank=2 or more, or use a flat schedule "
                                   "('gpipe', '1f1b', 'zb-h1')")
        if num_stages % stages_per_rank:
            raise ConfigError(f"{num_stages} stages do not divide into {stages_per_rank} "
                              f"stages per rank under {name}",
                              hint=f"use a multiple of {stages_per_rank} stages")
        return num_stages // stages_per_rank


def _ranks_from_stages(fn: Callable[[int, int], Schedule]
                       ) -> Callable[[int, int, int], Schedule]:
    """An order whose number of ranks follows from its stages (checked by the kind)."""
    return lambda num_microbatches, num_stages, num_ranks: fn(num_microbatches, num_stages)


SCHEDULES: dict[str, ScheduleKind] = {k.name: k for k in (
    ScheduleKind("gpipe", "GPipe", _ranks_from_stages(gpipe), 1),
    ScheduleKind("1f1b", "1F1B", _ranks_from_stages(one_f_one_b), 1),
    ScheduleKind("zb-h1", "ZB-H1", _ranks_from_stages(zb_h1), 1, splits_backward=True),
    ScheduleKind("interleaved-1f1b", "Interleaved 1F1B", interleaved_1f1b, None),
    ScheduleKind("zb-v", "ZB-V", _ranks_from_stages(zb_v), 2, splits_backward=True, v_shape=True),
    ScheduleKind("dualpipev", "DualPipeV", _ranks_from_stages(dualpipe_v), 2,
                 splits_backward=True, v_shape=True),
)}
"""Every schedule kind by the name the options accept."""

DEFAULT_SCHEDULE = SCHEDULES["gpipe"]
"""The schedule a program runs unless told otherwise: fill-drain, as torchgpipe."""

LOOPED = frozenset(name for name, kind in SCHEDULES.items() if kind.looped)
"""The names of the schedules that place several stages on each rank."""


def schedule_kind(name: str | ScheduleKind) -> ScheduleKind:
    """The schedule kind called `name` (a kind is returned as it is); ConfigError naming the
    known ones for any other name."""
    if isinstance(name, ScheduleKind):
        return name
    if not isinstance(name, str) or name not in SCHEDULES:
        known = ", ".join(repr(k) for k in SCHEDULES)
        raise ConfigError(f"unknown schedule {name!r}; known schedules: {known}",
                          hint=f"pass one of {known}")
    return SCHEDULES[name]


def default_stages_per_rank(name: str | ScheduleKind) -> int:
    """How many stages a rank holds under `name` unless told otherwise (see ScheduleKind)."""
    return schedule_kind(name).default_stages_per_rank


def stages_per_rank_for(name: str | ScheduleKind, requested: int) -> int:
    """The stages per rank `name` runs when a program asks for `requested` (see ScheduleKind)."""
    return schedule_kind(name).stages_per_rank_for(requested)


def stages_on(placement: Sequence[int], rank: int) -> list[int]:
    """The stages that `placement` (stage -> rank) puts on `rank`, in order."""
    return [s for s, r in enumerate(placement) if r == rank]


def check_layout(name: str | ScheduleKind, num_stages: int, stages_per_rank: int) -> int:
    """The number of ranks of `num_stages` stages at `stages_per_rank` each under schedule
    `name`; raises ConfigError where the schedule cannot place them so."""
    return schedule_kind(name).check_layout(num_stages, stages_per_rank)


def make_schedule(name: str | ScheduleKind, num_microbatches: int, num_stages: int,
                  num_ranks: int | None = None) -> Schedule:
    """The schedule `name` for M micro-batches and S stages on R ranks (default: S for the
    flat schedules, S / 2 for the looped ones)."""
    return schedule_kind(name).build(num_microbatches, num_stages, num_ranks)


def placement(name: str | ScheduleKind, num_stages: int, num_ranks: int) -> list[int]:
    """placement[s]: the pipeline rank that runs stage s under schedule `name`."""
    return schedule_kind(name).placement(num_stages, num_ranks)


# --------------------------------------------------------------------------- checks


_BUILD_HINT = "build one with make_schedule(name, M, S) (or gpipe(M, K), one_f_one_b(M, K), ...)"
_KINDS = tuple(ActionKind)


def is_split(schedule: Schedule) -> bool:
    """Whether the schedule splits backwards into I and W (see `zb_h1`)."""
    return any(a.kind == ActionKind.INPUT_GRAD for acts in schedule for a in acts)


def stage_ranks(schedule: Schedule) -> list[int]:
    """ranks[s]: the rank whose list holds stage s's actions. Raises ConfigError if a stage
    appears on two ranks, a stage index is missing, or a rank holds nothing."""
    if not schedule:
        raise ConfigError("schedule has no ranks", hint=_BUILD_HINT)
    rank_of: dict[int, int] = {}
    for r, actions in enumerate(schedule):
        if not actions:
            raise ConfigError(f"rank {r} of the schedule runs nothing",
                              hint="every rank must run at least one stage")
        for a in actions:
            if rank_of.setdefault(a.stage, r) != r:
                raise ConfigError(f"stage {a.stage} runs on ranks {rank_of[a.stage]} and {r}",
                                  hint="list all of a stage's actions under one rank")
    missing = sorted(set(range(max(rank_of) + 1)) - set(rank_of))
    if missing or min(rank_of) < 0:
        raise ConfigError(f"stages {missing or [min(rank_of)]} of 0..{max(rank_of)} are not in "
                          "the schedule", hint="number the stages 0..S-1, every one scheduled")
    return [rank_of[s] for s in range(len(rank_of))]


def waiting(schedule: Sequence[Sequence[Action]], position: Sequence[int]) -> str:
    """The next action of every rank with actions left (rank r at index position[r]), for the
    message of a schedule that deadlocks."""
    return ", ".join(f"stage {acts[p].stage}: {acts[p]}" for acts, p in zip(schedule, position)
                     if p < len(acts))


def validate(schedule: Schedule) -> tuple[int, int]:
    """Check that every stage runs on one rank, F and B (or I and W) of every micro-batch exactly
    once, and W(s, m) after I(s, m); return (M, S). A stage may split some backwards and not
    others (dualpipev).

    Only the content is checked here; `fxpipe.runtime.planning.grid.clock_cycles` also checks that
    the order cannot deadlock.
    """
    if not schedule or not any(schedule):
        raise ConfigError("schedule has no stages" if not schedule else "schedule has no "
                          "actions", hint=_BUILD_HINT)
    for r, actions in enumerate(schedule):
        for a in actions:
            if a.microbatch < 0 or a.stage < 0:
                raise ConfigError(
                    f"rank {r}: invalid action {a!r}",
                    hint="stage and microbatch must be >= 0",
                )
    ranks = stage_ranks(schedule)
    num_microbatches = 1 + max(a.microbatch for acts in schedule for a in acts)
    seen: list[set[tuple[ActionKind, int]]] = [set() for _ in ranks]
    for actions in schedule:
        for a in actions:
            s = a.stage
            if a.kind == ActionKind.WEIGHT_GRAD \
                    and (ActionKind.INPUT_GRAD, a.microbatch) not in seen[s]:
                raise ConfigError(f"stage {s} runs {a} before I{a.microbatch}",
                                  hint="a weight gradient needs its input gradient's pass first")
            if (a.kind, a.microbatch) in seen[s]:
                raise ConfigError(f"stage {s} runs {a} twice", hint="list each action once")
            seen[s].add((a.kind, a.microbatch))
    for s, done in enumerate(seen):
        both = sorted(m for k, m in done if k == ActionKind.BACKWARD
                      and (ActionKind.INPUT_GRAD, m) in done)
        if both:
            raise ConfigError(f"stage {s} runs both B{both[0]} and I{both[0]}",
                              hint="a micro-batch's backward is either B, or I then W")
        expected = {(ActionKind.FORWARD, m) for m in range(num_microbatches)}
        for m in range(num_microbatches):  # B, or I and W: as this stage runs the micro-batch
            split = (ActionKind.INPUT_GRAD, m) in done or (ActionKind.WEIGHT_GRAD, m) in done
            expected |= {(ActionKind.INPUT_GRAD, m), (ActionKind.WEIGHT_GRAD, m)} if split \
                else {(ActionKind.BACKWARD, m)}
        missing = sorted(expected - done, key=lambda km: (_KINDS.index(km[0]), km[1]))
        if missing:
            names = ", ".join(f"{k}{m}" for k, m in missing)
            raise ConfigError(
                f"stage {s} never runs {names} ({num_microbatches} micro-batches in the schedule)",
                hint="every stage must run F and B (or I and W) of every micro-batch",
            )
    return num_microbatches, len(ranks)

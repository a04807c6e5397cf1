"""Tests for fxpipe.runtime.planning.schedule (schedule shapes, placement),
fxpipe.runtime.planning.grid (the tick grid, rendering, activations in flight) and
fxpipe.runtime.planning.simulate (timing)."""
from __future__ import annotations

import itertools
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.errors import ConfigError
from fxpipe.runtime.planning.grid import (
    bubble_fraction,
    clock_cycles,
    peak_inflight,
    play,
    render_grid,
)
from fxpipe.runtime.planning.schedule import (
    LOOPED,
    SCHEDULES,
    Action,
    check_layout,
    default_stages_per_rank,
    dualpipe_v,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    placement,
    schedule_kind,
    stage_ranks,
    validate,
    zb_h1,
    zb_v,
)
from fxpipe.runtime.planning.simulate import TimedEvent, simulate

ALL_SIZES = list(itertools.product(range(1, 9), range(1, 6)))  # (M, K)


def on_ranks(name, num_microbatches, num_ranks):
    """Schedule `name` on `num_ranks` ranks: one stage each, or its stages per rank (2)."""
    return make_schedule(name, num_microbatches, num_ranks * default_stages_per_rank(name),
                         num_ranks)


def rows(schedule):
    """Each stage's actions as one space-separated string, for aligned literals."""
    return [" ".join(str(a) for a in actions) for actions in schedule]


def grid_rows(grid):
    return [[None if a is None else str(a) for a in row] for row in grid]


def parse(stage_rows):
    """The inverse of rows(): ["F0 B0", ...] -> a schedule."""
    return [
        [Action(tok[0], s, int(tok[1:])) for tok in line.split()]
        for s, line in enumerate(stage_rows)
    ]


def assert_grid_respects_dependencies(schedule, grid):
    """Checked independently of clock_cycles: completeness, list order and data dependencies
    (a backward, B or I of a split one, after F and after the next stage's backward, W after
    I). A stage's backward of a micro-batch is B, or I and W, as its list has it."""
    rank_of = {a.stage: r for r, acts in enumerate(schedule) for a in acts}
    num_stages = len(rank_of)
    split = {(a.stage, a.microbatch) for acts in schedule for a in acts if a.kind == "I"}
    num_microbatches = 1 + max(a.microbatch for acts in schedule for a in acts)
    tick_of = {}
    for tick, row in enumerate(grid):
        assert len(row) == len(schedule)
        for r, a in enumerate(row):
            if a is not None:
                assert rank_of[a.stage] == r
                assert a not in tick_of, f"{a} runs twice"
                tick_of[(a.kind, a.stage, a.microbatch)] = tick
    expected = {
        (kind, s, m)
        for s in range(num_stages)
        for m in range(num_microbatches)
        for kind in ("FIW" if (s, m) in split else "FB")
    }
    assert set(tick_of) == expected
    for r, actions in enumerate(schedule):
        ticks = [tick_of[(a.kind, a.stage, a.microbatch)] for a in actions]
        assert len(ticks) == len(set(ticks)) and ticks == sorted(ticks), \
            f"rank {r} out of list order"
    for (kind, s, m), t in tick_of.items():
        if kind == "F" and s > 0:
            assert tick_of[("F", s - 1, m)] < t
        if kind in "BI":
            assert tick_of[("F", s, m)] < t
            if s < num_stages - 1:
                after = "I" if (s + 1, m) in split else "B"
                assert tick_of[(after, s + 1, m)] < t
        if kind == "W":
            assert tick_of[("I", s, m)] < t


# --------------------------------------------------------------------------- shapes


def test_action_prints_as_kind_and_microbatch():
    assert str(Action("F", 2, 3)) == "F3"
    assert str(Action("B", 0, 0)) == "B0"


def test_gpipe_runs_all_forwards_then_backwards_in_reverse():
    assert rows(gpipe(4, 3)) == [
        "F0 F1 F2 F3 B3 B2 B1 B0",
        "F0 F1 F2 F3 B3 B2 B1 B0",
        "F0 F1 F2 F3 B3 B2 B1 B0",
    ]
    assert gpipe(4, 3)[1][0] == Action("F", 1, 0)


def test_1f1b_warms_up_then_alternates_then_drains():
    assert rows(one_f_one_b(4, 3)) == [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def test_1f1b_with_fewer_microbatches_than_stages_degenerates_to_fill_drain():
    assert rows(one_f_one_b(2, 4)) == [
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 B0 F1 B1",
    ]


def test_single_stage_1f1b_alternates_from_the_start():
    assert rows(one_f_one_b(3, 1)) == ["F0 B0 F1 B1 F2 B2"]


def test_make_schedule_builds_every_schedule_by_name():
    assert make_schedule("gpipe", 4, 3) == gpipe(4, 3)
    assert make_schedule("1f1b", 4, 3) == one_f_one_b(4, 3)
    assert make_schedule("zb-h1", 4, 3) == zb_h1(4, 3)
    assert make_schedule("interleaved-1f1b", 4, 6) == interleaved_1f1b(4, 6, 3)
    assert make_schedule("interleaved-1f1b", 4, 6, 2) == interleaved_1f1b(4, 6, 2)
    assert make_schedule("zb-v", 4, 6) == zb_v(4, 6)
    assert make_schedule("dualpipev", 4, 6) == dualpipe_v(4, 6)
    assert set(SCHEDULES) == {"gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "dualpipev"}
    assert LOOPED == {"interleaved-1f1b", "zb-v", "dualpipev"}


# --------------------------------------------------------------------------- clock grid


def test_clock_cycles_of_gpipe_2x3_is_the_fill_drain_staircase():
    _ = None
    assert grid_rows(clock_cycles(gpipe(3, 2))) == [
        ["F0", _],
        ["F1", "F0"],
        ["F2", "F1"],
        [_, "F2"],
        [_, "B2"],
        ["B2", "B1"],
        ["B1", "B0"],
        ["B0", _],
    ]


def test_clock_cycles_of_1f1b_2x3_interleaves_backwards():
    _ = None
    assert grid_rows(clock_cycles(one_f_one_b(3, 2))) == [
        ["F0", _],
        ["F1", "F0"],
        [_, "B0"],
        ["B0", "F1"],
        ["F2", "B1"],
        ["B1", "F2"],
        [_, "B2"],
        ["B2", _],
    ]


def test_gpipe_4x3_renders_exactly_like_the_reference_grid():
    expected = textwrap.dedent(
        """\
        clock  stage 0  stage 1  stage 2        GPipe, 3 stages x 4 microbatches
            0  F0                               bubble = (S-1)/(M+S-1) = 2/6 = 33%
            1  F1       F0
            2  F2       F1       F0
            3  F3       F2       F1
            4           F3       F2
            5                    F3
            6                    B3
            7           B3       B2
            8  B3       B2       B1
            9  B2       B1       B0
           10  B1       B0
           11  B0"""
    )
    assert render_grid(gpipe(4, 3), title="GPipe") == expected


def test_1f1b_4x3_renders_with_the_same_bubble_and_length():
    expected = textwrap.dedent(
        """\
        clock  stage 0  stage 1  stage 2        1F1B, 3 stages x 4 microbatches
            0  F0                               bubble = (S-1)/(M+S-1) = 2/6 = 33%
            1  F1       F0
            2  F2       F1       F0
            3                    B0
            4           B0       F1
            5  B0       F2       B1
            6  F3       B1       F2
            7  B1       F3       B2
            8           B2       F3
            9  B2                B3
           10           B3
           11  B3"""
    )
    assert render_grid(one_f_one_b(4, 3), title="1F1B") == expected


def test_render_grid_without_title_notes_only_the_size_and_widens_for_two_digit_labels():
    text = render_grid(gpipe(11, 1))
    lines = text.splitlines()
    assert lines[0] == "clock  stage 0        1 stages x 11 microbatches"
    assert lines[1] == "    0  F0             bubble = (S-1)/(M+S-1) = 0/11 = 0%"
    assert lines[-1] == "   21  B0"
    assert all(line == line.rstrip() for line in lines)


def test_render_grid_reports_measured_idle_time_when_a_schedule_idles_more_than_the_formula():
    # Stage 1 takes micro-batches out of order (F1 before F0): valid, but it idles longer.
    slow = parse(["F0 F1 B1 B0", "F1 F0 B0 B1"])
    text = render_grid(slow)
    assert "bubble = idle/total" in text.splitlines()[1]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_runs_each_action_once_in_dependency_order(name):
    for num_microbatches, num_ranks in ALL_SIZES:
        schedule = on_ranks(name, num_microbatches, num_ranks)
        stages = num_ranks * default_stages_per_rank(name)
        assert validate(schedule) == (num_microbatches, stages)
        assert stage_ranks(schedule) == placement(name, stages, num_ranks)
        assert_grid_respects_dependencies(schedule, clock_cycles(schedule))


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    num_microbatches=st.integers(1, 24),
    num_ranks=st.integers(1, 10),
)
def test_schedules_are_valid_for_any_size(name, num_microbatches, num_ranks):
    schedule = on_ranks(name, num_microbatches, num_ranks)
    assert_grid_respects_dependencies(schedule, clock_cycles(schedule))


def tick_by_tick(actions_by_rank, edges):
    """The clock as its definition reads: at each tick every rank whose next action's
    dependencies all ended at an earlier tick runs it (play places each action once instead)."""
    producers, consumers = {}, {}
    for src, dst in edges:
        producers.setdefault(dst, set()).add(src)
        consumers.setdefault(src, set()).add(dst)
    backward = {(a.stage, a.microbatch): a.kind for acts in actions_by_rank for a in acts
                if a.kind in ("B", "I")}

    def depends_on(a):
        if a.kind == "F":
            return [Action("F", p, a.microbatch) for p in producers.get(a.stage, ())]
        if a.kind == "W":
            return [Action("I", a.stage, a.microbatch)]
        return [Action("F", a.stage, a.microbatch)] + [
            Action(backward.get((d, a.microbatch), "B"), d, a.microbatch)
            for d in consumers.get(a.stage, ())]

    done, position, grid = set(), [0] * len(actions_by_rank), []
    while any(p < len(acts) for p, acts in zip(position, actions_by_rank)):
        row = [acts[p] if p < len(acts) and all(d in done for d in depends_on(acts[p]))
               else None for acts, p in zip(actions_by_rank, position)]
        assert any(row), "deadlocks"
        for r, a in enumerate(row):
            if a is not None:
                done.add(a)
                position[r] += 1
        grid.append(row)
    return grid


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(sorted(SCHEDULES)), num_microbatches=st.integers(1, 12),
       num_ranks=st.integers(1, 6), data=st.data())
def test_play_places_every_action_at_the_tick_the_tick_by_tick_clock_runs_it(
        name, num_microbatches, num_ranks, data):
    schedule = on_ranks(name, num_microbatches, num_ranks)
    stages = num_ranks * default_stages_per_rank(name)
    skips = data.draw(st.lists(st.tuples(st.integers(0, stages - 1), st.integers(0, stages - 1))
                               .filter(lambda e: e[0] + 1 < e[1]), max_size=3))
    edges = [(s, s + 1) for s in range(stages - 1)] + skips
    assert grid_rows(play(schedule, edges)) == grid_rows(tick_by_tick(schedule, edges))


@settings(max_examples=80, deadline=None)
@given(data=st.data(), num_microbatches=st.integers(1, 4), num_stages=st.integers(1, 4))
def test_clock_cycles_either_rejects_a_shuffled_schedule_or_respects_its_dependencies(
    data, num_microbatches, num_stages
):
    schedule = [
        data.draw(st.permutations(actions)) for actions in gpipe(num_microbatches, num_stages)
    ]
    try:
        grid = clock_cycles(schedule)
    except ConfigError as err:
        assert "deadlocks" in str(err)
    else:
        assert_grid_respects_dependencies(schedule, grid)


@pytest.mark.parametrize(("num_microbatches", "num_stages"), ALL_SIZES)
def test_gpipe_and_1f1b_take_the_same_ticks_and_bubble(num_microbatches, num_stages):
    ticks = 2 * (num_microbatches + num_stages - 1)
    for fn in (gpipe, one_f_one_b):
        grid = clock_cycles(fn(num_microbatches, num_stages))
        assert len(grid) == ticks
        idle = sum(a is None for row in grid for a in row)
        assert idle / (ticks * num_stages) == pytest.approx(
            bubble_fraction(num_microbatches, num_stages)
        )


def test_bubble_fraction_is_stages_minus_one_over_microbatches_plus_stages_minus_one():
    assert bubble_fraction(4, 3) == pytest.approx(2 / 6)
    assert bubble_fraction(1, 1) == 0.0
    assert bubble_fraction(8, 4) == pytest.approx(3 / 11)


@pytest.mark.parametrize(("num_microbatches", "num_stages"), ALL_SIZES)
def test_1f1b_holds_at_most_stages_left_microbatches_and_gpipe_holds_all(
    num_microbatches, num_stages
):
    assert peak_inflight(one_f_one_b(num_microbatches, num_stages)) == [
        min(num_stages - s, num_microbatches) for s in range(num_stages)
    ]
    assert peak_inflight(gpipe(num_microbatches, num_stages)) == [num_microbatches] * num_stages


# --------------------------------------------------------------------------- simulate


def compute_events(events):
    return {(e.kind, e.stage, e.microbatch): (e.start, e.end) for e in events if e.kind != "send"}


@pytest.mark.parametrize(("num_microbatches", "num_stages"), ALL_SIZES)
def test_simulate_with_unit_times_reproduces_the_clock_grid(num_microbatches, num_stages):
    for fn in (gpipe, one_f_one_b):
        schedule = fn(num_microbatches, num_stages)
        events, makespan = simulate(
            schedule, forward_time=[1] * num_stages, backward_time=[1] * num_stages
        )
        grid = clock_cycles(schedule)
        assert makespan == len(grid)
        starts = compute_events(events)
        for tick, row in enumerate(grid):
            for a in row:
                if a is not None:
                    assert starts[(a.kind, a.stage, a.microbatch)] == (tick, tick + 1)


def test_simulate_gpipe_with_equal_times_takes_microbatches_plus_stages_minus_one_rounds():
    events, makespan = simulate(gpipe(4, 3), forward_time=[1.5] * 3, backward_time=[2.5] * 3)
    assert makespan == (4 + 3 - 1) * (1.5 + 2.5)
    assert len(events) == 2 * 4 * 3
    assert all(e.kind in ("F", "B") for e in events)
    assert [e.start for e in events] == sorted(e.start for e in events)


def test_simulate_gpipe_2x2_with_unequal_times_matches_the_hand_computed_timeline():
    # stage 0: F=1, B=2; stage 1: F=3, B=1.
    #   s0 F0 [0,1]  F1 [1,2]                               B1 [8,10] B0 [10,12]
    #   s1           F0 [1,4]  F1 [4,7]  B1 [7,8]  B0 [8,9]
    events, makespan = simulate(gpipe(2, 2), forward_time=[1, 3], backward_time=[2, 1])
    assert compute_events(events) == {
        ("F", 0, 0): (0, 1), ("F", 0, 1): (1, 2), ("B", 0, 1): (8, 10), ("B", 0, 0): (10, 12),
        ("F", 1, 0): (1, 4), ("F", 1, 1): (4, 7), ("B", 1, 1): (7, 8), ("B", 1, 0): (8, 9),
    }  # fmt: skip
    assert makespan == 12
    # (M-1) * (max F + max B) + sum(F + B); (M-1) * max(F + B) + sum(F + B) would say 11.
    assert makespan == (2 - 1) * (3 + 2) + (1 + 2 + 3 + 1)


@settings(max_examples=60, deadline=None)
@given(
    num_microbatches=st.integers(1, 8),
    times=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=5),
)
def test_simulate_gpipe_makespan_is_dominated_by_the_slowest_stage(num_microbatches, times):
    fwd = [f for f, _ in times]
    bwd = [b for _, b in times]
    _, makespan = simulate(
        gpipe(num_microbatches, len(times)), forward_time=fwd, backward_time=bwd
    )
    assert makespan == (num_microbatches - 1) * (max(fwd) + max(bwd)) + sum(fwd) + sum(bwd)
    equal = (num_microbatches + len(times) - 1) * (min(fwd) + min(bwd))
    assert makespan >= equal


def test_simulate_refuses_a_schedule_that_waits_forever_and_names_the_stuck_actions():
    # stage 0 runs B0 before F0 could ever reach stage 1; stage 1 waits for that F0
    with pytest.raises(ConfigError, match="deadlocks on the given edges"):
        simulate(parse(["B0 F0", "F0 B0"]), forward_time=[1, 1], backward_time=[2, 2])


def test_simulate_places_every_action_whatever_order_the_ranks_unblock_in():
    # stage 0 finishes long before stage 1 and 2 can start their backwards: each rank is
    # woken by the action it waits on, and the times are those of the dependencies
    events, makespan = simulate(gpipe(3, 3), forward_time=[1, 5, 1], backward_time=[1, 1, 9])
    assert len([e for e in events if e.kind != "send"]) == 3 * 3 * 2
    assert makespan == pytest.approx(1 + 5 * 3 + 1 + 9 * 3 + 1 + 1)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(SCHEDULES)), st.integers(1, 6), st.integers(1, 3),
       st.lists(st.floats(0.1, 5.0), min_size=12, max_size=12), st.floats(0.0, 2.0))
def test_simulate_without_events_places_the_actions_as_with_them(name, m, ranks, times, comm):
    """record=False (the planner's makespan alone) ends where the recorded events end."""
    kind = schedule_kind(name)
    stages = ranks * kind.default_stages_per_rank
    actions = kind.build(m, stages, ranks)
    run = dict(forward_time=times[:stages], backward_time=times[6:6 + stages],
               weight_time=[t / 3 for t in times[6:6 + stages]], comm_time=comm)
    events, makespan = simulate(actions, **run)
    nothing, alone = simulate(actions, **run, record=False)
    assert nothing == [] and alone == makespan == max(e.end for e in events if e.kind != "send")


def test_simulate_one_slow_stage_lengthens_gpipe():
    _, fast = simulate(gpipe(4, 3), forward_time=[1, 1, 1], backward_time=[2, 2, 2])
    _, slow = simulate(gpipe(4, 3), forward_time=[1, 3, 1], backward_time=[2, 6, 2])
    assert fast == 6 * 3
    assert slow == (4 - 1) * 9 + (3 + 9 + 3)


def test_simulate_per_stage_comm_delays_activations_and_gradients_by_the_producer_time():
    # comm_time[0] = 0.5 ships stage 0's outputs forward and their gradients back.
    # comm_time[1] is never used: stage 1 sends nothing (it has no consumers).
    #   s0 F0 [0,1]  F1 [1,2]                                             B1 [5,6]  B0 [6,7]
    #   s1   F0 [1.5,2.5]  F1 [2.5,3.5]  B1 [3.5,4.5]  B0 [4.5,5.5]
    events, makespan = simulate(
        gpipe(2, 2), forward_time=[1, 1], backward_time=[1, 1], comm_time=[0.5, 7]
    )
    assert makespan == 7
    assert compute_events(events) == {
        ("F", 0, 0): (0, 1), ("F", 0, 1): (1, 2), ("B", 0, 1): (5, 6), ("B", 0, 0): (6, 7),
        ("F", 1, 0): (1.5, 2.5), ("F", 1, 1): (2.5, 3.5),
        ("B", 1, 1): (3.5, 4.5), ("B", 1, 0): (4.5, 5.5),
    }  # fmt: skip
    sends = sorted(
        (e.stage, e.peer, e.microbatch, e.start, e.end) for e in events if e.kind == "send"
    )
    assert sends == [
        (0, 1, 0, 1, 1.5), (0, 1, 1, 2, 2.5),  # activations 0 -> 1
        (1, 0, 0, 5.5, 6), (1, 0, 1, 4.5, 5),  # gradients 1 -> 0
    ]  # fmt: skip


def test_simulate_scalar_comm_adds_one_message_per_hop_each_way():
    _, makespan = simulate(
        gpipe(1, 3), forward_time=[1] * 3, backward_time=[1] * 3, comm_time=0.25
    )
    assert makespan == 6 + 4 * 0.25


def test_simulate_skip_edge_delays_stage_2_by_its_own_message():
    # Edges 0->1, 1->2 and a skip 0->2 whose message takes 5; the chain hops are free.
    #   s0 F0 [0,1]  F1 [1,2]                                            B1 [14,15] B0 [15,16]
    #   s1           F0 [1,2]  F1 [2,3]                  B1 [9,10] B0 [10,11]
    #   s2   F0 waits for s0's F0 + 5: [6,7]  F1 [7,8]  B1 [8,9]  B0 [9,10]
    # s0's B1 waits for s2's B1 (ends 9) + 5 = 14; its B0 for s2's B0 (10) + 5 = 15.
    edges = [(0, 1), (1, 2), (0, 2)]
    events, makespan = simulate(
        gpipe(2, 3),
        forward_time=[1, 1, 1],
        backward_time=[1, 1, 1],
        comm_time={(0, 2): 5},
        edges=edges,
    )
    assert compute_events(events) == {
        ("F", 0, 0): (0, 1), ("F", 0, 1): (1, 2), ("B", 0, 1): (14, 15), ("B", 0, 0): (15, 16),
        ("F", 1, 0): (1, 2), ("F", 1, 1): (2, 3), ("B", 1, 1): (9, 10), ("B", 1, 0): (10, 11),
        ("F", 2, 0): (6, 7), ("F", 2, 1): (7, 8), ("B", 2, 1): (8, 9), ("B", 2, 0): (9, 10),
    }  # fmt: skip
    assert makespan == 16
    assert TimedEvent(0, "send", 0, 1, 6, peer=2) in events
    assert TimedEvent(2, "send", 1, 9, 14, peer=0) in events
    _, chain = simulate(gpipe(2, 3), forward_time=[1, 1, 1], backward_time=[1, 1, 1])
    assert chain == (2 + 3 - 1) * 2


def test_simulate_skip_edge_alone_lets_stage_2_start_right_after_stage_0():
    # 0 -> 1 and 0 -> 2 only: stages 1 and 2 both wait on stage 0, neither on the other,
    # and stage 0's backward waits for both.
    events, makespan = simulate(
        gpipe(1, 3),
        forward_time=[1, 4, 1],
        backward_time=[1, 1, 1],
        edges=[(0, 1), (0, 2)],
    )
    times = compute_events(events)
    assert times[("F", 2, 0)] == (1, 2)
    assert times[("B", 2, 0)] == (2, 3)
    assert times[("B", 1, 0)] == (5, 6)
    assert times[("B", 0, 0)] == (6, 7)
    assert makespan == 7


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("fn", [gpipe, one_f_one_b, bubble_fraction])
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 3), "num_microbatches must be >= 1 (got 0)"),
        ((4, 0), "num_stages must be >= 1 (got 0)"),
        ((-2, 3), "num_microbatches must be >= 1 (got -2)"),
        ((2.5, 3), "num_microbatches must be an int"),
        ((4, True), "num_stages must be an int"),
    ],
)
def test_bad_sizes_raise_config_error_with_the_value_and_a_hint(fn, args, message):
    with pytest.raises(ConfigError) as info:
        fn(*args)
    assert message in info.value.message
    assert info.value.hint


def test_unknown_schedule_name_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown schedule 'zb'") as info:
        make_schedule("zb", 4, 2)
    assert "'gpipe'" in info.value.message and "'1f1b'" in info.value.message


@pytest.mark.parametrize(
    ("stage_rows", "message"),
    [
        (["F0 B0 B0"], "runs B0 twice"),
        (["F0 F1 B0"], "never runs B1"),
        ([], "no stages"),
    ],
)
def test_incomplete_schedules_are_rejected(stage_rows, message):
    with pytest.raises(ConfigError, match=message):
        clock_cycles(parse(stage_rows))


def test_a_stage_on_two_ranks_a_missing_stage_and_an_idle_rank_are_rejected():
    with pytest.raises(ConfigError, match="stage 1 runs on ranks 0 and 1"):
        validate([[Action("F", 1, 0), Action("B", 1, 0)], [Action("F", 1, 1)]])
    with pytest.raises(ConfigError, match=r"stages \[0\] of 0..1 are not in the schedule"):
        validate([[Action("F", 1, 0), Action("B", 1, 0)]])
    with pytest.raises(ConfigError, match="rank 1 of the schedule runs nothing"):
        validate([[Action("F", 0, 0), Action("B", 0, 0)], []])


def test_backward_before_forward_deadlocks():
    with pytest.raises(ConfigError, match="deadlocks"):
        clock_cycles(parse(["F0 B0", "B0 F0"]))
    with pytest.raises(ConfigError, match="deadlocks"):
        simulate(parse(["F0 B0", "B0 F0"]), forward_time=[1, 1], backward_time=[1, 1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"forward_time": [1, 1]}, r"forward_time needs one value per stage \(3 stages, got 2"),
        ({"backward_time": 1.0}, "backward_time needs one value per stage"),
        ({"forward_time": [1, -1, 1]}, r"forward_time\[1\] must be >= 0"),
        ({"comm_time": -1.0}, "comm_time must be >= 0"),
        ({"comm_time": {(0, 2): 1.0}}, "not among the edges"),
        ({"edges": [(2, 1)]}, "not a forward edge"),
        ({"edges": [(0, 3)]}, "not a forward edge"),
    ],
)
def test_simulate_rejects_bad_times_and_edges(kwargs, message):
    args = {"forward_time": [1, 1, 1], "backward_time": [1, 1, 1], **kwargs}
    with pytest.raises(ConfigError, match=message):
        simulate(gpipe(2, 3), **args)


# --------------------------------------------------------------------------- ZB-H1


def test_zb_h1_3x4_defers_each_stages_weight_gradients_by_its_index():
    assert rows(zb_h1(4, 3)) == [
        "F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3",
        "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
        "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3",
    ]


@pytest.mark.parametrize(("num_microbatches", "num_stages"), ALL_SIZES)
def test_zb_h1_keeps_1f1bs_forwards_and_input_gradients(num_microbatches, num_stages):
    """Without the W's it is 1F1B (I in B's place): the same micro-batches wait for their I."""
    zb = [[a for a in actions if a.kind != "W"] for actions in
          zb_h1(num_microbatches, num_stages)]
    ofob = one_f_one_b(num_microbatches, num_stages)
    assert [[(a.kind, a.microbatch) for a in actions] for actions in zb] == \
        [[("I" if a.kind == "B" else a.kind, a.microbatch) for a in actions] for actions in ofob]


@pytest.mark.parametrize(("num_microbatches", "num_stages"), ALL_SIZES)
def test_zb_h1_holds_at_each_stage_what_1f1b_holds_at_its_first(num_microbatches, num_stages):
    """A micro-batch is held until its W (the split backward keeps its saved tensors)."""
    peaks = peak_inflight(zb_h1(num_microbatches, num_stages))
    first = peak_inflight(one_f_one_b(num_microbatches, num_stages))[0]
    assert peaks == [first] * num_stages


@pytest.mark.parametrize(("num_microbatches", "num_stages"), ALL_SIZES)
def test_zb_h1_bubble_is_the_papers_stages_minus_one_times_f_plus_i_minus_w(
        num_microbatches, num_stages):
    k, m = num_stages, num_microbatches
    times = {"forward_time": [1.0] * k, "backward_time": [2.0] * k}  # I = W = 1
    _, zb = simulate(zb_h1(m, k), **times)
    _, ofob = simulate(one_f_one_b(m, k), **times)
    assert ofob == (m + k - 1) * 3
    if m >= k:
        assert zb == m * 3 + (k - 1) * (1 + 1 - 1)  # a third of 1F1B's bubble
    assert zb < ofob or k == 1


@pytest.mark.parametrize(("k", "m", "paper", "bubble_units"), [(2, 8, 25, 2), (8, 32, 103, 56)])
def test_zb_h1_steps_as_long_as_the_papers_at_unit_times(k, m, paper, bubble_units):
    _, zb = simulate(zb_h1(m, k), forward_time=[1.0] * k, backward_time=[2.0] * k)
    assert zb == paper
    assert k * zb - 3 * m * k == bubble_units  # idle stage-units over the step


def test_simulate_splits_the_backward_by_weight_time():
    events, makespan = simulate(
        zb_h1(1, 1), forward_time=[1.0], backward_time=[3.0], weight_time=[0.5]
    )
    assert compute_events(events) == {
        ("F", 0, 0): (0.0, 1.0), ("I", 0, 0): (1.0, 3.5), ("W", 0, 0): (3.5, 4.0)}
    assert makespan == 4.0
    with pytest.raises(ConfigError, match=r"weight_time\[0\] = 4.0 exceeds"):
        simulate(zb_h1(1, 1), forward_time=[1.0], backward_time=[3.0], weight_time=[4.0])


def test_validate_refuses_a_weight_gradient_before_its_input_gradient():
    with pytest.raises(ConfigError, match="runs W0 before I0"):
        validate(parse(["F0 W0 I0"]))
    with pytest.raises(ConfigError, match="never runs W1"):
        validate(parse(["F0 F1 I0 W0 I1 B2 F2"]))
    with pytest.raises(ConfigError, match="runs both B0 and I0"):
        validate(parse(["F0 I0 B0 W0"]))


def test_a_stage_may_split_some_backwards_and_run_others_whole():
    mixed = parse(["F0 F1 I0 W0 B1", "F0 I0 F1 B1 W0"])
    assert validate(mixed) == (2, 2)
    assert_grid_respects_dependencies(mixed, clock_cycles(mixed))
    # B1 on stage 0 waits for stage 1's B1, I0 for stage 1's I0, whichever each runs
    events, makespan = simulate(mixed, forward_time=[1, 1], backward_time=[2, 2],
                                weight_time=[1, 1], input_time=[1.5, 1.5])
    times = compute_events(events)
    assert times[("I", 1, 0)] == (2, 3.5) and times[("I", 0, 0)] == (3.5, 5)
    assert times[("B", 1, 1)] == (4.5, 6.5) and times[("B", 0, 1)] == (6.5, 8.5)
    assert makespan == 8.5


def test_zb_h1_grid_notes_the_measured_idle_share():
    text = render_grid(zb_h1(4, 3), title="ZB-H1")
    assert text.splitlines()[0].endswith("ZB-H1, 3 stages x 4 microbatches")
    assert "bubble = idle/total = 6/42 = 14%" in text.splitlines()[1]


# --------------------------------------------------------------------------- looped schedules


def rank_peaks(schedule):
    """Per rank: the most stage-micro-batches alive at once (F done, B or W not)."""
    peaks = []
    for actions in schedule:
        live = peak = 0
        for a in actions:
            if a.kind != "I":
                live += 1 if a.kind == "F" else -1
                peak = max(peak, live)
        peaks.append(peak)
    return peaks


def labelled(schedule):
    """Each rank's actions as "<stage><kind><micro-batch>" tokens."""
    return [" ".join(f"{a.stage}{a}" for a in actions) for actions in schedule]


def test_interleaved_1f1b_2x4_warms_up_a_round_per_extra_stage_then_alternates():
    assert labelled(interleaved_1f1b(4, 4, 2)) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_zb_v_2x4_runs_down_the_v_then_up_with_the_weight_gradients_in_the_gaps():
    assert labelled(zb_v(4, 4)) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 "
        "0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 "
        "1I3 1W2 2W3 1W3",
    ]


def test_looped_schedules_place_stages_round_the_ranks_or_in_a_v():
    assert placement("interleaved-1f1b", 6, 3) == [0, 1, 2, 0, 1, 2]
    assert placement("interleaved-1f1b", 6, 2) == [0, 1, 0, 1, 0, 1]
    assert placement("zb-v", 6, 3) == [0, 1, 2, 2, 1, 0]
    assert placement("1f1b", 3, 3) == [0, 1, 2]
    assert stage_ranks(zb_v(5, 6)) == [0, 1, 2, 2, 1, 0]
    assert stage_ranks(interleaved_1f1b(5, 6, 3)) == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: check_layout("zb-v", 4, 3), "zb-v places exactly 2 stages on each rank"),
        (lambda: check_layout("gpipe", 4, 2), "schedule 'gpipe' runs one stage per rank"),
        (lambda: check_layout("interleaved-1f1b", 4, 1), "places several stages on each rank"),
        (lambda: check_layout("interleaved-1f1b", 5, 2), "5 stages do not divide into 2"),
        (lambda: check_layout("zb-v", 4, True), "stages_per_rank must be an integer"),
        (lambda: zb_v(4, 3), r"zb-v needs exactly 2 stages per rank \(3 stages on 1 ranks\)"),
        (lambda: interleaved_1f1b(4, 5, 2), "the same number of stages on every rank"),
        (lambda: make_schedule("gpipe", 4, 4, 2), "gpipe needs exactly 1 stages per rank"),
    ],
)
def test_layouts_a_schedule_cannot_run_are_refused_with_the_numbers_and_a_fix(call, message):
    with pytest.raises(ConfigError, match=message) as info:
        call()
    assert info.value.hint


def test_check_layout_gives_the_number_of_ranks():
    assert check_layout("zb-v", 8, 2) == 4
    assert check_layout("interleaved-1f1b", 9, 3) == 3
    assert check_layout("zb-h1", 3, 1) == 3


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
@pytest.mark.parametrize("per_rank", [2, 3])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_interleaved_1f1b_divides_the_1f1b_bubble_by_the_stages_per_rank(num_ranks, per_rank,
                                                                          rounds):
    # A rank's model share costs F = 1 and B = 2, split evenly over its stages.
    m, v, k = rounds * num_ranks, per_rank, num_ranks
    f, b = [1 / v] * (k * v), [2 / v] * (k * v)
    _, looped = simulate(interleaved_1f1b(m, k * v, k), forward_time=f, backward_time=b)
    _, flat = simulate(one_f_one_b(m, k), forward_time=[1] * k, backward_time=[2] * k)
    assert flat == pytest.approx(3 * m + (k - 1) * 3)
    assert looped == pytest.approx(3 * m + (k - 1) * 3 / v)


@settings(max_examples=60, deadline=None)
@given(num_microbatches=st.integers(1, 24), num_ranks=st.integers(1, 6),
       per_rank=st.integers(2, 4))
def test_interleaved_1f1b_is_never_slower_than_1f1b_at_equal_work(num_microbatches, num_ranks,
                                                                   per_rank):
    m, v, k = num_microbatches, per_rank, num_ranks
    _, looped = simulate(interleaved_1f1b(m, k * v, k), forward_time=[1 / v] * (k * v),
                         backward_time=[2 / v] * (k * v))
    _, flat = simulate(one_f_one_b(m, k), forward_time=[1] * k, backward_time=[2] * k)
    assert looped <= flat + 1e-9


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 5])
def test_zb_v_bubble_at_equal_f_i_w_is_one_stage_forward_per_extra_rank(num_ranks):
    # Stage (half a rank's share) times F = I = W = 0.5: 2M stage-micro-batches of 1.5 per rank.
    k = num_ranks
    for m in range(2 * k - 1, 2 * k + 9):
        _, makespan = simulate(zb_v(m, 2 * k), forward_time=[0.5] * (2 * k),
                               backward_time=[1.0] * (2 * k), weight_time=[0.5] * (2 * k))
        assert makespan == pytest.approx(3 * m + (k - 1) * 0.5), m
        _, zb = simulate(zb_h1(m, k), forward_time=[1] * k, backward_time=[2] * k,
                         weight_time=[1] * k)
        assert makespan <= zb


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_zb_v_keeps_1f1b_memory_and_interleaving_a_little_more(num_ranks):
    # In stage-micro-batches of half a rank's share: 1F1B's first rank holds K full shares.
    k = num_ranks
    for m in (2 * k, 4 * k):
        assert rank_peaks(zb_v(m, 2 * k)) == [2 * k] * k
        assert rank_peaks(interleaved_1f1b(m, 2 * k, k))[0] == 2 * k + k - 1
        assert [2 * p for p in rank_peaks(one_f_one_b(m, k))][0] == 2 * k


def test_a_looped_grid_has_a_column_per_rank_and_names_the_stage_in_each_cell():
    text = render_grid(zb_v(4, 4), title="ZB-V")
    lines = text.splitlines()
    assert lines[0] == "clock  rank 0  rank 1        ZB-V, 4 stages x 4 microbatches on 2 ranks"
    assert lines[1].endswith("bubble = idle/total = 2/50 = 4%")
    assert "2F3: stage 2 forwards micro-batch 3" in lines[2]
    assert lines[4].split() == ["3", "3F0", "1F1"]


def test_a_stage_whose_compute_rounds_a_hair_below_its_forward_simulates():
    from types import SimpleNamespace

    from fxpipe.runtime.planning.timeline import predicted_step
    stage = SimpleNamespace(forward_time=1e-3, compute_time=1e-3 - 3.4e-21, comm_time=0.0,
                            recompute_time=0.0, weight_time=0.0, forward_messages=1,
                            backward_messages=1)
    plan = SimpleNamespace(stages=[stage, stage], chunks=2, microbatch_overhead=0.0,
                           step_overhead=0.0, action_overhead=0.0, message_overhead=0.0,
                           host_link=False, shared=())
    step, bubble = predicted_step(plan, "gpipe")
    assert step > 0 and 0 <= bubble < 1


def test_dualpipe_v_2x4_runs_whole_backwards_in_the_steady_state_and_splits_at_the_ends():
    assert labelled(dualpipe_v(4, 4)) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3",
    ]
    assert stage_ranks(dualpipe_v(4, 6)) == [0, 1, 2, 2, 1, 0]


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 5, 6])
def test_dualpipe_v_is_the_order_torch_pipelining_runs(num_ranks):
    """The same order, action for action, as torch.distributed.pipelining's ScheduleDualPipeV
    (its overlapped F and B pairs taken forward first)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    dual = getattr(schedules, "ScheduleDualPipeV", None)
    if dual is None:
        pytest.skip("this torch has no ScheduleDualPipeV")
    from types import SimpleNamespace
    letter = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    for m in range(2 * num_ranks, 2 * num_ranks + 7):
        ours = dualpipe_v(m, 2 * num_ranks)
        shape = SimpleNamespace(pp_group_size=num_ranks, _n_microbatches=m)
        for r in range(num_ranks):
            theirs = [Action(letter[b.computation_type.name], b.stage_index, b.microbatch_index)
                      for a in dual._calculate_single_rank_operations(shape, r)
                      for b in (a.sub_actions or (a,))]
            assert ours[r] == theirs, (m, r)


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 5])
def test_dualpipe_v_steps_no_slower_than_zb_v_where_a_split_backward_costs_more(num_ranks):
    # Stage times F = 0.5, B = 1.0; a split costs 10% more: I = 0.55, W = 0.55.
    k = num_ranks
    times = dict(forward_time=[0.5] * (2 * k), backward_time=[1.0] * (2 * k),
                 weight_time=[0.55] * (2 * k), input_time=[0.55] * (2 * k))
    for m in range(2 * k, 2 * k + 9):
        _, makespan = simulate(dualpipe_v(m, 2 * k), **times)
        _, zb = simulate(zb_v(m, 2 * k), **times)
        assert makespan <= zb + 1e-9, m


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 8])
def test_dualpipe_v_splits_k_3k_minus_1_over_2_backwards_whatever_the_micro_batches(num_ranks):
    k = num_ranks
    for m in (2 * k, 4 * k, 8 * k):
        dual = dualpipe_v(m, 2 * k)
        assert sum(a.kind == "I" for acts in dual for a in acts) == k * (3 * k - 1) // 2
        assert rank_peaks(dual) == [2 * k + 1] * k

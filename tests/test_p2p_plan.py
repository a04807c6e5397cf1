"""The point-to-point plan, against a model of NCCL's rules (fxpipe/runtime/planning/plan.py).

`run_nccl_model` plays per-rank programs of "post a batch" and "wait for a receive" under the
rules the plan's NOTE [Deadlock-free point-to-point] states: matching by order per pair and
direction, no tags, a rank's batches run one after another and each completes as a whole, and a
send completes only once its receive is posted and reached (rendezvous, every size). It returns
the matched pairs, or raises Deadlock with what each rank waits for.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import pytest

from fxpipe.errors import ConfigError
from fxpipe.runtime.planning.grid import clock_cycles
from fxpipe.runtime.planning.plan import (
    RECEIVE_LEAD,
    Message,
    Tick,
    clock,
    plan_rank,
    replies,
)
from fxpipe.runtime.planning.schedule import (
    SCHEDULES,
    Action,
    default_stages_per_rank,
    make_schedule,
    placement,
)


class Deadlock(Exception):
    pass


def run_nccl_model(programs: list[list[tuple]]) -> list[tuple[Message, Message]]:
    """programs[r]: ("post", [(op, message), ...]) and ("wait", message) steps of rank r."""
    world = len(programs)
    pc = [0] * world
    streams: list[list[list[list]]] = [[] for _ in range(world)]  # batches of [op, msg, done]
    queued: dict[tuple[int, int, str], list[list]] = defaultdict(list)  # (src, dst, op) -> ops
    done_msgs: set[tuple[int, Message]] = set()
    matched = []
    while True:
        progress = False
        for r in range(world):  # run each rank's program until it blocks
            while pc[r] < len(programs[r]):
                kind, arg = programs[r][pc[r]]
                if kind == "post":
                    batch = []
                    for op, msg in arg:
                        entry = [op, msg, False, r]
                        peer = msg.dst_rank if op == "send" else msg.src_rank
                        key = (r, peer, "send") if op == "send" else (peer, r, "recv")
                        queued[key].append(entry)
                        batch.append(entry)
                    streams[r].append(batch)
                elif (r, arg) not in done_msgs:
                    break
                pc[r] += 1
                progress = True
        heads = {id(e) for r in range(world) if streams[r] for e in streams[r][0]}
        for (src, dst, op), ops in list(queued.items()):
            if op != "send":
                continue
            recvs = queued.get((src, dst, "recv"), [])
            while ops and recvs and id(ops[0]) in heads and id(recvs[0]) in heads:
                send, recv = ops.pop(0), recvs.pop(0)
                matched.append((send[1], recv[1]))
                send[2] = recv[2] = True
                done_msgs.add((dst, recv[1]))
                progress = True
        for r in range(world):
            while streams[r] and all(e[2] for e in streams[r][0]):
                streams[r].pop(0)
                progress = True
        if all(pc[r] == len(programs[r]) and not streams[r] for r in range(world)):
            return matched
        if not progress:
            waits = [f"rank {r}: {programs[r][pc[r]][1] if pc[r] < len(programs[r]) else 'end'}"
                     for r in range(world)]
            raise Deadlock("; ".join(map(str, waits)))


def run_gloo_model(programs: list[list[tuple]]) -> None:
    """The same programs under gloo's rules: a send and its receive meet by tag whatever the
    order either was posted in, and a send never waits. A wait needs its receive posted by
    this rank before it and the send posted by its peer; raises Deadlock if none can go on."""
    world = len(programs)
    pc = [0] * world
    sent: set[Message] = set()
    received: set[tuple[int, Message]] = set()
    while not all(pc[r] == len(programs[r]) for r in range(world)):
        progress = False
        for r in range(world):
            while pc[r] < len(programs[r]):
                kind, arg = programs[r][pc[r]]
                if kind == "post":
                    for op, msg in arg:
                        if op == "send":
                            sent.add(msg)
                        else:
                            received.add((r, msg))
                else:
                    assert (r, arg) in received, f"rank {r} waits for {arg}, never posted"
                    if arg not in sent:
                        break
                pc[r] += 1
                progress = True
        if not progress:
            raise Deadlock("; ".join(f"rank {r}: {programs[r][pc[r]][1]}" for r in range(world)
                                     if pc[r] < len(programs[r])))


# -- programs: the plan's, and one message at a time in action order ----------------------------


def chain_messages(k: int, m: int, skips: tuple[tuple[int, int], ...] = (),
                   ranks: list[int] | None = None) -> list[Message]:
    """Stage s sends h{s} to s+1 (and h{s} to each skip destination); stage s on rank
    ranks[s] (default: one stage per rank)."""
    rank = ranks or list(range(k))
    edges = [(s, s + 1) for s in range(k - 1)] + list(skips)
    out = []
    for src, dst in edges:
        for mb in range(m):
            out.append(Message(rank[src], rank[dst], f"h{src}", mb, False, src, dst))
            out.append(Message(rank[dst], rank[src], f"h{src}", mb, True, dst, src))
    return out


def on_ranks(name: str, m: int, ranks: int) -> tuple[list[list[Action]], list[int]]:
    """Schedule `name` on `ranks` ranks (its default stages per rank) and its placement."""
    stages = ranks * default_stages_per_rank(name)
    return make_schedule(name, m, stages, ranks), placement(name, stages, ranks)


def consumed_by(msg: Message) -> tuple[str, int, int]:
    return ("B" if msg.grad else "F", msg.receiver, msg.microbatch)


def plan_programs(schedule, messages, edges, early: bool = False) -> list[list[tuple]]:
    """Each rank's posts and waits under the plan; a message between two stages of one rank
    is handed over in the process, not posted."""
    programs = []
    for rank in range(len(schedule)):
        mine = [x for x in messages if rank in (x.src_rank, x.dst_rank)
                and x.src_rank != x.dst_rank]
        ticks = plan_rank(rank, schedule, edges, mine, early_receives=early)
        program: list[tuple] = []
        for tick in ticks:
            ops = [("send" if x.src_rank == rank else "recv", x) for x in tick.post]
            if ops:
                program.append(("post", ops))
            if tick.action is not None:
                a = tick.action
                kind = "B" if a.kind == "I" else a.kind  # a split backward's I takes the grads
                program += [("wait", x) for x in mine
                            if x.dst_rank == rank and consumed_by(x) == (kind, a.stage,
                                                                          a.microbatch)]
        programs.append(program)
    return programs


def one_at_a_time_programs(schedule, messages) -> list[list[tuple]]:
    """The order a per-message executor posts in: each action's receives (each waited for at
    once), then its sends, each its own batch."""
    programs = []
    for rank, actions in enumerate(schedule):
        program: list[tuple] = []
        for a in actions:
            key = (a.kind, a.stage, a.microbatch)
            for x in messages:
                if x.dst_rank == rank and consumed_by(x) == key:
                    program += [("post", [("recv", x)]), ("wait", x)]
            for x in messages:
                made = ("B" if x.grad else "F", x.sender, x.microbatch)
                if x.src_rank == rank and made == key:
                    program.append(("post", [("send", x)]))
        programs.append(program)
    return programs


SIZES = [(k, m) for k in (2, 3, 4, 5) for m in (1, 2, 3, 4, 7, 8)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("k", "m"), SIZES)
def test_plan_cannot_deadlock_under_nccl_rules_and_matches_every_message(name, k, m):
    schedule, ranks = on_ranks(name, m, k)
    stages = len(ranks)
    edges = [(s, s + 1) for s in range(stages - 1)]
    messages = chain_messages(stages, m, ranks=ranks)
    matched = run_nccl_model(plan_programs(schedule, messages, edges))
    assert all(send == recv for send, recv in matched)  # order-based matching pairs equals
    remote = [x for x in messages if x.src_rank != x.dst_rank]
    assert sorted(s for s, _ in matched) == sorted(remote)
    if name == "zb-v":  # the bottom of the V, stage k-1 -> k, stays on rank k-1
        assert len(remote) == len(messages) - 2 * m


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_plan_with_skip_connections_cannot_deadlock(name):
    m = 5
    schedule, ranks = on_ranks(name, m, 4 // default_stages_per_rank(name))
    skips = ((0, 2), (0, 3), (1, 3))
    edges = [(s, s + 1) for s in range(3)] + list(skips)
    messages = chain_messages(4, m, skips, ranks=ranks)
    matched = run_nccl_model(plan_programs(schedule, messages, edges))
    assert all(send == recv for send, recv in matched)
    assert len(matched) == len([x for x in messages if x.src_rank != x.dst_rank])


def test_one_message_at_a_time_deadlocks_1f1b_under_nccl_rules():
    schedule = make_schedule("1f1b", 4, 2)
    with pytest.raises(Deadlock, match="rank 0: grad of 'h0' mb 0"):
        run_nccl_model(one_at_a_time_programs(schedule, chain_messages(2, 4)))


def test_one_message_at_a_time_gets_through_gpipe_which_never_crosses_directions():
    schedule = make_schedule("gpipe", 4, 3)
    run_nccl_model(one_at_a_time_programs(schedule, chain_messages(3, 4)))


def test_clock_of_a_chain_is_clock_cycles():
    for name in SCHEDULES:
        schedule, ranks = on_ranks(name, 5, 3)
        ticks = clock(schedule, [(s, s + 1) for s in range(len(ranks) - 1)])
        grid = clock_cycles(schedule)
        expected = {(a.kind, a.stage, a.microbatch): t for t, row in enumerate(grid)
                    for a in row if a is not None}
        assert ticks == expected


def test_two_stages_per_rank_are_planned_from_the_placement():
    # 4 stages on 2 ranks (stage s on rank s % 2), breadth-first: every forward of the lower
    # stage, then of the upper one, then the backwards in reverse.
    m, placement = 3, [0, 1, 0, 1]
    schedule = [[Action("F", s, mb) for s in stages for mb in range(m)]
                + [Action("B", s, mb) for s in reversed(stages) for mb in reversed(range(m))]
                for stages in ([0, 2], [1, 3])]
    edges = [(0, 1), (1, 2), (2, 3)]
    messages = []
    for s, d in edges:
        for mb in range(m):
            messages.append(Message(placement[s], placement[d], f"h{s}", mb, False, s, d))
            messages.append(Message(placement[d], placement[s], f"h{s}", mb, True, d, s))
    matched = run_nccl_model(plan_programs(schedule, messages, edges))
    assert all(send == recv for send, recv in matched) and len(matched) == len(messages)


def _chain_plans(name: str) -> Iterator[tuple[dict[tuple[str, int, int], int], list[Tick]]]:
    """The shared clock and each rank's plan of schedule `name` on a 3-stage chain, 4
    micro-batches, after checking that each rank posts exactly its own messages."""
    k, m = 3, 4
    schedule = make_schedule(name, m, k)
    edges = [(0, 1), (1, 2)]
    ticks = clock(schedule, edges)
    for rank in range(k):
        mine = [x for x in chain_messages(k, m) if rank in (x.src_rank, x.dst_rank)]
        plan = plan_rank(rank, schedule, edges, mine)
        assert sorted(x for t in plan for x in t.post) == sorted(mine)
        yield ticks, plan


def test_each_message_is_posted_after_its_producer_and_by_its_consumer():
    for ticks, plan in _chain_plans("1f1b"):
        for t in plan:
            assert list(t.post) == sorted(t.post)
            for x in t.post:
                kind = "B" if x.grad else "F"
                assert ticks[(kind, x.sender, x.microbatch)] == t.index - 1
                assert ticks[(kind, x.receiver, x.microbatch)] >= t.index


def test_a_split_backward_posts_each_gradient_the_tick_after_its_input_gradient_pass():
    for ticks, plan in _chain_plans("zb-h1"):
        for t in plan:
            for x in t.post:
                if x.grad:
                    assert ticks[("I", x.sender, x.microbatch)] == t.index - 1
                    assert ticks[("I", x.receiver, x.microbatch)] >= t.index


def test_plan_ticks_are_increasing_and_hold_every_action_of_the_rank():
    schedule = make_schedule("gpipe", 3, 2)
    plan = plan_rank(1, schedule, [(0, 1)], [])
    assert [t.action for t in plan] == schedule[1]
    assert [t.index for t in plan] == sorted(t.index for t in plan)
    assert isinstance(plan[0], Tick)


def test_a_schedule_whose_order_deadlocks_is_refused():
    bad = [[Action("F", 0, 0), Action("B", 0, 0)], [Action("B", 1, 0), Action("F", 1, 0)]]
    with pytest.raises(ConfigError, match="deadlocks at tick 1"):
        clock(bad, [(0, 1)])


def test_a_message_of_another_rank_is_refused():
    schedule = make_schedule("gpipe", 1, 3)
    with pytest.raises(ConfigError, match="not sent or received by rank 0"):
        plan_rank(0, schedule, [(0, 1), (1, 2)], [Message(1, 2, "h1", 0, False, 1, 2)])


# -- early receives (NOTE [Early receives]): transports that match by tag ----------------------


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("k", "m"), [(2, 1), (2, 4), (3, 5), (4, 8)])
def test_early_receives_cannot_deadlock_under_gloo_rules(name, k, m):
    schedule, ranks = on_ranks(name, m, k)
    edges = [(s, s + 1) for s in range(len(ranks) - 1)]
    messages = chain_messages(len(ranks), m, ranks=ranks)
    run_gloo_model(plan_programs(schedule, messages, edges, early=True))
    run_gloo_model(plan_programs(schedule, messages, edges))


def test_early_receives_with_skip_connections_cannot_deadlock_under_gloo_rules():
    for name in SCHEDULES:
        schedule, ranks = on_ranks(name, 5, 4 // default_stages_per_rank(name))
        skips = ((0, 2), (0, 3), (1, 3))
        edges = [(s, s + 1) for s in range(3)] + list(skips)
        run_gloo_model(plan_programs(schedule, chain_messages(4, 5, skips, ranks=ranks), edges,
                                     early=True))


def test_early_receives_break_nccl_order_which_is_why_nccl_plans_keep_them():
    # posted early, rank 1's receives of later activations precede its gradient sends in its
    # order, but not in rank 0's: under NCCL's rules this 1F1B hangs
    schedule = make_schedule("1f1b", 4, 2)
    messages = chain_messages(2, 4)
    with pytest.raises(Deadlock):
        run_nccl_model(plan_programs(schedule, messages, [(0, 1)], early=True))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_an_early_receive_is_posted_lead_actions_before_its_consumer(name):
    m, k = 6, 3
    schedule, ranks = on_ranks(name, m, k)
    edges = [(s, s + 1) for s in range(len(ranks) - 1)]
    ticks = clock(schedule, edges)
    messages = chain_messages(len(ranks), m, ranks=ranks)
    for rank in range(k):
        mine = [x for x in messages if rank in (x.src_rank, x.dst_rank)]
        late = {x: t.index for t in plan_rank(rank, schedule, edges, mine) for x in t.post}
        early = {x: t.index for t in plan_rank(rank, schedule, edges, mine, early_receives=True)
                 for x in t.post}
        assert sorted(early) == sorted(late)  # every message once
        own = sorted(ticks[(a.kind, a.stage, a.microbatch)] for a in schedule[rank])
        backward = {(key[1], key[2]): key[0] for key in ticks if key[0] in ("B", "I")}
        for x, at in early.items():
            if x.src_rank == rank or x.src_rank == x.dst_rank:  # sends, hand-overs: as planned
                assert at == late[x]
                continue
            consumer = ticks[(backward[(x.receiver, x.microbatch)], x.receiver, x.microbatch)
                             if x.grad else ("F", x.receiver, x.microbatch)]
            overlapped = len([t for t in own if at <= t < consumer])
            planned = len([t for t in own if late[x] <= t < consumer])
            expected = max(planned, min(RECEIVE_LEAD, len([t for t in own if t < consumer])))
            assert at <= late[x]
            if x.grad:  # its buffer takes the shape of the activation sent at F's tick + 1
                first = ticks[("F", x.receiver, x.microbatch)] + 1
                assert at >= first and (at == first or overlapped == expected)
            else:
                assert overlapped == expected


def test_early_receives_of_gpipe_literally():
    # 2 stages, 3 micro-batches: rank 1 runs F0 F1 F2 at ticks 1-3 and takes every activation
    # at tick 1; rank 0 runs F at 0-2, B at 5-7 and takes gradient 2 at tick 3 (after F2 sent
    # its activation), gradient 1 at tick 2, gradient 0 at tick 5.
    schedule = make_schedule("gpipe", 3, 2)
    messages = chain_messages(2, 3)
    posts = {}
    for rank in range(2):
        mine = [x for x in messages if rank in (x.src_rank, x.dst_rank)]
        for t in plan_rank(rank, schedule, [(0, 1)], mine, early_receives=True):
            for x in t.post:
                if x.dst_rank == rank:
                    posts[("g" if x.grad else "a") + str(x.microbatch)] = t.index
    assert posts == {"a0": 1, "a1": 1, "a2": 1, "g2": 3, "g1": 2, "g0": 5}


def _position(actions: list[Action], stage: int, mb: int, grad: bool) -> int:
    """Where in a rank's order the action runs that makes (or, at the receiver, uses) a message:
    F of the stage, or for a gradient its B or I."""
    kinds = ("B", "I") if grad else ("F",)
    return next(i for i, a in enumerate(actions)
                if a.kind in kinds and a.stage == stage and a.microbatch == mb)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("k", "m"), [(2, 8), (3, 5), (4, 4)])
def test_a_sends_reply_is_the_first_message_back_sent_after_the_peer_used_it(name, k, m):
    """In the peer's own order (not the clock's): the action that sends the reply is the one
    that waited for the send or a later one, and no message back leaves between the two."""
    schedule, ranks = on_ranks(name, m, k)
    stages = len(ranks)
    edges = [(s, s + 1) for s in range(stages - 1)]
    messages = chain_messages(stages, m, ranks=ranks)
    answered = 0
    for rank in range(k):
        mine = [x for x in messages if rank in (x.src_rank, x.dst_rank)]
        found = replies(rank, schedule, edges, mine)
        for sent in (x for x in mine if x.src_rank == rank != x.dst_rank):
            peer = schedule[sent.dst_rank]
            used = _position(peer, sent.receiver, sent.microbatch, sent.grad)
            back = [_position(peer, x.sender, x.microbatch, x.grad) for x in mine
                    if x.src_rank == sent.dst_rank and x.dst_rank == rank]
            after = [i for i in back if i >= used]
            if not after:
                assert sent not in found, (rank, sent)
                continue
            reply = found[sent]
            assert (reply.src_rank, reply.dst_rank) == (sent.dst_rank, rank)
            assert _position(peer, reply.sender, reply.microbatch, reply.grad) == min(after)
            answered += 1
        assert set(found) <= {x for x in mine if x.src_rank == rank != x.dst_rank}
    assert answered > 0


def test_1f1b_on_two_ranks_answers_each_gradient_by_the_activation_two_micro_batches_on():
    """Rank 0 runs F0 F1 B0 F2 B1 ... F7 B6 B7: after B(m) it sends activation m+2; after B6
    nothing, so the last two gradients have no reply."""
    schedule, ranks = on_ranks("1f1b", 8, 2)
    messages = chain_messages(2, 8, ranks=ranks)
    found = replies(1, schedule, [(0, 1)], messages)
    gradients = {x.microbatch: found.get(x) for x in messages if x.grad}
    assert {mb: r and (r.grad, r.microbatch) for mb, r in gradients.items()} == \
        {**{mb: (False, mb + 2) for mb in range(6)}, 6: None, 7: None}
    # rank 0's activation m is answered by rank 1's first message after its F(m): the
    # gradient of m (rank 1 runs F(m) B(m) in turn)
    found = replies(0, schedule, [(0, 1)], messages)
    assert {x.microbatch: (found[x].grad, found[x].microbatch)
            for x in messages if not x.grad} == {mb: (True, mb) for mb in range(8)}

"""The point-to-point plan: one logical clock for all ranks, and when each message is posted.

Pure (no torch): the distributed executor turns a rank's plan into `batch_isend_irecv` calls.

A schedule is given per rank (`actions_by_rank[r]`, the actions rank r runs in order; a rank may
run several stages) together with the stage -> rank placement and the stages' data edges
(src, dst). `clock` plays the ranks on the one unit-time clock
(`fxpipe.runtime.planning.grid.play`): every rank starts its next action at the first tick when the
actions it depends on ended in an earlier tick. Every rank computes the same clock from the same
inputs.

A message is one tensor (or scalar) crossing ranks: an activation from F(src, m) to F(dst, m), or
its gradient from the backward of dst to the backward of src. `plan_rank` posts each message at
the tick after its producer ran (its data is ready, and the transfer overlaps whatever runs until
its consumer) and lists, per tick, this rank's action and the messages it posts, sends and
receives together, in one canonical order.

NOTE [Deadlock-free point-to-point]
NCCL matches point-to-point operations by order, not by tag: between two ranks both directions
share one stream, executed in the order posted, and a send past NCCL's eager buffer completes only
once its receive is posted and reached. A batch (`batch_isend_irecv`, one NCCL group) progresses
as a whole, and a rank's batches run one after another. Posting one message at a time in action
order deadlocks: with 2 stages and 1F1B, rank 0 posts send(a0), send(a1), recv(g0) while rank 1
posts recv(a0), send(g0), recv(a1); send(a1) and send(g0) wait for each other.

Here every rank, at each tick t of the shared clock, posts one batch B(r, t) holding every message
it sends or receives whose post tick is t, sorted by (src rank, dst rank, value, micro-batch, ...);
it then runs its action of tick t, first waiting only for the receives that action consumes. So:

1. A message appears in exactly one batch on each of its two ranks, the batch of the same tick
   (both derive the post tick from the shared clock), and in the same position relative to the
   other messages of that pair (both sort by the same key). Per pair of ranks, the two ends post
   the same sequence, in the same order: order-based matching pairs each send with its receive.
2. Every rank posts B(r, t) for every t in increasing t. Induction on t: suppose every batch of
   ticks < t completes. A rank reaches tick t once its actions of ticks < t have run; each waits
   only for receives posted at earlier ticks (a message is posted the tick after its producer
   ran, and its consumer runs later still), which completed. So every rank posts B(r, t); by 1,
   every operation in B(r, t) has its partner in B(peer, t), so the batches of tick t, posted by
   all ranks, complete together, and batch t+1 of a rank starts only after its batch t.
3. The data of a send is ready when posted: its producer ran at an earlier tick on this rank.

A tick may post two batches, both derived from the plan on both ends (the dtype headers of the
first step under autocast, waited for, then the data; fxpipe/runtime/communication/dist_comm.py):
the argument holds with each batch as a tick of its own.

Nothing depends on tags, on buffering, or on how long an action takes (the clock only orders,
it does not time). tests/test_p2p_plan.py checks 1-3 on many schedules with a model of these
rules, and tests/test_p2p.py runs every schedule under the strict transport that enforces them.

NOTE [Replies]
Over gloo a send's work tells it has completed only through a blocking wait, so something must
wait for it before its tensor can go. A message from the peer proves it: if the peer sent R from
the action that used S (its wait for S returned inside it) or from a later one, then S had
arrived before R left, and once R is here S's wait returns at once. `replies` finds, for every
send, the first such R of the clock; the transport holds the send until R is received
(Transport.settle) and waits for it there, on the rank's own thread. An activation whose
gradient comes back is held until that gradient, a reply by the same rule (the executor's
choice: its send holds only what backward keeps anyway). A send with no R (the peer sends
nothing back after using it: GPipe's gradients, the last few of 1F1B) is waited for by the
transport's thread.

NOTE [Early receives]
A transfer starts only once both ends have posted it. Posted at the tick after its producer ran,
a receive goes out when its rank reaches that tick, which is after the rank's previous action:
when that action ends later than the producer, the data crosses while the rank waits for it
(gloo on CPU: a few milliseconds per MiB, between every two actions). Where messages match by tag
(gloo), order does not matter, so a receive can be posted RECEIVE_LEAD actions of its rank before
its consumer, and the transfer overlaps them. Its buffer lives that much longer. A gradient's
receive is never posted before its activation was sent (its buffer takes the sent value's shape
and dtype). NCCL matches by order, so its plan keeps every message in the batch of its tick.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from fxpipe.errors import ConfigError
from fxpipe.runtime.planning.grid import play
from fxpipe.runtime.planning.schedule import Action, ActionKind

__all__ = ["Message", "Tick", "clock", "plan_rank", "replies", "RECEIVE_LEAD"]

RECEIVE_LEAD = 2  # actions an early receive is posted before its consumer (one is too few
# where the action before the consumer is short: interleaved 1F1B's forwards)

ActionKey = tuple[ActionKind, int, int]  # (kind, stage, micro-batch)


class Message(NamedTuple):
    """One tensor crossing ranks. Field order is the canonical order of a batch. A tuple, so
    that hashing and comparing one (every message, several times a step, as a dict key) stays
    in C."""

    src_rank: int  # the rank that sends this message
    dst_rank: int  # the rank that receives it
    value: str  # the boundary value's name (the same on both ends)
    microbatch: int
    grad: bool  # False: the activation, src -> dst; True: its gradient, going back
    sender: int  # the stage that sends this message
    receiver: int  # the stage that receives it
    element: int = 0  # which leaf of a tuple value

    def __str__(self) -> str:
        kind = "grad of " if self.grad else ""
        part = f"[{self.element}]" if self.element else ""
        return (f"{kind}{self.value!r}{part} mb {self.microbatch} stage {self.sender} -> "
                f"{self.receiver} (rank {self.src_rank} -> {self.dst_rank})")


@dataclass(frozen=True)
class Tick:
    """What one rank does at one tick: post `post` as one batch, then run `action`."""

    index: int
    action: Action | None
    post: tuple[Message, ...]


def _key(a: Action) -> ActionKey:
    return (a.kind, a.stage, a.microbatch)


def clock(actions_by_rank: Sequence[Sequence[Action]],
          edges: Iterable[tuple[int, int]]) -> dict[ActionKey, int]:
    """The tick of every action, the ranks played on the one clock
    (fxpipe.runtime.planning.grid.play) along the stages' data edges. Raises ConfigError if the
    order deadlocks."""
    return {_key(a): tick for tick, row in enumerate(play(actions_by_rank, edges))
            for a in row if a is not None}


def plan_rank(rank: int, actions_by_rank: Sequence[Sequence[Action]],
              edges: Iterable[tuple[int, int]], messages: Iterable[Message], *,
              early_receives: bool = False) -> list[Tick]:
    """Rank `rank`'s ticks, in order: its action and the messages it posts at each.

    messages: every message this rank sends or receives. Ticks with neither an action nor a
    message are left out. early_receives: post each receive RECEIVE_LEAD actions of this rank
    before its consumer (NOTE [Early receives]); only for transports that match by tag.
    """
    tick_of = clock(actions_by_rank, edges)
    made = _made(tick_of)
    mine = {tick_of[_key(a)]: a for a in actions_by_rank[rank]}
    own = sorted(mine)  # the ticks of this rank's actions
    posts: dict[int, list[Message]] = defaultdict(list)
    for msg in messages:
        if rank not in (msg.src_rank, msg.dst_rank):
            raise ConfigError(f"message {msg} is not sent or received by rank {rank}",
                              hint="pass only this rank's messages")
        at = made(msg.sender, msg.microbatch, msg.grad) + 1
        if made(msg.receiver, msg.microbatch, msg.grad) < at:  # the consumer ran first
            raise ConfigError(f"message {msg} is consumed before it is produced",
                              hint="the edges do not match the schedule's stages")
        if early_receives and msg.dst_rank == rank != msg.src_rank:
            at = _early(at, made(msg.receiver, msg.microbatch, msg.grad),
                        made(msg.receiver, msg.microbatch, False) + 1 if msg.grad else 0, own)
        posts[at].append(msg)
    return [Tick(t, mine.get(t), tuple(sorted(posts.get(t, ()))))
            for t in sorted(set(mine) | set(posts))]


def _made(tick_of: dict[ActionKey, int]) -> Callable[[int, int, bool], int]:
    """made(stage, mb, grad): the tick of the action that computes stage's activation of
    micro-batch mb (its F), or with grad its input gradient (its B, or I where split). That is
    also the tick of the action that uses such a message: F of its receiver, or the
    receiver's backward for a gradient."""
    backward = {(k[1], k[2]): k[0] for k in tick_of if k[0].gives_input_grad}

    def made(stage: int, mb: int, grad: bool) -> int:
        key = (backward.get((stage, mb), ActionKind.BACKWARD), stage, mb) if grad \
            else (ActionKind.FORWARD, stage, mb)
        if key not in tick_of:
            raise ConfigError(f"no rank runs {key[0]}{mb} of stage {stage}, which a message needs",
                              hint="every stage must run F and B of every micro-batch")
        return tick_of[key]
    return made


def replies(rank: int, actions_by_rank: Sequence[Sequence[Action]],
            edges: Iterable[tuple[int, int]],
            messages: Iterable[Message]) -> dict[Message, Message]:
    """For each message `rank` sends to another rank, the first message that rank sends back
    from the action that used it or a later one (NOTE [Replies]); sends with none are absent.

    messages: every message this rank sends or receives."""
    made = _made(clock(actions_by_rank, edges))
    back: dict[int, list[tuple[int, Message]]] = defaultdict(list)  # peer -> its messages here
    mine = []
    for msg in messages:
        if msg.src_rank == msg.dst_rank:
            continue
        if msg.dst_rank == rank:
            back[msg.src_rank].append((made(msg.sender, msg.microbatch, msg.grad), msg))
        elif msg.src_rank == rank:
            mine.append(msg)
    for sent in back.values():
        sent.sort()
    ticks = {peer: [t for t, _ in sent] for peer, sent in back.items()}
    found = {}
    for msg in mine:
        used = made(msg.receiver, msg.microbatch, msg.grad)  # on the peer
        i = bisect.bisect_left(ticks.get(msg.dst_rank, []), used)
        if i < len(ticks.get(msg.dst_rank, [])):
            found[msg] = back[msg.dst_rank][i][1]
    return found


def _early(planned: int, consumer: int, earliest: int, own_ticks: Sequence[int]) -> int:
    """The tick of a receive posted early: that of the rank's action RECEIVE_LEAD actions
    before its consumer (or its first), no earlier than `earliest`, no later than planned."""
    i = bisect.bisect_left(own_ticks, consumer)
    return min(planned, max(earliest, own_ticks[max(i - RECEIVE_LEAD, 0)])) if i else planned

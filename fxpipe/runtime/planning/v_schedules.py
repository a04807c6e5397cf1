"""V-shaped schedules: 2R stages folded over R ranks, rank r holding stage r (down the V) and
stage 2R-1-r (up the V), so that the last stage sits on rank 0 beside the first.

* `zb_v` (Qi et al., ICLR'24, section 6) splits every backward into I and W: W fills what is
  left of the bubble, near zero at equal F, I and W, with 1F1B's activation memory.
* `dualpipe_v` (DeepSeek-V3's DualPipe on a V, as torch.distributed.pipelining orders it) keeps
  ZB-V's V and bubble but runs the steady state's backwards whole (B), splitting only those of
  the warm-up and cool-down, whose W's fill the bubbles there. A split backward costs more
  than a whole one (I walks the graph, W starts again from what I kept), so a stage may run
  B for some micro-batches and I, W for others; the validator, the clock and the simulator
  take either per (stage, micro-batch).
"""
from __future__ import annotations

from collections import deque

from fxpipe.runtime.planning.actions import (
    Action,
    ActionKind,
    Schedule,
    check_sizes,
    check_stages_per_rank,
)

__all__ = ["zb_v", "dualpipe_v"]


def zb_v(num_microbatches: int, num_stages: int) -> Schedule:
    """ZB-V: 2R stages in a V over R ranks (rank r holds stages r and 2R-1-r), the backward
    split into I and W.

    Rank r's order, with c0 = stage r (down the V) and c1 = stage 2R-1-r (up the V):
    warm up with 2(R-r)-1 forwards of c0, then r pairs (F c1, F c0), then R-r triples
    (F c1, I c1, W c1); in the steady state repeat (F c0, I c0, W c0, F c1, I c1, W c1); cool
    down with r pairs (I c0, I c1), R-r pairs (I c0, W c0), then the W's left. At equal F, I
    and W times no rank waits once the V is full, and a rank keeps at most about 2R
    stage-micro-batches alive, as 1F1B keeps R of stages twice the size. Fewer than 2R-1
    micro-batches play the order of 2R-1 with the missing ones left out.
    """
    check_sizes(num_microbatches, num_stages)
    check_stages_per_rank(num_stages, num_stages // 2 or 1, "zb-v", exactly=2)
    ranks = num_stages // 2
    played = max(num_microbatches, 2 * ranks - 1)
    return [[a for a in _zb_v_rank(r, ranks, played) if a.microbatch < num_microbatches]
            for r in range(ranks)]


class _Counter:
    """A rank's actions in order, each kind of each stage numbered 0, 1, ... as it runs."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.count: dict[tuple[ActionKind, int], int] = {}

    def run(self, *steps: tuple[ActionKind, int]) -> None:
        for kind, stage in steps:
            m = self.ran(kind, stage)
            self.count[(kind, stage)] = m + 1
            self.actions.append(Action(kind, stage, m))

    def ran(self, kind: ActionKind, stage: int) -> int:
        return self.count.get((kind, stage), 0)


def _zb_v_rank(r: int, ranks: int, played: int) -> list[Action]:
    """Rank r's ZB-V order for `played` micro-batches (see `zb_v`)."""
    kinds = (ActionKind.FORWARD, ActionKind.INPUT_GRAD, ActionKind.WEIGHT_GRAD)
    f_down, i_down, w_down = ((k, r) for k in kinds)
    up = 2 * ranks - 1 - r
    f_up, i_up, w_up = ((k, up) for k in kinds)
    c = _Counter()
    for _ in range(2 * (ranks - r) - 1):
        c.run(f_down)
    for _ in range(r):
        c.run(f_up, f_down)
    for _ in range(ranks - r):
        c.run(f_up, i_up, w_up)
    while c.ran(*f_up) < c.ran(*f_down) or c.ran(*f_down) < played:
        if c.ran(*f_down) < played:
            c.run(f_down)
        c.run(i_down, w_down, f_up, i_up, w_up)
    for _ in range(r):
        c.run(i_down, i_up)
    for _ in range(ranks - r):
        c.run(i_down, w_down)
    while c.ran(*w_up) < c.ran(*i_up):
        c.run(w_up)
    while c.ran(*w_down) < c.ran(*i_down):
        c.run(w_down)
    return c.actions


def dualpipe_v(num_microbatches: int, num_stages: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto R ranks): ZB-V's V of 2R stages, the
    backward split only where a split fills a bubble.

    Rank r's order, with c0 = stage r (down the V) and c1 = stage 2R-1-r (up the V):
    2(R-r-1) forwards of c0; r+1 pairs (F c0, F c1); R-r-1 triples (I c1, the oldest pending
    W, F c1); in the steady state M-2R+r+1 rounds of (F c0, B c1, F c1, B c0), whole backwards;
    R-r-1 triples (B c1, F c1, B c0); r+1 pairs of backwards (c1, c0), the later half of them
    split (I, its W pending); R-r-1 pairs (pending W, backward of c0); then the pending W's.
    Most backwards run whole, so the steady state pays nothing for splitting; the W's fill the
    warm-up and cool-down bubbles that ZB-V fills. Fewer than 2R micro-batches play the order
    of 2R with the missing ones left out.
    """
    check_sizes(num_microbatches, num_stages)
    check_stages_per_rank(num_stages, num_stages // 2 or 1, "dualpipev", exactly=2)
    ranks = num_stages // 2
    played = max(num_microbatches, 2 * ranks)
    return [[a for a in _dualpipe_v_rank(r, ranks, played) if a.microbatch < num_microbatches]
            for r in range(ranks)]


class _Backwards:
    """A rank's actions in order, where a stage's backward of micro-batch m is B(m), or I(m)
    with W(m) queued to run when asked (oldest first)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.count: dict[tuple[str, int], int] = {}
        self.weights: deque[Action] = deque()

    def forward(self, stage: int) -> None:
        self.actions.append(Action(ActionKind.FORWARD, stage, self._next("F", stage)))

    def backward(self, stage: int, split: bool = False) -> None:
        m = self._next("B", stage)
        if split:
            self.actions.append(Action(ActionKind.INPUT_GRAD, stage, m))
            self.weights.append(Action(ActionKind.WEIGHT_GRAD, stage, m))
        else:
            self.actions.append(Action(ActionKind.BACKWARD, stage, m))

    def weight(self) -> None:
        if self.weights:
            self.actions.append(self.weights.popleft())

    def _next(self, kind: str, stage: int) -> int:
        m = self.count.get((kind, stage), 0)
        self.count[(kind, stage)] = m + 1
        return m


def _dualpipe_v_rank(r: int, ranks: int, played: int) -> list[Action]:
    """Rank r's DualPipeV order for `played` >= 2R micro-batches (see `dualpipe_v`)."""
    down, up = r, 2 * ranks - 1 - r
    c = _Backwards()
    for _ in range(2 * (ranks - r - 1)):
        c.forward(down)
    for _ in range(r + 1):
        c.forward(down)
        c.forward(up)
    for _ in range(ranks - r - 1):
        c.backward(up, split=True)
        c.weight()
        c.forward(up)
    for _ in range(played - 2 * ranks + r + 1):
        c.forward(down)
        c.backward(up)
        c.forward(up)
        c.backward(down)
    for _ in range(ranks - r - 1):
        c.backward(up)
        c.forward(up)
        c.backward(down)
    split, half = False, (r + 1) // 2  # from the middle pair on, the backwards split
    for i in range(r + 1):
        split = split or (i == half and r % 2 == 1)
        c.backward(up, split)
        split = split or (i == half and r % 2 == 0)
        c.backward(down, split)
    for _ in range(ranks - r - 1):
        c.weight()
        c.backward(down, split)
    while c.weights:
        c.weight()
    return c.actions

"""Balancing by measurement: node times corrected by what each stage measured (pure).

The cost model predicts each stage's compute time; a few training steps measure it. Every node
of stage s then has its time multiplied by measured_s / predicted_s, so the corrected model
predicts exactly what was measured for this cut, and the partition is solved again. Nodes that
change stage carry the correction of the stage they were measured in. Rounds repeat until the
measured stages are within a tolerance of each other or the cut stops moving (it comes back to
one already measured); the best cut measured wins: the one whose busiest rank is least above the
ranks' mean. A rank's load is its measured compute plus what its stages' messages cost it, as
predicted (the links' time and each end's host work per message): measuring times compute only,
and a cut through a residual block, which sends two values where the block's end sends one, can
measure a little better balanced yet step slower (the bundled MLP, 4 micro-batches of 2 rows on
gloo: 10 ms a step at such a cut, 8 ms at the block's end). Under a looped schedule a rank
holds several stages, and what its step waits on is their sum, so a cut of equal stage maxima
can still leave one rank far busier than the other.
Rounds are compared relative to their own mean because each is measured at another moment: every
cut of a model computes the same work, so the mean is how fast the machine ran that round, and it
drifts by more than good cuts differ (a GPipe GPT round measured 93.9 / 110.2 ms at one cut and
89.1 / 108.4 at a worse one, which five benches then measured 12-16% apart). The messages are
not in that mean: a cut that adds them adds work the other cuts do not do.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fxpipe.errors import ConfigError

__all__ = ["BalanceRound", "LOSS", "TOLERANCE", "corrected", "spread", "best_round", "next_cut",
           "kept_reason"]

LOSS = "(loss)"
"""The key of the loss's correction (the last stage computes it after the model's outputs)."""
TOLERANCE = 0.05
"""Measured stages within 5% of each other (slowest / fastest - 1) count as balanced."""


@dataclass(frozen=True)
class BalanceRound:
    """One cut tried while balancing by measurement, per stage in seconds per micro-batch."""

    starts: tuple[str, ...]  # the first node of each stage: the cut
    modules: tuple[str, ...]  # the first module of each stage, for the report
    predicted: tuple[float, ...]  # compute time predicted before this round's measurement
    measured: tuple[float, ...]  # compute time measured (forward, backward, recompute)
    ranks: tuple[int, ...] = ()  # the pipeline rank of each stage; () is one stage per rank
    note: str = ""  # why balancing went on from this round, or why it stopped
    # what each stage's messages cost its rank beyond compute, predicted; () is none
    messages: tuple[float, ...] = ()

    @property
    def spread(self) -> float:
        return spread(self.measured)

    @property
    def rank_loads(self) -> tuple[float, ...]:
        """Measured compute of each rank: the sum of its stages."""
        return self._by_rank(self.measured)

    @property
    def rank_busy(self) -> tuple[float, ...]:
        """Each rank's measured compute and its stages' predicted message costs."""
        if not self.messages:
            return self.rank_loads
        return self._by_rank(tuple(c + m for c, m in zip(self.measured, self.messages,
                                                         strict=True)))

    def _by_rank(self, per_stage: tuple[float, ...]) -> tuple[float, ...]:
        if not self.ranks:
            return per_stage
        loads = [0.0] * (max(self.ranks) + 1)
        for rank, seconds in zip(self.ranks, per_stage, strict=True):
            loads[rank] += seconds
        return tuple(loads)

    @property
    def rank_spread(self) -> float:
        """How far apart the ranks' measured compute is (what a looped schedule waits on)."""
        return spread(self.rank_loads)

    @property
    def bottleneck(self) -> float:
        """The busiest rank's measured compute and messages: what bounds the step."""
        return max(self.rank_busy)

    @property
    def relative_bottleneck(self) -> float:
        """The busiest rank, its messages included, over the ranks' mean compute (1 when
        balanced and nothing crosses): the bottleneck with the machine's speed during this
        round taken out."""
        loads = self.rank_loads
        mean = sum(loads) / len(loads)
        return max(self.rank_busy) / mean if mean > 0 else float("inf")

    def to_json(self) -> dict[str, object]:
        return {"starts": list(self.starts), "modules": list(self.modules),
                "predicted_s": list(self.predicted), "measured_s": list(self.measured),
                "ranks": list(self.ranks), "messages_s": list(self.messages),
                "spread": self.spread,
                "rank_spread": self.rank_spread, "note": self.note}


def spread(times: Sequence[float]) -> float:
    """How far apart stage times are: slowest / fastest - 1 (0 when equal)."""
    low = min(times)
    return max(times) / low - 1 if low > 0 else float("inf")


def corrected(corrections: Mapping[str, float], stages: Sequence[Sequence[str]],
              predicted: Sequence[float], measured: Sequence[float]) -> dict[str, float]:
    """New node corrections: each node of stage s (node names per stage) multiplied by
    measured[s] / predicted[s]; the loss takes the last stage's factor.

    >>> corrected({}, [["a"], ["b"]], [1.0, 1.0], [1.0, 2.0])
    {'a': 1.0, 'b': 2.0, '(loss)': 2.0}
    """
    if not len(stages) == len(predicted) == len(measured):
        raise ConfigError(f"{len(stages)} stages, {len(predicted)} predicted and "
                          f"{len(measured)} measured times", hint="give one per stage")
    out = dict(corrections)
    for nodes, want, got in zip(stages, predicted, measured):
        if want <= 0 or got <= 0:
            continue  # nothing to learn from a stage without predicted or measured work
        factor = got / want
        for name in nodes:
            out[name] = out.get(name, 1.0) * factor
    if predicted[-1] > 0 and measured[-1] > 0:
        out[LOSS] = out.get(LOSS, 1.0) * measured[-1] / predicted[-1]
    return out


def best_round(rounds: Sequence[BalanceRound]) -> BalanceRound:
    """The round whose busiest rank (its messages included) is least above the ranks' mean
    compute, then whose slowest stage is least above the stages' mean (the first of equals)."""
    if not rounds:
        raise ConfigError("no balancing round was measured", hint="run at least one round")
    return min(rounds, key=lambda r: (r.relative_bottleneck, _over_mean(r.measured)))


def _over_mean(times: Sequence[float]) -> float:
    """The largest time over the mean (1 when all are equal)."""
    mean = sum(times) / len(times)
    return max(times) / mean if mean > 0 else float("inf")


def next_cut(stages: Sequence[Sequence[str]], measured: Sequence[float]) -> tuple[str, ...] | None:
    """The cut that moves nodes from the slowest stage to its faster neighbour, in proportion to
    the measured difference (the first node of each stage), for when solving again returns a
    cut already measured; None when the slowest stage has a single node.

    >>> next_cut([["a", "b", "c", "d"], ["e"]], [3.0, 1.0])
    ('a', 'd')
    """
    slow = max(range(len(measured)), key=measured.__getitem__)
    nodes = stages[slow]
    near = [j for j in (slow - 1, slow + 1) if 0 <= j < len(stages)]
    if len(nodes) < 2 or not near:
        return None
    fast = min(near, key=measured.__getitem__)
    share = (measured[slow] - measured[fast]) / (2 * measured[slow])
    count = min(max(1, round(len(nodes) * share)), len(nodes) - 1)
    starts = [s[0] for s in stages]
    if fast > slow:
        starts[fast] = nodes[len(nodes) - count]
    else:
        starts[slow] = nodes[count]
    return tuple(starts)


def kept_reason(rounds: Sequence[BalanceRound], tolerance: float = TOLERANCE) -> str:
    """Why the cut best_round keeps was kept, in words: balanced, or the least imbalanced of the
    cuts measured and why no further cut was tried (the last round's note)."""
    kept = best_round(rounds)
    which = f"round {list(rounds).index(kept) + 1}"
    if kept.spread <= tolerance:
        return f"{which}: its stages measured within {tolerance:.0%} of each other"
    why = rounds[-1].note or "no further cut was tried"
    return (f"{which}: the least imbalanced of {len(rounds)} cut(s) measured (busiest rank, "
            f"its messages included, {kept.relative_bottleneck - 1:.1%} over the mean compute), "
            f"still {kept.spread:.1%} apart: {why}")

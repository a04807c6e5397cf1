"""The figures a pipeline is judged by, each defined once: the report, the stage headers and the
bench print these, predicted or measured, so no two of them can disagree on what a bubble, an
imbalance or the bytes remat keeps are.

    imbalance     slowest / mean of the stages' (or ranks') busy times: 1.000 is even
    idle_share    the bubble: the ranks' idle share of a step, 1 - busy / (ranks x step)
    stage_load    what one stage is busy with per micro-batch: its compute and its half of the
                  traffic on its boundaries (each boundary is shared by two stages)
    kept_at_peak  the activation bytes a stage keeps at the peak of a step of a schedule
    remat_saving  what a remat region keeps instead of what it would save, or that it saves
                  nothing
    against       how far a measured figure is from its prediction
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["imbalance", "idle_share", "stage_load", "kept_at_peak", "remat_saving", "against"]


def imbalance(times: Sequence[float]) -> float:
    """Slowest / mean of busy times (1 when even, and for no time at all)."""
    mean = sum(times) / len(times) if times else 0.0
    return max(times) / mean if mean > 0 else 1.0


def idle_share(busy: float, ranks: int, step: float) -> float:
    """The bubble: the share of `ranks` ranks' time over a step of `step` seconds that they
    spend not computing (busy: their compute in the step, all ranks together).

    The one bubble fxpipe prints for a schedule: predicted, the schedule played at the stages'
    predicted costs (fxpipe.runtime.planning.timeline.predicted_step); measured, a run's step (the
    bench). GPipe's textbook (S-1)/(M+S-1) is this figure at equal unit costs
    (fxpipe.runtime.planning.grid.bubble_fraction), not a second one."""
    total = step * ranks
    return min(max(1 - busy / total, 0.0), 1.0) if total > 0 else 0.0


def stage_load(compute: float, comm: float) -> float:
    """Seconds a stage is busy per micro-batch: compute plus half of the traffic on its
    boundaries (`comm` counts each boundary whole; the stage on its other side pays the other
    half), as the schedule simulation charges it."""
    return compute + comm / 2


def kept_at_peak(saved: float, kept: float, inflight: int, whole: int) -> float:
    """Bytes a stage keeps for its backwards at the peak of a step: `inflight` micro-batches
    whose forward is done and backward is not (fxpipe.runtime.planning.grid.peak_inflight of the
    schedule), `whole` of them keeping `saved` bytes and the others `kept`, what their remat
    regions keep (which are whole: fxpipe.remat_policy.RematPolicy.kept_whole)."""
    return (inflight - whole) * kept + whole * saved


def remat_saving(kept: float, saved: float, size: Callable[[float], str]) -> str:
    """What a remat region keeps per micro-batch instead of what it keeps without remat, sizes
    written by `size`; a region that keeps as much or more says it saves nothing."""
    if kept >= saved:
        return (f"saves nothing: keeps {size(kept)} (its inputs) where running it whole keeps "
                f"{size(saved)}")
    return f"keeps {size(kept)} instead of {size(saved)}"


def against(measured: float, predicted: float) -> str:
    """How far a measurement is from its prediction, in words: "+25% against the prediction"."""
    if predicted <= 0:
        return "nothing predicted" if measured > 0 else "as predicted"
    return f"{measured / predicted - 1:+.0%} against the prediction"

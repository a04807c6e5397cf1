"""How fast each rank's core runs identical work at one moment: the noise floor of a measured
stage imbalance.

On a shared machine (a cloud VM whose cores share physical cores with other guests) the speed
of a core drifts on its own by tens of percent within seconds, so two ranks doing equal work can
measure far apart. `fxpipe bench` times this reference work on every rank at once around each
step of fxpipe's programs and reports how far apart the cores ran, and each schedule's imbalance
once each rank's compute is divided by its core's relative slowness: what is left apart is the
partition's doing, not the machine's.

Balancing by measurement does not rescale its samples so: a probe before and after a step
cannot see a drift within it, and in a trial it moved a GPipe round's stages 27% apart where
the same cut measured within 3% unscaled.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fxpipe.figures import imbalance

__all__ = ["CoreProbe", "relative_slowness", "speed_spread", "imbalance_at_equal_speed"]


class CoreProbe:
    """A fixed slice of transformer-like work (matmuls, GELU, layer norm, softmax) on fixed
    tensors; `seconds()` times it. Built once per process, so every call does the same work."""

    def __init__(self, width: int = 256, rows: int = 256, repeats: int = 3) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(rows, width, generator=generator)
        self.w1 = torch.randn(width, 4 * width, generator=generator) / width ** 0.5
        self.w2 = torch.randn(4 * width, width, generator=generator) / (4 * width) ** 0.5
        self.repeats = repeats

    def _work(self) -> torch.Tensor:
        h = self.x
        for _ in range(4):
            h = F.layer_norm(h + F.gelu(h @ self.w1) @ self.w2, h.shape[-1:])
            h = h + torch.softmax(h @ h.T / h.shape[-1] ** 0.5, dim=-1) @ h
        return h

    def seconds(self) -> float:
        """The fastest of a few back-to-back runs: a preemption spike is not the core's speed,
        a slower core of the moment is (it slows every run alike)."""
        best = float("inf")
        with torch.no_grad():
            for _ in range(self.repeats):
                start = time.perf_counter()
                self._work()
                best = min(best, time.perf_counter() - start)
        return best


def relative_slowness(probe_seconds: Sequence[float]) -> list[float]:
    """Each rank's probe time over the ranks' mean: 1.1 = this core ran 10% slower."""
    mean = sum(probe_seconds) / len(probe_seconds)
    return [t / mean for t in probe_seconds]


def speed_spread(probes: Sequence[Sequence[float]]) -> float:
    """Median over steps of how far apart the ranks' cores ran identical work (slowest /
    fastest - 1); probes[step][rank] in seconds."""
    return statistics.median(max(p) / min(p) - 1 for p in probes)


def imbalance_at_equal_speed(busy: Sequence[Sequence[float]],
                             probes: Sequence[Sequence[float]]) -> float:
    """The ranks' compute imbalance (slowest / mean, fxpipe.figures.imbalance) once each step's
    compute is divided by its core's relative slowness; busy[step][rank] and probes[step][rank]
    in seconds. Per rank the median over steps, as for the raw imbalance."""
    ranks = len(busy[0])
    normalised: list[list[float]] = [[] for _ in range(ranks)]
    for step_busy, step_probe in zip(busy, probes, strict=True):
        for r, (b, s) in enumerate(zip(step_busy, relative_slowness(step_probe), strict=True)):
            normalised[r].append(b / s)
    medians = [statistics.median(v) for v in normalised]
    return imbalance(medians)


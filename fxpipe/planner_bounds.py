"""What the planner (fxpipe.planner) knows of a candidate before cutting the graph: the
all-reduce of its replicas over their link, and lower bounds of its memory per device and of its
step, which let it skip candidates that cannot win or cannot fit."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch.fx import GraphModule, Node

from fxpipe.losses import loss_time
from fxpipe.optimizers import OptimizerMemory
from fxpipe.passes.partition.totals import GraphTotals
from fxpipe.profile import DeviceProfile
from fxpipe.remat_policy import remat_policy

__all__ = ["Bounds", "Link", "Layout"]


class Layout(Protocol):
    """What the bounds read of a candidate (fxpipe.planner.Candidate)."""

    @property
    def ranks(self) -> int: ...  # one replica's
    @property
    def replicas(self) -> int: ...
    @property
    def chunks(self) -> int: ...
    @property
    def remat(self) -> str: ...
    @property
    def shard(self) -> str: ...


@dataclass(frozen=True)
class Link:
    """Where a stage's replicas all-reduce: the devices of a machine (None: all on one), the
    bandwidth between machines, and the device profile's link within one."""

    devices_per_node: int | None
    inter_node: float | None
    profile: DeviceProfile

    def all_reduce(self, c: Layout, nbytes: float) -> float:
        """Seconds of a ring all-reduce of `nbytes` over the candidate's replicas."""
        if c.replicas == 1:
            return 0.0
        # a stage's replicas sit ranks apart: on one machine while they all fit on it
        across = self.devices_per_node is not None \
            and c.ranks * c.replicas > self.devices_per_node
        bandwidth = self.inter_node if across and self.inter_node \
            else self.profile.link_bandwidth
        hops = 2 * (c.replicas - 1)
        if c.shard == "optimizer":  # each replica's updated parameters, to the others
            hops += c.replicas - 1
        return hops / c.replicas * nbytes / bandwidth + hops * self.profile.link_latency


class Bounds:
    """Lower bounds of a candidate's memory per device and step, from the graph's totals
    before any cut: every rank holds at least its share of the weights, gradients, optimizer
    state and one micro-batch's activations, and computes at least its share of the
    micro-batches' work; the slowest stage's gradients are at least a rank's share."""

    def __init__(self, gm: GraphModule, profile: DeviceProfile, groups: list[list[Node]],
                 optimizer: OptimizerMemory, grad_bytes: float, link: Link) -> None:
        self.gm, self.profile, self.optimizer = gm, profile, optimizer
        self.grad_bytes, self.link = grad_bytes, link
        self.totals = GraphTotals.of(groups)
        self._held: dict[OptimizerMemory, float] = {}
        self._saved: dict[int, float] = {}
        self._time: dict[int, tuple[float, float]] = {}
        self._accumulate = self.totals.accumulation(self.profile)
        self._paid = self.totals.paid(self.profile)

    def memory(self, c: Layout, b: int) -> float:
        """The graph's weights, gradients, optimizer state (as sharded) and one micro-batch's
        saved activations, a rank's share: what the atoms of any remat and chunks sum to."""
        optimizer = self.optimizer.sharded(c.shard, c.replicas)
        if optimizer not in self._held:
            self._held[optimizer] = self.totals.held(optimizer)
        if b not in self._saved:
            self._saved[b] = self.totals.saved_bytes(b)
        return (self._held[optimizer] + self._saved[b]) / c.ranks

    def step(self, c: Layout, b: int) -> float:
        """A rank's share of the micro-batches' work (what measure_atoms' compute sums to: each
        operation's kernels and overhead, and what remat recomputes), the step's overhead and
        the all-reduce of a rank's share of the gradients."""
        if b not in self._time:
            self._time[b] = self.totals.kernel_time(self.profile, b)
        fwd, bwd = self._time[b]
        paid, paid_forward, region = self._paid
        recompute = remat_policy(c.remat).recomputed_share(c.chunks)
        again = recompute * (fwd + paid_forward + region)
        work = (fwd + bwd + paid + again + loss_time(self.gm, b, self.profile, False)) * c.chunks \
            + (c.chunks - 1) * self._accumulate
        return work / c.ranks + self.profile.step_overhead \
            + self.link.all_reduce(c, self.grad_bytes / c.ranks)

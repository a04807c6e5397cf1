"""The partition's prediction: each stage's nodes, times, messages and bytes (StagePlan), and
the plan of all stages with what a step pays beyond them (PartitionPlan)."""
from __future__ import annotations

from dataclasses import dataclass, field

from fxpipe.figures import imbalance, stage_load
from fxpipe.runtime.planning.schedule import ScheduleKind, schedule_kind
from fxpipe.runtime.planning.timeline import SharedWeight, tied_reduce

__all__ = ["StagePlan", "PartitionPlan"]


@dataclass(frozen=True)
class StagePlan:
    index: int
    nodes: tuple[str, ...]  # compute node names in order
    time: float  # predicted seconds per micro-batch: fwd + bwd (+ recompute) + communication
    compute_time: float
    comm_time: float
    memory: float | None  # predicted peak bytes under the memory model
    first_module: str
    last_module: str
    forward_time: float = 0.0  # the part of compute_time spent in forwards (recompute: backward)
    recompute_time: float = 0.0  # the part spent recomputing remat regions in the backward
    # the part of the backward a split backward's W runs (besides recomputing): the weight
    # gradients; the whole backward in the first stage, which has no input gradient to send
    weight_time: float = 0.0
    # the part of compute_time paid beyond kernels: per operation, per micro-batch, per region
    overhead_time: float = 0.0
    # bytes held whatever the schedule: weights and buffers, and for the trainable weights their
    # gradients and the optimizer's state (fxpipe.optimizers); part of `memory`
    held_bytes: float = 0.0
    # messages a rank running the stage sends or receives per micro-batch: in its forward (the
    # values crossing its boundaries) and in its backward (their gradients)
    forward_messages: int = 0
    backward_messages: int = 0


@dataclass(frozen=True)
class PartitionPlan:
    stages: tuple[StagePlan, ...]
    microbatch_size: int
    chunks: int
    balance: str
    bottleneck: float
    predicted_step_time: float  # the schedule simulated with the stage times (one step)
    candidates: tuple[tuple[int, float], ...] = ()  # (chunks, predicted step time) for "auto"
    # schedule="auto": (schedule, simulated step time, or None where no partition fits memory)
    schedules: tuple[tuple[str, float | None], ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    step_overhead: float = 0.0  # seconds each step pays once, beyond its micro-batches
    # seconds a pipeline rank pays beyond one process: per forward or backward of a stage and
    # micro-batch, and per message sent or received (fxpipe.profile.ranks)
    action_overhead: float = 0.0
    message_overhead: float = 0.0
    # the ranks' own cores move each message's bytes (gloo between CPU processes): a transfer
    # is host work of both its ends, not overlapped with their compute (DeviceProfile.host_link)
    host_link: bool = False
    # trainable weights several stages use (tied weights: an embedding and its output layer),
    # whose gradients an all-reduce sums where a schedule places those stages on several ranks
    shared: tuple[SharedWeight, ...] = ()

    def breakdown(self, schedule: ScheduleKind | str, ranks: int | None = None
                  ) -> dict[str, float]:
        """Seconds of one step's work under `schedule` on `ranks` ranks, all stages together
        (not its critical path): kernels, per-operation overhead, per-micro-batch overhead
        (both in compute_time), messages (each boundary once, forward and backward), what
        ranks pay to run each forward and backward and to send and receive each message, the
        tied weights' gradient all-reduce and the per-step overhead."""
        kind = schedule_kind(schedule)
        rank_of = kind.placement(len(self.stages), ranks or kind.ranks_for(len(self.stages)))
        m = self.chunks
        overhead = sum(s.overhead_time for s in self.stages) * m
        kernels = sum(s.compute_time for s in self.stages) * m - overhead
        work = sum(2 * self.action_overhead + self.message_overhead
                   * (s.forward_messages + s.backward_messages) for s in self.stages) * m
        return {"kernels": kernels, "overhead": overhead,
                "messages": sum(s.comm_time for s in self.stages) / 2 * m,
                "ranks": work, "reduce": tied_reduce(self, rank_of)[0], "step": self.step_overhead}

    @property
    def imbalance(self) -> float:
        """Slowest / mean stage, each busy with its compute and half its boundaries' traffic
        (fxpipe.figures: the one imbalance reports print)."""
        return imbalance([stage_load(s.compute_time, s.comm_time) for s in self.stages])

    def message_time(self, stage: StagePlan) -> float:
        """Seconds per micro-batch the stage's messages cost its rank beyond compute: its
        boundaries' link time and the host work of each message it sends or receives."""
        return stage.comm_time + self.message_overhead * (stage.forward_messages
                                                          + stage.backward_messages)

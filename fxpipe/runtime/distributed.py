"""The distributed executor: one process per stage, torch.distributed point-to-point.

Every rank calls `step(inputs, target)` with the whole batch; each runs its own stage's actions
in schedule order (GPipe: all forwards, then all backwards; 1F1B interleaves them), exchanging
activations and gradients with its peers (fxpipe.runtime.comm.DistComm). Micro-batch losses are
weighted by their share of the batch, so the accumulated gradients equal those of one
full-batch mean loss. Parameters that several stages hold (tied weights) have their gradients
summed across those stages; with data parallelism, gradients are then averaged across replicas.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fxpipe import ir
from fxpipe.errors import PeerLostError, PipelineRuntimeError, RuntimeInputError
from fxpipe.runtime.batchnorm import commit_batch_norms, discard_batch_norms
from fxpipe.runtime.comm import DistComm, MicrobatchComm, TagTable
from fxpipe.runtime.finite import check_finite
from fxpipe.runtime.local import remat_enabled, seeded_forward
from fxpipe.runtime.memory import KeptMemory
from fxpipe.runtime.overlap import ReplicaAverager
from fxpipe.runtime.schedule import get_schedule
from fxpipe.runtime.stage import StageModule
from fxpipe.runtime.timeline import Timeline
from fxpipe.signature import Signature

__all__ = ["DEFAULT_DP_BUCKET_BYTES", "DistributedExecutor", "Mesh", "split_target"]

DEFAULT_DP_BUCKET_BYTES = 25 * 2**20  # as DDP's bucket_cap_mb


@dataclass(frozen=True)
class Mesh:
    """Where each stage of each pipeline replica runs: rank = replica * stages + stage."""

    stages: int
    replicas: int
    rank: int

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def replica(self) -> int:
        return self.rank // self.stages

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        return (self.replica if replica is None else replica) * self.stages + stage

    def describe(self) -> list[tuple[int, int, int]]:
        """(rank, replica, stage) for every rank."""
        return [(r, r // self.stages, r % self.stages) for r in range(self.stages * self.replicas)]


@dataclass
class StepResult:
    loss: float
    events: list = field(default_factory=list)
    kept_bytes: int = 0  # peak activation bytes held for backward on this rank


def split_target(target: torch.Tensor | None, chunks: int, batch_dim: int, batch: int) -> list:
    if target is None:
        return [None] * chunks
    if target.dim() <= batch_dim or target.shape[batch_dim] != batch:
        raise RuntimeInputError(
            f"target shape {tuple(target.shape)} has no batch dimension {batch_dim} of size {batch}",
            hint="give the target the same batch size as the inputs, along the batch dimension "
                 "of the model's first output")
    return list(target.tensor_split(chunks, dim=batch_dim))


class DistributedExecutor:
    """Runs one stage of the program on this rank."""

    def __init__(self, *, module: StageModule, mesh: Mesh, signature: Signature,
                 input_indexes: Sequence[int], comm_info: dict[tuple[str, int, int], Any],
                 edges: Sequence[tuple[str, int, int]], random: bool, device: torch.device, pp_group: Any = None,
                 shared: dict[str, list[int]] | None = None, shared_groups: dict | None = None,
                 dp_group: Any = None, check_finite: bool = False, graph: Any = None,
                 dp_bucket_bytes: int = DEFAULT_DP_BUCKET_BYTES) -> None:
        self.module = module
        self.mesh = mesh
        self.signature = signature
        self.inputs = list(input_indexes)
        self.comm_info = comm_info
        self.edges = list(edges)  # every (tag, src, dst) of the program: the same tags on all ranks
        self.random = random
        self.device = device
        self.pp_group = pp_group
        self.dp_group = dp_group
        self.shared = shared or {}
        self.shared_groups = shared_groups or {}
        self.check_finite = check_finite
        self.graph = graph  # the stage GraphModule when known (names the node of a NaN/Inf)
        self.timeline = Timeline()
        self.record_memory = False
        # Replica averaging of untied gradients overlaps the last backward (0: after it).
        # Tied parameters wait for their sum over stages, which needs every stage's backward.
        self.averager = None
        if dp_group is not None and mesh.replicas > 1 and dp_bucket_bytes > 0:
            tied = {id(t) for name, t in module.named_model_tensors().items() if name in self.shared}
            self.averager = ReplicaAverager((p for p in module.parameters() if id(p) not in tied),
                                            dp_group, mesh.replicas, dp_bucket_bytes)

    @property
    def is_last(self) -> bool:
        return self.mesh.stage == self.mesh.stages - 1

    def step(self, tensors: Sequence[torch.Tensor], target: torch.Tensor | None,
             loss_fn: Callable[..., torch.Tensor], *, chunks: int, remat: str,
             schedule: str = "gpipe") -> StepResult:
        """One training step of this rank's stage: forwards and backwards of every micro-batch."""
        stage, k = self.mesh.stage, self.mesh.stages
        batch = self.signature.batch_size(tensors)
        micro = self.signature.split_inputs(tensors, chunks)
        out_dim = next((d for d in self.signature.out_batch_dims if d is not None), 0)
        targets = split_target(target, chunks, out_dim, batch)
        b = batch // chunks
        comm = DistComm(rank_of_stage=[self.mesh.rank_of(s) for s in range(k)],
                        tags=TagTable(self.edges, chunks), info=self.comm_info, microbatch_size=b,
                        group=self.pp_group, timeline=self.timeline)
        memory = KeptMemory(self.module.parameters()) if self.record_memory else None
        base = int(torch.randint(0, 2**62, (1,)).item()) if self.random else None
        self.timeline.reset()
        if self.averager:
            self.averager.armed = False  # armed only during the last backward
        discard_batch_norms()
        losses: dict[int, torch.Tensor] = {}
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        actions = get_schedule(schedule)(chunks, k)[stage]
        last_backward = max(i for i, a in enumerate(actions) if a.kind != "F")
        for i, action in enumerate(actions):
            mb = action.microbatch
            if i == 0:
                comm.prefetch_forward(stage, mb, self.device)
            if i + 1 < len(actions):  # post the next action's receives: they overlap this one
                upcoming = actions[i + 1]
                if upcoming.kind == "F":
                    comm.prefetch_forward(stage, upcoming.microbatch, self.device)
                else:  # posts nothing yet if that micro-batch's forward is this action
                    comm.prefetch_backward(stage, upcoming.microbatch)
            try:
                if action.kind == "F":
                    view = MicrobatchComm(comm, stage, mb, remat_enabled(remat, mb, chunks),
                                          self.device)
                    args = [micro[mb][i].to(self.device) for i in self.inputs]
                    with self.timeline.span("forward", stage, mb), \
                            seeded_forward(base, stage, mb, self.device), \
                            (memory.forward(mb) if memory else _nothing()):
                        out = self.module(view, *args)
                        if self.check_finite:
                            check_finite(stage, mb, view.sent, out if self.is_last else None,
                                         view.received, args, self.graph)
                        if self.is_last:
                            # equal micro-batches: weight 1/M makes the sum the batch mean
                            loss = self._loss(out, targets[mb], loss_fn) / chunks
                            losses[mb] = loss
                            total += loss.detach().double()
                else:
                    if self.averager and i == last_backward:
                        self.averager.arm()
                    with self.timeline.span("backward", stage, mb):
                        comm.backward(stage, mb, losses.pop(mb, None))
                    if memory:
                        memory.release(mb)
            except PipelineRuntimeError:
                raise
            except Exception as e:
                raise PipelineRuntimeError(
                    f"stage {stage} (rank {self.mesh.rank}) failed in {action.kind}{mb}: "
                    f"{type(e).__name__}: {e}", hint="the other ranks stop when this one exits") from e
        comm.finish()
        commit_batch_norms()  # deferred BatchNorm: running statistics of the whole batch
        try:
            with self.timeline.span("reduce", stage, -1):
                self._reduce_gradients()
            dist.broadcast(total, src=self.mesh.rank_of(k - 1), group=self.pp_group)
        except RuntimeError as e:
            raise PeerLostError(f"stage {stage} (rank {self.mesh.rank}): a collective with the "
                                f"other ranks failed: {str(e).splitlines()[0]}",
                                hint="another rank failed or exited; its error says why") from e
        return StepResult(float(total.item()), list(self.timeline.events),
                          memory.peak if memory else 0)

    def _loss(self, out: Any, target: Any, loss_fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        structured = self.signature.unflatten_outputs(list(out))
        return loss_fn(structured, target) if target is not None else loss_fn(structured)

    def _reduce_gradients(self) -> None:
        """Sums tied parameters' gradients over the stages that hold them, then averages every
        gradient over data-parallel replicas."""
        named = self.module.named_model_tensors()
        for name, stages in sorted(self.shared.items()):
            group = self.shared_groups.get(name)
            param = named.get(name)
            if group is None or param is None:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=group)
        if self.dp_group is None or self.mesh.replicas == 1:
            return
        tied = set()
        if self.averager is not None:
            self.averager.finish()
            tied = {id(t) for name, t in named.items() if name in self.shared}
        for param in self.module.parameters():
            if self.averager is None or id(param) in tied:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, group=self.dp_group)
                param.grad /= self.mesh.replicas


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def stage_info(recvs: Sequence[ir.CommInfo], sends: Sequence[ir.CommInfo], stage: int) -> dict:
    """(tag, src, dst) -> value info for this stage's messages."""
    info = {(c.tag, c.peer, stage): c.value for c in recvs}
    info.update({(c.tag, stage, c.peer): c.value for c in sends})
    return info

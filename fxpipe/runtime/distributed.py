"""The distributed executor: one process per stage, torch.distributed point-to-point.

Every rank calls `step(inputs, target)` with the whole batch; each runs its own stage's actions
in schedule order (GPipe: all forwards, then all backwards; 1F1B interleaves them; ZB-H1 splits
each backward into its input and weight gradients, NOTE [Split backward] in comm.py), exchanging
activations and gradients with its peers (fxpipe.runtime.comm.DistComm). The actions run on the
ticks of a clock all ranks share (fxpipe.runtime.plan), and each tick's sends and receives are
posted together, in one agreed order, so no schedule can deadlock under NCCL. Micro-batch losses
are weighted by their share of the batch, so the accumulated gradients equal those of one
full-batch mean loss. Parameters that several stages hold (tied weights) have their gradients
summed across those stages; with data parallelism, gradients are then averaged across replicas.

Mixed precision: the caller's `torch.autocast` applies to the stage (it runs in the caller's
thread), values cross stages in the dtype they have, and a GradScaler passed to `step` scales
the backward, with all ranks agreeing on skipping a step (fxpipe.runtime.amp).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fxpipe import ir
from fxpipe.errors import PeerLostError, PipelineRuntimeError, RuntimeInputError
from fxpipe.runtime.amp import AutocastState, agree_on_overflow, loss_scale
from fxpipe.runtime.batchnorm import commit_batch_norms, discard_batch_norms
from fxpipe.runtime.comm import DistComm, MicrobatchComm, TagTable, messages_of
from fxpipe.runtime.devices import make_timeline, pin_for, stage_devices, to_device
from fxpipe.runtime.finite import check_finite
from fxpipe.runtime.local import remat_enabled, seeded_forward
from fxpipe.runtime.memory import KeptMemory
from fxpipe.runtime.overlap import ReplicaAverager
from fxpipe.runtime.plan import Tick, plan_rank
from fxpipe.runtime.schedule import get_schedule
from fxpipe.runtime.stage import StageModule
from fxpipe.runtime.strict import make_transport
from fxpipe.runtime.timeline import Event
from fxpipe.runtime.transport import Transport
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
    events: list[Event] = field(default_factory=list)
    kept_bytes: int = 0  # peak activation bytes held for backward on this rank
    sends_held: int = 0  # most sent tensors held at once, waiting for their sends to complete
    overflow: bool = False  # with a scaler: some rank's gradients were not finite (all skip)


def split_target(target: torch.Tensor | None, chunks: int, batch_dim: int,
                 batch: int) -> list[torch.Tensor | None]:
    if target is None:
        return [None] * chunks
    if target.dim() <= batch_dim or target.shape[batch_dim] != batch:
        raise RuntimeInputError(
            f"target shape {tuple(target.shape)} has no batch dimension {batch_dim} of size "
            f"{batch}",
            hint="give the target the same batch size as the inputs, along the batch dimension "
                 "of the model's first output")
    return list(target.tensor_split(chunks, dim=batch_dim))


class DistributedExecutor:
    """Runs one stage of the program on this rank."""

    def __init__(self, *, module: StageModule, mesh: Mesh, signature: Signature,
                 input_indexes: Sequence[int], comm_info: dict[tuple[str, int, int], Any],
                 edges: Sequence[tuple[str, int, int]], random: bool, device: torch.device,
                 pp_group: Any = None, shared: dict[str, list[int]] | None = None,
                 shared_groups: dict[str, Any] | None = None,
                 dp_group: Any = None, check_finite: bool = False, graph: Any = None,
                 dp_bucket_bytes: int = DEFAULT_DP_BUCKET_BYTES, p2p: str | None = None) -> None:
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
        self.timeline = make_timeline(device)
        self.record_memory = False
        # point-to-point: "batched" (batch_isend_irecv) or "strict" (NCCL's rules on gloo);
        # None reads FXPIPE_P2P (fxpipe/runtime/transport.py)
        self.transport: Transport = make_transport(p2p, pp_group)
        self.plans: dict[tuple[str, int], list[Tick]] = {}
        # dtypes of received values under each autocast state, learned on its first step
        self.boundary_dtypes: dict[Any, dict[tuple[str, int, int, int], torch.dtype]] = {}
        self.warm = False
        self.last: StepResult | None = None  # the latest step's result
        # Replica averaging of untied gradients overlaps the last backward (0: after it).
        # Tied parameters wait for their sum over stages, which needs every stage's backward.
        self.averager = None
        if dp_group is not None and mesh.replicas > 1 and dp_bucket_bytes > 0:
            tied = {id(t) for name, t in module.named_model_tensors().items()
                    if name in self.shared}
            self.averager = ReplicaAverager((p for p in module.parameters() if id(p) not in tied),
                                            dp_group, mesh.replicas, dp_bucket_bytes)

    @property
    def is_last(self) -> bool:
        return self.mesh.stage == self.mesh.stages - 1

    def step(self, tensors: Sequence[torch.Tensor], target: torch.Tensor | None,
             loss_fn: Callable[..., torch.Tensor], *, chunks: int, remat: str,
             schedule: str = "gpipe", scaler: Any = None) -> StepResult:
        """One training step of this rank's stage: forwards and backwards of every micro-batch.

        scaler: a torch.amp.GradScaler; the backward runs on the scaled loss (the returned loss
        is not scaled) and all ranks agree on skipping the step (NOTE [Loss scaling across
        ranks] in fxpipe/runtime/amp.py).
        """
        stage, k = self.mesh.stage, self.mesh.stages
        tensors = list(tensors)
        for i, t in zip(self.inputs, pin_for([tensors[i] for i in self.inputs], self.device)):
            tensors[i] = t  # the inputs this stage reads, pinned once for async copies
        batch = self.signature.batch_size(tensors)
        micro = self.signature.split_inputs(tensors, chunks)
        out_dim = next((d for d in self.signature.out_batch_dims if d is not None), 0)
        targets = split_target(target, chunks, out_dim, batch)
        if self.is_last and target is not None:
            targets = pin_for(targets, self.device)
        self._warm_up()
        comm = self._comm(batch // chunks, chunks)
        ticks = self._plan(schedule, chunks)
        memory = KeptMemory(self.module.parameters()) if self.record_memory else None
        base = int(torch.randint(0, 2**62, (1,)).item()) if self.random else None
        devices = stage_devices(self.device, [*self.module.parameters(), *self.module.buffers()])
        scale = loss_scale(scaler, self.device)
        self.timeline.reset()
        if self.averager:
            self.averager.armed = False  # armed only during the last backward
        discard_batch_norms()
        losses: dict[int, torch.Tensor] = {}
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        # the last action that accumulates gradients (B, or W of a split backward)
        last_backward = max(t.index for t in ticks
                            if t.action is not None and t.action.kind in ("B", "W"))
        weights = [p for p in self.module.parameters() if p.requires_grad]
        for tick in ticks:
            comm.begin_tick(tick)
            action = tick.action
            if action is None:
                continue
            mb = action.microbatch
            try:
                if action.kind == "F":
                    view = MicrobatchComm(comm, stage, mb, remat_enabled(remat, mb, chunks),
                                          self.device)
                    args = [to_device(micro[mb][i], self.device) for i in self.inputs]
                    with self.timeline.span("forward", stage, mb), \
                            seeded_forward(base, mb, devices), \
                            (memory.forward(mb) if memory else _nothing()):
                        out = self.module(view, *args)
                        if self.check_finite:
                            check_finite(stage, mb, view.sent, out if self.is_last else None,
                                         view.received, args, self.graph)
                        if self.is_last:
                            # equal micro-batches: weight 1/M makes the sum the batch mean
                            loss = self._loss(out, to_device(targets[mb], self.device),
                                              loss_fn) / chunks
                            losses[mb] = loss if scale is None else loss * scale
                            total += loss.detach().double()
                elif action.kind == "I":
                    with self.timeline.span("backward", stage, mb, detail="I"):
                        comm.backward_input(stage, mb, losses.pop(mb, None))
                else:
                    if self.averager and tick.index == last_backward:
                        self.averager.arm()
                    detail = "W" if action.kind == "W" else ""
                    with self.timeline.span("backward", stage, mb, detail=detail):
                        if action.kind == "W":
                            comm.backward_weight(stage, mb, weights)
                        else:
                            comm.backward(stage, mb, losses.pop(mb, None))
                    if memory:
                        memory.release(mb)
            except PipelineRuntimeError:
                raise
            except Exception as e:
                raise PipelineRuntimeError(
                    f"stage {stage} (rank {self.mesh.rank}) failed in {action.kind}{mb}: "
                    f"{type(e).__name__}: {e}",
                    hint="the other ranks stop when this one exits") from e
        comm.finish()
        self._learned(comm)
        commit_batch_norms()  # deferred BatchNorm: running statistics of the whole batch
        overflow = False
        try:
            with self.timeline.span("reduce", stage, -1):
                self._reduce_gradients()
            dist.broadcast(total, src=self.mesh.rank_of(k - 1), group=self.pp_group)
            if scale is not None:
                overflow = agree_on_overflow(self.module.parameters(), self.device)
        except RuntimeError as e:
            raise PeerLostError(f"stage {stage} (rank {self.mesh.rank}): a collective with the "
                                f"other ranks failed: {str(e).splitlines()[0]}",
                                hint="another rank failed or exited; its error says why") from e
        sends_held = self.transport.peak
        self.transport.reset_peak()
        self.last = StepResult(float(total.item()), self.timeline.resolve(),
                               memory.peak if memory else 0, sends_held, overflow)
        return self.last

    def _warm_up(self) -> None:
        """A collective on the pipeline group before its first batched point-to-point: NCCL
        requires every rank of a group in the group's first batch_isend_irecv."""
        if self.warm:
            return
        self.warm = True
        if dist.get_backend(self.pp_group) == "nccl":
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.pp_group)

    def _plan(self, schedule: str, chunks: int) -> list[Tick]:
        """This rank's ticks (fxpipe.runtime.plan): the same clock on every rank."""
        key = (schedule, chunks)
        if key not in self.plans:
            k = self.mesh.stages
            actions_by_rank = get_schedule(schedule)(chunks, k)  # stage s on pipeline rank s
            edges = {(src, dst) for _, src, dst in self.edges}
            messages = messages_of(self.comm_info, chunks, list(range(k)))
            self.plans[key] = plan_rank(self.mesh.stage, actions_by_rank, edges, messages)
        return self.plans[key]

    def _comm(self, b: int, chunks: int) -> DistComm:
        """The step's communication. Under autocast, boundary dtypes are learned on the first
        step for each autocast dtype and micro-batch size (every rank runs the same step)."""
        autocast = AutocastState.capture().dtype(self.device.type)
        known = self.boundary_dtypes.get((autocast, b)) if autocast is not None else {}
        return DistComm(rank=self.mesh.stage,
                        global_ranks=[self.mesh.rank_of(s) for s in range(self.mesh.stages)],
                        placement=list(range(self.mesh.stages)), info=self.comm_info,
                        microbatch_size=b, device=self.device, transport=self.transport,
                        tags=TagTable(self.edges, chunks), dtypes=dict(known or {}),
                        learn=known is None, timeline=self.timeline)

    def _learned(self, comm: DistComm) -> None:
        if comm.learn:
            autocast = AutocastState.capture().dtype(self.device.type)
            self.boundary_dtypes[(autocast, comm.b)] = comm.dtypes

    def _loss(self, out: Any, target: Any, loss_fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        structured = self.signature.unflatten_outputs(list(out))
        return loss_fn(structured, target) if target is not None else loss_fn(structured)

    def _reduce_gradients(self) -> None:
        """Sums tied parameters' gradients over the stages that hold them, then averages every
        gradient over data-parallel replicas."""
        named = self.module.named_model_tensors()
        for name in sorted(self.shared):
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


def stage_info(recvs: Sequence[ir.CommInfo], sends: Sequence[ir.CommInfo],
               stage: int) -> dict[tuple[str, int, int], ir.ValueInfo]:
    """(tag, src, dst) -> value info for this stage's messages."""
    info = {(c.tag, c.peer, stage): c.value for c in recvs}
    info.update({(c.tag, stage, c.peer): c.value for c in sends})
    return info

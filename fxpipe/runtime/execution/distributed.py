"""The distributed executor: one process per pipeline rank, torch.distributed point-to-point.

Every rank calls `step(inputs, target)` with the whole batch; each runs its own stages' actions
(one stage, or several under a looped schedule) in schedule order (GPipe: all forwards, then all
backwards; 1F1B interleaves them; ZB-H1 and ZB-V split each backward into its input and weight
gradients, DualPipeV those at the step's ends, NOTE [Split backward] in dist_comm.py), exchanging
activations and gradients with its peers (fxpipe.runtime.communication.dist_comm.DistComm). The
actions run on the ticks of a clock all ranks share (fxpipe.runtime.planning.plan), and each tick's
sends and receives are posted together, in one agreed order, so no schedule can deadlock under NCCL.
Each micro-batch's loss starts its backward weighted as a mean or a sum over examples, whichever the
loss of the joined outputs shows it is (fxpipe.runtime.execution.loss_judge), so the accumulated
gradients equal those of the loss on the whole batch; a loss that is neither, or that data-parallel
replicas find of different kinds, is refused. Parameters that several stages hold (tied weights)
have their gradients summed across the ranks that hold them (stages of one rank share the Parameter
itself); with data parallelism, gradients are then averaged across replicas (under
shard="full" by FSDP2's reduce-scatter after the step's last backward,
fxpipe.runtime.execution.fsdp).

Mixed precision: the caller's `torch.autocast` applies to the stage (it runs in the caller's
thread), values cross stages in the dtype they have, and a GradScaler passed to `step` scales
the backward, with all ranks agreeing on skipping a step (fxpipe.runtime.execution.amp).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.errors import ConfigError, LossError, PeerLostError, PipelineRuntimeError
from fxpipe.remat_policy import RematPolicy, remat_policy
from fxpipe.runtime.communication.dist_comm import DistComm
from fxpipe.runtime.communication.mesh import Mesh
from fxpipe.runtime.communication.overlap import ReplicaAverager, average_present, sum_present
from fxpipe.runtime.communication.receive_buffers import ReceiveBuffers
from fxpipe.runtime.communication.strict import make_transport
from fxpipe.runtime.communication.tags import TagTable, messages_of
from fxpipe.runtime.communication.transport import Transport
from fxpipe.runtime.execution.amp import AutocastState, agree_on_overflow, loss_scale
from fxpipe.runtime.execution.batchnorm import (
    RUNNING_STATISTICS,
    average_statistics,
    commit_batch_norms,
    discard_batch_norms,
    too_few_values_hint,
)
from fxpipe.runtime.execution.devices import (
    make_timeline,
    pin_for,
    pinned_to,
    stage_devices,
    to_device,
)
from fxpipe.runtime.execution.evaluate import evaluate_rank
from fxpipe.runtime.execution.forward import run_forward
from fxpipe.runtime.execution.fsdp import FullShard
from fxpipe.runtime.execution.loss_judge import LossJudge, check_reads_held
from fxpipe.runtime.execution.loss_split import (
    KINDS,
    MEAN,
    SUM,
    WeightedLoss,
    known_kind,
    loss_key,
    weight_of,
)
from fxpipe.runtime.execution.memory import KeptMemory
from fxpipe.runtime.execution.split_backward import SplitPlans
from fxpipe.runtime.execution.stagespec import HeldStage
from fxpipe.runtime.planning.plan import Message, Tick, plan_rank, replies
from fxpipe.runtime.planning.schedule import ActionKind, ScheduleKind, schedule_kind, stage_ranks
from fxpipe.runtime.planning.timeline import Event
from fxpipe.runtime.program.arguments import DEFAULT_DP_BUCKET_BYTES
from fxpipe.signature import Signature
from fxpipe.targets import Target, map_target, split_target
from fxpipe.untouched import untouched

__all__ = ["DEFAULT_DP_BUCKET_BYTES", "DistributedExecutor"]


@dataclass
class StepResult:
    loss: float
    events: Sequence[Event] = ()  # on CUDA, read from the device when first looked at
    kept_bytes: int = 0  # peak activation bytes held for backward on this rank
    sends_held: int = 0  # most sent tensors held at once, waiting for their sends to complete
    overflow: bool = False  # with a scaler: some rank's gradients were not finite (all skip)


class DistributedExecutor:
    """Runs this rank's stages of the program (one, or several under a looped schedule)."""

    def __init__(self, *, units: Sequence[HeldStage], mesh: Mesh, signature: Signature,
                 edges: Sequence[tuple[str, int, int]], device: torch.device,
                 pp_group: Any = None, shared: dict[str, list[int]] | None = None,
                 shared_groups: dict[str, Any] | None = None,
                 dp_group: Any = None, check_finite: bool = False,
                 dp_bucket_bytes: int = DEFAULT_DP_BUCKET_BYTES, p2p: str | None = None,
                 full_shard: FullShard | None = None) -> None:
        self.units = {u.index: u for u in units}
        self.mesh = mesh
        self.signature = signature
        self.comm_info = {k: v for u in units for k, v in u.spec.messages.items()}
        self.written = frozenset().union(*(u.spec.written_recvs for u in units))
        self.edges = list(edges)  # every (tag, src, dst) of the program: the same tags on all ranks
        self.random = any(u.random for u in units)
        self.device = device
        self.pp_group = pp_group
        self.dp_group = dp_group
        self.shared = shared or {}
        self.shared_groups = shared_groups or {}
        self.check_finite = check_finite
        # shard="full": FSDP2 holds the stages' parameters and averages their gradients
        self.full_shard = full_shard
        self.timeline = make_timeline(device)
        self.receive_buffers = ReceiveBuffers()  # kept across steps
        self.record_memory = False
        # point-to-point: "batched" (batch_isend_irecv) or "strict" (NCCL's rules on gloo);
        # None reads FXPIPE_P2P (fxpipe/runtime/communication/transport.py)
        self.transport: Transport = make_transport(p2p, pp_group)
        # where each tied parameter summed over ranks sits: (its module's _parameters, name)
        summed = {name for name in self.shared if name in self.shared_groups}
        self.tied_slots = [(u.module._parameters, attr) for u in units
                           for attr, name in u.module.qualified_names().items()
                           if name in summed]
        # BatchNorm running statistics, which replicas average after a step: (buffers, name)
        self.statistic_slots = [(u.module._buffers, attr) for u in units
                                for attr, name in u.module.BUFFERS.items()
                                if name.rsplit(".", 1)[-1] in RUNNING_STATISTICS]
        self.plans: dict[tuple[ScheduleKind, int, bool], list[Tick]] = {}
        self.forward_plans: dict[tuple[ScheduleKind, int], list[Tick]] = {}  # evaluate()'s
        # (schedule, chunks) -> each send's reply (fxpipe.runtime.planning.plan.replies), and
        # the set of those replies (DistComm.proofs)
        self.replies: dict[tuple[ScheduleKind, int],
                           tuple[dict[Message, Message], frozenset[Message]]] = {}
        # dtypes of received values under each autocast state, learned on its first step
        self.boundary_dtypes: dict[Any, dict[tuple[str, int, int, int], torch.dtype]] = {}
        # per loss function (its key), the values it does not reach, learned on its first step
        # (NOTE [Absent gradients] in fxpipe/runtime/communication/dist_comm.py)
        self.absent_gradients: dict[Any, set[tuple[str, int, int, int]]] = {}
        # the model's parameters this rank does not hold, by id, with their names (set by the
        # program that holds the model): a loss reading one is refused (check_reads_held)
        self.foreign: dict[int, str] = {}
        self.split_plans: dict[int, SplitPlans] = {}  # read once per stage (split_backward.py)
        # each message's tag and text, per number of micro-batches (the tags depend on it)
        self.message_labels: dict[int, dict[Message, tuple[int, str]]] = {}
        self.warm = False
        self.hooks_told = False  # whether a gradient hook's warning was given (_tell_hooks)
        self.last: StepResult | None = None  # the latest step's result
        # how each loss splits over micro-batches (its kinds, found on a step that only finds
        # it for a schedule whose last stage starts a backward before every forward is done)
        self.loss_judge = LossJudge(signature, device, mesh, dp_group)
        self.loss_first: dict[tuple[ScheduleKind, int], bool] = {}
        # Replica averaging of untied gradients overlaps the last backward (0: after it).
        # Tied parameters wait for their sum over stages, which needs every stage's backward.
        self.averager = None
        if dp_group is not None and mesh.replicas > 1 and dp_bucket_bytes > 0 and \
                full_shard is None:
            tied = {id(t) for name, t in self.named_tensors().items() if name in self.shared}
            self.averager = ReplicaAverager((p for p in self.parameters() if id(p) not in tied),
                                            dp_group, mesh.replicas, dp_bucket_bytes)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once (stages of one rank share a tied one)."""
        return list({id(p): p for u in self.units.values() for p in u.module.parameters()}
                    .values())

    def buffers(self) -> list[torch.Tensor]:
        """This rank's buffers, each once."""
        return list({id(b): b for u in self.units.values() for b in u.module.buffers()}
                    .values())

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers by the model's qualified names."""
        out: dict[str, torch.Tensor] = {}
        for u in self.units.values():
            for name, tensor in u.module.named_model_tensors().items():
                out.setdefault(name, tensor)
        return out

    def step(self, tensors: Sequence[torch.Tensor], target: Target,
             loss_fn: Callable[..., torch.Tensor], *, chunks: int, remat: RematPolicy | str,
             schedule: ScheduleKind | str = "gpipe", scaler: Any = None) -> StepResult:
        """One training step of this rank's stages: forwards and backwards of every micro-batch.

        scaler: a torch.amp.GradScaler; the backward runs on the scaled loss (the returned loss
        is not scaled) and all ranks agree on skipping the step (NOTE [Loss scaling across
        ranks] in fxpipe/runtime/execution/amp.py).

        The loss is computed per micro-batch and once on the joined outputs (a loss fxpipe
        defines: its micro-batches' weighted by what each counts, fxpipe.losses.counted): the
        step returns the latter, and weights each micro-batch's backward as the comparison shows
        (NOTE in fxpipe.runtime.execution.loss_split). Raises LossError on every rank for a loss
        that is neither a mean nor a sum over examples, or whose kind the replicas cannot find
        or agree on.
        """
        key = loss_key(loss_fn, target is not None)
        kind = schedule_kind(schedule)
        batch = self.signature.batch_size(tensors)
        micro = self.signature.microbatches(batch, chunks)  # an uneven last batch's
        run = dict(batch=batch, chunks=micro, compiled=chunks, remat=remat_policy(remat),
                   schedule=kind, scaler=scaler)
        earlier = self._take_tied_gradients()
        try:
            if self._loss_first(kind, micro):  # judged on each step before its backward
                return self._step(tensors, target, loss_fn, key, None, **run)
            if key not in self.loss_judge.kinds:  # a step that only judges the loss, then it
                with untouched(self.parameters(), self.buffers()):
                    self._step(tensors, target, loss_fn, key, None, probe=True, **run)
            return self._step(tensors, target, loss_fn, key, self.loss_judge.kinds[key], **run)
        finally:
            for param, grad in earlier:
                param.grad = grad if param.grad is None else param.grad.add_(grad)

    def evaluate(self, tensors: Sequence[torch.Tensor], target: Target,
                 loss_fn: Callable[..., torch.Tensor], *, chunks: int,
                 schedule: ScheduleKind | str = "gpipe") -> float:
        """The loss of the batch without training (fxpipe.runtime.execution.evaluate): the
        forwards of the schedule without gradients; every rank returns the last stage's."""
        self._warm_up()
        batch = self.signature.batch_size(list(tensors))
        chunks = self.signature.microbatches(batch, chunks)
        comm = self._comm(batch // chunks, chunks)
        loss = evaluate_rank(self, comm, tensors, target, loss_fn, chunks=chunks,
                             schedule=schedule_kind(schedule))
        self._learned(comm)
        return loss

    def _tell_hooks(self, params: dict[int, list[nn.Parameter]]) -> None:
        """Warns, once, of a gradient hook on a parameter (Tensor.register_hook, or
        register_post_accumulate_grad_hook beside the replica averager's own): each
        micro-batch's backward is an autograd call of its own, so the hook runs once per
        micro-batch, where the plain model (and one process, which runs one backward) runs it
        once per step. A loop of attribute reads each step, no call, while no hook is found
        (and the averager puts none)."""
        own = self.averager.hook_ids if self.averager is not None else frozenset()
        for held in params.values():
            for param in held:
                after = param._post_accumulate_grad_hooks
                if param._backward_hooks:
                    kind = ("a gradient hook (Tensor.register_hook)", "on that micro-batch's "
                            "part of the gradient, not once on the batch's gradient")
                elif after and not own.issuperset(after):
                    kind = ("a hook after its gradient accumulates "
                            "(register_post_accumulate_grad_hook)", "after that micro-batch's "
                            "part of the gradient is added, not once after the batch's")
                else:
                    continue
                self.hooks_told = True
                name = next(n for n, t in self.named_tensors().items() if t is param)
                warnings.warn(
                    f"parameter {name!r} has {kind[0]}: under torchrun it runs once per "
                    f"micro-batch, {kind[1]} as in the plain model; a hook that is not linear "
                    "in the gradient (a clamp, a norm it records) or that acts on the "
                    "parameter (an optimizer step in backward) does otherwise. Do that on "
                    "p.grad after program.step(...) instead", UserWarning,
                    stacklevel=6)  # program.step's caller
                return

    def _take_tied_gradients(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The gradients that tied parameters hold from earlier steps (accumulating over
        steps), taken off them until the step ends: the step sums a tied weight's gradient over
        the ranks that hold it, and each holder already has the earlier steps' sum, which a
        second sum would count once per holder. The parameters are looked up where their
        modules hold them now (a load may replace them), in a few dictionary reads a step."""
        taken: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for slots, attr in self.tied_slots:
            param = slots.get(attr)
            if param is not None and param.grad is not None and id(param) not in taken:
                taken[id(param)] = (param, param.grad)
                param.grad = None
        return list(taken.values())

    def _loss_first(self, schedule: ScheduleKind, chunks: int) -> bool:
        """Whether the last stage runs every forward before its first backward (GPipe), so it
        knows the batch's loss before any backward."""
        if (schedule, chunks) not in self.loss_first:
            last = self.mesh.stages - 1
            actions = schedule.build(chunks, self.mesh.stages, self.mesh.ranks)
            kinds = [a.kind for a in actions[self.mesh.placement[last]] if a.stage == last]
            backward = next((i for i, k in enumerate(kinds) if k != ActionKind.FORWARD),
                            len(kinds))
            self.loss_first[(schedule, chunks)] = ActionKind.FORWARD not in kinds[backward:]
        return self.loss_first[(schedule, chunks)]

    def _step(self, tensors: Sequence[torch.Tensor], target: Target,
              loss_fn: Callable[..., torch.Tensor], key: Any, assumed: str | None, *,
              batch: int, chunks: int, compiled: int, remat: RematPolicy,
              schedule: ScheduleKind, scaler: Any, probe: bool = False) -> StepResult:
        """The step, its backward weighted as `assumed` (None: as the last stage finds before
        its first backward; `probe`: by 0, only to find the kind, recorded in loss_kinds).
        `chunks`: the batch's micro-batches (an uneven last batch's), `compiled`: the
        program's."""
        tensors = list(tensors)
        read = sorted({i for u in self.units.values() for i in u.inputs})
        for i, t in zip(read, pin_for([tensors[i] for i in read], self.device)):
            tensors[i] = t  # the inputs these stages read, pinned once for async copies
        micro = self.signature.split_inputs(tensors, chunks)
        targets = split_target(target, chunks, self.signature.target_batch_dim, batch)
        last_stage = self.mesh.stages - 1
        if last_stage in self.units and target is not None:
            targets = pin_for(targets, self.device) if isinstance(target, torch.Tensor) else \
                [map_target(lambda t: pinned_to(t, self.device), part) for part in targets]
            # (a structured one on the device here: to_device leaves structures as they are)
        self._warm_up()
        comm = self._comm(batch // chunks, chunks, key)
        # a step that learns dtypes waits for each header at its tick: every message in its
        # tick's batch on both ends
        ticks = self._plan(schedule, chunks, early=self.transport.by_tag and not comm.learn)
        comm.replies, comm.proofs = self.replies[(schedule, chunks)]
        memory = KeptMemory(self.parameters()) if self.record_memory else None
        base = int(torch.randint(0, 2**62, (1,)).item()) if self.random else None
        params = {s: list(u.module.parameters()) for s, u in self.units.items()}  # walked once
        if chunks > 1 and not self.hooks_told:
            self._tell_hooks(params)
        devices = {s: stage_devices(self.device, [*params[s], *u.module.buffers()])
                   for s, u in self.units.items()}
        scale = loss_scale(scaler, self.device)
        self.timeline.reset()
        if self.averager:
            self.averager.armed = False  # armed only during the last backward
        if self.full_shard is not None:
            self._refuse_split_backward(ticks)
            self.full_shard.accumulate()
        discard_batch_norms()
        losses: dict[int, torch.Tensor] = {}
        outputs: dict[int, list[Any]] = {}  # the last stage's, detached: the batch's loss
        values: dict[int, torch.Tensor] = {}  # each micro-batch's loss, detached
        replicas = self.mesh.replicas
        weight = 0.0 if probe else None if assumed is None else \
            weight_of(assumed, chunks, replicas)
        # one micro-batch per replica: its halves show the kind (one replica takes any loss)
        halves = chunks == 1 and replicas > 1
        known = known_kind(loss_fn) or self.loss_judge.kinds.get(key)
        judged: tuple[float, list[float], str | None, list[int]] | None = None

        def judge() -> tuple[float, list[float], str | None, list[int]]:
            return self.loss_judge.judge(outputs, values, target, targets, loss_fn, halves,
                                         known)
        # the last stage's outputs are kept until the judge runs the loss on them joined
        joins = not self.loss_judge.weighs_parts(loss_fn, halves)

        def decided() -> float:
            """The weight of the last stage's losses, judged on this step before its first
            backward unless given."""
            nonlocal judged, weight
            if weight is None:  # every forward of the last stage is done (_loss_first)
                judged = judge()
                kind = judged[2] or self.loss_judge.kinds.get(key, MEAN)
                weight = weight_of(kind, chunks, replicas)
            return weight
        # the last action that accumulates gradients (B, or W of a split backward)
        last_backward = max(t.index for t in ticks
                            if t.action is not None and t.action.kind.accumulates_weight_grad)
        weights = {s: [p for p in params[s] if p.requires_grad] for s in self.units}
        final = self.mesh.stages - 1  # the last stage
        for tick in ticks:
            comm.begin_tick(tick)
            action = tick.action
            if action is None:
                continue
            stage, mb = action.stage, action.microbatch
            unit = self.units[stage]
            try:
                if action.kind == ActionKind.FORWARD:
                    last = stage == final

                    def keep(out: Any, mb: int = mb) -> None:  # the last stage's loss
                        losses[mb] = self.loss_judge.loss(out, to_device(targets[mb], self.device),
                                                loss_fn)
                        if comm.learn_gradients and self.foreign and not values:
                            check_reads_held(losses[mb], self.foreign, final)
                        values[mb] = losses[mb].detach()
                        if joins:
                            outputs[mb] = [o.detach() if isinstance(o, torch.Tensor) else o
                                           for o in out]
                    run_forward(unit, comm, mb, micro[mb], recompute=remat.recomputes(mb, chunks),
                                seed_base=base, rng_devices=devices[stage],
                                check=self.check_finite, check_outputs=last,
                                modes=self.timeline.span("forward", stage, mb),
                                track=memory.forward((stage, mb)) if memory else None,
                                then=keep if last else None)  # the comm keeps what backward needs
                elif action.kind == ActionKind.INPUT_GRAD:
                    with self.timeline.span("backward", stage, mb, detail=action.kind):
                        held = comm.backward_input(
                            stage, mb, self._weighted(losses, mb, decided(), scale)
                            if stage == final else None, weights[stage],
                            release=not remat.recomputes(mb, chunks))
                    if memory and held is not None:  # I freed what W does not read
                        memory.keep_only((stage, mb), held)
                else:
                    if self.averager and tick.index == last_backward:
                        self.averager.arm()
                    split = action.kind == ActionKind.WEIGHT_GRAD
                    with self.timeline.span("backward", stage, mb,
                                            detail=action.kind if split else ""):
                        if split:
                            comm.backward_weight(stage, mb, weights[stage])
                        else:
                            comm.backward(stage, mb, self._weighted(losses, mb, decided(), scale)
                                          if stage == final else None)
                    if memory:
                        memory.release((stage, mb))
            except (PipelineRuntimeError, LossError):
                raise
            except Exception as e:
                how, uneven = self.signature.split_text(batch, chunks, compiled)
                raise PipelineRuntimeError(
                    f"stage {stage} (rank {self.mesh.rank}) failed in {action.kind}{mb} "
                    f"({how}): {type(e).__name__}: {e}",
                    hint="; ".join(h for h in (too_few_values_hint(e, batch // chunks),
                                               uneven) if h)
                    or "the other ranks stop when this one exits") from e
        comm.finish()
        self._learned(comm, key)
        # what the last stage found of the loss: [loss, kind, replicas finding each kind...,
        # its parts' losses...]
        # (read on the host once per step: by the judge on the last stage, from the broadcast
        # on the others)
        width = len(KINDS) + 1
        size = 2 + width + (2 if halves else chunks)
        numbers: list[float] | None = None
        if last_stage in self.units:
            if judged is None:
                judged = judge()
            numbers = [judged[0], KINDS.index(judged[2]) if judged[2] is not None else -1,
                       *judged[3], *judged[1]]
            numbers += [0.0] * (size - len(numbers))
            verdict = to_device(pin_for([torch.tensor(numbers, dtype=torch.float64)],
                                        self.device)[0], self.device)
        else:
            verdict = torch.zeros(size, dtype=torch.float64, device=self.device)
        overflow = False
        first = min(self.units)
        try:
            with self.timeline.span("reduce", first, -1):
                self._settle_statistics()
                if self.full_shard is not None:
                    self.full_shard.reduce()
                self._reduce_gradients()
            dist.broadcast(verdict, src=self.mesh.rank_of(last_stage), group=self.pp_group)
            if scale is not None:
                overflow = agree_on_overflow(self.parameters(), self.device)
        except RuntimeError as e:
            raise PeerLostError(f"stage {first} (rank {self.mesh.rank}): a collective with the "
                                f"other ranks failed: {str(e).splitlines()[0]}",
                                hint="another rank failed or exited; its error says why") from e
        if numbers is None:
            numbers = verdict.tolist()
        used = self.loss_judge.settle(numbers, loss_fn, key, assumed, probe, halves)
        sends_held = self.transport.peak
        self.transport.reset_peak()
        # the replicas' losses are averaged (fxpipe.runtime.communication.mesh): a sum's is their
        # sum
        self.last = StepResult(numbers[0] * (replicas if used == SUM else 1),
                               self.timeline.take(),
                               memory.peak if memory else 0, sends_held, overflow)
        return self.last

    def _warm_up(self) -> None:
        """A collective on the pipeline group before its first batched point-to-point: NCCL
        requires every rank of a group in the group's first batch_isend_irecv."""
        if self.warm:
            return
        self.warm = True
        if self.device.type == "cuda":
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.pp_group)

    def _plan(self, schedule: ScheduleKind, chunks: int, early: bool) -> list[Tick]:
        """This rank's ticks (fxpipe.runtime.planning.plan): the same clock on every rank; `early`
        posts receives some actions before their consumer (NOTE [Early receives] there)."""
        key = (schedule, chunks, early)
        if key not in self.plans:
            mesh = self.mesh
            actions_by_rank = schedule.build(chunks, mesh.stages, mesh.ranks)
            if stage_ranks(actions_by_rank) != list(mesh.placement):
                raise PipelineRuntimeError(
                    f"schedule {schedule.name!r} places the stages on ranks "
                    f"{stage_ranks(actions_by_rank)}, but this program runs them on "
                    f"{list(mesh.placement)}", hint="compile the program for this schedule")
            edges = {(src, dst) for _, src, dst in self.edges}
            messages = messages_of(self.comm_info, chunks, mesh.placement)
            self.plans[key] = plan_rank(mesh.pipe_rank, actions_by_rank, edges, messages,
                                        early_receives=early)
            if (schedule, chunks) not in self.replies:  # the same with early receives or not
                answers = replies(mesh.pipe_rank, actions_by_rank, edges, messages)
                self.replies[(schedule, chunks)] = (answers, frozenset(answers.values()))
        return self.plans[key]

    def _comm(self, b: int, chunks: int, loss: Any = None) -> DistComm:
        """The step's communication. Under autocast, boundary dtypes are learned on the first
        step for each autocast dtype and micro-batch size, and which values the loss does not
        reach on the first step with each loss function (`loss`, its key; None: no backward);
        every rank runs the same step."""
        autocast = AutocastState.capture().dtype(self.device.type)
        known = self.boundary_dtypes.get((autocast, b)) if autocast is not None else {}
        absent = set() if loss is None else self.absent_gradients.get(loss)
        return DistComm(rank=self.mesh.pipe_rank,
                        global_ranks=[self.mesh.global_rank(r) for r in range(self.mesh.ranks)],
                        placement=list(self.mesh.placement), info=self.comm_info,
                        microbatch_size=b, device=self.device, transport=self.transport,
                        tags=TagTable(self.edges, chunks), dtypes=dict(known or {}),
                        learn=known is None, timeline=self.timeline, written=self.written,
                        split_plans=self.split_plans, buffers=self.receive_buffers,
                        labels=self.message_labels.setdefault(chunks, {}), absent=absent)

    def _learned(self, comm: DistComm, loss: Any = None) -> None:
        if comm.learn:
            autocast = AutocastState.capture().dtype(self.device.type)
            self.boundary_dtypes[(autocast, comm.b)] = comm.dtypes
        if comm.learn_gradients and loss is not None:
            self.absent_gradients[loss] = comm.learned_absent()

    def close(self) -> None:
        """Removes the hooks this executor put on its parameters (a program that installs a
        new cut builds a new executor over the same parameters)."""
        if self.averager is not None:
            self.averager.close()
            self.averager = None

    def _weighted(self, losses: dict[int, torch.Tensor], mb: int, weight: float,
                  scale: torch.Tensor | None) -> WeightedLoss:
        """Micro-batch `mb`'s loss and the gradient its backward starts from: the weight times
        the loss scale, as autograd gives it to a loss multiplied by them, without the product."""
        return WeightedLoss(losses.pop(mb), weight if scale is None else scale * weight)

    def _refuse_split_backward(self, ticks: Sequence[Tick]) -> None:
        split = sorted({str(t.action.kind) for t in ticks if t.action is not None
                        and t.action.kind in (ActionKind.INPUT_GRAD, ActionKind.WEIGHT_GRAD)})
        if split:
            raise ConfigError(f"shard='full' cannot run a schedule that splits the backward "
                              f"(this one has {' and '.join(split)} actions): FSDP2 reduces "
                              "the gradients of whole backward passes",
                              hint="use schedule='gpipe', '1f1b' or 'interleaved-1f1b', or "
                                   "shard='optimizer'")

    def _settle_statistics(self) -> None:
        """The step's BatchNorm running statistics: deferred ones committed from the global
        batch's sums (every replica's), the others averaged over the replicas, so that every
        replica of a stage holds the same."""
        replicas = self.mesh.replicas > 1 and self.dp_group is not None
        committed = commit_batch_norms(self.dp_group if replicas else None)
        if not replicas or not self.statistic_slots:
            return
        live = {id(t): t for slots, attr in self.statistic_slots
                if (t := slots.get(attr)) is not None and id(t) not in committed}
        if live:
            average_statistics(list(live.values()), self.dp_group, self.mesh.replicas)

    def _reduce_gradients(self) -> None:
        """Sums tied parameters' gradients over the ranks that hold them, then averages every
        gradient over data-parallel replicas. A frozen parameter (requires_grad False, as every
        rank's training code sets it) is left without a gradient, as DDP leaves it: a zero one
        would have an optimizer's weight decay move it. So is one that no replica's loss
        reached (see fxpipe.runtime.communication.overlap), and a tied one that the loss
        reached on none of its holders."""
        named = self.named_tensors()
        for name in sorted(self.shared):
            group = self.shared_groups.get(name)
            param = named.get(name)
            if group is None or param is None or not param.requires_grad:
                continue
            sum_present(param, group)
        if self.dp_group is None or self.mesh.replicas == 1 or self.full_shard is not None:
            return
        averaged: set[int] = set()  # by the averager: what required grad when it was made
        if self.averager is not None:
            self.averager.finish()
            tied = {id(t) for name, t in named.items() if name in self.shared}
            averaged = {i for i in self.averager.index if i not in tied}
        for param in self.parameters():
            if param.requires_grad and id(param) not in averaged:
                average_present(param, self.dp_group, self.mesh.replicas)



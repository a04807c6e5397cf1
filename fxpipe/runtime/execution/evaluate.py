"""The loss of a batch without training it, on one rank of a distributed pipeline.

Validation under torchrun: every micro-batch runs forward through the stages in the order the
program's schedule runs its forwards, without gradients, and the last stage computes the batch's
loss as step() does: a loss fxpipe defines from its micro-batches' losses weighted by what each
counts (nothing kept), any other on the joined outputs, as one process would. The plan is the
schedule's with its backward actions and gradient messages left out
(fxpipe.runtime.planning.plan: the same clock on every rank). What the forwards change in the
stages' buffers (BatchNorm's running statistics in train mode) is put back: evaluating changes
nothing the model holds.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.runtime.communication.tags import messages_of
from fxpipe.runtime.execution.devices import stage_devices, to_device
from fxpipe.runtime.execution.forward import draw_base, run_forward
from fxpipe.runtime.planning.plan import Tick, plan_rank
from fxpipe.runtime.planning.schedule import ActionKind, ScheduleKind
from fxpipe.targets import Target, map_target, split_target
from fxpipe.untouched import untouched

__all__ = ["evaluate_rank", "forward_plan"]


def forward_plan(executor: Any, schedule: ScheduleKind, chunks: int) -> list[Tick]:
    """This rank's ticks of the schedule's forwards alone (cached on the executor)."""
    key = (schedule, chunks)
    if key not in executor.forward_plans:
        mesh = executor.mesh
        actions_by_rank = [[a for a in actions if a.kind == ActionKind.FORWARD]
                           for actions in schedule.build(chunks, mesh.stages, mesh.ranks)]
        edges = {(src, dst) for _, src, dst in executor.edges}
        messages = [m for m in messages_of(executor.comm_info, chunks, mesh.placement)
                    if not m.grad]
        executor.forward_plans[key] = plan_rank(mesh.pipe_rank, actions_by_rank, edges,
                                                messages)
    plan: list[Tick] = executor.forward_plans[key]
    return plan


def evaluate_rank(executor: Any, comm: Any, tensors: Sequence[torch.Tensor],
                  target: Target, loss_fn: Callable[..., torch.Tensor], *,
                  chunks: int, schedule: ScheduleKind) -> float:
    """The loss of this replica's batch (every rank of the pipeline calls it, and every rank
    returns it): the stages' forwards without gradients through `comm` (a DistComm for the
    batch's micro-batch size), the loss on the last stage."""
    with torch.no_grad(), untouched([], executor.buffers()):
        return _evaluate(executor, comm, list(tensors), target, loss_fn, chunks, schedule)


def _evaluate(executor: Any, comm: Any, tensors: list[torch.Tensor],
              target: Target, loss_fn: Callable[..., torch.Tensor], chunks: int,
              schedule: ScheduleKind) -> float:
    signature = executor.signature
    micro = signature.split_inputs(tensors, chunks)
    targets = split_target(target, chunks, signature.target_batch_dim,
                           signature.batch_size(tensors))
    judge = executor.loss_judge
    # a loss fxpipe defines is weighed from its micro-batches' alone: nothing is kept
    joins = not judge.weighs_parts(loss_fn, halves=False)
    comm.replies, comm.proofs = {}, frozenset()  # forwards only: no message comes back
    base = draw_base() if executor.random else None
    last_stage = executor.mesh.stages - 1
    outputs: dict[int, list[Any]] = {}
    values: dict[int, torch.Tensor] = {}  # each micro-batch's loss
    devices = {s: stage_devices(executor.device, [*u.module.parameters(), *u.module.buffers()])
               for s, u in executor.units.items()}
    for tick in forward_plan(executor, schedule, chunks):
        comm.begin_tick(tick)
        action = tick.action
        if action is None:
            continue
        last = action.stage == last_stage

        def keep(out: Any, mb: int = action.microbatch) -> None:
            part = map_target(lambda t: to_device(t, executor.device), targets[mb])
            values[mb] = judge.loss(out, part, loss_fn)
            if joins:
                outputs[mb] = list(out)
        run_forward(executor.units[action.stage], comm, action.microbatch,
                    micro[action.microbatch], recompute=False, seed_base=base,
                    rng_devices=devices[action.stage], check=executor.check_finite,
                    check_outputs=last, then=keep if last else None)
    comm.finish()
    value = torch.zeros(1, dtype=torch.float64, device=executor.device)
    if last_stage in executor.units:
        value.fill_(judge.batch_loss(outputs, values, target, targets, loss_fn)[0])
    dist.broadcast(value, src=executor.mesh.rank_of(last_stage), group=executor.pp_group)
    return float(value.item())

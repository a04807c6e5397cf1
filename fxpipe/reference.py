"""What a pipelined step equals: the plain model run over the same micro-batches.

NOTE [What equals what]: the pipeline computes the plain model on each micro-batch in turn, the
outputs joined along the batch dimension, then the loss and its backward (so the gradients are
those of gradient accumulation over the micro-batches, with the scaling of one full-batch loss).
BatchNorm in training normalises each micro-batch with its own statistics, as GPipe does. A step
that draws random numbers takes one number (`draw_base`) from the caller's generator, and
micro-batch m's stream starts at `microbatch_seed(base, m)` and runs through the stages as
through one forward of the plain model: a seeded pipelined step equals a seeded
`microbatched_forward` step. In eval mode without dropout this is the plain model on the batch.

The losses a written program's --verify compares with are recorded from it, on a copy of the
model (the model itself is not trained), with the launcher's optimizer (SGD, momentum 0.9) and
seed per step (`torch.manual_seed(step)`).
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.losses import LossFn
from fxpipe.reparametrized import derived_memo
from fxpipe.runtime.communication.mesh import Mesh
from fxpipe.runtime.execution.amp import compiled_autocast
from fxpipe.runtime.execution.devices import stage_devices
from fxpipe.runtime.execution.forward import draw_base, seeded_forward
from fxpipe.runtime.execution.loss_split import MEAN, SUM, split_kind
from fxpipe.runtime.execution.rank import shard_batch
from fxpipe.signature import Signature
from fxpipe.targets import Target, map_target

__all__ = ["reference_losses", "microbatched_forward", "replicated_loss", "reference_device",
           "copy_to", "depends_on_split", "replica_counts"]


def microbatched_forward(model: nn.Module, signature: Signature, flat: Sequence[torch.Tensor],
                         chunks: int, draws_random: bool) -> Any:
    """The plain model's outputs as the pipeline computes them (NOTE [What equals what]).

    draws_random: whether the pipeline draws random numbers (any stage does); then one number is
    taken from the caller's generator, as a pipelined step takes it.
    """
    base = draw_base() if draws_random else None
    return signature.unflatten_outputs(
        signature.join_outputs(_microbatch_leaves(model, signature, flat, chunks, base)))


def _microbatch_leaves(model: nn.Module, signature: Signature, flat: Sequence[torch.Tensor],
                       chunks: int, base: int | None) -> list[list[Any]]:
    """Each micro-batch's output leaves, micro-batch m's random stream started at its seed."""
    # every CUDA generator the model draws from starts each micro-batch at its seed, as the
    # pipeline's stages seed theirs (not only the CPU's)
    devices = stage_devices(torch.device("cpu"), [*model.parameters(), *model.buffers(), *flat])
    per_microbatch = []
    chunks = signature.microbatches(signature.batch_size(flat), chunks)  # as the pipeline's
    for m, tensors in enumerate(signature.split_inputs(flat, chunks)):
        args, kwargs = signature.unflatten_inputs(tensors)
        with seeded_forward(base, m, devices):
            per_microbatch.append(pytree.tree_leaves(model(*args, **kwargs)))
    return per_microbatch


def replicated_loss(model: nn.Module, signature: Signature, flat: Sequence[torch.Tensor],
                    target: Target, loss: LossFn, chunks: int, draws_random: bool,
                    replicas: int) -> torch.Tensor | None:
    """The loss `replicas` data-parallel replicas of the pipeline train on (NOTE [What equals
    what], once per replica): each computes the plain model over its shard of the batch (the
    batch's equal parts, in order) in `chunks` micro-batches, every replica from the same
    random base; their losses are averaged for a mean over examples and summed for a sum, as
    the replicas' gradients are (fxpipe.runtime.execution.loss_split). None for a loss that is
    neither, which replicas refuse."""
    base = draw_base() if draws_random else None
    leaves, losses = [], []
    for replica in range(replicas):
        shard, shard_target = shard_batch(signature, list(flat), target,
                                          Mesh((0,), replicas, replica))
        mine = _microbatch_leaves(model, signature, shard, chunks, base)
        leaves += mine
        output = signature.unflatten_outputs(signature.join_outputs(mine))
        losses.append(loss(output, shard_target) if shard_target is not None else loss(output))
    with torch.no_grad():
        output = signature.unflatten_outputs(signature.join_outputs(leaves))
        whole = loss(output, target) if target is not None else loss(output)
    kind = split_kind(float(whole), [float(v.detach()) for v in losses], whole.dtype)
    if kind == MEAN:
        return torch.stack(losses).mean()
    if kind == SUM:
        return torch.stack(losses).sum()
    return None


def depends_on_split(model: nn.Module, draws_random: bool) -> bool:
    """Whether a step's result depends on how the batch is split among replicas: random numbers
    drawn per micro-batch, or BatchNorm normalising each micro-batch with its statistics."""
    return draws_random or any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
                               for m in model.modules())


def replica_counts(batch: int, chunks: int, most: int = 8) -> list[int]:
    """The numbers of data-parallel replicas (2 to `most`) a batch splits among evenly, each
    replica's share into `chunks` micro-batches."""
    return [r for r in range(2, most + 1) if batch % r == 0 and (batch // r) % chunks == 0]


def reference_device(model: nn.Module, first_stage: torch.device) -> torch.device:
    """Where the reference copy runs: the first stage's device when the whole model fits there
    (it sits on that one device), else the CPU: a model spread over several GPUs may fit on
    none of them."""
    here = {t.device for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    return first_stage if here <= {first_stage} else torch.device("cpu")


def copy_to(model: nn.Module, device: torch.device | None) -> nn.Module:
    """A deep copy of `model` whose tensors are made on `device` one by one (never a second
    copy of a tensor on the device it sits on, on the way)."""
    memo = derived_memo(model)  # a weight_norm's weight: derived anew by the copy
    if device is None:
        return copy.deepcopy(model, memo)
    for t in [*model.parameters(), *model.buffers()]:
        moved = t.detach().to(device, copy=True)
        memo[id(t)] = nn.Parameter(moved, requires_grad=t.requires_grad) \
            if isinstance(t, nn.Parameter) else moved
    return copy.deepcopy(model, memo)


def reference_losses(model: nn.Module, signature: Signature, flat: list[torch.Tensor],
                     target: Target, loss: LossFn, steps: int, lr: float, *,
                     chunks: int = 1, draws_random: bool = False,
                     device: torch.device | None = None,
                     autocast: str | None = None, replicas: int = 1) -> list[float]:
    """The losses of `steps` SGD steps of a copy of `model` on one batch, each computed as the
    pipeline computes it (`microbatched_forward`; with `replicas` > 1, as that many
    data-parallel replicas do: `replicated_loss`), step i seeded with torch.manual_seed(i), on
    `device` (the model's tensors may be spread over a pipeline's devices; the copy gathers them
    there) and under the program's autocast dtype. Empty for replicas of a loss they refuse."""
    model = copy_to(model, device)
    if device is not None:
        flat = [t.to(device) for t in flat]
        target = map_target(lambda t: t.to(device), target)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)  # as the launcher
    scaler = torch.amp.GradScaler(device.type if device is not None else "cpu",
                                  enabled=autocast == "fp16")
    losses = []
    for step in range(steps):
        with torch.random.fork_rng(), compiled_autocast(autocast,
                                                        [device or torch.device("cpu")]):
            torch.manual_seed(step)
            if replicas > 1:
                found = replicated_loss(model, signature, flat, target, loss, chunks,
                                        draws_random, replicas)
                if found is None:
                    return []
                value = found
            else:
                output = microbatched_forward(model, signature, flat, chunks, draws_random)
                value = loss(output, target) if target is not None else loss(output)
        torch.autograd.backward(scaler.scale(value))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(float(value.detach()))
    return losses

"""Each stage's compute time in one process: every stage alone, forward and backward of every
micro-batch of a training step, nothing else running beside it.

A stage receives detached copies of the values its producers sent (leaves that require grad, as
over torch.distributed), so its backward is its own: autograd from the values it sends (gradient
ones) and, on the last stage, from the micro-batch losses. The time of a stage is its forwards,
backwards and recomputation (remat regions recompute during the backward), with no waiting in
it. The result is per step and micro-batch, for the caller's statistics. The caller restores
what a step changes (gradients, BatchNorm statistics, RNG state).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe import ir
from fxpipe.losses import loss_of
from fxpipe.remat_policy import RematPolicy, remat_policy
from fxpipe.runtime.comm import MicrobatchComm
from fxpipe.runtime.execution.batchnorm import discard_batch_norms
from fxpipe.runtime.execution.devices import to_device
from fxpipe.runtime.execution.stagespec import HeldStage
from fxpipe.signature import Signature
from fxpipe.targets import Target, map_target, split_target

__all__ = ["time_stages"]


class _Mailbox:
    """Values between stages, handed on as fresh leaves: no autograd edge crosses stages."""

    def __init__(self) -> None:
        self.box: dict[tuple[str, int, int, int], Any] = {}

    def send(self, value: Any, tag: str, src: int, dst: int, mb: int) -> None:
        self.box[(tag, src, dst, mb)] = value

    def recv(self, tag: str, src: int, dst: int, mb: int, device: torch.device) -> Any:
        def leaf(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            out = to_device(t.detach(), device)
            return out.requires_grad_(t.requires_grad) if ir.differentiable(t) else out
        return pytree.tree_map(leaf, self.box[(tag, src, dst, mb)])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_stages(stages: Sequence[HeldStage], signature: Signature, chunks: int,
                remat: RematPolicy | str,
                flat: Sequence[torch.Tensor], target: Target,
                loss_fn: Callable[..., torch.Tensor], *, steps: int = 2
                ) -> list[list[list[float]]]:
    """Seconds each stage computes per micro-batch: times[stage][step][micro-batch]."""
    chunks = signature.microbatches(signature.batch_size(list(flat)), chunks)
    micro = signature.split_inputs(list(flat), chunks)
    targets = split_target(target, chunks, signature.target_batch_dim,
                           signature.batch_size(list(flat)))
    times: list[list[list[float]]] = [[] for _ in stages]
    for _ in range(steps):
        box = _Mailbox()
        for s, stage in enumerate(stages):
            times[s].append(_stage_step(s, stage, s == len(stages) - 1, box, micro, targets,
                                        chunks, remat_policy(remat), signature, loss_fn))
        discard_batch_norms()
    return times


def _stage_step(s: int, stage: HeldStage, last: bool, box: _Mailbox,
                micro: Sequence[Sequence[torch.Tensor]], targets: Sequence[Target],
                chunks: int, remat: RematPolicy, signature: Signature,
                loss_fn: Callable[..., torch.Tensor]) -> list[float]:
    """Forwards of every micro-batch, then their backwards in reverse order (GPipe's order);
    seconds per micro-batch."""
    roots: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    elapsed = [0.0] * chunks
    with torch.enable_grad():
        for mb in range(chunks):
            view = MicrobatchComm(box, s, mb, remat.recomputes(mb, chunks), stage.device)
            args = [to_device(micro[mb][i], stage.device) for i in stage.inputs]
            _sync(stage.device)
            start = time.perf_counter()
            out = stage.module(view, *args)
            outputs = [t for t in pytree.tree_leaves(view.sent) if isinstance(t, torch.Tensor)
                       and t.requires_grad]
            grads = [torch.ones_like(t) for t in outputs]
            if last:
                structured = signature.unflatten_outputs(list(out))
                target = map_target(lambda t: to_device(t, stage.device), targets[mb])
                loss = loss_of(loss_fn, structured, target) / chunks
                outputs.append(loss)
                grads.append(torch.ones_like(loss))
            _sync(stage.device)
            elapsed[mb] += time.perf_counter() - start
            roots.append((outputs, grads))
        for mb in reversed(range(chunks)):
            outputs, grads = roots[mb]
            if not outputs:
                continue
            start = time.perf_counter()
            torch.autograd.backward(outputs, grads)
            _sync(stage.device)
            elapsed[mb] += time.perf_counter() - start
    return elapsed

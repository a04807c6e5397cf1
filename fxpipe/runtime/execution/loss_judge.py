"""How a distributed step learns its loss's kind: the last stage judges each step's loss (the
joined outputs' loss against its micro-batches', or with one micro-batch per replica its two
halves'), the replicas agree, and every rank settles the verdict the last stage broadcasts
(the rules of a mean, a sum and neither: fxpipe.runtime.execution.loss_split)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.errors import LossError, PeerLostError
from fxpipe.losses import counted, loss_of
from fxpipe.runtime.communication.mesh import Mesh
from fxpipe.runtime.execution.backward_graph import Graph
from fxpipe.runtime.execution.devices import to_device
from fxpipe.runtime.execution.loss_split import (
    KINDS,
    MEAN,
    MIXED,
    NEITHER,
    SUM,
    UNDECIDED,
    agreed,
    changed,
    disagreement,
    known_kind,
    refusal,
    split_kind,
    undecidable,
)
from fxpipe.signature import Signature
from fxpipe.targets import Target, check_target, check_tensor, split_target

__all__ = ["LossJudge", "check_batch_target", "check_reads_held"]


def check_batch_target(signature: Signature, inputs: list[torch.Tensor],
                       target: Target) -> None:
    """Refuses a target whose batch is not the inputs' batch, before replicas take their
    shares of both (each share cut by the inputs' batch would pass a larger target). A tensor
    of the target without that dimension at all is left to split_target: with a program.json
    whose outputs' batch dimension was edited, joining the outputs says so first."""
    if target is None:
        return
    dim = signature.target_batch_dim
    if not isinstance(target, torch.Tensor):
        check_target(target, dim, signature.batch_size(inputs), only_batched=True)
    elif target.dim() > dim:
        check_tensor("target", target, dim, signature.batch_size(inputs))


def check_reads_held(loss: torch.Tensor, foreign: dict[int, str], stage: int) -> None:
    """Refuses a loss that reads a parameter of the model this rank does not train (an L2
    penalty over model.parameters() in the loss function): the last stage would compute its
    gradient and keep it, and the rank that trains it would go without the loss's term.
    `foreign`: those parameters by id, with their names. Walks the loss's graph once (the
    first step with each loss function)."""
    if loss.grad_fn is None:
        return
    leaves = (getattr(node, "variable", None) for node in Graph([loss.grad_fn]).nodes)
    found = {id(leaf) for leaf in leaves if leaf is not None and id(leaf) in foreign}
    if found:
        names = [name for key, name in foreign.items() if key in found]  # the model's order
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        raise LossError(
            f"the loss function reads the model's parameter {names[0]!r}{more}, which this "
            f"rank's stages do not hold (another rank's stage trains it, or no stage uses it): "
            f"the last stage (stage {stage}) would compute the gradient the loss gives it and "
            "keep it here, so training would miss that term",
            hint="put a penalty on the weights as the optimizer's weight_decay, or compute the "
                 "term in forward and return it as one more output (each stage then adds its "
                 "own parameters' part)")


class LossJudge:
    """The loss's kind of each (loss function, with or without a target) this executor steps
    with, and the judging and settling of a step's verdict."""

    def __init__(self, signature: Signature, device: torch.device, mesh: Mesh,
                 dp_group: Any) -> None:
        self.signature = signature
        self.device = device
        self.mesh = mesh
        self.dp_group = dp_group
        self.kinds: dict[Any, str] = {}  # loss_key -> MEAN or SUM, once found

    def loss(self, out: Any, target: Any, loss_fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        """`loss_fn` on the last stage's flat outputs, structured as the model returns them."""
        structured = self.signature.unflatten_outputs(list(out))
        return loss_of(loss_fn, structured, target)

    def judge(self, outputs: dict[int, list[Any]], values: dict[int, torch.Tensor],
              target: Target, targets: list[Target],
              loss_fn: Callable[..., torch.Tensor], halves: bool, known: str | None
              ) -> tuple[float, list[float], str | None, list[int]]:
        """The loss of the whole batch (as in one process), its parts' losses, the kind the
        replicas agree on (fxpipe.runtime.execution.loss_split), and how many found each kind.
        The parts are the micro-batches, or with `halves` the two halves of the one micro-batch;
        a micro-batch of one example has none and takes the `known` kind. The whole batch's
        loss is the loss run once more on the joined `outputs`, or for a loss fxpipe defines
        (`weighs_parts`) its micro-batches' losses weighted by what each counts."""
        if halves:
            full = float(values[0])
            parts, sizes = self._halves(outputs[0], target, loss_fn)
            kind = split_kind(full, parts, values[0].dtype, sizes) if parts else \
                known or UNDECIDED
        else:
            full, parts = self.batch_loss(outputs, values, target, targets, loss_fn)
            kind = split_kind(full, parts, values[0].dtype)
        found = [0] * (len(KINDS) + 1)
        found[KINDS.index(kind) if kind is not None else len(KINDS)] = 1
        if self.dp_group is not None and self.mesh.replicas > 1:
            counts = torch.tensor(found, dtype=torch.float64, device=self.device)
            try:  # the last stage of every replica
                dist.all_reduce(counts, group=self.dp_group)
            except RuntimeError as e:
                raise PeerLostError(f"rank {self.mesh.rank}: agreeing on the loss's kind with "
                                    f"the other replicas failed: {str(e).splitlines()[0]}",
                                    hint="another rank failed or exited; its error says why"
                                    ) from e
            found = [int(n) for n in counts.tolist()]
        return full, parts, agreed(found), found

    @staticmethod
    def weighs_parts(loss_fn: Callable[..., torch.Tensor], halves: bool) -> bool:
        """Whether `judge` finds the batch's loss from its micro-batches' alone: for a loss
        fxpipe defines (fxpipe.losses.NAMED, a mean over what it counts), whose joined outputs
        then need not be kept or run through the loss again. Halves are always run."""
        return not halves and known_kind(loss_fn) is not None

    def batch_loss(self, outputs: dict[int, list[Any]], values: dict[int, torch.Tensor],
                    target: Target, targets: list[Target],
                    loss_fn: Callable[..., torch.Tensor]) -> tuple[float, list[float]]:
        """The batch's loss and its micro-batches', in one host read."""
        order = sorted(values)
        losses = [values[m].detach().reshape(()).to(torch.float64) for m in order]
        if self.weighs_parts(loss_fn, False):
            counts = [c for m in order if (c := counted(loss_fn, targets[m])) is not None]
            if len(counts) == len(order):
                losses += [to_device(c, self.device).to(torch.float64) for c in counts]
            read = torch.stack(losses).tolist()
            parts, weights = read[:len(order)], read[len(order):] or [1.0] * len(order)
            total = sum(weights)
            # a part that counts nothing (its loss 0/0) weighs nothing
            full = sum(w * p for w, p in zip(weights, parts) if w) / total if total \
                else float("nan")
            return full, parts
        joined = self.signature.join_outputs([outputs[m] for m in order])
        with torch.no_grad():
            loss = self.loss(joined, to_device(target, self.device) if target is not None
                             else None, loss_fn)
        full, *parts = torch.stack([loss.detach().reshape(()).to(torch.float64),
                                    *losses]).tolist()
        return full, parts

    def _halves(self, out: list[Any], target: Target,
                loss_fn: Callable[..., torch.Tensor]) -> tuple[list[float], list[int]]:
        """The losses of the two halves of one micro-batch's outputs (and target, split as the
        step splits it) along the batch, and their sizes; none for one example."""
        dims = self.signature.out_batch_dims
        size = next((o.shape[d] for o, d in zip(out, dims)
                     if d is not None and isinstance(o, torch.Tensor)), 1)
        if size < 2:
            return [], []
        halves = [[o.tensor_split(2, d)[h] if d is not None and isinstance(o, torch.Tensor)
                   else o for o, d in zip(out, dims)] for h in (0, 1)]
        out_dim = next((d for d in dims if d is not None), 0)
        targets = split_target(target, 2, out_dim, size)
        with torch.no_grad():
            parts = [float(self.loss(h, to_device(t, self.device) if t is not None else None,
                                      loss_fn)) for h, t in zip(halves, targets)]
        return parts, [size - size // 2, size // 2]

    def settle(self, verdict: list[float], loss_fn: Callable[..., torch.Tensor], key: Any,
               assumed: str | None, probe: bool, halves: bool) -> str:
        """Every rank alike: remembers what a judging step found, refuses a loss that does not
        split over micro-batches, whose kind the replicas could not find or disagree on, or
        that changed kind after its backward was scaled; returns the kind the backward was
        weighted as."""
        width = len(KINDS) + 1
        full, code, parts = verdict[0], int(verdict[1]), verdict[2 + width:]
        kind = KINDS[code] if code >= 0 else None
        if kind == UNDECIDED:
            raise undecidable(loss_fn, self.mesh.replicas)
        if kind == MIXED:
            counts = [int(n) for n in verdict[2:2 + width]]
            raise disagreement(loss_fn, counts, None if probe else assumed)
        if probe:
            self.kinds[key] = kind if kind is not None else MEAN
        elif assumed is None and kind in (MEAN, SUM):  # for a later step that cannot judge
            self.kinds[key] = kind
        if kind == NEITHER and (probe or assumed is None):
            raise refusal(loss_fn, full, parts, None, halves,
                          self.signature.batch_free_outputs())
        if assumed is not None and not probe and changed(kind, assumed):
            raise refusal(loss_fn, full, parts, assumed, halves,
                          self.signature.batch_free_outputs())
        return assumed or kind or self.kinds.get(key, MEAN)

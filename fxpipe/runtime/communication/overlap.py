"""Data-parallel gradient averaging that overlaps the last backward pass of a step.

A stage's parameter gradients are final once the last micro-batch's backward has reached them;
the rest of that backward can run while they travel. As DDP does, parameters are grouped into
buckets of about `bucket_bytes` in the reverse of their order in the stage (the order backward
produces their gradients). During the step's last backward a post-accumulate-grad hook marks
each parameter ready; a bucket whose parameters are all ready is flattened and all-reduced
asynchronously over the replicas of this stage. Buckets are launched strictly in order, so that
every replica issues the same collectives in the same order whatever order its hooks fire in.
`finish()` launches what the last backward did not reach, waits, and writes back the averages.

A parameter the step's loss did not reach keeps no gradient on the replica that did not reach
it. Each bucket carries, after its gradients, one element per parameter: 1 where the replica
holds a gradient. As DDP's `find_unused_parameters` does, a parameter that no replica reached
is left without one (a zero gradient would have weight decay and momentum move it, which the
plain model's optimizer does not), and one that some reached gets the average, the others
counting zeros. Only a replica that lacks a gradient reads the flags back to the host.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work
from torch.utils.hooks import RemovableHandle

from fxpipe.errors import ConfigError
from fxpipe.sharding import local_part

__all__ = ["ReplicaAverager", "buckets", "average_present", "sum_present"]


def buckets(sizes: list[tuple[int, torch.dtype]], bucket_bytes: int) -> list[list[int]]:
    """Indexes of consecutive parameters grouped into buckets of at most `bucket_bytes` (one
    larger parameter makes a bucket of its own) holding a single dtype each."""
    out: list[list[int]] = []
    filled = 0
    for i, (nbytes, dtype) in enumerate(sizes):
        if out and filled + nbytes <= bucket_bytes and sizes[out[-1][0]][1] == dtype:
            out[-1].append(i)
            filled += nbytes
        else:
            out.append([i])
            filled = nbytes
    return out


class ReplicaAverager:
    """Averages the gradients of `params` over `replicas` ranks of `group`, bucket by bucket."""

    def __init__(self, params: Iterable[torch.nn.Parameter], group: ProcessGroup | None,
                 replicas: int, bucket_bytes: int) -> None:
        self.params = [p for p in reversed(list(params)) if p.requires_grad]
        self.group, self.replicas = group, replicas
        sizes = [(p.numel() * p.element_size(), p.dtype) for p in self.params]
        self.buckets = buckets(sizes, bucket_bytes)
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.armed = False
        self.overlapped = 0  # buckets of the last step launched while its backward ran
        self._reset()
        # The ignore: torch leaves Tensor.register_post_accumulate_grad_hook unannotated.
        self.handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._ready)  # type: ignore[no-untyped-call]
            for p in self.params]
        self.hook_ids = frozenset(handle.id for handle in self.handles)  # in p's hook dicts

    def _reset(self) -> None:
        self.missing = [len(members) for members in self.buckets]
        self.launched: list[tuple[Work, torch.Tensor]] = []

    def arm(self) -> None:
        """The next backward is the step's last for every parameter: reduce as gradients land."""
        self._reset()
        self.armed = True

    def _ready(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        self.missing[self.bucket_of[self.index[id(param)]]] -= 1
        while len(self.launched) < len(self.buckets) and not self.missing[len(self.launched)]:
            self._launch(len(self.launched))

    def _launch(self, b: int) -> None:
        flat = _with_presence([self.params[i] for i in self.buckets[b]])
        self.launched.append((dist.all_reduce(flat, group=self.group, async_op=True), flat))

    def finish(self) -> None:
        """Launches the buckets not yet launched, waits for all, writes the averages back."""
        self.armed = False
        self.overlapped = len(self.launched)
        while len(self.launched) < len(self.buckets):
            self._launch(len(self.launched))
        for b, (work, flat) in enumerate(self.launched):
            work.wait()
            members = [self.params[i] for i in self.buckets[b]]
            grads, present = flat[:-len(members)], flat[-len(members):]
            grads /= self.replicas
            offset = 0
            for k, p in enumerate(members):
                n = p.numel()
                _write_average(p, grads[offset:offset + n], present[k])
                offset += n
        self.launched = []

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def average_present(param: torch.Tensor, group: ProcessGroup | None,
                    replicas: int) -> None:
    """Averages one parameter's gradient over `replicas` ranks of `group` as the buckets are
    averaged: left without one where no replica holds one."""
    flat = _with_presence([param])
    dist.all_reduce(flat, group=group)
    _write_average(param, flat[:-1].div_(replicas), flat[-1])


def sum_present(param: torch.Tensor, group: ProcessGroup | None) -> None:
    """Sums a tied parameter's gradient over the ranks of `group` that hold it, left without
    one where none holds one. The sum runs on the gradient itself (no copy of a large
    embedding's), beside a one-element sum of the holders that have one, which only a holder
    without one reads back to the host. Under shard="full" each holder sums its shard: the
    same part of the same shape on every holder (the replica index is the same)."""
    present = torch.ones(1, device=param.device) if param.grad is not None else \
        torch.zeros(1, device=param.device)
    dist.all_reduce(present, group=group)
    grad = param.grad if param.grad is not None else torch.zeros_like(param)
    dist.all_reduce(local_part(grad), group=group)
    if param.grad is None and bool(present > 0):
        param.grad = grad


def _with_presence(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters' gradients (zeros where missing) flattened, then one flag each: 1 where
    this replica holds a gradient. The flags are filled on the device: no host copy."""
    flags = torch.ones(len(params), dtype=params[0].dtype, device=params[0].device)
    for k, p in enumerate(params):
        if p.grad is None:
            flags[k] = 0
    try:
        return torch.cat([*((p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                            for p in params), flags])
    except RuntimeError:
        sparse = [p for p in params if p.grad is not None and p.grad.is_sparse]
        if not sparse:
            raise
        raise ConfigError(f"a parameter of shape {tuple(sparse[0].shape)} has a sparse gradient "
                          "(an nn.Embedding(sparse=True)), and data-parallel replicas average "
                          "dense gradients", hint="use sparse=False under replicas") from None


def _write_average(param: torch.Tensor, average: torch.Tensor,
                   present: torch.Tensor) -> None:
    """Writes the replicas' average into the gradient, unless no replica held one. A parameter
    frozen since the collectives were set up keeps no gradient, as DDP's."""
    if not param.requires_grad:
        return
    average = average.view_as(param)
    if param.grad is not None:
        param.grad.copy_(average)
    elif bool(present > 0):  # a host read only where this replica's loss missed it
        param.grad = average.clone()

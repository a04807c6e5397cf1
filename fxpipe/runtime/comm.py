"""Communication between stages: in one process (autograd-connected) or over torch.distributed.

A stage's generated code calls `comm.recv(tag, src=...)` and `comm.send(value, tag, dst=...)` on
a view bound to its stage and micro-batch; `comm.remat` says whether this micro-batch recomputes
its activations and `comm.device` where the stage runs.

NOTE [Gradients across stages]
LocalComm hands the producer's tensor to the consumer with a differentiable `.to(device)`, so the
whole pipeline is one autograd graph and `loss.backward()` reaches every stage, as in torchgpipe.
DistComm cannot: the receiver gets a fresh leaf. It records, per micro-batch, the leaves it
received and the tensors it sent; the backward of a micro-batch receives the gradient of every
sent tensor, runs autograd on them, and sends the gradient of every received leaf back:

    stage s                          stage s+1
    x = recv(...)  (leaf) <-------- -
    y = f(x); send(y) ------------>  y' = recv(...) (leaf); loss(g(y'))
    ...                              backward: y'.grad
    backward(y, grad=recv_grad) <--- send_grad(y'.grad)
    send_grad(x.grad) ----> ...
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fxpipe import ir
from fxpipe.errors import PeerLostError, PipelineRuntimeError

__all__ = ["LocalComm", "DistComm", "MicrobatchComm", "TagTable"]


@dataclass
class MicrobatchComm:
    """The view of a Comm that one stage forward sees."""

    base: Any
    stage: int
    microbatch: int
    remat: bool
    device: torch.device
    received: dict[str, Any] = field(default_factory=dict)  # for the NaN/Inf check
    sent: dict[str, Any] = field(default_factory=dict)

    def recv(self, tag: str, src: int) -> Any:
        value = self.base.recv(tag, src, self.stage, self.microbatch, self.device)
        self.received[tag] = value
        return value

    def send(self, value: Any, tag: str, dst: int) -> None:
        self.sent[tag] = value
        self.base.send(value, tag, self.stage, dst, self.microbatch)


class LocalComm:
    """Mailboxes in one process; values stay in the autograd graph."""

    def __init__(self) -> None:
        self.box: dict[tuple[str, int, int, int], Any] = {}
        self.lock = threading.Lock()

    def send(self, value: Any, tag: str, src: int, dst: int, mb: int) -> None:
        with self.lock:
            self.box[(tag, src, dst, mb)] = value

    def recv(self, tag: str, src: int, dst: int, mb: int, device: torch.device) -> Any:
        with self.lock:
            try:
                value = self.box.pop((tag, src, dst, mb))
            except KeyError:
                raise PipelineRuntimeError(
                    f"stage {dst} expected {tag!r} from stage {src} for micro-batch {mb}, "
                    "but it was not sent", hint="this is a scheduling bug; please report it") from None
        return pytree.tree_map(lambda t: _to_device(t, device) if isinstance(t, torch.Tensor)
                               else t, value)


_COPY_STREAMS: dict[torch.device, Any] = {}


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A differentiable copy to `device`; between GPUs it runs on a copy stream of the target
    device, so it overlaps the computation there (as torchgpipe does)."""
    if t.device == device:
        return t
    if device.type != "cuda" or t.device.type != "cuda":
        return t.to(device)
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(t.device))  # the producer has written t
    with torch.cuda.stream(stream):
        out = t.to(device, non_blocking=True)
    t.record_stream(stream)  # keep t's memory until the copy is done
    torch.cuda.current_stream(device).wait_stream(stream)
    return out


class TagTable:
    """Integer tags for (value, src, dst): both ends derive the same numbers from the program."""

    def __init__(self, edges: Sequence[tuple[str, int, int]], num_microbatches: int) -> None:
        self.index = {edge: i for i, edge in enumerate(sorted(set(edges)))}
        self.m = num_microbatches

    def tag(self, name: str, src: int, dst: int, mb: int, backward: bool, element: int = 0) -> int:
        slot = (self.index[(name, src, dst)] * self.m + mb) * _ELEMENTS + element
        return (slot << 1) | int(backward)


_ELEMENTS = 64  # tensors per communicated value (a tuple of tensors is sent element by element)


def _leaves(info: ir.ValueInfo) -> list[ir.ValueInfo]:
    return [x for i in info for x in _leaves(i)] if isinstance(info, tuple) else [info]


def _needs_grad(info: ir.ValueInfo) -> bool:
    return isinstance(info, ir.TensorInfo) and info.is_float and info.requires_grad


@dataclass
class _Record:
    received: list[tuple[torch.Tensor, str, int, int]] = field(default_factory=list)
    sent: list[tuple[torch.Tensor, str, int, int]] = field(default_factory=list)


class DistComm:
    """Point-to-point over torch.distributed, one process per stage (gloo on CPU, nccl on GPU).

    Which values carry gradients back is decided from the compiled value info on both ends
    (floating tensors that require grad), so every message has exactly one receiver.
    """

    def __init__(self, *, rank_of_stage: Sequence[int], tags: TagTable,
                 info: dict[tuple[str, int, int], ir.ValueInfo], microbatch_size: int,
                 group: Any = None, timeline: Any = None) -> None:
        self.rank_of_stage = list(rank_of_stage)
        self.tags = tags
        self.info = info  # (tag, src stage, dst stage) -> value info
        self.b = microbatch_size
        self.group = group
        self.records: dict[int, _Record] = {}
        self.pending: list[Any] = []  # isend works to wait for before buffers are reused
        self.timeline = timeline
        # irecvs posted ahead of need, so a transfer overlaps the computation before it
        self.early: dict[int, tuple[Any, torch.Tensor]] = {}
        self.prefetch = dist.get_backend(group) == "gloo"  # nccl needs both ends in one order

    def prefetch_forward(self, stage: int, mb: int, device: torch.device) -> None:
        """Posts the receives of micro-batch mb's forward on `stage`."""
        if not self.prefetch:
            return
        for (tag, src, dst), info in self.info.items():
            if dst != stage:
                continue
            for k, leaf in enumerate(_leaves(info)):
                if isinstance(leaf, ir.TensorInfo):
                    number = self.tags.tag(tag, src, dst, mb, backward=False, element=k)
                    buffer = torch.empty(leaf.concrete_shape(self.b), dtype=leaf.dtype,
                                         device=device)
                    self._post(number, buffer, self.rank_of_stage[src])

    def prefetch_backward(self, stage: int, mb: int) -> None:
        """Posts the receives of the gradients micro-batch mb's backward on `stage` needs."""
        if not self.prefetch:
            return
        for value, tag, dst, k in self.records.get(mb, _Record()).sent:
            number = self.tags.tag(tag, stage, dst, mb, backward=True, element=k)
            self._post(number, _grad_buffer(value), self.rank_of_stage[dst])

    def _post(self, number: int, buffer: torch.Tensor, rank: int) -> None:
        if number in self.early:
            return
        try:
            work = dist.irecv(buffer, src=rank, group=self.group, tag=number)
        except RuntimeError as e:
            raise PeerLostError(f"receiving from rank {rank} failed: {str(e).splitlines()[0]}",
                                hint="another rank failed, exited or timed out") from e
        self.early[number] = (work, buffer)

    def _take(self, number: int, buffer: torch.Tensor, rank: int) -> torch.Tensor:
        """The buffer of a prefetched receive (waited for), or a blocking receive into buffer."""
        posted = self.early.pop(number, None)
        if posted is None:
            _recv(buffer, rank, self.group, number)
            return buffer
        work, early = posted
        try:
            work.wait()
        except RuntimeError as e:
            raise PeerLostError(f"receiving from rank {rank} failed: {str(e).splitlines()[0]}",
                                hint="another rank failed, exited or timed out") from e
        return early

    # -- forward --------------------------------------------------------------------------------

    def recv(self, tag: str, src: int, dst: int, mb: int, device: torch.device) -> Any:
        info = self.info[(tag, src, dst)]
        record = self.records.setdefault(mb, _Record())
        values = []
        with self._event("recv", dst, mb, tag):
            for k, leaf in enumerate(_leaves(info)):
                number = self.tags.tag(tag, src, dst, mb, backward=False, element=k)
                value = self._recv_leaf(leaf, self.rank_of_stage[src], number, device)
                if _needs_grad(leaf):
                    record.received.append((value, tag, src, k))
                values.append(value)
        return _rebuild(info, iter(values))

    def _recv_leaf(self, info: ir.ValueInfo, rank: int, number: int, device: torch.device) -> Any:
        if isinstance(info, ir.TensorInfo):
            buffer = torch.empty(info.concrete_shape(self.b), dtype=info.dtype, device=device) \
                if number not in self.early else self.early[number][1]
            buffer = self._take(number, buffer, rank)
            return buffer.requires_grad_(_needs_grad(info) and torch.is_grad_enabled())
        buffer = torch.empty(1, dtype=torch.float64, device=device)
        _recv(buffer, rank, self.group, number)
        value = buffer.item()
        return int(value) if float(value).is_integer() and not isinstance(info.value, float) else value

    def send(self, value: Any, tag: str, src: int, dst: int, mb: int) -> None:
        info = self.info[(tag, src, dst)]
        record = self.records.setdefault(mb, _Record())
        with self._event("send", src, mb, tag):
            for k, (leaf, leaf_info) in enumerate(zip(pytree.tree_leaves(value), _leaves(info))):
                number = self.tags.tag(tag, src, dst, mb, backward=False, element=k)
                if isinstance(leaf, torch.Tensor):
                    data = leaf.detach().contiguous()
                else:
                    data = torch.tensor([float(leaf)], dtype=torch.float64, device=self._device(value))
                self.pending.append((_isend(data, self.rank_of_stage[dst], self.group, number),
                                     data))
                if _needs_grad(leaf_info):
                    record.sent.append((leaf, tag, dst, k))

    @staticmethod
    def _device(value: Any) -> torch.device:
        tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
        return tensors[0].device if tensors else torch.device("cpu")

    # -- backward -------------------------------------------------------------------------------

    def backward(self, stage: int, mb: int, loss: torch.Tensor | None = None) -> None:
        """Backward of one micro-batch: gradients in, autograd, gradients out."""
        record = self.records.pop(mb, _Record())
        tensors, grads = [], []
        if loss is not None and loss.requires_grad:
            tensors.append(loss)
            grads.append(None)
        for value, tag, dst, k in record.sent:
            number = self.tags.tag(tag, stage, dst, mb, backward=True, element=k)
            grad = _grad_buffer(value) if number not in self.early else self.early[number][1]
            with self._event("recv_grad", stage, mb, tag):
                grad = self._take(number, grad, self.rank_of_stage[dst])
            if isinstance(value, torch.Tensor) and value.requires_grad:
                tensors.append(value)
                grads.append(grad)
        if tensors:
            torch.autograd.backward(tensors, grads)
        for leaf, tag, src, k in record.received:
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            number = self.tags.tag(tag, src, stage, mb, backward=True, element=k)
            data = grad.detach().contiguous()
            with self._event("send_grad", stage, mb, tag):
                self.pending.append((_isend(data, self.rank_of_stage[src], self.group, number),
                                     data))

    def finish(self) -> None:
        """Waits for every outstanding send of the step."""
        for work, _ in self.pending:
            try:
                work.wait()
            except RuntimeError as e:
                raise PeerLostError(f"a send to another stage failed: {e}",
                                    hint="another rank failed or exited; its error says why") from e
        self.pending.clear()
        self.records.clear()
        self.early.clear()

    def _event(self, kind: str, stage: int, mb: int, tag: str) -> Any:
        if self.timeline is None:
            return _NULL
        return self.timeline.span(kind, stage, mb, detail=tag)


def _grad_buffer(value: torch.Tensor) -> torch.Tensor:
    """Where the gradient of a sent value arrives: contiguous, as the receiver sends it (a
    buffer with the value's own strides, e.g. transposed or channels_last, would be filled in
    the wrong order)."""
    return torch.empty(value.shape, dtype=value.dtype, device=value.device)


def _recv(buffer: torch.Tensor, rank: int, group: Any, tag: int) -> None:
    try:
        dist.recv(buffer, src=rank, group=group, tag=tag)
    except RuntimeError as e:
        raise PeerLostError(f"receiving from rank {rank} failed: {str(e).splitlines()[0]}",
                            hint="another rank failed, exited or timed out; its error says why") from e


def _isend(data: torch.Tensor, rank: int, group: Any, tag: int) -> Any:
    try:
        return dist.isend(data, dst=rank, group=group, tag=tag)
    except RuntimeError as e:
        raise PeerLostError(f"sending to rank {rank} failed: {str(e).splitlines()[0]}",
                            hint="another rank failed, exited or timed out; its error says why") from e


def _rebuild(info: ir.ValueInfo, values: Any) -> Any:
    if isinstance(info, tuple):
        return tuple(_rebuild(i, values) for i in info)
    return next(values)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL = _Null()

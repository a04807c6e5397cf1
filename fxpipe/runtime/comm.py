"""Communication between stages: the view a stage's code sees, and the in-process mailboxes.

A stage's generated code calls `comm.recv(tag, src=...)` and `comm.send(value, tag, dst=...)` on
a view bound to its stage and micro-batch; `comm.remat` says whether this micro-batch recomputes
its activations and `comm.device` where the stage runs.

NOTE [Gradients across stages]
LocalComm hands the producer's tensor to the consumer with a differentiable `.to(device)`, so the
whole pipeline is one autograd graph and `loss.backward()` reaches every stage, as in torchgpipe.
DistComm (fxpipe/runtime/communication/dist_comm.py) cannot: the receiver gets a fresh leaf. It
records, per stage and micro-batch, the leaves it received and the tensors it sent; the backward of
a micro-batch receives the gradient of every sent tensor, runs autograd on them, and sends the
gradient of every received leaf back:

    stage s                          stage s+1
    x = recv(...)  (leaf) <-------- -
    y = f(x); send(y) ------------>  y' = recv(...) (leaf); loss(g(y'))
    ...                              backward: y'.grad
    backward(y, grad=recv_grad) <--- send_grad(y'.grad)
    send_grad(x.grad) ----> ...
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.errors import PipelineRuntimeError
from fxpipe.runtime.ops import RNG_TAG

__all__ = ["LocalComm", "MicrobatchComm"]


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

    def carries_host_tensors(self, dst: int) -> bool:
        """Whether a host tensor sent to stage `dst` arrives as it is (the RNG hand-over,
        fxpipe.runtime.ops)."""
        carries = getattr(self.base, "carries_host_tensors", None)
        return bool(carries(self.stage, dst)) if carries is not None else \
            self.device.type == "cpu"

    def recv(self, tag: str, src: int) -> Any:
        value = self.base.recv(tag, src, self.stage, self.microbatch, self.device)
        self.received[tag] = value
        return value

    def send(self, value: Any, tag: str, dst: int) -> None:
        self.sent[tag] = value
        self.base.send(value, tag, self.stage, dst, self.microbatch)


class LocalComm:
    """Mailboxes in one process; values stay in the autograd graph. The generator state handed
    between stages stays on the host, where the generators keep it (NOTE [Random streams across
    stages] in fxpipe/runtime/ops.py)."""

    def __init__(self) -> None:
        self.box: dict[tuple[str, int, int, int], Any] = {}
        self.lock = threading.Lock()

    def carries_host_tensors(self, src: int, dst: int) -> bool:
        return True

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
                    "but it was not sent",
                    hint="this is a scheduling bug; please report it") from None
        if tag == RNG_TAG:
            return value
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
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(t.device))  # the producer has written t
    with torch.cuda.stream(stream):
        out = t.to(device, non_blocking=True)
    t.record_stream(stream)  # keep t's memory until the copy is done
    consumer = torch.cuda.current_stream(device)
    consumer.wait_stream(stream)
    # `out` was allocated on the copy stream; the consumer uses it on its own stream, so its
    # memory must not return to the copy stream's pool before that work is done (torchgpipe's
    # Copy does the same for both ends)
    out.record_stream(consumer)
    return out

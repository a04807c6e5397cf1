"""Which messages a step's stage boundaries make, and the integer tags both ends of each derive
from the program alone (gloo matches a receive to its send by tag)."""
from __future__ import annotations

from collections.abc import Sequence

from fxpipe import ir
from fxpipe.runtime.planning.plan import Message

__all__ = ["Edge", "TagTable", "messages_of", "activation_of", "gradient_of"]

Edge = tuple[str, int, int]  # (value, src stage, dst stage)


class TagTable:
    """Integer tags for (value, src, dst): both ends derive the same numbers from the program."""

    def __init__(self, edges: Sequence[tuple[str, int, int]], num_microbatches: int) -> None:
        self.index = {edge: i for i, edge in enumerate(sorted(set(edges)))}
        self.m = num_microbatches

    def tag(self, name: str, src: int, dst: int, mb: int, backward: bool, element: int = 0) -> int:
        slot = (self.index[(name, src, dst)] * self.m + mb) * _ELEMENTS + element
        return (slot << 1) | int(backward)


_ELEMENTS = 64  # tensors per communicated value (a tuple of tensors is sent element by element)


def messages_of(info: dict[Edge, ir.ValueInfo], chunks: int,
                placement: Sequence[int]) -> list[Message]:
    """Every message of these edges: each leaf forward, and back the gradient of each leaf
    that needs one; placement[stage] is the stage's rank."""
    out = []
    for (tag, src, dst), value in sorted(info.items()):
        for k, leaf in enumerate(ir.leaves(value)):
            for mb in range(chunks):
                out.append(Message(placement[src], placement[dst], tag, mb, False, src, dst, k))
                if ir.carries_grad(leaf):
                    out.append(Message(placement[dst], placement[src], tag, mb, True, dst, src, k))
    return out


def activation_of(msg: Message) -> Message:
    """The forward message whose gradient `msg` is."""
    return Message(msg.dst_rank, msg.src_rank, msg.value, msg.microbatch, False, msg.receiver,
                   msg.sender, msg.element)


def gradient_of(msg: Message) -> Message:
    """The message that carries the gradient of forward message `msg` back."""
    return Message(msg.dst_rank, msg.src_rank, msg.value, msg.microbatch, True, msg.receiver,
                   msg.sender, msg.element)

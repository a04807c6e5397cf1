"""The send and recv operations that stage graphs call: thin calls into a Comm."""
from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Comm", "send", "recv"]


class Comm(Protocol):
    """What a stage sees of communication for one micro-batch.

    The executor hands each stage forward a Comm bound to its stage index and micro-batch, so
    stage code only names the value (its tag) and the peer stage.
    """

    def recv(self, tag: str, src: int) -> Any: ...

    def send(self, value: Any, tag: str, dst: int) -> None: ...


def recv(comm: Comm, tag: str, *, src: int) -> Any:
    """Receives value `tag` from stage `src`."""
    return comm.recv(tag, src)


def send(comm: Comm, value: Any, tag: str, *, dst: int) -> None:
    """Sends `value` (named `tag`) to stage `dst`."""
    comm.send(value, tag, dst)

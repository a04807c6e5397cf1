"""How a batch of sends and receives reaches the other ranks: torch.distributed, or strict mode.

`post(ops)` posts the operations of one tick as one batch and returns a handle per receive;
the transport holds each send's tensor until that send completes (not until the step ends), and
`flush()` waits for them all. fxpipe/runtime/planning/plan.py says in what order batches are posted.

* `TorchTransport` calls `dist.batch_isend_irecv`: one NCCL group under nccl; under gloo one
  send or receive per operation, as isend/irecv post it, with a tag per message, so a wrong
  order hangs instead of delivering the wrong tensor.
* `StrictTransport` (fxpipe/runtime/communication/strict.py) runs on gloo and behaves like NCCL, to
test
  schedules on CPU: FXPIPE_P2P=strict, or `p2p="strict"` in the executor.

Environment:
    FXPIPE_P2P              "batched" (default) or "strict"
    FXPIPE_P2P_EAGER_BYTES  strict mode: sends smaller than this complete without waiting for
                            their receive, as NCCL's eager buffer (default 0: every send waits)
    FXPIPE_P2P_TIMEOUT      strict mode: seconds a wait lasts before it is reported as a hang
                            (default 60)
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fxpipe.errors import PeerLostError
from fxpipe.runtime.communication.backend import carries_cuda

__all__ = ["Op", "Handle", "Transport", "TorchTransport", "SendReaper", "P2P_MODES"]

P2P_MODES = ("batched", "strict")


@dataclass
class Op:
    """One send or receive of a batch."""

    kind: str  # "send" | "recv"
    tensor: torch.Tensor  # contiguous
    peer: int  # the other end's global rank
    tag: int = 0  # used by gloo only; NCCL and strict mode match by order
    label: str = ""  # names the message in errors; strict mode checks both ends agree
    # a send whose reply proves it complete (an activation whose gradient comes back once the
    # peer has used it), named by that reply: see Transport.settle
    answered: Any = None


class Handle(Protocol):
    def wait(self) -> None: ...


class Transport(Protocol):
    def post(self, ops: Sequence[Op]) -> list[Handle | None]:
        """Posts one batch; a handle per receive (None for a send: the transport keeps each
        send's tensor until the send completes, then drops it)."""
        ...

    def flush(self) -> None:
        """Waits until every send has completed."""
        ...

    def settle(self, answered: Any) -> None:
        """The reply named by a send's `answered` has arrived: that send is complete, and
        the transport may drop it now."""
        ...

    def set_timeout(self, seconds: float) -> None:
        """How long a wait for a peer may last before it is reported lost."""
        ...

    @property
    def by_tag(self) -> bool:
        """Whether a send meets its receive by tag (gloo), whatever the order they were posted
        in; NCCL (and strict mode) match by order."""
        ...

    @property
    def peak(self) -> int:
        """The most send tensors held at once since reset_peak()."""
        ...

    def reset_peak(self) -> None: ...


def _lost(peer: int, e: BaseException) -> PeerLostError:
    return PeerLostError(f"point-to-point with rank {peer} failed: {str(e).splitlines()[0]}",
                         hint="another rank failed, exited or timed out; its error says why")


def _wait(work: Any, timeout: timedelta | None) -> None:
    """A gloo wait with the timeout given (else its group's, fixed when the group was made); a
    NCCL wait without one, which only orders streams where one would block the host."""
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


class _Works:
    """The torch works behind one receive (NCCL returns one work for a whole batch)."""

    def __init__(self, works: list[Any], peer: int, timeout: timedelta | None = None) -> None:
        self.works = works
        self.peer = peer
        self.timeout = timeout

    def wait(self) -> None:
        try:
            for work in self.works:
                _wait(work, self.timeout)
        except RuntimeError as e:
            raise _lost(self.peer, e) from e


class SendReaper:
    """Holds the tensors of sends in flight and drops each once its send has completed.

    Gloo's works report completion only through a blocking wait(), so a thread waits for them
    in posting order. NCCL's works answer is_completed() from their CUDA event: they are
    polled whenever a batch is posted (wait() there would only order streams).

    A gloo send with a reply (`park`: a message the peer sends once it has used this one, e.g.
    an activation's gradient; NOTE [Replies] in fxpipe/runtime/planning/plan.py) is not handed to
    the thread: the reply proves it complete, so `settle` drops it on the caller's thread, its
    wait() returning at once. Waking the thread for every send and handing the GIL back and
    forth cost the tiny GPT's 1F1B ranks about 1 ms of a 15 ms step's CPU.
    """

    def __init__(self, *, poll: bool) -> None:
        self.poll = poll
        self.held: list[tuple[list[Any], list[torch.Tensor], int]] = []
        self.count = 0  # tensors held now
        self.peak = 0  # most tensors held at once since reset_peak()
        self.error: BaseException | None = None
        self.lock = threading.Condition()
        self.queue: queue.Queue[tuple[list[Any], list[torch.Tensor], int]] = queue.Queue()
        self.running = False  # the waiting thread runs while there are sends, then exits
        self.timeout: timedelta | None = None  # a gloo send's wait (None: its group's)
        # by reply: the sends it proves complete
        self.parked: dict[Any, list[tuple[list[Any], list[torch.Tensor], int]]] = {}

    def add(self, works: list[Any], tensors: list[torch.Tensor], peer: int) -> None:
        with self.lock:
            self.count += len(tensors)
            self.peak = max(self.peak, self.count)
            if not self.poll:
                self.queue.put((works, tensors, peer))
                if not self.running:
                    self.running = True
                    threading.Thread(target=self._run, name="fxpipe-p2p-sends",
                                     daemon=True).start()
                return
        self.held.append((works, tensors, peer))
        self.held = [h for h in self.held if not self._done_polled(h)]

    def park(self, answered: Any, works: list[Any], tensors: list[torch.Tensor],
             peer: int) -> None:
        """Holds a send until `settle(answered)` (or `flush`); see the class docstring."""
        if self.poll:  # NCCL: polled like any other send
            self.add(works, tensors, peer)
            return
        with self.lock:
            self.count += len(tensors)
            self.peak = max(self.peak, self.count)
        self.parked.setdefault(answered, []).append((works, tensors, peer))

    def settle(self, answered: Any) -> None:
        """The reply of a parked send arrived: its wait() returns at once; drop it (a failed
        wait is raised by `flush`, as the thread's are)."""
        for entry in self.parked.pop(answered, ()):
            self._settle(entry)

    def _done_polled(self, entry: tuple[list[Any], list[torch.Tensor], int]) -> bool:
        if not all(w.is_completed() for w in entry[0]):
            return False
        self._release(entry)
        return True

    def _release(self, entry: tuple[list[Any], list[torch.Tensor], int]) -> None:
        with self.lock:
            self.count -= len(entry[1])
            self.lock.notify_all()

    def _run(self) -> None:
        while True:
            try:
                entry = self.queue.get(timeout=1.0)
            except queue.Empty:
                with self.lock:
                    if self.queue.empty():
                        self.running = False
                        return
                continue
            self._settle(entry)
            del entry

    def _settle(self, entry: tuple[list[Any], list[torch.Tensor], int]) -> None:
        """Waits for an entry's sends, drops its works, then releases its tensors: no work
        outlives the step whose flush waits for the release, so none is left for the thread
        to destroy after the process group is gone. Runs on the thread, or on the caller's
        for a parked send."""
        works = entry[0]
        try:
            for work in works:
                _wait(work, self.timeout)
        except RuntimeError as e:
            self.error = self.error or _lost(entry[2], e)
        works.clear()
        self._release(entry)

    def flush(self) -> None:
        for answered in list(self.parked):  # replies that never came: a send without its use
            self.settle(answered)
        if self.poll:
            for entry in self.held:
                try:
                    for work in entry[0]:
                        work.wait()
                except RuntimeError as e:
                    raise _lost(entry[2], e) from e
                self._release(entry)
            self.held = []
        else:
            with self.lock:
                while self.count and self.error is None:
                    self.lock.wait(1.0)
        if self.error is not None:
            raise self.error


class TorchTransport:
    """`dist.batch_isend_irecv` over `group`."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.tags = not carries_cuda(dist.get_backend(group))  # gloo matches by tag
        self.sends = SendReaper(poll=not self.tags)
        self._peers: dict[int, int] = {}  # global rank -> its rank in the group

    def post(self, ops: Sequence[Op]) -> list[Handle | None]:
        if not ops:
            return []
        if self.tags:  # gloo: batch_isend_irecv runs one isend or irecv per operation
            return [self._post_one(op) for op in ops]
        p2p = [dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, op.tensor, op.peer,
                          self.group, tag=0) for op in ops]  # NCCL matches by order
        try:
            works = dist.batch_isend_irecv(p2p)
        except RuntimeError as e:
            raise _lost(ops[0].peer, e) from e
        sends = [op for op in ops if op.kind == "send"]
        if len(works) == len(ops):  # one work per operation
            for work, op in zip(works, ops):
                if op.kind == "send":
                    self.sends.add([work], [op.tensor], op.peer)
            return [_Works([w], op.peer, self.sends.timeout) if op.kind == "recv" else None
                    for w, op in zip(works, ops)]
        if sends:  # one group (NCCL): its sends are done when all of it is
            self.sends.add(list(works), [op.tensor for op in sends], sends[0].peer)
        return [_Works(list(works), op.peer) if op.kind == "recv" else None for op in ops]

    def _post_one(self, op: Op) -> Handle | None:
        """One operation as dist.isend or dist.irecv posts it, to the process group itself:
        their checks and group lookups, repeated for every message, were a fifth of a rank's
        Python calls per step."""
        group: Any = self.group if self.group is not None else dist.group.WORLD
        peer = self._peers.get(op.peer)
        if peer is None:
            peer = self._peers[op.peer] = op.peer if self.group is None else \
                dist.get_group_rank(self.group, op.peer)
        tensor = torch.view_as_real(op.tensor) if op.tensor.is_complex() else op.tensor
        try:
            if op.kind == "send":
                work = group.send([tensor], peer, op.tag)
            else:
                work = group.recv([tensor], peer, op.tag)
        except RuntimeError as e:
            raise _lost(op.peer, e) from e
        if op.kind == "send":
            if op.answered is not None:
                self.sends.park(op.answered, [work], [op.tensor], op.peer)
            else:
                self.sends.add([work], [op.tensor], op.peer)
            return None
        return _Works([work], op.peer, self.sends.timeout)

    def flush(self) -> None:
        self.sends.flush()

    def settle(self, answered: Any) -> None:
        self.sends.settle(answered)

    def set_timeout(self, seconds: float) -> None:
        """gloo's waits for a peer last `seconds` (NCCL's watchdog reads its group's)."""
        self.sends.timeout = timedelta(seconds=seconds) if self.tags else None

    @property
    def by_tag(self) -> bool:
        return self.tags

    @property
    def peak(self) -> int:
        return self.sends.peak

    def reset_peak(self) -> None:
        self.sends.peak = self.sends.count

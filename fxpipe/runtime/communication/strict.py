"""Strict point-to-point on gloo: NCCL's ordering rules, enforced and checked, on CPU.

Gloo matches a receive to a send by tag and buffers sends of any size, which hides ordering
bugs that hang under NCCL. StrictTransport gives gloo NCCL's rules instead:

* No tags: per pair and direction, messages match first-in-first-out. Each carries a header
  with a sequence number, its label (value, micro-batch, stages) and its size; the receiver
  checks them against what it expects and names both messages on a mismatch.
* A rank's batches run one after another, as NCCL groups on one stream: batch n+1 starts when
  every operation of batch n has completed. Inside a batch the operations progress together,
  one lane per peer and direction, each lane in the order posted.
* Rendezvous: a send waits for a clear-to-send from its receiver, which the receiver sends only
  when it has posted and reached that receive. Sends smaller than `eager_bytes` skip this, as
  NCCL's eager buffer does (default 0: every send waits).
* A wait that lasts `timeout_s` is reported as a hang, with what this rank's stream is blocked
  on, instead of hanging.

Channels (gloo tags, fixed): clear-to-send (receiver -> sender), header and data (sender ->
receiver).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.errors import ConfigError, PeerLostError, PipelineRuntimeError
from fxpipe.runtime.communication.transport import (
    P2P_MODES,
    Handle,
    Op,
    SendReaper,
    TorchTransport,
    Transport,
)

__all__ = ["StrictTransport", "make_transport"]

_CTS, _HEADER, _DATA = 1, 2, 3
_HEADER_BYTES = 256
_LABEL_BYTES = _HEADER_BYTES - 24
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


def _encode(seq: int, tensor: torch.Tensor, label: str) -> torch.Tensor:
    header = torch.zeros(_HEADER_BYTES, dtype=torch.uint8)
    code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else -1
    header[:24].view(torch.int64).copy_(torch.tensor([seq, tensor.numel() * tensor.element_size(),
                                                      code]))
    text = label.encode()[:_LABEL_BYTES]
    header[24:24 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return header


def _decode(header: torch.Tensor) -> tuple[int, int, str, str]:
    seq, nbytes, code = header[:24].view(torch.int64).tolist()
    label = bytes(header[24:].tolist()).rstrip(b"\0").decode(errors="replace")
    return seq, nbytes, str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else "?", label


def _describe(op: Op) -> str:
    t = op.tensor
    return f"{op.label or 'a message'} ({str(t.dtype).replace('torch.', '')}{list(t.shape)})"


class _Batch:
    def __init__(self, number: int, ops: list[Op]) -> None:
        self.number = number
        self.ops = ops
        self.done = threading.Event()
        self.error: BaseException | None = None


class _StrictHandle:
    def __init__(self, transport: StrictTransport, batch: _Batch, op: Op) -> None:
        self.transport, self.batch, self.op = transport, batch, op

    def wait(self) -> None:
        if not self.batch.done.wait(self.transport.timeout_s):
            raise PipelineRuntimeError(
                f"strict point-to-point: rank {self.transport.rank} waited "
                f"{self.transport.timeout_s:g} s for batch #{self.batch.number} "
                f"({self.op.kind} {_describe(self.op)}, peer rank {self.op.peer}); "
                f"{self.transport.blocked_on()}",
                hint="the ranks post their operations in orders that cannot both progress: "
                     "this hangs under NCCL; post each tick's sends and receives together in "
                     "one agreed order (fxpipe/runtime/planning/plan.py)")
        if self.batch.error is not None:
            raise self.batch.error


class StrictTransport:
    """NCCL's rules on a gloo group (see the module docstring)."""

    def __init__(self, group: Any = None, *, eager_bytes: int = 0, timeout_s: float = 60.0) -> None:
        self.group = group
        self.rank = dist.get_rank()
        self.eager_bytes = eager_bytes
        self.timeout_s = timeout_s
        self.sent: dict[int, int] = defaultdict(int)  # messages sent to each peer so far
        self.received: dict[int, int] = defaultdict(int)
        self.posted = 0
        self.failure: BaseException | None = None
        self.current: _Batch | None = None
        self.lanes: dict[tuple[int, str], str] = {}  # what each lane of the current batch does
        self.eager = SendReaper(poll=False)  # eager sends gloo has not delivered yet
        self.last: _Batch | None = None
        self.held = 0  # tensors of sends in batches not completed yet
        self.most = 0
        self.lock = threading.Lock()
        self.queue: queue.Queue[_Batch] = queue.Queue()
        self.running = False  # the stream's thread runs while there are batches, then exits

    def set_timeout(self, seconds: float) -> None:
        """A wait for a peer is reported as a hang after `seconds`."""
        self.timeout_s = seconds

    def post(self, ops: Sequence[Op]) -> list[Handle | None]:
        if not ops:
            return []
        for op in ops:
            if not op.tensor.is_contiguous():
                raise PipelineRuntimeError(f"strict point-to-point: {_describe(op)} is not "
                                           "contiguous", hint="send and receive contiguous tensors")
        batch = _Batch(self.posted, list(ops))
        self.posted += 1
        with self.lock:
            self.held += sum(op.kind == "send" for op in ops)
            self.most = max(self.most, self.held + self.eager.count)
            self.queue.put(batch)
            if not self.running:
                self.running = True
                threading.Thread(target=self._stream, name="fxpipe-p2p-strict",
                                 daemon=True).start()
        self.last = batch
        return [_StrictHandle(self, batch, op) if op.kind == "recv" else None for op in ops]

    def flush(self) -> None:
        """Waits for every batch posted so far, then for eager sends gloo still delivers."""
        if self.last is not None:
            last = Op("flush", torch.empty(0), -1, label="the last batch")
            _StrictHandle(self, self.last, last).wait()
            self.last = None
        self.eager.flush()

    def settle(self, answered: Any) -> None:
        """Nothing to do: a batch's sends are dropped when its stream completes it."""

    @property
    def by_tag(self) -> bool:
        return False  # NCCL's order-based matching

    @property
    def peak(self) -> int:
        return self.most

    def reset_peak(self) -> None:
        self.most = self.held + self.eager.count

    def blocked_on(self) -> str:
        batch = self.current
        if batch is None:
            return "its stream is idle"
        doing = "; ".join(v for v in self.lanes.values() if v) or "finishing"
        return f"its stream is at batch #{batch.number}: {doing}"

    # -- the stream: batches one after another, lanes of a batch together -------------------------

    def _stream(self) -> None:
        while True:
            try:
                batch = self.queue.get(timeout=1.0)
            except queue.Empty:
                with self.lock:
                    if self.queue.empty():
                        self.running = False
                        return
                continue
            self.current = batch
            if self.failure is None:
                try:
                    self._run(batch)
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                    self.failure = e
            batch.error = self.failure
            self.current = None
            with self.lock:
                self.held -= sum(op.kind == "send" for op in batch.ops)
            batch.done.set()
            del batch

    def _run(self, batch: _Batch) -> None:
        lanes: dict[tuple[int, str], list[Op]] = {}
        for op in batch.ops:
            lanes.setdefault((op.peer, op.kind), []).append(op)
        self.lanes = {key: "" for key in lanes}
        errors: list[BaseException] = []
        threads = [threading.Thread(target=self._lane, args=(key, ops, errors), daemon=True)
                   for key, ops in lanes.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _lane(self, key: tuple[int, str], ops: list[Op], errors: list[BaseException]) -> None:
        try:
            for op in ops:
                (self._send if op.kind == "send" else self._recv)(key, op)
            self.lanes[key] = ""
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def _wait(self, work: Any, key: tuple[int, str], doing: str) -> None:
        self.lanes[key] = doing
        start = time.monotonic()
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            if time.monotonic() - start >= self.timeout_s * 0.99:
                raise PipelineRuntimeError(
                    f"strict point-to-point: rank {self.rank} made no progress for "
                    f"{self.timeout_s:g} s: {doing}",
                    hint="the ranks post their operations in orders that cannot both progress "
                         "(a hang under NCCL)") from e
            raise PeerLostError(f"point-to-point with rank {key[0]} failed: "
                                f"{str(e).splitlines()[0]}",
                                hint="another rank failed, exited or timed out") from e

    def _send(self, key: tuple[int, str], op: Op) -> None:
        peer, seq = op.peer, self.sent[op.peer]
        self.sent[peer] += 1
        if op.tensor.numel() * op.tensor.element_size() >= self.eager_bytes:
            cts = torch.empty(1, dtype=torch.int64)
            self._wait(dist.irecv(cts, src=peer, group=self.group, tag=_CTS), key,
                       f"send {_describe(op)} to rank {peer} waits for rank {peer} to post and "
                       f"reach its receive")
            if int(cts) != seq:
                raise PipelineRuntimeError(
                    f"strict point-to-point: rank {peer} is ready for its message #{int(cts)} "
                    f"from rank {self.rank}, whose next send is #{seq}: {_describe(op)}",
                    hint="both ends must post the same messages in the same order")
            header = _encode(seq, op.tensor, op.label)
            self._wait(dist.isend(header, dst=peer, group=self.group, tag=_HEADER), key,
                       f"send the header of {_describe(op)} to rank {peer}")
            self._wait(dist.isend(op.tensor, dst=peer, group=self.group, tag=_DATA), key,
                       f"send {_describe(op)} to rank {peer}")
            return
        # Eager: complete at once, as a send into NCCL's buffer does. Gloo delivers it when the
        # receiver gets there; the tensors stay alive until then.
        header = _encode(seq, op.tensor, op.label)
        works = [dist.isend(header, dst=peer, group=self.group, tag=_HEADER),
                 dist.isend(op.tensor, dst=peer, group=self.group, tag=_DATA)]
        self.eager.add(works, [header, op.tensor], peer)

    def _recv(self, key: tuple[int, str], op: Op) -> None:
        peer, seq = op.peer, self.received[op.peer]
        self.received[peer] += 1
        nbytes = op.tensor.numel() * op.tensor.element_size()
        if nbytes >= self.eager_bytes:
            cts = torch.tensor([seq], dtype=torch.int64)
            self._wait(dist.isend(cts, dst=peer, group=self.group, tag=_CTS), key,
                       f"tell rank {peer} that receive {_describe(op)} is reached")
        header = torch.empty(_HEADER_BYTES, dtype=torch.uint8)
        self._wait(dist.irecv(header, src=peer, group=self.group, tag=_HEADER), key,
                   f"receive {_describe(op)} from rank {peer} waits for rank {peer} to send it")
        their_seq, their_bytes, their_dtype, their_label = _decode(header)
        expected = op.label
        if (their_seq, their_label, their_bytes) != (seq, expected, nbytes) \
                or their_dtype != str(op.tensor.dtype):
            raise PipelineRuntimeError(
                f"strict point-to-point: rank {self.rank} expected message #{seq} from rank "
                f"{peer} to be {_describe(op)} ({nbytes} bytes), but rank {peer} sent message "
                f"#{their_seq}: {their_label} ({their_dtype.replace('torch.', '')}, "
                f"{their_bytes} bytes)",
                hint="both ends must post the same messages in the same order and agree on "
                     "each one's shape and dtype")
        self._wait(dist.irecv(op.tensor, src=peer, group=self.group, tag=_DATA), key,
                   f"receive {_describe(op)} from rank {peer}")


def make_transport(mode: str | None, group: Any = None) -> Transport:
    """The transport for `mode` (None: FXPIPE_P2P, default "batched")."""
    mode = mode or os.environ.get("FXPIPE_P2P", "batched") or "batched"
    if mode not in P2P_MODES:
        raise ConfigError(f"unknown point-to-point mode {mode!r} (known: {', '.join(P2P_MODES)})",
                          hint="set FXPIPE_P2P=batched or FXPIPE_P2P=strict")
    if mode == "batched":
        return TorchTransport(group)
    if dist.get_backend(group) != "gloo":
        raise ConfigError(f"strict point-to-point runs on gloo (this group uses "
                          f"{dist.get_backend(group)})",
                          hint="strict mode tests on CPU what NCCL does; unset FXPIPE_P2P on GPUs")
    return StrictTransport(group, eager_bytes=int(os.environ.get("FXPIPE_P2P_EAGER_BYTES", "0")),
                           timeout_s=float(os.environ.get("FXPIPE_P2P_TIMEOUT", "60")))

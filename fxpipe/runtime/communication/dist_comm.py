"""Point-to-point communication of one rank's stages over torch.distributed, and the backward
each micro-batch runs on its received leaves and sent values (NOTE [Gradients across stages] in
fxpipe/runtime/comm.py).

NOTE [Split backward]
Zero-bubble schedules split a micro-batch's backward in two
(fxpipe/runtime/execution/split_backward.py). I (`backward_input`) runs autograd from the loss or
the sent values to the received leaves only: it walks the input closure, the nodes from which a
received leaf is reachable, and sends the leaves' gradients back at once, since the previous stage
waits for them. The same autograd call captures, on the way, the incoming gradient of each
intermediate: a node of the closure with an edge toward a weight (which nodes these are is read from
the stage's first graph and kept in `split_plans`, fxpipe/runtime/execution/backward_graph.py). W
(`backward_weight`) later starts autograd at the intermediates with those gradients
and walks only what lies between them and the weights: it reruns each intermediate for its
weight-side outputs (a Linear's dW and db; a custom autograd Function computes all of its
outputs again) and the nodes that lead only to weights, never the input-only nodes I ran. Each
weight's gradient reaches its .grad through AccumulateGrad once, so post-accumulate hooks fire
as in a plain backward. Between I and W the rank keeps the intermediates, the graph below them
(input-only nodes there keep their saved tensors until W frees everything) and the kept
gradients; the sent values are detached where nothing else holds them, which frees the graph
above the intermediates. Where W computes every weight's gradient itself and the micro-batch
recomputed no remat region, I instead reads the inputs W's kernels need (a linear's x) and
frees the whole graph, as a plain backward would: from I to W the micro-batch keeps only those
inputs and the captured gradients (`release`; the memory model counts them so,
Report.kept_by_rank).

A micro-batch with an output that depends on no received leaf but reaches a weight (every
micro-batch of a first stage; `w * x_input` sent beside `f(received)`) falls back: I takes the
leaves' gradients with the whole graph retained, and W runs a full backward from the outputs
with inputs= the stage's parameters, so W costs a whole backward there. This is decided per
stage and micro-batch from the graph, so any mixture of split and fallback micro-batches is
exact. Remat regions recompute per autograd call: I recomputes a region it reaches, as a plain
backward would, and W recomputes it once more when it needs tensors saved inside it (W's
autograd calls, one per group of weights that share intermediates, share one GraphExecGroup, so
once in all), so under remat W costs one extra forward of each region it reaches on top of the
weight gradients; reusing I's recomputation instead would hold the region's activations from I
to W, which remat exists to avoid. Gradients summed over tied stages or replicas are reduced
after the step's last action, so after every W.

DistComm posts nothing itself when the stage code calls send/recv: `send` leaves the value in an
outbox and `recv` waits for a receive posted earlier. At each tick of the rank's plan
(fxpipe/runtime/planning/plan.py) `begin_tick` posts that tick's sends and receives as one batch, in
the plan's order, which NCCL needs (see NOTE [Deadlock-free point-to-point] there).

Under autocast, values cross stages in the dtype they have. Receive buffers need it before the
data arrives: the first step under a new autocast state learns it (each forward message is
preceded by a one-number header, a batch of its own in the same tick), later steps reuse it.
Without autocast the compiled dtypes hold. A sent value whose shape or dtype differs from what
its receiver expects is an error naming the value, the stage and both.

NOTE [Absent gradients]
A received value the loss does not reach (an output the loss ignores, a value read only through
argmax or a comparison) gets no gradient, and its sender must then add nothing to its weights'
gradients: a weight that only such a value reaches keeps none, as in the plain model, where a
zero gradient would have weight decay and momentum move it. Yet the sender has posted a receive
for the gradient, and reading the gradient's values on the host would stall every step. So the
first step with each loss function learns which values get none: each gradient message then has
a one-number header (1: a gradient, 0: none), posted just before it in the same batch on both
ends and read when the gradient is; the receiver sends zeros in place of none, and the sender
leaves the message out of its backward. A value that got no gradient in any micro-batch of that
step is absent from then on: its receiver still sends zeros and its sender leaves them out, with
no header. Should such a value get a gradient in a later step (a loss that reads an output only
on some batches), its receiver raises rather than drop it; a value that got a gradient when
learned but gets none in a later micro-batch adds zeros, which changes no sum.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.utils._pytree as pytree

from fxpipe import ir
from fxpipe.errors import PipelineRuntimeError
from fxpipe.runtime.communication.receive_buffers import ReceiveBuffers
from fxpipe.runtime.communication.tags import Edge, TagTable, activation_of, gradient_of
from fxpipe.runtime.communication.transport import Handle, Op, Transport
from fxpipe.runtime.execution.loss_split import WeightedLoss
from fxpipe.runtime.execution.split_backward import (
    SplitPlans,
    WeightPass,
    engine_backward,
    input_backward,
)
from fxpipe.runtime.planning.plan import Message, Tick

__all__ = ["DistComm", "DTYPE_CODES"]


_HEADER_TAG = 1 << 30  # added to a message's tag for its header (dtype, gradient or none)
DTYPE_CODES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
               torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]


def _short(dtype: torch.dtype, shape: Sequence[int]) -> str:
    return f"{str(dtype).replace('torch.', '')}{list(shape)}"


@dataclass
class _Record:
    received: list[tuple[torch.Tensor, Message]] = field(default_factory=list)
    sent: list[tuple[torch.Tensor, Message]] = field(default_factory=list)


class DistComm:
    """Point-to-point over torch.distributed for one rank's stages and one step.

    Which values carry gradients back is decided from the compiled value info on both ends
    (floating tensors that require grad), so every message has exactly one receiver.

    Args:
        rank: this rank's index in the plan; global_ranks[r] is plan rank r's process.
        placement: placement[stage] is the plan rank that runs the stage.
        info: (value, src stage, dst stage) -> value info, for this rank's stages' edges.
        dtypes: (value, src, dst, element) -> dtype of forward tensors where known; `learn`
            fills in the others (see the module docstring).
        buffers: receive buffers kept across steps (the caller's; None: a new one each).
        labels: each message's tag and text, kept across steps of this many micro-batches by
            the caller (None: made again each step).
        absent: (value, src, dst, element) of the values whose gradient the loss does not
            reach, learned on the first step with the loss (None: this step learns them; NOTE
            [Absent gradients]).
    """

    def __init__(self, *, rank: int, global_ranks: Sequence[int], placement: Sequence[int],
                 info: dict[Edge, ir.ValueInfo], microbatch_size: int, device: torch.device,
                 transport: Transport, tags: TagTable | None = None,
                 dtypes: dict[tuple[str, int, int, int], torch.dtype] | None = None,
                 learn: bool = False, timeline: Any = None,
                 written: frozenset[Edge] = frozenset(),
                 split_plans: dict[int, SplitPlans] | None = None,
                 buffers: ReceiveBuffers | None = None,
                 labels: dict[Message, tuple[int, str]] | None = None,
                 absent: set[tuple[str, int, int, int]] | None = None) -> None:
        self.rank = rank
        self.global_ranks = list(global_ranks)
        self.placement = list(placement)
        self.info = info
        self.b = microbatch_size
        self.device = device
        self.transport = transport
        self.tags = tags
        self.dtypes = dtypes if dtypes is not None else {}
        self.learn = learn
        self.timeline = timeline
        self.written = written  # receives the stage writes into: it gets a copy (recv)
        self.records: dict[tuple[int, int], _Record] = {}  # (stage, mb) -> what crossed
        self.outbox: dict[Message, torch.Tensor] = {}  # produced, posted at its tick
        self.inbox: dict[Message, tuple[Handle | None, torch.Tensor]] = {}  # posted receives
        self.sent_values: dict[Message, torch.Tensor] = {}  # grad buffers take their shape
        # sends whose gradient comes back: the transport drops them when it arrives
        self.answered: set[Message] = set()
        self.retained: dict[tuple[int, int], WeightPass] = {}  # (stage, mb): I done, W to run
        # per stage, what reading its backward graph found (kept across steps by the caller)
        self.split_plans = split_plans if split_plans is not None else {}
        self.buffers = buffers
        self.labels = labels if labels is not None else {}
        self.learn_gradients = absent is None
        self.absent = absent if absent is not None else set()
        # learning: the gradient messages of this step that carry none, and for each value
        # whether any micro-batch's gradient came
        self.missing: set[Message] = set()
        self.reached: dict[tuple[str, int, int, int], bool] = {}
        # a send -> the message from its peer whose arrival proves it complete
        # (fxpipe.runtime.planning.plan.replies): the transport holds the send until then.
        # `proofs` are those replies, the receives that settle held sends. The executor sets
        # both once it has the step's plan.
        self.replies: dict[Message, Message] = {}
        self.proofs: frozenset[Message] = frozenset()

    def carries_host_tensors(self, src: int, dst: int) -> bool:
        """Whether a host tensor stage `src` sends to stage `dst` arrives as it is: on a CPU
        device, or handed over between two stages of this rank."""
        return self.device.type == "cpu" or self.placement[src] == self.placement[dst]

    # -- posting --------------------------------------------------------------------------------

    def begin_tick(self, tick: Tick) -> None:
        """Posts the tick's sends and receives as one batch, in the plan's order."""
        remote = []
        for msg in tick.post:
            if msg.src_rank == msg.dst_rank:  # two stages of this rank: hand it over
                value = self._take(msg)  # a copy only for a stage that writes into it
                self.answered.discard(msg)
                written = not msg.grad and (msg.value, msg.sender, msg.receiver) in self.written
                self.inbox[msg] = (None, value.clone() if written else value)
                if msg.grad:  # its value's gradient is here: the value need not be held on
                    self.sent_values.pop(activation_of(msg), None)
            else:
                remote.append(msg)
        if not remote:
            return
        if self.learn:
            self._exchange_dtypes([m for m in remote if not m.grad and self._is_tensor(m)])
        if self.learn_gradients:  # each gradient message after its header
            remote = [h for m in remote for h in ((_presence_of(m), m) if m.grad else (m,))]
        ops = [self._op(msg) for msg in remote]
        start = time.perf_counter()
        handles = self.transport.post(ops)
        self._record_posts(remote, start)
        for msg, op, handle in zip(remote, ops, handles):
            if op.kind == "recv":
                self.inbox[msg] = (handle, op.tensor)

    def _op(self, msg: Message) -> Op:
        if msg.microbatch < 0:  # a gradient's presence header (learning step)
            real = _presence_of(msg)
            tag, text = self._tag(real) + _HEADER_TAG, f"presence of {real}"
            if msg.src_rank == self.rank:
                code = torch.tensor([int(real not in self.missing)], device=self.device)
                return Op("send", code, self.global_ranks[msg.dst_rank], tag, text)
            return Op("recv", torch.empty(1, dtype=torch.int64, device=self.device),
                      self.global_ranks[msg.src_rank], tag, text)
        if msg.src_rank == self.rank:
            if msg in self.answered:  # held until its gradient, storage backward keeps anyway
                answered: Message | None = gradient_of(msg)
            elif msg in self.sent_values:  # an activation sent as a contiguous copy: dropped
                answered = None  # as soon as sent, not held through the forwards to a reply
            else:
                answered = self.replies.get(msg)
            self.answered.discard(msg)
            tag, text = self._label(msg)
            return Op("send", self._take(msg), self.global_ranks[msg.dst_rank], tag, text,
                      answered)
        tag, text = self._label(msg)
        return Op("recv", self._buffer(msg), self.global_ranks[msg.src_rank], tag, text)

    def _label(self, msg: Message) -> tuple[int, str]:
        """The message's tag and its text (for errors), made once per program and micro-batch
        count: a step posts every message, and both are the same every step."""
        try:
            return self.labels[msg]
        except KeyError:
            label = self.labels[msg] = (self._tag(msg), str(msg))
            return label

    def _take(self, msg: Message) -> torch.Tensor:
        try:
            return self.outbox.pop(msg)
        except KeyError:
            raise PipelineRuntimeError(f"{msg} is due to be sent, but stage {msg.sender} has not "
                                       "produced it", hint="this is a scheduling bug; please "
                                       "report it") from None

    def _tag(self, msg: Message) -> int:
        if self.tags is None:
            return 0
        a = activation_of(msg) if msg.grad else msg
        return self.tags.tag(msg.value, a.sender, a.receiver, msg.microbatch, msg.grad,
                             msg.element)

    def _leaf_info(self, msg: Message) -> ir.ValueInfo:
        a = activation_of(msg) if msg.grad else msg
        return ir.leaves(self.info[(msg.value, a.sender, a.receiver)])[msg.element]

    def _is_tensor(self, msg: Message) -> bool:
        return isinstance(self._leaf_info(msg), ir.TensorInfo)

    def _buffer(self, msg: Message) -> torch.Tensor:
        """Where a message arrives: contiguous, in the shape and dtype the sender sends."""
        if msg.grad:  # the gradient of a value this rank sent: its shape and dtype
            value = self.sent_values.pop(activation_of(msg))
            shape, dtype, device = tuple(value.shape), value.dtype, value.device
        else:
            leaf = self._leaf_info(msg)
            device = self.device
            if isinstance(leaf, ir.TensorInfo):
                shape = leaf.concrete_shape(self.b)
                dtype = self.dtypes.get((msg.value, msg.sender, msg.receiver, msg.element),
                                        leaf.dtype)
            else:  # a number
                shape, dtype = (1,), torch.float64
        if self.buffers is None:
            return torch.empty(shape, dtype=dtype, device=device)
        kind = (msg.value, msg.sender, msg.receiver, msg.element, msg.grad)  # any micro-batch
        return self.buffers.get(kind, shape, dtype, device)

    def _exchange_dtypes(self, forward: list[Message]) -> None:
        """Learning step: a header with each forward tensor's dtype, one batch before the data."""
        if not forward:
            return
        ops = []
        for msg in forward:
            if msg.src_rank == self.rank:
                code = DTYPE_CODES.index(self.outbox[msg].dtype)
                ops.append(Op("send", torch.tensor([code], device=self.device),
                              self.global_ranks[msg.dst_rank], self._tag(msg) + _HEADER_TAG,
                              f"dtype of {msg}"))
            else:
                ops.append(Op("recv", torch.empty(1, dtype=torch.int64, device=self.device),
                              self.global_ranks[msg.src_rank], self._tag(msg) + _HEADER_TAG,
                              f"dtype of {msg}"))
        for msg, op, handle in zip(forward, ops, self.transport.post(ops)):
            if handle is not None:
                handle.wait()
                key = (msg.value, msg.sender, msg.receiver, msg.element)
                self.dtypes[key] = DTYPE_CODES[int(op.tensor.item())]

    def _learn_gradient(self, msg: Message, reached: bool) -> None:
        """Learning step: whether the loss reached the value `msg` carried, in its
        micro-batch."""
        key = (msg.value, msg.sender, msg.receiver, msg.element)
        self.reached[key] = self.reached.get(key, False) or reached
        if not reached:
            self.missing.add(gradient_of(msg))

    def learned_absent(self) -> set[tuple[str, int, int, int]]:
        """After a learning step: the values whose gradient no micro-batch's loss reached."""
        return {key for key, reached in self.reached.items() if not reached}

    def _record_posts(self, msgs: list[Message], start: float) -> None:
        if self.timeline is None:
            return
        for grad in (False, True):
            sent = [m for m in msgs if m.src_rank == self.rank and m.grad == grad
                    and m.microbatch >= 0]  # not presence headers
            if sent:
                self.timeline.mark("send_grad" if grad else "send", sent[0].sender,
                                   sent[0].microbatch, start,
                                   detail=", ".join(sorted({m.value for m in sent})))

    # -- forward --------------------------------------------------------------------------------

    def recv(self, tag: str, src: int, dst: int, mb: int, device: torch.device) -> Any:
        info = self.info[(tag, src, dst)]
        record = self.records.setdefault((dst, mb), _Record())
        values: list[Any] = []
        with self._event("recv", dst, mb, tag):
            for k, leaf in enumerate(ir.leaves(info)):
                msg = Message(self.placement[src], self.placement[dst], tag, mb, False, src, dst, k)
                buffer = self._wait(msg)
                if isinstance(leaf, ir.TensorInfo):
                    value = buffer.requires_grad_(ir.carries_grad(leaf) and torch.is_grad_enabled())
                    if ir.carries_grad(leaf):
                        record.received.append((value, msg))
                    # a leaf that requires grad cannot be written into: the stage gets a copy
                    written = (tag, src, dst) in self.written and value.requires_grad
                    values.append(value.clone() if written else value)
                else:
                    number = buffer.item()
                    exact = isinstance(leaf, ir.ScalarInfo) and isinstance(leaf.value, float)
                    values.append(int(number) if float(number).is_integer() and not exact
                                  else number)
        return _rebuild(info, iter(values))

    def _wait(self, msg: Message) -> torch.Tensor:
        try:
            handle, buffer = self.inbox.pop(msg)
        except KeyError:
            raise PipelineRuntimeError(f"{msg} is needed, but its receive was never posted",
                                       hint="this is a scheduling bug; please report it") from None
        if handle is not None:
            handle.wait()
            if msg.grad or msg in self.proofs:  # the sends it proves complete
                self.transport.settle(msg)
        return buffer

    def send(self, value: Any, tag: str, src: int, dst: int, mb: int) -> None:
        info = self.info[(tag, src, dst)]
        record = self.records.setdefault((src, mb), _Record())
        for k, (leaf, leaf_info) in enumerate(zip(pytree.tree_leaves(value), ir.leaves(info))):
            msg = Message(self.placement[src], self.placement[dst], tag, mb, False, src, dst, k)
            if isinstance(leaf, torch.Tensor):
                self._check(leaf, leaf_info, msg)
                self.outbox[msg] = leaf.detach().contiguous()
            else:
                self.outbox[msg] = torch.tensor([float(leaf)], dtype=torch.float64,
                                                device=self.device)
            if ir.carries_grad(leaf_info) and torch.is_grad_enabled():  # else no backward
                record.sent.append((leaf, msg))
                self.sent_values[msg] = leaf
                if isinstance(leaf, torch.Tensor) and leaf.is_contiguous():
                    # the send holds the value backward keeps anyway, until its gradient
                    # proves it received
                    self.answered.add(msg)

    def _check(self, value: torch.Tensor, info: ir.ValueInfo, msg: Message) -> None:
        """The sent tensor must be what the receiver allocates for it."""
        if not isinstance(info, ir.TensorInfo):
            raise PipelineRuntimeError(f"stage {msg.sender} sends a tensor as {msg}, which the "
                                       f"plan has as a non-tensor ({info})",
                                       hint="the model's forward differs from the compiled one")
        shape = info.concrete_shape(self.b)
        key = (msg.value, msg.sender, msg.receiver, msg.element)
        if key not in self.dtypes and self.learn:
            self.dtypes[key] = value.dtype
        dtype = self.dtypes.get(key, info.dtype)
        if tuple(value.shape) != shape or value.dtype != dtype:
            source = "the compiled plan" if key not in self.dtypes else \
                "its shape from the compiled plan, its dtype from the first micro-batch sent " \
                "under this autocast state"
            raise PipelineRuntimeError(
                f"stage {msg.sender} sends {msg.value!r} (micro-batch {msg.microbatch}) to stage "
                f"{msg.receiver} as {_short(value.dtype, value.shape)}, but stage "
                f"{msg.receiver} expects {_short(dtype, shape)} ({source})",
                hint="the model's forward differs from the compiled one (another batch shape, "
                     "dtype, or autocast state on some rank); compile it for this input")

    # -- backward -------------------------------------------------------------------------------

    def backward(self, stage: int, mb: int, loss: WeightedLoss | None = None) -> None:
        """Backward of one micro-batch: gradients in, autograd, gradients out."""
        record = self.records.pop((stage, mb), _Record())
        tensors, grads = self._output_grads(record, stage, mb, loss)
        if tensors and grads[0] is None:  # a loss that is not a scalar: autograd says so
            torch.autograd.backward(tensors, grads)
        elif tensors:
            engine_backward(tensors, cast(list[torch.Tensor], grads))
        for leaf, msg in record.received:
            self._gradient_out(leaf, leaf.grad, msg)

    def backward_input(self, stage: int, mb: int, loss: WeightedLoss | None = None,
                       weights: Sequence[torch.Tensor] | None = None,
                       release: bool = False) -> list[torch.Tensor] | None:
        """The input-gradient half of a split backward (NOTE [Split backward]): gradients in,
        the received leaves' gradients out; what the weight half needs (for `weights`, by
        default every parameter in the graph) stays for `backward_weight`. `release`: no remat
        region recomputed in this micro-batch, so that I may free the graph where W needs only
        its recipes' inputs; returns those saved tensors then (None: the graph is kept)."""
        record = self.records.pop((stage, mb), _Record())
        tensors, grads = self._output_grads(record, stage, mb, loss)
        got, weight_pass = input_backward(  # generated code: no tensor hooks
            tensors, grads, [leaf for leaf, _ in record.received], weights,
            self.split_plans.setdefault(stage, {}), direct=True, release=release)
        self.retained[(stage, mb)] = weight_pass
        for (leaf, msg), grad in zip(record.received, got):
            self._gradient_out(leaf, grad, msg)
        return weight_pass.held()

    def _gradient_out(self, leaf: torch.Tensor, grad: torch.Tensor | None, msg: Message) -> None:
        """Leaves a received leaf's gradient for its sender: zeros where the loss did not reach
        it, which the sender leaves out (NOTE [Absent gradients])."""
        if self.learn_gradients:
            self._learn_gradient(msg, grad is not None)
        elif grad is not None and self.absent and \
                (msg.value, msg.sender, msg.receiver, msg.element) in self.absent:
            raise PipelineRuntimeError(
                f"the loss reached {msg.value!r}, sent by stage {msg.sender} to stage "
                f"{msg.receiver} (micro-batch {msg.microbatch}), which the first step with this "
                "loss function did not reach: its sender would drop the gradient",
                hint="a loss that reads some outputs only on some batches: read each output on "
                     "every batch (0 * output where it is not wanted), or pass another loss "
                     "function object for each way of reading them")
        out = grad if grad is not None else torch.zeros_like(leaf)
        self.outbox[gradient_of(msg)] = out.detach().contiguous()

    def backward_weight(self, stage: int, mb: int, weights: Sequence[torch.Tensor]) -> None:
        """The weight-gradient half: accumulates into `weights`' .grad from what
        `backward_input` kept, then frees it."""
        self.retained.pop((stage, mb)).run(weights)

    def _output_grads(self, record: _Record, stage: int, mb: int, loss: WeightedLoss | None
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The tensors a backward starts from (the loss, the sent values) and their gradients,
        waiting for each gradient's receive."""
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if loss is not None and loss.loss.requires_grad:
            tensors.append(loss.loss)
            grads.append(loss.start())
        for value, msg in record.sent:
            with self._event("recv_grad", stage, mb, msg.value):
                grad = self._wait(gradient_of(msg))
            if self._absent(msg):  # the loss did not reach it: zeros in place of none
                continue
            if isinstance(value, torch.Tensor) and value.requires_grad:
                tensors.append(value)
                grads.append(grad)
        return tensors, grads

    def _absent(self, msg: Message) -> bool:
        """Whether the loss did not reach the value `msg` sent (its gradient arrived)."""
        if self.learn_gradients:
            grad = gradient_of(msg)
            header = self.inbox.pop(_presence_of(grad), None)  # none from this rank's stages
            if header is not None:
                handle, code = header
                if handle is not None:
                    handle.wait()
                self._learn_gradient(msg, bool(code.item()))
            return grad in self.missing
        return bool(self.absent) and (msg.value, msg.sender, msg.receiver, msg.element) in \
            self.absent

    def finish(self) -> None:
        """Waits for every send of the step; everything posted must have been used."""
        self.transport.flush()
        left = sorted(self.outbox) + sorted(self.inbox)
        unweighted = sorted(self.retained)
        self.retained.clear()
        self.outbox.clear()
        self.inbox.clear()
        self.records.clear()
        self.sent_values.clear()
        self.answered.clear()
        self.missing.clear()
        if self.buffers is not None:
            self.buffers.end_step()
        if left:
            raise PipelineRuntimeError(f"{len(left)} messages were never sent or never used, "
                                       f"e.g. {left[0]}", hint="this is a scheduling bug; please "
                                       "report it")
        if unweighted:
            raise PipelineRuntimeError(f"{len(unweighted)} split backwards never ran their weight "
                                       f"gradient, e.g. (stage, micro-batch) {unweighted[0]}",
                                       hint="this is a scheduling bug; please report it")

    def _event(self, kind: str, stage: int, mb: int, tag: str) -> Any:
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(kind, stage, mb, detail=tag)


def _presence_of(msg: Message) -> Message:
    """The header saying whether gradient message `msg` carries a gradient, and back: the
    message with its micro-batch as -1 - m (no micro-batch is negative)."""
    return msg._replace(microbatch=-1 - msg.microbatch)


def _rebuild(info: ir.ValueInfo, values: Any) -> Any:
    if isinstance(info, tuple):
        return tuple(_rebuild(i, values) for i in info)
    return next(values)

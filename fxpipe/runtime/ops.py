"""The send and recv operations that stage graphs call: thin calls into a Comm.

NOTE [Random streams across stages]: a micro-batch draws its random numbers (dropout, stochastic
depth) from one stream, as one forward of the plain model would: stage 0 starts it from the
micro-batch's seed, and every later stage continues it from the generator state the stage
before it handed over (`hand_over_rng` at its end, `continue_rng` at the next one's start). So
the masks are the plain model's on that micro-batch, wherever the cuts fall.

Both generators keep their state on the host (a CUDA generator's is its seed and offset, read
and set without touching the device, as torch.utils.checkpoint stashes it), so the hand-over
never waits for a device: a comm that carries host tensors (the local executor's mailboxes,
gloo, two stages of one rank) gets the host state as it is, and one that carries device tensors
(NCCL) gets it by an asynchronous copy from pinned memory. Only the receiving end of such a
comm reads it back to the host, the one wait the hand-over cannot avoid: the state exists there
only once the message has arrived.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["Comm", "send", "recv", "continue_rng", "hand_over_rng", "RNG_TAG", "RNG_STATE_BYTES"]

RNG_TAG = "fxpipe_rng_state"
_CPU_STATE_BYTES = 5056  # torch.get_rng_state(): the CPU generator (Mersenne Twister)
_CUDA_STATE_BYTES = 16  # torch.cuda.get_rng_state(): seed and offset of Philox
RNG_STATE_BYTES = _CPU_STATE_BYTES + _CUDA_STATE_BYTES
"""The message that carries a micro-batch's random stream: the CPU generator's state, then the
state of the generator of the device where the stage runs (zeros on a CPU stage)."""


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


def _device_of(comm: Comm) -> torch.device:
    device = getattr(comm, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def _carries_host_tensors(comm: Comm, dst: int) -> bool:
    carries = getattr(comm, "carries_host_tensors", None)
    return bool(carries(dst)) if carries is not None else _device_of(comm).type == "cpu"


def hand_over_rng(comm: Comm, *, dst: int) -> None:
    """Sends the generator state where this stage's forward left it to stage `dst`."""
    device = _device_of(comm)
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" \
        else torch.zeros(_CUDA_STATE_BYTES, dtype=torch.uint8)
    state = torch.cat([torch.get_rng_state(), cuda])
    if state.numel() != RNG_STATE_BYTES:
        raise RuntimeError(f"generator state of {state.numel()} bytes, expected "
                           f"{RNG_STATE_BYTES}: this torch keeps its generators otherwise")
    if not _carries_host_tensors(comm, dst):  # pinned, so the copy does not block the host
        state = state.pin_memory().to(device, non_blocking=True)
    comm.send(state, RNG_TAG, dst)


def continue_rng(comm: Comm, *, src: int) -> None:
    """Continues this micro-batch's random stream where stage `src` left it."""
    state = comm.recv(RNG_TAG, src).detach()
    if state.device.type != "cpu":  # arrived in device memory (NCCL): the one host read
        state = state.to("cpu")
    torch.set_rng_state(state[:_CPU_STATE_BYTES].contiguous())
    device = _device_of(comm)
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[_CPU_STATE_BYTES:].contiguous(), device)

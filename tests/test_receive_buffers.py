"""Receive buffers kept across steps (fxpipe/runtime/communication/receive_buffers.py): one is
handed out again only when nothing else holds its memory."""
from __future__ import annotations

import torch

from fxpipe.runtime.communication.receive_buffers import ReceiveBuffers

CPU = torch.device("cpu")


def _get(buffers: ReceiveBuffers, kind: str = "h", shape: tuple[int, ...] = (2, 3),
         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return buffers.get(kind, shape, dtype, CPU)


def test_a_buffer_nothing_holds_is_handed_out_again() -> None:
    buffers = ReceiveBuffers()
    first = _get(buffers)
    ptr = first.data_ptr()
    del first
    again = _get(buffers)
    assert again.data_ptr() == ptr and again.shape == (2, 3) and again.is_contiguous()
    assert (buffers.allocated, buffers.reused) == (1, 1)


def test_a_buffer_still_held_in_any_form_is_not_written_into() -> None:
    """The buffer itself, a view or slice of it, a detached alias, autograd's saved tensor and
    a .grad that took it each keep it from the next receive."""
    def holders(t: torch.Tensor) -> list[object]:
        leaf = torch.zeros(2, 3, requires_grad=True)
        leaf.grad = t
        w = torch.ones(3, 3, requires_grad=True)
        return [t, t[0], t.detach(), t.view(3, 2), (t @ w).sum(), leaf]

    for k in range(6):
        buffers = ReceiveBuffers()
        first = _get(buffers)
        held = holders(first)[k]
        ptr = first.data_ptr()
        del first
        assert _get(buffers).data_ptr() != ptr, k  # a new buffer (dropped at once)
        assert (buffers.allocated, buffers.reused) == (2, 0), k
        del held
        assert _get(buffers).data_ptr() == ptr, k  # free again: the first kept is taken
        assert (buffers.allocated, buffers.reused) == (2, 1), k


def test_buffers_in_use_at_once_are_distinct_and_all_kept() -> None:
    buffers = ReceiveBuffers()
    a, b = _get(buffers), _get(buffers)
    assert a.data_ptr() != b.data_ptr()
    ptrs = {a.data_ptr(), b.data_ptr()}
    del a, b
    c, d = _get(buffers), _get(buffers)
    assert {c.data_ptr(), d.data_ptr()} == ptrs
    assert (buffers.allocated, buffers.reused) == (2, 2)


def test_another_shape_dtype_or_kind_gets_its_own_buffer() -> None:
    buffers = ReceiveBuffers()
    _get(buffers)
    assert _get(buffers, shape=(3, 3)).shape == (3, 3)
    assert _get(buffers, dtype=torch.bfloat16).dtype == torch.bfloat16
    _get(buffers, kind="other")
    assert (buffers.allocated, buffers.reused) == (4, 0)


def test_a_step_drops_the_kinds_it_did_not_receive() -> None:
    """A new batch size (another shape) must not leave the old buffers held for ever."""
    buffers = ReceiveBuffers()
    _get(buffers, shape=(2, 3))
    buffers.end_step()
    assert buffers.kept_bytes == 2 * 3 * 4
    _get(buffers, shape=(4, 3))
    buffers.end_step()
    assert buffers.kept_bytes == 4 * 3 * 4
    buffers.end_step()  # a step that received nothing
    assert buffers.kept_bytes == 0

"""Plain-torch models for ways video and outlook transformers broke fxpipe:

1. A wrapped helper that adds into a view of its input (torchvision's MViT, `_add_rel_pos`:
   `attn[:, :, 1:, 1:] += rel`): the cost pass gave it a leaf that needs gradients, which
   autograd does not let anything write into.

Each model is checked against the plain model at 2 stages and 2 micro-batches, in eval and in
train mode: outputs, loss and every parameter's gradient (check_transparent).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fxpipe import ir
from fxpipe.frontend.capture import capture
from fxpipe.testing.transparency import check_transparent
from passes.cost import annotate_costs


def _check(model: nn.Module, x: torch.Tensor, mode: str, **options: object) -> None:
    model.train(mode == "train")
    check_transparent(model, (x,), None, stages=2, chunks=2, remat="never", **options)


# --- 1. an in-place add into a view of an input -------------------------------------------------

def add_rel_pos(attn: torch.Tensor, q: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Adds a relative position bias to the attention between tokens, not the class token."""
    attn[:, :, 1:, 1:] += q[:, :, 1:] @ table
    return attn


torch.fx.wrap("add_rel_pos")


class _RelPos(nn.Module):
    def __init__(self, tokens: int, head_dim: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(head_dim, tokens - 1) * 0.1)

    def forward(self, attn: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return add_rel_pos(attn, q, self.table)


class _MViTLike(nn.Module):
    """Attention with a class token whose scores get a bias added in place (MViT)."""

    def __init__(self, dim: int = 8, heads: int = 2, tokens: int = 5) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.rel_pos = _RelPos(tokens, dim // heads)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * (C // self.heads) ** -0.5) @ k.transpose(-2, -1)
        attn = self.rel_pos(attn, q)
        h = (attn.softmax(-1) @ v).transpose(1, 2).reshape(B, N, C)
        return self.head(x + self.proj(h))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_helper_adding_into_a_view_of_its_input_is_costed_and_matches(mode: str) -> None:
    torch.manual_seed(0)
    _check(_MViTLike(), torch.randn(4, 5, 8), mode)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_view_written_into_at_the_start_of_a_stage(mode: str) -> None:
    torch.manual_seed(0)
    _check(_MViTLike(), torch.randn(4, 5, 8), mode, split_points=["rel_pos"])


def test_cost_of_a_helper_writing_into_its_input_counts_its_kernels() -> None:
    torch.manual_seed(0)
    gm = capture(_MViTLike().train(), (torch.randn(4, 5, 8),))
    annotate_costs(gm)
    helper = next(n for n in gm.graph.nodes if n.target is add_rel_pos)
    cost = ir.cost(helper)
    assert cost.fwd_flops.free_symbols == {ir.BATCH} and cost.bwd_kernels > 0

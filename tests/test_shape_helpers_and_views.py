"""Plain-torch models for ways video and outlook transformers broke fxpipe:

1. A wrapped helper that adds into a view of its input (torchvision's MViT, `_add_rel_pos`:
   `attn[:, :, 1:, 1:] += rel`): the cost pass gave it a leaf that needs gradients, which
   autograd does not let anything write into.
2. A wrapped helper that adapts Python lists of sizes to the input and writes into the lists it
   is given (torchvision's 3D Swin, `_get_window_and_shift_size`): shape propagation and the
   cost pass ran it on torch.fx's immutable lists.
3. A kernel that specialises the batch symbol and then fails (F.fold, as in timm's VOLO):
   its shapes came from static samples, but every later size was frozen at the example batch.

Each model is checked against the plain model at 2 stages and 2 micro-batches, in eval and in
train mode: outputs, loss and every parameter's gradient (check_transparent).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe import ir
from fxpipe.frontend import shapes
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


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_helper_adding_into_a_view_of_its_input_is_timed(mode: str) -> None:
    torch.manual_seed(0)
    model, x = _MViTLike().train(mode == "train"), torch.randn(4, 5, 8)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, balance="time")
    with torch.no_grad():
        torch.testing.assert_close(program(x), model(x))


def test_cost_of_a_helper_writing_into_its_input_counts_its_kernels() -> None:
    torch.manual_seed(0)
    gm = capture(_MViTLike().train(), (torch.randn(4, 5, 8),))
    annotate_costs(gm)
    helper = next(n for n in gm.graph.nodes if n.target is add_rel_pos)
    cost = ir.cost(helper)
    assert cost.fwd_flops.free_symbols == {ir.BATCH} and cost.bwd_kernels > 0


# --- 2. lists of sizes through a helper -----------------------------------------------------------

def window_and_shift(shift: list[int], size: list[int],
                     window: list[int]) -> tuple[list[int], list[int]]:
    """Shrinks the window to the input where the input is smaller, and does not shift there."""
    for i in range(len(size)):
        if size[i] <= window[i]:
            window[i] = size[i]
            shift[i] = 0
    return window, shift


torch.fx.wrap("window_and_shift")


class _ShiftedWindows(nn.Module):
    """Swin-style block: window and shift from a helper, pad to whole windows, roll, attend
    within windows (reshape(B, ...)), roll back."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.window, self.shift = [4, 16], [2, 2]
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        window, shift = window_and_shift(self.shift.copy(), [H, W], self.window.copy())
        pad_h = (window[0] - H % window[0]) % window[0]
        pad_w = (window[1] - W % window[1]) % window[1]
        h = F.pad(self.norm(x), (0, 0, 0, pad_w, 0, pad_h))
        h = torch.roll(h, shifts=(-shift[0], -shift[1]), dims=(1, 2))
        hp, wp = H + pad_h, W + pad_w
        h = h.reshape(B, hp // window[0], window[0], wp // window[1], window[1], C)
        h = h.permute(0, 1, 3, 2, 4, 5).reshape(-1, window[0] * window[1], C)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        h = (q @ k.transpose(-2, -1) * C ** -0.5).softmax(-1) @ v
        h = h.reshape(B, hp // window[0], wp // window[1], window[0], window[1], C)
        h = h.permute(0, 1, 3, 2, 4, 5).reshape(B, hp, wp, C)
        h = torch.roll(h, shifts=(shift[0], shift[1]), dims=(1, 2))[:, :H, :W]
        return x + self.proj(h)


class _SwinLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 8)
        self.blocks = nn.Sequential(_ShiftedWindows(), _ShiftedWindows())
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)).mean((1, 2)))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_helper_writing_into_lists_of_sizes_compiles_and_matches(mode: str) -> None:
    torch.manual_seed(0)
    _check(_SwinLike(), torch.randn(4, 6, 8, 3), mode)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_lists_from_a_helper_used_on_both_sides_of_a_cut(mode: str) -> None:
    torch.manual_seed(0)
    _check(_SwinLike(), torch.randn(4, 6, 8, 3), mode, split_points=["blocks.0.proj"])


def test_helper_gets_plain_lists_in_shape_propagation() -> None:
    torch.manual_seed(0)
    gm = capture(_ShiftedWindows().eval(), (torch.randn(4, 6, 8, 8),))
    helper = next(n for n in gm.graph.nodes if n.target is window_and_shift)
    window, shift = ir.value_info(helper)
    assert [int(w.value) for w in window] == [4, 8] and [int(s.value) for s in shift] == [2, 0]


def test_plain_containers_copies_fx_immutable_lists() -> None:
    frozen = torch.fx.immutable_collections.immutable_list([1, [2, 3]])
    plain = shapes.plain_containers((frozen, {"k": frozen}, torch.Size([4, 5])))
    assert type(plain[0]) is list and type(plain[0][1]) is list and type(plain[1]["k"]) is list
    assert type(plain[2]) is torch.Size
    plain[0][0] = 7  # writable, and the graph's own list is left alone
    assert frozen[0] == 1


# --- 3. a kernel that specialises the batch size and fails --------------------------------------

def fold_back(cols: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Sums overlapping 3x3 patches back into an image (F.fold, as outlook attention does)."""
    return F.fold(cols, output_size=(height, width), kernel_size=3, padding=1)


torch.fx.wrap("fold_back")


class _Outlooker(nn.Module):
    """VOLO's outlook attention in short: unfold, reshape(B, ...), fold back to (H, W); the
    fold is called directly or through a helper (an operation not known to specialise)."""

    def __init__(self, dim: int = 8, helper: bool = False) -> None:
        super().__init__()
        self.helper = helper
        self.v = nn.Linear(dim, dim)
        self.attn = nn.Linear(dim, 9)
        self.unfold = nn.Unfold(kernel_size=3, padding=1)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        v = self.unfold(self.v(x).permute(0, 3, 1, 2)).reshape(B, C, 9, H * W)
        weights = self.attn(x).reshape(B, 1, 9, H * W).softmax(2)
        cols = (v * weights).reshape(B, C * 9, H * W)
        y = fold_back(cols, H, W) if self.helper else F.fold(cols, (H, W), 3, padding=1)
        y = x + self.proj(y.permute(0, 2, 3, 1))
        return self.head(y.reshape(B, H * W, C).mean(1))


@pytest.mark.parametrize("helper", [False, True], ids=["fold", "helper"])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_folded_outlook_attention_follows_the_microbatch(mode: str, helper: bool) -> None:
    torch.manual_seed(0)
    _check(_Outlooker(helper=helper), torch.randn(4, 4, 4, 8), mode)


def test_helper_that_specialises_and_fails_is_sampled() -> None:
    torch.manual_seed(0)
    gm = capture(_Outlooker(helper=True).eval(), (torch.randn(4, 4, 4, 8),))
    assert fold_back in gm.meta[ir.SAMPLED]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert ir.value_info(out).shape[0] == ir.BATCH



# --- an in-place write into a value received from the stage before, on two ranks ---------------

class WritesWhatItReceives(nn.Module):
    """The second stage begins by adding into a slice of the hidden state it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h[:, :4] += self.bias
        out: torch.Tensor = self.b(torch.relu(h))
        return out


def _writes_what_it_receives() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return WritesWhatItReceives(), torch.randn(8, 8), torch.randint(0, 8, (8,))


def _cut_after_the_first_layer(model: nn.Module, x: torch.Tensor, **options: Any) -> Any:
    whole = fxpipe.compile(model, (x,), stages=2, chunks=2, profile="a100", **options)
    nodes = sum(len(s.nodes) for s in whole.plan.stages)
    return fxpipe.compile(model, (x,), stages=2, chunks=2, profile="a100",
                          balance=[1, nodes - 1], **options)


def _step_on_rank(rank: int, world: int) -> tuple[float, dict[str, torch.Tensor]]:
    model, x, y = _writes_what_it_receives()
    program = _cut_after_the_first_layer(model, x, remat="never")
    loss = program.step(x, target=y)
    return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_a_receive_the_stage_writes_into_is_marked_and_only_that_one() -> None:
    model, x, _ = _writes_what_it_receives()
    program = _cut_after_the_first_layer(model, x)
    first, second = (s.graph_module for s in program.stages)
    assert [c.written for c in program.stages[1].recvs] == [True]
    assert "clone" not in second.code  # the stage code is unchanged: the receive copies
    assert not any(c.written for c in program.stages[0].recvs)


@pytest.mark.distributed
def test_a_stage_writing_into_a_received_value_trains_like_the_model_on_two_ranks() -> None:
    import copy

    from ranks import spawn

    from fxpipe.losses import default_loss

    model, x, y = _writes_what_it_receives()
    plain = copy.deepcopy(model)
    loss = default_loss(plain(x), y)
    loss.backward()
    ranks = spawn(2, __name__, "_step_on_rank")
    assert [r[0] for r in ranks] == pytest.approx([float(loss.detach())] * 2, rel=1e-5)
    got = {**ranks[0][1], **ranks[1][1]}
    assert set(got) == {n for n, _ in plain.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.grad, msg=lambda m, n=name: f"{n}: {m}")

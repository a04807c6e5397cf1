"""Training paths that once failed in the pipeline only: an RNN filling its output in place
under remat; train-only branches that capture refused; features scattered into embeddings at
positions read from the token ids. Each pipeline is checked against the plain model: outputs,
loss and every parameter gradient."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import CaptureError
from fxpipe.testing.reference_step import reference_step


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _assert_trains_as_plain(model: nn.Module, inputs: tuple[torch.Tensor, ...], *,
                            stages: int = 2, chunks: int = 2, **options: object) -> None:
    """The pipeline's outputs, loss and every parameter gradient equal the plain model's."""
    reference = copy.deepcopy(model)
    program = fxpipe.compile(model, inputs, stages=stages, chunks=chunks, **options)
    torch.manual_seed(0)
    with torch.no_grad():
        expected = reference(*inputs)
        torch.testing.assert_close(program(*inputs), expected)
    target = torch.randn_like(expected)
    torch.manual_seed(1)
    loss = program.step(*inputs, target=target, loss_fn=_mse)
    torch.manual_seed(1)
    want = reference_step(program, reference, *inputs, target=target, loss_fn=_mse)
    assert loss == pytest.approx(want, rel=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert q.grad is not None, name
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class FilledRNN(nn.Module):
    """An RNN that writes each step's state into a preallocated output (`out[:, t] = h`), as
    RWKV's CPU kernel does: every step reads `out`'s storage after an earlier step wrote it."""

    def __init__(self, width: int = 16, layers: int = 2, steps: int = 6) -> None:
        super().__init__()
        self.steps = steps
        self.embed = nn.Linear(width, width)
        self.cells = nn.ModuleList(nn.Linear(2 * width, width) for _ in range(layers))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for cell in self.cells:
            out = torch.zeros_like(x)
            h = torch.zeros_like(x[:, 0])
            for t in range(self.steps):
                h = torch.tanh(cell(torch.cat([x[:, t], h], dim=-1)))
                out.select(1, t).copy_(h * 2.0)  # out[:, t] = h * 2, as fx traces it
            x = x + out
        return self.head(x)


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("remat", ["never", "always", "except_last"])
def test_rnn_writing_its_output_in_place_trains_as_the_plain_model(capture: str,
                                                                   remat: str) -> None:
    torch.manual_seed(0)
    model = FilledRNN().train()
    _assert_trains_as_plain(model, (torch.randn(4, 6, 16),), remat=remat, capture=capture)


def test_remat_leaves_out_every_read_of_a_tensor_written_later() -> None:
    torch.manual_seed(0)
    model = FilledRNN(layers=1, steps=3)
    program = fxpipe.compile(model, (torch.randn(4, 3, 16),), stages=2, chunks=2,
                             remat="always", capture="fx")
    from fxpipe import ir
    from fxpipe.passes.remat import rewritten_later
    for st in program.stages:
        for node in rewritten_later(st.graph_module):
            assert ir.REMAT not in node.meta, node.name


class _Level(nn.Module):
    """A decoder level that also writes a deep-supervision head into a list it shares with
    the top module (as MONAI's DynUNet skip layers do)."""

    def __init__(self, heads: list[torch.Tensor], index: int, width: int) -> None:
        super().__init__()
        self.heads = heads
        self.index = index
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.head = nn.Conv2d(width, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(x))
        self.heads[self.index] = self.head(x)
        return x


class DeepSupervision(nn.Module):
    """Train mode returns the output stacked with the heads the levels left in the list."""

    def __init__(self, width: int = 4, levels: int = 2) -> None:
        super().__init__()
        self.heads: list[torch.Tensor] = [torch.zeros(1)] * levels
        self.stem = nn.Conv2d(1, width, 3, padding=1)
        self.levels = nn.ModuleList(_Level(self.heads, i, width) for i in range(levels))
        self.out = nn.Conv2d(width, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for level in self.levels:
            x = nn.functional.avg_pool2d(level(x), 2)
        out = self.out(x)
        if not self.training:
            return out
        size = out.shape[2:]
        return torch.stack([out, *(nn.functional.interpolate(h, size) for h in self.heads)], 1)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_heads_shared_through_a_list_train_as_the_plain_model(capture: str) -> None:
    torch.manual_seed(0)
    model = DeepSupervision().train()
    shared = model.heads
    _assert_trains_as_plain(model, (torch.randn(4, 1, 8, 8),), capture=capture)
    # tracing left the model's list in place, shared, holding real tensors
    assert all(level.heads is shared for level in model.levels)
    assert all(type(h) is torch.Tensor for h in shared)
    assert type(model(torch.randn(2, 1, 8, 8))) is torch.Tensor


class ScatterVLM(nn.Module):
    """Image features written into the text embeddings at the image tokens' positions, found
    from the token ids (LLaVA's masked_scatter). `listed` joins the features as LLaVA does,
    through a Python list of the samples."""

    def __init__(self, listed: bool, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.listed = listed
        self.image_token = vocab - 1
        self.embed = nn.Embedding(vocab, width)
        self.vision = nn.Linear(12, width)
        self.block = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        text = self.embed(ids)
        features = self.vision(patches)
        features = torch.cat(list(features), 0) if self.listed else features.flatten(0, 1)
        mask = (ids == self.image_token).unsqueeze(-1)
        x = text.masked_scatter(mask, features)
        return self.head(torch.relu(self.block(x)))


def _vlm_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 30, (4, 10))
    ids[0, 1:5] = 31  # every sample has 4 image tokens, at positions of its own
    ids[1, 5:9] = 31
    ids[2, [0, 2, 4, 6]] = 31
    ids[3, 6:10] = 31
    return ids, torch.randn(4, 4, 12)


@pytest.mark.parametrize("remat", ["never", "always"])
def test_features_scattered_at_positions_from_the_ids_train_as_the_plain_model(
        remat: str) -> None:
    torch.manual_seed(0)
    _assert_trains_as_plain(ScatterVLM(listed=False).train(), _vlm_batch(), remat=remat)


def test_a_list_of_the_samples_is_refused_naming_its_line() -> None:
    torch.manual_seed(0)
    with pytest.raises(CaptureError) as caught:
        fxpipe.compile(ScatterVLM(listed=True), _vlm_batch(), stages=2, chunks=2)
    message = str(caught.value)
    assert message.startswith(
        "ScatterVLM fixes the number of samples while it computes, so its graph holds for "
        "batches of 4 only and cannot run on micro-batches\n  at ")
    assert "in forward: features = torch.cat(list(features), 0) if self.listed" in message
    assert "x.flatten(0, 1) rather than torch.cat(list(x))" in message


class GuardedEncoder(nn.Module):
    """Training mode clamps activations only when some are not finite, as DETR's encoder does:
    a branch on a tensor's value that torch.export cannot decide."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        if self.training:
            if not torch.isfinite(h).all():
                h = h.clamp(-1e4, 1e4)
        return self.second(h)


@pytest.mark.parametrize("remat", ["never", "always"])
def test_a_branch_on_values_follows_the_example_and_trains_as_the_plain_model(
        remat: str) -> None:
    torch.manual_seed(0)
    model = GuardedEncoder().train()
    _assert_trains_as_plain(model, (torch.randn(4, 16),), remat=remat, capture="follow_branches")


def test_a_branch_on_values_is_refused_naming_the_option_that_follows_it() -> None:
    with pytest.raises(CaptureError) as caught:
        fxpipe.compile(GuardedEncoder().train(), (torch.randn(4, 16),), stages=2, chunks=2)
    headline, at, _ = caught.value.message.splitlines()
    assert headline.startswith("GuardedEncoder decides what to compute from the values in a "
                               "tensor")
    assert "in forward: if not torch.isfinite(h).all():" in at
    assert "pass capture='follow_branches'" in (caught.value.hint or "")
    # eval mode has no such branch and captures as it is
    fxpipe.compile(GuardedEncoder().eval(), (torch.randn(4, 16),), stages=2, chunks=2)


def test_a_batch_taking_the_other_branch_stops_naming_the_line() -> None:
    torch.manual_seed(0)
    model = GuardedEncoder().train()
    program = fxpipe.compile(model, (torch.randn(4, 16),), stages=2, chunks=2,
                             capture="follow_branches")
    bad = torch.randn(4, 16)
    bad[3, 0] = float("inf")
    with pytest.raises(Exception, match=r"the branch at \S*test_backward_inplace_and_train_paths"
                                        r"\.py:\d+ went the other way than on the example batch"):
        program(bad)

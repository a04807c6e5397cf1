"""The built-in cross-entropy finds the class dimension from the target's shape: the last one
for a language model's [batch, tokens, vocabulary], dimension 1 as torch's F.cross_entropy for a
segmentation's [N, C, H, W] against [N, H, W]; a shape that fits both, or neither, is refused
with both readings named (fxpipe.losses)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.errors import LossError
from fxpipe.losses import default_loss


def test_classes_last_for_a_language_model_and_any_target_with_a_row_each():
    logits, tokens = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    expected = F.cross_entropy(logits.reshape(-1, 7), tokens.reshape(-1))
    torch.testing.assert_close(default_loss(logits, tokens), expected)
    torch.testing.assert_close(default_loss(logits, tokens.reshape(-1)), expected)
    flat, labels = torch.randn(6, 3), torch.randint(0, 3, (6,))
    torch.testing.assert_close(default_loss(flat, labels), F.cross_entropy(flat, labels))


def test_classes_in_dim_1_as_torch_reads_them_for_a_segmentation():
    logits, labels = torch.randn(2, 5, 4, 3), torch.randint(0, 5, (2, 4, 3))
    torch.testing.assert_close(default_loss(logits, labels), F.cross_entropy(logits, labels))
    with_ignored = labels.clone()
    with_ignored[0, 0] = -100
    torch.testing.assert_close(default_loss(logits, with_ignored),
                               F.cross_entropy(logits, with_ignored))


def test_a_shape_that_fits_both_readings_or_neither_is_refused_naming_them():
    with pytest.raises(LossError, match=r"cannot tell the class dimension of a prediction of "
                                        r"shape \(2, 4, 4, 4\)") as error:
        default_loss(torch.randn(2, 4, 4, 4), torch.randint(0, 4, (2, 4, 4)))
    assert "functional.cross_entropy for classes in dimension 1" in error.value.hint
    assert "flatten(0, -2)" in error.value.hint
    with pytest.raises(LossError, match=r"the target's shape is \(2, 5, 4\) \(classes in the "
                                        r"last dimension\) or \(2, 4, 3\) \(classes in "
                                        r"dimension 1, as torch's F.cross_entropy\), but it is "
                                        r"\(2, 6\)"):
        default_loss(torch.randn(2, 5, 4, 3), torch.randint(0, 3, (2, 6)))


class _Segment(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("loss_fn", [None, "cross_entropy"])
def test_a_segmentation_trains_with_the_built_in_loss_as_with_torchs(loss_fn):
    torch.manual_seed(0)
    model, plain = _Segment(), _Segment()
    plain.load_state_dict(model.state_dict())
    x, labels = torch.randn(4, 3, 6, 4), torch.randint(0, 5, (4, 6, 4))
    program = fxpipe.compile(model, (x,), stages=2, chunks=2)
    loss = program.step(x, target=labels, loss_fn=loss_fn)
    expected = F.cross_entropy(plain(x), labels)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)

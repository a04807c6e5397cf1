"""Embeddings whose gradient counts each index's occurrences in the batch
(scale_grad_by_freq=True) are refused for more than one micro-batch, naming them, under either
front end; with one micro-batch, and every other embedding option, training equals the plain
model's (fxpipe.passes.freq_scaled)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import ConfigError


class Bags(nn.Module):
    def __init__(self, **options: object) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, **options)
        self.bag = nn.EmbeddingBag(50, 4, mode="sum")
        self.body = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.body(torch.cat([self.emb(ids).mean(1), self.bag(ids)], 1))


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 12, (8, 6), generator=g)  # few indices: each occurs often
    ids[:, 0] = 0
    return ids, torch.randint(0, 5, (8,), generator=g)


def _trains_as_plain(model: nn.Module, chunks: int) -> None:
    plain = copy.deepcopy(model)
    ids, y = _ids()
    program = fxpipe.compile(model, (ids,), stages=2, chunks=chunks)
    loss = program.step(ids, target=y)
    expected = nn.functional.cross_entropy(plain(ids), y)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        mine, theirs = p.grad, q.grad
        if mine.is_sparse:
            mine, theirs = mine.to_dense(), theirs.to_dense()
        torch.testing.assert_close(mine, theirs, msg=name)


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("where", ["emb", "bag"])
def test_a_frequency_scaled_embedding_is_refused_for_several_micro_batches(capture, where):
    torch.manual_seed(0)
    model = Bags()
    getattr(model, where).scale_grad_by_freq = True
    with pytest.raises(ConfigError, match=rf"^{where} scales its embedding's gradient by how "
                                          r"often each index occurs .* 4 micro-batches") as e:
        fxpipe.compile(model, (_ids()[0],), stages=2, chunks=4, capture=capture)
    assert "scale_grad_by_freq=False, or compile with chunks=1" in str(e.value)


def test_a_frequency_scaled_embedding_trains_as_the_plain_model_in_one_micro_batch():
    torch.manual_seed(0)
    _trains_as_plain(Bags(scale_grad_by_freq=True), chunks=1)


@pytest.mark.parametrize("options", [{"padding_idx": 0}, {"sparse": True}])
def test_other_embedding_options_train_as_the_plain_model(options):
    torch.manual_seed(0)
    _trains_as_plain(Bags(**options), chunks=4)

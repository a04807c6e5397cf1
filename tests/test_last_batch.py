"""A batch that does not divide into `chunks` (an epoch's last batch without drop_last): it runs
in equal micro-batches no larger than an even split's (Signature.microbatches), and trains and
evaluates as the plain model does on the whole batch, in one process and under torchrun."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from gpt_batches import assert_ranks_match_plain, plain_step, tokens
from ranks import spawn

import fxpipe
from fxpipe.errors import PipelineRuntimeError
from fxpipe.models import gpt
from fxpipe.signature import Signature
from fxpipe.testing.reference_step import reference_step

BATCHES = (7, 6, 3, 1)  # compiled for 8 in 4 chunks


def test_the_micro_batches_of_a_batch_are_equal_and_no_larger_than_an_even_split_s():
    for batch, chunks, want in [(8, 4, 4), (16, 4, 4), (7, 4, 7), (6, 4, 3), (3, 4, 3),
                                (1, 4, 1), (12, 8, 6), (9, 2, 3), (2, 1, 1)]:
        got = Signature.microbatches(batch, chunks)
        assert (got, batch % got) == (want, 0), (batch, chunks)
        assert batch // got <= -(-batch // chunks)


def test_a_micro_batch_too_small_for_the_model_says_how_the_batch_was_split_and_what_to_pass():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 3))
    program = fxpipe.compile(model, (torch.randn(16, 8),), stages=2, chunks=4)
    # 6 runs as 3 micro-batches of 2, and trains
    program.step(torch.randn(6, 8), target=torch.randint(0, 3, (6,)), loss_fn=F.cross_entropy)
    with pytest.raises(PipelineRuntimeError) as err:  # BatchNorm's statistics of one example
        program.step(torch.randn(7, 8), target=torch.randint(0, 3, (7,)),
                     loss_fn=F.cross_entropy)
    assert "(a batch of 7 in 7 micro-batches of 1): ValueError" in str(err.value)
    assert "chunks=4 does not divide 7" in err.value.hint and "drop_last=True" in err.value.hint
    assert "BatchNorm in train mode normalises each micro-batch" in err.value.hint
    program = fxpipe.compile(model, (torch.randn(4, 8),), stages=2, chunks=4)
    with pytest.raises(PipelineRuntimeError) as err:  # the compiled chunks: one example each
        program.step(torch.randn(4, 8), target=torch.randint(0, 3, (4,)),
                     loss_fn=F.cross_entropy)
    assert err.value.hint.startswith("BatchNorm in train mode normalises each micro-batch by "
                                     "its own statistics") and "use fewer chunks" in err.value.hint
    assert Signature.split_text(16, 4, 4) == ("a batch of 16 in 4 micro-batches of 4", None)


def test_uneven_batches_train_and_evaluate_as_the_whole_batch_in_one_process():
    torch.manual_seed(0)
    model, (idx,) = gpt.build(batch=8, dropout=0.0)
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (idx,), stages=2, chunks=4, profile="a100")
    for size in BATCHES:
        x, y = tokens(size, 32, size)
        model.zero_grad()
        plain.zero_grad()
        assert program.step(x, target=y) == pytest.approx(plain_step(plain, x, y), rel=1e-6)
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=f"batch {size}: {name}")
        with torch.no_grad():
            torch.testing.assert_close(program(x), plain(x))
            assert program.evaluate(x, target=y) == \
                pytest.approx(float(F.cross_entropy(plain(x).flatten(0, 1), y.flatten())),
                              rel=1e-6)


def test_an_uneven_batch_draws_the_random_streams_of_its_micro_batches():
    torch.manual_seed(0)
    model, (idx,) = gpt.build(batch=8, dropout=0.2)
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (idx,), stages=2, chunks=4, profile="a100")
    x, y = tokens(7, 32, 0)
    torch.manual_seed(3)
    loss = program.step(x, target=y)
    torch.manual_seed(3)
    assert loss == pytest.approx(reference_step(program, plain, x, target=y), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize("schedule,stages", [("1f1b", 2), ("zb-h1", 2), ("zb-v", 4)])
def test_uneven_batches_on_two_ranks_train_and_evaluate_as_the_whole_batch(schedule, stages):
    shapes = [(size, 32) for size in BATCHES]
    ranks = spawn(2, "gpt_batches", "steps_on_ranks", schedule, stages, shapes, False,
                  timeout=120, bound=400)
    assert_ranks_match_plain(ranks, shapes)

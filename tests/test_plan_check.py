"""What the planner's check computes its figures from (fxpipe.tools.plan_check), never timings."""
from __future__ import annotations

import pytest
import torch

from fxpipe.models import mlp
from fxpipe.planner import Candidate
from fxpipe.tools.plan_check import (
    _held_bytes,
    check_rows,
    choice_against_best,
    competition_ranks,
    distinct,
    measured_memory,
    options_of,
    per_device,
    render,
)


def test_ranks_put_the_smallest_first_and_share_ties():
    assert competition_ranks([3.0, 1.0, 2.0]) == [3, 1, 2]
    assert competition_ranks([1.0, 2.0, 2.0, 0.5]) == [2, 3, 3, 1]


def _candidate(step, chunks, memory=1e6):
    return Candidate(2, 1, 1, chunks, "1f1b", "never", pipeline_s=step, memory_bytes=memory)


def test_the_table_is_built_from_the_given_measurements():
    planned = [_candidate(0.010, 4), _candidate(0.012, 2), _candidate(0.020, 1)]
    steps = [[0.30, 0.31, 0.32], [0.20, 0.21, 0.22], [0.50, 0.50, 0.51]]
    rows = check_rows(planned, steps, [1.1e6, 1e6, 0.8e6])
    assert [r.predicted_rank for r in rows] == [1, 2, 3]
    assert [r.measured_rank for r in rows] == [2, 1, 3]
    assert [r.measured_s for r in rows] == [0.31, 0.21, 0.50]
    assert all(r.low_s <= r.measured_s <= r.high_s for r in rows)
    assert rows[0].memory_error == pytest.approx(1e6 / 1.1e6 - 1)
    # the choice (predicted first) measured 0.31 against the best 0.21
    assert choice_against_best(rows) == pytest.approx(0.31 / 0.21)
    assert "NOT within 5%" in render(rows)
    assert "within 5%" in render(check_rows(planned, [steps[1], steps[0], steps[2]],
                                            [1e6] * 3))
    with pytest.raises(ValueError, match="one of each per candidate"):
        check_rows(planned, steps[:2], [1e6] * 3)


def test_a_device_holds_the_sum_of_its_stages():
    looped = Candidate(4, 2, 1, 4, "zb-v", "never")  # rank 0: stages 0 and 3; rank 1: 1 and 2
    assert per_device(looped, [1.0, 2.0, 4.0, 8.0]) == 9.0
    assert options_of(looped) == {"stages": 4, "chunks": 4, "schedule": "zb-v",
                                  "remat": "never"}


def test_the_memory_measured_is_the_storage_a_step_leaves_and_the_kept_activations():
    model, (x,) = mlp.build(depth=4)
    y = mlp.target((x,))
    c = Candidate(2, 1, 1, 2, "1f1b", "never")
    measured, predicted = measured_memory(model, (x,), y, c, "a100")
    weights = sum(p.numel() * 4 for p in model.parameters())
    # Adam after a step: weights, gradients and two moments, plus what the stages keep
    assert sum(measured) > 4 * weights
    assert len(measured) == len(predicted) == 2
    for m, p in zip(measured, predicted):
        assert m == pytest.approx(p, rel=0.10)
    # two replicas: each holds every weight but keeps only its half of the batch's activations
    halves, predicted_halves = measured_memory(model, (x,), y, Candidate(2, 1, 2, 2, "1f1b",
                                                                         "never"), "a100")
    assert all(h < m for h, m in zip(halves, measured))
    assert all(p < q for p, q in zip(predicted_halves, predicted))
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert _held_bytes(layer, optimizer) == 4 * 4 * (3 * 2 + 2)  # weight, grad, 2 moments


def test_a_candidate_sharding_the_optimizer_is_compiled_and_measured_with_its_share():
    """shard="optimizer" reaches fxpipe.compile, and one process counts a replica's 1/R of the
    state it holds whole, as the memory model charges it."""
    model, (x,) = mlp.build(depth=4)
    y = mlp.target((x,))
    whole, sharded = (Candidate(2, 1, 2, 2, "1f1b", "never", shard=mode)
                      for mode in ("none", "optimizer"))
    assert options_of(sharded) == {**options_of(whole), "shard": "optimizer"}
    held, predicted = measured_memory(model, (x,), y, whole, "a100")
    held_sharded, predicted_sharded = measured_memory(model, (x,), y, sharded, "a100")
    for m, p in zip(held_sharded, predicted_sharded):
        assert m == pytest.approx(p, rel=0.10)
    # Adam's two moments, halved: a stage's own weights' worth less
    for a, b in zip(held, held_sharded):
        assert a - b > 0
    assert sum(held) - sum(held_sharded) == pytest.approx(
        sum(p.numel() * 4 for p in model.parameters()), rel=1e-6)


def test_candidates_predicted_alike_are_measured_once():
    a, b, c = _candidate(0.01, 2), _candidate(0.01, 2), _candidate(0.02, 1)
    b = Candidate(2, 1, 1, 2, "gpipe", "never", pipeline_s=0.01, memory_bytes=1e6)
    assert distinct([a, b, c]) == [a, c]


def test_the_loss_kept_is_measured_on_the_programs_outputs_as_the_memory_model_counts_it():
    """The last stage's memory holds what the loss keeps per micro-batch in flight: measured
    here with autograd's hooks on a real cross-entropy, predicted on the meta device."""
    import fxpipe
    from fxpipe.losses import loss_saved_bytes
    from fxpipe.models import gpt
    from fxpipe.tools.plan_check import _loss_kept

    model, (idx,) = gpt.build(batch=8, dropout=0.0)
    program = fxpipe.compile(model, (idx,), stages=2, chunks=4, profile="a100")
    measured = _loss_kept(program, (idx,), gpt.target((idx,)), 4)
    # a micro-batch's share of the batch's log-softmax (2 x 32 x 512 floats each), of its
    # target and of a scalar
    assert measured == pytest.approx(loss_saved_bytes(program.built.captured, 2), rel=0.02)
    assert measured >= 2 * 32 * 512 * 4

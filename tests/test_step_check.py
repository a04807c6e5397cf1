"""fxpipe.tools.step_check: what its figures are computed from (the figures themselves are
benchmark output, never asserted)."""
from __future__ import annotations

import torch

import fxpipe
from fxpipe.testing.user_models import USER_MODELS, load_user_model
from fxpipe.tools.step_check import check_model, machine_time


def test_the_user_models_pipeline_like_the_plain_model_in_eval():
    for name in USER_MODELS:
        model, inputs, kwargs = load_user_model(name)
        model.eval()
        program = fxpipe.compile(model, inputs, stages=2, chunks=2, example_kwargs=kwargs)
        expected, got = model(*inputs, **kwargs), program(*inputs, **kwargs)
        if isinstance(expected, dict):
            expected, got = expected["logits"], got["logits"]
        torch.testing.assert_close(got, expected)


def test_a_model_is_predicted_and_measured_in_one_process():
    row = check_model("skipnet", steps=2, ranks=False)
    assert row["predicted_local_s"] > 0 and row["predicted_ranks_s"] > 0
    assert 0 < row["local_min_s"] <= row["local_median_s"]
    assert row["machine_s"] > 0 and machine_time() > 0


def test_the_variants_of_a_model_are_predicted_and_measured_in_one_process():
    from fxpipe.tools.step_check import VARIANTS, check_variants

    rows = check_variants("branchy", rounds=2, budget=0.0)
    assert list(rows) == list(VARIANTS)
    assert all(predicted > 0 and measured > 0 for predicted, measured in rows.values())
    # recomputing every micro-batch is predicted to cost more than recomputing none
    assert rows[2, "always"][0] > rows[2, "except_last"][0] > rows[2, "never"][0]


def test_reference_blocks_are_predicted_as_kernels_and_overheads_and_measured():
    from fxpipe.tools.step_check import BLOCKS, check_blocks

    rows = check_blocks(rounds=2, burst=2, budget=0.0)
    assert list(rows) == list(BLOCKS)
    for measured, kernels, overheads in rows.values():
        assert measured > 0 and kernels > 0 and overheads > 0
    # the attention block runs more operations (a split, views and transposes per head) than
    # the MLP block, so more per-operation overhead is predicted for it
    assert rows["attention block (2 x 32 tokens of 64)"][2] > \
        rows["mlp block (2 x 32 tokens of 64)"][2]

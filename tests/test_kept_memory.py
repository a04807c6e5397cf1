"""Activations kept for backward in a real distributed step, against the memory model.

program.measure_kept steps with autograd's saved-tensor hooks on (the loss's saved tensors
included) and reports this rank's peak beside Report.kept_by_rank, the rank's actions played
in schedule order. Every schedule and remat mode must agree within 10% on 2 gloo ranks; what is
left is an input batch counted as its whole storage where the model counts each micro-batch's
slice (a few KiB here).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from ranks import spawn

import fxpipe
from fxpipe.errors import ConfigError
from fxpipe.losses import loss_saved_bytes
from fxpipe.models import gpt

SCHEDULES = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "interleaved-1f1b": 2, "zb-v": 2, "dualpipev": 2}


def _measure(rank: int, world: int, remat: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model, (idx,) = gpt.build(batch=16, dropout=0.0)
    y = gpt.target((idx,))
    out = {}
    for schedule, per_rank in SCHEDULES.items():
        program = fxpipe.compile(model, (idx,), stages=world * per_rank, chunks=8,
                                 profile="a100", schedule=schedule, remat=remat)
        out[schedule] = program.measure_kept(idx, target=y)
        program.zero_grad()
    return out


# under remat (about 8 s) in the slow tier
@pytest.mark.parametrize("remat", ["never", pytest.param("except_last", marks=pytest.mark.slow)])
def test_kept_activations_match_the_prediction_for_every_schedule(remat: str) -> None:
    # never fails without the loss's bytes (the last rank) or with a looped rank's stages'
    # peaks summed; except_last mixes micro-batches kept whole with recomputed ones
    for rank, found in enumerate(spawn(2, "test_kept_memory", "_measure", remat)):
        for schedule, figures in found.items():
            measured, predicted = figures["measured_bytes"], figures["predicted_bytes"]
            assert measured > 0 and figures["rank"] == rank
            assert abs(measured - predicted) <= 0.1 * predicted + 4096, \
                (schedule, rank, measured, predicted)


def test_the_last_stage_keeps_what_the_loss_saves() -> None:
    """Cross-entropy keeps its log-softmax (the logits' size), the target and a scalar: the
    partition and the report count them on the last stage, per micro-batch in flight."""
    model, (idx,) = gpt.build(batch=8, dropout=0.0)
    program = fxpipe.compile(model, (idx,), stages=2, chunks=4, profile="a100")
    logits = model(idx[:2])
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    target = gpt.target((idx[:2],))
    logits = logits.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(logits.flatten(0, 1), target.flatten())
    expected = float(sum(saved.values()))
    assert loss_saved_bytes(program.built.captured, 2) == expected
    assert expected >= logits.numel() * logits.element_size()
    report = program.report()
    assert [s["loss_bytes"] for s in report.stages] == [0.0, expected]
    last = report.stages[-1]
    without_loss = report.remat.kept_at_peak(
        last["activations_bytes"], last["kept_with_remat_bytes"], 4, 4)
    assert report.kept_by_stage(report.schedule, 2)[-1] == without_loss + 4 * expected


def test_measure_kept_in_one_process_points_to_measure_activations() -> None:
    model, (idx,) = gpt.build(batch=8, dropout=0.0)
    program = fxpipe.compile(model, (idx,), stages=2, chunks=4, profile="a100")
    with pytest.raises(ConfigError, match="measure_activations"):
        program.measure_kept(idx, target=gpt.target((idx,)))


class _ScaledTail(torch.nn.Module):
    """Two linears, then a weight that scales elementwise (as an RMSNorm's does): W needs the
    engine for it, so the stage that holds it keeps its graph from I to W."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 16)
        self.second = torch.nn.Linear(16, 16)
        self.scale = torch.nn.Parameter(torch.ones(16))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.second(torch.relu(self.first(x))))
        return self.head(h * self.scale)


def test_what_a_split_backward_keeps_from_i_to_w_by_stage() -> None:
    """The last stage's weights all hang on linears and norms: from I to W it keeps the inputs
    of its five linears (ln_1's, the attention's, ln_2's and ln_f's outputs, d wide, and the
    MLP's, 4d wide). The first stage's W is a whole backward, and a stage with an elementwise
    weight needs its graph in W: both keep everything (None)."""
    model, (idx,) = gpt.build(batch=8, dropout=0.0)  # d_model 64, 32 tokens
    program = fxpipe.compile(model, (idx,), stages=2, chunks=4, profile="a100",
                             schedule="zb-h1", remat="never")
    report = program.report()
    first, last = report.stages
    b = program.plan.microbatch_size
    assert first["weight_pass_bytes"] is None
    assert last["weight_pass_bytes"] == (4 + 4) * b * 32 * 64 * 4 < last["activations_bytes"]
    # one stage per rank: each stage's peak is its rank's, both played the same way
    assert report.kept_by_stage(report.schedule, 2) == report.kept_by_rank(report.schedule, 2)

    for name, p in model.named_parameters():  # frozen layers have no W: only the head's input
        p.requires_grad_(name == "wte.weight")  # (tied: the head's weight)
    frozen = fxpipe.compile(model, (idx,), stages=2, chunks=4, profile="a100",
                            schedule="zb-h1", remat="never")
    assert [s["stage"] for s in frozen.report().stages] == [0, 1]
    assert frozen.report().stages[1]["weight_pass_bytes"] == b * 32 * 64 * 4

    scaled = fxpipe.compile(_ScaledTail(), (torch.randn(8, 16),), stages=2, chunks=2,
                            profile="a100", schedule="zb-h1")
    holder = [(s["stage"], s["weight_pass_bytes"]) for s in scaled.report().stages
              if "scale" in scaled.stage_modules[s["stage"]].state_dict()]
    assert holder == [(1, None)]  # a stage that receives, so not for want of a gradient

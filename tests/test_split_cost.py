"""`python -m fxpipe.tools.split_cost stage`: runs, and counts the engine calls a split backward
of the bench GPT's last stage makes (one for I; W computes every group itself as the executors
run it, or takes one call per weight group through the engine)."""
from __future__ import annotations

import re

from fxpipe.tools.split_cost import main


def test_the_stage_measurement_counts_one_call_for_i_and_none_or_one_per_weight_group(
        capsys) -> None:
    assert main(["stage", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    calls = {m.group(1): int(m.group(2))
             for m in re.finditer(r"^\s+(\w+) .*engine calls\s+(\d+)", out, re.MULTILINE)}
    # through the engine: 4 blocks x (2 norms, qkv, projection, 2 MLP layers) + final norm +
    # head, and I; as the executors run it, every group is a linear's or a norm's: I alone
    assert calls == {"plain": 1, "split": 1, "engine": 1 + 4 * 6 + 2}


def test_a_steps_python_calls_are_counted_and_grow_with_the_micro_batches() -> None:
    import fxpipe
    from fxpipe.models import gpt
    from fxpipe.tools.split_cost import _python_calls

    model, (idx,) = gpt.build(batch=8, dropout=0.0)
    y = gpt.target((idx,))
    calls = {chunks: _python_calls(fxpipe.compile(model, (idx,), stages=2, chunks=chunks,
                                                  profile="a100", remat="never"), idx, y)
             for chunks in (2, 8)}
    assert 0 < calls[2] < calls[8]


def test_the_one_process_baseline_is_the_full_batch_step() -> None:
    """The ranks' summed CPU is compared with this step: it must do the whole model's work,
    its accumulated gradients those of the batch's mean loss."""
    import copy

    import torch

    from fxpipe.models import gpt
    from fxpipe.tools.bench_worker import accumulate, micro_batches

    model, (idx,) = gpt.build(batch=8, dropout=0.0)
    y = gpt.target((idx,))
    whole = copy.deepcopy(model)
    accumulate(model, micro_batches((idx,), y, 4))
    logits = whole(idx)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)

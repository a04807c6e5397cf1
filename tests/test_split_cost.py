"""`python -m fxpipe.tools.split_cost stage`: runs, and counts the engine calls a split backward
of the bench GPT's last stage makes (one for I; W computes every group itself as the executors
run it, or takes one call per weight group through the engine)."""
from __future__ import annotations

import re
import sys

import pytest

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


def _count_messages(rank: int, world: int, chunks: int) -> tuple[int, float]:
    import fxpipe
    from fxpipe.models import gpt
    from fxpipe.tools.split_cost import _message_cpu, _messages

    model, (idx,) = gpt.build(batch=8, dropout=0.0)
    y = gpt.target((idx,))
    program = fxpipe.compile(model, (idx,), stages=world, chunks=chunks, profile="a100",
                             schedule="1f1b", remat="never")
    return _messages(program, idx, y), _message_cpu(rank, (2, 8, 4), count=20)


@pytest.mark.slow  # two gloo ranks, two compiles each: about 6 s
def test_each_rank_posts_an_activation_and_a_gradient_per_micro_batch_and_no_more() -> None:
    """The floor split_cost subtracts from the pipeline's host work is messages x the CPU of
    one: the count must be what 1F1B on two stages posts (rank 0 sends each micro-batch's
    activation and receives its gradient; rank 1 the reverse), scalars and headers none."""
    from tests import ranks

    for chunks in (2, 4):
        results = ranks.spawn(2, "tests.test_split_cost", "_count_messages", chunks)
        assert [count for count, _ in results] == [2 * chunks, 2 * chunks]
        assert all(seconds > 0 for _, seconds in results)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_the_cpu_by_thread_names_the_calling_thread_step_and_sees_another_threads_work() -> None:
    import threading
    import time

    from fxpipe.tools.split_cost import _thread_cpu

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    before = _thread_cpu()
    worker = threading.Thread(target=spin)
    worker.start()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:  # the two take turns holding the GIL
        pass
    during = _thread_cpu()  # an ended thread leaves /proc: read while the worker runs
    stop.set()
    worker.join()
    assert during["step"] - before["step"] >= 0.05  # in clock ticks of 10 ms
    others = sum(during.values()) - during["step"] - (sum(before.values()) - before["step"])
    assert others >= 0.05


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_the_cpu_by_thread_of_programs_taking_turns_is_per_step_and_per_program() -> None:
    import time

    from fxpipe.tools.split_cost import _cpu_by_thread

    class Busy:  # a program whose step holds the CPU for `seconds`
        def __init__(self, seconds: float) -> None:
            self.seconds, self.steps = seconds, 0

        def zero_grad(self) -> None:
            pass

        def step(self, *_: object, **__: object) -> None:
            self.steps += 1
            end = time.process_time() + self.seconds
            while time.process_time() < end:
                pass

    programs = {"light": Busy(0.002), "heavy": Busy(0.008)}
    spent = _cpu_by_thread(programs, None, None, blocks=2, steps=10)  # type: ignore[arg-type]
    assert [p.steps for p in programs.values()] == [20, 20]
    assert spent["light"]["step"] == pytest.approx(0.002, abs=0.0015)  # clock ticks: 0.5 ms
    assert spent["heavy"]["step"] == pytest.approx(0.008, abs=0.0015)

"""Stages that hold no parameters (a conv net's skip addition, its pooling) train like the plain
model: in one process at the most stages the compiler accepts, and as a written program under
`fxpipe run`, where such a rank makes and steps no optimizer and checkpoints still save and
resume."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import fxpipe
from fxpipe.errors import PartitionError
from fxpipe.runtime.program.torchrun import free_port
from fxpipe.storage.checkpoint import load_checkpoint
from fxpipe.testing.reference_step import reference_step
from tests.skip_cnn import build, target

LR = 0.05


def _parameterless(program: fxpipe.Program) -> list[int]:
    return [s for s, st in enumerate(program.stage_modules) if not list(st.parameters())]


def test_at_the_most_stages_a_conv_net_trains_like_the_plain_model_in_one_process():
    model, (x,) = build()
    y = target((x,))
    plain = copy.deepcopy(model)
    with pytest.raises(PartitionError) as error:
        fxpipe.compile(copy.deepcopy(model), (x,), stages=100, chunks=2, profile="a100")
    most = int(error.value.hint.split("at most ")[1].split()[0])
    program = fxpipe.compile(model, (x,), stages=most, chunks=2, profile="a100")
    assert _parameterless(program)  # the skip's addition, the pooling, activations

    torch.manual_seed(0)
    loss = program.step(x, target=y)
    torch.manual_seed(0)
    expected = reference_step(program, plain, x, target=y)
    assert loss == pytest.approx(expected, rel=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """3 stages; stage 1 is the skip's addition and the pooling: no parameters."""
    model, (x,) = build()
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (x,), stages=3, chunks=2, profile="a100",
                             balance=[20, 2, 1])  # compute nodes per stage
    assert _parameterless(program) == [1]
    folder = tmp_path_factory.mktemp("parameterless") / "program"
    program.write(str(folder), target=target((x,)), lr=LR)
    return folder, program, plain, x


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fxpipe", "run", *args, "--port",
                           str(free_port())], capture_output=True, text=True, timeout=600,
                          env=env)


@pytest.mark.slow  # two 3-process runs; the parameterless stages train in one process above
def test_a_written_program_with_a_parameterless_stage_trains_saves_and_resumes(written,
                                                                               tmp_path):
    folder, program, plain, x = written
    saved = tmp_path / "checkpoint"
    result = _run(str(folder), "--nproc", "3", "--steps", "2", "--verify", "--save", str(saved))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verify: OK" in result.stdout

    # the checkpoint holds what two SGD steps of the plain model give: every gradient agreed
    optimizer = torch.optim.SGD(plain.parameters(), lr=LR, momentum=0.9)  # as the launcher
    for step in range(2):
        torch.manual_seed(step)
        reference_step(program, plain, x, target=target((x,)))
        optimizer.step()
        optimizer.zero_grad()
    state = load_checkpoint(str(saved))["model"]
    assert set(state) == set(plain.state_dict())
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-6, msg=name)

    result = _run(str(folder), "--nproc", "3", "--steps", "1", "--verify", "--resume",
                  str(saved))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step 2 loss" in result.stdout and "verify: OK: steps 2..2" in result.stdout

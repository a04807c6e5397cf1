"""A written program of a meta-compiled model: stage code and a spec without weights; each rank
reads its stage from a checkpoint (--weights PATH) or runs the model's initializers (--init)."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import fxpipe
from fxpipe.models import gpt

CONFIG = {"vocab_size": 512, "seq_len": 32, "d_model": 64, "n_layer": 2, "n_head": 4,
          "dropout": 0.0}
IDX = torch.randint(512, (8, 32), generator=torch.Generator().manual_seed(0))
TARGET = gpt.target((IDX,))
STEPS = 2


def _meta_program() -> fxpipe.Program:
    with torch.device("meta"):
        model = gpt.GPT(**CONFIG)
    return fxpipe.compile(model, (IDX,), stages=2, chunks=4, profile="a100", check="shapes")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("giant")
    _meta_program().write(str(folder / "program"), target=TARGET)
    torch.manual_seed(5)
    plain = gpt.GPT(**CONFIG)
    save_file({k: v for k, v in plain.state_dict().items() if k != "lm_head.weight"},
              folder / "model.safetensors")
    return folder, plain


def _run(folder, *args: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fxpipe", "run", str(folder / "program"),
                           "--nproc", "2", "--port", str(port), "--steps", str(STEPS), *args],
                          capture_output=True, text=True, timeout=600, env=env)


def _losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+ loss (\S+)", output, re.MULTILINE)]


def _sgd_losses(step, params) -> list[float]:
    """The launcher's optimizer: SGD with momentum 0.9 at the program's lr."""
    optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        losses.append(step())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def test_the_program_is_written_without_weights_and_lists_what_it_needs(written):
    folder, plain = written
    files = set(os.listdir(folder / "program"))
    assert "weights.pt" not in files
    assert {"weights.json", "state.pt", "model.pt", "stage_0.py", "stage_1.py"} <= files
    info = json.loads((folder / "program" / "weights.json").read_text())
    assert info["weights"] is None and info["model"] == "model.pt"
    spec = json.loads((folder / "program" / "program.json").read_text())
    assert set(spec["structure"]["tensors"]) == set(plain.state_dict())
    assert info["tensors"]["wte.weight"] == {"shape": [512, 64], "dtype": "float32",
                                             "parameter": True, "requires_grad": True}
    assert os.path.getsize(folder / "program" / "model.pt") < 64 * 1024  # no data in it


@pytest.mark.slow
def test_without_weights_or_init_each_rank_says_how_to_run_it(written):
    result = _run(written[0])
    assert result.returncode != 0
    assert "without weights" in result.stderr and "--weights PATH" in result.stderr


@pytest.mark.slow
def test_ranks_read_their_stage_from_a_checkpoint_and_train_like_the_plain_model(written):
    folder, plain = written
    result = _run(folder, "--weights", str(folder / "model.safetensors"))
    assert result.returncode == 0, result.stdout + result.stderr

    def step() -> float:
        loss = torch.nn.functional.cross_entropy(plain(IDX).flatten(0, 1), TARGET.flatten())
        loss.backward()
        return float(loss)

    expected = _sgd_losses(step, plain.parameters())
    assert _losses(result.stdout) == pytest.approx(expected, rel=1e-5)


def test_ranks_initialize_their_stage_like_init_weights_in_one_process(written):
    folder, _ = written
    result = _run(folder, "--init", "--seed", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    program = _meta_program()
    program.init_weights(seed=3)
    expected = _sgd_losses(lambda: program.step(IDX, target=TARGET), program.parameters())
    assert _losses(result.stdout) == pytest.approx(expected, rel=1e-5)

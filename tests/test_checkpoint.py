"""Checkpoints: atomic, in the model's names, and resuming gives exactly the uninterrupted run."""
from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import fxpipe
from fxpipe.errors import CheckpointError
from fxpipe.models import gpt


def _setup(stages: int, model):
    program = fxpipe.compile(copy.deepcopy(model), (X,), stages=stages, chunks=4, profile="a100")
    return program, torch.optim.Adam(program.parameters(), lr=1e-3)


def _train(program, optimizer, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(program.step(X, target=Y))
        optimizer.step()
        optimizer.zero_grad()
    return losses


torch.manual_seed(0)
MODEL, (X,) = gpt.build(dropout=0.0)
Y = gpt.target((X,))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-for-bit comparisons need a fixed reduction order
    yield
    torch.set_num_threads(threads)


def test_resuming_gives_exactly_the_losses_of_an_uninterrupted_run(tmp_path):
    program, optimizer = _setup(2, MODEL)
    uninterrupted = _train(program, optimizer, 6)
    program, optimizer = _setup(2, MODEL)
    first = _train(program, optimizer, 3)
    program.save(str(tmp_path / "ckpt"), optimizer=optimizer, step=3)
    program, optimizer = _setup(2, MODEL)  # a fresh process would start like this
    assert program.load(str(tmp_path / "ckpt"), optimizer=optimizer) == 3
    assert first + _train(program, optimizer, 3) == uninterrupted


def test_a_checkpoint_resumes_with_another_number_of_stages(tmp_path):
    program, optimizer = _setup(2, MODEL)
    uninterrupted = _train(program, optimizer, 4)
    program, optimizer = _setup(2, MODEL)
    first = _train(program, optimizer, 2)
    program.save(str(tmp_path / "ckpt"), optimizer=optimizer, step=2)
    program, optimizer = _setup(3, MODEL)
    program.load(str(tmp_path / "ckpt"), optimizer=optimizer)
    second = _train(program, optimizer, 2)
    assert first + second == pytest.approx(uninterrupted, rel=1e-6)


def test_a_checkpoint_loads_into_the_plain_model(tmp_path):
    program, optimizer = _setup(2, MODEL)
    _train(program, optimizer, 2)
    program.save(str(tmp_path / "ckpt"))
    plain = copy.deepcopy(MODEL)
    plain.load_state_dict(fxpipe.load_checkpoint(str(tmp_path / "ckpt"))["model"])  # strict
    torch.testing.assert_close(plain(X), program(X))


def test_writes_are_atomic_and_loading_is_weights_only(tmp_path, monkeypatch):
    program, _ = _setup(2, MODEL)
    target = tmp_path / "ckpt"
    program.save(str(target))
    before = sorted(os.listdir(target))
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    fxpipe.load_checkpoint(str(target))
    assert calls and all(calls)  # every file is read with weights_only=True

    def crash(obj, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        program.save(str(target))
    assert sorted(os.listdir(target)) == before  # no temporary left behind, nothing replaced
    monkeypatch.undo()
    fxpipe.load_checkpoint(str(target))  # the old checkpoint is intact


def test_an_incomplete_checkpoint_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint.json"):
        fxpipe.load_checkpoint(str(tmp_path / "ckpt"))
    program, _ = _setup(2, MODEL)
    program.save(str(tmp_path / "ckpt2"))
    meta = json.loads((tmp_path / "ckpt2" / "checkpoint.json").read_text())
    meta["shards"] = 2
    (tmp_path / "ckpt2" / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="lacks shard-00001.pt"):
        fxpipe.load_checkpoint(str(tmp_path / "ckpt2"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    return [line.split(" (")[0] for line in result.stdout.splitlines() if line.startswith("step ")]


@pytest.mark.slow
@pytest.mark.distributed
def test_distributed_resume_gives_exactly_the_losses_of_an_uninterrupted_run(tmp_path):
    program = fxpipe.compile(copy.deepcopy(MODEL), (X,), stages=2, chunks=4, profile="a100")
    program.write(str(tmp_path / "prog"), target=Y, reference_steps=0)
    script = str(tmp_path / "prog" / "program.py")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                               "2", "--master-port", str(_free_port()), script, *args],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})

    whole = _losses(run("--steps", "4"))
    first = _losses(run("--steps", "2", "--save", str(tmp_path / "ckpt")))
    second = _losses(run("--steps", "2", "--resume", str(tmp_path / "ckpt")))
    assert first + second == whole
    assert second[0].startswith("step 2 ")


def test_two_writes_of_a_program_give_identical_files(tmp_path):
    program, _ = _setup(2, MODEL)
    program.write(str(tmp_path / "a"), target=Y, reference_steps=0)
    program.write(str(tmp_path / "b"), target=Y, reference_steps=0)
    names = sorted(os.listdir(tmp_path / "a"))
    assert "weights.pt" in names and names == sorted(os.listdir(tmp_path / "b"))
    for name in names:  # torch.save embedded the temporary file's name before
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name

"""Failures in a distributed run: no hangs, every rank exits non-zero, the error shows once."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fxpipe
from fxpipe.errors import PipelineRuntimeError
from fxpipe.models import gpt, mlp
from fxpipe.runtime.program.torchrun import free_port

pytestmark = pytest.mark.distributed

BOUND_S = 60  # the promise: peers stop within this many seconds


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("failing")
    model, inputs = gpt.build(dropout=0.0)
    program = fxpipe.compile(model, inputs, stages=2, chunks=2, profile="a100")
    program.write(str(folder), target=gpt.target(inputs), reference_steps=0)
    return folder


def _start(folder: Path, world: int, *args: str) -> list[tuple[subprocess.Popen, Path, Path]]:
    port = free_port()
    procs = []
    for rank in range(world):
        out, err = folder / f"rank{rank}.out", folder / f"rank{rank}.err"
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, str(folder / "program.py"), *args], env=env,
                                stdout=open(out, "w"), stderr=open(err, "w"))
        procs.append((proc, out, err))
    return procs


def _wait_all(procs, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for proc, _, _ in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p, _, _ in procs:
                p.kill()
            pytest.fail(f"a rank did not exit within {timeout} s: the run hangs")
    return codes


def test_killing_a_rank_mid_training_stops_the_others_quickly(written):
    procs = _start(written, 2, "--steps", "100000", "--timeout", str(BOUND_S))
    out0 = procs[0][1]
    deadline = time.monotonic() + 180
    while "step 1 loss" not in out0.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "step 1 loss" in out0.read_text(), "training did not start"
    killed_at = time.monotonic()
    os.kill(procs[1][0].pid, signal.SIGKILL)
    codes = _wait_all(procs[:1], BOUND_S)
    procs[1][0].wait()
    elapsed = time.monotonic() - killed_at
    assert codes[0] != 0
    assert elapsed < BOUND_S
    err0 = procs[0][2].read_text()
    assert "stopping, another rank failed or exited" in err0
    assert "Traceback" not in err0
    print(f"rank 0 exited with status {codes[0]} {elapsed:.1f} s after rank 1 was killed")


def test_an_error_inside_a_stage_stops_every_rank_and_is_printed_once(written):
    # A learning rate this large makes the weights infinite after the first step; with
    # --check-finite the first stage that computes them raises, naming itself.
    procs = _start(written, 2, "--steps", "5", "--lr", "1e30", "--check-finite",
                   "--timeout", str(BOUND_S))
    start = time.monotonic()
    codes = _wait_all(procs, BOUND_S + 60)
    assert all(code != 0 for code in codes), codes
    assert time.monotonic() - start < BOUND_S + 60
    errors = [p[2].read_text() for p in procs]
    assert sum(e.count("non-finite values (NaN/Inf) first appear in stage") for e in errors) == 1
    assert any("stopping, another rank failed or exited" in e for e in errors)


def test_nan_check_names_the_stage_and_the_node_in_process():
    model, (x,) = mlp.build()
    program = fxpipe.compile(model, (x,), stages=3, chunks=2, check_finite=True, profile="a100")
    program(x)  # finite: no error
    with torch.no_grad():
        model.blocks[4].fc1.weight.fill_(float("nan"))
    stage = next(st.index for st in program.stages
                 if any(n.name == "blocks_4_fc1" for n in st.graph_module.graph.nodes))
    with pytest.raises(PipelineRuntimeError) as err:
        program(x)
    text = str(err.value)
    assert f"first appear in stage {stage}, micro-batch 0 at node blocks_4_fc1" in text
    assert "fxpipe/models/mlp.py" in text  # the user's source line
    assert "hint:" in text


def _rank_pid(root: int, rank: int) -> int | None:
    """The pid of `rank` among the processes below `root` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ and b"program.py" in command \
                    and b"torch.distributed.run" not in command:
                return pid
    return None


def _signal_rank_of_fxpipe_run(folder: Path, tmp_path: Path, sig: signal.Signals,
                               timeout: int) -> tuple[int, str, float]:
    """Starts `fxpipe run`, sends `sig` to rank 1 once training runs; returns the exit status,
    stderr and the seconds from the signal to the exit."""
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "fxpipe", "run", str(folder), "--nproc",
                                 "2", "--steps", "100000", "--timeout", str(timeout)],
                                stdout=stdout, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 180
        while "step 1 loss" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        pid = _rank_pid(proc.pid, 1)
        assert pid is not None, "training did not start"
        sent = time.monotonic()
        os.kill(pid, sig)
        _, err = proc.communicate(timeout=timeout + 60)
        return proc.returncode, err, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            for pid in [p for p in (_rank_pid(proc.pid, 0), _rank_pid(proc.pid, 1)) if p]:
                os.kill(pid, signal.SIGKILL)
            proc.kill()


@pytest.mark.slow
def test_fxpipe_run_names_a_rank_killed_by_a_signal(written, tmp_path):
    code, err, _ = _signal_rank_of_fxpipe_run(written, tmp_path, signal.SIGKILL, BOUND_S)
    assert code == 1
    assert err.startswith("fxpipe: error: rank 1 (stage 1) was killed by SIGKILL (full log: "), err


@pytest.mark.slow
def test_fxpipe_run_ends_within_the_timeout_when_a_rank_is_stopped(written, tmp_path):
    code, err, elapsed = _signal_rank_of_fxpipe_run(written, tmp_path, signal.SIGSTOP, 10)
    assert code == 1
    assert "rank 1 (stage 1)" in err and ("stopped" in err or "hung" in err), err
    assert elapsed < 10 + 6, f"{elapsed:.1f} s after rank 1 was stopped, at --timeout 10"

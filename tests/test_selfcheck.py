"""fxpipe selfcheck: the command runs its CPU checks here, says what it skipped, and reports a
check that fails as FAILED with exit status 1."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fxpipe.program import Program
from fxpipe.tools import selfcheck


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU says")
def test_selfcheck_runs_the_cpu_checks_and_says_what_it_skipped():
    result = subprocess.run([sys.executable, "-m", "fxpipe", "selfcheck", "--models", "mlp",
                             "--quick", "--no-distributed"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "pipeline = model, mlp, remat except_last, fp32" in out
    assert "pipeline = model, mlp, remat except_last, bf16" in out
    assert "model already on the GPU" in out and "no GPU" in out
    assert "written program, one process" in out and "--verify OK" in out
    assert "dropout: the pipeline draws the plain model's masks" in out
    assert "compile(autocast='bf16') is sized for bf16" in out
    assert "host syncs per step" in out
    assert "ok, 0 failed, 2 skipped" in out


@pytest.mark.slow
def test_a_pipeline_that_computes_something_else_fails_the_selfcheck(monkeypatch):
    real_step = Program.step

    def wrong_step(self, *args, **kwargs):
        loss = real_step(self, *args, **kwargs)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(1.01)  # a gradient 1% off, as a lost micro-batch share would be
        return loss

    monkeypatch.setattr(Program, "step", wrong_step)
    lines: list[str] = []
    code = selfcheck.run_selfcheck(["mlp"], remat=("never",), precisions=("fp32",),
                                   distributed=False, log=lines.append)
    assert code == 1
    row = next(line for line in lines if "mlp, remat never, fp32" in line)
    assert "FAILED" in row and "differs by" in row


def test_tolerances_follow_the_arithmetic_in_use_tf32_convolutions_included():
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3))
    linear = torch.nn.Sequential(torch.nn.Linear(3, 3))
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    matmul, convolution = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
        assert selfcheck.arithmetic("fp32", gpu, conv)[0] == "tf32"  # cuDNN's default
        assert selfcheck.arithmetic("fp32", gpu, linear)[0] == "fp32"
        assert selfcheck.arithmetic("fp32", cpu, conv)[0] == "fp32"
        torch.backends.cudnn.allow_tf32 = False
        assert selfcheck.arithmetic("fp32", gpu, conv)[0] == "fp32"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert selfcheck.arithmetic("fp32", gpu, linear)[0] == "tf32"
        assert selfcheck.arithmetic("bf16", gpu, linear)[0] == "bf16"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, convolution
    assert selfcheck.tolerance("fp32") == 1e-4
    assert selfcheck.tolerance("tf32") == pytest.approx(8 * 2**-11)  # above the 2e-3 it was
    assert selfcheck.tolerance("bf16") == pytest.approx(8 * 2**-8)


def test_a_run_that_fails_after_a_good_verdict_shows_its_cause_not_the_verdict(monkeypatch):
    result = subprocess.CompletedProcess(
        [], 1, stdout="step 0 loss 6.2\nverify: OK: steps 0..1 against the plain model\n",
        stderr="Traceback (most recent call last):\nRuntimeError: Connection reset by peer\n"
               "==========\n")
    monkeypatch.setattr(selfcheck.subprocess, "run", lambda *a, **k: result)
    with pytest.raises(AssertionError) as info:
        selfcheck._run(["program.py"])
    assert str(info.value) == "exit 1: RuntimeError: Connection reset by peer"


def test_the_host_sync_check_passes_a_step_that_reads_once_and_fails_one_that_waits_more(
        monkeypatch):
    """The GPU check's code path, on the CPU: torch's CUDA calls stand in as no-ops, and a step
    that also synchronizes the device fails the check."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    cpu = torch.device("cpu")
    assert selfcheck._host_syncs(cpu, steps=1).startswith("0 host read(s) and 0 sync(s)")
    real_step = Program.step

    def waiting_step(self, *args, **kwargs):
        for _ in range(2):
            torch.cuda.synchronize()
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(Program, "step", waiting_step)
    with pytest.raises(AssertionError, match="2 host read"):
        selfcheck._host_syncs(cpu, steps=1)

"""`fxpipe selfcheck`: on this machine, in minutes, what the CPU test suite cannot prove.

With a GPU it checks, against the plain model on that GPU (loss and every parameter's gradient):
every reference model pipelined on devices ["cuda:0", "cuda:0"] in every remat mode, in fp32
and under bf16 autocast; a model that already sits on the GPU, compiled as it is; a written
program run in one process on the GPU (its --verify against the plain model); with two or more
GPUs, a written program of every schedule (GPipe, 1F1B, ZB-H1 on 2 stages; interleaved 1F1B
and ZB-V on 4 stages, two per rank) under torchrun over NCCL. It
also times the device profile against the datasheet preset. Without a GPU it runs the same
checks on the CPU (torchrun over gloo in strict point-to-point mode, which keeps NCCL's ordering
rules) and says what it skipped. One table at the end; exit status 1 when a check failed.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tabulate import tabulate

import fxpipe
from fxpipe.losses import default_loss
from fxpipe.models import MODELS, load
from fxpipe.profile import PRESETS, DeviceProfile, measure
from fxpipe.runtime.schedule import SCHEDULES, default_stages_per_rank

__all__ = ["run_selfcheck", "Check"]

REMAT_MODES = ("never", "except_last", "always")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Check:
    """One line of the table."""

    name: str
    where: str
    status: str  # "ok", "FAILED" or "skipped"
    detail: str
    seconds: float


def run_selfcheck(models: Sequence[str] = MODELS, *, remat: Sequence[str] = REMAT_MODES,
                  precisions: Sequence[str] = PRECISIONS, distributed: bool = True,
                  log: Callable[[str], None] = print) -> int:
    """Runs every check, printing a progress line per check and the table at the end."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    log(f"fxpipe selfcheck {fxpipe.__version__}, torch {torch.__version__}: "
        + (f"{gpus} GPU(s), {torch.cuda.get_device_name(0)}" if gpus else "no GPU, CPU checks"))
    checks: list[Check] = []

    def record(check: Check) -> None:
        checks.append(check)
        log(f"  {check.status:<7} {check.name} ({check.where}): {check.detail} "
            f"[{check.seconds:.1f} s]")

    for name in models:
        for mode in remat:
            for precision in precisions:
                record(_timed(f"pipeline = model, {name}, remat {mode}, {precision}",
                              str(device),
                              functools.partial(_transparency, name, mode, precision, device)))
    if gpus:
        record(_timed("model already on the GPU", str(device),
                      functools.partial(_model_on_device, device)))
    else:
        record(Check("model already on the GPU", "-", "skipped", "no GPU", 0.0))
    record(_timed("written program, one process", str(device), _written_local))
    if distributed:
        backend = "nccl" if gpus >= 2 else "gloo, strict point-to-point"
        for schedule in SCHEDULES:
            record(_timed(f"written program, 2 ranks, {schedule}", backend,
                          functools.partial(_written_torchrun, schedule, gpus >= 2)))
        if 0 < gpus < 2:
            record(Check("NCCL between ranks", "-", "skipped", "needs 2 GPUs (NCCL puts one rank "
                         "on each)", 0.0))
    record(_timed("device profile", str(device), functools.partial(_profile, device)))
    log("\n" + tabulate([[c.name, c.where, c.status, c.detail, f"{c.seconds:.1f}"]
                         for c in checks],
                        headers=["check", "where", "result", "detail", "s"], tablefmt="simple"))
    failed = [c for c in checks if c.status == "FAILED"]
    skipped = [c for c in checks if c.status == "skipped"]
    log(f"\n{len(checks) - len(failed) - len(skipped)} ok, {len(failed)} failed, "
        f"{len(skipped)} skipped")
    return 1 if failed else 0


def _timed(name: str, where: str, check: Callable[[], str]) -> Check:
    """Runs one check: its detail line when it passes, the error's first line when not."""
    start = time.perf_counter()
    try:
        detail = check()
        status = "ok"
    except Exception as e:  # noqa: BLE001 - a failed check is a row of the table
        detail = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        if os.environ.get("FXPIPE_DEBUG"):
            traceback.print_exc()
        status = "FAILED"
    return Check(name, where, status, detail, time.perf_counter() - start)


def _case(name: str, device: torch.device) -> tuple[torch.nn.Module, tuple[Any, ...],
                                                    dict[str, Any], torch.Tensor | None]:
    """A reference model that a pipeline must match exactly, its batch and its target."""
    model, inputs, kwargs = load(name, deterministic=True)
    module = importlib.import_module(f"fxpipe.models.{name}")
    target = module.target(inputs) if hasattr(module, "target") else None

    def move(t: Any) -> Any:
        return t.to(device) if isinstance(t, torch.Tensor) else t

    return (model, tuple(move(x) for x in inputs), {k: move(v) for k, v in kwargs.items()},
            move(target) if target is not None else None)


def _autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _plain_step(model: torch.nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any],
                target: torch.Tensor | None, precision: str,
                device: torch.device) -> tuple[float, dict[str, torch.Tensor]]:
    with _autocast(precision, device):
        loss = default_loss(model(*inputs, **kwargs), target)
    torch.autograd.backward(loss)
    return float(loss.detach()), _grads(model)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _tolerance(precision: str, device: torch.device) -> float:
    """Largest error relative to the largest value: bf16 keeps 8 bits of mantissa; fp32 on a
    GPU convolves in TF32 by default (10 bits), on the CPU in full fp32."""
    if precision == "bf16":
        return 3e-2
    return 2e-3 if device.type == "cuda" else 1e-4


def _compare(loss: float, grads: dict[str, torch.Tensor], ref_loss: float,
             ref_grads: dict[str, torch.Tensor], tolerance: float) -> str:
    """The worst relative error over the loss and every gradient; raises past `tolerance`."""
    if set(grads) != set(ref_grads):
        raise AssertionError(f"gradients of {sorted(set(grads) ^ set(ref_grads))[:3]} exist "
                             "in one run only")
    worst, where = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12), "loss"
    for name, ref in ref_grads.items():
        error = float((grads[name].float() - ref.float()).abs().max())
        relative = error / max(float(ref.float().abs().max()), 1e-12)
        if relative > worst:
            worst, where = relative, f"gradient of {name}"
    if worst > tolerance:
        raise AssertionError(f"{where} differs by {worst:.2e} of its largest value "
                             f"(tolerance {tolerance:.0e})")
    return f"largest difference {worst:.1e} ({where})"


def _transparency(name: str, remat: str, precision: str, device: torch.device) -> str:
    model, inputs, kwargs, target = _case(name, torch.device("cpu"))
    plain = copy.deepcopy(model).to(device)
    moved = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    ref_loss, ref_grads = _plain_step(plain, moved, kwargs, target.to(device)
                                      if target is not None else None, precision, device)
    program = fxpipe.compile(model, inputs, example_kwargs=kwargs, stages=2, chunks=2,
                             remat=remat, devices=[device, device], profile="a100")
    with _autocast(precision, device):
        loss = program.step(*inputs, target=target, **kwargs)
    return _compare(loss, _grads(model), ref_loss, ref_grads, _tolerance(precision, device))


def _model_on_device(device: torch.device) -> str:
    model, inputs, kwargs, target = _case("gpt", device)
    model.to(device)
    plain = copy.deepcopy(model)
    ref_loss, ref_grads = _plain_step(plain, inputs, kwargs, target, "fp32", device)
    program = fxpipe.compile(model, inputs, example_kwargs=kwargs, stages=2, chunks=2,
                             profile="a100")
    loss = program.step(*inputs, target=target, **kwargs)
    return _compare(loss, _grads(model), ref_loss, ref_grads, _tolerance("fp32", device))


def _write(folder: str, schedule: str) -> None:
    model, inputs, kwargs, target = _case("gpt", torch.device("cpu"))
    program = fxpipe.compile(model, inputs, example_kwargs=kwargs,
                             stages=2 * default_stages_per_rank(schedule), chunks=2,
                             schedule=schedule, profile="a100")
    program.write(folder, target=target, reference_steps=2)


def _run(command: list[str], env: dict[str, str] | None = None) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    lines = (result.stdout + result.stderr).strip().splitlines()
    verdict = next((line for line in lines if line.startswith("verify:")), None)
    if result.returncode != 0 or verdict is None or "OK" not in verdict:
        raise AssertionError(verdict or (lines[-1] if lines else f"exit {result.returncode}"))
    difference = verdict.rsplit("difference", 1)[-1].split("(")[0].strip()
    return f"--verify OK, largest loss difference {difference}"


def _written_local() -> str:
    with _folder() as folder:
        _write(folder, "gpipe")
        return _run([sys.executable, os.path.join(folder, "program.py"), "--steps", "2",
                     "--verify"])


def _written_torchrun(schedule: str, nccl: bool) -> str:
    with _folder() as folder:
        _write(folder, schedule)
        env = {} if nccl else {"FXPIPE_P2P": "strict", "CUDA_VISIBLE_DEVICES": ""}
        return _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "--master-port", str(_free_port()), os.path.join(folder, "program.py"),
                     "--steps", "2", "--verify"], env)


def _profile(device: torch.device) -> str:
    measured = measure(device)
    preset = _preset(device)
    text = (f"{_rate(measured.peak_flops, 'FLOP/s')} matmul, "
            f"{_rate(measured.mem_bandwidth, 'B/s')} copy, "
            f"{measured.kernel_overhead * 1e6:.1f} us per kernel")
    if preset is None:
        return text + ("" if device.type == "cuda" else " (no datasheet preset for a CPU)")
    return (f"{text}; {measured.peak_flops / preset.peak_flops:.0%} of the {preset.name} "
            f"datasheet, {measured.mem_bandwidth / preset.mem_bandwidth:.0%} of its bandwidth")


def _rate(value: float, unit: str) -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _preset(device: torch.device) -> DeviceProfile | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((PRESETS[key] for key in sorted(PRESETS) if "-" not in key and key in name), None)


@contextlib.contextmanager
def _folder() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="fxpipe-selfcheck-") as root:
        yield os.path.join(root, "program")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port

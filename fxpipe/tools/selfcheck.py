"""`fxpipe selfcheck`: on this machine, in minutes, what the CPU test suite cannot prove.

With a GPU it checks, against the plain model on that GPU (loss and every parameter's gradient):
every reference model pipelined on devices ["cuda:0", "cuda:0"] in every remat mode, in fp32
and under bf16 autocast; a model that already sits on the GPU, compiled as it is; a written
program run in one process on the GPU (its --verify against the plain model); with two or more
GPUs, a written program of every schedule (GPipe, 1F1B, ZB-H1 on 2 stages; interleaved 1F1B
and ZB-V on 4 stages, two per rank) under torchrun over NCCL; two ranks on a node that shows
them one GPU (gloo on the CPU, said once); a model with dropout whose masks must be the plain
model's; compile(autocast="bf16") sized for bf16 (profile and boundary dtypes); the host
syncs of a steady-state step on the GPU (one: the loss step() returns). It also times
the device profile against the datasheet preset. Without a GPU it runs the same checks on the
CPU (torchrun over gloo in strict point-to-point mode, which keeps NCCL's ordering rules) and
says what it skipped. One table at the end; exit status 1 when a check failed.

Each comparison's tolerance follows from the arithmetic in use (`arithmetic`, `tolerance`):
8 units of roundoff of the autocast dtype, or of TF32 where torch computes fp32 matmuls or a
model's convolutions in it (cuDNN's default on a GPU), and 1e-4 in full fp32; each row says
which.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tabulate import tabulate

import fxpipe
from fxpipe import ir
from fxpipe.losses import default_loss
from fxpipe.models import MODELS, gpt, load
from fxpipe.profile import PRESETS, DeviceProfile, measure
from fxpipe.profile.presets import spec_of_device
from fxpipe.runtime.planning.schedule import SCHEDULES, default_stages_per_rank
from fxpipe.runtime.program.torchrun import free_port
from fxpipe.testing.host_syncs import HostSyncs
from fxpipe.testing.reference_step import reference_step

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
    record(_timed("dropout: the pipeline draws the plain model's masks", str(device),
                  functools.partial(_dropout, device)))
    if gpus:
        record(_timed("host syncs per step, 2 stages x 8 micro-batches", str(device),
                      functools.partial(_host_syncs, device)))
    else:
        record(Check("host syncs per step, 2 stages x 8 micro-batches", "-", "skipped",
                     "no GPU (tests/test_host_syncs.py counts them on the CPU)", 0.0))
    record(_timed("compile(autocast='bf16') is sized for bf16", str(device),
                  functools.partial(_autocast_sizing, device)))
    record(_timed("written program, one process", str(device), _written_local))
    if distributed:
        backend = "nccl" if gpus >= 2 else "gloo, strict point-to-point"
        for schedule in SCHEDULES:
            record(_timed(f"written program, 2 ranks, {schedule}", backend,
                          functools.partial(_written_torchrun, schedule, gpus >= 2)))
        if 0 < gpus < 2:
            record(Check("NCCL between ranks", "-", "skipped", "needs 2 GPUs (NCCL puts one rank "
                         "on each)", 0.0))
        if gpus:
            record(_timed("written program, 2 ranks on 1 visible GPU", "gloo on the CPU",
                          _more_ranks_than_gpus))
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


# Bits of mantissa of each arithmetic (TF32 keeps fp16's 10 over fp32's exponent).
_MANTISSA_BITS = {"fp32": 23, "tf32": 10, "fp16": 10, "bf16": 7}


def arithmetic(precision: str, device: torch.device, model: torch.nn.Module) -> tuple[str, str]:
    """The coarsest arithmetic a check computes in, and why: the autocast dtype; on a GPU, TF32
    where torch allows it for matmuls, or for convolutions (cuDNN's default) when the model
    has any; else fp32."""
    if precision != "fp32":
        return precision, f"{precision} autocast"
    if device.type == "cuda":
        if torch.backends.cuda.matmul.allow_tf32:
            return "tf32", "TF32 matmuls (torch.backends.cuda.matmul.allow_tf32)"
        convolutions = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules())
        if convolutions and torch.backends.cudnn.allow_tf32:
            return "tf32", "TF32 convolutions (torch.backends.cudnn.allow_tf32)"
    return "fp32", "fp32"


def tolerance(arithmetic: str) -> float:
    """Largest error relative to the largest value: 8 units of roundoff of the arithmetic
    (2^-(bits+1)), and never below 1e-4, which micro-batches summed in another order than the
    full batch reach in fp32."""
    return max(1e-4, 8 * 2.0 ** -(_MANTISSA_BITS[arithmetic] + 1))


def _compare(loss: float, grads: dict[str, torch.Tensor], ref_loss: float,
             ref_grads: dict[str, torch.Tensor], used: tuple[str, str]) -> str:
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
    bound = tolerance(used[0])
    if worst > bound:
        raise AssertionError(f"{where} differs by {worst:.2e} of its largest value "
                             f"(tolerance {bound:.1e} for {used[1]})")
    return f"largest difference {worst:.1e} ({where}), tolerance {bound:.1e} for {used[1]}"


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
    return _compare(loss, _grads(model), ref_loss, ref_grads,
                    arithmetic(precision, device, model))


def _model_on_device(device: torch.device) -> str:
    model, inputs, kwargs, target = _case("gpt", device)
    model.to(device)
    plain = copy.deepcopy(model)
    ref_loss, ref_grads = _plain_step(plain, inputs, kwargs, target, "fp32", device)
    program = fxpipe.compile(model, inputs, example_kwargs=kwargs, stages=2, chunks=2,
                             profile="a100")
    loss = program.step(*inputs, target=target, **kwargs)
    return _compare(loss, _grads(model), ref_loss, ref_grads, arithmetic("fp32", device, model))


def _write(folder: str, schedule: str) -> None:
    model, inputs, kwargs, target = _case("gpt", torch.device("cpu"))
    program = fxpipe.compile(model, inputs, example_kwargs=kwargs,
                             stages=2 * default_stages_per_rank(schedule), chunks=2,
                             schedule=schedule, profile="a100")
    program.write(folder, target=target, reference_steps=2)


def _run(command: list[str], env: dict[str, str] | None = None, expect: str = "") -> str:
    """Runs a written program; its --verify line when it passed (and printed `expect`)."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    lines = (result.stdout + result.stderr).strip().splitlines()
    verdict = next((line for line in lines if line.startswith("verify:")), None)
    if result.returncode != 0 or verdict is None or "OK" not in verdict:
        # the verdict when there is one, else the last line that says why (not a banner)
        why = next((line for line in reversed(lines) if line.strip(" =-")), "")
        raise AssertionError(verdict if verdict and "OK" not in verdict else
                             f"exit {result.returncode}: {why}")
    if expect and sum(expect in line for line in lines) != 1:
        raise AssertionError(f"the run did not say {expect!r} once")
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
                     "--master-port", str(free_port()), os.path.join(folder, "program.py"),
                     "--steps", "2", "--verify"], env)


def _more_ranks_than_gpus() -> str:
    """Two ranks on a node that shows them one GPU: gloo on the CPU, said once, not a crash of
    NCCL's ("Duplicate GPU detected")."""
    with _folder() as folder:
        _write(folder, "gpipe")
        return _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "--master-port", str(free_port()), os.path.join(folder, "program.py"),
                     "--steps", "2", "--verify"], {"CUDA_VISIBLE_DEVICES": "0"},
                    expect="2 ranks on this node but 1 GPU")


def _dropout(device: torch.device) -> str:
    """A model with dropout on `device`: the pipeline's masks are the plain model's on each
    micro-batch (every generator the stages draw from is seeded per micro-batch)."""
    model, (idx,) = gpt.build(dropout=0.1)
    target = gpt.target((idx,)).to(device)
    model.to(device)
    idx = idx.to(device)
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (idx,), stages=2, chunks=2, devices=[device, device],
                             profile="a100")
    torch.manual_seed(0)
    loss = program.step(idx, target=target)
    torch.manual_seed(0)
    ref_loss = reference_step(program, plain, idx, target=target)
    return _compare(loss, _grads(model), ref_loss, _grads(plain),
                    arithmetic("fp32", device, model))


def _host_syncs(device: torch.device, steps: int = 3) -> str:
    """A tiny GPT with dropout on two stages of the GPU, 8 micro-batches: after warm-up a step
    waits for the device once, to return the loss. Counted twice: the Python calls that read
    device values or synchronize (fxpipe.testing.host_syncs), and the syncs inside CUDA ops
    that torch's sync debug mode reports."""
    model, (idx,) = gpt.build(batch=16, dropout=0.1)
    target = gpt.target((idx,)).to(device)
    model.to(device)
    idx = idx.to(device)
    program = fxpipe.compile(model, (idx,), stages=2, chunks=8, devices=[device, device],
                             profile="a100")
    for _ in range(2):
        program.step(idx, target=target)
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught, HostSyncs() as reads:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                program.step(idx, target=target)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    debug = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    said = f"{reads.count / steps:g} host read(s) and {len(debug) / steps:g} sync(s) in CUDA " \
           "ops per step"
    if reads.count > steps or len(debug) > steps:
        raise AssertionError(f"{said}, expected at most 1 each (the loss): {reads.report()}; "
                             f"{'; '.join(sorted(set(debug)))}")
    return said


def _autocast_sizing(device: torch.device) -> str:
    """compile(autocast='bf16'): the profile measured on `device` in bf16, and a boundary after
    a matmul sent in bf16."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(device)
    x = torch.randn(8, 64, device=device)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, devices=[device, device],
                             autocast="bf16")
    profile = program.built.profile
    (sent,) = program.built.stages[0].graph.sends
    dtype = sent.value.dtype if isinstance(sent.value, ir.TensorInfo) else None
    if profile.precision != "bf16" or dtype != torch.bfloat16:
        raise AssertionError(f"profile {profile.name} ({profile.precision}), boundary sent as "
                             f"{dtype}: not sized for bf16")
    return f"profile {profile.name} ({profile.precision}), boundary sent as {dtype}"


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
    key = spec_of_device(torch.cuda.get_device_name(device))
    return PRESETS[key] if key is not None else None


@contextlib.contextmanager
def _folder() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="fxpipe-selfcheck-") as root:
        yield os.path.join(root, "program")



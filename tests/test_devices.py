"""Devices: host-to-device copies, per-device dropout seeds, device-time timelines, and the
CUDA paths of both executors (marked `cuda`; they skip without a GPU, and the NCCL ones without
two)."""
from __future__ import annotations

import copy
import importlib
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from ranks import spawn
from test_p2p import _chain_case
from torch import nn

import fxpipe
from fxpipe.losses import default_loss
from fxpipe.models import load as load_model
from fxpipe.runtime.execution.amp import AutocastState
from fxpipe.runtime.execution.devices import (
    CudaTimeline,
    WallTimeline,
    make_timeline,
    pin_for,
    stage_devices,
    to_device,
)
from fxpipe.runtime.execution.forward import seeded_forward
from fxpipe.runtime.execution.local import _thread_modes

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_two = pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2,
                               reason="needs two CUDA devices")


# -- on any machine ------------------------------------------------------------------------------


def test_cpu_tensors_for_a_cpu_stage_are_neither_pinned_nor_copied():
    x = torch.randn(3)
    assert pin_for([x, None], torch.device("cpu"))[0] is x
    assert to_device(x, torch.device("cpu")) is x
    assert stage_devices(torch.device("cpu"), [x]) == []


def test_each_micro_batch_draws_its_own_dropout_mask_on_cpu():
    def mask(mb: int) -> torch.Tensor:
        with seeded_forward(7, mb, []):
            return torch.rand(8)

    assert torch.equal(mask(1), mask(1))  # the same whatever ran before
    assert not torch.equal(mask(1), mask(2))
    state = torch.get_rng_state()
    mask(0)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's stream is untouched


def test_wall_timeline_marks_a_span_that_started_earlier():
    timeline = make_timeline(torch.device("cpu"))
    assert type(timeline) is WallTimeline
    start = time.perf_counter()
    with timeline.span("forward", 0, 0):
        pass
    timeline.mark("send", 0, 0, start, detail="h")
    events = timeline.resolve()
    assert [e.kind for e in events] == ["forward", "send"]
    assert events[1].start <= events[0].start and events[1].detail == "h"


# -- CUDA ------------------------------------------------------------------------------------------


@pytest.mark.cuda
@needs_cuda
def test_inputs_for_a_cuda_stage_are_pinned_once_and_copied_without_blocking():
    x = torch.randn(64, 8)
    (pinned,) = pin_for([x], torch.device("cuda"))
    assert pinned.is_pinned() and not x.is_pinned()
    part = pinned.tensor_split(4)[1]
    assert part.is_pinned()  # a micro-batch of a pinned batch is pinned
    y = to_device(part, torch.device("cuda", 0))
    torch.cuda.synchronize()
    assert torch.equal(y.cpu(), x.tensor_split(4)[1])


@pytest.mark.cuda
@needs_cuda
def test_cuda_timeline_measures_device_time():
    device = torch.device("cuda", 0)
    timeline = make_timeline(device)
    assert isinstance(timeline, CudaTimeline)
    a = torch.randn(2048, 2048, device=device)
    with timeline.span("forward", 0, 0):
        for _ in range(20):
            a = a @ a / 2048
    with timeline.span("backward", 0, 0):
        pass
    forward, backward = timeline.resolve()  # read from CUDA events once the work is done
    assert 0 <= forward.start < forward.end <= backward.start <= backward.end


@pytest.mark.cuda
@needs_cuda
def test_autocast_reaches_a_local_stage_on_cuda():
    model, x, y = _chain_case()
    plain = copy.deepcopy(model).cuda()
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, devices=["cuda:0", "cuda:0"],
                             profile="a100")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = program(x.cuda())
        ref = plain(x.cuda())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0.02, atol=0.02)


class _Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.b(torch.relu(self.a(x))), 0.5, training=True)


@pytest.mark.cuda
@needs_two
def test_a_stage_on_the_second_gpu_draws_a_new_dropout_mask_per_micro_batch():
    model = _Dropout()
    x = torch.ones(4, 16)
    program = fxpipe.compile(model, (x,), stages=2, chunks=4, split_points=["b"],
                             devices=["cuda:0", "cuda:1"], profile="a100")
    masks = (program(x) == 0).cpu()  # stage 1 (dropout) runs on cuda:1
    assert len({tuple(m.tolist()) for m in masks}) == 4
    assert not torch.equal(masks, (program(x) == 0).cpu())  # and a new one per step


def _nccl_steps(rank: int, world: int, cases: list[tuple[str, int]]) -> dict:
    out = {}
    for schedule, chunks in cases:
        model, x, y = _chain_case()
        program = fxpipe.compile(model, (x,), stages=world, chunks=chunks, schedule=schedule,
                                 split_points=[f"blocks.{i}" for i in range(1, world)],
                                 profile="a100")
        loss = program.step(x, target=y)
        grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
        program.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16 = program.step(x, target=y)  # learns the bf16 boundary dtypes over NCCL
        events = [e.kind for e in program._rank.executor.last.events]
        out[(schedule, chunks)] = (loss, grads, bf16, events)
    return out


@pytest.mark.cuda
@needs_two
def test_gpipe_and_1f1b_over_nccl_train_like_the_model():
    cases = [("gpipe", 4), ("1f1b", 4)]
    ranks = spawn(2, "test_devices", "_nccl_steps", cases, backend="nccl", timeout=60)
    model, x, y = _chain_case()
    plain = copy.deepcopy(model)
    loss = default_loss(plain(x), y)
    loss.backward()
    for case in cases:
        assert ranks[0][case][0] == pytest.approx(float(loss.detach()), rel=1e-4)
        got = {k: g for r in ranks for k, g in r[case][1].items()}
        for name, p in plain.named_parameters():
            torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-5)
        assert ranks[0][case][2] == pytest.approx(float(loss.detach()), rel=0.05)
        assert {"forward", "backward", "send"} <= set(ranks[0][case][3])


@pytest.mark.cuda
@needs_two
def test_a_weight_tied_across_two_gpus_in_one_process_trains_like_the_plain_model():
    # GPT ties wte.weight (stage 0, cuda:0) and lm_head.weight (last stage, cuda:1): the
    # parameter lives on cuda:0 and stage 1 reads a differentiable copy on cuda:1.
    model, inputs, kwargs = load_model("gpt", deterministic=True)
    target = importlib.import_module("fxpipe.models.gpt").target(inputs)
    plain = copy.deepcopy(model).cuda(0)
    loss_ref = default_loss(plain(inputs[0].cuda(0)), target.cuda(0))
    loss_ref.backward()
    program = fxpipe.compile(model, inputs, stages=2, chunks=4, devices=["cuda:0", "cuda:1"],
                             profile="a100")
    loss = program.step(inputs[0].cuda(0), target=target.cuda(1))
    assert loss == pytest.approx(float(loss_ref), rel=1e-4)
    assert model.wte.weight.device == torch.device("cuda", 0)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)


def _openmp_max_threads() -> Callable[[], int] | None:
    """OpenMP's omp_get_max_threads of the library torch loaded (per thread), if it is one."""
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    for path in sorted(paths):
        function = getattr(ctypes.CDLL(path), "omp_get_max_threads", None)
        if function is not None:
            return lambda: int(function())
    return None


def test_stage_threads_run_with_the_callers_number_of_cpu_threads():
    # OpenMP keeps the thread count per thread; a fresh worker starts at OpenMP's default (every
    # core) until torch's first parallel loop there, and the small matmuls before it run on a
    # team whose idle members then spin, taking cores from the other stages
    max_threads = _openmp_max_threads()
    if max_threads is None:
        pytest.skip("torch is not built with a known OpenMP library")
    wanted = (os.cpu_count() or 1) + 1  # never OpenMP's default

    def in_a_stage_thread() -> int:
        with _thread_modes(True, AutocastState.capture(), wanted, torch.device("cpu")):
            return max_threads()

    previous = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(max_workers=1) as fresh:
            assert fresh.submit(max_threads).result() != wanted
            assert fresh.submit(in_a_stage_thread).result() == wanted
    finally:
        torch.set_num_threads(previous)

"""The local executor: every stage in one process, one worker thread per device (as torchgpipe).

The forwards run in the order of the schedule the executor is given, played on the one clock
(fxpipe.runtime.grid.play; under GPipe micro-batch m enters stage s at tick m + s), so at each
tick the stages work on different micro-batches at once; the backwards are one autograd
backward of the joined outputs, whatever the schedule. Values move between devices with a
differentiable copy, so the outputs belong to one autograd graph and `loss.backward()` reaches
every parameter of the model; remat regions recompute during that backward.

The caller's autocast state is captured when `run` is called and re-entered in every worker
thread (autocast is per thread), so `with torch.autocast(...): program(x)` takes effect in every
stage. Each micro-batch draws random numbers from its own stream, which continues from stage to
stage as through one forward of the plain model, on every device the stage uses.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fxpipe.errors import FxPipeError, PipelineRuntimeError
from fxpipe.remat_policy import RematPolicy, remat_policy
from fxpipe.runtime.amp import AutocastState
from fxpipe.runtime.batchnorm import commit_batch_norms, discard_batch_norms
from fxpipe.runtime.comm import LocalComm, MicrobatchComm
from fxpipe.runtime.devices import pin_for, stage_devices, to_device
from fxpipe.runtime.finite import check_finite
from fxpipe.runtime.grid import chain, play
from fxpipe.runtime.memory import KeptMemory
from fxpipe.runtime.schedule import ActionKind, ScheduleKind, schedule_kind
from fxpipe.runtime.stagespec import HeldStage
from fxpipe.signature import Signature

__all__ = ["LocalExecutor", "microbatch_seed", "seeded_forward", "draw_base"]

_RNG_LOCK = threading.Lock()


def microbatch_seed(base: int, microbatch: int) -> int:
    """Where micro-batch `microbatch`'s random stream starts: the first stage seeds it, later
    stages continue it (NOTE [Random streams across stages] in fxpipe.runtime.ops), so the
    masks are the same whatever runs first."""
    return (base * 1_000_003 + microbatch) % (2**63 - 1)


def draw_base() -> int:
    """One number from the caller's generator per step, from which every micro-batch's seed
    comes: seeding torch before a step makes the step reproducible."""
    return int(torch.randint(0, 2**62, (1,)).item())


@contextlib.contextmanager
def seeded_forward(base: int | None, microbatch: int,
                   devices: Sequence[torch.device] = ()) -> Iterator[None]:
    """Runs a stage forward on its micro-batch's RNG stream (when the stage draws random
    numbers), apart from the caller's: seeded here, and continued by a later stage from the
    state the stage before it hands over (NOTE [Random streams across stages]).

    devices: the CUDA devices the stage uses (fxpipe.runtime.devices.stage_devices). Each one's
    generator is forked and seeded, not only the current device's: a stage on cuda:1 would
    otherwise start every micro-batch from the same restored state, drawing the same masks.
    """
    if base is None:
        yield
        return
    indexes = [d.index for d in devices if d.type == "cuda"]
    with _RNG_LOCK, torch.random.fork_rng(devices=indexes):
        seed = microbatch_seed(base, microbatch)
        torch.default_generator.manual_seed(seed)
        for index in indexes:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


class LocalExecutor:
    def __init__(self, stages: Sequence[HeldStage], signature: Signature, chunks: int,
                 remat: RematPolicy | str, check_finite: bool = False, *,
                 schedule: ScheduleKind | str = "gpipe", ranks: int | None = None) -> None:
        self.stages = list(stages)
        self.check_finite = check_finite
        self.signature = signature
        self.chunks = chunks
        self.remat = remat_policy(remat)
        # the forwards of the schedule, tick by tick (the backward is one autograd call)
        grid = play(schedule_kind(schedule).build(chunks, len(self.stages), ranks),
                    chain(len(self.stages)))
        self.forward_ticks = [tick for tick in (
            [(a.stage, a.microbatch) for a in row if a is not None
             and a.kind == ActionKind.FORWARD] for row in grid) if tick]
        devices = sorted({str(s.device) for s in self.stages})
        self.workers = {d: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fxpipe-{d}")
                        for d in devices}
        self.workers_by_stage = [self.workers[str(s.device)] for s in self.stages]

    def run(self, tensors: Sequence[torch.Tensor],
            trackers: Sequence[KeptMemory] | None = None) -> list[Any]:
        """Flat tensor inputs in, flat outputs (joined over micro-batches) out.

        trackers: one fxpipe.runtime.memory.KeptMemory per stage, to measure kept activations.
        """
        if any(st.device.type == "cuda" for st in self.stages):
            tensors = pin_for(tensors, torch.device("cuda"))
        micro = self.signature.split_inputs(tensors, self.chunks)
        autocast = AutocastState.capture()
        discard_batch_norms()
        comm = LocalComm()
        outputs: list[Any] = [None] * self.chunks
        base = draw_base() if any(s.random for s in self.stages) else None
        grad = torch.is_grad_enabled()
        k = len(self.stages)
        for tasks in self.forward_ticks:
            futures = [(s, mb, self.workers_by_stage[s].submit(
                self._task, comm, s, mb, micro[mb], base, grad, autocast,
                trackers[s] if trackers else None)) for s, mb in tasks]
            for s, mb, future in futures:
                try:
                    result = future.result()
                except FxPipeError:
                    raise
                except Exception as e:  # noqa: BLE001 - add the stage and micro-batch
                    raise PipelineRuntimeError(
                        f"stage {s} failed on micro-batch {mb}: {type(e).__name__}: {e}",
                        hint="run the stage alone (program.stages[i]) to debug it") from e
                if s == k - 1:
                    outputs[mb] = result
        commit_batch_norms()  # deferred BatchNorm: running statistics of the whole batch
        return self.signature.join_outputs([list(o) for o in outputs])

    def _task(self, comm: LocalComm, s: int, mb: int, inputs: Sequence[torch.Tensor],
              base: int | None, grad: bool, autocast: AutocastState, tracker: Any) -> Any:
        stage = self.stages[s]
        view = MicrobatchComm(comm, s, mb, self.remat.recomputes(mb, self.chunks), stage.device)
        args = [to_device(inputs[i], stage.device) for i in stage.inputs]
        devices = stage_devices(stage.device, [*stage.module.parameters(),
                                               *stage.module.buffers()]) if stage.random else []
        with torch.set_grad_enabled(grad), autocast.enter(), _on(stage.device), \
                seeded_forward(base if stage.random else None, mb, devices), \
                (tracker.forward(mb) if tracker is not None else contextlib.nullcontext()):
            out = stage.module(view, *args)
        if self.check_finite:
            check_finite(s, mb, view.sent, out, view.received, args, stage.graph)
        return out

    def close(self) -> None:
        for worker in self.workers.values():
            worker.shutdown(wait=False)


def _on(device: torch.device) -> Any:
    """Makes a CUDA stage's device current in its worker thread (a thread starts on cuda:0)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

"""The local executor: every stage in one process, one worker thread per device (as torchgpipe).

The forwards run in the order of the schedule the executor is given, played on the one clock
(fxpipe.runtime.planning.grid.play; under GPipe micro-batch m enters stage s at tick m + s), so at
each tick the stages work on different micro-batches at once; the backwards are one autograd
backward of the joined outputs, whatever the schedule. Values move between devices with a
differentiable copy, so the outputs belong to one autograd graph and `loss.backward()` reaches
every parameter of the model; remat regions recompute during that backward.

The caller's autocast state is captured when `run` is called and re-entered in every worker
thread (autocast is per thread), so `with torch.autocast(...): program(x)` takes effect in every
stage. So is the caller's number of CPU threads: OpenMP keeps it per thread, and a worker left at
OpenMP's default (every core) runs small kernels on a team whose idle members spin, taking a
core from the other stages. Each micro-batch draws random numbers from its own stream, which
continues from stage to stage as through one forward of the plain model, on every device the
stage uses.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fxpipe.errors import FxPipeError, PipelineRuntimeError
from fxpipe.remat_policy import RematPolicy, remat_policy
from fxpipe.runtime.comm import LocalComm
from fxpipe.runtime.execution.amp import AutocastState
from fxpipe.runtime.execution.batchnorm import (
    commit_batch_norms,
    discard_batch_norms,
    too_few_values_hint,
)
from fxpipe.runtime.execution.devices import pin_for, stage_devices
from fxpipe.runtime.execution.forward import draw_base, run_forward
from fxpipe.runtime.execution.memory import KeptMemory
from fxpipe.runtime.execution.stagespec import HeldStage
from fxpipe.runtime.planning.grid import chain, play
from fxpipe.runtime.planning.schedule import ActionKind, ScheduleKind, schedule_kind
from fxpipe.signature import Signature

__all__ = ["LocalExecutor"]


class LocalExecutor:
    def __init__(self, stages: Sequence[HeldStage], signature: Signature, chunks: int,
                 remat: RematPolicy | str, check_finite: bool = False, *,
                 schedule: ScheduleKind | str = "gpipe", ranks: int | None = None) -> None:
        self.stages = list(stages)
        self.check_finite = check_finite
        self.signature = signature
        self.chunks = chunks
        self.remat = remat_policy(remat)
        self.schedule, self.ranks = schedule_kind(schedule), ranks
        self._ticks: dict[int, list[list[tuple[int, int]]]] = {}
        self.forward_ticks(chunks)
        devices = sorted({str(s.device) for s in self.stages})
        self.workers = {d: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fxpipe-{d}")
                        for d in devices}
        self.workers_by_stage = [self.workers[str(s.device)] for s in self.stages]

    def forward_ticks(self, chunks: int) -> list[list[tuple[int, int]]]:
        """The schedule's forwards of `chunks` micro-batches, tick by tick, as (stage,
        micro-batch) (the backward is one autograd call)."""
        if chunks not in self._ticks:
            grid = play(self.schedule.build(chunks, len(self.stages), self.ranks),
                        chain(len(self.stages)))
            self._ticks[chunks] = [tick for tick in (
                [(a.stage, a.microbatch) for a in row if a is not None
                 and a.kind == ActionKind.FORWARD] for row in grid) if tick]
        return self._ticks[chunks]

    def run(self, tensors: Sequence[torch.Tensor],
            trackers: Sequence[KeptMemory] | None = None) -> list[Any]:
        """Flat tensor inputs in, flat outputs (joined over micro-batches) out.

        trackers: one fxpipe.runtime.execution.memory.KeptMemory per stage, to measure kept
        activations.
        """
        if any(st.device.type == "cuda" for st in self.stages):
            tensors = pin_for(tensors, torch.device("cuda"))
        chunks = self.signature.microbatches(self.signature.batch_size(tensors), self.chunks)
        micro = self.signature.split_inputs(tensors, chunks)
        autocast = AutocastState.capture()
        discard_batch_norms()
        comm = LocalComm()
        outputs: list[Any] = [None] * chunks
        base = draw_base() if any(s.random for s in self.stages) else None
        grad = torch.is_grad_enabled()
        threads = torch.get_num_threads()
        k = len(self.stages)
        for tasks in self.forward_ticks(chunks):
            futures = [(s, mb, self.workers_by_stage[s].submit(
                self._task, comm, s, mb, micro[mb], self.remat.recomputes(mb, chunks), base,
                grad, autocast, threads, trackers[s] if trackers else None)) for s, mb in tasks]
            for s, mb, future in futures:
                try:
                    result = future.result()
                except FxPipeError:
                    raise
                except Exception as e:  # noqa: BLE001 - add the stage and micro-batch
                    split, uneven = self.signature.split_text(
                        self.signature.batch_size(tensors), chunks, self.chunks)
                    raise PipelineRuntimeError(
                        f"stage {s} failed on micro-batch {mb} ({split}): "
                        f"{type(e).__name__}: {e}",
                        hint="; ".join(h for h in (too_few_values_hint(
                            e, self.signature.batch_size(tensors) // chunks), uneven) if h)
                        or "run the stage alone (program.stages[i]) to debug it"
                    ) from e
                if s == k - 1:
                    outputs[mb] = result
        commit_batch_norms()  # deferred BatchNorm: running statistics of the whole batch
        return self.signature.join_outputs([list(o) for o in outputs])

    def _task(self, comm: LocalComm, s: int, mb: int, inputs: Sequence[torch.Tensor],
              recompute: bool, base: int | None, grad: bool, autocast: AutocastState,
              threads: int, tracker: Any) -> Any:
        """The forward in this stage's worker thread, under the caller's grad mode, autocast
        and CPU threads (each per thread) and on the stage's device."""
        stage = self.stages[s]
        devices = stage_devices(stage.device, [*stage.module.parameters(),
                                               *stage.module.buffers()]) if stage.random else []
        return run_forward(stage, comm, mb, inputs, recompute=recompute, seed_base=base,
                           rng_devices=devices, check=self.check_finite, check_outputs=True,
                           modes=_thread_modes(grad, autocast, threads, stage.device),
                           track=tracker.forward(mb) if tracker is not None else None).out

    def close(self) -> None:
        for worker in self.workers.values():
            worker.shutdown(wait=False)


@contextlib.contextmanager
def _thread_modes(grad: bool, autocast: AutocastState, threads: int,
                  device: torch.device) -> Iterator[None]:
    """The caller's grad mode, autocast and CPU threads, and the stage's device, in a worker
    thread."""
    torch.set_num_threads(threads)  # this thread's OpenMP team, as the caller's
    with torch.set_grad_enabled(grad), autocast.enter(), _on(device):
        yield


def _on(device: torch.device) -> Any:
    """Makes a CUDA stage's device current in its worker thread (a thread starts on cuda:0)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

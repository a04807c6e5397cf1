"""The planner's predictions against measurement: `python -m fxpipe.tools.plan_check`.

On the bench GPT (fxpipe.tools.bench.BENCH_GPT) and 2 gloo CPU processes, fxpipe.plan ranks its
candidates for 2 devices; the best few distinct ones are compiled with the options the plan
gives and stepped (with Adam) in an order rotated from step to step, so that drifts of the
machine hit them alike. It prints, per candidate, the predicted step and its rank, the measured
step (median and 95% interval) and its rank, the memory per device predicted and measured, and
whether the planner's choice measures within 5% of the best measured.

Memory is measured in one process per candidate: the allocated storage of the weights, buffers,
gradients and optimizer state after a step, plus the activations each stage keeps for its
backward (Program.measure_activations, at all micro-batches in flight) scaled to the micro-batches
the candidate's schedule keeps in flight at its peak: what the memory model describes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate
from torch import nn

import fxpipe
from fxpipe.losses import default_loss
from fxpipe.models import load_factory
from fxpipe.planner import Candidate, Plan, plan
from fxpipe.runtime.execution.memory import KeptMemory
from fxpipe.runtime.planning.grid import peak_inflight
from fxpipe.runtime.planning.schedule import default_stages_per_rank, placement, schedule_kind
from fxpipe.runtime.program.torchrun import free_port
from fxpipe.tools.bench import BENCH_GPT
from fxpipe.tools.bench_stats import bootstrap_interval, rotated
from fxpipe.units import human_bytes

__all__ = ["CheckRow", "competition_ranks", "check_rows", "render", "measured_memory",
           "options_of", "distinct", "main"]

TOLERANCE = 0.05  # the choice is good when its measured step is within this of the best


def competition_ranks(values: Sequence[float]) -> list[int]:
    """1 for the smallest value, ties sharing the better rank (1, 2, 2, 4)."""
    return [1 + sum(other < v for other in values) for v in values]


@dataclass(frozen=True)
class CheckRow:
    """One candidate: what the planner predicted and what it measured."""

    candidate: Candidate
    predicted_rank: int
    measured_s: float  # median seconds per step
    low_s: float  # 95% interval of the median
    high_s: float
    measured_rank: int
    predicted_memory: float  # bytes, the most a device holds
    measured_memory: float

    @property
    def memory_error(self) -> float:
        return self.predicted_memory / self.measured_memory - 1


def check_rows(candidates: Sequence[Candidate], steps: Sequence[Sequence[float]],
               measured_memory: Sequence[float]) -> list[CheckRow]:
    """The rows for these candidates (in the planner's order), given each one's measured step
    times and memory per device."""
    if not (len(candidates) == len(steps) == len(measured_memory)):
        raise ValueError(f"{len(candidates)} candidates, {len(steps)} step series and "
                         f"{len(measured_memory)} memories: one of each per candidate")
    medians = [statistics.median(s) for s in steps]
    predicted = competition_ranks([c.step_s for c in candidates])
    measured = competition_ranks(medians)
    return [CheckRow(c, p, m, *bootstrap_interval(s), r, c.memory_bytes, mem)
            for c, p, m, s, r, mem in zip(candidates, predicted, medians, steps, measured,
                                          measured_memory)]


def choice_against_best(rows: Sequence[CheckRow]) -> float:
    """The planner's choice's measured step over the best measured step (1.0: it was best)."""
    choice = min(rows, key=lambda r: (r.predicted_rank, r.candidate.step_s))
    return choice.measured_s / min(r.measured_s for r in rows)


def render(rows: Sequence[CheckRow]) -> str:
    lines = []
    for r in rows:
        c = r.candidate
        lines.append([c.ranks, c.replicas, c.stages_per_rank, c.chunks, c.schedule, c.remat,
                      c.shard, f"{c.step_s * 1e3:.1f}", r.predicted_rank,
                      f"{r.measured_s * 1e3:.1f} ({r.low_s * 1e3:.1f}-{r.high_s * 1e3:.1f})",
                      r.measured_rank, human_bytes(r.predicted_memory),
                      human_bytes(r.measured_memory), f"{r.memory_error:+.1%}"])
    table = tabulate(lines, headers=["ranks", "replicas", "stages/rank", "micro-batches",
                                     "schedule", "remat", "shard", "predicted ms", "rank",
                                     "measured ms (95%)", "rank", "memory predicted",
                                     "measured", "error"], tablefmt="github")
    ratio = choice_against_best(rows)
    verdict = "within" if ratio <= 1 + TOLERANCE else "NOT within"
    return (f"{table}\n\nthe planner's choice measures {ratio - 1:+.1%} against the best "
            f"measured: {verdict} {TOLERANCE:.0%}\n")


def distinct(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The first of each group predicted alike (step and memory): one stage runs every
    schedule the same way, and remat except_last nothing on a last stage."""
    seen: set[tuple[int, int, float, float]] = set()
    out = []
    for c in candidates:
        key = (c.ranks, c.replicas, c.step_s, c.memory_bytes)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def options_of(c: Candidate) -> dict[str, Any]:
    """fxpipe.compile's arguments for a candidate."""
    out: dict[str, Any] = {"stages": c.stages, "chunks": c.chunks, "schedule": c.schedule,
                           "remat": c.remat}
    if c.stages_per_rank != default_stages_per_rank(c.schedule):
        out["stages_per_rank"] = c.stages_per_rank
    if c.shard != "none":
        out["shard"] = c.shard
    return out


def _held_bytes(module: nn.Module, optimizer: torch.optim.Optimizer,
                state_share: float = 1.0) -> float:
    """Allocated storage of a stage's weights, buffers, gradients and optimizer state (its
    0-dim step counters aside), the state counted at `state_share` (a replica's part of it
    under shard="optimizer")."""
    def nbytes(tensors: list[torch.Tensor]) -> float:
        return float(sum(t.untyped_storage().nbytes()
                         for t in {id(t): t for t in tensors}.values()))

    held = [*module.parameters(), *module.buffers()]
    held += [p.grad for p in module.parameters() if p.grad is not None]
    state = [v for p in module.parameters() for v in optimizer.state.get(p, {}).values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return nbytes(held) + state_share * nbytes(state)


def measured_memory(model: nn.Module, inputs: tuple[Any, ...], target: Any, c: Candidate,
                    profile: Any = None) -> tuple[list[float], list[float]]:
    """(measured, predicted) bytes per stage of the candidate, in this process, on one
    replica's share of the batch: after one step with Adam, what each stage holds plus the
    activations it keeps at its schedule's peak (Program.measure_activations keeps every
    micro-batch's; each stage keeps its schedule's in-flight share of them), the last stage
    with what the loss keeps for each micro-batch in flight (_loss_kept). Under
    shard="optimizer" a replica holds 1/R of the state (ZeroRedundancyOptimizer, measured on
    gloo ranks by tests/test_shard.py); one process holds it whole, so it counts 1/R here."""
    inputs = tuple(x[:len(x) // c.replicas] for x in inputs)
    target = target[:len(target) // c.replicas]
    options = options_of(c)
    if c.shard != "none":
        options["replicas"] = c.replicas  # the memory model's share, in one process
    program = fxpipe.compile(model, inputs, profile=profile, **options)
    optimizer = torch.optim.Adam(program.parameters(), lr=1e-4)
    kept = program.measure_activations(*inputs)
    program.step(*inputs, target=target)
    optimizer.step()
    inflight = peak_inflight(schedule_kind(c.schedule).build(c.chunks, c.stages, c.ranks))
    loss = _loss_kept(program, inputs, target, c.chunks)
    measured = []
    for stage, act, f in zip(program.stages, kept, inflight):
        module = program.module_of(stage.index)
        assert module is not None
        last = stage.index == c.stages - 1
        measured.append(_held_bytes(module, optimizer,
                                    1 / c.replicas if c.shard == "optimizer" else 1.0)
                        + act["measured_bytes"] * f / c.chunks + (loss * f if last else 0.0))
    return measured, [s.memory or 0.0 for s in program.plan.stages]


def _loss_kept(program: fxpipe.Program, inputs: tuple[Any, ...], target: Any,
               chunks: int) -> float:
    """Bytes the default loss keeps for its backward per micro-batch: on the program's own
    outputs for the batch (autograd's saved-tensor hooks, each storage once; the outputs
    themselves only where the loss saves them), a `chunks`-th of it."""
    with torch.no_grad():
        out = program(*inputs)
    out = torch.utils._pytree.tree_map(
        lambda t: t.detach().requires_grad_() if isinstance(t, torch.Tensor)
        and t.is_floating_point() else t, out)
    tracker = KeptMemory()  # what the executors track a step's kept activations with
    with tracker.forward("loss"):
        default_loss(out, target)
    return tracker.peak / chunks


def per_device(c: Candidate, per_stage: Sequence[float]) -> float:
    """The most a device holds: the sum of its stages'."""
    held: dict[int, float] = {}
    for rank, nbytes in zip(placement(c.schedule, c.stages, c.ranks), per_stage):
        held[rank] = held.get(rank, 0.0) + nbytes
    return max(held.values())


def _worker(rank: int, world: int, port: int, args: dict[str, Any], queue: Any) -> None:
    try:
        queue.put((rank, _time_candidates(rank, world, port, args)))
    except Exception:  # noqa: BLE001 - reported by the parent
        import traceback

        queue.put((rank, {"error": traceback.format_exc()}))


def _time_candidates(rank: int, world: int, port: int, args: dict[str, Any]
                     ) -> dict[str, Any]:
    """Seconds per step of each candidate on this rank, stepped in rotated order."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=900))
    torch.manual_seed(0)
    model, inputs, _, target = load_factory(args["factory"], args["settings"])
    steps = []
    for options in args["candidates"]:
        program = fxpipe.compile(model, inputs, profile=args["profile"], **options)
        optimizer = program.optimizer(torch.optim.Adam, lr=1e-4)  # ZeRO-1 under a shard
        assert optimizer is not None  # every stage of the bench GPT holds parameters

        def step(program: Any = program, optimizer: Any = optimizer) -> None:
            program.step(*inputs, target=target)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps.append(step)
    names = [str(k) for k in range(len(steps))]
    times: list[list[float]] = [[] for _ in names]
    for i in range(args["warmup"] + args["steps"]):
        for k in map(int, rotated(names, i)):
            dist.barrier()
            start = time.perf_counter()
            steps[k]()
            dist.barrier()  # the step ends when its slowest rank is done
            if i >= args["warmup"]:
                times[k].append(time.perf_counter() - start)
    dist.destroy_process_group()
    return {"times": times, "load": os.getloadavg()}


def measure(found: Plan, top: int, steps: int, warmup: int, factory: str,
            settings: list[str], profile: Any) -> tuple[list[CheckRow], Any]:
    """The top distinct fitting candidates of the plan, measured (2 ranks)."""
    chosen = distinct([c for c in found.candidates if c.fits and not c.skipped])[:top]
    model, inputs, _, target = load_factory(factory, settings)
    memory = []
    for c in chosen:
        stages, _ = measured_memory(model, inputs, target, c, profile)
        memory.append(per_device(c, stages))
    args = {"factory": factory, "settings": settings, "profile": profile, "steps": steps,
            "warmup": warmup, "candidates": [options_of(c) for c in chosen]}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, found.devices, port, args, queue))
             for r in range(found.devices)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, result = queue.get(timeout=3600)
            if "error" in result:
                raise RuntimeError(f"rank {rank} failed:\n{result['error']}")
            results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    times = results[0]["times"]  # every rank waits for the slowest at the barrier
    return check_rows(chosen, times, memory), results[0]["load"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxpipe.tools.plan_check",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=6, help="candidates to measure")
    parser.add_argument("--steps", type=int, default=24, help="measured steps per candidate "
                        "(12 left the top candidates, predicted within 0.3%%, 5%% apart by noise)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", default=None,
                        help="device profile (default: measured on this machine)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    factory = "fxpipe.models.gpt:build"
    settings = [f"{k}={json.dumps(v)}" for k, v in BENCH_GPT.items()]
    model, inputs, _, _ = load_factory(factory, settings)
    found = plan(model, inputs, devices=2, profile=args.profile, prune=False)
    print(found.table(rows=args.top), end="", flush=True)
    before = os.getloadavg()
    rows, after = measure(found, args.top, args.steps, args.warmup, factory, settings,
                          args.profile)
    print(f"\nmeasured on 2 gloo processes, {args.steps} steps each, interleaved (load "
          f"average {before[0]:.2f} before, {after[0]:.2f} after):\n")
    print(render(rows), end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"candidate": r.candidate.__dict__, **{k: v for k, v in r.__dict__.items()
                                                             if k != "candidate"}}
                       for r in rows], f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

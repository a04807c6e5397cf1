"""One rank of `fxpipe bench`: builds every variant on the same model, data and micro-batches, then
times them step by step, each step running every variant once in an order rotated from step to
step, so that drifts of the machine hit them alike (fxpipe.tools.bench_stats).

Variants: the plain model in one process (rank 0; gradient accumulation over the same
micro-batches, and one step at full batch), fxpipe with every schedule of
fxpipe.runtime.planning.schedule.SCHEDULES (remat as asked) and with the other remat modes (GPipe),
and the torch.distributed.pipelining variants of fxpipe.tools.bench_torch. fxpipe's steps also
record, per stage, the compute (forward, backward, recompute; waits excluded) and the time spent
waiting for receives, and around every step every rank times the same reference work at once
(fxpipe.tools.core_speed), so that the report can tell the partition's imbalance from the cores'
own drift.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import logging
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import fxpipe
from fxpipe.errors import FxPipeError
from fxpipe.losses import default_loss
from fxpipe.models import load_factory
from fxpipe.passes.partition import PartitionPlan, best_round
from fxpipe.program import Program
from fxpipe.runtime.planning.schedule import (
    DEFAULT_SCHEDULE,
    SCHEDULES,
    ActionKind,
    default_stages_per_rank,
)
from fxpipe.runtime.planning.timeline import Event, busy_time, predicted_events, predicted_step
from fxpipe.tools.bench_stats import measured_steps, rotated
from fxpipe.tools.bench_torch import (
    TorchVariant,
    build_torch_step,
    error_line,
    failure_note,
    plan_variants,
)
from fxpipe.tools.core_speed import CoreProbe

__all__ = ["worker", "REMAT_COMPARED", "accumulate", "micro_batches", "time_variants"]

# Remat modes measured side by side: off, the default (every micro-batch but the last, whose
# backward follows at once), and every micro-batch.
REMAT_COMPARED = ("never", "except_last", "always")
_WAITS = ("recv", "recv_grad")
TRY_TIMEOUT_S = 60  # the first step of a torch variant, on every rank

Step = Callable[[], float]
Seconds = dict[str, list[float]]  # variant -> seconds of each of its steps


def worker(rank: int, world: int, port: int, args: dict[str, Any], queue: Any) -> None:
    try:
        queue.put((rank, run_worker(rank, world, port, args)))
    except Exception:  # noqa: BLE001 - report to the parent, which prints it once
        queue.put((rank, {"error": traceback.format_exc()}))


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


class _FxpipeVariant:
    """A compiled program, its optimizer, and what each of its steps measured."""

    def __init__(self, program: Program, inputs: tuple[Any, ...], target: Any) -> None:
        self.program, self.inputs, self.target = program, inputs, target
        self.optimizer = torch.optim.SGD(program.parameters(), lr=1e-3)
        self.pipeline: list[float] = []  # seconds of program.step alone
        # each step's spans, read once the timing is over: reading them is not the step's work
        # (and on a GPU waits for the device)
        self.events: list[Sequence[Event]] = []
        self.probes: list[float] = []  # seconds of the reference work around each step

    def step(self) -> float:
        start = time.perf_counter()
        loss = self.program.step(*self.inputs, target=self.target)
        self.pipeline.append(time.perf_counter() - start)
        self.events.append(self.program.measured.get("last_step_events", []))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def stage_times(self, warm: int) -> list[tuple[float, float]]:
        """(compute, receive waits) of this rank's stages together, each step after `warm`."""
        return [(busy_time(events), sum(e.end - e.start for e in events if e.kind in _WAITS))
                for events in self.events[warm:]]

    def parts(self, warm: int) -> dict[int, tuple[float, float, float]]:
        """Each stage of this rank's median (forward, backward, W) over the steps after
        `warm` (stage_parts)."""
        return median_parts([stage_parts(events) for events in self.events[warm:]])


def time_variants(names: list[str], steps: dict[str, Step], rounds: int, *, warmup: int,
                  probe: Callable[[], float], barrier: Callable[[], None],
                  alone: tuple[str, ...] = (), losses: dict[str, float] | None = None,
                  say: Callable[[str], None] = print,
                  extend: Callable[[float], int] | None = None) -> tuple[
                      Seconds, Seconds, Seconds, list[float]]:
    """Times every variant of `names` that this rank runs (`steps`) once per round, in an
    order rotated from round to round, so that drifts of the machine hit them alike; returns
    the wall and CPU seconds of each step, the reference work's seconds around each (their
    mean), and the load average of each round; `losses` gets each variant's first loss.

    Every step follows the same reference work (`probe`, which times the cores for fxpipe's
    imbalance figure): run before fxpipe's steps alone, it left them colder caches than
    torch's (the bundled MLP's torch 1F1B step took 7.7 ms after another step, 11.8 ms after
    the reference work). Every rank runs each step and its reference work at once (`barrier`)
    but for the variants one rank runs `alone`.

    `extend`, given the last warm-up round's wall seconds, says how many rounds to measure
    after the warm-up (instead of `rounds - warmup`); every rank must get the same answer.
    """
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    around: dict[str, list[float]] = {name: [] for name in names}
    load: list[float] = []
    before = probe()
    i = 0
    while i < rounds:
        label = f"step {i + 1}/{rounds}" + (" (warm-up)" if i < warmup else "")
        load.append(os.getloadavg()[0])
        began = time.perf_counter()
        for name in rotated(names, i):  # every variant first in turn
            barrier()
            if name not in steps:  # a variant another rank runs alone
                continue
            start, used = time.perf_counter(), time.process_time()
            loss = steps[name]()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - used)
            if name not in alone:
                barrier()  # every rank times the reference work at once
            after = probe()
            around[name].append((before + after) / 2)
            before = after
            if losses is not None:
                losses.setdefault(name, loss)
            say(f"  {label} {name}: {times[name][-1]:.2f} s")
        i += 1
        if extend is not None and i == warmup:
            rounds = warmup + extend(time.perf_counter() - began)
    return times, cpu, around, load


def stage_parts(events: Sequence[Event]) -> dict[int, tuple[float, float, float]]:
    """Each stage's (forward, backward, W) busy seconds in one step's events: the backward
    counts every backward span (a whole B, I and W, recomputes included), W those of a split
    backward's weight gradients alone; receive waits nested in them are not busy."""
    return {s: (busy_time(events, s, ("forward",)),
                busy_time(events, s, ("backward", "recompute")),
                busy_time(events, s, ("backward",), str(ActionKind.WEIGHT_GRAD)))
            for s in sorted({e.stage for e in events if e.stage >= 0})}


def median_parts(steps: list[dict[int, tuple[float, float, float]]]
                 ) -> dict[int, tuple[float, float, float]]:
    """Each stage's median (forward, backward, W) over the steps."""
    stages = sorted({s for step in steps for s in step})
    return {s: (statistics.median(step[s][0] for step in steps if s in step),
                statistics.median(step[s][1] for step in steps if s in step),
                statistics.median(step[s][2] for step in steps if s in step)) for s in stages}


def _at_compute(program: Program, parts: dict[int, tuple[float, float, float]]
                ) -> PartitionPlan:
    """The program's plan with each stage's forward, backward and (under a split backward) W
    as its rank measured them (parts[s], seconds per step, see stage_parts), the recompute
    scaled with the backward; messages and the per-action costs keep their predicted times."""
    plan, chunks = program.plan, program.built.spec.chunks
    stages = []
    for st in plan.stages:
        if st.index not in parts:
            stages.append(st)
            continue
        forward, backward, weight = (t / chunks for t in parts[st.index])
        predicted_backward = st.compute_time - st.forward_time
        scale = backward / predicted_backward if predicted_backward > 0 else 1.0
        stages.append(replace(st, forward_time=forward, compute_time=forward + backward,
                              recompute_time=st.recompute_time * scale,
                              weight_time=weight if weight > 0 else st.weight_time * scale))
    return replace(plan, stages=tuple(stages))


def _rounds(program: Program) -> list[dict[str, Any]]:
    """The program's balance rounds as JSON, the one its cut was kept from marked."""
    rounds = program.built.rounds
    kept = best_round(rounds) if rounds else None
    return [{**r.to_json(), "kept": r is kept} for r in rounds]


def _compile(model: Any, inputs: tuple[Any, ...], world: int, args: dict[str, Any],
             remat: str, schedule: str) -> Program:
    """fxpipe's program for `schedule` on `world` ranks: one stage per rank, or two under the
    looped schedules (interleaved-1f1b, zb-v)."""
    return fxpipe.compile(copy.deepcopy(model), inputs,
                          stages=world * default_stages_per_rank(schedule),
                          chunks=args["chunks"], remat=remat, balance=args["balance"],
                          schedule=schedule)


def micro_batches(inputs: tuple[Any, ...], target: Any,
                  chunks: int) -> list[tuple[tuple[Any, ...], Any]]:
    """The batch's (inputs, target) micro-batches along dimension 0, split once."""
    return list(zip(zip(*[x.tensor_split(chunks, dim=0) for x in inputs]),
                    target.tensor_split(chunks, dim=0)))


def accumulate(model: Any, micro: list[tuple[tuple[Any, ...], Any]]) -> float:
    """The plain model's forward and backward of each micro-batch in one process, their
    gradients accumulated as the whole batch's mean loss; returns that loss."""
    total = 0.0
    for args, tgt in micro:
        loss = default_loss(model(*args), tgt) / len(micro)
        torch.autograd.backward(loss)
        total += float(loss.detach())
    return total


def _single(model: Any, inputs: tuple[Any, ...], target: Any, chunks: int) -> Step:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    micro = micro_batches(inputs, target, chunks)

    def step() -> float:
        total = accumulate(model, micro)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step


def _build_fxpipe(rank: int, world: int, model: Any, inputs: tuple[Any, ...], target: Any,
                  args: dict[str, Any], skipped: list[str]) -> dict[str, _FxpipeVariant]:
    out: dict[str, _FxpipeVariant] = {}
    for schedule, kind in SCHEDULES.items():
        name = "fxpipe" if kind is DEFAULT_SCHEDULE else f"fxpipe_{schedule}"
        _say(rank, f"compiling {name} (balance={args['balance']}, remat={args['remat']}) ...")
        start = time.perf_counter()
        try:
            program = _compile(model, inputs, world, args, args["remat"], schedule)
        except FxPipeError as e:
            skipped.append(f"{name}: {str(e).splitlines()[0]}")
            continue
        out[name] = _FxpipeVariant(program, inputs, target)
        _say(rank, f"  {name} ready in {time.perf_counter() - start:.1f} s; stages start at "
                   + ", ".join(s.first_module for s in program.plan.stages))
    for remat in REMAT_COMPARED:
        if remat != args["remat"]:
            _say(rank, f"compiling fxpipe_remat_{remat} ...")
            out[f"fxpipe_remat_{remat}"] = _FxpipeVariant(
                _compile(model, inputs, world, args, remat, DEFAULT_SCHEDULE.name),
                inputs, target)
    return out


def _try_torch(variant: TorchVariant, model: Any, inputs: tuple[Any, ...], target: Any,
               chunks: int, rank: int, world: int, skipped: list[str],
               losses: dict[str, float], tie_groups: dict[tuple[int, ...], Any]) -> Step | None:
    """The variant's step, built on the default group as torch's users run it, once a first
    step worked on every rank (its loss is the variant's first), else None and a note.

    The first step runs on groups of its own, closed as soon as it fails on a rank, so that the
    other ranks' operations fail at once rather than wait for them; they are thrown away either
    way. A group kept per variant would cost every variant's compute time: each gloo group keeps
    a thread that wakes every 10 ms, and thirty groups slowed the pipelines' compute by 6-11%."""
    trial = [dist.new_group(timeout=timedelta(seconds=TRY_TIMEOUT_S))]
    trial_ties: dict[tuple[int, ...], Any] = {}

    def close_trial() -> None:
        """Destroys the trial groups and drops this rank's last references to them, which closes
        their connections: an operation another rank still waits on there fails at once
        (connection closed by peer) instead of waiting out TRY_TIMEOUT_S. A failed step also
        leaves operations pending that would keep the machine busy while the others are timed."""
        for group in (*trial, *trial_ties.values()):
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)
        trial.clear()
        trial_ties.clear()
        gc.collect()  # the failed step's stages and schedule hold the groups too

    error = ""
    try:
        with _torch_log_quiet():
            build_torch_step(variant, copy.deepcopy(model), inputs, target, chunks, rank, world,
                             trial[0], trial_ties)()
    except Exception as e:  # noqa: BLE001 - a variant torch cannot run is reported
        error = error_line(e)
    if error:
        close_trial()
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error[:300])
    close_trial()
    if any(errors):
        skipped.append(failure_note(variant.name, errors))  # the same line on every rank
        return None
    step = build_torch_step(variant, copy.deepcopy(model), inputs, target, chunks, rank, world,
                            None, tie_groups)
    losses[variant.name] = step()
    return step


@contextlib.contextmanager
def _torch_log_quiet() -> Iterator[None]:
    """torch.distributed.pipelining logs a failed action with the whole schedule (a line per
    action: about a hundred for a variant), on top of raising; the bench says why a variant did
    not run in one line (failure_note), so a trial step's own log is left out."""
    logger = logging.getLogger("torch.distributed.pipelining")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _process_groups() -> int:
    """The process groups this rank holds (torch has no public count): each gloo group keeps a
    thread that wakes every 10 ms, which the timed variants would pay for."""
    return len(dist.distributed_c10d._world.pg_map)


def run_worker(rank: int, world: int, port: int, args: dict[str, Any]) -> dict[str, Any]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=900))
    torch.manual_seed(0)
    model, inputs, _, target = load_factory(args["factory"], args["settings"])
    chunks = args["chunks"]
    skipped: list[str] = []
    fx = _build_fxpipe(rank, world, model, inputs, target, args, skipped)
    main = fx["fxpipe"].program
    points = {world: [s.first_module for s in main.plan.stages[1:]],
              **{int(k): v for k, v in args["fxpipe_points"].items()}}
    variants, notes = plan_variants(model, world, points, args["torch_schedules"])
    skipped += notes
    steps: dict[str, Step] = {name: v.step for name, v in fx.items()}
    losses: dict[str, float] = {}
    tie_groups: dict[tuple[int, ...], Any] = {}
    for variant in variants:
        _say(rank, f"building {variant.name} (stages start at "
                   f"{', '.join(variant.points) or variant.units}) and trying one step ...")
        step = _try_torch(variant, model, inputs, target, chunks, rank, world, skipped, losses,
                          tie_groups)
        if step is not None:
            steps[variant.name] = step
    if rank == 0:  # the plain model: accumulating the same micro-batches, and at full batch
        steps = {"single_process": _single(copy.deepcopy(model), inputs, target, chunks),
                 "single_process_full_batch": _single(copy.deepcopy(model), inputs, target, 1),
                 **steps}
    singles = ("single_process", "single_process_full_batch")
    names = [*singles, *(n for n in steps if n not in singles)]  # the same list on every rank
    groups = _process_groups()
    probe = CoreProbe()

    def extend(round_seconds: float) -> int:
        """Rank 0's count of measured steps, from its last warm-up round, on every rank."""
        count = torch.tensor([measured_steps(round_seconds, args["steps"], args["seconds"])])
        dist.broadcast(count, src=0)
        if rank == 0 and int(count) > args["steps"]:
            _say(rank, f"a round of every variant took {round_seconds:.2f} s: measuring "
                       f"{int(count)} steps (--seconds {args['seconds']:g})")
        return int(count)

    times, cpu, probes, load = time_variants(
        names, steps, args["warmup"] + args["steps"], warmup=args["warmup"],
        probe=probe.seconds, barrier=dist.barrier, alone=singles, losses=losses,
        say=lambda text: _say(rank, text), extend=extend)
    for name, ours in fx.items():
        ours.probes.extend(probes[name])
    warm = args["warmup"]
    # what each fxpipe variant's rank keeps for backward at the peak of one more step, against
    # the memory model (Program.measure_kept; that step's gradients are dropped)
    kept = {}
    for name, ours in fx.items():
        dist.barrier()
        kept[name] = ours.program.measure_kept(*ours.inputs, target=ours.target)
        ours.optimizer.zero_grad(set_to_none=True)
    parts = {name: v.parts(warm) for name, v in fx.items()}
    every_parts: list[Any] = [None] * world
    dist.all_gather_object(every_parts, parts)
    result = {
        "times": {k: v[warm:] for k, v in times.items()}, "losses": losses, "kept": kept,
        "cpu_times": {k: v[warm:] for k, v in cpu.items()}, "load": load[warm:],
        "skipped": skipped, "process_groups": groups,
        "pipeline": {k: v.pipeline[warm:] for k, v in fx.items()},
        "stage_times": {k: v.stage_times(warm) for k, v in fx.items()},
        "probes": {k: v.probes[warm:] for k, v in fx.items()},
        "events": [e.__dict__ for e in main.measured.get("last_step_events", [])],
        # each schedule played with its program's stage costs
        "predicted": {k: predicted_step(v.program.plan, v.program.built.spec.schedule,
                                        world)[0] for k, v in fx.items()},
        # the same with each stage's forward, backward and W as its rank measured them in this
        # run: what the schedule's model predicts once the machine's speed of the moment is known
        "predicted_at_measured_compute": {
            k: predicted_step(_at_compute(v.program, {s: t for p in every_parts
                                                      for s, t in p[k].items()}),
                              v.program.built.spec.schedule, world)[0]
            for k, v in fx.items()},
        "predicted_events": [e.__dict__ for e in predicted_events(main.plan)],
        "stages": [{"first": s.first_module, "last": s.last_module, "ops": len(s.nodes),
                    "predicted_s": s.compute_time * main.built.spec.chunks}
                   for s in main.plan.stages],
        "balance_rounds": [r.to_json() for r in main.built.rounds],
        "balance_rounds_by_variant": {k: _rounds(v.program) for k, v in fx.items()},
        "balance": main.measured.get("balance", args["balance"]),
        "profile": main.report().profile,
        "variants": {v.name: {"frontend": v.frontend, "cut": v.cut, "schedule": v.schedule,
                              "points": list(v.points), "units": list(v.units)}
                     for v in variants},
        "split_points": points[world],
    }
    dist.destroy_process_group()
    return result

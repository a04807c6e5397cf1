"""`fxpipe bench`: fxpipe against one process and torch.distributed.pipelining at its best.

One invocation runs, on the same model, data, seed and micro-batches, one gloo process per stage
(one thread each), every variant of fxpipe.tools.bench_worker step by step, in an order rotated
from step to step, so that drifts of the machine hit them alike (at least `steps` steps, more
while a round of every variant is short: see bench_stats.measured_steps): the plain model in one
process (accumulating the micro-batches, and at full batch), fxpipe with each of its schedules
(fxpipe.runtime.planning.schedule.SCHEDULES) and remat modes, and torch.distributed.pipelining
with both its frontends, at its natural cut and at fxpipe's, with each of its schedules
(fxpipe.tools.bench_torch). fxpipe balances by measurement (balance="dynamic") unless told
otherwise; its cut for the torch variants with two stages per rank is fxpipe's own
balanced cut into that many stages, made in this process first.

It reports median step times and CPU seconds, speedups against each schedule's bound (over one
process running the same micro-batches, and over the full batch at what micro-batching costs
that process), fxpipe's best schedule against the fastest torch variant as a paired ratio with
its 95% interval (fxpipe.tools.bench_stats), the measured compute and waits of each stage and
their imbalance, predicted against measured step time, and the activation bytes each stage
keeps in each remat mode; writes bench.json, bench.md and a Chrome trace
(fxpipe.tools.bench_report).
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch.multiprocessing as mp
from tabulate import tabulate

import fxpipe
from fxpipe.errors import ConfigError, FxPipeError
from fxpipe.models import gpt, load_factory
from fxpipe.runtime.program.torchrun import free_port
from fxpipe.tools.bench_report import summarise, write
from fxpipe.tools.bench_torch import SCHEDULES as TORCH_SCHEDULES
from fxpipe.tools.bench_worker import REMAT_COMPARED, worker

__all__ = ["BenchOptions", "run_bench", "run_bench_compile", "BENCH_GPT"]


@dataclass(frozen=True)
class BenchOptions:
    """What `fxpipe bench` measures and where it writes the results."""

    model: str = "gpt"  # a bundled model's name or MODULE:FACTORY
    settings: tuple[str, ...] = field(default_factory=tuple)  # KEY=VALUE for the factory
    stages: int = 2
    chunks: int = 8
    remat: str = "never"
    steps: int = 15  # at least; more while a round of every variant takes under seconds/steps
    seconds: float = 180.0  # measuring time the extra steps of short rounds fill
    warmup: int = 2
    out: str = "."
    plot: bool = False
    port: int | None = None
    balance: str = "dynamic"  # fxpipe's balance mode
    torch_schedules: tuple[str, ...] = tuple(TORCH_SCHEDULES)


BENCH_GPT = {"d_model": 256, "n_layer": 8, "n_head": 4, "seq_len": 128, "vocab_size": 4096,
             "batch": 16, "dropout": 0.0}


def _factory(model: str, settings: list[str]) -> tuple[str, list[str]]:
    if ":" in model:
        return model, settings
    if model == "gpt" and not settings:
        settings = [f"{k}={json.dumps(v)}" for k, v in BENCH_GPT.items()]
    return f"fxpipe.models.{model}:build", settings


def _memory(args: dict[str, Any]) -> dict[str, list[dict[str, float]]]:
    """Kept activation bytes per stage in each remat mode (one process, real run)."""
    out = {}
    for remat in REMAT_COMPARED:
        model, inputs, _, _ = load_factory(args["factory"], args["settings"])
        program = fxpipe.compile(model, inputs, stages=args["stages"], chunks=args["chunks"],
                                 remat=remat, profile="a100")
        out[remat] = program.measure_activations(*inputs)
    return out


def _local_cuts(args: dict[str, Any], stages: int) -> list[str]:
    """fxpipe's own cut into `stages` stages (balanced in this process), for the torch
    variants that run two stages per rank."""
    model, inputs, _, _ = load_factory(args["factory"], args["settings"])
    program = fxpipe.compile(model, inputs, stages=stages, chunks=args["chunks"],
                             remat=args["remat"], balance=args["balance"])
    return [s.first_module for s in program.plan.stages[1:]]


def _run_ranks(ns: BenchOptions, args: dict[str, Any]) -> dict[int, dict[str, Any]] | None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = ns.port or free_port()
    procs = [ctx.Process(target=worker, args=(r, ns.stages, port, args, queue))
             for r in range(ns.stages)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        for _ in procs:
            rank, result = queue.get(timeout=3600)
            if "error" in result:
                print(f"rank {rank} failed:\n{result['error']}")
                return None
            results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


def _measured(ns: BenchOptions) -> str:
    if ns.seconds <= 0 or ns.warmup == 0:
        return f"{ns.steps} measured steps"
    return (f"at least {ns.steps} measured steps (more while a round of every variant takes "
            f"under {ns.seconds / ns.steps:.1f} s, up to {ns.seconds:g} s of measuring)")


def run_bench(ns: BenchOptions) -> int:
    """Runs the benchmark (see the module docstring); 0 when every rank finished."""
    if ns.plot and importlib.util.find_spec("matplotlib") is None:  # before minutes of work
        raise ConfigError("--plot draws the timeline with matplotlib, which is not installed",
                          hint="pip install matplotlib (or fxpipe[plot]), or leave out --plot")
    factory, settings = _factory(ns.model, list(ns.settings))
    args: dict[str, Any] = {
        "factory": factory, "settings": settings, "stages": ns.stages, "chunks": ns.chunks,
        "remat": ns.remat, "steps": ns.steps, "seconds": ns.seconds,
        "warmup": ns.warmup, "balance": ns.balance,
        "torch_schedules": [s for s in ns.torch_schedules if s in TORCH_SCHEDULES]}
    load = os.getloadavg()[0]
    print(f"fxpipe bench: {factory} {' '.join(settings)}\n  {ns.stages} stages x {ns.chunks} "
          f"micro-batches, remat={ns.remat}, balance={ns.balance}, {ns.warmup} warm-up + "
          f"{_measured(ns)}, gloo, 1 thread per process; load average {load:.2f}",
          flush=True)
    print(f"measuring kept activations (remat {' / '.join(REMAT_COMPARED)}) ...", flush=True)
    memory = _memory(args)
    args["fxpipe_points"] = {}
    for per_rank in sorted({TORCH_SCHEDULES[s][1] for s in args["torch_schedules"]} - {1}):
        stages = per_rank * ns.stages
        print(f"balancing fxpipe's cut into {stages} stages for the torch variants with "
              f"{per_rank} stages per rank ...", flush=True)
        start = time.perf_counter()
        try:
            args["fxpipe_points"][str(stages)] = _local_cuts(args, stages)
        except FxPipeError as e:  # e.g. more stages than the model can be cut into
            print(f"  no cut: {str(e).splitlines()[0]}", flush=True)
            continue
        print(f"  stages begin at {args['fxpipe_points'][str(stages)]} "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    print(f"starting {ns.stages} processes: each compiles and times every variant "
          f"({ns.warmup} warm-up + {_measured(ns)}) ...", flush=True)
    results = _run_ranks(ns, args)
    if results is None:
        return 1
    print(f"writing the results to {ns.out}/ ...", flush=True)
    _, inputs, _, _ = load_factory(factory, settings)
    options = {"model": ns.model, "stages": ns.stages, "chunks": ns.chunks, "remat": ns.remat,
               "batch": inputs[0].shape[0], "balance": ns.balance,
               "load_average": [load, os.getloadavg()[0]]}
    write(summarise(results, memory, options), ns.out, ns.plot)
    return 0


def run_bench_compile(n_layer: int = 48, stages: int = 4, profile: str = "a100") -> int:
    """Compile time of the reference GPT with `n_layer` blocks, pass by pass."""
    model, inputs = gpt.build(n_layer=n_layer, dropout=0.0)
    print(f"compiling gpt.build(n_layer={n_layer}) into {stages} stages ...", flush=True)
    start = time.perf_counter()
    program = fxpipe.compile(model, inputs, stages=stages, chunks=4, profile=profile)
    total = time.perf_counter() - start
    timings = program.built.timings
    rows = [[name, f"{seconds:.2f}", f"{seconds / total:.0%}"] for name, seconds in timings.items()]
    rows.append(["(other: program setup, loading stage classes)",
                 f"{total - sum(timings.values()):.2f}", ""])
    rows.append(["total", f"{total:.2f}", "100%"])
    nodes = len(program.graph_module.graph.nodes)
    print(tabulate(rows, headers=["pass", "seconds", "share"], tablefmt="github"))
    print(f"{nodes} graph nodes; target: under 10 s")
    return 0

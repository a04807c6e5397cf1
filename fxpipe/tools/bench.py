"""`fxpipe bench`: step time of fxpipe against one process and torch.distributed.pipelining.

One invocation runs, on the same model, data, seed and micro-batches, one gloo process per stage
(one thread each), alternating the variants step by step so that drifts of the machine hit them
alike:

    (a) the plain model in one process over the same micro-batches (gradient accumulation)
    (b) fxpipe's distributed GPipe program, remat as asked and in the other modes for their cost
    (c) torch.distributed.pipelining with ScheduleGPipe, cut at the same stage boundaries

It reports median step times and samples/s after warm-up, speedups and ratios, fxpipe's
predicted against measured step time, per-stage busy time and bubble, and the activation bytes
each stage keeps in each remat mode; writes bench.json and bench.md (and a Chrome trace).
"""
from __future__ import annotations

import copy
import json
import os
import socket
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.queues import Queue
from typing import Any, TypeAlias, TypedDict, final

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate
from torch import nn
from torch.distributed import ProcessGroup

import fxpipe
from fxpipe.losses import default_loss
from fxpipe.models import gpt, load_factory
from fxpipe.program import Program
from fxpipe.report import human_bytes
from fxpipe.runtime.timeline import (
    Event,
    EventJSON,
    busy_time,
    predicted_events,
    write_chrome_trace,
)

__all__ = ["BenchOptions", "BenchJSON", "StageDetail", "run_bench", "run_bench_compile",
           "BENCH_GPT"]

Step: TypeAlias = Callable[[], float]
"""One training step of a variant on the benchmark's batch; returns the loss."""


@dataclass(frozen=True)
class BenchOptions:
    """What `fxpipe bench` measures and where it writes the results."""

    model: str = "gpt"  # a bundled model's name or MODULE:FACTORY
    settings: tuple[str, ...] = field(default_factory=tuple)  # KEY=VALUE for the factory
    stages: int = 2
    chunks: int = 8
    remat: str = "never"
    steps: int = 5
    warmup: int = 2
    out: str = "."
    plot: bool = False
    port: int | None = None

# Remat modes measured side by side: off, the default (every micro-batch but the last, whose
# backward follows at once), and every micro-batch.
REMAT_COMPARED = ("never", "except_last", "always")

BENCH_GPT = {"d_model": 256, "n_layer": 8, "n_head": 4, "seq_len": 128, "vocab_size": 4096,
             "batch": 16, "dropout": 0.0}


class _WorkerArgs(TypedDict):
    """What every benchmark process is given (pickled to it)."""

    factory: str  # MODULE:FACTORY
    settings: list[str]  # KEY=VALUE for the factory
    stages: int
    chunks: int
    remat: str
    steps: int
    warmup: int


class _StagePlan(TypedDict):
    first: str
    last: str
    ops: int
    predicted_s: float  # seconds per micro-batch


@final  # so that "error" in a reply tells the two kinds apart
class _WorkerResult(TypedDict):
    """What a process measured (the per-variant step times after warm-up) and predicted."""

    times: dict[str, list[float]]
    losses: dict[str, float]  # of the first step, per variant
    busy: float
    events: list[EventJSON]
    predicted: float
    predicted_events: list[EventJSON]
    stages: list[_StagePlan]
    split_points: list[str]


@final
class _WorkerError(TypedDict):
    error: str  # the traceback


class StageDetail(_StagePlan):
    """One stage of bench.json: its plan, measured busy time, and kept activation bytes per
    remat mode of REMAT_COMPARED."""

    stage: int
    busy_s: float
    bubble: float
    kept_bytes_remat_never: float
    kept_bytes_remat_except_last: float
    kept_bytes_remat_always: float
    kept_reduction: float | None  # kept bytes with remat off over the default mode
    kept_reductions: dict[str, float | None]  # ... over every mode


class BenchJSON(TypedDict):
    """bench.json: seconds, samples/s and ratios per variant, stage details, kept bytes."""

    model: str
    stages: int
    chunks: int
    remat: str
    batch: int
    step_time_s: dict[str, float]  # median
    step_time_min_max_s: dict[str, list[float]]
    samples_per_s: dict[str, float]
    speedup_vs_single_process: float
    step_time_ratio_vs_torch_pipelining: float | None
    predicted_step_time_s: float
    predicted_over_measured: float
    remat_step_time_ratio: float
    remat_step_time_ratios: dict[str, float]
    stages_detail: list[StageDetail]
    kept_activations: dict[str, list[dict[str, float]]]  # program.measure_activations per mode
    losses_first_step: dict[str, float]
    split_points: list[str]
    ideal_speedup: float
    predicted_events: list[EventJSON]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]  # (host, port) of an AF_INET socket
        return port


def _factory(model: str, settings: list[str]) -> tuple[str, list[str]]:
    if ":" in model:
        return model, settings
    if model == "gpt" and not settings:
        settings = [f"{k}={json.dumps(v)}" for k, v in BENCH_GPT.items()]
    return f"fxpipe.models.{model}:build", settings


def _mean_loss(output: Any, target: torch.Tensor | None) -> torch.Tensor:
    return default_loss(output, target)


def _split_points(program: Program) -> list[str]:
    """Module names where fxpipe's stages 1.. begin, for torch pipelining's split_spec."""
    points = []
    for stage in program.plan.stages[1:]:
        points.append(stage.first_module)
    return points


def _pipelining(model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
                chunks: int, points: list[str], rank: int, world: int) -> Step | None:
    """A step function for torch.distributed.pipelining cut at `points` (None if unavailable)."""
    try:
        from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline
    except ImportError:
        return None
    mb = tuple(x.tensor_split(chunks, dim=0)[0] for x in inputs)
    pipe = pipeline(model, mb, split_spec={p: SplitPoint.BEGINNING for p in points})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, chunks, loss_fn=_mean_loss)
    module = pipe.get_stage_module(rank)
    # Tied parameters are copies per stage in torch pipelining: sum their gradients by hand.
    ties: list[tuple[nn.Parameter, ProcessGroup]] = []
    for mapping in pipe.replicated_params:
        ranks = sorted(int(name.rsplit("_", 1)[1]) for name in mapping)
        group = dist.new_group(ranks)
        name = mapping.get(f"submod_pp_{rank}")
        if name is not None:
            ties.append((module.get_parameter(name), group))
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step() -> float:
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(*inputs)
        elif rank == world - 1:
            schedule.step(target=target, losses=losses)
        else:
            schedule.step()
        for param, group in ties:
            dist.all_reduce(param.grad, group=group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = torch.tensor([float(sum(loss.detach() for loss in losses) / len(losses))
                              if losses else 0.0])
        dist.broadcast(value, src=world - 1)
        return float(value)

    return step


def _single(model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
            chunks: int) -> Step:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    micro = list(zip(*[x.tensor_split(chunks, dim=0) for x in inputs]))
    targets = target.tensor_split(chunks, dim=0)

    def step() -> float:
        total = 0.0
        for args, tgt in zip(micro, targets):
            loss = _mean_loss(model(*args), tgt) / chunks
            torch.autograd.backward(loss)
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step


def _fxpipe(model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor,
            args: _WorkerArgs, remat: str) -> tuple[Program, Step]:
    program = fxpipe.compile(model, inputs, stages=args["stages"], chunks=args["chunks"],
                             remat=remat, balance="time")
    optimizer = torch.optim.SGD(program.parameters(), lr=1e-3)

    def step() -> float:
        loss = program.step(*inputs, target=target)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return program, step


def _timed(step: Step) -> tuple[float, float]:
    dist.barrier()
    start = time.perf_counter()
    loss = step()
    return time.perf_counter() - start, loss


def _worker(rank: int, world: int, port: int, args: _WorkerArgs,
            queue: Queue[tuple[int, _WorkerResult | _WorkerError]]) -> None:
    try:
        queue.put((rank, _run_worker(rank, world, port, args)))
    except Exception:  # noqa: BLE001 - report to the parent, which prints it once
        queue.put((rank, {"error": traceback.format_exc()}))


def _run_worker(rank: int, world: int, port: int, args: _WorkerArgs) -> _WorkerResult:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    model, inputs, _, target = load_factory(args["factory"], args["settings"])
    chunks = args["chunks"]
    program, fx_step = _fxpipe(copy.deepcopy(model), inputs, target, args, args["remat"])
    variants: dict[str, Step] = {"fxpipe": fx_step}
    for other in REMAT_COMPARED:
        if other != args["remat"]:
            _, variants[f"fxpipe_remat_{other}"] = _fxpipe(copy.deepcopy(model), inputs, target,
                                                           args, other)
    points = _split_points(program)
    torch_step = _pipelining(copy.deepcopy(model), inputs, target, chunks, points, rank, world)
    if torch_step is not None:
        variants["torch_pipelining"] = torch_step
    single = _single(copy.deepcopy(model), inputs, target, chunks) if rank == 0 else None
    times: dict[str, list[float]] = {name: [] for name in ["single_process", *variants]}
    losses: dict[str, float] = {}
    for i in range(args["warmup"] + args["steps"]):
        dist.barrier()
        if single is not None:  # rank 0
            t, loss = time.perf_counter(), single()
            times["single_process"].append(time.perf_counter() - t)
            losses.setdefault("single_process", loss)
        dist.barrier()
        for name, step in variants.items():
            t, loss = _timed(step)
            times[name].append(t)
            losses.setdefault(name, loss)
        if rank == 0:
            print(f"  step {i + 1}/{args['warmup'] + args['steps']}"
                  + ("" if i >= args["warmup"] else " (warm-up)"), flush=True)
    events: list[Event] = program.measured.get("last_step_events", [])
    busy = busy_time(events)
    result: _WorkerResult = {
        "times": {k: v[args["warmup"]:] for k, v in times.items()}, "losses": losses,
        "busy": busy, "events": [e.to_json() for e in events],
        "predicted": program.plan.predicted_step_time,
        "predicted_events": [e.to_json() for e in predicted_events(program.plan)],
        "stages": [{"first": s.first_module, "last": s.last_module, "ops": len(s.nodes),
                    "predicted_s": s.time} for s in program.plan.stages],
        "split_points": points}
    dist.destroy_process_group()
    return result


def _memory(args: _WorkerArgs) -> dict[str, list[dict[str, float]]]:
    """Kept activation bytes per stage in each remat mode (one process, real run)."""
    out = {}
    for remat in REMAT_COMPARED:
        torch.manual_seed(0)
        model, inputs, _, _ = load_factory(args["factory"], args["settings"])
        program = fxpipe.compile(model, inputs, stages=args["stages"], chunks=args["chunks"],
                                 remat=remat, profile="a100")
        out[remat] = program.measure_activations(*inputs)
    return out


def run_bench(ns: BenchOptions) -> int:
    """Runs the benchmark (see the module docstring); 0 when every variant ran."""
    factory, settings = _factory(ns.model, list(ns.settings))
    args: _WorkerArgs = {"factory": factory, "settings": settings, "stages": ns.stages,
                         "chunks": ns.chunks, "remat": ns.remat, "steps": ns.steps,
                         "warmup": ns.warmup}
    print(f"fxpipe bench: {factory} {' '.join(settings)}\n  {ns.stages} stages x {ns.chunks} "
          f"micro-batches, remat={ns.remat}, {ns.warmup} warm-up + {ns.steps} measured steps, "
          f"gloo, 1 thread per process", flush=True)
    print(f"measuring kept activations (remat {' / '.join(REMAT_COMPARED)}) ...", flush=True)
    memory = _memory(args)
    ctx = mp.get_context("spawn")
    queue: Queue[tuple[int, _WorkerResult | _WorkerError]] = ctx.Queue()
    port = ns.port or _free_port()
    procs = [ctx.Process(target=_worker, args=(r, ns.stages, port, args, queue))
             for r in range(ns.stages)]
    for p in procs:
        p.start()
    results: dict[int, _WorkerResult] = {}
    try:
        for _ in procs:
            rank, result = queue.get(timeout=1800)
            if "error" in result:
                print(f"rank {rank} failed:\n{result['error']}")
                return 1
            results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    summary, events = _summarise(results, memory, ns)
    _write(summary, events, ns)
    return 0


def _summarise(results: dict[int, _WorkerResult], memory: dict[str, list[dict[str, float]]],
               ns: BenchOptions) -> tuple[BenchJSON, dict[int, list[EventJSON]]]:
    """bench.json, and the measured events of every rank."""
    ranks = sorted(results)
    names = [n for n in results[0]["times"]]
    step: dict[str, float] = {}
    spread: dict[str, list[float]] = {}
    for name in names:
        per_step = [max(results[r]["times"][name][i] for r in ranks if results[r]["times"][name])
                    for i in range(len(results[0]["times"][name]))]
        step[name] = statistics.median(per_step)
        spread[name] = [min(per_step), max(per_step)]
    _, inputs, _, _ = load_factory(*_factory(ns.model, list(ns.settings)))
    batch = inputs[0].shape[0]
    measured = step["fxpipe"]
    by_mode = {m: step["fxpipe" if m == ns.remat else f"fxpipe_remat_{m}"]
               for m in REMAT_COMPARED}
    summary: BenchJSON = {
        "model": ns.model, "stages": ns.stages, "chunks": ns.chunks, "remat": ns.remat,
        "batch": batch, "step_time_s": step, "step_time_min_max_s": spread,
        "samples_per_s": {k: batch / v for k, v in step.items()},
        "speedup_vs_single_process": step["single_process"] / measured,
        "step_time_ratio_vs_torch_pipelining": (measured / step["torch_pipelining"]
                                                if "torch_pipelining" in step else None),
        "predicted_step_time_s": results[0]["predicted"],
        "predicted_over_measured": results[0]["predicted"] / measured,
        # step time with remat on over remat off: the default mode, and each mode
        "remat_step_time_ratio": by_mode["except_last"] / by_mode["never"],
        "remat_step_time_ratios": {m: by_mode[m] / by_mode["never"] for m in REMAT_COMPARED[1:]},
        "stages_detail": [],
        "kept_activations": memory,
        "losses_first_step": results[0]["losses"],
        "split_points": results[0]["split_points"],
        "ideal_speedup": ns.stages * ns.chunks / (ns.chunks + ns.stages - 1),
        "predicted_events": results[0]["predicted_events"],
    }
    for r in ranks:
        busy = results[r]["busy"]
        kept = {m: memory[m][r]["measured_bytes"] for m in REMAT_COMPARED}
        summary["stages_detail"].append({
            "stage": r, **results[0]["stages"][r], "busy_s": busy,
            "bubble": max(0.0, 1 - busy / measured),
            "kept_bytes_remat_never": kept["never"],
            "kept_bytes_remat_except_last": kept["except_last"],
            "kept_bytes_remat_always": kept["always"],
            # kept activations with remat off over remat on (default mode, and every mode)
            "kept_reduction": _ratio(kept["never"], kept["except_last"]),
            "kept_reductions": {m: _ratio(kept["never"], kept[m]) for m in REMAT_COMPARED[1:]}})
    return summary, {r: results[r]["events"] for r in ranks}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _write(summary: BenchJSON, events: dict[int, list[EventJSON]], ns: BenchOptions) -> None:
    os.makedirs(ns.out, exist_ok=True)
    spread = summary["step_time_min_max_s"]
    rows = [[name, f"{t:.3f}", f"{spread[name][0]:.3f}-{spread[name][1]:.3f}",
             f"{summary['samples_per_s'][name]:.1f}",
             f"{summary['step_time_s']['single_process'] / t:.2f}x"]
            for name, t in summary["step_time_s"].items()]
    kept = summary["kept_activations"]  # by mode, as kept_bytes_remat_* in stages_detail
    stage_rows = [[d["stage"], d["first"], d["last"], d["ops"], f"{d['predicted_s'] * 1e3:.1f}",
                   f"{d['busy_s']:.3f}", f"{d['bubble']:.1%}",
                   *[human_bytes(kept[m][d["stage"]]["measured_bytes"]) for m in REMAT_COMPARED],
                   *[f"{r:.1f}x" if r else "-" for r in d["kept_reductions"].values()]]
                  for d in summary["stages_detail"]]
    lines = [f"# fxpipe bench: {summary['model']}, {summary['stages']} stages x "
             f"{summary['chunks']} micro-batches, remat={summary['remat']}", "",
             tabulate(rows, headers=["variant", "median step (s)", "min-max (s)", "samples/s",
                                     "speedup vs 1 process"],
                      tablefmt="github"), "",
             f"- speedup over one process: **{summary['speedup_vs_single_process']:.2f}x** "
             f"(ideal {summary['ideal_speedup']:.2f}x)"]
    if summary["step_time_ratio_vs_torch_pipelining"] is not None:
        lines.append(f"- step time / torch.distributed.pipelining: "
                     f"**{summary['step_time_ratio_vs_torch_pipelining']:.3f}**")
    lines += [f"- predicted step time {summary['predicted_step_time_s']:.3f} s vs measured "
              f"{summary['step_time_s']['fxpipe']:.3f} s "
              f"(predicted/measured {summary['predicted_over_measured']:.3f})",
              "- step time with remat on / off: " + ", ".join(
                  f"{m} {r:.3f}" for m, r in summary["remat_step_time_ratios"].items())
              + " (except_last is the default)",
              f"- stage boundaries (torch pipelining split points): {summary['split_points']}", "",
              tabulate(stage_rows,
                       headers=["stage", "first", "last", "ops", "pred ms/mb", "busy s", "bubble",
                                *[f"kept ({m})" for m in REMAT_COMPARED],
                                *[f"kept never/{m}" for m in REMAT_COMPARED[1:]]],
                       tablefmt="github")]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    with open(os.path.join(ns.out, "bench.md"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(ns.out, "bench.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=True, default=str)
    measured = [Event(**e) for evs in events.values() for e in evs]
    predicted = [Event(**e) for e in summary["predicted_events"]]
    write_chrome_trace(os.path.join(ns.out, "bench_trace.json"),
                       {"fxpipe measured": measured, "fxpipe predicted": predicted})
    print(f"wrote {ns.out}/bench.json, {ns.out}/bench.md, {ns.out}/bench_trace.json")
    if getattr(ns, "plot", False):
        _plot(measured, os.path.join(ns.out, "bench_timeline.png"))


def _plot(events: list[Event], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); skipped")
        return
    colors = {"forward": "tab:blue", "backward": "tab:orange", "recv": "tab:gray",
              "send": "tab:green", "recv_grad": "tab:gray", "send_grad": "tab:green"}
    fig, ax = plt.subplots(figsize=(12, 1 + len({e.stage for e in events})))
    for e in events:
        if e.kind in colors and e.stage >= 0:
            ax.barh(e.stage, e.end - e.start, left=e.start, color=colors[e.kind],
                    edgecolor="black", linewidth=0.3)
            if e.kind in ("forward", "backward"):
                ax.text(e.start + (e.end - e.start) / 2, e.stage,
                        f"{'F' if e.kind == 'forward' else 'B'}{e.microbatch}", ha="center",
                        va="center", fontsize=7)
    ax.set_yticks(sorted({e.stage for e in events}))
    ax.set_yticklabels([f"stage {s}" for s in sorted({e.stage for e in events})])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


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

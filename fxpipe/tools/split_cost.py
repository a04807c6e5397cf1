"""`python -m fxpipe.tools.split_cost`: what the split backward costs against a plain backward.

Two measurements, each interleaving its variants step by step and repeating them, in CPU
seconds (time.process_time, one thread), with autograd engine calls and Python calls counted:

* `stage`: one micro-batch of the bench GPT's last stage (4 blocks, the final norm, the head
  and the loss, received activations that require grad): a plain backward against I + W, with
  the stage's plan read once as the executor keeps it.
* `ranks`: the tiny GPT (fxpipe.models.gpt defaults, batch 16 unless --batch says otherwise; the
  model's own default is 8) on 2 gloo ranks x 8 micro-batches, 1F1B against ZB-H1 (remat
  "never" unless --remat says otherwise); each rank reports its CPU
  time (waits for messages included), its ratio to 1F1B's taken round by round (the median of
  the per-round ratios and its bootstrap 95% interval, fxpipe.tools.bench_stats: the machine's
  drift between rounds cancels), engine calls per step, and the Python calls of a step
  (cProfile's count, builtins included; profiled apart from the timed steps). Rank 0 also times,
  in the same rotation while rank 1 waits, the plain model's step in one process (8 micro-batches
  accumulated): the compute both ranks share, so that the ranks' summed CPU less it is the host
  work the pipeline adds. Of that, what the messages cost at least: each rank's messages per
  1F1B step times the CPU of one message of the boundary's shape in a plain gloo ping-pong.
  Last, each rank's CPU per step of each schedule by thread (Linux): the step's own thread,
  whose work fxpipe's executor does, apart from gloo's (its TCP loop's CPU varies with when
  messages arrive against their receives, which the schedule's order moves) and fxpipe's send
  thread.

`--also FILE` races another implementation of `input_backward` (a module file with the same
function, e.g. an earlier version of fxpipe/runtime/execution/split_backward.py) beside the current
one.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import importlib.util
import inspect
import os
import pstats
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fxpipe
from fxpipe.models import gpt
from fxpipe.runtime.communication import dist_comm, transport
from fxpipe.runtime.execution import split_backward
from fxpipe.testing.engine_calls import EngineCalls
from fxpipe.tools.bench_stats import paired_ratio, rotated
from fxpipe.tools.bench_worker import accumulate, micro_batches

__all__ = ["main"]

Split = Callable[..., Any]


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("split_backward_also", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--also {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _variants(also: str | None) -> dict[str, Split | None]:
    """name -> input_backward (None: a plain backward)."""
    def through_engine(*args: Any, direct: bool = False, **kwargs: Any) -> Any:
        return split_backward.input_backward(*args, **kwargs)  # W: an engine call per group

    found: dict[str, Split | None] = {
        # as the executor runs it where no remat region recomputes
        "split": partial(split_backward.input_backward, direct=True, release=True),
        "engine": through_engine}
    if also:
        other = _load(also).input_backward
        takes = inspect.signature(other).parameters

        def as_it_takes(outputs: Any, grads: Any, leaves: Any, weights: Any = None,
                        plans: Any = None, **options: Any) -> Any:
            """Called as the executor calls the current one, with what an older one takes."""
            given = {"plans": plans, **options}
            return other(outputs, grads, leaves, weights,
                         **{k: v for k, v in given.items() if k in takes})

        found["also"] = partial(as_it_takes, direct=True, release=True)
    return found


def _summary(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    median = statistics.median(values)
    return f"median {median * 1e3:7.2f} ms [IQR {q[0] * 1e3:.2f}-{q[2] * 1e3:.2f}]"


class _LastStage(nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        half = len(model.blocks) // 2
        self.blocks = nn.Sequential(*model.blocks[half:])
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(self.blocks(x)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def measure_stage(repeats: int, also: str | None) -> None:
    """Plain backward against I + W on the bench GPT's last stage, one micro-batch (see the module
    docstring)."""
    from fxpipe.tools.bench import BENCH_GPT
    settings: dict[str, Any] = {**BENCH_GPT, "batch": int(BENCH_GPT["batch"]) // 8}  # of 8
    model, (idx,) = gpt.build(**settings)
    stage = _LastStage(model)
    x = torch.randn(idx.shape[0], idx.shape[1], int(settings["d_model"]))
    target = gpt.target((idx,), vocab_size=int(settings["vocab_size"]))
    weights = [p for p in stage.parameters() if p.requires_grad]
    variants: dict[str, Split | None] = {"plain": None, **_variants(also)}
    plans: dict[str, Any] = {name: {} for name in variants}

    def once(name: str) -> tuple[float, float, int]:
        split = variants[name]
        leaf = x.clone().requires_grad_()
        loss = stage(leaf, target)
        with EngineCalls() as calls:
            start = time.process_time()
            if split is None:
                loss.backward()
                forward_done = time.process_time()
            else:
                _, weight_pass = split([loss], [None], [leaf], weights, plans[name])
                forward_done = time.process_time()
                weight_pass.run(weights)
            end = time.process_time()
        return end - start, forward_done - start, calls.count

    for name in variants:  # warm up, and read each split's plan
        for _ in range(3):
            once(name)
    times: dict[str, list[float]] = {n: [] for n in variants}
    inputs: dict[str, list[float]] = {n: [] for n in variants}
    engine: dict[str, int] = {}
    order = list(variants)
    for r in range(repeats):
        for name in order[r % len(order):] + order[:r % len(order)]:  # rotated each round
            total, first, calls = once(name)
            times[name].append(total)
            inputs[name].append(first)
            engine[name] = calls
    plain = statistics.median(times["plain"])
    print(f"stage: bench GPT last stage, one micro-batch {tuple(x.shape)}, {repeats} rounds, "
          f"CPU time per micro-batch")
    for name in variants:
        ratios = sorted(t / p for t, p in zip(times[name], times["plain"]))
        q = statistics.quantiles(ratios, n=4)
        first = statistics.median(inputs[name])
        print(f"  {name:6s} {_summary(times[name])}  I part {first * 1e3:7.2f} ms"
              f"  engine calls {engine[name]:3d}  / plain: median {statistics.median(ratios):.3f} "
              f"[IQR {q[0]:.3f}-{q[2]:.3f}] (medians {statistics.median(times[name]) / plain:.3f})")


def _rank(rank: int, world: int, port: int, repeats: int, also: str | None, remat: str,
          batch: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        splits = _variants(also)
        programs: dict[str, Any] = {}
        model, (idx,) = gpt.build(batch=batch, dropout=0.0)
        y = gpt.target((idx,))
        for schedule in ("1f1b", "zb-h1"):
            programs[schedule] = fxpipe.compile(model, (idx,), stages=world, chunks=8,
                                                profile="a100", schedule=schedule, remat=remat)
        variants = [("1f1b", "split")] + [("zb-h1", name) for name in splits] + [("plain", "")]
        plain, micro = copy.deepcopy(model), micro_batches((idx,), y, 8)
        cpu: dict[str, list[float]] = {}
        engine: dict[str, list[int]] = {}
        for r in range(repeats + 2):
            for schedule, name in variants[r % len(variants):] + variants[:r % len(variants)]:
                if schedule == "plain":
                    if rank != 0:
                        continue
                    plain.zero_grad()
                    with EngineCalls() as calls:
                        start = time.process_time()
                        accumulate(plain, micro)
                        used = time.process_time() - start
                else:
                    setattr(dist_comm, "input_backward", splits[name])  # noqa: B010 (the variant)
                    program = programs[schedule]
                    program.zero_grad()
                    with EngineCalls() as calls:
                        start = time.process_time()
                        program.step(idx, target=y)
                        used = time.process_time() - start
                if r >= 2:  # after two warm-up rounds
                    label = schedule if schedule in ("1f1b", "plain") else f"{schedule} {name}"
                    cpu.setdefault(label, []).append(used)
                    engine.setdefault(label, []).append(calls.count)
        # counted with the executor's own split backward (the rotation may have left another)
        setattr(dist_comm, "input_backward", splits["split"])  # noqa: B010
        python = {label: _python_calls(programs[schedule], idx, y)
                  for schedule, label in (("1f1b", "1f1b"), ("zb-h1", "zb-h1 split"))}
        messages = _messages(programs["1f1b"], idx, y)
        threads = _cpu_by_thread(programs, idx, y)
        width = dict(model.named_parameters())["ln_f.weight"].numel()  # d_model
        shape = (idx.shape[0] // 8, idx.shape[1], width)  # what crosses the cut
        out.put((rank, cpu, engine, python, messages, _message_cpu(rank, shape), threads))
    finally:
        dist.destroy_process_group()


def _python_calls(program: Any, idx: torch.Tensor, y: torch.Tensor) -> float:
    """Python function calls (builtins included, as cProfile counts them) of one program.step,
    the median of three; both ranks step together."""
    counts = []
    for _ in range(3):
        program.zero_grad()
        profile = cProfile.Profile()
        profile.enable()
        program.step(idx, target=y)
        profile.disable()
        counts.append(pstats.Stats(profile).total_calls)  # type: ignore[attr-defined]
    return float(statistics.median(counts))


def _messages(program: Any, idx: torch.Tensor, y: torch.Tensor) -> int:
    """The point-to-point messages (sends and receives) this rank posts in one program.step
    after a first (which also exchanges each message's dtype and shape); both ranks step
    together."""
    program.zero_grad()
    program.step(idx, target=y)
    posted = 0
    post = transport.TorchTransport._post_one

    def counted(self: Any, op: Any) -> Any:
        nonlocal posted
        posted += 1
        return post(self, op)
    setattr(transport.TorchTransport, "_post_one", counted)  # noqa: B010 (counting)
    try:
        program.zero_grad()
        program.step(idx, target=y)
    finally:
        setattr(transport.TorchTransport, "_post_one", post)  # noqa: B010
    return posted


def _thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's threads by name, the calling thread as "step"
    (Linux's /proc, in clock ticks; {} elsewhere)."""
    found: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return found
    tick, caller = os.sysconf("SC_CLK_TCK"), threading.get_native_id()
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = "step" if int(tid) == caller else f.read().strip()
        except OSError:  # a thread that ended meanwhile
            continue
        user, system = stat[stat.rindex(")") + 2:].split()[11:13]
        found[name] = found.get(name, 0.0) + (int(user) + int(system)) / tick
    return found


def _cpu_by_thread(programs: dict[str, Any], idx: torch.Tensor, y: torch.Tensor,
                   blocks: int = 4, steps: int = 15) -> dict[str, dict[str, float]]:
    """Per program, CPU seconds per step of each thread of this process: the step's own
    thread apart from gloo's (its TCP loop) and fxpipe's send thread ("python"). The programs
    take turns in blocks of `steps` steps in a row (clock ticks of 10 ms need many steps to
    resolve a step; turns spread the machine's drift over them alike); both ranks step
    together."""
    spent: dict[str, dict[str, float]] = {name: {} for name in programs}
    for block in range(blocks):
        for name in rotated(list(programs), block):
            before = _thread_cpu()
            for _ in range(steps):
                programs[name].zero_grad()
                programs[name].step(idx, target=y)
            for thread, seconds in _thread_cpu().items():
                used = seconds - before.get(thread, 0.0)
                if used > 0:
                    spent[name][thread] = spent[name].get(thread, 0.0) + used / (blocks * steps)
    return spent


def _message_cpu(rank: int, shape: tuple[int, ...], count: int = 400) -> float:
    """CPU seconds (gloo's threads included) this rank spends per message of `shape` (float32),
    half sent and half received in a ping-pong with the other rank: the floor of what a message
    of the pipeline costs, whatever posts it."""
    tensor = torch.zeros(shape)
    dist.barrier()
    start = time.process_time()
    for i in range(count):
        if (i + rank) % 2 == 0:
            dist.send(tensor, 1 - rank)
        else:
            dist.recv(tensor, 1 - rank)
    return (time.process_time() - start) / count


def measure_ranks(repeats: int, also: str | None, remat: str, batch: int = 16) -> None:
    """1F1B against ZB-H1 on 2 ranks, per step, on the last stage's rank (module docstring)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, repeats, also, remat, batch, out))
             for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, cpu, engine, python, messages, per_message, threads = out.get(timeout=1800)
        results[rank] = (cpu, engine, python, messages, per_message, threads)
    for p in procs:
        p.join()
    print(f"ranks: tiny GPT, batch {batch}, 2 ranks x 8 micro-batches, remat={remat}, "
          f"{repeats} steps per variant, interleaved; CPU time per step (waits included)")
    for rank in sorted(results):
        cpu, engine, python = results[rank][:3]
        for label in [k for k in cpu if k != "plain"]:
            calls = f"  Python calls per step {python[label]:.0f}" if label in python else ""
            ratio = paired_ratio(cpu[label], cpu["1f1b"])  # step by step: the same round's
            print(f"  rank {rank} {label:14s} {_summary(cpu[label])}  x1F1B "
                  f"{ratio.median:.2f} [95% {ratio.low:.2f}-{ratio.high:.2f}]  engine calls per "
                  f"step {statistics.median(engine[label]):.0f}{calls}")
    plain = results[0][0]["plain"]
    print(f"  one process, the plain model, 8 micro-batches accumulated: {_summary(plain)}")
    for label in results[0][0]:
        if label != "plain":
            summed = sum(statistics.median(results[r][0][label]) for r in results)
            print(f"  {label:14s} both ranks' CPU summed {summed * 1e3:6.2f} ms: "
                  f"{(summed - statistics.median(plain)) * 1e3:+6.2f} ms over one process")
    added = sum(statistics.median(results[r][0]["1f1b"]) for r in results) - \
        statistics.median(plain)
    floor = {r: results[r][3] * results[r][4] for r in results}
    print("  1f1b's messages: " + ", ".join(
        f"rank {r} {results[r][3]} per step x {results[r][4] * 1e6:.0f} us CPU each "
        f"(a ping-pong of one boundary's tensor) = {floor[r] * 1e3:.2f} ms"
        for r in sorted(results))
        + f"; of the {added * 1e3:.2f} ms the pipeline adds, "
        f"{(added - sum(floor.values())) * 1e3:.2f} ms is neither the model nor its messages")
    for r in sorted(results):
        threads = results[r][5]
        for schedule, spent in threads.items():
            if not spent:
                continue
            own = spent.get("step", 0.0) / max(threads["1f1b"].get("step", 0.0), 1e-9)
            print(f"  {schedule}, rank {r}'s CPU per step by thread (4 blocks of 15 steps, "
                  "taking turns; clock ticks): "
                  + ", ".join(f"{name} {seconds * 1e3:.2f} ms"
                              for name, seconds in sorted(spent.items(), key=lambda t: -t[1]))
                  + (f"; its step thread x1F1B {own:.2f}" if schedule != "1f1b" else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxpipe.tools.split_cost",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("what", nargs="*", help="stage, ranks or both (the default)")
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--also", help="another split_backward.py to race beside this one")
    parser.add_argument("--batch", type=int, default=16,
                        help="the ranks' batch (sequences; 8 micro-batches of it)")
    parser.add_argument("--remat", default="never",
                        help="the ranks' remat (under remat W recomputes a region once more)")
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    what = ns.what or ["stage", "ranks"]
    if set(what) - {"stage", "ranks"}:
        parser.error(f"what to measure is 'stage' or 'ranks', got {' '.join(what)}")
    if "stage" in what:
        measure_stage(ns.repeats, ns.also)
    if "ranks" in what:
        measure_ranks(ns.repeats, ns.also, ns.remat, ns.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())

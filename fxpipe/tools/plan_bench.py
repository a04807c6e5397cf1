"""What the planner costs and what it answers, on shapes too large for this machine.

    python -m fxpipe.tools.plan_bench speed     # fxpipe plan for Llama-3 70B on 64 x 80 GB
    python -m fxpipe.tools.plan_bench largest   # the largest that fits, on 1/8/32/128 x 16 GB

Every model is built on the meta device (no weights) and planned with repeated blocks stamped;
each figure is in CPU seconds of this process (time.process_time), beside the machine's load.
`llama` is also a factory for `fxpipe plan fxpipe.tools.plan_bench:llama --devices 64 ...`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tabulate import tabulate

from fxpipe.models import gpt
from fxpipe.planner import Plan, plan
from fxpipe.sizing import largest_that_fits
from fxpipe.units import human_bytes

__all__ = ["llama", "gpt_family", "LargestRow", "largest_table", "main"]

GB = 1e9


def llama(preset: str = "70b", layers: int | None = None, batch: int = 64,
          seq: int = 2048) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """(model, (ids,), kwargs): a Llama-3 shape (fxpipe.tools.giant.PRESETS) in bf16 on the
    meta device, with a global batch of `batch` sequences of `seq` tokens."""
    from fxpipe.tools.giant import llama_on_meta

    model = llama_on_meta(preset, layers=layers)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids,), {"use_cache": False}


def gpt_family(n_layer: int, d_model: int = 4096, n_head: int = 32, seq_len: int = 1024,
               vocab_size: int = 50304, batch: int = 64) -> tuple[Any, tuple[Any, ...]]:
    """The bundled GPT at GPT-3 6.7B's width (fp32), `n_layer` blocks, on the meta device
    when built under torch.device("meta")."""
    return gpt.build(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len,
                     vocab_size=vocab_size, batch=batch, dropout=0.0)


def plan_llama(devices: int = 64, memory: float = 80 * GB, per_node: int = 8,
               preset: str = "70b", batch: int = 64, seq: int = 2048,
               layers: int | None = None, **plan_kwargs: Any) -> tuple[Plan, float]:
    """The plan for a Llama shape on `devices` devices of `memory`, and its CPU seconds (the
    model's construction on meta not included)."""
    model, inputs, kwargs = llama(preset, layers=layers, batch=batch, seq=seq)
    used = time.process_time()
    result = plan(model, inputs, kwargs, devices=devices, memory_per_device=memory,
                  devices_per_node=per_node, inter_node_bandwidth=25e9, profile="h100:bf16",
                  check="shapes", master_weights=True, **plan_kwargs)
    return result, time.process_time() - used


@dataclass(frozen=True)
class LargestRow:
    """The largest model of the family on `devices` devices, its plan and what finding it cost."""

    devices: int
    layers: int
    parameters: int
    plan: Plan
    cpu_s: float

    def cells(self) -> list[Any]:
        c = self.plan.choice
        return [self.devices, self.layers, f"{self.parameters / 1e6:,.0f}M", c.ranks,
                c.stages_per_rank, c.replicas, c.chunks, c.schedule, c.remat,
                f"{c.step_s * 1e3:,.1f}", human_bytes(c.memory_bytes), f"{self.cpu_s:.1f}"]


HEADERS = ["devices", "layers", "parameters", "ranks", "stages/rank", "replicas",
           "micro-batches", "schedule", "remat", "step ms", "memory/device", "CPU s"]


def largest_table(build: Callable[[int], tuple[Any, ...]], devices: Sequence[int],
                  memory: float, say: Callable[[str], None] | None = None,
                  **plan_kwargs: Any) -> list[LargestRow]:
    """One row per device count (ascending): the most layers `build` may have to fit, and its
    plan. Each search after the first starts from a guess, the row before's layers per device
    times the devices, and never goes below the row before's layers."""
    rows: list[LargestRow] = []
    for n in sorted(devices):
        used = time.process_time()
        before = rows[-1] if rows else None  # more devices fit at least as many, about
        guess = before.layers * n // before.devices if before else None  # as many per device
        layers, found = largest_that_fits(build, devices=n, memory_per_device=memory,
                                          low=before.layers if before else 1, guess=guess,
                                          say=say, **plan_kwargs)
        cpu = time.process_time() - used
        with torch.device("meta"):
            model = build(layers)[0]
        parameters = sum(p.numel() for p in model.parameters())
        rows.append(LargestRow(n, layers, parameters, found, cpu))
        if say is not None:
            say(tabulate([rows[-1].cells()], headers=HEADERS, tablefmt="github"))
    return rows


def _load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxpipe.tools.plan_bench",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    speed = sub.add_parser("speed", help="fxpipe plan for a Llama shape, in CPU seconds")
    speed.add_argument("--preset", default="70b")
    speed.add_argument("--devices", type=int, default=64)
    speed.add_argument("--memory-gb", type=float, default=80)
    speed.add_argument("--devices-per-node", type=int, default=8)
    speed.add_argument("--batch", type=int, default=64, help="sequences in the global batch")
    speed.add_argument("--seq", type=int, default=2048)
    speed.add_argument("--layers", type=int, help="decoder layers instead of the preset's")
    speed.add_argument("--no-stamp", dest="stamp", action="store_false",
                       help="trace every decoder layer instead of stamping copies of one")
    speed.add_argument("--profile-to", metavar="FILE", help="write cProfile's statistics")
    speed.add_argument("--rows", type=int, default=8)
    big = sub.add_parser("largest", help="the largest GPT that fits on 1, 8, 32, 128 devices")
    big.add_argument("--devices", type=int, nargs="+", default=[1, 8, 32, 128])
    big.add_argument("--memory-gb", type=float, default=16)
    big.add_argument("--d-model", type=int, default=4096)
    big.add_argument("--batch", type=int, default=64)
    big.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.what == "speed":
        def run() -> tuple[Plan, float]:
            return plan_llama(args.devices, args.memory_gb * GB, args.devices_per_node,
                              args.preset, args.batch, args.seq, args.layers, stamp=args.stamp)

        if args.profile_to:
            import cProfile

            profiler = cProfile.Profile()
            result, cpu = profiler.runcall(run)
            profiler.dump_stats(args.profile_to)
        else:
            result, cpu = run()
        print(result.table(rows=args.rows), end="")
        print(f"\nplanned in {cpu:.1f} s CPU ({_load()})")
        return 0
    rows = largest_table(
        lambda n: gpt_family(n, d_model=args.d_model, n_head=args.d_model // 64,
                             seq_len=args.seq, batch=args.batch),
        args.devices, args.memory_gb * GB, say=say, profile="h100")
    print(f"the largest GPT (d_model {args.d_model}, batch {args.batch} x {args.seq} tokens, "
          f"Adam, fp32) on devices of {args.memory_gb:g} GB, h100 profile:\n")
    print(tabulate([r.cells() for r in rows], headers=HEADERS, tablefmt="github"))
    print(f"\n{_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

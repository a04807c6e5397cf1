"""The `fxpipe` command line: argparse over the public API.

    fxpipe demo                              compile the bundled GPT, write it, train on 2 processes
    fxpipe compile MODULE:FACTORY [options]  print the partition report, write the program
    fxpipe costs MODULE:FACTORY [options]    per-node cost table
    fxpipe report DIR                        the report of a written program
    fxpipe run DIR --nproc K [program args]  train a written program (torchrun)
    fxpipe selfcheck                         prove the GPU paths here (CPU parts without)
    fxpipe bench MODEL [options]             fxpipe vs one process vs torch.distributed.pipelining
    fxpipe bench-partition                   solver quality and speed against baselines
    fxpipe bench-compile                     compile time of a 48-block GPT, pass by pass
    fxpipe profile [--refresh | --preset NAME] the device profile compiles use (cached)
"""
from __future__ import annotations

import argparse
import shlex
import sys
import traceback
from collections.abc import Callable

import torch
from tabulate import tabulate

from fxpipe import ir
from fxpipe.api import compile as compile_program
from fxpipe.errors import ConfigError, FxPipeError
from fxpipe.frontend.capture import capture
from fxpipe.models import MODELS, load_factory
from fxpipe.passes.cost import annotate_costs
from fxpipe.profile import cache_dir, cached_profile, get_profile, profile_key
from fxpipe.profile.cache import clear_cache, profile_path
from fxpipe.program import Program
from fxpipe.report import cost_table
from fxpipe.runtime.folder import program_report
from fxpipe.runtime.torchrun import plan_run, run_program
from fxpipe.tools.bench import BenchOptions, run_bench, run_bench_compile
from fxpipe.tools.bench_partition import run_bench_partition
from fxpipe.tools.bench_torch import SCHEDULES as TORCH_SCHEDULES
from fxpipe.tools.demo import run_demo
from fxpipe.tools.selfcheck import run_selfcheck

__all__ = ["main"]


def _chunks(value: str) -> int | str:
    return value if value == "auto" else int(value)


def _balance(value: str) -> list[int] | str:
    return [int(x) for x in value.split(",")] if value[0].isdigit() else value


def _add_compile_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("factory", help="MODULE:FACTORY returning (model, example_inputs), e.g. "
                                   "fxpipe.models.gpt:build")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the factory (JSON value), repeatable")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--chunks", type=_chunks, default=4, help="micro-batches, or 'auto'")
    p.add_argument("--remat", default="except_last", help="never|always|except_last|auto")
    p.add_argument("--balance", type=_balance, default="cost",
                   help="cost|dynamic|time|params or node counts like 20,21")
    p.add_argument("--memory-limit", type=float, default=None, help="bytes per stage")
    p.add_argument("--schedule", default="gpipe", help="gpipe|1f1b|zb-h1|auto")
    p.add_argument("--profile", default=None, help="device profile preset (a100, h100, ...)")


def _compile(args: argparse.Namespace) -> tuple[Program, torch.Tensor | None]:
    model, inputs, kwargs, target = load_factory(args.factory, args.set)
    print(f"compiling {type(model).__name__} into {args.stages} stages (capture, costs, "
          "partition, split, remat, codegen) ...", file=sys.stderr, flush=True)
    program = compile_program(model, inputs, example_kwargs=kwargs, stages=args.stages,
                             chunks=args.chunks, remat=args.remat, balance=args.balance,
                             memory_limit=args.memory_limit, schedule=args.schedule,
                             profile=args.profile, command=_command_line(args))
    return program, target


def _command_line(args: argparse.Namespace) -> str:
    """The `fxpipe compile` command that compiles the same program again (shown in headers)."""
    words = ["fxpipe", "compile", args.factory]
    for setting in args.set:
        words += ["--set", setting]
    balance = args.balance if isinstance(args.balance, str) else ",".join(map(str, args.balance))
    words += ["--stages", str(args.stages), "--chunks", str(args.chunks), "--remat", args.remat,
              "--balance", balance]
    if args.memory_limit is not None:
        words += ["--memory-limit", repr(args.memory_limit)]
    if args.schedule != "gpipe":
        words += ["--schedule", args.schedule]
    if args.profile is not None:
        words += ["--profile", args.profile]
    return shlex.join(words)


def cmd_compile(args: argparse.Namespace) -> int:
    program, target = _compile(args)
    print(program.report().text())
    if args.out:
        files = program.write(args.out, target=target)
        print(f"\nwrote {len(files)} files to {args.out}/ (run: fxpipe run {args.out} "
              f"--nproc {args.stages})")
    return 0


def cmd_costs(args: argparse.Namespace) -> int:
    model, inputs, kwargs, _ = load_factory(args.factory, args.set)
    gm = capture(model, inputs, kwargs, inline_modules=not args.modules)
    annotate_costs(gm)
    b = args.microbatch or gm.meta[ir.CAPTURE].batch_size
    print(cost_table(gm, b=b, profile=get_profile(args.profile), sort=args.sort,
                     by_module=args.by_module, top=args.top))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    print(program_report(args.dir, as_json=args.json), end="")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    plan = plan_run(args.dir, args.nproc, args.port, args.program_args)
    return run_program(plan, debug=args.debug)


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(args.out, nproc=2, steps=args.steps)


def cmd_selfcheck(args: argparse.Namespace) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.quick:
        return run_selfcheck(models, remat=("except_last",), distributed=not args.no_distributed)
    return run_selfcheck(models, distributed=not args.no_distributed)


def cmd_bench(args: argparse.Namespace) -> int:
    return run_bench(BenchOptions(model=args.model, settings=tuple(args.set), stages=args.stages,
                                  chunks=args.chunks, remat=args.remat, steps=args.steps,
                                  warmup=args.warmup, out=args.out, plot=args.plot,
                                  port=args.port, balance=args.balance,
                                  torch_schedules=tuple(args.torch_schedules.split(","))))


def cmd_bench_compile(args: argparse.Namespace) -> int:
    return run_bench_compile(args.n_layer, args.stages, args.profile)


def cmd_bench_partition(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    return run_bench_partition(sizes, args.stages, args.out)


def cmd_profile(args: argparse.Namespace) -> int:
    if args.clear:
        removed = clear_cache()
        print(f"removed {removed} cached profiles and balanced cuts from {cache_dir()}")
        return 0
    if args.preset:
        profile = get_profile(args.preset)
        where = "datasheet preset"
    else:
        dtype = getattr(torch, args.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"unknown dtype {args.dtype!r}", hint="e.g. float32, bfloat16")
        if not args.refresh and not profile_path(profile_key(args.device, dtype)).exists():
            print(f"measuring {args.device} ({args.dtype}) once for this machine ...",
                  file=sys.stderr, flush=True)
        profile = cached_profile(args.device, dtype, refresh=args.refresh)
        where = str(profile_path(profile.key))
    print(f"{profile.name} [{profile.key}]\n{profile.source}\n{where}\n")
    print(tabulate(profile.describe(), headers=["op class", "GFLOP/s (small .. large kernels)",
                                                "GB/s (small .. large kernels)"]))
    print(f"\nkernel launch: {profile.kernel_overhead * 1e6:.2f} us; link latency "
          f"{profile.link_latency * 1e6:.1f} us per message")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxpipe", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:11]))
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    c = sub.add_parser("compile", help="partition a model, print the report, write the program")
    _add_compile_options(c)
    c.add_argument("--out", help="folder to write the program to")
    c.set_defaults(func=cmd_compile)
    k = sub.add_parser("costs", help="per-node cost table of a model")
    k.add_argument("factory")
    k.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    k.add_argument("--microbatch", type=int, default=None, help="micro-batch size to evaluate at")
    k.add_argument("--sort", choices=["time", "fwd_flops", "params", "saved"], default=None)
    k.add_argument("--by-module", action="store_true", help="group rows by module")
    k.add_argument("--modules", action="store_true", help="keep torch.nn modules as single nodes")
    k.add_argument("--top", type=int, default=None)
    k.add_argument("--profile", default="measure")
    k.set_defaults(func=cmd_costs)
    r = sub.add_parser("report", help="print the report of a written program")
    r.add_argument("dir")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_report)
    u = sub.add_parser("run", help="train a written program on local processes (torchrun)")
    u.add_argument("dir")
    u.add_argument("--nproc", type=int, required=True, help="processes: stages x replicas")
    u.add_argument("--port", type=int, default=None,
                   help="the rendezvous port (default: a free one)")
    u.set_defaults(func=cmd_run, program_args=[])
    u.epilog = "Other arguments go to program.py, e.g. --steps 5 --verify --timeline t.json"
    d = sub.add_parser("demo", help="compile the bundled GPT, write it, train it on 2 processes")
    d.add_argument("--out", default="fxpipe-demo")
    d.add_argument("--steps", type=int, default=3)
    d.set_defaults(func=cmd_demo)
    s = sub.add_parser("selfcheck", help="prove the GPU paths on this machine (CPU parts without "
                                         "a GPU); run it on every new machine or torch version")
    s.add_argument("--models", default=",".join(MODELS),
                   help=f"reference models to check (default {','.join(MODELS)})")
    s.add_argument("--quick", action="store_true",
                   help="one remat mode (except_last) instead of all three")
    s.add_argument("--no-distributed", action="store_true",
                   help="skip the checks that start torchrun")
    s.set_defaults(func=cmd_selfcheck)
    b = sub.add_parser("bench", help="step time against one process and torch pipelining")
    _add_bench_options(b)
    b.set_defaults(func=cmd_bench)
    bc = sub.add_parser("bench-compile", help="compile time of a deep GPT, pass by pass")
    bc.add_argument("--n-layer", type=int, default=48)
    bc.add_argument("--stages", type=int, default=4)
    bc.add_argument("--profile", default="a100")
    bc.set_defaults(func=cmd_bench_compile)
    bp = sub.add_parser("bench-partition", help="partition quality and solve time")
    bp.add_argument("--sizes", default="1000,10000,100000")
    bp.add_argument("--stages", type=int, default=8)
    bp.add_argument("--out", default=".")
    bp.set_defaults(func=cmd_bench_partition)
    pr = sub.add_parser("profile", help="show (or measure again) the device profile compiles use")
    pr.add_argument("--device", default="cpu")
    pr.add_argument("--dtype", default="float32")
    pr.add_argument("--refresh", action="store_true", help="measure again and cache the result")
    pr.add_argument("--preset", default=None, help="show a datasheet preset, e.g. h100:bf16")
    pr.add_argument("--clear", action="store_true",
                    help="forget every cached profile and balanced cut of this machine")
    pr.set_defaults(func=cmd_profile)
    return p


def _add_bench_options(b: argparse.ArgumentParser) -> None:
    b.add_argument("model", nargs="?", default="gpt", help="bundled model name or MODULE:FACTORY")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    b.add_argument("--stages", type=int, default=2)
    b.add_argument("--chunks", type=int, default=8)
    b.add_argument("--remat", default="never")
    b.add_argument("--steps", type=int, default=5, help="measured steps per variant")
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--out", default=".")
    b.add_argument("--plot", action="store_true", help="write a PNG Gantt chart (matplotlib)")
    b.add_argument("--port", type=int, default=29511)
    b.add_argument("--balance", default="dynamic", help="fxpipe's balance mode (cost|dynamic|...)")
    b.add_argument("--torch-schedules", default=",".join(TORCH_SCHEDULES),
                   help="torch.distributed.pipelining schedules to race, comma-separated")


def main(argv: list[str] | None = None) -> int:
    args, extra = parser().parse_known_args(argv)
    if extra and getattr(args, "command", None) == "run":
        args.program_args = [a for a in extra if a != "--"]
    elif extra:
        parser().error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser().print_help()
        return 2
    func: Callable[[argparse.Namespace], int] = args.func  # a cmd_* function above
    try:
        return func(args)
    except FxPipeError as e:
        if args.debug:
            traceback.print_exc()
        else:
            print(f"fxpipe: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

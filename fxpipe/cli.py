"""The `fxpipe` command line: compile, inspect, run and benchmark pipelines of any PyTorch model.

Exit status: 0 ok, 1 a failure while running, 2 bad input (an option, a model, a factory).

Only what the parser needs is imported up front (torch-free): each command imports the API and
tools it runs, so `fxpipe --help` and `fxpipe COMMAND --help` answer without importing torch.
"""
from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import re
import shlex
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fxpipe.choices import BALANCE_MODES, MODELS, REMAT_MODES, SHARD_MODES
from fxpipe.errors import ConfigError, FxPipeError, PipelineRuntimeError
from fxpipe.runtime.planning.schedule import DEFAULT_SCHEDULE, SCHEDULES
from fxpipe.runtime.program.arguments import program_options_help
from fxpipe.units import byte_size
from fxpipe.version import __version__

if TYPE_CHECKING:
    import torch

    from fxpipe.program import Program

__all__ = ["main"]


FACTORY_FORMS = """\
MODULE:FACTORY names a callable, imported from the current folder or sys.path (as `python -m`
does); --set KEY=VALUE passes keyword arguments to it (JSON values). It returns one of:
  (model, example_inputs)                 example_inputs: a tensor or a tuple of tensors
  (model, example_inputs, example_kwargs) example_kwargs: keyword inputs, a dict of tensors
Its module may also define example_kwargs(inputs, **settings) (keyword inputs, when the factory
returns none) and target(inputs, **settings) (the training target the written program uses)."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help line (unless it says its own, or it is a flag);
    descriptions and examples as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def _chunks(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def _balance(value: str) -> list[int] | str:
    if value in BALANCE_MODES:
        return value
    try:
        return [int(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(BALANCE_MODES)} or node counts like 20,21, got "
            f"{value!r}") from None


def _byte_size(value: str) -> float:
    """Bytes, as a plain number or with a unit (fxpipe.units.byte_size)."""
    try:
        return byte_size(value)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(error.message) from error


def _add_factory(p: argparse.ArgumentParser) -> None:
    p.add_argument("factory", help="MODULE:FACTORY returning (model, example_inputs), e.g. "
                                   "fxpipe.models.gpt:build (forms: see below)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the factory (JSON value), repeatable")


def _add_compile_options(p: argparse.ArgumentParser) -> None:
    _add_factory(p)
    p.add_argument("--stages", type=int, default=2,
                   help="pipeline stages (processes, except under a looped schedule: "
                        "stages / stages-per-rank)")
    p.add_argument("--chunks", type=_chunks, default=4,
                   help="micro-batches per batch, or 'auto' (the best divisor of the batch)")
    p.add_argument("--remat", default="except_last", choices=REMAT_MODES,
                   help="what to recompute in backward")
    p.add_argument("--balance", type=_balance, default="cost",
                   help=f"{'|'.join(BALANCE_MODES)}, or node counts per stage like 20,21")
    p.add_argument("--memory-limit", type=_byte_size, default=None, metavar="SIZE",
                   help="memory per rank the partition and --remat auto fit, like 8GiB or 1.5GB "
                        "(plain numbers are bytes); a rank holding several stages gives each an "
                        "equal share (default: no limit)")
    p.add_argument("--schedule", default=DEFAULT_SCHEDULE.name, choices=(*SCHEDULES, "auto"),
                   help="pipeline schedule; interleaved-1f1b, zb-v and dualpipev place several "
                        "stages on each rank; auto: the fastest predicted one that fits, on "
                        "the same number of ranks")
    p.add_argument("--stages-per-rank", type=int, default=None,
                   help="stages each rank holds (default: 2 for interleaved-1f1b, zb-v and "
                        "dualpipev, 1 for the others)")
    p.add_argument("--profile", default=None,
                   help="device profile preset (a100, h100, h100:bf16, ...); default: measured "
                        "on this machine")
    _add_optimizer(p)
    p.add_argument("--shard", default="none", choices=SHARD_MODES,
                   help="what the data-parallel replicas of a stage split: none, or the "
                        "optimizer's state (ZeRO-1); the written program honours it")
    p.add_argument("--replicas", type=int, default=None,
                   help="data-parallel replicas the memory model shards over (default: 1)")
    p.add_argument("--no-stamp", dest="stamp", action="store_false",
                   help="trace every block of a run of alike blocks (the layers of a ModuleList) "
                        "instead of tracing one and stamping out the rest (the default, checked "
                        "against the whole model)")


def _add_optimizer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--optimizer", default="adam",
                   help="what training holds per parameter, for the memory each stage is "
                        "charged: adam, adamw, sgd, momentum, adagrad, rmsprop, adafactor, ... "
                        "or bytes per parameter element beyond the weight (default: adam)")
    p.add_argument("--master-weights", action="store_true",
                   help="the optimizer keeps float32 master weights and state (mixed precision)")


def _optimizer(args: argparse.Namespace) -> str | float:
    try:
        return float(args.optimizer)
    except ValueError:
        return str(args.optimizer)


def _compile(args: argparse.Namespace) -> tuple[Program, torch.Tensor | None]:
    from fxpipe.api import compile as compile_program
    from fxpipe.models import load_factory

    model, inputs, kwargs, target = load_factory(args.factory, args.set)
    print(f"compiling {type(model).__name__} into {args.stages} stages (capture, costs, "
          "partition, split, remat, codegen) ...", file=sys.stderr, flush=True)
    program = compile_program(model, inputs, example_kwargs=kwargs, stages=args.stages,
                             chunks=args.chunks, remat=args.remat, balance=args.balance,
                             memory_limit=args.memory_limit, schedule=args.schedule,
                             stages_per_rank=args.stages_per_rank,
                             profile=args.profile, command=_command_line(args),
                             optimizer=_optimizer(args), master_weights=args.master_weights,
                             stamp=args.stamp, shard=args.shard, replicas=args.replicas)
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
    if args.schedule != DEFAULT_SCHEDULE.name:
        words += ["--schedule", args.schedule]
    if args.stages_per_rank is not None:
        words += ["--stages-per-rank", str(args.stages_per_rank)]
    if args.profile is not None:
        words += ["--profile", args.profile]
    if args.optimizer != "adam":
        words += ["--optimizer", args.optimizer]
    if args.master_weights:
        words += ["--master-weights"]
    if not args.stamp:
        words += ["--no-stamp"]
    if args.shard != "none":
        words += ["--shard", args.shard]
    if args.replicas is not None:
        words += ["--replicas", str(args.replicas)]
    return shlex.join(words)


def cmd_compile(args: argparse.Namespace) -> int:
    program, target = _compile(args)
    print(program.report().text())
    if args.out:
        files = program.write(args.out, target=target)
        print(f"\nwrote {len(files)} files to {args.out}/ (run: fxpipe run {args.out} "
              f"--nproc {program.built.spec.ranks})")
    return 0


def cmd_costs(args: argparse.Namespace) -> int:
    from fxpipe.tools.costs import print_costs

    return print_costs(args.factory, args.set, modules=args.modules, microbatch=args.microbatch,
                       profile=args.profile, sort=args.sort, by_module=args.by_module,
                       top=args.top)


def cmd_plan(args: argparse.Namespace) -> int:
    from fxpipe.models import load_factory
    from fxpipe.planner import plan
    from fxpipe.sizing import largest_that_fits

    if args.largest:
        if args.memory_per_device is None:
            raise ConfigError("--largest searches for what fits in --memory-per-device",
                              hint="pass --memory-per-device, e.g. 80GB")
        key = args.largest

        def build(size: int) -> tuple[Any, ...]:
            return load_factory(args.factory, [*args.set, f"{key}={size}"])[:3]

        size, found = largest_that_fits(
            build, devices=args.devices, memory_per_device=args.memory_per_device,
            profile=args.profile, devices_per_node=args.devices_per_node,
            inter_node_bandwidth=args.inter_node_bandwidth, optimizer=_optimizer(args),
            master_weights=args.master_weights, **_shards(args),
            say=lambda line: print(line, file=sys.stderr, flush=True))
        print(f"the largest {key} that fits: {size}\n")
        print(found.table(rows=args.rows), end="")
        return 0
    model, inputs, kwargs, _ = load_factory(args.factory, args.set)
    print(f"planning {type(model).__name__} on {args.devices} devices (capture and costs once, "
          "then every candidate's partition) ...", file=sys.stderr, flush=True)
    result = plan(model, inputs, kwargs, devices=args.devices,
                  memory_per_device=args.memory_per_device, profile=args.profile,
                  devices_per_node=args.devices_per_node,
                  inter_node_bandwidth=args.inter_node_bandwidth, optimizer=_optimizer(args),
                  master_weights=args.master_weights, **_shards(args))
    print(result.table(rows=args.rows), end="")
    return 0


def _shards(args: argparse.Namespace) -> dict[str, Any]:
    """plan()'s shard modes: the one --shard names, else its default (every available one)."""
    return {"shards": (args.shard,)} if args.shard is not None else {}


def cmd_report(args: argparse.Namespace) -> int:
    from fxpipe.runtime.program.folder import program_report

    print(program_report(args.dir, as_json=args.json), end="")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from fxpipe.runtime.program.torchrun import plan_run, run_program

    plan = plan_run(args.dir, args.nproc, args.port, args.program_args)
    return run_program(plan, debug=args.debug)


def cmd_demo(args: argparse.Namespace) -> int:
    from fxpipe.tools.demo import run_demo

    return run_demo(args.out, nproc=2, steps=args.steps)


def cmd_selfcheck(args: argparse.Namespace) -> int:
    from fxpipe.tools.selfcheck import run_selfcheck

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.quick:
        return run_selfcheck(models, remat=("except_last",), distributed=not args.no_distributed)
    return run_selfcheck(models, distributed=not args.no_distributed)


def cmd_bench(args: argparse.Namespace) -> int:
    from fxpipe.tools.bench import BenchOptions, run_bench
    from fxpipe.tools.bench_torch import SCHEDULES as TORCH_SCHEDULES

    chosen = args.torch_schedules.split(",") if args.torch_schedules else TORCH_SCHEDULES
    return run_bench(BenchOptions(model=args.model, settings=tuple(args.set), stages=args.stages,
                                  chunks=args.chunks, remat=args.remat, steps=args.steps,
                                  seconds=args.seconds, warmup=args.warmup, out=args.out,
                                  plot=args.plot, port=args.port, balance=args.balance,
                                  torch_schedules=tuple(chosen)))


def cmd_bench_compile(args: argparse.Namespace) -> int:
    from fxpipe.tools.bench import run_bench_compile

    return run_bench_compile(args.n_layer, args.stages, args.profile)


def cmd_bench_partition(args: argparse.Namespace) -> int:
    from fxpipe.tools.bench_partition import run_bench_partition

    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    return run_bench_partition(sizes, args.stages, args.out)


def cmd_profile(args: argparse.Namespace) -> int:
    from fxpipe.tools.profile_show import show_profile

    return show_profile(clear=args.clear, preset=args.preset, device=args.device,
                        dtype=args.dtype, refresh=args.refresh)


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines) if lines else ""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fxpipe", formatter_class=_Formatter,
        description="Compile any PyTorch model into a GPipe pipeline, inspect it, train it.",
        epilog=_examples("fxpipe demo", "fxpipe compile fxpipe.models.gpt:build --stages 2 "
                         "--out prog", "fxpipe run prog --nproc 2 --steps 5",
                         "fxpipe COMMAND --help") + "\n\n" + __doc__.split("\n\n")[1])
    p.add_argument("--version", action="version",
                   version=f"fxpipe {__version__} (torch {_torch_version()})")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    # --debug after the command too: every subcommand takes it (SUPPRESS keeps the top's value)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    def command(name: str, help: str, *examples: str, epilog: str = "") -> argparse.ArgumentParser:
        text = "\n\n".join(t for t in (_examples(*examples), epilog) if t)
        cp = sub.add_parser(name, help=help, description=help, epilog=text, parents=[common],
                            formatter_class=_Formatter)
        cp.set_defaults(command_parser=cp)  # whose options an unknown flag is compared with
        return cp

    c = command("compile", "partition a model, print the report, write the program",
                "fxpipe compile fxpipe.models.gpt:build --set n_layer=8 --stages 4 --out prog",
                "fxpipe compile mymodel:build --chunks auto --profile a100",
                epilog=FACTORY_FORMS)
    _add_compile_options(c)
    c.add_argument("--out", help="folder to write the program to (default: print the report only)")
    c.set_defaults(func=cmd_compile)
    pl = command("plan", "choose stages, replicas, micro-batches, schedule and remat for N devices",
                 "fxpipe plan fxpipe.models.gpt:build --devices 8 --profile h100",
                 "fxpipe plan mymodel:build --devices 64 --devices-per-node 8 "
                 "--memory-per-device 80GB --inter-node-bandwidth 25e9 --profile h100",
                 "fxpipe plan fxpipe.models.gpt:build --devices 8 --memory-per-device 16GB "
                 "--largest n_layer --profile h100",
                 epilog=FACTORY_FORMS)
    _add_factory(pl)
    pl.add_argument("--devices", type=int, required=True, help="devices the run has")
    pl.add_argument("--memory-per-device", type=_byte_size, default=None, metavar="SIZE",
                    help="memory a device may hold, like 80GB (default: no limit)")
    pl.add_argument("--devices-per-node", type=int, default=None,
                    help="devices per machine (default: all on one)")
    pl.add_argument("--inter-node-bandwidth", type=float, default=None, metavar="BYTES_PER_S",
                    help="bandwidth between machines per device, e.g. 25e9")
    pl.add_argument("--profile", default=None,
                    help="device profile preset (a100, h100, h100:bf16, ...); default: measured "
                         "on this machine")
    _add_optimizer(pl)
    pl.add_argument("--shard", default=None, choices=SHARD_MODES,
                    help="consider only this sharding of the replicas (default: none and "
                         "optimizer, ZeRO-1)")
    pl.add_argument("--rows", type=int, default=12, help="candidates to print")
    pl.add_argument("--largest", metavar="KEY", default=None,
                    help="search the factory's KEY (e.g. n_layer) for the largest model that "
                         "fits, each size built on the meta device")
    pl.set_defaults(func=cmd_plan)
    k = command("costs", "per-node cost table of a model",
                "fxpipe costs fxpipe.models.gpt:build --top 10",
                "fxpipe costs fxpipe.models.mlp:build --by-module --sort params",
                epilog=FACTORY_FORMS)
    _add_factory(k)
    k.add_argument("--microbatch", type=int, default=None,
                   help="micro-batch size to evaluate at (default: the example's batch size)")
    k.add_argument("--sort", choices=["time", "fwd_flops", "params", "saved"], default=None,
                   help="sort rows by this column, largest first (default: graph order, or "
                        "time with --top)")
    k.add_argument("--by-module", action="store_true", help="group rows by module")
    k.add_argument("--modules", action="store_true", help="keep torch.nn modules as single nodes")
    k.add_argument("--top", type=int, default=None,
                   help="only the N costliest rows (by --sort, else by time)")
    k.add_argument("--profile", default="measure",
                   help="device profile: 'measure' (this machine) or a preset (a100, h100, ...)")
    k.set_defaults(func=cmd_costs)
    r = command("report", "print the report of a written program", "fxpipe report prog",
                "fxpipe report prog --json")
    r.add_argument("dir", help="folder written by fxpipe compile --out")
    r.add_argument("--json", action="store_true", help="print report.json instead of the text")
    r.set_defaults(func=cmd_report)
    u = command("run", "train a written program on local processes (torchrun)")
    u.add_argument("dir", help="folder written by fxpipe compile --out")
    u.add_argument("--nproc", type=int, default=None,
                   help="processes: pipeline ranks x replicas (default: the program's ranks, "
                        "one replica)")
    u.add_argument("--port", type=int, default=None,
                   help="the rendezvous port (default: a free one)")
    u.set_defaults(func=cmd_run, program_args=[])
    u.epilog = ("Other arguments go to program.py, e.g. --steps 5 --verify --timeline t.json;\n"
                + program_options_help())
    u.formatter_class = argparse.RawDescriptionHelpFormatter
    d = command("demo", "compile the bundled GPT, write it, train it on 2 processes",
                "fxpipe demo", "fxpipe demo --out /tmp/demo --steps 5")
    d.add_argument("--out", default="fxpipe-demo", help="folder to write the program to")
    d.add_argument("--steps", type=int, default=3, help="training steps")
    d.set_defaults(func=cmd_demo)
    s = command("selfcheck", "prove the GPU paths on this machine (CPU parts without a GPU); run "
                "it on every new machine or torch version", "fxpipe selfcheck --quick")
    s.add_argument("--models", default=",".join(MODELS), help="reference models to check")
    s.add_argument("--quick", action="store_true",
                   help="one remat mode (except_last) instead of all three")
    s.add_argument("--no-distributed", action="store_true",
                   help="skip the checks that start torchrun")
    s.set_defaults(func=cmd_selfcheck)
    b = command("bench", "step time against one process and torch pipelining",
                "fxpipe bench", "fxpipe bench gpt --set n_layer=8 --stages 4 --chunks 8",
                "fxpipe bench mymodel:build --steps 10 --plot")
    _add_bench_options(b)
    b.set_defaults(func=cmd_bench)
    bc = command("bench-compile", "compile time of a deep GPT, pass by pass",
                 "fxpipe bench-compile --n-layer 24")
    bc.add_argument("--n-layer", type=int, default=48, help="GPT blocks")
    bc.add_argument("--stages", type=int, default=4, help="pipeline stages")
    bc.add_argument("--profile", default="a100", help="device profile preset")
    bc.set_defaults(func=cmd_bench_compile)
    bp = command("bench-partition", "partition quality and solve time",
                 "fxpipe bench-partition --sizes 1000,10000 --stages 4")
    bp.add_argument("--sizes", default="1000,10000,100000",
                    help="graph sizes (nodes) to solve, comma-separated")
    bp.add_argument("--stages", type=int, default=8, help="pipeline stages")
    bp.add_argument("--out", default=".", help="folder for the results")
    bp.set_defaults(func=cmd_bench_partition)
    pr = command("profile", "show (or measure again) the device profile compiles use",
                 "fxpipe profile", "fxpipe profile --preset h100:bf16", "fxpipe profile --refresh")
    pr.add_argument("--device", default="cpu", help="device to measure")
    pr.add_argument("--dtype", default="float32", help="dtype to measure")
    pr.add_argument("--refresh", action="store_true", help="measure again and cache the result")
    pr.add_argument("--preset", default=None, help="show a datasheet preset, e.g. h100:bf16")
    pr.add_argument("--clear", action="store_true",
                    help="forget every cached profile and balanced cut of this machine")
    pr.set_defaults(func=cmd_profile)
    return p


def _add_bench_options(b: argparse.ArgumentParser) -> None:
    b.add_argument("model", nargs="?", default="gpt",
                   help=f"bundled model ({', '.join(MODELS)}) or MODULE:FACTORY")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the factory (JSON value), repeatable")
    b.add_argument("--stages", type=int, default=2, help="pipeline stages (processes)")
    b.add_argument("--chunks", type=int, default=8, help="micro-batches per batch")
    b.add_argument("--remat", default="never", choices=REMAT_MODES,
                   help="what fxpipe recomputes in backward")
    b.add_argument("--steps", type=int, default=15,
                   help="measured steps per variant, at least (paired ratios need about 15 to "
                        "resolve 3%% of a step of a second)")
    b.add_argument("--seconds", type=float, default=180.0,
                   help="measuring time that more steps fill while a round of every variant "
                        "is short (a step of a few ms needs about a hundred; a round costs "
                        "about 0.1 s a variant more than its steps); 0: just --steps")
    b.add_argument("--warmup", type=int, default=2, help="warm-up steps per variant")
    b.add_argument("--out", default=".", help="folder for the results")
    b.add_argument("--plot", action="store_true", help="write a PNG Gantt chart (matplotlib)")
    b.add_argument("--port", type=int, default=29511, help="rendezvous port of the ranks")
    b.add_argument("--balance", default="dynamic", choices=BALANCE_MODES,
                   help="fxpipe's balance mode")
    b.add_argument("--torch-schedules", default=None,
                   help="torch.distributed.pipelining schedules to race, comma-separated "
                        "(default: every one fxpipe.tools.bench_torch knows)")


def _unknown(p: argparse.ArgumentParser, extra: list[str]) -> None:
    """Refuses unknown arguments, suggesting the closest option of the command (exit 2)."""
    options = re.findall(r"--[\w-]+", p.format_help())
    notes = [f"did you mean {close[0]}?" for word in extra if word.startswith("-")
             for close in [difflib.get_close_matches(word.split("=")[0], options, n=1)] if close]
    p.error(f"unrecognized arguments: {' '.join(extra)}"
            + (f" ({'; '.join(notes)})" if notes else ""))


def _torch_version() -> str:
    """torch's version as installed, read without importing it (as --help is answered)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra and getattr(args, "command", None) == "run":
        args.program_args = [a for a in extra if a != "--"]
    elif extra:
        _unknown(args.command_parser if getattr(args, "command_parser", None) else p, extra)
    if not getattr(args, "func", None):
        p.print_help()
        return 2
    func: Callable[[argparse.Namespace], int] = args.func  # a cmd_* function above
    try:
        return func(args)
    except FxPipeError as e:
        if args.debug:
            traceback.print_exc()
        else:
            print(f"fxpipe: error: {e}", file=sys.stderr)
        # a pipeline that failed while running is a failure; anything else was bad input
        return 1 if isinstance(e, PipelineRuntimeError) else 2
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        print(f"fxpipe: error: {args.command} needs PyTorch, and torch is not installed in "
              f"{sys.executable}\nhint: pip install 'torch>=2.4' (on a machine without a GPU, "
              "the CPU build: pip install torch --index-url "
              "https://download.pytorch.org/whl/cpu)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

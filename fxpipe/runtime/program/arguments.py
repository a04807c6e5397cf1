"""The command line of a written program.py: its options, and an unknown one named with the
option it most resembles, so that `fxpipe run` can check a command before starting ranks."""
from __future__ import annotations

import argparse
import difflib
import math
import os
from typing import TYPE_CHECKING

from fxpipe.errors import ConfigError

if TYPE_CHECKING:  # torch-free at run time: `fxpipe run --help` lists these options
    from fxpipe.runtime.program.spec import ProgramSpec

__all__ = ["program_parser", "parse_program_args", "program_options_help",
           "DEFAULT_DP_BUCKET_BYTES", "OPTIMIZERS"]

DEFAULT_DP_BUCKET_BYTES = 25 * 2**20  # as DDP's bucket_cap_mb
OPTIMIZERS = ("sgd", "adamw")  # program.py --optimizer (fxpipe.runtime.launch makes them)


def program_parser(spec: ProgramSpec | None) -> argparse.ArgumentParser:
    """program.py's options (their defaults depend on the program; without one, as any
    program takes them, for `fxpipe run --help`)."""
    parser = argparse.ArgumentParser(
        prog="program.py", exit_on_error=False,
        description=f"Train the fxpipe pipeline of {spec.model if spec else 'a model'}.")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--lr", type=float, default=spec.lr if spec else None,
                        help="learning rate (default "
                             f"{spec.lr if spec else 'the one the program was written with'})")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                        help="sgd: SGD with momentum 0.9, as --verify's losses were recorded; "
                             "adamw: AdamW with torch's defaults (default sgd)")
    parser.add_argument("--weight-decay", type=float, default=0.0,
                        help="the optimizer's weight decay: decoupled in adamw, an L2 term in "
                             "sgd (default 0)")
    parser.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                        help="raise the learning rate linearly to --lr over the first N steps, "
                             "counted from step 0, so that a resumed run goes on where the "
                             "ramp was (default 0: none)")
    parser.add_argument("--clip-grad-norm", type=float, metavar="MAX",
                        help="before each optimizer step, scale the gradients down to a 2-norm "
                             "of MAX where it is larger: the whole model's norm, over every "
                             "rank (default: no clipping)")
    parser.add_argument("--verify", action="store_true",
                        help="check the losses against the plain model's (recorded at write time)")
    parser.add_argument("--data", metavar="MODULE:FN",
                        help="train on your batches: FN() returns an iterable of (inputs, "
                             "target), inputs as the model takes them (a tensor, a tuple, a "
                             "dict of keyword inputs), one global batch each (default: the "
                             "example batch, every step)")
    parser.add_argument("--timeline", metavar="PATH",
                        help="write a Chrome trace of the last step (open in Perfetto)")
    parser.add_argument("--save", metavar="DIR", help="write a checkpoint after training")
    parser.add_argument("--save-every", type=int, metavar="N",
                        help="with --save: also write it every N steps, each save replacing the "
                             "last, so that a run stopped midway resumes from there (default: "
                             "only after training)")
    parser.add_argument("--resume", metavar="DIR", help="start from a checkpoint (model and "
                        "optimizer state; written by --save or program.save); with --data, "
                        "the batches of the steps it holds are read and skipped")
    parser.add_argument("--check-finite", action="store_true",
                        help="stop with the stage and value where NaN/Inf first appear")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds a rank waits for a peer before giving up (default 60)")
    parser.add_argument("--setup-timeout", type=float, default=1800.0,
                        help="seconds the ranks wait for each other while they start and load "
                             "their stages' weights, before --timeout applies (default 1800)")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--weights", metavar="PATH",
                         help="each rank reads its stage's tensors from this checkpoint, by the "
                              "model's state_dict names: a state dict (.pt/.bin), a .safetensors "
                              "file, or a save_pretrained folder (sharded with an index or not)")
    weights.add_argument("--init", action="store_true",
                         help="each rank initializes its stage with the model's initializers "
                              "(a program of a model compiled on the meta device)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of --init (default 0)")
    parser.add_argument("--dp-bucket-mb", type=float, default=DEFAULT_DP_BUCKET_BYTES / 2**20,
                        help="with data-parallel replicas: average gradients in buckets of this "
                             "size during the last backward (default 25); 0 averages after it")
    return parser


def program_options_help() -> str:
    """program.py's options as its --help lists them, for `fxpipe run --help`."""
    text = program_parser(None).format_help()
    return "program.py's " + text[text.index("options:"):].rstrip()


def parse_program_args(argv: list[str], spec: ProgramSpec) -> argparse.Namespace:
    """program.py's options from `argv`; raises ConfigError naming a word it does not take."""
    parser = program_parser(spec)
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(f"program.py {e}", hint="program.py --help lists its options") from None
    if unknown:
        # argparse lists its options only in this attribute
        options = [o for action in parser._actions for o in action.option_strings]
        word = unknown[0]
        close = difflib.get_close_matches(word.partition("=")[0], options, n=1)
        raise ConfigError(f"program.py does not take {word!r}"
                          + (f" (did you mean {close[0]}?)" if close else ""),
                          hint="program.py --help lists its options")
    _check_values(args)
    return args


def _check_values(args: argparse.Namespace) -> None:
    """Values argparse accepts that would train on garbage or check nothing: a NaN or negative
    learning rate, a negative step count, a --verify of no steps, a timeline nowhere writable."""
    if not (math.isfinite(args.lr) and args.lr >= 0):
        raise ConfigError(f"program.py --lr {args.lr} is not a learning rate (allowed: a finite "
                          "number >= 0)", hint="omit --lr to train with the program's own")
    if args.steps < 0:
        raise ConfigError(f"program.py --steps {args.steps} is negative (allowed: 0 or more)",
                          hint="pass --steps 1 or more to train")
    if args.verify and args.steps < 1:
        raise ConfigError(f"program.py --verify with --steps {args.steps} would check no loss",
                          hint="pass --steps 1 or more with --verify")
    if args.clip_grad_norm is not None and not (math.isfinite(args.clip_grad_norm)
                                                 and args.clip_grad_norm > 0):
        raise ConfigError(f"program.py --clip-grad-norm {args.clip_grad_norm} is not a norm "
                          "(allowed: a finite number > 0)",
                          hint="omit --clip-grad-norm to train without clipping")
    if args.verify and args.clip_grad_norm is not None:
        raise ConfigError(f"program.py --verify compares with losses recorded without clipping, "
                          f"and --clip-grad-norm {args.clip_grad_norm} changes every later step",
                          hint="verify without --clip-grad-norm first, then train with it")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise ConfigError(f"program.py --weight-decay {args.weight_decay} is no weight decay "
                          "(allowed: a finite number >= 0)", hint="omit it for none")
    if args.warmup_steps < 0:
        raise ConfigError(f"program.py --warmup-steps {args.warmup_steps} is negative "
                          "(allowed: 0 or more)", hint="omit it for no warm-up")
    changed = [f"{option} {value}" for option, value, default in (
        ("--optimizer", args.optimizer, "sgd"), ("--weight-decay", args.weight_decay, 0.0),
        ("--warmup-steps", args.warmup_steps, 0)) if value != default]
    if args.verify and changed:
        raise ConfigError(f"program.py --verify compares with losses recorded by SGD with "
                          f"momentum 0.9 at a constant learning rate, and {', '.join(changed)} "
                          "trains otherwise", hint="verify without it first, then train with it")
    if args.save_every is not None and args.save_every < 1:
        raise ConfigError(f"program.py --save-every {args.save_every} is no number of steps "
                          "(allowed: 1 or more)", hint="omit --save-every to save after training")
    if args.save_every is not None and not args.save:
        raise ConfigError(f"program.py --save-every {args.save_every} has no folder to save to",
                          hint="pass --save DIR with it")
    if args.verify and args.data:
        raise ConfigError(f"program.py --verify compares with losses recorded on the example "
                          f"batch, and --data {args.data} trains on other batches",
                          hint="verify without --data first, then train on your data")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ConfigError(f"program.py --timeout {args.timeout} is not a number of seconds "
                          "(allowed: a finite number > 0)", hint="omit --timeout to wait 60 s")
    if not (math.isfinite(args.dp_bucket_mb) and args.dp_bucket_mb >= 0):
        raise ConfigError(f"program.py --dp-bucket-mb {args.dp_bucket_mb} is not a size "
                          "(allowed: a finite number >= 0)", hint="omit --dp-bucket-mb for 25")
    if args.timeline is not None:
        folder = os.path.dirname(os.path.abspath(args.timeline))
        if os.path.isdir(args.timeline) or not os.path.isdir(folder):
            what = "is a folder" if os.path.isdir(args.timeline) else \
                f"is in {folder}, which is no folder"
            raise ConfigError(f"program.py --timeline {args.timeline} {what}",
                              hint="name a file in an existing folder, e.g. --timeline t.json")

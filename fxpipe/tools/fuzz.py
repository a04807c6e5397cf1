"""Random DAG models for checking transparency (DESIGN.md): the compiled program must compute
the same outputs, loss and gradients as the plain model, for every model and config.

    model, inputs, kwargs = random_model(seed)  # or random.Random(...), or a hypothesis draw
    # fxpipe.testing.transparency:
    check_transparent(model, inputs, kwargs, stages=2, chunks=4, remat="always")

    python -m fxpipe.tools.fuzz --examples 1000 --seed 1  # N examples, a summary, 1 on failure
    python -m fxpipe.tools.fuzz --replay 1000017  # one example again, with the full error
    python -m fxpipe.tools.fuzz --minimise "CostError"  # hypothesis finds and shrinks a failure
    python -m fxpipe.tools.fuzz --avoid relu_,batch_sized_gate  # leave features out (open bugs)

A model is a `FuzzNet`: a ModuleDict of layers plus a constant plan (a tuple of `Op`s, each
reading earlier values by index) run by a Python loop in `forward`. torch.fx unrolls that loop
because the plan is a constant. Values 0 .. n_inputs-1 are the positional inputs; layer i writes
value n_inputs + i. A `Spec` (plain frozen data, printed in every failure) determines the model,
its parameters (init_seed) and its example batch.

Features: 1-3 inputs (batch 4, 6 or 8; widths 2-16), Linear (widths 2-16, some without bias),
LayerNorm (over 4+ features: over 2-3 it is too ill-conditioned for float32 comparisons),
ReLU/GELU/Tanh/Sigmoid, Dropout, residual additions, long skip edges, branches merged by add,
mul or torch.cat, Linear layers that share one weight Parameter (tied; placed in the second half
of the model, tied to a Linear of the first half, so they can land in different stages), a Linear
module called twice (reuse), in-place ReLU (F.relu(inplace=True), as torchvision writes it), an
optional keyword input `gate` (multiplies a value by sigmoid(gate) when given; sometimes
(1, width), broadcast over the batch), and 1-3 outputs as a tensor, tuple or dict. Edge cases, at
low rates: an input returned as an output, an output returned twice, a branch merged with
itself, an unused input, frozen layers (requires_grad=False), inputs that require grad (their
gradients are compared too), the same tensor passed as two inputs. `avoid=` (or --avoid) leaves
any of them out (KINDS, EDGE_FEATURES).

Configs: stages 1 .. min(4, layers that launch a kernel), chunks a divisor of the batch, remat
never/always/except_last, and sometimes explicit split_points at random layers (cuts the cost
model would not choose).

Dropout: models are generated with p in {0, 0.1, 0.5}. A model with any p > 0 is returned in
eval mode, where check_transparent compares it with the plain model (in train mode a micro-batch
draws other masks than the full batch, so it cannot be compared). Such a model is also checked
in train mode between the program with remat and without (check_dropout_remat: same cuts, same
torch seed, so the same masks: outputs bit for bit). Models with only p = 0 are returned in train
mode (15% in eval mode, to cover both).

The same generator runs from a seed (a plain loop, `python -m fxpipe.tools.fuzz`) and from
hypothesis (`models_and_configs()`, which shrinks failures towards fewer layers, fewer features
and the first choice of every option).
"""
from __future__ import annotations

import argparse
import re
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fxpipe.testing.fuzz_examples import (  # noqa: F401 - re-exported: the fuzzer's whole API
    Example,
    models_and_configs,
    random_config,
    random_example,
)
from fxpipe.testing.fuzz_models import (  # noqa: F401 - re-exported: the fuzzer's whole API
    ACTIVATIONS,
    BATCHES,
    EDGE_FEATURES,
    KINDS,
    REMATS,
    FuzzNet,
    Op,
    Spec,
    SpecOptions,
    example_batch,
    random_model,
    random_spec,
)
from fxpipe.testing.transparency import PROFILE  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is Python 3.11+

__all__ = [
    "EDGE_FEATURES",
    "KINDS",
    "Example",
    "FuzzNet",
    "Op",
    "Spec",
    "main",
    "minimise",
    "models_and_configs",
    "random_config",
    "random_example",
    "random_model",
    "random_spec",
]


# -- minimising ----------------------------------------------------------------------------------


def failure_of(example: Example) -> str | None:
    """The first line of the example's failure, or None when it is transparent."""
    try:
        example.check()
    except AssertionError as e:
        return _first_line(str(e))
    return None


def minimise(pattern: str, *, max_examples: int = 2000,
             **options: Unpack[SpecOptions]) -> Example:
    """The smallest example hypothesis finds whose failure matches the regex `pattern`.

    hypothesis searches models_and_configs(**options) for a failing example and shrinks it
    towards fewer layers and inputs, the first option of every choice and fewer stages.
    """
    from hypothesis import HealthCheck, find, settings  # a test extra: only this command needs it

    regex = re.compile(pattern)

    def fails(example: Example) -> bool:
        message = failure_of(example)
        return message is not None and regex.search(message) is not None

    return find(models_and_configs(**options), fails,
                settings=settings(max_examples=max_examples, database=None, deadline=None,
                                  suppress_health_check=list(HealthCheck)))


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


# -- command line ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fxpipe.tools.fuzz",
        description="Compiles random DAG models and checks that every program is transparent "
                    "(same outputs, loss and gradients as the plain model).")
    parser.add_argument("--examples", type=int, default=1000, help="how many (default 1000)")
    parser.add_argument("--seed", type=int, default=0,
                        help="base seed: example i uses seed SEED * 1000000 + i")
    parser.add_argument("--max-layers", type=int, default=10)
    parser.add_argument("--avoid", default="", metavar="FEATURES",
                        help="comma-separated features to leave out (see KINDS, EDGE_FEATURES)")
    parser.add_argument("--replay", type=int, default=None, metavar="SEED",
                        help="run the one example of this seed and print the full error")
    parser.add_argument("--minimise", default=None, metavar="REGEX",
                        help="search for an example whose failure matches REGEX, shrink it and "
                             "print it")
    args = parser.parse_args(argv)
    options: SpecOptions = {
        "max_layers": args.max_layers,
        "avoid": tuple(x.strip() for x in args.avoid.split(",") if x.strip())}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small models: threads only add overhead
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _run(args, options)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, options: SpecOptions) -> int:
    if args.minimise is not None:
        from hypothesis.errors import NoSuchExample

        try:
            example = minimise(args.minimise, max_examples=args.examples, **options)
        except NoSuchExample:
            print(f"no failure matching {args.minimise!r} in {args.examples} examples")
            return 0
        print(f"minimal: stages={example.stages} chunks={example.chunks} "
              f"remat={example.remat!r} split_points={example.split_points}\n{example.spec!r}\n"
              f"{failure_of(example)}")
        return 1
    if args.replay is not None:
        example = random_example(args.replay, **options)
        print(f"seed {args.replay}: stages={example.stages} chunks={example.chunks} "
              f"remat={example.remat!r} split_points={example.split_points}\n{example.spec!r}")
        try:
            example.check()
        except AssertionError:
            traceback.print_exc()
            return 1
        print("transparent")
        return 0

    start = time.perf_counter()
    failures: list[tuple[int, str]] = []
    for i in range(args.examples):
        seed = args.seed * 1_000_000 + i
        try:
            example = random_example(seed, **options)
            example.check()
        except Exception as e:  # noqa: BLE001 - AssertionError: fxpipe; others: the generator
            message = _first_line(str(e))
            if not isinstance(e, AssertionError):
                message = f"fuzz error: {type(e).__name__}: {message}"
            failures.append((seed, message))
            print(f"FAIL seed={seed}: {message}", flush=True)
        if (i + 1) % 50 == 0 or i + 1 == args.examples:
            print(f"[{i + 1}/{args.examples}] {len(failures)} failures, "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
    kinds: dict[str, list[int]] = {}
    for seed, message in failures:
        kinds.setdefault(message.split(":")[0] + ": " + message.split(":")[1].strip()
                         if ":" in message else message, []).append(seed)
    print(f"summary: {args.examples} examples (seed {args.seed}), {len(failures)} failures, "
          f"{time.perf_counter() - start:.0f}s")
    for kind, seeds in kinds.items():
        print(f"  {len(seeds)} x {kind}: seeds {seeds[:10]}{' ...' if len(seeds) > 10 else ''}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

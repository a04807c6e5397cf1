"""Random DAG models for checking transparency (DESIGN.md): the compiled program must compute
the same outputs, loss and gradients as the plain model, for every model and config.

    model, inputs, kwargs = random_model(seed)          # or random.Random(...), or hypothesis draw
    check_transparent(model, inputs, kwargs, stages=2, chunks=4, remat="always")

    python -m fxpipe.fuzz --examples 1000 --seed 1     # N examples, a summary, exit 1 on failure
    python -m fxpipe.fuzz --replay 1000017             # one example again, with the full error
    python -m fxpipe.fuzz --minimise "CostError"       # hypothesis finds and shrinks a failure
    python -m fxpipe.fuzz --avoid relu_,batch_sized_gate   # leave features out (open bugs)

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

The same generator runs from a seed (a plain loop, `python -m fxpipe.fuzz`) and from hypothesis
(`models_and_configs()`, which shrinks failures towards fewer layers, fewer features and the
first choice of every option).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.fuzz_models import (  # noqa: F401 - re-exported: the fuzzer's whole API
    ACTIVATIONS, BATCHES, EDGE_FEATURES, KINDS, PROFILE, REMATS, Example, FuzzNet, Op, Spec,
    example_batch, models_and_configs, random_config, random_example, random_model, random_spec)

__all__ = [
    "EDGE_FEATURES",
    "KINDS",
    "Example",
    "FuzzNet",
    "Op",
    "Spec",
    "check_dropout_remat",
    "check_transparent",
    "main",
    "minimise",
    "models_and_configs",
    "random_config",
    "random_example",
    "random_model",
    "random_spec",
]


# -- the check ------------------------------------------------------------------------------------


def _detach(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def _clone(tree: Any, dtype: torch.dtype | None = None) -> Any:
    """Fresh copies of the tensors of `tree` (so no run sees another's in-place updates), that
    require grad where the originals do."""
    memo: dict[int, torch.Tensor] = {}  # one copy per tensor: aliased inputs stay aliased

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in memo:
            copy_ = t.detach().clone()
            if dtype is not None and copy_.is_floating_point():
                copy_ = copy_.to(dtype)
            memo[id(t)] = copy_.requires_grad_(t.requires_grad)
        return memo[id(t)]

    return pytree.tree_map(one, tree)


def _results(output: Any, loss: torch.Tensor, model: nn.Module,
             inputs: Any) -> dict[str, torch.Tensor | None]:
    """Every compared tensor by name: output leaves, the loss, every parameter's gradient (under
    every name) and the gradient of every input that requires grad."""
    named: dict[str, torch.Tensor | None] = {}
    for k, leaf in enumerate(pytree.tree_leaves(output)):
        named[f"output leaf {k}"] = leaf.detach() if isinstance(leaf, torch.Tensor) else leaf
    named["loss"] = loss.detach()
    for name, p in model.named_parameters(remove_duplicate=False):
        named[f"gradient of {name}"] = None if p.grad is None else p.grad.detach().clone()
    for k, t in enumerate(pytree.tree_leaves(inputs)):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            named[f"gradient of input leaf {k}"] = None if t.grad is None else t.grad.detach()
    return named


def _run_plain(model: nn.Module, inputs: tuple, kwargs: dict,
               dtype: torch.dtype | None = None) -> tuple[Any, dict[str, Any]]:
    from fxpipe.losses import default_loss

    model = copy.deepcopy(model)
    if dtype is not None:
        model = model.to(dtype)
    args, kw = _clone((inputs, kwargs), dtype)
    output = model(*args, **kw)
    loss = default_loss(output)
    if loss.requires_grad:  # False when no output depends on a parameter or input
        loss.backward()
    return output, _results(output, loss, model, (args, kw))


def _rebatched(tree: Any, batch: int, factor: int, seed: int) -> Any:
    """New random values of the same structure with the batch `factor` times larger: every
    dimension 0 equal to `batch` grows, others (broadcast inputs) stay; aliasing and
    requires_grad are kept."""
    g = torch.Generator().manual_seed(seed)
    memo: dict[int, torch.Tensor] = {}

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in memo:
            shape = list(t.shape)
            if shape and shape[0] == batch:
                shape[0] = batch * factor
            new = torch.randn(shape, generator=g, dtype=t.dtype) if t.is_floating_point() \
                else t.repeat(factor, *[1] * (t.dim() - 1))
            memo[id(t)] = new.requires_grad_(t.requires_grad)
        return memo[id(t)]

    return pytree.tree_map(one, tree)


def _compare(actual: dict[str, Any], expected: dict[str, Any], exact: Callable[[], dict],
             where: str, explain_rounding: bool) -> None:
    if actual.keys() != expected.keys():
        raise AssertionError(f"compared names differ: {sorted(actual)} vs {sorted(expected)}"
                             f"\n  {where}")
    reference: dict[str, Any] | None = None
    for what, wanted in expected.items():
        got = actual[what]
        if (got is None) != (wanted is None):
            raise AssertionError(f"{what} is {'missing' if got is None else 'present'} but the "
                                 f"plain model's is {'missing' if wanted is None else 'present'}"
                                 f"\n  {where}")
        if got is None:
            continue
        try:
            torch.testing.assert_close(got, wanted)
            continue
        except AssertionError as e:
            failure = str(e)
        if explain_rounding and got.is_floating_point() and got.shape == wanted.shape:
            if reference is None:
                reference = exact()
            ref = reference[what].double()
            plain_error = float((wanted.double() - ref).abs().max())
            piped_error = (got.double() - ref).abs()
            allowed = 1e-5 + 1.3e-6 * ref.abs() + 4 * plain_error
            if bool((piped_error <= allowed).all()):
                continue  # float32 rounding: the plain model errs as much
            failure += (f"\nagainst float64: the program errs by up to "
                        f"{float(piped_error.max()):.3g}, the plain float32 model by "
                        f"{plain_error:.3g}")
        raise AssertionError(f"{what} differs: {failure}\n  {where}")


def check_transparent(model: nn.Module, inputs: Sequence[Any], kwargs: dict | None, stages: int,
                      chunks: int, remat: str, *, profile: Any = PROFILE,
                      explain_rounding: bool = True, rerun: bool = True,
                      **options: Any) -> None:
    """Compiles a copy of `model` and compares it with another plain copy in float32: outputs,
    the default loss (mean of squares of every output, no target), every parameter's gradient
    (under every name, so both names of a tied weight) and the gradient of every input that
    requires grad, with torch.testing.assert_close's default float32 tolerances (rtol 1.3e-6,
    atol 1e-5).

    The model is compared in the mode it is in (see the module docstring on dropout). With
    `rerun`, the program is then called again, on a new batch twice as large (gradients reset),
    and compared again: a program is reused, and only the batch size may change between calls.
    Last, its outputs under torch.no_grad() are compared (inference skips remat).
    Raises AssertionError naming the seed, the config and the tensor that differs and by how
    much; an exception inside fxpipe (compile, run, backward) becomes an AssertionError too.
    `options` go to fxpipe.compile (e.g. split_points, to cut at a chosen place).

    Rounding: random DAGs with products of branches reach gradients in the hundreds, where
    float32 rounding alone exceeds rtol 1.3e-6. With explain_rounding (the default), a tensor
    that fails assert_close is checked against the plain model run in float64: the difference
    is rounding, not a bug, when the program's error against float64 is within the default
    tolerances plus 4 x the plain float32 model's own error (max over the tensor). A pipeline
    bug (a missing micro-batch, a gradient counted twice, a wrong stage input) errs by the size
    of the values, orders of magnitude above that.
    """
    import fxpipe
    from fxpipe.losses import default_loss

    kwargs = dict(kwargs or {})
    inputs = tuple(inputs)
    seed = getattr(model, "fuzz_seed", None)
    spec = getattr(model, "spec", None)
    where = (f"seed={seed} stages={stages} chunks={chunks} remat={remat!r} "
             f"mode={'train' if model.training else 'eval'}"
             + "".join(f" {k}={v!r}" for k, v in options.items()))
    if spec is not None:
        where += f"\n  spec={spec!r}"

    piped = copy.deepcopy(model)
    step = "compile"
    batches = [(inputs, kwargs, "")]
    if rerun:
        batch = next(t.shape[0] for t in pytree.tree_leaves((inputs, kwargs))
                     if isinstance(t, torch.Tensor) and t.dim() > 0)
        new_inputs, new_kwargs = _rebatched((inputs, kwargs), batch, 2, seed=batch + 17)
        batches.append((new_inputs, new_kwargs, " (second call, batch x 2)"))
    try:
        program = fxpipe.compile(piped, _clone(inputs), example_kwargs=_clone(kwargs),
                                 stages=stages, chunks=chunks, remat=remat, profile=profile,
                                 **options)
    except Exception as e:
        raise AssertionError(f"fxpipe failed at compile: {type(e).__name__}: {e}\n  {where}"
                             ) from e
    for batch_inputs, batch_kwargs, call in batches:
        expected_output, expected = _run_plain(model, batch_inputs, batch_kwargs)
        for p in piped.parameters():
            p.grad = None
        step = "run"
        try:
            args, kw = _clone((batch_inputs, batch_kwargs))
            output = program(*args, **kw)
            step = "loss"
            loss = default_loss(output)
            step = "backward"
            if loss.requires_grad:
                loss.backward()
        except Exception as e:
            raise AssertionError(f"fxpipe failed at {step}{call}: {type(e).__name__}: {e}\n  "
                                 f"{where}") from e
        out_spec = pytree.tree_structure(output)
        exp_spec = pytree.tree_structure(expected_output)
        if out_spec != exp_spec:
            raise AssertionError(f"output structure differs{call}: {out_spec} instead of "
                                 f"{exp_spec}\n  {where}")
        actual = _results(output, loss, piped, (args, kw))
        _compare(actual, expected,
                 lambda bi=batch_inputs, bk=batch_kwargs: _run_plain(model, bi, bk,
                                                                     torch.float64)[1],
                 where + call, explain_rounding)
    # Inference: the same outputs without autograd (remat regions do not checkpoint then).
    try:
        with torch.no_grad():
            output = program(*_clone(inputs), **_clone(kwargs))
    except Exception as e:
        raise AssertionError(f"fxpipe failed at run under torch.no_grad(): {type(e).__name__}: "
                             f"{e}\n  {where}") from e
    with torch.no_grad():
        expected_output = copy.deepcopy(model)(*_clone(inputs), **_clone(kwargs))
    outputs = {f"output leaf {k}": t for k, t in enumerate(pytree.tree_leaves(output))}
    expected = {f"output leaf {k}": t for k, t in enumerate(pytree.tree_leaves(expected_output))}
    _compare(outputs, expected, lambda: _run_plain(model, inputs, kwargs, torch.float64)[1],
             where + " (under torch.no_grad())", explain_rounding)


def _stage_of_nodes(program: Any) -> list[tuple[str, int]]:
    from fxpipe import ir

    return [(n.name, n.meta[ir.STAGE]) for n in ir.compute_nodes(program.graph_module.graph)]


def _node_counts(program: Any) -> list[int]:
    """Compute nodes per stage: balance=... for another program with the same cuts."""
    from fxpipe import ir

    counts = [0] * len(program.stages)
    for node in ir.compute_nodes(program.graph_module.graph):
        counts[node.meta[ir.STAGE]] += 1
    return counts


def check_dropout_remat(model: nn.Module, inputs: Sequence[Any], kwargs: dict | None,
                        stages: int, chunks: int, remat: str, *, profile: Any = PROFILE,
                        **options: Any) -> None:
    """For a model with active dropout, in train mode: the program with remat `remat` (or
    "always" when `remat` is "never") and the program without remat, cut at the same places,
    draw the same masks, so their outputs and loss agree bit for bit (rtol=0, atol=0) for the
    same torch seed, and their gradients within the default tolerances.

    Train-mode dropout cannot be compared with the plain model (a micro-batch draws other masks
    than the full batch), but recomputation must redraw exactly the masks of the forward pass.
    """
    import fxpipe
    from fxpipe.losses import default_loss

    kwargs = dict(kwargs or {})
    other = remat if remat != "never" else "always"
    where = (f"seed={getattr(model, 'fuzz_seed', None)} stages={stages} chunks={chunks} "
             f"remat={other!r} vs 'never' (dropout, train mode)"
             + "".join(f" {k}={v!r}" for k, v in options.items()))
    results = []
    fixed = dict(options)
    try:
        if "split_points" not in fixed and stages > 1:
            # The same cuts for both programs: the cost of recomputation moves the cost
            # model's cuts, and each (stage, micro-batch) draws from its own RNG stream. The
            # cost model's stages need not be contiguous in node order, so both programs get
            # the node counts of a first one.
            probe = fxpipe.compile(copy.deepcopy(model).train(), _clone(tuple(inputs)),
                                   example_kwargs=_clone(kwargs), stages=stages, chunks=chunks,
                                   remat="never", profile=profile, **fixed)
            fixed["balance"] = _node_counts(probe)
    except Exception as e:
        raise AssertionError(f"fxpipe failed: {type(e).__name__}: {e}\n  {where}") from e
    cuts = []
    for mode in ("never", other):
        piped = copy.deepcopy(model).train()
        try:
            program = fxpipe.compile(piped, _clone(tuple(inputs)), example_kwargs=_clone(kwargs),
                                     stages=stages, chunks=chunks, remat=mode, profile=profile,
                                     **fixed)
            cuts.append(_stage_of_nodes(program))
            args, kw = _clone((tuple(inputs), kwargs))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1234)
                output = program(*args, **kw)
            loss = default_loss(output)
            if loss.requires_grad:
                loss.backward()
        except Exception as e:
            raise AssertionError(f"fxpipe failed with remat={mode!r}: {type(e).__name__}: {e}"
                                 f"\n  {where}") from e
        results.append(_results(output, loss, piped, (args, kw)))
    if cuts[0] != cuts[1]:
        raise AssertionError(f"the same {'split_points' if 'split_points' in fixed else 'balance'}"
                             f" gives other stages with remat={other!r}: {cuts[1]} instead of "
                             f"{cuts[0]}\n  {where}")
    for what, a in results[0].items():
        b = results[1][what]
        if (a is None) != (b is None):
            raise AssertionError(f"{what} is None in one program only\n  {where}")
        if a is not None:
            # the forward pass is the same computation: bit for bit; gradients may sum a
            # value's contributions in another order when its users are recomputed
            exact = {} if what.startswith("gradient") else {"rtol": 0, "atol": 0}
            try:
                torch.testing.assert_close(b, a, **exact)
            except AssertionError as e:
                raise AssertionError(f"{what} differs: {e}\n  {where}") from None


# -- minimising ----------------------------------------------------------------------------------


def failure_of(example: Example) -> str | None:
    """The first line of the example's failure, or None when it is transparent."""
    try:
        example.check()
    except AssertionError as e:
        return _first_line(str(e))
    return None


def minimise(pattern: str, *, max_examples: int = 2000, **options: Any) -> Example:
    """The smallest example hypothesis finds whose failure matches the regex `pattern`.

    hypothesis searches models_and_configs(**options) for a failing example and shrinks it
    towards fewer layers and inputs, the first option of every choice and fewer stages.
    """
    import re

    from hypothesis import HealthCheck, find, settings

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
        prog="python -m fxpipe.fuzz",
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
    options = {"max_layers": args.max_layers,
               "avoid": tuple(x.strip() for x in args.avoid.split(",") if x.strip())}
    import warnings

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small models: threads only add overhead
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _run(args, options)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, options: dict[str, Any]) -> int:
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

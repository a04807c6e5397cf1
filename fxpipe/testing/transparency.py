"""The transparency check (DESIGN.md): a compiled program must compute what the plain model
computes — the same outputs, loss and every parameter's gradient — for any model and config.

    check_transparent(model, inputs, kwargs, stages=2, chunks=4, remat="always")

Used by the fuzzer (fxpipe.tools.fuzz) on random models and by the tests on hand-written ones. A
model with dropout cannot be compared in train mode (a micro-batch draws other masks than the full
batch); check_dropout_remat compares the program with remat against the program without it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, TypeVar

import torch
import torch.utils._pytree as pytree
from torch import nn

import fxpipe
from fxpipe import ir
from fxpipe.losses import default_loss
from fxpipe.profile import DeviceProfile
from fxpipe.program import Program
from fxpipe.reference import copy_to

__all__ = ["PROFILE", "check_dropout_remat", "check_transparent"]

PROFILE = "a100"  # a deterministic preset: no CPU micro-benchmark per check

T = TypeVar("T")

Results: TypeAlias = dict[str, torch.Tensor | None]
"""Every compared tensor of one run by name (None: a gradient that was not computed)."""


def _clone(tree: T, dtype: torch.dtype | None = None) -> T:
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

    cloned: T = pytree.tree_map(one, tree)  # the same structure
    return cloned


def _results(output: Any, loss: torch.Tensor, model: nn.Module, inputs: Any) -> Results:
    """Every compared tensor by name: output leaves, the loss, every parameter's gradient (under
    every name) and the gradient of every input that requires grad."""
    named: Results = {}
    for k, leaf in enumerate(pytree.tree_leaves(output)):
        named[f"output leaf {k}"] = leaf.detach() if isinstance(leaf, torch.Tensor) else leaf
    named["loss"] = loss.detach()
    for name, p in model.named_parameters(remove_duplicate=False):
        named[f"gradient of {name}"] = None if p.grad is None else p.grad.detach().clone()
    for k, t in enumerate(pytree.tree_leaves(inputs)):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            named[f"gradient of input leaf {k}"] = None if t.grad is None else t.grad.detach()
    return named


def _run_plain(model: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any],
               dtype: torch.dtype | None = None) -> tuple[Any, Results]:
    model = copy_to(model, None)
    if dtype is not None:
        model = model.to(dtype)
    args, kw = _clone((inputs, kwargs), dtype)
    output = model(*args, **kw)
    loss = default_loss(output)
    if loss.requires_grad:  # False when no output depends on a parameter or input
        torch.autograd.backward(loss)
    return output, _results(output, loss, model, (args, kw))


def _float64(model: nn.Module, inputs: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Callable[[], Results]:
    """The plain model's results in float64, computed only when asked for."""
    return lambda: _run_plain(model, inputs, kwargs, torch.float64)[1]


def _rebatched(tree: T, batch: int, factor: int, seed: int) -> T:
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

    rebatched: T = pytree.tree_map(one, tree)  # the same structure
    return rebatched


def _compare(actual: Results, expected: Results, exact: Callable[[], Results],
             where: str, explain_rounding: bool) -> None:
    if actual.keys() != expected.keys():
        raise AssertionError(f"compared names differ: {sorted(actual)} vs {sorted(expected)}"
                             f"\n  {where}")
    reference: Results | None = None
    for what, wanted in expected.items():
        got = actual[what]
        if got is None and wanted is None:
            continue
        if got is None or wanted is None:
            raise AssertionError(f"{what} is {'missing' if got is None else 'present'} but the "
                                 f"plain model's is {'missing' if wanted is None else 'present'}"
                                 f"\n  {where}")
        try:
            torch.testing.assert_close(got, wanted)
            continue
        except AssertionError as e:
            failure = str(e)
        if explain_rounding and got.is_floating_point() and got.shape == wanted.shape:
            if reference is None:
                reference = exact()
            exact_value = reference[what]
            assert exact_value is not None  # the float64 run has every tensor float32 has
            ref = exact_value.double()
            plain_error = float((wanted.double() - ref).abs().max())
            piped_error = (got.double() - ref).abs()
            allowed = 1e-5 + 1.3e-6 * ref.abs() + 4 * plain_error
            if bool((piped_error <= allowed).all()):
                continue  # float32 rounding: the plain model errs as much
            failure += (f"\nagainst float64: the program errs by up to "
                        f"{float(piped_error.max()):.3g}, the plain float32 model by "
                        f"{plain_error:.3g}")
        raise AssertionError(f"{what} differs: {failure}\n  {where}")


def check_transparent(model: nn.Module, inputs: Sequence[Any], kwargs: dict[str, Any] | None,
                      stages: int, chunks: int, remat: str, *,
                      profile: DeviceProfile | str | None = PROFILE,
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
    kwargs = dict(kwargs or {})
    inputs = tuple(inputs)
    seed = getattr(model, "fuzz_seed", None)
    spec = getattr(model, "spec", None)
    where = (f"seed={seed} stages={stages} chunks={chunks} remat={remat!r} "
             f"mode={'train' if model.training else 'eval'}"
             + "".join(f" {k}={v!r}" for k, v in options.items()))
    if spec is not None:
        where += f"\n  spec={spec!r}"

    piped = copy_to(model, None)
    step = "compile"
    batches: list[tuple[tuple[Any, ...], dict[str, Any], str]] = [(inputs, kwargs, "")]
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
                torch.autograd.backward(loss)
        except Exception as e:
            raise AssertionError(f"fxpipe failed at {step}{call}: {type(e).__name__}: {e}\n  "
                                 f"{where}") from e
        out_spec = pytree.tree_structure(output)
        exp_spec = pytree.tree_structure(expected_output)
        if out_spec != exp_spec:
            raise AssertionError(f"output structure differs{call}: {out_spec} instead of "
                                 f"{exp_spec}\n  {where}")
        actual = _results(output, loss, piped, (args, kw))
        _compare(actual, expected, _float64(model, batch_inputs, batch_kwargs), where + call,
                 explain_rounding)
    # Inference: the same outputs without autograd (remat regions do not checkpoint then).
    try:
        with torch.no_grad():
            output = program(*_clone(inputs), **_clone(kwargs))
    except Exception as e:
        raise AssertionError(f"fxpipe failed at run under torch.no_grad(): {type(e).__name__}: "
                             f"{e}\n  {where}") from e
    with torch.no_grad():
        expected_output = copy_to(model, None)(*_clone(inputs), **_clone(kwargs))
    outputs = {f"output leaf {k}": t for k, t in enumerate(pytree.tree_leaves(output))}
    expected = {f"output leaf {k}": t for k, t in enumerate(pytree.tree_leaves(expected_output))}
    _compare(outputs, expected, _float64(model, inputs, kwargs),
             where + " (under torch.no_grad())", explain_rounding)


def _stage_of_nodes(program: Program) -> list[tuple[str, int]]:
    return [(n.name, n.meta[ir.STAGE]) for n in ir.compute_nodes(program.graph_module.graph)]


def _node_counts(program: Program) -> list[int]:
    """Compute nodes per stage: balance=... for another program with the same cuts."""
    counts = [0] * len(program.stages)
    for node in ir.compute_nodes(program.graph_module.graph):
        counts[node.meta[ir.STAGE]] += 1
    return counts


def check_dropout_remat(model: nn.Module, inputs: Sequence[Any], kwargs: dict[str, Any] | None,
                        stages: int, chunks: int, remat: str, *,
                        profile: DeviceProfile | str | None = PROFILE,
                        **options: Any) -> None:
    """For a model with active dropout, in train mode: the program with remat `remat` (or
    "always" when `remat` is "never") and the program without remat, cut at the same places,
    draw the same masks, so their outputs and loss agree bit for bit (rtol=0, atol=0) for the
    same torch seed, and their gradients within the default tolerances.

    Train-mode dropout cannot be compared with the plain model (a micro-batch draws other masks
    than the full batch), but recomputation must redraw exactly the masks of the forward pass.
    """
    kwargs = dict(kwargs or {})
    other = remat if remat != "never" else "always"
    where = (f"seed={getattr(model, 'fuzz_seed', None)} stages={stages} chunks={chunks} "
             f"remat={other!r} vs 'never' (dropout, train mode)"
             + "".join(f" {k}={v!r}" for k, v in options.items()))
    results: list[Results] = []
    fixed = dict(options)
    try:
        if "split_points" not in fixed and stages > 1:
            # The same cuts for both programs: the cost of recomputation moves the cost
            # model's cuts, and each (stage, micro-batch) draws from its own RNG stream. The
            # cost model's stages need not be contiguous in node order, so both programs get
            # the node counts of a first one.
            probe = fxpipe.compile(copy_to(model, None).train(), _clone(tuple(inputs)),
                                   example_kwargs=_clone(kwargs), stages=stages, chunks=chunks,
                                   remat="never", profile=profile, **fixed)
            fixed["balance"] = _node_counts(probe)
    except Exception as e:
        raise AssertionError(f"fxpipe failed: {type(e).__name__}: {e}\n  {where}") from e
    cuts: list[list[tuple[str, int]]] = []
    for mode in ("never", other):
        piped = copy_to(model, None).train()
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
                torch.autograd.backward(loss)
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
            try:
                if what.startswith("gradient"):
                    torch.testing.assert_close(b, a)
                else:
                    torch.testing.assert_close(b, a, rtol=0, atol=0)
            except AssertionError as e:
                raise AssertionError(f"{what} differs: {e}\n  {where}") from None

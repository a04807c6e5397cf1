"""Which dimension of each input and output is the batch: found by checking separability.

A dimension is the batch dimension when running the model on two halves of the batch along it
and concatenating the results reproduces the whole-batch result. That is what micro-batching
relies on, so it is checked rather than assumed to be dim 0 (an LSTM with batch_first=False has
its batch in dim 1; a causal model is not separable along time).

A meta model with a list of alike blocks (fxpipe.frontend.stamp) runs whole at most once, on the
example batch; the trials on halves run the model cut to three blocks when that cut model's
outputs have the whole one's shapes and dtypes on the example batch (on meta, shapes are all
there is to compare), so that no trial pays for every layer. With `derive`, the example batch
runs cut too, and capture derives the whole model's outputs from the stamped graph.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.errors import CaptureError
from fxpipe.frontend.custom_functions import custom_functions_applied
from fxpipe.frontend.mutation import StateSnapshot, check_unchanged
from fxpipe.frontend.zero_noise import NoiseAsZeros
from fxpipe.signature import ModelArgs, ModelKwargs, is_tensor
from fxpipe.untouched import seeded

__all__ = ["BatchLayout", "infer_batch_layout", "finite_scale"]


@dataclass(frozen=True)
class BatchLayout:
    input_dims: tuple[int | None, ...]  # per tensor input leaf
    output_dims: tuple[int | None, ...]  # per output leaf
    output_is_tensor: tuple[bool, ...]
    out_spec: pytree.TreeSpec
    batch_size: int
    # The eager model's flat outputs on trial_batches(), kept when the capture check would
    # compute them again: a model in eval mode, or a meta model (shapes only) run in its own
    # mode; empty otherwise.
    eager_outputs: tuple[list[Any], ...] = ()
    # The model's own autograd.Functions its first run applied (fxpipe.frontend.custom_functions)
    custom_functions: tuple[str, ...] = ()

    def slice_inputs(self, args: ModelArgs, kwargs: ModelKwargs, start: int,
                     length: int) -> tuple[ModelArgs, ModelKwargs]:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        dims = iter(self.input_dims)
        out: list[Any] = []
        for leaf in leaves:
            if is_tensor(leaf):
                d = next(dims)
                out.append(leaf if d is None else leaf.narrow(d, start, length))
            else:
                out.append(leaf)
        sliced: tuple[ModelArgs, ModelKwargs] = pytree.tree_unflatten(out, spec)
        return sliced

    def trial_batches(self, args: ModelArgs,
                      kwargs: ModelKwargs) -> list[tuple[ModelArgs, ModelKwargs]]:
        """The example batch and a smaller one, to check a captured graph beyond the example."""
        small = max(1, self.batch_size // 2)
        return [(args, kwargs), self.slice_inputs(args, kwargs, 0, small)]


def _candidates(tensors: Sequence[torch.Tensor]) -> Iterator[tuple[int | None, ...]]:
    """Assignments of batch dims to tensor inputs, most likely first (dim 0 everywhere)."""
    seen: set[tuple[int | None, ...]] = set()
    depth = max((t.dim() for t in tensors), default=0)
    for d in range(depth):
        for t in tensors:
            if d >= t.dim() or t.shape[d] < 2:
                continue
            size = t.shape[d]
            same = tuple(d if (d < u.dim() and u.shape[d] == size) else None for u in tensors)
            anywhere = tuple(d if (d < u.dim() and u.shape[d] == size) else
                             next((e for e in range(u.dim()) if u.shape[e] == size), None)
                             for u in tensors)
            # inputs whose other dimension merely equals the batch size are unbatched first
            for dims in (same, anywhere):
                if dims not in seen:
                    seen.add(dims)
                    yield dims


def _output_dims(full: Sequence[Any], first: Sequence[Any],
                 second: Sequence[Any]) -> tuple[int | None, ...] | None:
    """Each output's batch dim, or None if the halves do not concatenate to the whole."""
    dims: list[int | None] = []
    for f, a, b in zip(full, first, second):
        if not is_tensor(f):
            dims.append(None)
            continue
        changed = [d for d in range(f.dim()) if a.shape[d] != f.shape[d]]
        if not changed:
            dims.append(None)
            continue
        if len(changed) != 1:
            return None
        d = changed[0]
        if a.shape[d] + b.shape[d] != f.shape[d]:
            return None
        # A meta model (fxpipe.frontend.meta) has shapes only: they alone pick the dimension.
        if not f.is_meta and not _allclose(f, torch.cat([a, b], dim=d)):
            return None
        dims.append(d)
    return tuple(dims)


def _allclose(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    scale = finite_scale(a)
    return bool(torch.allclose(a, b, rtol=1e-3, atol=1e-5 + 1e-4 * scale, equal_nan=True))


def infer_batch_layout(model: nn.Module, args: ModelArgs, kwargs: ModelKwargs,
                       leaves: Sequence[Any],
                       batch_dims: Sequence[int | None] | None,
                       before: StateSnapshot | None = None,
                       cut: Callable[[], AbstractContextManager[None]] | None = None,
                       derive: bool = False) -> BatchLayout:
    """Finds (or checks the given) batch dims; runs the model in eval mode, without grad, and
    puts every module's own training flag back.

    The first run, in the model's own mode, is checked against `before` (state and inputs
    written in place are refused: fxpipe.frontend.mutation). The caller restores the model's
    buffers afterwards. `cut`, for a model on meta: a context in which the
    model is cut short, for the trial runs (see the module's docstring); with `derive`, every
    run is of the cut model, the example batch's too: the whole model's outputs are then derived
    from the stamped graph, which the caller must check (fxpipe.frontend.capture).
    """
    tensors = [x for x in leaves if is_tensor(x)]
    modes = [m.training for m in model.modules()]
    any_training = any(modes)
    whole: Callable[[], AbstractContextManager[None]] = cut if derive and cut else nullcontext
    functions: list[str] = []
    with torch.no_grad(), seeded(0), whole(), custom_functions_applied(functions):
        out = model(*args, **kwargs)
    if before is not None:
        check_unchanged(model, before)
    out_leaves, out_spec = pytree.tree_flatten(out)
    out_is_tensor = tuple(is_tensor(x) for x in out_leaves)
    if batch_dims is not None:
        candidates: Iterator[tuple[int | None, ...]] = iter([_check_given(batch_dims, tensors)])
    else:
        candidates = _candidates(tensors)
    candidates_tried = list(candidates)
    model.eval()
    tried: list[tuple[int | None, ...]] = []

    def search(noise: NoiseAsZeros | None) -> tuple[BatchLayout | None, list[Any]]:
        """The layout the trials find (None if none) and the outputs on the example batch
        they compared with; under `noise`, every random draw is zeros."""
        with contextlib.nullcontext() if noise is None else noise:
            # In eval mode the seeded run above is already the eval-mode result.
            with whole():
                full = out_leaves if not any_training and noise is None else \
                    pytree.tree_leaves(model(*args, **kwargs))
            trials, trial_full = (whole, full) if whole is not nullcontext else \
                _trial_model(model, args, kwargs, full, cut)
            # A split whose halves leave every output's shape as it is (a sequence-first
            # input cut along time, the output a mean over time) is taken only when no other
            # split gives an output a batch dimension: a loss over the batch is then all
            # the model returns.
            fallback: BatchLayout | None = None
            for dims in candidates_tried:
                if noise is None:
                    tried.append(dims)
                with trials():
                    layout = _try(model, args, kwargs, dims, trial_full, out_spec,
                                  out_is_tensor, tensors)
                if layout is not None and any(d is not None for d in layout.output_dims):
                    return layout, full
                fallback = fallback or layout
            return fallback, full

    try:
        with torch.no_grad(), seeded(0):  # a draw's numbers are the same on every search
            layout, full = search(None)
            zeroed = False
            if layout is None:  # noise drawn over the batch, or examples that interact
                noise = NoiseAsZeros()
                layout, full = search(noise)
                zeroed = noise.drew
                layout = layout if zeroed else None
            if layout is not None:
                _check_numbers(model, out, full, layout)
                layout = replace(layout, custom_functions=tuple(functions))
                if zeroed:  # the trials' outputs are not the model's: the check runs it
                    return replace(layout, eager_outputs=())
                if not any_training:
                    return replace(layout, eager_outputs=(full, layout.eager_outputs[0]))
                if any(is_tensor(x) for x in out_leaves) and \
                        all(x.is_meta for x in out_leaves if is_tensor(x)):
                    return replace(layout, eager_outputs=_own_mode_outputs(
                        model, modes, args, kwargs, out_leaves, layout, whole))
                return replace(layout, eager_outputs=())
    finally:  # each module's own flag: a BatchNorm frozen in a training model stays frozen
        for module, mode in zip(model.modules(), modes):
            module.training = mode
    raise _no_batch_dim(model, tensors, batch_dims, tried)


def _own_mode_outputs(model: nn.Module, modes: Sequence[bool], args: ModelArgs,
                      kwargs: ModelKwargs, out_leaves: list[Any], layout: BatchLayout,
                      whole: Callable[[], AbstractContextManager[None]]
                      ) -> tuple[list[Any], ...]:
    """A meta model's outputs on trial_batches() in its own (training) mode: what the capture
    check compares the graph's shapes and dtypes with, instead of running model and graph twice
    more. The example batch's is the first run's; the smaller batch's is one run more."""
    for module, mode in zip(model.modules(), modes):
        module.training = mode
    small_args, small_kwargs = layout.trial_batches(args, kwargs)[1]
    with torch.no_grad(), seeded(0), whole():
        small = pytree.tree_leaves(model(*small_args, **small_kwargs))
    return (out_leaves, small)


def _trial_model(model: nn.Module, args: ModelArgs, kwargs: ModelKwargs, full: Sequence[Any],
                 cut: Callable[[], AbstractContextManager[None]] | None
                 ) -> tuple[Callable[[], AbstractContextManager[None]], Sequence[Any]]:
    """The context to run the trials in and the outputs on the example batch they compare
    with: the cut model's when its outputs on the example batch have the whole model's shapes
    and dtypes, else the whole model's."""
    if cut is None or not all(x.is_meta for x in full if is_tensor(x)):
        return nullcontext, full
    try:
        with cut():
            short = pytree.tree_leaves(model(*args, **kwargs))
    except Exception:  # noqa: BLE001 - the cut model is a shortcut only: trial the whole one
        return nullcontext, full
    if len(short) != len(full) or any(
            is_tensor(a) != is_tensor(b) or
            (is_tensor(a) and (a.shape != b.shape or a.dtype != b.dtype)) or
            (not is_tensor(a) and not _same_number(a, b))
            for a, b in zip(full, short)):
        return nullcontext, full
    return cut, short


def _no_batch_dim(model: nn.Module, tensors: Sequence[torch.Tensor],
                  batch_dims: Sequence[int | None] | None,
                  tried: list[tuple[int | None, ...]]) -> CaptureError:
    """Why no batch dimension was found: too few examples, or examples that interact."""
    name = type(model).__name__
    shapes = [tuple(t.shape) for t in tensors]
    dims = tuple(batch_dims) if batch_dims is not None else (0,) * len(tensors)
    sizes = {t.shape[d] for t, d in zip(tensors, dims) if d is not None and d < t.dim()}
    if sizes and max(sizes) == 0:
        return CaptureError(
            f"the example batch of {name} is empty (tensor input shapes {shapes})",
            hint="pass an example batch with at least 2 samples along the batch dimension")
    if sizes and max(sizes) == 1:
        return CaptureError(
            f"the example batch of {name} has 1 sample (tensor input shapes {shapes}): finding "
            "and checking the batch dimension compares the model on two halves of the example, "
            "so it needs at least 2 samples",
            hint="pass an example batch of 2 or more samples (e.g. torch.cat([x, x])); "
                 "micro-batches of 1 sample are fine, so batch = chunks works")
    if batch_dims is not None:
        return CaptureError(
            f"{name} is not separable along the given batch_dims {dims} (tensor input shapes "
            f"{shapes}): its outputs on two halves of the batch do not make its output on the "
            "whole batch",
            hint="check batch_dims (one entry per tensor input, None for unbatched ones); "
                 "pipelining needs a model whose examples do not interact (no BatchNorm in "
                 "train mode across the batch, no in-batch losses)")
    return CaptureError(
        f"found no batch dimension along which {name} is separable "
        f"(tensor input shapes {shapes}; tried batch dims {tried})",
        hint="pass batch_dims=[...] (one entry per tensor input, None for unbatched ones); "
             "pipelining needs a model whose examples do not interact (no BatchNorm in "
             "train mode across the batch, no in-batch losses)",
    )


def _check_numbers(model: nn.Module, out: Any, full: Sequence[Any], layout: BatchLayout) -> None:
    """Refuses outputs that are Python numbers and differ between the batch and its first half
    (`x.shape[0]`): each micro-batch computes its own, and none is the plain model's."""
    half = layout.batch_size // 2
    for index, (value, part) in enumerate(zip(full, layout.eager_outputs[0])):
        if is_tensor(value) or _same_number(value, part):
            continue
        if not isinstance(value, (int, float, complex)):
            raise _opaque_output(model, out, index, value)
        raise CaptureError(
            f"output{_output_path(out, index)} of {type(model).__name__} is a Python number that "
            f"depends on the batch ({value!r} for the batch of {layout.batch_size}, {part!r} for "
            f"its first {half} examples): a pipeline computes it once per micro-batch, so it "
            "cannot return the plain model's value",
            hint="return a tensor with one entry per example, or compute the number outside the "
                 "model (e.g. from x.shape[0] of the batch)")


def _opaque_output(model: nn.Module, out: Any, index: int, value: object) -> CaptureError:
    """An output that is neither a tensor nor a structure of them, and differs between the
    batch and its half: e.g. a Hugging Face model's key/value cache object."""
    kind = type(value).__name__
    cache = " (a Hugging Face model returns its key/value cache unless use_cache=False)" \
        if kind.endswith("Cache") else ""
    return CaptureError(
        f"output{_output_path(out, index)} of {type(model).__name__} is an object of type {kind}, "
        f"which differs between the batch and its first half and is neither a tensor nor a "
        f"structure of tensors{cache}: a pipeline joins each output of its micro-batches "
        f"along the batch, and cannot join this one",
        hint="return tensors only" + (": pass use_cache=False in example_kwargs and in every "
                                      "call" if cache else
                                      " (or a list, tuple or dict of them); a dataclass of "
                                      "outputs is one once registered: "
                                      f"torch.export.register_dataclass({kind})"))


def _output_path(out: Any, index: int) -> str:
    """Where the index-th output leaf sits (`[1]`, `['count']`); its index where a registered
    output type gives no keys."""
    try:
        paths = [path for path, _ in pytree.tree_flatten_with_path(out)[0]]
    except ValueError:  # registered without flatten_with_keys_fn, as many libraries do
        return f" leaf {index}"
    return pytree.keystr(paths[index])


def _same_number(a: object, b: object) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an __eq__ that compares tensors, or an exotic one
        # An object holding tensors (a dataclass of outputs, which pytree does not flatten)
        # holds the batch's: not the same. Anything else has nothing to compare.
        return not (_holds_tensors(a) or _holds_tensors(b))


def _holds_tensors(value: object) -> bool:
    """Whether an object's attributes hold a tensor (directly or in lists, tuples, dicts)."""
    attributes = getattr(value, "__dict__", None)
    if not isinstance(attributes, dict):
        attributes = {k: getattr(value, k, None) for k in getattr(value, "__slots__", ())}
    return any(is_tensor(leaf) for leaf in pytree.tree_leaves(list(attributes.values())))


def _check_given(batch_dims: Sequence[int | None],
                 tensors: Sequence[torch.Tensor]) -> tuple[int | None, ...]:
    dims = tuple(batch_dims)
    shapes = [tuple(t.shape) for t in tensors]
    if len(dims) != len(tensors):
        raise CaptureError(f"batch_dims has {len(dims)} entries for {len(tensors)} tensor inputs "
                           f"(shapes {shapes})",
                           hint="give one entry per tensor input, None for unbatched ones")
    bad = [(d, s) for d, s in zip(dims, shapes) if d is not None and
           (not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < len(s))]
    if bad or all(d is None for d in dims):
        raise CaptureError(f"batch_dims {dims} does not name a dimension of each batched input "
                           f"(tensor input shapes {shapes})",
                           hint="give each batched input's dimension index (e.g. 0), None for "
                                "unbatched ones, and at least one batched input")
    sizes = {t.shape[d] for t, d in zip(tensors, dims) if d is not None}
    if len(sizes) != 1:
        raise CaptureError(f"batch_dims {dims} select different batch sizes ({sorted(sizes)})",
                           hint="every batched input must have the same batch size")
    return dims


def _try(model: nn.Module, args: ModelArgs, kwargs: ModelKwargs, dims: tuple[int | None, ...],
         full: Sequence[Any], out_spec: pytree.TreeSpec, out_is_tensor: tuple[bool, ...],
         tensors: Sequence[torch.Tensor]) -> BatchLayout | None:
    size = next(t.shape[d] for t, d in zip(tensors, dims) if d is not None)
    if size < 2:
        return None
    probe = BatchLayout(dims, (), out_is_tensor, out_spec, size)
    half = size // 2
    try:
        first = pytree.tree_leaves(model(*probe.slice_inputs(args, kwargs, 0, half)[0],
                                         **probe.slice_inputs(args, kwargs, 0, half)[1]))
        if size == 2 * half and all(t.is_meta for t in tensors):
            # Meta tensors carry shapes only, and the second half has the first's: running it
            # again would give the same shapes (a run on fake tensors saved).
            second = first
        else:
            a2, k2 = probe.slice_inputs(args, kwargs, half, size - half)
            second = pytree.tree_leaves(model(*a2, **k2))
    except Exception:  # noqa: BLE001 - a wrong dim often makes the model fail
        return None
    if len(first) != len(full) or len(second) != len(full):
        return None
    out_dims = _output_dims(full, first, second)
    if out_dims is None:
        return None
    return BatchLayout(dims, out_dims, out_is_tensor, out_spec, size, (first,))


def finite_scale(a: torch.Tensor) -> float:
    """Largest finite magnitude (NaN and inf outputs are compared with equal_nan, not scaled)."""
    finite = a.detach()[torch.isfinite(a.detach())]
    return float(finite.abs().max()) if finite.numel() else 0.0

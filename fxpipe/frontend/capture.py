"""Capture any nn.Module as a torch.fx GraphModule that is checked against the eager model.

Two front ends: torch.fx symbolic tracing (readable, module-level) and torch.export (captures
Python control flow on shapes, LSTMs, Hugging Face models). "auto" tries fx, runs the captured
graph against the eager model on the example batch and on a smaller one, and falls back to export
when tracing fails or computes something else (a trace can succeed and still be wrong, e.g. when
forward hooks are skipped).

Writes: TENSOR on every node (fxpipe.frontend.shapes), GraphModule.meta[CAPTURE] = CaptureInfo.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe import ir
from fxpipe.errors import CaptureError, ConfigError
from fxpipe.frontend import lazy, regions, shapes, tracers
from fxpipe.frontend.batching import BatchLayout, infer_batch_layout
from fxpipe.frontend.check import compare_shapes, compare_with_eager
from fxpipe.frontend.inputs import (
    check_fits_forward,
    input_names,
    normalize_inputs,
    set_signature_codegen,
    signature_of,
)
from fxpipe.frontend.meta import (
    Check,
    check_name,
    eager_runs,
    is_meta_model,
    meta_run_error,
    to_meta,
    validate_check,
)
from fxpipe.frontend.module_hooks import refuse_backward_hooks, warn_hooks_run_while_compiling
from fxpipe.frontend.mutation import (
    StateSnapshot,
    attributes_kept,
    restore_values,
    snapshot_state,
    stored_error,
    tensor_attributes,
)
from fxpipe.frontend.naming import name_nodes_after_modules
from fxpipe.frontend.stamp import Stamper
from fxpipe.frontend.tracers import LeafModule, refuse_scripted_modules
from fxpipe.reparametrized import derived_attributes
from fxpipe.signature import ModelArgs, ModelKwargs, Signature, is_tensor
from fxpipe.untouched import modes_kept

__all__ = ["capture", "CaptureInfo", "METHODS"]

METHODS = ("auto", "fx", "export", "follow_branches")


@dataclass(frozen=True)
class CaptureInfo:
    """How the graph was obtained; stored in GraphModule.meta[ir.CAPTURE]."""

    method: str  # "fx" or "export": the front end that produced the graph
    requested: str  # what the caller asked for ("auto", "fx", "export")
    fallback_reason: str | None  # why "auto" did not keep the fx graph
    training: bool  # the model's mode at capture time, baked into the graph
    signature: Signature
    batch_size: int
    inline_modules: bool
    # seconds per phase: batch layout, front end (trace or export, and the check), shapes
    timings: tuple[tuple[str, float], ...] = ()
    checked: str = "values against the eager model"  # what the graph was checked against
    fake_runs: int = 0  # runs of the whole model or its graph on fake tensors (_Runs)
    cpu_timings: tuple[tuple[str, float], ...] = ()  # CPU seconds, by the phases of timings
    stamped: int = 0  # blocks stamped as copies of a traced one (fxpipe.frontend.stamp)
    stamp_note: str | None = None  # one line: which blocks were stamped, or why not (None: off)
    cut_runs: int = 0  # runs (and export) of the model cut to three blocks, on fake tensors
    inlined_leaves: tuple[str, ...] = ()  # leaf_modules export traced through (it has none)

    def describe(self) -> str:
        """One line for the report: the front end, why fx was not kept, what was checked."""
        how = f"captured with {self.method}"
        if self.fallback_reason:
            how += f" (the fx trace was not kept: {_first_line(self.fallback_reason)})"
        if self.inlined_leaves:
            how += f", traced through leaf_modules {', '.join(self.inlined_leaves)}"
        return f"{how}; checked: {self.checked}"


@dataclass
class _Runs:
    """Counts the runs of the model or its graph on fake tensors while capturing (a meta model's
    eager runs and graph checks, export's trace, shape propagation): they dominate its cost."""

    fake: int = 0
    cut: int = 0  # of them, runs of the model cut to three blocks (counted apart)
    stamper: Stamper | None = None  # tells whether the model is cut now

    def add(self) -> None:
        """One run more (of the cut model while it is cut)."""
        if self.stamper is not None and self.stamper.cutting:
            self.cut += 1
        else:
            self.fake += 1

    @contextlib.contextmanager
    def calls(self, module: nn.Module, on: bool) -> Iterator[None]:
        """Counts every call of `module` inside the block, when `on`."""
        if not on:
            yield
            return
        handle = module.register_forward_pre_hook(self._count)
        try:
            yield
        finally:
            handle.remove()

    def _count(self, *_: Any) -> None:
        self.add()


def capture(
    model: nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    method: str = "auto",
    leaf_modules: Sequence[LeafModule] = (),
    inline_modules: bool = False,
    batch_dims: Sequence[int | None] | None = None,
    check: Check = None,
    stamp: bool = False,
) -> fx.GraphModule:
    """Captures `model` as a GraphModule that computes what the model computes.

    Args:
        model: any nn.Module; its train/eval mode is captured and recorded.
        example_inputs: a tensor or a tuple of positional inputs (batch size >= 2).
        example_kwargs: keyword inputs.
        method: "auto" (fx, checked, falling back to export), "fx", "export", or
            "follow_branches": export, each `if` on a tensor's value going the way it goes on
            the example batch, checked on every batch (fxpipe.frontend.branches).
        leaf_modules: module types, instances or qualified names to keep as opaque
            call_module nodes under fx.
        inline_modules: trace through torch.nn modules (functional graph with get_attr
            parameters) instead of calling them as leaves.
        batch_dims: the batch dimension of each tensor input (None = not batched); inferred
            when omitted by checking that the model is separable along it.
        check: for a model on the meta device, which has no values to compare: a twin (a
            small instance of the same code on real tensors, checked on the example batch) or
            "shapes" (output shapes and dtypes only); see fxpipe.frontend.meta.
        stamp: trace a run of alike blocks (the layers of a ModuleList) as three and stamp out
            the rest (fxpipe.frontend.stamp); the graph is checked against the whole model.

    Returns:
        A GraphModule with flat tensor placeholders, callable like the model
        (`gm(*example_inputs, **example_kwargs)`), with ir.TENSOR on every node and
        `gm.meta[ir.CAPTURE]`.

    Raises:
        CaptureError: neither front end captures the model; says where and what to do.
    """
    if method not in METHODS:
        raise ConfigError(f"unknown capture method {method!r}", hint=f"use one of {METHODS}")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be an nn.Module (got {type(model).__name__})",
                          hint="wrap the function in an nn.Module")
    leaf_labels = tuple(_leaf_label(x) for x in leaf_modules)
    if leaf_labels and method in ("export", "follow_branches"):
        raise ConfigError(f"leaf_modules ({', '.join(leaf_labels)}) keep modules whole under the "
                          f"fx front end, but the {method!r} front end traces through every "
                          f"module", hint="capture with 'auto' or 'fx' (compile(capture=...), "
                                          "capture(method=...)), or drop leaf_modules")
    args, kwargs = normalize_inputs(example_inputs, example_kwargs)
    check_fits_forward(model, args, kwargs)
    refuse_backward_hooks(model)
    refuse_scripted_modules(model)
    warn_hooks_run_while_compiling(model, stacklevel=2)
    validate_check(check, model, (args, kwargs))
    if check is not None:  # a meta model: checked on a twin or by shapes, run on meta inputs
        method, batch_dims = _check_twin(check, model, args, kwargs, method, leaf_modules,
                                         inline_modules, batch_dims)
        args, kwargs = to_meta((args, kwargs))
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    tensors = [x for x in leaves if is_tensor(x)]
    if not tensors:
        raise CaptureError("the example inputs contain no tensor",
                           hint="pass at least one tensor input (a batch of examples)")
    names = input_names(model, args, kwargs)
    clock = [(time.perf_counter(), time.process_time())]

    def lap() -> tuple[float, float]:
        """Wall and CPU seconds since the last lap."""
        clock.append((time.perf_counter(), time.process_time()))
        return clock[-1][0] - clock[-2][0], clock[-1][1] - clock[-2][1]

    named_inputs = [(n, x) for n, x in zip(names, leaves) if is_tensor(x)]
    held = tensor_attributes(model)  # put back after the trial runs (attributes_kept)
    if check is None:  # buffers a forward fills once are filled before capture
        with _attention_fast_path_off():
            lazy.run_first_forward(model, args, kwargs, named_inputs)
    before = snapshot_state(model, named_inputs)
    meta = check is not None  # every run of the model is on fake tensors
    stamper = Stamper(model) if stamp else None
    runs = _Runs(stamper=stamper)
    # A meta model with lists of alike blocks runs cut to three blocks a list only: the whole
    # model's outputs are derived from the stamped graph (see _derived_capture).
    with attributes_kept(model, held) as stored, preserved_state(model, before), \
            runs.calls(model, meta), _attention_fast_path_off(), _own_generators_named(model):
        found = _derived_capture(method, model, args, kwargs, leaves, in_spec, names, tensors,
                                 batch_dims, before, leaf_modules, inline_modules, runs,
                                 stamper, lap) \
            if stamper is not None and stamper.runs and meta else None
        if found is None:
            cut = stamper.cut if stamper is not None and stamper.runs and meta else None
            layout, signature, layout_s = _laid_out(model, args, kwargs, leaves, in_spec, names,
                                                    batch_dims, before, cut, False, stamper, lap)
            gm, used, reason = _capture_with(method, model, signature, leaves, tensors, layout,
                                             leaf_modules, inline_modules, args, kwargs, runs,
                                             stamper)
        else:
            layout, signature, layout_s, gm, used, reason = found
        regions.inline_regions(gm)  # no_grad / autocast regions: marked operations
        front_s = lap()
        _annotate_shapes(gm, used, tensors, signature, runs)
    stored = [name for name in stored if name not in derived_attributes(model)]
    if stored:
        raise stored_error(model, stored)
    inlined = leaf_labels if used == "export" else ()
    if inlined:
        warnings.warn(f"leaf_modules ({', '.join(inlined)}) were traced through: torch.export "
                      f"has no leaf modules, and the fx trace, which keeps them whole, was not "
                      f"kept ({_first_line(reason or '')})", UserWarning, stacklevel=2)
    name_nodes_after_modules(gm)
    gm.meta.setdefault(ir.QUALNAMES, {})
    phases = (("batch_layout", layout_s), (f"{used}+check", front_s), ("shapes", lap()))
    checked = check_name(check) + (_DERIVED if found is not None else "")
    gm.meta[ir.CAPTURE] = CaptureInfo(used, method, reason, model.training, signature,
                                      layout.batch_size, inline_modules,
                                      tuple((k, wall) for k, (wall, _) in phases),
                                      checked, runs.fake,
                                      tuple((k, cpu) for k, (_, cpu) in phases),
                                      stamper.stamped if stamper else 0,
                                      stamper.note if stamper else None, runs.cut, inlined)
    return gm


@contextlib.contextmanager
def _own_generators_named(model: nn.Module) -> Iterator[None]:
    """A capture that fails on a model holding a torch.Generator of its own says so: its draws
    differ from run to run, so no graph matches the model run beside it (and a pipeline could
    not give each micro-batch the plain model's numbers), and export cannot take a symbolic
    size from one."""
    try:
        yield
    except CaptureError as error:
        held = [f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules()
                for name, value in vars(module).items() if isinstance(value, torch.Generator)]
        if not held:
            raise
        raise CaptureError(
            error.message,
            hint=f"{type(model).__name__} holds a torch.Generator of its own "
                 f"({', '.join(held[:3])}): draw from torch's default generator instead "
                 f"(generator=None), which a pipeline seeds per micro-batch as the plain model "
                 f"runs (README: \"Training semantics: what equals what\")"
                 + (f"; otherwise: {error.hint}" if error.hint else "")) from error


@contextlib.contextmanager
def _attention_fast_path_off() -> Iterator[None]:
    """The capture's runs of the model take the attention path its graph takes. In eval mode
    without gradients (the trial runs), nn.TransformerEncoder's fast path returns zeros at the
    positions src_key_padding_mask pads, where the traced layers compute values (as the plain
    model does with gradients): the graph would look wrong."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _leaf_label(leaf: LeafModule) -> str:
    """How a leaf_modules entry reads in a message: a type's or a module's class name, or the
    qualified name given."""
    if isinstance(leaf, type):
        return leaf.__name__
    return leaf if isinstance(leaf, str) else type(leaf).__name__


_DERIVED = ("; the whole model's output shapes derived from the stamped graph, the model run "
            "cut to three blocks a list")


def _laid_out(model: nn.Module, args: ModelArgs, kwargs: ModelKwargs, leaves: Sequence[Any],
              in_spec: pytree.TreeSpec, names: Sequence[str],
              batch_dims: Sequence[int | None] | None, before: StateSnapshot,
              cut: Callable[[], contextlib.AbstractContextManager[None]] | None, derive: bool,
              stamper: Stamper | None, lap: Callable[[], tuple[float, float]]
              ) -> tuple[BatchLayout, Signature, tuple[float, float]]:
    """The batch layout (fxpipe.frontend.batching), the signature, and the seconds they took."""
    with eager_runs(model):
        try:
            layout = infer_batch_layout(model, args, kwargs, leaves, batch_dims, before, cut,
                                        derive)
        except CaptureError:
            raise
        except Exception as error:  # noqa: BLE001 - the first run: on meta, what needs data
            if not is_meta_model(model):
                raise
            raise meta_run_error(model, error) from error
    signature = signature_of(leaves, in_spec, names, layout, model)
    if stamper is not None:
        stamper.outputs = len(signature.out_is_tensor)
    return layout, signature, lap()


def _derived_capture(method: str, model: nn.Module, args: ModelArgs, kwargs: ModelKwargs,
                     leaves: Sequence[Any], in_spec: pytree.TreeSpec, names: Sequence[str],
                     tensors: Sequence[torch.Tensor], batch_dims: Sequence[int | None] | None,
                     before: StateSnapshot, leaf_modules: Sequence[LeafModule], inline: bool,
                     runs: _Runs, stamper: Stamper, lap: Callable[[], tuple[float, float]]
                     ) -> tuple[BatchLayout, Signature, tuple[float, float], fx.GraphModule, str,
                                str | None] | None:
    """A meta model's capture without running it whole: the layout and the shape check's
    reference come from the model cut to three blocks a list. The stamped graph holds every
    block (each a copy of one traced block, which the last block's trace matched), and shape
    propagation through all of them must give those outputs' shapes; so when every list was
    stamped, the whole model's output shapes are the cut one's. None when a list was left whole
    or the capture failed: then the caller lays the whole model out as before."""
    layout, signature, layout_s = _laid_out(model, args, kwargs, leaves, in_spec, names,
                                            batch_dims, before, stamper.cut, True, stamper, lap)
    try:
        gm, used, reason = _capture_with(method, model, signature, leaves, tensors, layout,
                                         leaf_modules, inline, args, kwargs, runs, stamper)
    except CaptureError:
        return None
    if not stamper.stamped_every_list:
        return None
    return layout, signature, layout_s, gm, used, reason


_SHAPED = "fxpipe_shaped_by_check"  # gm.meta: ir.TENSOR written by _check_by_shapes


def _check_by_shapes(gm: fx.GraphModule, tensors: Sequence[torch.Tensor], signature: Signature,
                     layout: BatchLayout, runs: _Runs) -> str | None:
    """A meta model's fx graph checked by the shapes it propagates (which capture keeps), not by
    two runs more: what compare_with_eager compares on meta tensors, shapes and dtypes."""
    try:
        shapes.propagate_shapes(gm, tensors, signature.input_batch_dims)
    except Exception as error:  # noqa: BLE001 - a wrong trace may crash on other shapes
        first_line = str(error).splitlines()[0] if str(error) else ""
        return f"running it raised {type(error).__name__}: {first_line}"
    runs.fake += 1 + len(gm.meta[ir.SAMPLED]) - len(shapes.known_sampled(gm))
    gm.meta[_SHAPED] = True
    infos = {n: n.meta[ir.TENSOR] for n in gm.graph.nodes if n.op != "output"}
    return compare_shapes(gm, infos, layout)


def _annotate_shapes(gm: fx.GraphModule, used: str, tensors: Sequence[torch.Tensor],
                     signature: Signature, runs: _Runs) -> None:
    """ir.TENSOR on every node: from export's own symbolic values when they determine it (a
    run less), else by propagating shapes (each restart after a specialising kernel a run),
    unless the check propagated them already."""
    if gm.meta.pop(_SHAPED, False) and \
            all(ir.TENSOR in n.meta for n in gm.graph.nodes if n.op != "output"):
        return
    infos = shapes.export_infos(gm, signature.input_batch_dims) if used == "export" else None
    if infos is not None:
        shapes.write_infos(gm, infos, shapes.known_sampled(gm))
        return
    shapes.propagate_shapes(gm, tensors, signature.input_batch_dims)
    runs.fake += 1 + len(gm.meta[ir.SAMPLED]) - len(shapes.known_sampled(gm))


def _check_twin(check: Check, model: nn.Module, args: ModelArgs, kwargs: ModelKwargs,
                method: str, leaf_modules: Sequence[LeafModule], inline_modules: bool,
                batch_dims: Sequence[int | None] | None
                ) -> tuple[str, Sequence[int | None] | None]:
    """With a twin: captures it on the real example batch, checked against its eager outputs;
    the meta model then uses the front end and batch dimensions that passed on the twin."""
    if not isinstance(check, nn.Module):
        return method, batch_dims
    twin = capture(check, args, kwargs, method=method, leaf_modules=leaf_modules,
                   inline_modules=inline_modules, batch_dims=batch_dims)
    info: CaptureInfo = twin.meta[ir.CAPTURE]
    return info.method, info.signature.input_batch_dims


def _capture_with(method: str, model: nn.Module, signature: Signature, leaves: Sequence[Any],
                  tensors: Sequence[torch.Tensor], layout: BatchLayout,
                  leaf_modules: Sequence[LeafModule], inline: bool, args: ModelArgs,
                  kwargs: ModelKwargs, runs: _Runs,
                  stamper: Stamper | None = None) -> tuple[fx.GraphModule, str, str | None]:
    reason = None
    meta = is_meta_model(model)
    if method in ("auto", "fx"):
        try:
            def traced() -> fx.GraphModule:
                gm = tracers.trace_fx(model, signature, leaves, leaf_modules, inline)
                set_signature_codegen(gm, signature)
                return gm

            def fx_check(gm: fx.GraphModule) -> str | None:
                if meta and len(layout.eager_outputs) == 2:
                    return _check_by_shapes(gm, tensors, signature, layout, runs)
                with runs.calls(gm, meta):
                    return compare_with_eager(gm, model, signature, args, kwargs, layout)

            gm, problem = _stamped_or_whole(traced, fx_check, stamper)
            if problem is None:
                return gm, "fx", None
            if method == "fx":
                raise CaptureError(
                    f"the fx trace computes something else than the model: {problem}",
                    hint="use method='export' (or 'auto')")
            reason = f"fx trace differs from the eager model: {problem}"
        except CaptureError as e:
            if method == "fx":
                raise
            reason = e.message

    def exported() -> fx.GraphModule:
        gm = tracers.export(model, signature, leaves, tensors, layout,
                            follow_branches=method == "follow_branches")
        runs.add()
        set_signature_codegen(gm, signature)
        return gm

    def export_check(gm: fx.GraphModule) -> str | None:
        infos = shapes.export_infos(gm, signature.input_batch_dims) \
            if meta and len(layout.eager_outputs) == 2 else None
        if infos is not None:
            return compare_shapes(gm, infos, layout)
        with runs.calls(gm, meta):
            return compare_with_eager(gm, model, signature, args, kwargs, layout)

    gm, problem = _stamped_or_whole(exported, export_check, stamper)
    if problem is not None:
        raise CaptureError(f"the exported graph computes something else than the model: {problem}",
                           hint=regions.LOST_REGION_HINT if problem.startswith(regions.LOST_REGION)
                           else "please report this model; as a workaround capture a submodule")
    return gm, "export", reason


def _stamped_or_whole(front: Callable[[], fx.GraphModule],
                      check: Callable[[fx.GraphModule], str | None],
                      stamper: Stamper | None) -> tuple[fx.GraphModule, str | None]:
    """`front()` and what `check` finds wrong with its graph (None: nothing). With a stamper,
    the front end traces the reduced model and the stamped graph is checked against the whole
    model; a stamped graph that fails the check is dropped for a capture of the whole model."""
    if stamper is None:
        gm = front()
        return gm, check(gm)
    gm = stamper.capture(front)
    problem = check(gm)
    if problem is not None and stamper.stamped:
        stamper.refuse(f"the stamped graph computes something else than the model: {problem}")
        gm = front()
        problem = check(gm)
    return gm, problem


@contextlib.contextmanager
def preserved_state(model: nn.Module, before: StateSnapshot | None = None) -> Iterator[None]:
    """Restores training flags and buffers (BatchNorm statistics) after trial runs, including a
    buffer that forward replaced by another tensor, and the parameters and inputs `before`
    saved (a forward that writes them is refused, and leaves them as they were)."""
    buffers = [(m, name, b, b.detach().clone()) for m in model.modules()
               for name, b in m._buffers.items() if b is not None]
    try:
        with modes_kept(model):
            yield
    finally:
        with torch.no_grad():
            for m, name, b, saved in buffers:
                m._buffers[name] = b
                b.copy_(saved)
        if before is not None:
            restore_values(before)


def run_flat(gm: fx.GraphModule, tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """Runs a captured graph on its flat tensor leaves, returning the flat output leaves."""
    return tuple(fx.Interpreter(gm).run(*tensors, enable_io_processing=False))

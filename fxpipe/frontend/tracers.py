"""The two front ends of fxpipe.capture: torch.fx symbolic tracing and torch.export.

Both trace a flat root: a module that shares the model's children and parameters (so qualified
names are the model's) and takes the tensor leaves of the example inputs, returning the flat
leaves of the outputs. Attribute names that are not plain identifiers are aliased before fx
writes any code, so model text never reaches generated code outside a string literal.
"""
from __future__ import annotations

import contextlib
import io
import keyword
import logging
import re
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeAlias

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.experimental.symbolic_shapes import ShapeEnv, is_concrete_int

from fxpipe import ir, source
from fxpipe.errors import CaptureError
from fxpipe.frontend import branches
from fxpipe.frontend.batching import BatchLayout
from fxpipe.frontend.regions import ModeWatch
from fxpipe.runtime.execution.batchnorm import cumulative_batch_norm
from fxpipe.signature import Signature

__all__ = ["trace_fx", "export", "LeafModule", "refuse_scripted_modules"]

LeafModule: TypeAlias = type[nn.Module] | nn.Module | str
"""A module kept opaque under fx: its type, the instance, or its qualified name."""


def refuse_scripted_modules(model: nn.Module) -> None:
    """Raises CaptureError when `model` is or holds a TorchScript module: neither front end sees
    into one (fx cannot trace a script method, export keeps it as an opaque script object that
    no stage code can hold)."""
    scripted: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.jit.ScriptModule) \
                and not any(name.startswith(f"{outer}.") for outer in scripted):
            scripted.append(name)
    if scripted:
        more = f" (and {len(scripted) - 3} more)" if len(scripted) > 3 else ""
        raise CaptureError(
            f"{type(model).__name__} holds TorchScript modules "
            f"({', '.join(repr(n) if n else 'the model itself' for n in scripted[:3])}{more}, "
            f"made by torch.jit.script or torch.jit.trace): neither torch.fx nor torch.export "
            f"can see into one, so fxpipe cannot capture what it computes",
            hint="compile the model with its eager modules (before torch.jit.script/trace); "
                 "a pipeline runs the graph it captures, so scripting gains it nothing")


def _flat_root(model: nn.Module, signature: Signature, leaves: Sequence[Any]) -> nn.Module:
    """A module that shares `model`'s children and parameters (so qualified names are the
    model's) and whose forward takes the tensor leaves and returns the flat output leaves."""
    tensor_names = [leaf.name for leaf in signature.tensor_leaves]
    positions = [i for i, leaf in enumerate(signature.leaves) if leaf.is_tensor]
    in_spec = signature.in_spec
    n_out = len(signature.out_is_tensor)

    def impl(*tensors: torch.Tensor) -> tuple[Any, ...]:
        values = list(leaves)
        for pos, t in zip(positions, tensors):
            values[pos] = t
        args, kwargs = pytree.tree_unflatten(values, in_spec)
        out = model.forward(*args, **kwargs)
        flat = pytree.tree_leaves(out)
        if len(flat) == 1 and n_out > 1 and isinstance(flat[0], fx.Proxy):
            # fx.Proxy gains __getitem__ at run time (torch sets its magic methods in a loop)
            flat = [flat[0][i] for i in range(n_out)]  # type: ignore[index]
        return tuple(flat)

    params = ", ".join(tensor_names)
    src = f"def forward(self, {params}):\n    return impl({params})\n"
    namespace: dict[str, Any] = {"impl": impl}
    exec(compile(src, "<fxpipe flat root>", "exec"), namespace)  # names are sanitised identifiers
    root: nn.Module = type(type(model).__name__, (nn.Module,), {"forward": namespace["forward"]})()
    object.__setattr__(root, "_modules", model._modules)
    object.__setattr__(root, "_parameters", model._parameters)
    object.__setattr__(root, "_buffers", model._buffers)
    root.training = model.training
    return root


# NOTE [Buffers are graph values]
# fx's tracer hands a module's buffers to forward as the tensors themselves unless asked
# otherwise, so an operation on buffers alone (`self.mask == 0`, `self.inv_freq * self.scale`)
# runs once while tracing and its result is frozen into the graph as a constant: after
# `model.load_state_dict(...)` or any in-place change of those buffers the program would still
# run the old values. Buffers are proxies here, like parameters, so such operations are graph
# operations on the stages' own buffers. A forward that reads a buffer as a Python value
# (`range(self.table.shape[0])`, `if self.count > 0:`) cannot be traced so; it is traced again
# with buffers as tensors, as fx does by default, and such constants then stay.


class _Tracer(fx.Tracer):
    def __init__(self, leaf_modules: Sequence[LeafModule], inline: bool,
                 proxy_buffers: bool = True) -> None:
        super().__init__()
        self.record_stack_traces = True
        self.inline = inline
        self.proxy_buffer_attributes = proxy_buffers  # NOTE [Buffers are graph values]
        self.leaf_types = tuple(x for x in leaf_modules if isinstance(x, type))
        self.leaf_names = {x for x in leaf_modules if isinstance(x, str)}
        self.leaf_ids = {id(x) for x in leaf_modules if isinstance(x, nn.Module)}
        self.outside = ModeWatch.now()  # grad mode and autocast where tracing starts

    def create_proxy(self, kind: str, target: Callable[..., Any] | str, args: tuple[Any, ...],
                     kwargs: dict[str, Any], name: str | None = None, type_expr: Any | None = None,
                     proxy_factory_fn: Callable[[fx.Node], fx.Proxy] | None = None) -> fx.Proxy:
        """Records the grad-mode and autocast regions an operation runs in (fxpipe.frontend.
        regions): fx runs `with torch.no_grad():` while tracing and would keep only the ops."""
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr,
                                     proxy_factory_fn)
        mode = self.outside.mode() if kind.startswith("call_") else ()
        if mode:
            proxy.node.meta[ir.MODE] = mode
        return proxy

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if id(m) in self.leaf_ids or qualname in self.leaf_names or isinstance(m, self.leaf_types):
            return True
        return False if self.inline else super().is_leaf_module(m, qualname)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        if not isinstance(m, nn.modules.batchnorm._BatchNorm):
            return super().call_module(m, forward, args, kwargs)
        # Buffers read inside a BatchNorm (its own forward or a subclass's, like timm's
        # BatchNormAct2d) become graph values, so `self.num_batches_tracked.add_(1)` is an
        # operation of the graph instead of running once at trace time.
        proxied = self.proxy_buffer_attributes
        self.proxy_buffer_attributes = True
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self.proxy_buffer_attributes = proxied


def _batch_norm_forward(self: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """What _BatchNorm.forward computes, traceable: without its Python check of the input's rank
    (control flow on a proxy), and with momentum=None (a cumulative average) as one operation
    instead of `1 / float(num_batches_tracked)`, which neither front end can capture."""
    training_stats = self.training and self.track_running_stats
    if self.momentum is None and training_stats and self.running_mean is not None \
            and self.running_var is not None and self.num_batches_tracked is not None:
        args = (x, self.running_mean, self.running_var, self.weight, self.bias,
                self.num_batches_tracked, self.eps)
        if isinstance(x, fx.Proxy):  # one node, which deferred BatchNorm can recognise
            out: torch.Tensor = x.tracer.create_proxy(
                "call_function", cumulative_batch_norm, args, {})
            return out
        return cumulative_batch_norm(*args)
    if training_stats and self.num_batches_tracked is not None:
        self.num_batches_tracked.add_(1)
    use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
    keep_stats = not self.training or self.track_running_stats
    return torch.nn.functional.batch_norm(
        x, self.running_mean if keep_stats else None, self.running_var if keep_stats else None,
        self.weight, self.bias, use_batch_stats,
        0.0 if self.momentum is None else self.momentum, self.eps)


@contextlib.contextmanager
def traceable_batch_norm() -> Iterator[None]:
    """Installs _batch_norm_forward as every BatchNorm's forward (subclasses that call
    super().forward included) while a front end traces."""
    base = nn.modules.batchnorm._BatchNorm
    original = base.forward
    base.forward = _batch_norm_forward  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        base.forward = original  # type: ignore[method-assign]


def trace_fx(model: nn.Module, signature: Signature, leaves: Sequence[Any],
             leaf_modules: Sequence[LeafModule], inline: bool) -> fx.GraphModule:
    root = _flat_root(model, signature, leaves)
    tracer = _Tracer(leaf_modules, inline)
    try:
        with traceable_batch_norm(), _python_state_kept(model):
            try:
                graph = tracer.trace(root)
            except Exception:  # noqa: BLE001 - a buffer read as a Python value (NOTE above)
                tracer = _Tracer(leaf_modules, inline, proxy_buffers=False)
                graph = tracer.trace(root)
    except Exception as e:  # noqa: BLE001 - fx raises TraceError, TypeError, AttributeError ...
        where = source.from_exception(e)
        raise CaptureError(
            f"torch.fx cannot trace {type(model).__name__}: {type(e).__name__}: {e}"
            + (f"\n  at {where}" if where else ""),
            hint="use method='export' (or 'auto'), mark the submodule as a leaf with "
                 "leaf_modules=[...], or replace Python control flow on tensors with "
                 "torch.where/torch.cond",
        ) from e
    aliases = _alias_unsafe_targets(graph)
    if aliases:
        owner = {alias: _resolve_attr(root, qualname) for alias, qualname in aliases.items()}
        for node in graph.nodes:
            if (node.op in ("get_attr", "call_module") and isinstance(node.target, str)
                    and node.target not in owner):
                owner[node.target] = _resolve_attr(root, node.target)
        gm = fx.GraphModule(owner, graph, class_name=type(model).__name__)
    else:
        gm = fx.GraphModule(root, graph, class_name=type(model).__name__)
    gm.meta[ir.QUALNAMES] = aliases
    return gm


def _safe_path(target: str) -> bool:
    """Plain identifiers and ModuleList indices, which fx writes safely."""
    return all(part.isascii() and ((part.isidentifier() and not keyword.iskeyword(part))
                                   or part.isdigit()) for part in target.split("."))


def _alias_unsafe_targets(graph: fx.Graph) -> dict[str, str]:
    """Renames attributes whose qualified names are not plain identifiers (quotes, newlines,
    keywords, unicode) to safe aliases, so that no generated code ever contains model text
    outside a string literal; returns {alias: qualified name}."""
    aliases: dict[str, str] = {}
    by_target: dict[str, str] = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module") and not _safe_path(str(node.target)):
            target = str(node.target)
            if target not in by_target:
                cleaned = re.sub(r"\W", "_", target.encode("ascii", "replace").decode())
                by_target[target] = f"fxpipe_attr{len(by_target)}_{cleaned.strip('_')}"
                aliases[by_target[target]] = target
            node.target = by_target[target]
    return aliases


def _resolve_attr(root: nn.Module, target: str) -> object:
    obj: object = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def export(model: nn.Module, signature: Signature, leaves: Sequence[Any],
           tensors: Sequence[torch.Tensor], layout: BatchLayout, *,
           follow_branches: bool = False) -> fx.GraphModule:
    root = _flat_root(model, signature, leaves)
    attempts = [torch.export.Dim("batch", min=1), torch.export.Dim("batch", min=2),
                torch.export.Dim.AUTO]
    errors: list[Exception] = []
    ep: torch.export.ExportedProgram | None = None
    fixed: list[source.SourceLine] = []
    decisions: branches.Decisions | None = None
    tries = iter(attempts)
    dim = next(tries)
    while True:
        dynamic = tuple({bd: dim} if bd is not None else None for bd in layout.input_dims)
        try:
            with _quiet_export(), traceable_batch_norm(), _undecided_causal_masks(), \
                    _conversions_that_change_nothing(), _python_state_kept(model), \
                    _sizes_fixed(fixed), branches.following(decisions):
                ep = torch.export.export(root, tuple(tensors), dynamic_shapes=dynamic,
                                         strict=False)
            break
        except Exception as e:  # noqa: BLE001 - export raises many kinds
            errors.append(e)
            if _is_data_dependent(e):
                if follow_branches and decisions is None:  # again, the example's way
                    with _python_state_kept(model):
                        decisions = branches.record(root, model, tensors)
                    continue
                break  # another batch range will not help
            following = next(tries, None)
            if following is None:
                break
            dim = following
    if ep is None:
        error = errors[0]
        where = source.from_exception(error)
        if _is_data_dependent(error):
            raise _data_dependent_error(type(model).__name__, error, where,
                                        training=model.training) from error
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CaptureError(
            f"neither torch.fx nor torch.export can capture {type(model).__name__}: "
            f"{type(error).__name__}: {first}" + (f"\n  at {where}" if where else ""),
            hint=_PACKED_HINT if _ran_on_packed_sequence(error) else
            "data-dependent control flow (if on tensor values, .item(), nonzero) cannot be "
            "captured: rewrite it with torch.where or torch.cond, or move it out of forward",
        ) from error
    _refuse_fixed_batch(ep, type(model).__name__, layout, fixed)
    gm = ep.module()
    gm._forward_pre_hooks.clear()  # export's input-spec check; the signature checks instead
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
            gm.graph.erase_node(node)
    _bind_model_state(gm, model)
    gm.graph.eliminate_dead_code()
    return gm


_PACKED_HINT = (
    "an RNN over a PackedSequence (pack_padded_sequence) runs as many steps on each example as "
    "its length says, which no graph can hold: run it over the padded batch and read each "
    "example's last valid step with its length (out[torch.arange(n), lengths - 1]), or mask "
    "the padded steps")


def _ran_on_packed_sequence(error: BaseException) -> bool:
    """Whether a frame the error passed through held a PackedSequence."""
    tb = error.__traceback__
    while tb is not None:
        if any(isinstance(v, nn.utils.rnn.PackedSequence) for v in tb.tb_frame.f_locals.values()):
            return True
        tb = tb.tb_next
    return False


def _is_data_dependent(error: Exception) -> bool:
    return "data-dependent" in str(error) or "DataDependent" in type(error).__name__


def _data_dependent_error(model: str, error: Exception, where: source.SourceLine | None,
                          training: bool = False) -> CaptureError:
    """Says which line of the model decides on a tensor's values, and what to write instead;
    torch's symbolic expression (Eq(u0, 1): a value it cannot know while tracing) is a detail."""
    found = re.search(r"expression (.+?)(?: \(unhinted|\.?$)", str(error).splitlines()[0]
                      if str(error) else "")
    at = f"at {where}" if where else "in its forward (torch named no line of it)"
    detail = f"\n  detail: torch.export could not decide {found.group(1)}" if found else ""
    return CaptureError(
        f"{model} decides what to compute from the values in a tensor, which neither torch.fx "
        f"nor torch.export can capture (a pipeline runs the same operations for every batch)"
        f"\n  {at}{detail}",
        hint="rewrite that line without Python control flow on tensor values: torch.where to "
             "choose between values, torch.cond for two branches, or decide outside forward "
             "(if, bool(), .item() and nonzero on a tensor all read its values); where it is an "
             "`if` on a tensor that goes the same way on every batch (a guard against rare "
             "values, such as a clamp of non-finite ones), pass capture='follow_branches': the "
             "graph takes the example batch's way and checks it on every micro-batch"
             + ("; an `if` on a random draw in training (LayerDrop's `torch.rand([]) < p`) goes "
                "its own way on every step, so follow_branches would fail: set its probability "
                "to 0 (transformers: config.layerdrop = 0.0) or compile in eval mode"
                if training else ""))


@contextlib.contextmanager
def _sizes_fixed(found: list[source.SourceLine]) -> Iterator[None]:
    """Records the first model line where export turns a dynamic size (the batch: the only one
    asked for) into a number, which torch reports without the line."""
    original = ShapeEnv._set_replacement

    def record(self: ShapeEnv, a: Any, tgt: Any, msg: str) -> None:
        if not found and getattr(tgt, "is_Integer", False) and str(a).startswith("s"):
            where = source.from_stack_trace("".join(traceback.format_stack()))
            if where is not None:
                found.append(where)
        original(self, a, tgt, msg)

    ShapeEnv._set_replacement = record  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShapeEnv._set_replacement = original  # type: ignore[method-assign]


def _refuse_fixed_batch(ep: torch.export.ExportedProgram, model: str, layout: BatchLayout,
                        fixed: Sequence[source.SourceLine]) -> None:
    """A graph whose batch size export could keep only as a number runs on batches of that size
    alone, never on micro-batches: refused, naming the line that fixed it."""
    user = set(ep.graph_signature.user_inputs)
    values = [n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder" and n.name in user]
    static = [v for v, d in zip(values, layout.input_dims)
              if d is not None and isinstance(v, torch.Tensor) and is_concrete_int(v.shape[d])]
    if layout.batch_size < 2 or not static:
        return
    at = f"at {fixed[0]}" if fixed else "(torch named no line of it)"
    raise CaptureError(
        f"{model} fixes the number of samples while it computes, so its graph holds for "
        f"batches of {layout.batch_size} only and cannot run on micro-batches\n  {at}",
        hint="keep the batch a dimension of tensors on that line: x.flatten(0, 1) rather than "
             "torch.cat(list(x)), one operation on the whole batch rather than a Python loop "
             "over its samples (list(x), x.unbind(0), x.tolist() and len(x) make one value per "
             "sample, which fixes their number); or pipeline the part of the model after it")


@contextlib.contextmanager
def _python_state_kept(model: nn.Module) -> Iterator[None]:
    """Puts back the lists and dicts that modules keep as plain attributes, with their contents,
    after tracing. A model may pass values between its modules through such a shared list
    (MONAI's DynUNet: the skip layers write their deep-supervision heads into a list the top
    module reads); tracing writes traced values into it, and torch.export puts back a copy of
    the list in one module only, so the eager model afterwards read traced tensors instead of
    its own outputs."""
    kept: list[tuple[nn.Module, str, Any, Any]] = []
    for module in model.modules():
        for name, value in vars(module).items():
            if isinstance(value, list):
                kept.append((module, name, value, list(value)))
            elif isinstance(value, dict) and not name.startswith("_"):
                kept.append((module, name, value, dict(value)))
    try:
        yield
    finally:
        for module, name, container, contents in kept:
            container.clear()
            if isinstance(container, list):
                container.extend(contents)
            else:
                container.update(contents)
            module.__dict__[name] = container


@contextlib.contextmanager
def _undecided_causal_masks() -> Iterator[None]:
    """nn.Transformer asks whether a mask is causal by comparing its values, which export
    cannot decide on traced tensors (or decides with a data-dependent branch in the graph). The
    answer only selects a faster kernel, the mask is applied either way: while exporting, a
    mask is causal only when the caller says so (is_causal=True)."""
    module = torch.nn.modules.transformer
    original = module._detect_is_causal_mask

    def detect(mask: torch.Tensor | None, is_causal: bool | None = None,
               size: int | None = None) -> bool:
        return is_causal is True

    module._detect_is_causal_mask = detect
    try:
        yield
    finally:
        module._detect_is_causal_mask = original


@contextlib.contextmanager
def _conversions_that_change_nothing() -> Iterator[None]:
    """`module.to(dtype)` inside forward (Switch Transformers' router) makes export swap the
    module's parameters, which it cannot do while tracing. When every parameter and buffer has
    that dtype and device already, the call returns the module unchanged, as it would have left
    it; a real conversion still runs (and export reports it)."""
    original = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if memory_format is None and all(
                (device is None or t.device == device)
                and (dtype is None or not t.is_floating_point() or t.dtype == dtype)
                for t in tensors):
            return self
        return original(self, *args, **kwargs)

    nn.Module.to = to  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Keeps export's own diagnostics (partial graphs, LSTM weight warnings) off the console;
    failures are reported by CaptureError instead."""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.filterwarnings("ignore", message=".*(was|were) assigned during export.*")
            yield
    finally:
        logger.setLevel(level)


def _bind_model_state(gm: fx.GraphModule, model: nn.Module) -> None:
    """Points the graph's attributes at the model's own parameters and buffers (not copies)."""
    own: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    own.update(dict(model.named_buffers(remove_duplicate=False)))
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(node.target, str) and node.target in own:
            owner_path, _, attr = node.target.rpartition(".")
            owner = gm.get_submodule(owner_path) if owner_path else gm
            value = own[node.target]
            if isinstance(value, nn.Parameter):
                owner._parameters[attr] = value
            else:
                owner._buffers[attr] = value

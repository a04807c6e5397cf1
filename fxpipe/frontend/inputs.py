"""The model's example inputs as capture sees them: normalized to (args, kwargs), each leaf
named after the forward's parameters, and the Signature the captured graph is called with (its
code generator makes the flat-placeholder graph callable like the model)."""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.errors import ConfigError
from fxpipe.frontend.batching import BatchLayout
from fxpipe.signature import (
    LeafSpec,
    ModelArgs,
    ModelKwargs,
    Signature,
    forward_parameters,
    is_tensor,
)
from fxpipe.source import identifier

__all__ = ["normalize_inputs", "check_fits_forward", "input_names", "signature_of",
           "SignatureCodeGen", "set_signature_codegen"]

_RESERVED = frozenset({"self"})  # placeholder names of a forward(self, ...)


def normalize_inputs(example_inputs: Any,
                     example_kwargs: ModelKwargs | None) -> tuple[ModelArgs, ModelKwargs]:
    """(args, kwargs) from what the user passed: one tensor or a tuple/list, and a dict."""
    if example_inputs is None:
        raise ConfigError("capture needs example inputs", hint="pass a batch the model accepts")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise ConfigError(f"example_kwargs must be a dict (got {type(example_kwargs).__name__})",
                          hint="pass keyword inputs as example_kwargs={'name': value}")
    return args, dict(example_kwargs or {})


def check_fits_forward(model: nn.Module, args: ModelArgs, kwargs: ModelKwargs) -> None:
    """Refuses example inputs that forward's signature cannot take, before any run: the call
    would fail with a bare TypeError, often because a list meant as one input was taken as
    the positional inputs. Skipped where forward pre-hooks or another __call__ may change the
    call."""
    if type(model).__call__ is not nn.Module.__call__ or model._forward_pre_hooks:
        return
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        raise ConfigError(
            f"the example inputs do not fit {type(model).__name__}.forward{signature}: {error} "
            f"({len(args)} positional input(s), keywords {sorted(kwargs)})",
            hint="example_inputs is the tuple of positional inputs (a tensor alone is one) and "
                 "example_kwargs the keyword inputs; a forward taking one list or tuple takes "
                 "example_inputs=([x, y],)") from None


def input_names(model: nn.Module, args: ModelArgs, kwargs: ModelKwargs) -> list[str]:
    """Placeholder names from the forward signature: idx, targets, xs_0, xs_1 ..."""
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    positional = [params[i].name if i < len(params) else f"arg{i}" for i in range(len(args))]
    taken: set[str] = set()
    names: list[str] = []
    for label, value in [*zip(positional, args), *kwargs.items()]:
        leaves = pytree.tree_leaves(value)
        if len(leaves) == 1 and not isinstance(value, (tuple, list, dict)):
            names.append(identifier(label, taken, reserved=_RESERVED))
        else:
            names += [identifier(f"{label}_{i}", taken, reserved=_RESERVED)
                      for i in range(len(leaves))]
    return names


def signature_of(leaves: Sequence[Any], in_spec: pytree.TreeSpec, names: Sequence[str],
                 layout: BatchLayout, model: nn.Module | None = None) -> Signature:
    """How the graph is called: the inputs' structure, each leaf's name, shape (-1 along its
    batch dimension) or baked constant, the outputs' structure and batch dimensions, and the
    parameters of `model`'s forward (which bind a call that passes inputs otherwise)."""
    specs: list[LeafSpec] = []
    k = 0
    for name, leaf in zip(names, leaves):
        if is_tensor(leaf):
            bd = layout.input_dims[k]
            shape = tuple(-1 if d == bd else s for d, s in enumerate(leaf.shape))
            specs.append(LeafSpec(name, True, leaf.dtype, shape, bd))
            k += 1
        else:
            specs.append(LeafSpec(name, False, constant=leaf))
    try:
        forward = forward_parameters(inspect.signature(model.forward)) if model else None
    except (TypeError, ValueError):  # a forward without a signature inspect can read
        forward = None
    return Signature(in_spec, specs, layout.out_spec, layout.output_dims, layout.output_is_tensor,
                     forward)


class SignatureCodeGen(fx.graph.CodeGen):
    """Makes the GraphModule callable like the model: (args, kwargs) in, structured output out."""

    def __init__(self, signature: Signature) -> None:
        super().__init__()
        self.signature = signature

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, *,
                   expanded_def: bool = False) -> str:
        names = [v.split(":")[0].split("#")[0].strip() for v in free_vars if v != "self"]
        unpack = f"{', '.join(names)}, = " if names else ""
        return (f"def forward(self, *args, **kwargs){maybe_return_annotation}:\n"
                f"    {unpack}_fxpipe_signature.flatten_inputs(args, kwargs)")

    def generate_output(self, output_args: fx.node.Argument, *args: Any, **kwargs: Any) -> str:
        return f"return _fxpipe_signature.unflatten_outputs({output_args!r})"

    def additional_globals(self) -> list[tuple[str, Any]]:
        return [("_fxpipe_signature", self.signature)]

    def process_inputs(self, *args: Any) -> Any:
        return args

    def process_outputs(self, outputs: Any) -> Any:
        return outputs


def set_signature_codegen(gm: fx.GraphModule, signature: Signature) -> None:
    """Makes `gm` callable like the model (SignatureCodeGen) and regenerates its code."""
    gm.graph.set_codegen(SignatureCodeGen(signature))
    gm.recompile()

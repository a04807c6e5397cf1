"""Capturing a model built on the meta device: shapes and dtypes without a byte of data.

A model built under `torch.device("meta")` has parameters without storage, so capture cannot
compare the graph's outputs with the model's: there are no values. What it can do instead is
chosen explicitly (`check=`), never skipped silently:

    check=twin       a small instance of the same code on real tensors (fewer or narrower
                     layers, same forward): its graph is checked against its eager outputs on
                     the example batch, which also finds the batch dimension by separability;
                     the meta model is then captured with the front end that passed, and its
                     graph's output shapes and dtypes are checked against the meta model's
    check="shapes"   only the output shapes and dtypes are checked on the meta model, and the
                     batch dimension is the first candidate whose output shapes split with it

Operations that need values (`nonzero`, boolean masks, `.item()`) cannot run on meta tensors;
they are reported with the operation and the user's source line.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, TypeAlias

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpipe import ir, source
from fxpipe.errors import CaptureError, ConfigError
from fxpipe.untouched import seeded

__all__ = ["Check", "CHECKS", "is_meta_model", "to_meta", "run_on_meta", "eager_runs",
           "meta_run_error", "check_name", "validate_check", "has_meta_tensor"]

Check: TypeAlias = str | nn.Module | None
"""How a meta model's capture is checked: None (against eager, real models only), "shapes", or
a twin module on real tensors."""

CHECKS = ("shapes",)

_META_HINT = ("a model on the meta device has no values to compare: pass check=twin (a small "
              "instance of the same model class on the CPU, e.g. built with fewer layers, that "
              "accepts the same example inputs) to check the capture's values on it, or "
              "check='shapes' to check only output shapes and dtypes")


def is_meta_model(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is on the meta device."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def has_meta_tensor(values: Any) -> bool:
    return any(isinstance(x, torch.Tensor) and x.is_meta for x in pytree.tree_leaves(values))


def to_meta(values: Any) -> Any:
    """`values` with every tensor replaced by a meta tensor of its shape, dtype and grad flag."""

    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not x.is_meta:
            out = torch.empty_like(x, device="meta")
            return out.requires_grad_(x.requires_grad) if ir.differentiable(x) else out
        return x

    return pytree.tree_map(convert, values)


def validate_check(check: Check, model: nn.Module, example: Any) -> None:
    """Rejects a check that does not fit the model: explicit alternatives are for meta models."""
    meta = is_meta_model(model)
    if check is None:
        if meta:
            raise CaptureError(f"{type(model).__name__} is on the meta device, so capture cannot "
                               "check its graph against eager outputs", hint=_META_HINT)
        return
    if not meta:
        raise ConfigError(f"check={_describe(check)} is for models on the meta device, and "
                          f"{type(model).__name__} has real tensors",
                          hint="leave check unset: a real model is checked against its own "
                               "eager outputs")
    if isinstance(check, nn.Module):
        if is_meta_model(check):
            raise ConfigError(f"the twin {type(check).__name__} is on the meta device too",
                              hint="build the twin on the CPU, small enough to run there")
        if has_meta_tensor(example):
            raise ConfigError("the twin runs on the example inputs, and they are meta tensors",
                              hint="pass real example inputs (the meta model reads only their "
                                   "shapes and dtypes)")
        return
    if check not in CHECKS:
        raise ConfigError(f"unknown check {check!r}",
                          hint="use check=twin (an nn.Module) or check='shapes'")


def check_name(check: Check) -> str:
    """How the graph was checked, for CaptureInfo and the report."""
    if check is None:
        return "values against the eager model"
    if isinstance(check, nn.Module):
        return (f"values on the twin {type(check).__name__}; output shapes and dtypes on the "
                "meta model")
    return "output shapes and dtypes on the meta model (values not checked)"


def _describe(check: Check) -> str:
    return type(check).__name__ if isinstance(check, nn.Module) else repr(check)


_OP_IN_MESSAGE = re.compile(r"(torch\.\w+\(\)|Tensor\.\w+\(\)|aten\.[\w.]+)")


def eager_runs(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Where capture runs the model itself: as is for a real model; for a meta model under a
    fake mode, so that library code which skips value checks while tracing (Hugging Face's
    `is_tracing`) skips them here too, and data-dependent operations raise instead of guessing."""
    if not is_meta_model(model):
        return contextlib.nullcontext()
    return FakeTensorMode(allow_non_fake_inputs=True)


def run_on_meta(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Runs `model` on meta inputs, naming the operation and line that needs data if it fails."""
    try:
        with torch.no_grad(), seeded(0), eager_runs(model):
            return model(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - any failure here needs values or a device
        raise meta_run_error(model, error) from error


def meta_run_error(model: nn.Module, error: Exception) -> CaptureError:
    """Why `model` cannot run on meta inputs: the operation and line that need data."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    op = _OP_IN_MESSAGE.search(text)
    where = source.from_exception(error)
    return CaptureError(
        f"{type(model).__name__} cannot run on the meta device"
        + (f": {op.group(1)} needs the values of its input" if op else "")
        + f" ({type(error).__name__}: {first[:200]})"
        + (f"\n  at {where}" if where else ""),
        hint="meta tensors have shapes but no data: replace data-dependent operations "
             "(nonzero, boolean masks, .item(), if on tensor values) with shape-static ones "
             "(torch.where, masked arithmetic), or compile a model with real weights",
    )

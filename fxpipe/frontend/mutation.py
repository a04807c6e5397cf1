"""What a forward changes besides its outputs: state and inputs it writes in place.

A pipeline runs forward once per micro-batch, on stages that a graph describes. A buffer the
model updates in forward (`self.count += 1`, an EMA with `copy_`) would be updated once per
micro-batch, or not at all when the trace runs the update on the real tensor instead of recording
it, and an input written in place is written in micro-batch slices. Neither is what the plain
model does, so both are refused at capture time. BatchNorm's running statistics are the one
exception: the runtime knows them (per micro-batch, or once per batch with deferred_batch_norm).

A forward that stores a tensor carrying gradient on a module (`self.aux_loss = ...`, an auxiliary
loss the training loop adds) is refused too: the pipeline runs the captured graph, which returns
values and sets no attribute, so the attribute would keep what a compile-time run left, and a loss
that reads it would train on that stale value, every step. Whatever tensor a trial run stored is
put back as it was; one without gradient (a cache of positions) is not refused.

The version counter of a tensor counts its in-place writes, but not a write through `.data`
(which has a counter of its own), so parameters, buffers and inputs are also compared by value,
and by identity (an attribute reassigned in forward). The values saved for the comparison put
back what the trial forwards wrote: compiling never changes the caller's parameters.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from fxpipe.errors import CaptureError

__all__ = ["StateSnapshot", "snapshot_state", "check_unchanged", "restore_values",
           "batch_norm_statistics", "written", "tensor_attributes", "attributes_kept",
           "stored_error"]

_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def batch_norm_statistics(model: nn.Module) -> set[str]:
    """Qualified names of the BatchNorm running statistics, which forward may update."""
    names: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            names.update(f"{prefix}.{s}" if prefix else s for s in _STATISTICS)
    return names


@dataclass(frozen=True)
class StateSnapshot:
    """Parameters, buffers and input tensors as they were before a forward."""

    tensors: dict[str, tuple[torch.Tensor, int]]  # "buffer count" / "input x" -> (tensor, version)
    values: dict[str, torch.Tensor]  # values (not on the meta device), by the same key


def snapshot_state(model: nn.Module, inputs: Sequence[tuple[str, torch.Tensor]]) -> StateSnapshot:
    """Records the state of `model` and its named input tensors before a forward."""
    tensors: dict[str, tuple[torch.Tensor, int]] = {}
    values: dict[str, torch.Tensor] = {}
    skip = batch_norm_statistics(model)
    named = [*((f"parameter {n}", p) for n, p in model.named_parameters(remove_duplicate=True)),
             *((f"buffer {n}", b) for n, b in model.named_buffers(remove_duplicate=True)
               if n not in skip),
             *((f"input {n}", t) for n, t in inputs)]
    for key, t in named:
        if key in tensors:
            continue
        tensors[key] = (t, t._version)
        if not t.is_meta:
            values[key] = t.detach().clone()
    return StateSnapshot(tensors, values)


def restore_values(before: StateSnapshot) -> None:
    """Writes back the saved value of every tensor a forward since `before` changed."""
    with torch.no_grad():
        for key, saved in before.values.items():
            tensor = before.tensors[key][0].detach()
            if not torch.equal(saved, tensor):
                tensor.copy_(saved)


def written(model: nn.Module, before: StateSnapshot) -> list[str]:
    """The keys of `before` ("parameter w", "buffer count", "input x") that a forward since
    then wrote or reassigned."""
    now: dict[str, torch.Tensor] = {
        f"parameter {n}": p for n, p in model.named_parameters(remove_duplicate=True)}
    now.update({f"buffer {n}": b for n, b in model.named_buffers(remove_duplicate=True)})
    changed = []
    for key, (tensor, version) in before.tensors.items():
        current = tensor if key.startswith("input ") else now.get(key)
        if current is not tensor or tensor._version != version:
            changed.append(key)
            continue
        saved = before.values.get(key)
        if saved is not None and not torch.equal(saved, tensor.detach()) \
                and not (saved.is_floating_point() and _same_with_nan(saved, tensor.detach())):
            changed.append(key)
    return changed


def _same_with_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def check_unchanged(model: nn.Module, before: StateSnapshot) -> None:
    """Raises a CaptureError naming every input and state tensor the forward since `before`
    wrote (BatchNorm's running statistics excepted)."""
    changed = written(model, before)
    if not changed:
        return
    name = type(model).__name__
    inputs = [k.removeprefix("input ") for k in changed if k.startswith("input ")]
    if inputs:
        raise CaptureError(
            f"{name} modifies its input {', '.join(inputs)} in place (or through .data) in "
            "forward (the plain model writes into the caller's tensor on every call; a pipeline "
            "would write into micro-batch slices of it, stage by stage)",
            hint="compute a new tensor instead (x = x + 1 rather than x.add_(1) or x += 1, "
                 "F.relu(x) rather than inplace=True on an input)")
    state = ", ".join(changed)
    raise CaptureError(
        f"{name} updates its {state} in forward, in place or through .data (the plain model "
        "updates it once per call, on the whole batch; a pipeline runs forward once per "
        "micro-batch, so it would be updated once per micro-batch or not at all; compiling "
        "left it as it was)",
        hint="update it outside forward, e.g. in the training loop after program.step(...) "
             "(fxpipe reproduces only BatchNorm's running statistics, see deferred_batch_norm)")


_MODULE_OWN = frozenset(vars(nn.Module()))  # what every module holds: hooks, flags


def _attributes(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, Any]]:
    """Each module's own attributes (not those every module has), by qualified name:
    (name, module, attribute, value)."""
    for prefix, module in model.named_modules():
        for attr, value in list(vars(module).items()):
            if attr not in _MODULE_OWN:
                yield f"{prefix}.{attr}" if prefix else attr, module, attr, value


def tensor_attributes(model: nn.Module) -> dict[str, tuple[nn.Module, str, Any]]:
    """What the model's modules hold as plain attributes (neither parameters nor buffers) that
    is a tensor or None, by qualified name: (module, attribute, value)."""
    return {name: (module, attr, value) for name, module, attr, value in _attributes(model)
            if value is None or isinstance(value, torch.Tensor)}


@contextlib.contextmanager
def attributes_kept(model: nn.Module, held: dict[str, tuple[nn.Module, str, Any]]
                    ) -> Iterator[list[str]]:
    """Puts back, on the way out (an error's too), each plain attribute that the forwards since
    `held` (tensor_attributes before them) set to another tensor, or to an fx Proxy (a trace's);
    fills the list it yields with those that carry gradient, for stored_error."""
    stored: list[str] = []
    try:
        yield stored
    finally:
        for name, module, attr, value in _attributes(model):
            if not isinstance(value, (torch.Tensor, fx.Proxy)):
                continue
            was = held.get(name)
            if was is not None and was[2] is value:
                continue
            if was is not None:
                setattr(module, attr, was[2])
            else:
                delattr(module, attr)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                stored.append(name)


def stored_error(model: nn.Module, stored: Sequence[str]) -> CaptureError:
    """The error for a forward that stored tensors carrying gradient on modules (`stored`)."""
    return CaptureError(
        f"{type(model).__name__}'s forward stores a tensor that carries gradient on a module "
        f"({', '.join(stored)}; e.g. an auxiliary loss for the training loop to add): a "
        "pipeline runs the captured graph, which returns values and sets no attribute, so it "
        "would keep what a compile-time run left, and a loss reading it would train on that "
        "stale value (compiling put it back as it was)",
        hint="return it from forward as one more output: the loss function gets it with the "
             "others, e.g. program.step(x, target=y, loss_fn=lambda out, t: "
             "task_loss(out[0], t) + out[1])")

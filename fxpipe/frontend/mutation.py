"""What a forward changes besides its outputs: state and inputs it writes in place.

A pipeline runs forward once per micro-batch, on stages that a graph describes. A buffer the
model updates in forward (`self.count += 1`, an EMA with `copy_`) would be updated once per
micro-batch, or not at all when the trace runs the update on the real tensor instead of recording
it, and an input written in place is written in micro-batch slices. Neither is what the plain
model does, so both are refused at capture time. BatchNorm's running statistics are the one
exception: the runtime knows them (per micro-batch, or once per batch with deferred_batch_norm).

The version counter of a tensor counts its in-place writes, so comparing counters before and
after one eager forward finds every write without copying the parameters; buffers are also
compared by value (a write through `.data` does not count) and by identity (an attribute
reassigned in forward).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fxpipe.errors import CaptureError

__all__ = ["StateSnapshot", "snapshot_state", "check_unchanged", "batch_norm_statistics"]

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
    values: dict[str, torch.Tensor]  # buffer values (not on the meta device), by the same key


def snapshot_state(model: nn.Module, inputs: Sequence[tuple[str, torch.Tensor]]) -> StateSnapshot:
    """Records the state of `model` and its named input tensors before a forward."""
    tensors: dict[str, tuple[torch.Tensor, int]] = {}
    values: dict[str, torch.Tensor] = {}
    skip = batch_norm_statistics(model)
    for name, p in model.named_parameters(remove_duplicate=True):
        tensors[f"parameter {name}"] = (p, p._version)
    for name, b in model.named_buffers(remove_duplicate=True):
        if name in skip:
            continue
        tensors[f"buffer {name}"] = (b, b._version)
        if not b.is_meta:
            values[f"buffer {name}"] = b.detach().clone()
    for name, t in inputs:
        tensors.setdefault(f"input {name}", (t, t._version))
    return StateSnapshot(tensors, values)


def _changed(model: nn.Module, before: StateSnapshot) -> list[str]:
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
        if saved is not None and not torch.equal(saved, tensor.detach()):
            changed.append(key)
    return changed


def check_unchanged(model: nn.Module, before: StateSnapshot) -> None:
    """Raises a CaptureError naming every input and state tensor the forward since `before`
    wrote (BatchNorm's running statistics excepted)."""
    changed = _changed(model, before)
    if not changed:
        return
    name = type(model).__name__
    inputs = [k.removeprefix("input ") for k in changed if k.startswith("input ")]
    if inputs:
        raise CaptureError(
            f"{name} modifies its input {', '.join(inputs)} in place in forward (the plain model "
            "writes into the caller's tensor on every call; a pipeline would write into "
            "micro-batch slices of it, stage by stage)",
            hint="compute a new tensor instead (x = x + 1 rather than x.add_(1) or x += 1, "
                 "F.relu(x) rather than inplace=True on an input)")
    state = ", ".join(changed)
    raise CaptureError(
        f"{name} updates its {state} in forward (the plain model updates it once per call, on "
        "the whole batch; a pipeline runs forward once per micro-batch, so it would be updated "
        "once per micro-batch or not at all)",
        hint="update it outside forward, e.g. in the training loop after program.step(...) "
             "(fxpipe reproduces only BatchNorm's running statistics, see deferred_batch_norm)")

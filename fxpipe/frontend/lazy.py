"""Buffers a model fills on its first forward: that one-time initialisation runs before capture.

Some models build a buffer in their first forward, once the input's size is known, and never
again (timm's ConViT replaces `rel_indices` by the relative positions of its patches). A pipeline
runs forward once per micro-batch, so a forward that writes state is refused
(fxpipe.frontend.mutation) unless the write is done before capture. So the model is run once, as
the caller's own first call would run it (without gradients, in its own mode); when that call
wrote buffers and nothing else, a second call must write nothing. Then the model keeps what its
first forward wrote into those buffers, and only that (parameters, inputs, other buffers,
BatchNorm statistics, training flags and the random state are as they were), and the graph is
captured from it. A buffer written again on the second call (a step counter, a KV cache) is put
back as it was, and capture refuses it as before (the buffers filled once stay filled, as after
the model's own first call); a forward that writes a parameter or an input is put back whole.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fxpipe.frontend.mutation import (
    StateSnapshot,
    batch_norm_statistics,
    restore_values,
    snapshot_state,
    written,
)
from fxpipe.signature import ModelArgs, ModelKwargs
from fxpipe.untouched import modes_kept, seeded

__all__ = ["run_first_forward"]


@dataclass(frozen=True)
class _Slot:
    """A buffer attribute as it was: the tensor in it (or None), its version and a copy."""

    owner: nn.Module
    attr: str
    tensor: torch.Tensor | None
    version: int
    value: torch.Tensor | None


def _slots(model: nn.Module) -> dict[str, _Slot]:
    """Every buffer attribute by qualified name, BatchNorm statistics and None ones included."""
    slots: dict[str, _Slot] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, b in module._buffers.items():
            name = f"{prefix}.{attr}" if prefix else attr
            if name not in slots:
                slots[name] = _Slot(module, attr, b, 0 if b is None else b._version,
                                    None if b is None else b.detach().clone())
    return slots


def _filled(before: dict[str, _Slot], model: nn.Module) -> list[str]:
    """The buffers a forward since `before` wrote, reassigned or added (BatchNorm's running
    statistics, which the runtime reproduces, excepted)."""
    statistics = batch_norm_statistics(model)
    now = _slots(model)
    names = []
    for name, slot in now.items():
        was = before.get(name)
        if name in statistics:
            continue
        if was is None or slot.tensor is not was.tensor or slot.version != was.version or (
                was.value is not None and slot.value is not None
                and not torch.equal(was.value, slot.value)):
            names.append(name)
    return names


def _put_back(before: dict[str, _Slot], keep: Sequence[str]) -> None:
    """Every buffer attribute but `keep` holds its old tensor with its old value again."""
    with torch.no_grad():
        for name, was in before.items():
            if name in keep:
                continue
            was.owner._buffers[was.attr] = was.tensor
            if was.tensor is not None and was.value is not None \
                    and not torch.equal(was.value, was.tensor):
                was.tensor.copy_(was.value)


def _without_buffers(state: StateSnapshot, names: Sequence[str]) -> StateSnapshot:
    keys = {f"buffer {n}" for n in names}
    return StateSnapshot({k: v for k, v in state.tensors.items() if k not in keys},
                         {k: v for k, v in state.values.items() if k not in keys})


def run_first_forward(model: nn.Module, args: ModelArgs, kwargs: ModelKwargs,
                      inputs: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """Runs the model's first forward when it fills buffers once, keeping them; returns their
    names. Buffers written again on a second call are put back, for capture to refuse them;
    when forward writes a parameter or an input the model is put back whole."""
    state = snapshot_state(model, inputs)
    slots = _slots(model)
    kept: list[str] = []
    try:
        with torch.no_grad(), seeded(0), modes_kept(model):
            model(*args, **kwargs)
            filled = _filled(slots, model)
            beyond = [k for k in written(model, state) if not k.startswith("buffer ")]
            if filled and not beyond:
                second, second_slots = snapshot_state(model, inputs), _slots(model)
                model(*args, **kwargs)
                if not [k for k in written(model, second) if not k.startswith("buffer ")]:
                    again = {*_filled(second_slots, model),
                             *(k.removeprefix("buffer ") for k in written(model, second))}
                    kept = [name for name in filled if name not in again]
    finally:
        _put_back(slots, keep=kept)
        restore_values(_without_buffers(state, kept))
    return kept

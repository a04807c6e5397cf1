"""The tensors of the stages one process holds, read from a checkpoint by the model's names.

Shared by `Program.load_weights` and a written program's `--weights`: both know, for each tensor
a stage binds, its qualified name, the model's state_dict keys for it
(fxpipe.storage.state.StateNames) and a template (a meta or real tensor with the shape, dtype and
requires_grad it must have).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
from torch import nn

from fxpipe.errors import CheckpointError
from fxpipe.storage.weights import WeightsSource, match_names

__all__ = ["load_named", "like"]


def like(value: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """`value` as a Parameter if `template` is one (with its requires_grad), else as is."""
    if isinstance(template, nn.Parameter):
        return nn.Parameter(value, requires_grad=template.requires_grad)
    return value


def load_named(source: WeightsSource, templates: Mapping[str, torch.Tensor],
               keys: Mapping[str, tuple[str, ...]], devices: Mapping[str, torch.device], *,
               known: Collection[str], strict: bool = True) -> dict[str, torch.Tensor]:
    """Reads each of `templates` (qualified name -> template) onto its device, in the
    template's dtype; a tensor that templates share under several names is read once.

    keys: the model's state_dict keys of every tensor of the model, not only these: the
    checkpoint is checked against all of them, so every process reports every missing name.
    known: every state_dict key of the model (a checkpoint name outside it is an error when
    strict).

    Raises CheckpointError naming missing and extra names and every shape that differs.
    """
    chosen = match_names(source.keys(), keys, known, strict=strict)
    wrong = [f"{chosen[q]} is {list(source.shapes[chosen[q]])} in the checkpoint, "
             f"{list(t.shape)} in the model"
             for q, t in sorted(templates.items()) if source.shapes[chosen[q]] != tuple(t.shape)]
    if wrong:
        raise CheckpointError(f"{len(wrong)} tensors of the checkpoint have other shapes than "
                              f"the model's: {'; '.join(wrong[:8])}",
                              hint="load a checkpoint of this model's configuration")
    out: dict[str, torch.Tensor] = {}
    read: dict[int, torch.Tensor] = {}
    for name, template in templates.items():
        if id(template) not in read:
            value = source.read(chosen[name], devices[name], template.dtype)
            read[id(template)] = like(value, template)
        out[name] = read[id(template)]
    return out

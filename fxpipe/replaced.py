"""A model tensor replaced after compiling (`model.fc.weight = nn.Parameter(...)`,
`model.load_state_dict(state, assign=True)`, two weights tied after the fact): the stages hold
the tensors the model had when the program was built, so they would run and train the old one
while the model's new one got no gradient. Every call compares the slots the stages' tensors
came from with what the model holds there now (one reference comparison per tensor, no
function call) and refuses a replaced one, naming it. Values changed in place (`copy_`,
`load_state_dict` without `assign`, an optimizer's step, `model.to(dtype)`) are the stages'
own and need no check."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from fxpipe.errors import ConfigError
from fxpipe.storage.state import StateNames

__all__ = ["ModelSlots"]


@dataclass(frozen=True)
class ModelSlots:
    """Where the stages' tensors sit in the model: (the owning module's `_parameters` or
    `_buffers`, the attribute, the tensor the stages hold, its state_dict key)."""

    slots: tuple[tuple[Mapping[str, torch.Tensor | None], str, torch.Tensor, str], ...] = ()

    @staticmethod
    def of(model: nn.Module, names: StateNames, held: Mapping[str, torch.Tensor]) -> ModelSlots:
        """The slots of `model` that hold one of the stages' tensors (`held`, by the graph's
        qualified names; `names` maps them to the model's keys, a tied tensor to each). A
        stage tensor that is not the model's (a copy on another device, a shard, one on the
        meta device waiting for weights) has no slot: replacing the model's changes nothing the
        stages run, and the program's own checks cover it."""
        slots: list[tuple[Mapping[str, torch.Tensor | None], str, torch.Tensor, str]] = []
        for qualname, tensor in held.items():
            if tensor.is_meta:
                continue
            for key in names.keys.get(qualname, ()):
                path, _, attribute = key.rpartition(".")
                try:
                    module = model.get_submodule(path)
                except AttributeError:
                    continue
                for table in (module._parameters, module._buffers):
                    if table.get(attribute) is tensor:
                        slots.append((table, attribute, tensor, key))
        return ModelSlots(tuple(slots))

    def replaced(self) -> ConfigError | None:
        """The error to raise when a slot holds another tensor now, or None."""
        changed = [key for table, attribute, tensor, key in self.slots
                   if attribute not in table or table[attribute] is not tensor]
        if not changed:
            return None
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        return ConfigError(
            f"the model's {changed[0]}{more} was replaced by another tensor after compiling "
            f"(an assignment such as model.{changed[0]} = nn.Parameter(...), or "
            f"load_state_dict(..., assign=True)); the program's stages hold the one it was "
            f"compiled with, so they would train that one and the model's new one would get "
            f"no gradient",
            hint="change values in place (with torch.no_grad(): param.copy_(new), or "
                 "load_state_dict(state) without assign=True), or put the compiled tensor back; "
                 "to tie or replace weights, do it before fxpipe.compile")

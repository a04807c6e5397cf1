"""A model tensor or module replaced after compiling (`model.fc.weight = nn.Parameter(...)`,
`model.load_state_dict(state, assign=True)`, two weights tied after the fact, a new head
`model.fc = nn.Linear(...)`): the stages hold the tensors the model had when the program was
built and run the graph captured from its modules, so they would run and train the old ones
while the model's new ones got no gradient. Every call compares the slots the stages' tensors
came from with what the model holds there now (one reference comparison per tensor, no
function call), and each module's children with those it had (`dict.get` mapped over every
child in C, no Python call per module), and refuses a replaced one, naming it. Values changed
in place (`copy_`, `load_state_dict` without `assign`, an optimizer's step, `model.to(dtype)`)
are the stages' own and need no check."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

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
    # per module with children: its name, its `_modules`, their names and the children
    children: tuple[tuple[str, dict[str, nn.Module | None], tuple[str, ...],
                          tuple[nn.Module | None, ...]], ...] = ()
    _tables: tuple[dict[str, nn.Module | None], ...] = field(init=False, repr=False,
                                                            compare=False)
    _keys: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _expected: list[nn.Module | None] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rows = [(table, key, kid) for _, table, keys, kids in self.children
                for key, kid in zip(keys, kids)]
        object.__setattr__(self, "_tables", tuple(t for t, _, _ in rows))
        object.__setattr__(self, "_keys", tuple(k for _, k, _ in rows))
        object.__setattr__(self, "_expected", [kid for _, _, kid in rows])

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
        children = tuple((name, module._modules, tuple(module._modules),
                          tuple(module._modules.values()))
                         for name, module in model.named_modules() if module._modules)
        return ModelSlots(tuple(slots), children)

    def replaced(self) -> ConfigError | None:
        """The error to raise when a slot holds another tensor, or a module another child,
        now; or None."""
        # each child where it was: dict.get mapped in C (no Python call per module), and
        # modules compare by identity (a deleted one is None)
        if list(map(dict.get, self._tables, self._keys)) != self._expected:
            return self._replaced_module()
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

    def _replaced_module(self) -> ConfigError:
        changed = [(f"{name}.{key}" if name else key, key not in table)
                   for name, table, keys, kids in self.children
                   for key, kid in zip(keys, kids) if table.get(key) is not kid]
        (first, deleted), more = changed[0], len(changed) - 1
        return ConfigError(
            f"the model's submodule {first}{f' (and {more} more)' if more else ''} was "
            f"{'deleted' if deleted else 'replaced by another module'} after compiling (an "
            f"assignment such as model.{first} = nn.Linear(...)); the program runs the graph "
            f"captured from the one it was compiled with and its stages hold that one's "
            f"weights, so they would run and train it while the model's new one got no "
            f"gradient",
            hint="replace modules (a new head, another activation) before fxpipe.compile, or "
                 "compile again: fxpipe.compile(model, ...); putting the compiled module back "
                 "runs the program again")


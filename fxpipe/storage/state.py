"""The one mapping between the tensors a pipeline's stages hold and the model's state_dict names.

A stage binds each parameter and buffer under the model's qualified name of the graph attribute
it reads (`StageModule.PARAMETERS`). The model's `state_dict()` may know that tensor by several
keys (a tied weight: `wte.weight` and `lm_head.weight`), or not at all (a constant the capture
lifted). `StateNames` records, for every graph tensor that is model state, all its keys, the
first one being the key checkpoints and optimizer state use. A program in memory builds it from
the model; a written program reads it back from program.json.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.fx import GraphModule

from fxpipe import ir
from fxpipe.sharding import shard_like, whole

__all__ = ["StateNames", "HoldsModelTensors", "graph_tensors"]


class HoldsModelTensors(Protocol):
    """A stage as the naming sees it (fxpipe.runtime.stage.StageModule is one)."""

    def named_model_tensors(self) -> dict[str, torch.Tensor]: ...


def graph_tensors(gm: GraphModule) -> dict[str, torch.Tensor]:
    """The captured graph's parameters, buffers and constants by the model's qualified names."""
    out: dict[str, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            owner, _, name = str(node.target).rpartition(".")
            value = getattr(gm.get_submodule(owner) if owner else gm, name)
            if isinstance(value, torch.Tensor):
                out[ir.qualname(gm, str(node.target))] = value
    return out


@dataclass(frozen=True)
class StateNames:
    """Graph qualified name -> the model's state_dict keys for that tensor (first: canonical)."""

    keys: Mapping[str, tuple[str, ...]]

    @staticmethod
    def of_model(model: nn.Module, gm: GraphModule) -> StateNames:
        """The names `model.state_dict()` gives the tensors of the captured graph `gm`."""
        by_id: dict[int, list[str]] = {}
        for key, value in model.state_dict(keep_vars=True).items():
            by_id.setdefault(id(value), []).append(key)
        return StateNames({q: tuple(by_id[id(t)]) for q, t in sorted(graph_tensors(gm).items())
                           if id(t) in by_id})

    def merged(self, other: StateNames) -> StateNames:
        """These names and `other`'s (a plan of another mode or shape names the tensors it
        reads, which this one may not)."""
        return StateNames({**other.keys, **self.keys})

    @staticmethod
    def from_json(data: Mapping[str, Iterable[str]]) -> StateNames:
        return StateNames({str(q): tuple(str(k) for k in keys) for q, keys in data.items()})

    def to_json(self) -> dict[str, list[str]]:
        return {q: list(keys) for q, keys in sorted(self.keys.items())}

    def exceptions(self) -> dict[str, list[str]]:
        """The tensors not named by their own state_dict key alone (tied, or bound under
        another name): what a written program records, the rest following from the model's
        keys (`completed`)."""
        return {q: list(keys) for q, keys in sorted(self.keys.items()) if keys != (q,)}

    @staticmethod
    def completed(exceptions: Mapping[str, Iterable[str]], state_keys: Iterable[str]
                  ) -> StateNames:
        """`exceptions` with every state_dict key that none of them takes naming itself."""
        keys = {str(q): tuple(str(k) for k in ks) for q, ks in exceptions.items()}
        taken = set(keys).union(*keys.values())
        return StateNames({**{k: (k,) for k in state_keys if k not in taken}, **keys})

    def state_dict(self, modules: Iterable[HoldsModelTensors]) -> dict[str, torch.Tensor]:
        """Every state_dict key of the model that these stages hold, with the stage's tensor
        (whole: a shard="full" stage's parameters are gathered, collectively over its
        replicas)."""
        out: dict[str, torch.Tensor] = {}
        for qualname, tensor in _named(modules).items():
            keys = self.keys.get(qualname, ())
            if keys:
                tensor = whole(tensor)
            for key in keys:
                out[key] = tensor
        return out

    def canonical(self, modules: Iterable[HoldsModelTensors]) -> dict[int, str]:
        """id(stage tensor) -> its canonical state_dict key (optimizer state is keyed by it)."""
        out: dict[int, str] = {}
        for qualname, tensor in _named(modules).items():
            keys = self.keys.get(qualname)
            if keys:
                out.setdefault(id(tensor), keys[0])
        return out

    def load(self, modules: Iterable[HoldsModelTensors],
             state: Mapping[str, torch.Tensor]) -> list[str]:
        """Copies `state` (model keys) into the stages' tensors; returns the keys it used."""
        used: list[str] = []
        with torch.no_grad():
            for qualname, tensor in _named(modules).items():
                for key in self.keys.get(qualname, ()):
                    if key in state:
                        tensor.copy_(shard_like(state[key], tensor))
                        used.append(key)
                        break
        return used


def _named(modules: Iterable[HoldsModelTensors]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        out.update(module.named_model_tensors())
    return out

"""Real tensors for the stages one process holds, from a model built on the meta device.

`initialize` gives the model's tensors named by a stage real storage on the stage's device and
fills them with the model's own initializers, module by module: every module that holds one of
them directly gets empty tensors for all it holds directly, then each such module and each of
its ancestors runs `reset_parameters()` (children first, as construction does), then the root's
`_init_weights(module)` (the Hugging Face convention), each call with a seed derived from the
module's qualified name. So a tensor's value depends on the seed and its module, never on which
stage holds it, and no tensor of another stage is allocated. The model itself stays on meta: the
initializers run on a view of it whose tensors are the new ones.

Initialization is checked, not trusted: a requested tensor that no initializer writes
(a buffer computed in `__init__`, which no initializer recomputes) is an error naming it, and so
is an initializer that draws random numbers for tensors of several stages (its draws for the
others are skipped on meta, which would make this stage's values depend on the partition).
"""
from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe.errors import CheckpointError
from fxpipe.untouched import seeded

__all__ = ["initialize", "seed_for", "meta_names"]


def seed_for(seed: int, qualname: str, phase: str) -> int:
    """The RNG seed of one initializer call: a stable hash of the base seed, module and phase."""
    digest = hashlib.sha256(f"{seed}\0{qualname}\0{phase}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def meta_names(named: Mapping[str, torch.Tensor]) -> list[str]:
    return sorted(name for name, t in named.items() if t.is_meta)


@dataclass
class _Call:
    """What one initializer call wrote."""

    real: set[int] = field(default_factory=set)  # storages of real tensors it wrote
    drew_on_meta: bool = False  # it drew random numbers for a tensor that has no storage here


class _WriteRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch unannotated
    """Records the tensors each initializer call writes (in place, or through a view)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.call = _Call()

    def __torch_dispatch__(self, func: OpOverload[..., Any], types: Sequence[type],
                           args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                           ) -> Any:
        kwargs = kwargs or {}
        random = torch.Tag.nondeterministic_seeded in func.tags
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            for t in pytree.tree_leaves(value):
                if isinstance(t, torch.Tensor):
                    if t.is_meta:
                        self.call.drew_on_meta |= random
                    else:
                        self.call.real.add(_storage(t))
        return func(*args, **kwargs)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def initialize(model: nn.Module, tensors: Mapping[str, torch.Tensor], device: torch.device, *,
               seed: int = 0) -> dict[str, torch.Tensor]:
    """Real copies of `tensors` (the model's own, by qualified name) on `device`.

    Meta tensors are created empty and filled by the model's initializers (see the module
    docstring); tensors that already have values (a buffer built on a real device inside the
    meta model, a constant of the graph) are copied. Parameters come back as nn.Parameter with
    the original's requires_grad, buffers as plain tensors.
    """
    wanted = {id(t): name for name, t in tensors.items() if t.is_meta}
    order = _post_order(model)
    owners = [(q, m) for q, m in order if any(id(t) in wanted for t in _direct(m))]
    held = {id(t) for _, m in owners for t in _direct(m)}
    orphans = sorted(name for key, name in wanted.items() if key not in held)
    if orphans:
        raise CheckpointError(f"{_names(orphans)} are on the meta device and no module of "
                              f"{type(model).__name__} holds them, so nothing can initialize them",
                              hint="build them on a real device, or load them from weights")
    real: dict[int, torch.Tensor] = {}
    for _, module in owners:
        for t in _direct(module):
            if t.is_meta and id(t) not in real:
                real[id(t)] = _like(torch.empty_like(t, device=device), t)
    if wanted:
        _run_initializers(model, order, owners, real, wanted, device, seed)
    return {name: real[id(t)] if t.is_meta else _like(t.detach().to(device, copy=True), t)
            for name, t in tensors.items()}


def _like(value: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """`value` as a Parameter if `original` is one (same requires_grad), else as is."""
    if isinstance(original, nn.Parameter):
        return nn.Parameter(value, requires_grad=original.requires_grad)
    return value


def _run_initializers(model: nn.Module, order: list[tuple[str, nn.Module]],
                      owners: list[tuple[str, nn.Module]], real: dict[int, torch.Tensor],
                      wanted: dict[int, str], device: torch.device, seed: int) -> None:
    """Runs reset_parameters, then the root's _init_weights, on the view of every owner and
    ancestor; checks that each wanted tensor was written, by no partition-dependent call."""
    view = _view(model, real)
    owner_paths = {q for q, _ in owners}
    involved = [(q, view[id(m)]) for q, m in order
                if any(o == q or not q or o.startswith(q + ".") for o in owner_paths)]
    init_weights = getattr(model, "_init_weights", None)
    storage_of = {_storage(real[key]): name for key, name in wanted.items()
                  if real[key].numel()}  # an empty tensor has nothing to write
    written: set[int] = set()
    recorder = _WriteRecorder()
    for phase in ("reset_parameters", "_init_weights"):
        for qualname, module in involved:
            if phase == "reset_parameters":
                fn = getattr(module, "reset_parameters", None) or \
                    getattr(module, "_reset_parameters", None)
                call = fn if callable(fn) else None
            else:
                call = (lambda m=module: init_weights(m)) if callable(init_weights) else None
            if call is None:
                continue
            recorder.call = _Call()
            with seeded(seed_for(seed, qualname, phase)), torch.no_grad(), recorder:
                call()
            mine = recorder.call.real & storage_of.keys()
            if mine and recorder.call.drew_on_meta:
                raise CheckpointError(
                    f"{phase} of {qualname or 'the model'} ({type(module).__name__}) draws "
                    f"random numbers for tensors of several stages, so the values of "
                    f"{_names(sorted(storage_of[s] for s in mine))} would depend on the "
                    "partition", hint="load the weights from a checkpoint instead "
                                      "(program.load_weights), or initialize per module")
            written |= mine
    unwritten = sorted(name for s, name in storage_of.items() if s not in written)
    if unwritten:
        raise CheckpointError(
            f"no initializer of {type(model).__name__} writes {_names(unwritten)}: neither "
            "their modules' reset_parameters() nor the model's _init_weights(module) sets them "
            "(a buffer computed in __init__ has no values on the meta device)",
            hint="give those modules a reset_parameters() that computes them (or, for "
                 "buffers, register them persistent so checkpoints carry them and load weights)")


def _direct(module: nn.Module) -> list[torch.Tensor]:
    """The tensors a module holds itself (not its children's)."""
    return [t for t in [*module._parameters.values(), *module._buffers.values()]
            if t is not None]


def _post_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module once (first qualified name), children before their parent."""
    seen: set[int] = set()
    out: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        seen.add(id(module))
        for name, child in module._modules.items():
            if child is not None and id(child) not in seen:
                visit(f"{prefix}.{name}" if prefix else name, child)
        out.append((prefix, module))

    visit("", model)
    return out


def _view(model: nn.Module, real: Mapping[int, torch.Tensor]) -> dict[int, nn.Module]:
    """Shallow copies of every module, sharing structure, whose tensors are the real ones where
    there are some (meta elsewhere): the model's initializers run on it, the model is untouched.
    Keyed by id of the original module."""
    views: dict[int, nn.Module] = {}

    def clone(module: nn.Module) -> nn.Module:
        if id(module) in views:
            return views[id(module)]
        twin = copy.copy(module)
        views[id(module)] = twin
        twin.__dict__["_parameters"] = {k: real.get(id(v), v) if v is not None else v
                                        for k, v in module._parameters.items()}
        twin.__dict__["_buffers"] = {k: real.get(id(v), v) if v is not None else v
                                     for k, v in module._buffers.items()}
        twin.__dict__["_modules"] = {k: clone(c) if c is not None else None
                                     for k, c in module._modules.items()}
        return twin

    clone(model)
    return views


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:8])
    return shown + (f" ... ({len(names) - 8} more)" if len(names) > 8 else "")

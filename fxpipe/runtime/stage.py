"""The base class of generated stage modules, and the checkpoint helper their remat regions use."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from fxpipe.errors import CodegenError
from fxpipe.remat_policy import CHECKPOINT_OPTIONS
from fxpipe.runtime.execution.memory import active_tracker

__all__ = ["StageModule", "checkpoint", "share_tied"]


def checkpoint(region: Callable[..., Any], *args: Any, enabled: bool) -> Any:
    """Runs `region(*args)`, recomputing it in the backward pass instead of keeping its
    activations when `enabled` (the executor enables it per micro-batch, e.g. for all but the
    last one under remat="except_last").

    Non-reentrant checkpointing with the RNG state preserved, so dropout inside the region draws
    the same mask when it is recomputed (fxpipe.remat_policy.CHECKPOINT_OPTIONS).
    """
    if not enabled or not torch.is_grad_enabled():
        return region(*args)
    tracker = active_tracker()
    if tracker is not None:
        tracker.add_region_inputs(args)
    return _torch_checkpoint(region, *args, **CHECKPOINT_OPTIONS)


def share_tied(modules: Sequence[StageModule]) -> None:
    """Stages of one process share tied parameters: one Parameter object under every stage that
    binds its qualified name, as in the model (so its gradient accumulates once)."""
    owner: dict[str, nn.Parameter] = {}
    for module in modules:
        for attr, qualname in module.PARAMETERS.items():
            param = module._parameters.get(attr)
            if param is None:
                continue
            if qualname in owner:
                module._parameters[attr] = owner[qualname]
            else:
                owner[qualname] = param


class StageModule(nn.Module):
    """A pipeline stage: binds the model's tensors to the attribute names its code uses.

    Subclasses (generated) declare PARAMETERS / BUFFERS / MODULES as {attribute: qualified name
    in the model}. Passing the model's own tensors shares them (gradients land in the model);
    passing a loaded state dict gives the stage its own copies.
    """

    PARAMETERS: ClassVar[dict[str, str]] = {}
    FROZEN: ClassVar[tuple[str, ...]] = ()
    BUFFERS: ClassVar[dict[str, str]] = {}
    MODULES: ClassVar[dict[str, str]] = {}
    INPUTS: ClassVar[tuple[str, ...]] = ()
    STAGE: ClassVar[int] = 0

    def __init__(self, tensors: Mapping[str, torch.Tensor],
                 modules: Mapping[str, nn.Module] | None = None) -> None:
        super().__init__()
        missing = [q for q in [*self.PARAMETERS.values(), *self.BUFFERS.values()]
                   if q not in tensors]
        if missing:
            raise CodegenError(f"stage {self.STAGE} needs tensors that were not given: "
                               f"{missing[:5]}",
                               hint="pass the model's state_dict (original qualified names)")
        for attr, qualname in self.PARAMETERS.items():
            value = tensors[qualname]
            if not isinstance(value, nn.Parameter):
                value = nn.Parameter(value.detach(), requires_grad=attr not in self.FROZEN)
            self.register_parameter(attr, value)
        for attr, qualname in self.BUFFERS.items():
            self.register_buffer(attr, tensors[qualname])
        for attr, qualname in self.MODULES.items():
            if modules is None or qualname not in modules:
                raise CodegenError(
                    f"stage {self.STAGE} calls module {qualname!r} as a leaf, which generated "
                    "code cannot rebuild", hint="pass the model's modules, or capture without "
                    "leaf_modules (method='export' inlines every module)")
            self.add_module(attr, modules[qualname])

    @classmethod
    def qualified_names(cls) -> dict[str, str]:
        return {**cls.PARAMETERS, **cls.BUFFERS}

    def extra_repr(self) -> str:
        """What print(program) shows of a stage: its docstring's first line (the stage, the
        model's modules it runs and its operations) and its parameters."""
        summary = (type(self).__doc__ or f"Stage {self.STAGE}").strip().splitlines()[0]
        count = sum(p.numel() for p in self.parameters())
        return f"{summary.rstrip('.')}, {count:,} parameters"

    def named_model_tensors(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers under the model's qualified names."""
        foreign = self.__dict__.get("_foreign", {})
        out = {}
        for attr, qualname in self.qualified_names().items():
            out[qualname] = foreign[attr][0] if attr in foreign else getattr(self, attr)
        return out

    def place(self, device: torch.device, placed: set[int]) -> None:
        """Moves this stage's tensors to `device` in place (the model's own tensors move with
        them), except those an earlier stage of this process placed (`placed`: their ids,
        updated here), which this stage then reads from there (borrow_foreign)."""
        with torch.no_grad():
            for tensor in [*self.parameters(), *self.buffers()]:
                if id(tensor) in placed:
                    continue
                placed.add(id(tensor))
                # a meta tensor stays until the stage gets weights, which are made on the device
                if tensor.device != device and not tensor.is_meta:
                    tensor.data = tensor.data.to(device)
        self.borrow_foreign(device)

    def borrow_foreign(self, device: torch.device) -> list[str]:
        """Reads the parameters that live on another device through a differentiable copy.

        In one process, a parameter two stages share (a tied weight) lives on the device of
        the first; a stage on another device then uses `param.to(device)` on every access, so
        the forward runs on its own device and the gradient flows back to the one parameter.
        The borrowed parameters stay out of this stage's parameters() (their owner lists
        them). Returns the attributes borrowed.
        """
        foreign: dict[str, tuple[nn.Parameter, torch.device]] = self.__dict__.setdefault(
            "_foreign", {})
        for attr, param in list(self._parameters.items()):
            if param is not None and param.device != device and not param.is_meta:
                del self._parameters[attr]
                foreign[attr] = (param, device)
        return sorted(foreign)

    def __getattr__(self, name: str) -> Any:
        # the stage code reads its parameters as attributes, dozens per micro-batch: found
        # here first, as nn.Module.__getattr__ would, without a second call
        # (subscripts, not dict.get: a call each, and this runs for every parameter read)
        state = self.__dict__
        if "_parameters" in state and name in state["_parameters"]:
            return state["_parameters"][name]
        if "_foreign" in state and name in state["_foreign"]:
            param, device = state["_foreign"][name]
            return param.to(device)
        return super().__getattr__(name)

"""The stages a `Program` holds: built from the compiled plan on a mapping of qualified names to
tensors (the model's own, so the model trains with the program, or new ones with weights for a
model built on the meta device), by fxpipe.runtime.execution.hold as a written program's are.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.fx import GraphModule

from fxpipe import ir
from fxpipe.built import Built, BuiltStage
from fxpipe.errors import ConfigError
from fxpipe.passes.remat import RematRegion
from fxpipe.runtime.communication.mesh import GroupCache, Mesh
from fxpipe.runtime.execution.hold import HeldStages, RunSettings, hold_stages
from fxpipe.runtime.execution.stagespec import StageSpec
from fxpipe.runtime.stage import StageModule

__all__ = ["Stage", "hold_built", "stage_views", "held_tensors"]


@dataclass
class Stage:
    """One stage of a built program, as `program.stages` shows it: what the compiler made of
    it, what the runtime reads of it, and its module where this process holds it."""

    built: BuiltStage
    spec: StageSpec
    module: StageModule | None  # built here: every stage locally, this rank's under torchrun

    @property
    def index(self) -> int:
        return self.built.index

    @property
    def graph_module(self) -> GraphModule:  # with explicit send/recv nodes
        return self.built.graph_module

    @property
    def source(self) -> str:  # the generated Python file
        return self.built.source

    @property
    def recvs(self) -> tuple[ir.CommInfo, ...]:
        return self.spec.recvs

    @property
    def sends(self) -> tuple[ir.CommInfo, ...]:
        return self.spec.sends

    @property
    def regions(self) -> list[RematRegion]:
        return self.built.regions


def hold_built(built: Built, classes: Sequence[type[StageModule]], settings: RunSettings,
               tensors: Mapping[str, torch.Tensor], mesh: Mesh | None,
               device: torch.device | None, groups: GroupCache | None = None) -> HeldStages:
    """Builds the stages of this process (all of them when `mesh` is None) on `tensors`;
    under a mesh its process groups come from `groups` when made before."""
    modules = {ir.qualname(built.captured, k): v for k, v in built.captured.named_modules()}
    return hold_stages(built.spec, lambda s: classes[s](tensors, modules), settings, mesh=mesh,
                       device=device, groups=groups,
                       graphs=[st.graph_module for st in built.stages])


def stage_views(built: Built, held: HeldStages) -> list[Stage]:
    """Every stage of the program, with its module where this process holds it."""
    mine = {st.index: st.module for st in held.stages}
    return [Stage(st, runs, mine.get(st.index))
            for st, runs in zip(built.stages, built.spec.stages)]


def held_tensors(held: HeldStages) -> tuple[dict[str, torch.Tensor], dict[str, torch.device]]:
    """The held stages' tensors by qualified name (a tied one once), and each one's device
    (the first stage's that binds it)."""
    tensors: dict[str, torch.Tensor] = {}
    devices: dict[str, torch.device] = {}
    for module, device in zip(held.modules, held.devices):
        if module.MODULES and held.meta:
            raise ConfigError(f"stage {module.STAGE} calls leaf modules "
                              f"{sorted(module.MODULES.values())}, whose tensors fxpipe cannot "
                              "materialize", hint="compile without leaf_modules")
        for name, tensor in module.named_model_tensors().items():
            tensors.setdefault(name, tensor)
            devices.setdefault(name, device)
    return tensors, devices

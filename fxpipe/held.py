"""The stages a `Program` holds: built from the compiled plan on a mapping of qualified names to
tensors (the model's own, so the model trains with the program, or new ones with weights for a
model built on the meta device), by fxpipe.runtime.execution.hold as a written program's are.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fxpipe import ir
from fxpipe.built import Built
from fxpipe.errors import ConfigError
from fxpipe.runtime.communication.mesh import GroupCache, Mesh
from fxpipe.runtime.execution.hold import HeldStages, RunSettings, hold_stages
from fxpipe.runtime.stage import StageModule

__all__ = ["hold_built", "held_tensors"]


def hold_built(built: Built, classes: Sequence[type[StageModule]], settings: RunSettings,
               tensors: Mapping[str, torch.Tensor], mesh: Mesh | None,
               device: torch.device | None, groups: GroupCache | None = None) -> HeldStages:
    """Builds the stages of this process (all of them when `mesh` is None) on `tensors`;
    under a mesh its process groups come from `groups` when made before."""
    modules = {ir.qualname(built.captured, k): v for k, v in built.captured.named_modules()}
    return hold_stages(built.spec, lambda s: classes[s](tensors, modules), settings, mesh=mesh,
                       device=device, groups=groups,
                       graphs=[st.graph_module for st in built.stages])


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

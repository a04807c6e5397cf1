"""The stages one process holds: their modules on their devices, and the executor that runs them.

Locally a process holds every stage (on its rank's device); under torchrun it holds its rank's
stages (one, or several under a looped schedule). A stage is built on a mapping of qualified
names to tensors: the model's own (so the model trains with the program), or new ones with
weights for a model built on the meta device.
Stages that still hold meta tensors get no executor until they have weights.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.fx import GraphModule

from fxpipe import ir
from fxpipe.built import Built, BuiltStage
from fxpipe.config import CompileConfig
from fxpipe.errors import ConfigError
from fxpipe.passes.remat import RematRegion
from fxpipe.runtime.local import LocalExecutor, LocalStage
from fxpipe.runtime.materialize import meta_names
from fxpipe.runtime.mesh import GroupCache, Mesh, make_groups
from fxpipe.runtime.rank import RankStage, StageWiring, devices_for_stages, setup_rank
from fxpipe.runtime.stage import StageModule, share_tied

__all__ = ["Stage", "HeldStages", "hold_stages", "held_tensors"]


@dataclass
class Stage:
    """One stage of a built program."""

    index: int
    graph_module: GraphModule  # with explicit send/recv nodes
    source: str  # the generated Python file
    module: StageModule | None  # built here: every stage locally, this rank's under torchrun
    built: BuiltStage

    @property
    def recvs(self) -> tuple[ir.CommInfo, ...]:
        return self.built.graph.recvs

    @property
    def sends(self) -> tuple[ir.CommInfo, ...]:
        return self.built.graph.sends

    @property
    def regions(self) -> list[RematRegion]:
        return self.built.regions


@dataclass
class HeldStages:
    modules: list[StageModule]  # the stages this process holds, in stage order
    devices: list[torch.device]  # the device of each
    views: list[Stage]  # every stage of the program (module None where another rank holds it)
    local: LocalExecutor | None  # every stage in this process, once they have weights
    rank: RankStage | None  # this rank's stages under torchrun, once they have weights
    meta: list[str]  # qualified names of the tensors that have no weights yet


def hold_stages(built: Built, classes: Sequence[type[StageModule]], config: CompileConfig,
                tensors: Mapping[str, torch.Tensor], mesh: Mesh | None,
                device: torch.device | None, groups: GroupCache | None = None) -> HeldStages:
    """Builds the stages of this process (all of them when `mesh` is None) on `tensors`;
    under a mesh its process groups come from `groups` when made before."""
    modules = {ir.qualname(built.captured, k): v for k, v in built.captured.named_modules()}
    if mesh is None:
        devices = devices_for_stages(built.config.placement, config.devices)
        held = [classes[st.index](tensors, modules) for st in built.stages]
        share_tied(held)
        views = []
        local = []
        placed: set[int] = set()  # a tensor shared by stages lives where the first one runs
        for st, module, stage_device in zip(built.stages, held, devices):
            module.place(stage_device, placed)
            local.append(LocalStage(module, stage_device, st.input_indexes, st.random,
                                    st.graph_module))
            views.append(Stage(st.index, st.graph_module, st.source, module, st))
        meta = sorted({q for m in held for q in meta_names(m.named_model_tensors())})
        executor = None if meta else LocalExecutor(local, built.signature, built.plan.chunks,
                                                   config.remat,
                                                   check_finite=config.check_finite,
                                                   schedule=built.config.schedule_kind,
                                                   ranks=built.config.ranks)
        return HeldStages(held, devices[:len(held)], views, executor, None, meta)
    assert device is not None  # the rank's device comes with its mesh
    mine = [classes[s](tensors, modules) for s in mesh.held]
    share_tied(mine)
    placed = set()
    for module in mine:
        module.place(device, placed)
    by_index = dict(zip(mesh.held, mine))
    views = [Stage(other.index, other.graph_module, other.source, by_index.get(other.index),
                   other) for other in built.stages]
    meta = sorted({q for m in mine for q in meta_names(m.named_model_tensors())})
    if meta:
        return HeldStages(mine, [device] * len(mine), views, None, None, meta)
    rank = setup_rank(
        [(by_index[st.index], StageWiring(st.index, st.input_indexes, st.graph.recvs,
                                          st.graph.sends, st.random), st.graph_module)
         for st in built.stages if st.index in by_index],
        mesh=mesh, groups=make_groups(mesh, built.shared, device.type, groups), device=device,
        signature=built.signature, edges=built.edges, shared=built.shared,
        chunks=built.plan.chunks, remat=config.remat, schedule=built.config.schedule,
        check_finite=config.check_finite, dp_bucket_mb=config.dp_bucket_mb)
    return HeldStages(mine, [device] * len(mine), views, None, rank, meta)


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


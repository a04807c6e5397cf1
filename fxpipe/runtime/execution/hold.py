"""The stages one process holds of a runtime plan: their modules on their devices, and the
executor that runs them. `Program` (stages compiled in the process) and a written program's
launcher (stages built from their files) both hold their stages here.

In one process every stage is held, each on its pipeline rank's device, and run by the local
executor; under torchrun a rank holds its own stages (one, or several under a looped schedule)
on its device, run by the distributed executor. Stages that still hold meta tensors (a model
built on the meta device) get no executor until they have weights.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.fx import GraphModule

from fxpipe.losses import LossFn, loss_of
from fxpipe.runtime.communication.mesh import GroupCache, Mesh, make_groups
from fxpipe.runtime.execution.devices import pinned_to
from fxpipe.runtime.execution.local import LocalExecutor
from fxpipe.runtime.execution.loss_judge import check_batch_target
from fxpipe.runtime.execution.rank import RankPipeline, devices_for_stages, setup_rank
from fxpipe.runtime.execution.stagespec import HeldStage
from fxpipe.runtime.program.materialize import meta_names
from fxpipe.runtime.program.spec import ProgramSpec
from fxpipe.runtime.stage import StageModule, share_tied
from fxpipe.targets import Target, map_target

__all__ = ["RunSettings", "HeldStages", "hold_stages", "local_loss"]


@dataclass(frozen=True)
class RunSettings:
    """How a process runs the plan: chosen where it runs, no part of the plan."""

    check_finite: bool = False  # name the first node that makes a NaN or Inf
    dp_bucket_mb: float = 25.0  # gradients averaged over replicas in buckets of this size
    devices: Sequence[str] | None = None  # in one process: one device per pipeline rank


@dataclass
class HeldStages:
    """The stages this process holds, in stage order, and what runs them."""

    stages: list[HeldStage]
    local: LocalExecutor | None  # every stage in this process, once they have weights
    rank: RankPipeline | None  # this rank's stages under torchrun, once they have weights
    meta: list[str]  # qualified names of the tensors that have no weights yet

    @property
    def modules(self) -> list[StageModule]:
        return [st.module for st in self.stages]

    @property
    def devices(self) -> list[torch.device]:
        return [st.device for st in self.stages]


def hold_stages(spec: ProgramSpec, make: Callable[[int], StageModule], settings: RunSettings, *,
                mesh: Mesh | None = None, device: torch.device | None = None,
                groups: GroupCache | None = None,
                graphs: Sequence[GraphModule | None] = ()) -> HeldStages:
    """Makes the stages this process holds (every one when `mesh` is None, else the mesh's
    rank's on `device`) with `make(index)`, ties their shared parameters, places them and
    builds their executor. `groups`: the process groups made before, reused; `graphs`: each
    stage's graph when known, to name the node of a NaN or Inf."""
    indexes = list(range(len(spec.stages))) if mesh is None else list(mesh.held)
    if mesh is None:
        devices = devices_for_stages(spec.placement, settings.devices)
    else:
        assert device is not None  # the rank's device comes with its mesh
        devices = [device] * len(indexes)
    stages = [HeldStage(spec.stages[s], make(s), stage_device, graphs[s] if graphs else None)
              for s, stage_device in zip(indexes, devices)]
    share_tied([st.module for st in stages])
    placed: set[int] = set()  # a tensor shared by stages lives where the first one runs
    for st in stages:
        st.module.place(st.device, placed)
    meta = sorted({q for st in stages for q in meta_names(st.module.named_model_tensors())})
    held = HeldStages(stages, None, None, meta)
    if meta:
        return held
    if mesh is None:
        held.local = LocalExecutor(stages, spec.signature, spec.chunks, spec.remat,
                                   check_finite=settings.check_finite, schedule=spec.schedule,
                                   ranks=spec.ranks)
        return held
    assert device is not None
    held.rank = setup_rank(stages, spec, mesh=mesh,
                           groups=make_groups(mesh, spec.shared, device.type, groups),
                           device=device, check_finite=settings.check_finite,
                           dp_bucket_mb=settings.dp_bucket_mb)
    return held


def local_loss(executor: LocalExecutor, inputs: list[torch.Tensor],
               target: Target, loss_fn: LossFn) -> torch.Tensor:
    """The loss of one step in one process: every micro-batch through every stage, the outputs
    joined, the target moved to where the last stage put them."""
    check_batch_target(executor.signature, inputs, target)
    outputs = executor.signature.unflatten_outputs(executor.run(inputs))
    if target is not None:  # from pinned memory: a pageable copy would wait for the device
        device = executor.stages[-1].device
        target = map_target(lambda t: pinned_to(t, device), target)
    return loss_of(loss_fn, outputs, target)

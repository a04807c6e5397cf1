"""One rank of a distributed pipeline: its device, its place in the mesh, its executor, its step.

Used alike by `Program` (compiled in the process) and by a written program's launcher (built
from stage files), so a rank is set up and stepped the same way whichever way it was made.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fxpipe.errors import ConfigError, RuntimeInputError
from fxpipe.losses import LossFn
from fxpipe.runtime.communication.backend import carries_cuda, cuda_index_for, local_rank
from fxpipe.runtime.communication.mesh import Groups, Mesh, average_over_replicas
from fxpipe.runtime.execution.distributed import DistributedExecutor, StepResult
from fxpipe.runtime.execution.fsdp import FullShard
from fxpipe.runtime.execution.loss_judge import check_batch_target
from fxpipe.runtime.execution.stagespec import HeldStage
from fxpipe.runtime.program.spec import ProgramSpec
from fxpipe.signature import Signature
from fxpipe.targets import Target, narrow_target

__all__ = ["RankPipeline", "setup_rank", "mesh_of_world",
           "rank_device", "devices_for_stages", "shard_batch"]


def rank_device(backend: str | None = None, *, say: bool = True) -> torch.device:
    """The device of this rank's stages (fxpipe.runtime.communication.backend): its own GPU when the
    backend moves CUDA tensors, which becomes the current device as NCCL needs before its first
    collective; else the CPU, said in one line when this node has GPUs (`say`: a launcher that
    chose gloo for more ranks than GPUs said it already)."""
    backend = backend or (dist.get_backend() if dist.is_initialized() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    world = dist.get_world_size() if dist.is_initialized() else \
        int(os.environ.get("WORLD_SIZE", "1"))
    if not carries_cuda(backend):
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus and say and local_rank(rank) == 0:
            print(f"fxpipe: process group backend {backend!r} moves no CUDA tensors point to "
                  f"point: the stages train on the CPU although this node has {gpus} GPU"
                  f"{'s' if gpus > 1 else ''} (make the group with backend 'nccl' to use them)",
                  file=sys.stderr, flush=True)
        return torch.device("cpu")
    index = cuda_index_for(rank, world, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def devices_for_stages(placement: Sequence[int],
                       devices: Sequence[str] | None = None) -> list[torch.device]:
    """The device of each stage in one process, stage s on its rank placement[s]'s device: one
    device per rank as given; else the GPUs this process sees, one per rank when there are
    enough and in turn when there are fewer; else the CPU."""
    ranks = max(placement, default=-1) + 1
    if devices is not None:
        per_rank = [torch.device(d) for d in devices[:ranks]]
    else:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        per_rank = [torch.device("cuda", r % count) if count else torch.device("cpu")
                    for r in range(ranks)]
    return [per_rank[r] for r in placement]


def mesh_of_world(placement: Sequence[int]) -> Mesh:
    """This rank's place in a (replicas x pipeline ranks) mesh of the initialized process
    group; placement[s] is the pipeline rank of stage s."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ranks = max(placement) + 1
    if world % ranks:
        what = f"the number of stages ({ranks})" if ranks == len(placement) else \
            f"the number of pipeline ranks ({ranks}: {len(placement)} stages, " \
            f"{len(placement) // ranks} per rank)"
        raise ConfigError(f"world size {world} is not a multiple of {what}",
                          hint=f"launch {ranks} x replicas processes (e.g. torchrun "
                               f"--nproc-per-node {ranks}), or use a number of stages that "
                               f"divides {world}")
    return Mesh(tuple(placement), world // ranks, rank)


def shard_batch(signature: Signature, flat: list[torch.Tensor], target: Target,
                mesh: Mesh) -> tuple[list[torch.Tensor], Target]:
    """This replica's share of the global batch (and of the target), refused unless the
    replicas share it equally (each share then runs in as many equal micro-batches as
    signature.microbatches gives it)."""
    batch = signature.batch_size(flat)
    if batch % mesh.replicas:
        raise RuntimeInputError(f"global batch {batch} cannot be shared equally by "
                                f"{mesh.replicas} data-parallel replicas",
                                hint=f"use a multiple of {mesh.replicas} (the replicas), e.g. "
                                     "DataLoader(drop_last=True)")
    size = batch // mesh.replicas
    start = mesh.replica * size
    sharded = [t if leaf.batch_dim is None else t.narrow(leaf.batch_dim, start, size)
               for leaf, t in zip(signature.tensor_leaves, flat)]
    return sharded, narrow_target(target, signature.target_batch_dim, start, size)


@dataclass
class RankPipeline:
    """This rank's stages of a distributed pipeline, ready to step."""

    executor: DistributedExecutor
    mesh: Mesh
    groups: Groups
    spec: ProgramSpec  # the plan it runs

    def step(self, flat: list[torch.Tensor], target: Target, loss_fn: LossFn,
             scaler: torch.amp.GradScaler | None = None) -> tuple[float, StepResult]:
        """One training step of the global batch; returns the global loss and what this rank
        measured (events, kept bytes). With `scaler` the backward runs on the scaled loss."""
        flat, target = self._share(flat, target)
        result = self.executor.step(flat, target, loss_fn, chunks=self.spec.chunks,
                                    remat=self.spec.remat, schedule=self.spec.schedule,
                                    scaler=scaler)
        return self._global(result.loss), result

    def evaluate(self, flat: list[torch.Tensor], target: Target,
                 loss_fn: LossFn) -> float:
        """The global batch's loss without training: each replica's share forward through the
        stages, the replicas' losses averaged as step() averages them."""
        flat, target = self._share(flat, target)
        return self._global(self.executor.evaluate(flat, target, loss_fn,
                                                   chunks=self.spec.chunks,
                                                   schedule=self.spec.schedule))

    def _share(self, flat: list[torch.Tensor], target: Target
               ) -> tuple[list[torch.Tensor], Target]:
        """This replica's share of the global batch and target, checked first as a whole."""
        check_batch_target(self.spec.signature, flat, target)
        if self.mesh.replicas == 1:
            return flat, target
        return shard_batch(self.spec.signature, flat, target, self.mesh)

    def _global(self, loss: float) -> float:
        """The global batch's loss from this replica's: the replicas' mean."""
        if self.mesh.replicas == 1:
            return loss
        return average_over_replicas(loss, self.groups.dp, self.mesh.replicas,
                                     self.executor.device)

    def close(self) -> None:
        """Lets go of what the executor attached to the parameters; the groups stay."""
        self.executor.close()


def setup_rank(stages: Sequence[HeldStage], spec: ProgramSpec, *, mesh: Mesh, groups: Groups,
               device: torch.device, check_finite: bool = False,
               dp_bucket_mb: float = 25.0) -> RankPipeline:
    """Builds the executor of this rank's stages of `spec`; their modules already sit on
    `device` and share their tied parameters. Under shard="full" with several replicas FSDP2
    shards them over the replicas first (fxpipe.runtime.execution.fsdp)."""
    full_shard = None
    if spec.shard == "full" and mesh.replicas > 1:
        assert groups.device_mesh is not None  # made whenever there are replicas
        full_shard = FullShard([st.module for st in stages], groups.device_mesh["dp"])
    executor = DistributedExecutor(
        units=stages, mesh=mesh, signature=spec.signature, edges=spec.edges, device=device,
        pp_group=groups.pp, dp_group=groups.dp, shared=spec.shared, shared_groups=groups.shared,
        check_finite=check_finite, dp_bucket_bytes=int(dp_bucket_mb * 2**20),
        full_shard=full_shard)
    return RankPipeline(executor, mesh, groups, spec)

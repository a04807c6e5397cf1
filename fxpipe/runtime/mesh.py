"""Process groups of a data-parallel x pipeline-parallel run, on torch's own DeviceMesh.

Ranks form a 2-D mesh ("dp", "pp"): rank = replica * stages + stage. Point-to-point traffic stays
inside a "pp" row; gradient averaging runs down a "dp" column; tied parameters get one group per
replica over the stages that hold them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fxpipe.runtime.distributed import Mesh

__all__ = ["Groups", "make_groups", "average_over_replicas"]


@dataclass
class Groups:
    pp: ProcessGroup | None = None
    dp: ProcessGroup | None = None
    # tied parameter -> group (this replica)
    shared: dict[str, ProcessGroup] = field(default_factory=dict)
    device_mesh: DeviceMesh | None = None


def make_groups(mesh: Mesh, shared: dict[str, list[int]]) -> Groups:
    """Creates the groups; every rank must call this in the same order (it is collective)."""
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    device_mesh = init_device_mesh(device_type, (mesh.replicas, mesh.stages),
                                   mesh_dim_names=("dp", "pp"))
    groups = Groups(pp=device_mesh.get_group("pp"), dp=device_mesh.get_group("dp"),
                    device_mesh=device_mesh)
    for name, stages in sorted(shared.items()):
        for replica in range(mesh.replicas):
            ranks = [mesh.rank_of(s, replica) for s in stages]
            group = dist.new_group(ranks)
            if replica == mesh.replica and mesh.rank in ranks:
                groups.shared[name] = group
    return groups


def average_over_replicas(loss: float, group: ProcessGroup | None, replicas: int) -> float:
    """The global-batch loss: the mean of the replicas' losses."""
    value = torch.tensor([loss], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        value = value.cuda()
    dist.all_reduce(value, group=group)
    return float(value.item()) / replicas

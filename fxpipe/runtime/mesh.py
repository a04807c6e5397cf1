"""Process groups of a data-parallel x pipeline-parallel run, on torch's own DeviceMesh.

Ranks form a 2-D mesh ("dp", "pp"): rank = replica * stages + stage. Point-to-point traffic stays
inside a "pp" row; gradient averaging runs down a "dp" column; tied parameters get one group per
replica over the stages that hold them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Groups", "make_groups", "average_over_replicas"]


@dataclass
class Groups:
    pp: Any = None
    dp: Any = None
    shared: dict[str, Any] = field(default_factory=dict)  # tied parameter -> group (this replica)
    device_mesh: Any = None


def make_groups(mesh: Any, shared: dict[str, list[int]]) -> Groups:
    """Creates the groups; every rank must call this in the same order (it is collective)."""
    from torch.distributed.device_mesh import init_device_mesh

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


def average_over_replicas(loss: float, group: Any, replicas: int) -> float:
    """The global-batch loss: the mean of the replicas' losses."""
    value = torch.tensor([loss], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        value = value.cuda()
    dist.all_reduce(value, group=group)
    return float(value.item()) / replicas

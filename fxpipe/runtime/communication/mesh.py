"""Where stages run in a data-parallel x pipeline-parallel run, and its process groups.

Ranks form a 2-D mesh ("dp", "pp"): rank = replica * R + placement[stage], where R is the
number of pipeline ranks of one replica and placement says which of them runs each stage (stage
s on rank s under a flat schedule; several stages per rank under a looped one). Point-to-point
traffic stays inside a "pp" row; gradient averaging runs down a "dp" column; tied parameters
get one group per replica over the ranks that hold them (none when one rank holds them all).
The groups sit on torch's own DeviceMesh.

A group costs more than its messages: each gloo group runs a thread that wakes every 10 ms,
which takes time from the compute on a busy CPU. So no group is made twice: a single replica's
"pp" group is the default group, and a tied parameter held by every rank uses the default group
too, as do ties over ranks another tie already has a group for. Nor is one made again when a
program installs a new cut (a balance round, a rebalance, new weights): a `GroupCache` keeps
the groups a process made, by their ranks.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fxpipe.runtime.planning.schedule import stages_on

__all__ = ["Mesh", "Groups", "GroupCache", "make_groups", "group_over", "limit_waits",
           "average_over_replicas"]


@dataclass(frozen=True)
class Mesh:
    """This process's place: `placement[s]` is the pipeline rank of stage s (0..R-1), and
    rank = replica * R + pipeline rank."""

    placement: tuple[int, ...]
    replicas: int
    rank: int

    @property
    def stages(self) -> int:
        """Stages of the pipeline."""
        return len(self.placement)

    @property
    def ranks(self) -> int:
        """Pipeline ranks of one replica."""
        return max(self.placement) + 1

    @property
    def pipe_rank(self) -> int:
        """This process's rank within its pipeline replica."""
        return self.rank % self.ranks

    @property
    def replica(self) -> int:
        return self.rank // self.ranks

    @property
    def held(self) -> tuple[int, ...]:
        """The stages this process runs, in stage order."""
        return self.stages_of(self.pipe_rank)

    def stages_of(self, pipe_rank: int) -> tuple[int, ...]:
        return tuple(stages_on(self.placement, pipe_rank))

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        """The global rank that runs `stage` of `replica` (default: this one's)."""
        return self.global_rank(self.placement[stage], replica)

    def global_rank(self, pipe_rank: int, replica: int | None = None) -> int:
        return (self.replica if replica is None else replica) * self.ranks + pipe_rank

    def ranks_of(self, stages: Sequence[int], replica: int | None = None) -> list[int]:
        """The global ranks that run any of `stages`, each once, in order."""
        return sorted({self.rank_of(s, replica) for s in stages})

    def describe(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(rank, replica, stages it runs) for every rank."""
        return [(r, r // self.ranks, self.stages_of(r % self.ranks))
                for r in range(self.ranks * self.replicas)]


@dataclass
class Groups:
    pp: ProcessGroup | None = None
    dp: ProcessGroup | None = None
    # tied parameter -> group (this replica)
    shared: dict[str, ProcessGroup] = field(default_factory=dict)
    device_mesh: DeviceMesh | None = None


@dataclass
class GroupCache:
    """The groups one process made (by their ranks) and its DeviceMesh (by device type and
    shape), for the lifetime of its default group: making a group is collective and each gloo
    group keeps a thread, so a program that installs a new cut reuses them."""

    world: Any = None  # the default group they belong to
    groups: dict[tuple[int, ...], ProcessGroup] = field(default_factory=dict)
    meshes: dict[tuple[str, int, int], DeviceMesh] = field(default_factory=dict)

    def current(self) -> GroupCache:
        """This cache, emptied first when the default group is not the one its groups are of."""
        if self.world is not dist.group.WORLD:
            self.world, self.groups, self.meshes = dist.group.WORLD, {}, {}
        return self


def make_groups(mesh: Mesh, shared: dict[str, list[int]], device_type: str = "cpu",
                cache: GroupCache | None = None) -> Groups:
    """Creates the groups (or takes them from `cache`); every rank must call this in the same
    order with the same cache history (making a group is collective). `device_type`: where the
    stages run, the device type of the DeviceMesh."""
    cache = (cache or GroupCache()).current()
    world = dist.get_world_size()
    if mesh.replicas == 1 and mesh.ranks == world:  # one pipeline: all of it is the default group
        groups = Groups(pp=dist.group.WORLD)
    else:
        key = (device_type, mesh.replicas, mesh.ranks)
        if key not in cache.meshes:
            cache.meshes[key] = init_device_mesh(device_type, (mesh.replicas, mesh.ranks),
                                                 mesh_dim_names=("dp", "pp"))
        device_mesh = cache.meshes[key]
        groups = Groups(pp=device_mesh.get_group("pp"), dp=device_mesh.get_group("dp"),
                        device_mesh=device_mesh)
    for name, stages in sorted(shared.items()):
        for replica in range(mesh.replicas):
            ranks = mesh.ranks_of(stages, replica)
            if len(ranks) < 2:  # the stages share one Parameter object on their one rank
                continue
            group = group_over(ranks, cache.groups)
            if replica == mesh.replica and mesh.rank in ranks:
                groups.shared[name] = group
    return groups


def limit_waits(groups: Groups, seconds: float, setup_seconds: float) -> None:
    """Waits for every rank (up to `setup_seconds`: starting and loading a stage's weights
    take long), then lets each collective of `groups` and of the default group wait at most
    `seconds`; under NCCL its watchdog too. (gloo's point-to-point waits take theirs from the
    transport, fxpipe.runtime.communication.transport.) A torch without the setter keeps the groups'
    timeouts."""
    if dist.get_backend() == "gloo":
        # gloo's own waits last as long as its groups' timeout; this barrier says its own
        dist.monitored_barrier(timeout=timedelta(seconds=setup_seconds), wait_all_ranks=True)
    else:
        dist.barrier()
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return
    every = [dist.group.WORLD, groups.pp, groups.dp, *groups.shared.values()]
    for group in {id(g): g for g in every if g is not None}.values():
        set_timeout(timedelta(seconds=seconds), group)


def group_over(ranks: Sequence[int], made: dict[tuple[int, ...], ProcessGroup],
               whole: ProcessGroup | None = None) -> ProcessGroup:
    """The process group of exactly `ranks`: `whole` (default: the default group) when they
    are every rank, else one made on first use and kept in `made` by its ranks. Collective:
    every rank calls it for the same ranks in the same order."""
    key = tuple(sorted(ranks))
    if len(key) == dist.get_world_size():
        group = whole if whole is not None else dist.group.WORLD
    else:
        if key not in made:
            made[key] = dist.new_group(list(key))
        group = made[key]
    assert group is not None
    return group


def average_over_replicas(loss: float, group: ProcessGroup | None, replicas: int,
                          device: torch.device) -> float:
    """The global-batch loss: the mean of the replicas' losses (on the stages' device, which
    the group's backend carries)."""
    value = torch.tensor([loss], dtype=torch.float64, device=device)
    dist.all_reduce(value, group=group)
    return float(value.item()) / replicas

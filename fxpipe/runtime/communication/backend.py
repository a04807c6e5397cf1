"""Which communication backend a rank uses, and on which device its stages run.

NCCL needs one GPU per process: two ranks of a node on one GPU abort with "Duplicate GPU
detected". So a launcher starts NCCL only when every local rank has a GPU of its own, and
otherwise runs every rank on the CPU over gloo, saying so in one line. A process group made
by the user decides by its backend string: "nccl", a per-device string that sends CUDA tensors
through a backend other than gloo ("cpu:gloo,cuda:nccl"), or no backend at all ("undefined":
torch picks NCCL for CUDA tensors) put the stages on this rank's GPU; gloo carries CPU tensors
only (its point-to-point reads host memory), so under it the stages stay on the CPU, said in
one line when the node has GPUs.
"""
from __future__ import annotations

import os
import sys

import torch

from fxpipe.errors import ConfigError

__all__ = ["carries_cuda", "choose_backend", "local_world_size", "local_rank",
           "cuda_index_for"]

# Launchers that start one process per device say how many run on this node, and which one
# this process is.
_LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                         "MV2_COMM_WORLD_LOCAL_SIZE")
_LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK",
                         "MV2_COMM_WORLD_LOCAL_RANK")


def _int_variable(names: tuple[str, ...]) -> int | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def local_world_size(world: int) -> int:
    """The processes on this node: the launcher's count, else the whole world (one node)."""
    found = _int_variable(_LOCAL_SIZE_VARIABLES)
    return found if found else world


def local_rank(rank: int) -> int:
    """This process's index on its node: the launcher's, else its global rank (one node)."""
    found = _int_variable(_LOCAL_RANK_VARIABLES)
    return found if found is not None else rank


def carries_cuda(backend: str, cuda_available: bool | None = None) -> bool:
    """Whether a process group of `backend` (as dist.get_backend() names it) moves the stages'
    CUDA tensors point to point: "nccl"; a per-device string whose cuda entry is not gloo;
    "undefined" (torch chooses per device: NCCL for CUDA) where CUDA exists."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    name = backend.strip().lower()
    if not cuda:
        return False
    if name == "undefined":
        return True
    if ":" in name:
        by_device = dict(part.strip().split(":", 1) for part in name.split(",") if ":" in part)
        return by_device.get("cuda", "gloo").strip() not in ("", "gloo")
    return name == "nccl"


def choose_backend(world: int, rank: int, gpus: int, *, say: bool = True) -> str:
    """The backend a launcher starts: NCCL when this node has a GPU for each of its ranks,
    else gloo on the CPU (with one line from the node's first rank when it has GPUs)."""
    if gpus == 0:
        return "gloo"
    local = local_world_size(world)
    if local <= gpus:
        return "nccl"
    if say and local_rank(rank) == 0:
        print(f"fxpipe: {local} ranks on this node but {gpus} GPU{'s' if gpus > 1 else ''}: "
              f"every rank trains on the CPU over gloo (NCCL needs a GPU per rank; start at "
              f"most {gpus} process{'es' if gpus > 1 else ''} per node to train on the GPUs)",
              file=sys.stderr, flush=True)
    return "gloo"


def cuda_index_for(rank: int, world: int, gpus: int) -> int:
    """This rank's GPU under a CUDA backend: its local rank, which must name a GPU of its own."""
    local, index = local_world_size(world), local_rank(rank)
    if index >= gpus or local > gpus:
        raise ConfigError(
            f"{local} ranks on this node but {gpus} GPU{'s' if gpus != 1 else ''}: rank {rank} "
            f"(local rank {index}) has no GPU of its own, and NCCL refuses two ranks on one GPU",
            hint=f"start at most {gpus} process{'es' if gpus != 1 else ''} per node, or make "
                 "the process group with backend 'gloo' to train on the CPU")
    return index

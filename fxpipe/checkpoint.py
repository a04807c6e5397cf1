"""Checkpoints in the model's own names: save a pipeline, resume it, or load it into the model.

Every process writes its stages' tensors and its optimizer's state keyed by the model's
state_dict names (one shard per rank; fxpipe.state.StateNames gives the names), atomically
(temporary file, then rename); rank 0 writes checkpoint.json last, so a checkpoint without it is
incomplete and is refused. Loading merges the shards (`weights_only=True`), so a checkpoint can
be resumed by the same pipeline, by another number of stages, or by the plain model.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, TypedDict

import torch
import torch.distributed as dist

from fxpipe.errors import CheckpointError
from fxpipe.files import atomic_save, atomic_write
from fxpipe.version import __version__

__all__ = ["Checkpoint", "save_shard", "load_checkpoint", "restore"]

META = "checkpoint.json"


class Checkpoint(TypedDict):
    """A loaded checkpoint, every tensor on the CPU."""

    model: dict[str, torch.Tensor]  # the model's state_dict names
    optimizer: dict[str, Any] | None  # optimizer state keyed by parameter names
    step: int | None


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _optimizer_by_name(optimizer: torch.optim.Optimizer,
                       names: dict[int, str]) -> dict[str, Any]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    raw = optimizer.state_dict()
    index_to_name = {i: names[id(p)] for i, p in enumerate(params)}
    return {"state": {index_to_name[i]: s for i, s in raw["state"].items()},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                              "params": [index_to_name[i] for i in g["params"]]}
                             for g in raw["param_groups"]]}


def save_shard(directory: str, state: dict[str, torch.Tensor],
               optimizer: torch.optim.Optimizer | None,
               names: dict[int, str], *, step: int | None, model: str) -> None:
    """Writes one process's tensors (model names) and optimizer state, then the metadata."""
    rank, world = _rank_world()
    os.makedirs(directory, exist_ok=True)
    shard: dict[str, Any] = {"model": {k: v.detach().cpu() for k, v in state.items()}}
    if optimizer is not None:
        shard["optimizer"] = _optimizer_by_name(optimizer, names)
    atomic_save(shard, os.path.join(directory, f"shard-{rank:05d}.pt"))
    if world > 1:
        dist.barrier()
    if rank == 0:
        meta = {"fxpipe": __version__, "shards": world, "step": step,
                "optimizer": optimizer is not None, "model": model}
        atomic_write(os.path.join(directory, META), json.dumps(meta, indent=2) + "\n")
    if world > 1:
        dist.barrier()


def load_checkpoint(directory: str) -> Checkpoint:
    """{"model": state_dict in the model's names, "optimizer": name-keyed state, "step": n}."""
    meta_path = os.path.join(directory, META)
    if not os.path.exists(meta_path):
        raise CheckpointError(f"{directory} has no {META}: not a checkpoint, or an incomplete one",
                              hint="save with program.save(directory) and let it finish")
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, Any] = {"state": {}, "param_groups": None}
    for rank in range(meta["shards"]):
        path = os.path.join(directory, f"shard-{rank:05d}.pt")
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint {directory} lacks {os.path.basename(path)} "
                                  f"({meta['shards']} shards expected)",
                                  hint="copy every shard-*.pt file of the checkpoint")
        shard = torch.load(path, map_location="cpu", weights_only=True)
        model.update(shard["model"])
        if "optimizer" in shard:
            optim["state"].update(shard["optimizer"]["state"])
            groups = shard["optimizer"]["param_groups"]
            if optim["param_groups"] is None:
                optim["param_groups"] = [dict(g, params=list(g["params"])) for g in groups]
            else:
                for mine, theirs in zip(optim["param_groups"], groups):
                    mine["params"] += [p for p in theirs["params"] if p not in mine["params"]]
    return {"model": model, "optimizer": optim if meta["optimizer"] else None,
            "step": meta.get("step")}


def restore(optimizer: torch.optim.Optimizer, by_name: Mapping[str, Any],
            names: dict[int, str]) -> None:
    """Loads a name-keyed optimizer state into an optimizer over (some of) those parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, p in enumerate(params):
        name = names[id(p)]
        if name in by_name["state"]:
            state[i] = by_name["state"][name]
    groups = []
    position = 0
    saved_groups = by_name["param_groups"] or []
    padded = saved_groups + [None] * len(optimizer.param_groups)
    for g, saved in zip(optimizer.param_groups, padded):
        count = len(g["params"])
        hyper = {k: v for k, v in (saved or g).items() if k != "params"}
        groups.append({**hyper, "params": list(range(position, position + count))})
        position += count
    optimizer.load_state_dict({"state": state, "param_groups": groups})

"""Checkpoints as transactions: a save is complete or absent, and a load checks every byte.

A checkpoint folder DIR holds one complete save and the manifest that names it:

    DIR/checkpoint.json              written last: format, step, the model's class and structure
                                     fingerprint (fxpipe.storage.structure), the optimizer's class,
                                     the save's folder and every shard's size and sha256
    DIR/checkpoint.lock              held by the one process saving (fxpipe.storage.savelock)
    DIR/save-000007/shard-00000.pt   one shard per rank: {"model": tensors by the model's
    DIR/save-000007/shard-00001.pt   state_dict keys, "optimizer": state by parameter names,
                                     "rng": its generators, "scaler": its GradScaler's state}

Every rank writes its shard into a new temporary folder DIR/.fxpipe-save-*.tmp and reports the
shard's size and sha256 to rank 0. Once every rank has, rank 0 renames the folder to the next
save-N and replaces checkpoint.json (an atomic rename): that is the moment the save counts.
Until then checkpoint.json names the previous save, whose folder goes only after. A process
killed at any moment leaves the previous checkpoint or the new one, never a mix, and a rank
that dies before its shard is written stops the save. The next save removes what a killed one
left behind: temporary files and folders, save-N folders checkpoint.json does not name, and
shards of the older layout (shard-*.pt beside checkpoint.json). One job at a time saves into a
folder: a second saver is refused, naming the first. A save into a folder that holds anything
but a checkpoint is refused too, as it would remove the entries it takes for its own.

A load reads checkpoint.json, checks each shard's size and sha256, reads it with
`weights_only=True` (all from one open file: a save that removes it meanwhile does not change
what is read) and merges the shards, so a checkpoint can be resumed by the same pipeline,
by another number of stages, or by the plain model; fxpipe.storage.resume fits it to the model and
optimizer that load it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from typing import Any, BinaryIO, TypedDict, TypeVar

import torch
import torch.distributed as dist

from fxpipe.errors import CheckpointError, FxPipeError
from fxpipe.sharding import optimizer_kind, whole_state_dict
from fxpipe.storage.files import (
    TEMP_PREFIX,
    TORCH_WRITE_FAILURES,
    atomic_write,
    fsync_folder,
    write_failed,
)
from fxpipe.storage.loss_scale import is_scaler_state
from fxpipe.storage.random_state import random_state
from fxpipe.storage.savelock import LOCK, hold_save_lock
from fxpipe.storage.structure import Structure
from fxpipe.version import __version__

__all__ = ["Checkpoint", "save_shard", "load_checkpoint", "FORMAT", "META"]

META = "checkpoint.json"
FORMAT = 2
_SAVE = re.compile(r"save-(\d{6,})")
_OLD_SHARD = re.compile(r"shard-\d{5}\.pt")
_T = TypeVar("_T")


class Checkpoint(TypedDict):
    """A loaded checkpoint, every tensor on the CPU."""

    model: dict[str, torch.Tensor]  # the model's state_dict names
    optimizer: dict[str, Any] | None  # optimizer state keyed by parameter names
    step: int | None
    path: str  # the checkpoint folder
    model_class: str  # the saved model's class name
    fingerprint: str  # its fxpipe.storage.structure fingerprint
    optimizer_class: str | None
    files: dict[str, str]  # state_dict key -> the shard file (in DIR) that holds it
    # each saving rank's generators (fxpipe.storage.random_state), None where it saved none
    rng: list[dict[str, Any] | None]
    # each saving rank's GradScaler state (fxpipe.storage.loss_scale), None where it saved none
    scaler: list[dict[str, Any] | None]


# -- saving ------------------------------------------------------------------------------------


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _optimizer_by_name(optimizer: torch.optim.Optimizer,
                       names: dict[int, str]) -> dict[str, Any] | None:
    """The optimizer's state keyed by parameter names; None on a replica that does not save
    the state of a sharded optimizer (fxpipe.sharding: the first replica saves it whole)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    raw = whole_state_dict(optimizer)
    if raw is None:
        return None
    index_to_name = {i: names[id(p)] for i, p in enumerate(params)}
    return {"state": {index_to_name[i]: s for i, s in raw["state"].items()},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                              "params": [index_to_name[i] for i in g["params"]]}
                             for g in raw["param_groups"]]}


def save_shard(directory: str, state: dict[str, torch.Tensor],
               optimizer: torch.optim.Optimizer | None,
               names: dict[int, str], *, step: int | None, structure: Structure,
               scaler: dict[str, Any] | None = None) -> None:
    """Saves one process's tensors (model names), optimizer state and (`scaler`) GradScaler
    state as part of one checkpoint; under torch.distributed every rank calls it, and it
    returns once the checkpoint is published (or raises on every rank when one rank failed)."""
    rank, world = _rank_world()
    lock: list[int] = []  # rank 0 holds the folder's save lock until the save is over
    try:
        tmp = _on_rank0(rank, world, lambda: _begin(directory, lock))
        shard: dict[str, Any] = {"model": {k: v.detach().cpu() for k, v in state.items()},
                                 "rng": random_state()}
        saved = _optimizer_by_name(optimizer, names) if optimizer is not None else None
        if saved is not None:
            shard["optimizer"] = saved
        if scaler is not None:
            shard["scaler"] = scaler
        kind = optimizer_kind(optimizer) if optimizer is not None and saved is not None \
            else None
        entries = _on_every_rank(rank, world,
                                 lambda: {**_write_shard(directory, tmp, rank, shard),
                                          "optimizer": kind},
                                 cleanup=lambda: shutil.rmtree(os.path.join(directory, tmp), True))
        # a rank whose stages hold no parameters has no optimizer, rank 0's included
        kinds = sorted({entry.pop("optimizer") for entry in entries} - {None})
        meta = {"format": FORMAT, "fxpipe": __version__, "step": step, "model": structure.model,
                "fingerprint": structure.fingerprint(),
                "optimizer": kinds[0] if kinds else None, "shards": entries}
        _on_rank0(rank, world, lambda: _publish(directory, tmp, meta))
    finally:
        for fd in lock:
            os.close(fd)


def _on_rank0(rank: int, world: int, fn: Callable[[], _T]) -> _T:
    """fn() on rank 0, its result on every rank; a failure raises on every rank."""
    outcome: list[Any] = [None, None]
    if rank == 0:
        try:
            outcome = [fn(), None]
        except Exception as e:
            if world == 1:
                raise
            outcome = [None, f"{type(e).__name__}: {e}"]
            _broadcast(outcome)
            raise
    if world > 1:
        outcome = _broadcast(outcome)
    if outcome[1] is not None:
        raise CheckpointError(f"rank 0 failed to save the checkpoint ({outcome[1]})",
                              hint="see rank 0's error; the previous checkpoint is unchanged")
    result: _T = outcome[0]
    return result


def _broadcast(payload: list[Any]) -> list[Any]:
    dist.broadcast_object_list(payload, src=0)
    return payload


def _on_every_rank(rank: int, world: int, fn: Callable[[], dict[str, Any]],
                   cleanup: Callable[[], None]) -> list[dict[str, Any]]:
    """fn() on every rank, all results on every rank; a failure anywhere raises everywhere
    (the rank that failed raises its own error) after rank 0 ran `cleanup`."""
    mine: tuple[dict[str, Any] | None, str | None]
    try:
        mine = (fn(), None)
    except Exception as e:
        if world == 1:
            cleanup()
            raise
        mine = (None, f"{type(e).__name__}: {e}")
        failure: BaseException | None = e
    else:
        failure = None
    gathered: list[Any] = [mine]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
    failed = [(r, why) for r, (_, why) in enumerate(gathered) if why is not None]
    if failed:
        if rank == 0:
            cleanup()
        if failure is not None:
            raise failure
        raise CheckpointError(f"rank {failed[0][0]} failed to write its shard ({failed[0][1]})",
                              hint="see that rank's error; the previous checkpoint is unchanged")
    return [entry for entry, _ in gathered]


def _begin(directory: str, lock: list[int]) -> str:
    """Takes the folder's save lock (into `lock`), removes what killed saves left, then makes
    this save's temporary folder (its name)."""
    _check_checkpoint_folder(directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot make the checkpoint folder {directory} ({e})",
                              hint="save into a folder this process can create") from None
    name = f"{TEMP_PREFIX}save-{secrets.token_hex(6)}.tmp"
    try:  # a full disk refuses even a new file or folder
        lock.append(hold_save_lock(directory))
        _remove_leftovers(directory, keep=_current_folder(directory))
        os.mkdir(os.path.join(directory, name))  # not mkdtemp: the umask sets who reads it
    except OSError as e:
        if isinstance(e, FxPipeError):
            raise
        raise write_failed(e.filename or directory, e) from e
    return name


def _check_checkpoint_folder(directory: str) -> None:
    """Refuses a file, and a folder that holds entries but no checkpoint (no checkpoint.json,
    and no save lock of a first save that was killed): a save would remove its save-*,
    shard-*.pt and .fxpipe-* entries as a killed save's leftovers."""
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"{directory} is a file, not a checkpoint folder",
                              hint="save into a new or empty folder")
    present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    if present and META not in present and LOCK not in present:
        shown = ", ".join(present[:5]) + (f", ... ({len(present) - 5} more)"
                                          if len(present) > 5 else "")
        raise CheckpointError(f"{directory} holds {shown} but no {META}: it is no checkpoint "
                              "folder, and a save there could remove what it holds",
                              hint="save into a new or empty folder, or into one that holds an "
                                   "fxpipe checkpoint")


def _write_shard(directory: str, tmp: str, rank: int, shard: dict[str, Any]) -> dict[str, Any]:
    name = f"shard-{rank:05d}.pt"
    path = os.path.join(directory, tmp, name)
    try:
        torch.save(shard, path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not any(m in str(e) for m in TORCH_WRITE_FAILURES):
            raise
        raise write_failed(path, e) from e
    return {"file": name, "bytes": os.path.getsize(path), "sha256": _sha256(path)}


def _publish(directory: str, tmp: str, meta: dict[str, Any]) -> None:
    """Gives the complete save its name, then points checkpoint.json at it (the commit)."""
    numbers = [int(m.group(1)) for n in os.listdir(directory) if (m := _SAVE.fullmatch(n))]
    folder = f"save-{max(numbers, default=0) + 1:06d}"
    fsync_folder(os.path.join(directory, tmp))
    os.rename(os.path.join(directory, tmp), os.path.join(directory, folder))
    fsync_folder(directory)
    atomic_write(os.path.join(directory, META), json.dumps({**meta, "folder": folder}, indent=2)
                 + "\n")
    fsync_folder(directory)
    _remove_leftovers(directory, keep=folder)


def _current_folder(directory: str) -> str | None:
    """The save checkpoint.json names (None without a readable one: nothing to keep)."""
    try:
        folder: str = _read_meta(directory)["folder"]
    except FxPipeError:
        return None
    return folder


def _remove_leftovers(directory: str, *, keep: str | None) -> None:
    """Removes temporary files and folders, saves other than `keep`, and shards of the older
    layout (which this fxpipe does not read)."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        temporary = name.startswith(TEMP_PREFIX) and name.endswith(".tmp")  # saves' and writes'
        if temporary or (_SAVE.fullmatch(name) and name != keep):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
        elif _OLD_SHARD.fullmatch(name):
            os.remove(path)
    fsync_folder(directory)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return _sha256_of(f)


def _sha256_of(f: BinaryIO) -> str:
    digest = hashlib.sha256()
    while block := f.read(1 << 20):
        digest.update(block)
    return digest.hexdigest()


# -- loading -----------------------------------------------------------------------------------


def load_checkpoint(directory: str) -> Checkpoint:
    """Reads the checkpoint checkpoint.json names, every shard checked against its size and
    sha256: {"model": state_dict in the model's names, "optimizer": name-keyed state, "step": n,
    ...}. Raises CheckpointError naming the file when anything is missing or damaged."""
    meta = _read_meta(directory)
    for _ in range(3):  # a save that finishes while we read removes the folder we read from
        try:
            return _read_shards(directory, meta)
        except FileNotFoundError:
            again = _read_meta(directory)
            if again == meta:
                break
            meta = again
    folder = os.path.join(directory, meta["folder"])
    present = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    missing = [e["file"] for e in meta["shards"] if e["file"] not in present]
    lacking = f"{meta['folder']}/{missing[0] if missing else '?'}"
    raise CheckpointError(f"checkpoint {directory} lacks {lacking} ({len(meta['shards'])} "
                          f"shards expected, found {len(present)})",
                          hint="copy the whole checkpoint folder, save-* folder included")


def _read_meta(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, META)
    if not os.path.exists(path):
        raise CheckpointError(f"{directory} has no {META}: not a checkpoint, or one whose "
                              "first save did not finish",
                              hint="save with program.save(directory) and let it finish")
    try:
        with open(path, encoding="utf-8") as f:
            meta: dict[str, Any] = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read as JSON ({type(e).__name__}: {e})",
                              hint="the checkpoint is damaged: restore the file from a copy, "
                                   "or save the checkpoint again") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is malformed: a JSON {type(meta).__name__}, not an object",
                              hint="the checkpoint is damaged: restore the file from a copy, "
                                   "or save the checkpoint again")
    found = meta.get("format", 1)
    if found != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {found!r}, this fxpipe reads "
                              f"format {FORMAT}",
                              hint="save the checkpoint again with this fxpipe version")
    _check_fields(path, meta)
    return meta


_FIELDS: dict[str, tuple[type, ...]] = {
    "step": (int, type(None)), "model": (str,), "fingerprint": (str,),
    "optimizer": (str, type(None)), "folder": (str,), "shards": (list,)}
_SHARD_FIELDS: dict[str, type] = {"file": str, "bytes": int, "sha256": str}


def _check_fields(path: str, meta: dict[str, Any]) -> None:
    bad = [f"{k}={meta.get(k)!r} (expected {' or '.join(t.__name__ for t in types)})"
           for k, types in _FIELDS.items() if not isinstance(meta.get(k), types)]
    if not bad:
        bad = [f"shards[{i}]={entry!r:.80}" for i, entry in enumerate(meta["shards"])
               if not isinstance(entry, dict)
               or any(not isinstance(entry.get(k), t) for k, t in _SHARD_FIELDS.items())
               or os.path.basename(entry["file"]) != entry["file"]]
        if not _SAVE.fullmatch(meta["folder"]) or not meta["shards"]:
            bad.append(f"folder={meta['folder']!r}, {len(meta['shards'])} shards")
    if bad:
        raise CheckpointError(f"{path} is malformed: {'; '.join(bad)}",
                              hint="the checkpoint is damaged: restore the file from a copy, "
                                   "or save the checkpoint again")


def _read_shards(directory: str, meta: dict[str, Any]) -> Checkpoint:
    model: dict[str, torch.Tensor] = {}
    files: dict[str, str] = {}
    optim: dict[str, Any] = {"state": {}, "param_groups": None}
    rng: list[dict[str, Any] | None] = []
    scalers: list[dict[str, Any] | None] = []
    for entry in meta["shards"]:
        name = f"{meta['folder']}/{entry['file']}"
        shard = _read_shard(os.path.join(directory, name), entry)
        model.update(shard["model"])
        rng.append(shard.get("rng"))
        scalers.append(shard.get("scaler"))
        files.update(dict.fromkeys(shard["model"], name))
        if "optimizer" in shard:
            optim["state"].update(shard["optimizer"]["state"])
            groups = shard["optimizer"]["param_groups"]
            if optim["param_groups"] is None:
                optim["param_groups"] = [dict(g, params=list(g["params"])) for g in groups]
            else:
                for mine, theirs in zip(optim["param_groups"], groups):
                    mine["params"] += [p for p in theirs["params"] if p not in mine["params"]]
    return {"model": model, "optimizer": optim if meta["optimizer"] else None,
            "step": meta["step"], "path": directory, "model_class": meta["model"],
            "fingerprint": meta["fingerprint"], "optimizer_class": meta["optimizer"],
            "files": files, "rng": rng, "scaler": scalers}


def _read_shard(path: str, entry: dict[str, Any]) -> dict[str, Any]:
    """One shard, checked and read through one open file: a save that removes the file after
    it was opened (a concurrent save publishing) does not change what is read."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - FileNotFoundError: the caller looks again
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e.strerror})",
                              hint="restore the shard from a copy, or save the checkpoint "
                                   "again") from None
    with f:
        return _read_open_shard(path, f, entry)


def _read_open_shard(path: str, f: BinaryIO, entry: dict[str, Any]) -> dict[str, Any]:
    size = os.fstat(f.fileno()).st_size
    hint = "the shard is damaged: restore it from a copy, or save the checkpoint again"
    if size != entry["bytes"]:
        raise CheckpointError(f"{path}: {size} bytes, checkpoint.json says {entry['bytes']} "
                              "(truncated or replaced)", hint=hint)
    digest = _sha256_of(f)
    if digest != entry["sha256"]:
        raise CheckpointError(f"{path}: sha256 {digest[:16]}..., checkpoint.json says "
                              f"{entry['sha256'][:16]}... (its bytes changed after the save)",
                              hint=hint)
    f.seek(0)
    try:
        shard = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling fails in many ways, all mean "damaged"
        raise CheckpointError(f"{path} cannot be read as a checkpoint shard "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                              hint=hint) from None
    if not (isinstance(shard, dict) and isinstance(shard.get("model"), dict)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                    for k, v in shard["model"].items())
            and _is_optimizer_state(shard.get("optimizer", {"state": {}, "param_groups": []}))
            and _is_random_state(shard.get("rng", {"cpu": torch.empty(0), "cuda": []}))
            and is_scaler_state(shard.get("scaler"))):
        raise CheckpointError(f"{path} holds a {type(shard).__name__}, not an fxpipe shard "
                              "({'model': {key: tensor}, 'optimizer': ...})", hint=hint)
    result: dict[str, Any] = shard
    return result


def _is_random_state(value: object) -> bool:
    return (isinstance(value, dict) and isinstance(value.get("cpu"), torch.Tensor)
            and isinstance(value.get("cuda"), list)
            and all(isinstance(t, torch.Tensor) for t in value["cuda"]))


def _is_optimizer_state(value: object) -> bool:
    return (isinstance(value, dict) and isinstance(value.get("state"), dict)
            and isinstance(value.get("param_groups"), list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                    for g in value["param_groups"]))

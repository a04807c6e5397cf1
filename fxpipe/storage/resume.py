"""Fitting a loaded checkpoint to the model and optimizer that resume from it, strictly.

A strict load refuses a checkpoint of another model (class or structure fingerprint), keys the
model does not have or that this process needs and the checkpoint lacks, tensors of another
shape or dtype (copying would broadcast or cast them), and optimizer state of another class or
none at all when an optimizer is passed. `strict=False` loads what fits and warns, naming
every key and parameter it skipped. Integrity (sizes, checksums, readable shards) is checked
by fxpipe.storage.checkpoint either way.
"""
from __future__ import annotations

import warnings
from collections.abc import Collection, Iterable
from typing import Any

import torch

from fxpipe.errors import CheckpointError
from fxpipe.sharding import current_state, optimizer_kind, shard_state
from fxpipe.storage.checkpoint import Checkpoint
from fxpipe.storage.structure import Structure, TensorSpec

__all__ = ["fit_state", "restore_optimizer"]

_SHOWN = 20  # problems listed in one message


def _complain(strict: bool, fact: str, problems: list[str], hint: str) -> None:
    lines = [f"  - {p}" for p in problems[:_SHOWN]]
    if len(problems) > _SHOWN:
        lines.append(f"  - ... and {len(problems) - _SHOWN} more")
    message = "\n".join([fact, *lines])
    if strict:
        raise CheckpointError(message, hint=hint)
    warnings.warn(f"{message}\nloaded the rest (strict=False)", UserWarning, stacklevel=3)


def fit_state(checkpoint: Checkpoint, expected: Structure, needed: Iterable[str], *,
              strict: bool = True) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors that fit `expected` (the loading model's structure).

    needed: the keys this process loads (its stages' tensors); a missing one is a problem.
    Raises CheckpointError listing every problem (strict), or warns and leaves them out.
    """
    problems = []
    if checkpoint["model_class"] != expected.model:
        problems.append(f"model: {checkpoint['model_class']} in checkpoint.json, this model is "
                        f"{expected.model}")
    fits = {}
    for key, tensor in sorted(checkpoint["model"].items()):
        file, want, found = checkpoint["files"][key], expected.tensors.get(key), \
            TensorSpec.of(tensor)
        if want is None:
            problems.append(f"unexpected key {key} in {file} ({found}): {expected.model} has no "
                            "such key")
        elif want != found:
            problems.append(f"{key} in {file}: expected {want}, found {found}")
        else:
            fits[key] = tensor
    for key in sorted(set(needed) - set(checkpoint["model"])):
        want = expected.tensors.get(key)
        problems.append(f"missing key {key}: expected {want}, found none in any shard")
    mine, theirs = expected.fingerprint()[:16], checkpoint["fingerprint"][:16]
    if not problems and mine != theirs:
        absent = sorted(set(expected.tensors) - set(checkpoint["model"]))
        problems.append(f"structure fingerprint: expected {mine}, found {theirs} in "
                        "checkpoint.json" + (f" (the checkpoint lacks {', '.join(absent[:5])})"
                                             if absent else ""))
    if problems:
        count = f"{len(problems)} problem" + ("s" if len(problems) > 1 else "")
        _complain(strict, f"checkpoint {checkpoint['path']} does not fit this {expected.model} "
                          f"(structure fingerprint {mine}, the checkpoint's {theirs}; {count}):"
                  if mine != theirs else
                  f"checkpoint {checkpoint['path']} does not fit this {expected.model} "
                  f"({count}):", problems,
                  hint="load it into the model it was saved from; program.load(dir, "
                       "strict=False) loads only the tensors that fit and warns about the rest")
    return fits


def restore_optimizer(optimizer: torch.optim.Optimizer, checkpoint: Checkpoint,
                      names: dict[int, str], *, strict: bool = True,
                      skip: Collection[str] = ()) -> None:
    """Loads the checkpoint's name-keyed optimizer state into an optimizer over (some of) its
    parameters (names: id(parameter) -> canonical key). skip: keys whose model tensors were
    not loaded, so their state is not either (strict=False); a parameter not restored keeps
    the state it has."""
    kind, saved = optimizer_kind(optimizer), checkpoint["optimizer"]
    where = f"{checkpoint['path']}/checkpoint.json"
    if saved is None or checkpoint["optimizer_class"] != kind:
        found = "none (saved without optimizer=)" if saved is None \
            else f"{checkpoint['optimizer_class']} state"
        _complain(strict, f"{where}: optimizer: expected {kind} state, found {found}; the "
                          "optimizer is left as it is", [],
                  hint=f"resume with the optimizer the checkpoint was saved with, save with "
                       f"optimizer=, or load without optimizer= to start a fresh {kind}")
        return
    group_of = {p: i for i, g in enumerate(saved["param_groups"] or []) for p in g["params"]}
    current = current_state(optimizer)  # kept for the parameters not restored
    problems, state, groups, position = [], {}, [], 0
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            name = names[id(p)]
            if name not in group_of:
                problems.append(f"parameter {name}: not in the checkpoint's {kind}")
            elif group_of[name] != i:
                problems.append(f"parameter {name}: in param group {i}, in group "
                                f"{group_of[name]} of the checkpoint")
            restored = group_of.get(name) == i and name not in skip
            if restored and name in saved["state"]:
                state[position] = saved["state"][name]
            elif not restored and position in current:
                state[position] = current[position]
            position += 1
    if problems:
        _complain(strict, f"{where}: the saved {kind} does not fit this optimizer:", problems,
                  hint="make the optimizer over the same parameters and param groups as the "
                       "one saved")
    saved_groups: list[Any] = list(saved["param_groups"] or [])
    position = 0
    for i, group in enumerate(optimizer.param_groups):
        source = saved_groups[i] if i < len(saved_groups) else group
        count = len(group["params"])
        groups.append({**{k: v for k, v in source.items() if k != "params"},
                       "params": list(range(position, position + count))})
        position += count
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    shard_state(optimizer)  # shard="full": each replica keeps its part of the whole state

"""Where a written program's stages get their tensors: weights.pt, a checkpoint, or the model's
initializers.

A program written from a model with weights carries them (weights.pt). One written from a model
built on the meta device carries none: `--weights PATH` reads each rank's own tensors from a
checkpoint by the model's state_dict names, `--init` runs the model's initializers on them
(model.pt is the model without data, pickled, so this imports the model's code). Tensors no
checkpoint holds (non-persistent buffers, constants of the graph) come from state.pt, computed
when the program was written. weights.json (fxpipe.writer.write_weights) says which files exist
and lists every tensor's shape and dtype; program.json's structure holds the model's state_dict
keys.
"""
from __future__ import annotations

import ast
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxpipe.errors import CheckpointError, ProgramFolderError
from fxpipe.runtime.program.loading import load_named
from fxpipe.runtime.program.materialize import initialize
from fxpipe.runtime.program.spec import ProgramSpec
from fxpipe.runtime.program.spec_json import REWRITE_HINT
from fxpipe.runtime.stage import StageModule
from fxpipe.storage.state import StateNames
from fxpipe.storage.structure import Structure
from fxpipe.storage.weights import open_weights

__all__ = ["stage_tensors", "check_names", "check_written"]


def _info(folder: Path) -> dict[str, Any]:
    path = folder / "weights.json"
    if not path.exists():  # written before weights.json existed: weights.pt holds everything
        return {"weights": "weights.pt", "state": None, "model": None, "tensors": None}
    with open(path, encoding="utf-8") as f:
        info: dict[str, Any] = json.load(f)
    return info


def _load(path: Path) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = torch.load(path, map_location="cpu", weights_only=True,
                                                 mmap=True)
    return loaded


def _template(entry: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, str(entry["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {entry['dtype']!r} in weights.json",
                              hint="write the program again with this fxpipe version")
    empty = torch.empty([int(d) for d in entry["shape"]], dtype=dtype, device="meta")
    if entry["parameter"]:
        return nn.Parameter(empty, requires_grad=bool(entry["requires_grad"]))
    return empty


def stage_tensors(folder: Path, classes: Sequence[type[StageModule]], names: StateNames,
                  device: torch.device, *, weights: str | os.PathLike[str] | None = None,
                  init: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensors the stage classes bind, by qualified name, on `device` (read for these
    stages only when they come from a checkpoint or the initializers)."""
    info = _info(folder)
    wanted = sorted({q for cls in classes for q in cls.qualified_names().values()})
    own = info.get("weights")
    if weights is None and not init:
        if own is None:
            raise CheckpointError(
                "this program was written from a model on the meta device, without weights",
                hint="run it with --weights PATH (a checkpoint of the model: a state dict, a "
                     ".safetensors file or a save_pretrained folder) or with --init")
        base = _load(folder / own)
        return {q: base[q].to(device) for q in wanted if q in base}
    base = _load(folder / (own or info["state"]))
    templates = _templates(info, wanted)
    in_file = {q: t for q, t in templates.items() if names.keys.get(q)}
    out = {q: base[q].to(device) for q in wanted if q not in in_file and q in base}
    devices = dict.fromkeys(in_file, device)
    if weights is not None:
        known = info.get("state_keys") or [k for keys in names.keys.values() for k in keys]
        out.update(load_named(open_weights(weights), in_file, names.keys, devices,
                              known=known))
    else:
        model = _skeleton(folder, info)
        out.update(initialize(model, {q: _resolve(model, q) for q in in_file}, device,
                              seed=seed))
    return out


def check_written(folder: Path, spec: ProgramSpec) -> None:
    """Checks what program.json says about the stages' tensors against the stage files and
    weights.json (both recorded by digest): the tensor names (check_names) and the tied
    parameters, whose gradients the ranks that hold them must add up."""
    check_names(folder, spec.aliases, spec.structure)
    holders: dict[str, list[int]] = {}
    for stage in spec.stages:
        for qualname in sorted(set(_parameters(folder / stage.file, stage.class_name))):
            holders.setdefault(qualname, []).append(stage.index)
    tied = {q: stages for q, stages in holders.items() if len(stages) > 1}
    listed = [sorted(stages) for stages in spec.shared.values()]
    missing = [f"{q!r} (stages {stages})" for q, stages in sorted(tied.items())
               if stages not in listed]
    if missing:
        raise ProgramFolderError(
            f"{folder}/program.json: the field shared is {spec.shared!r}, but the stage files "
            f"bind the parameters {', '.join(missing)} in several stages (was it edited by "
            "hand?): their gradients would not be added up", hint=REWRITE_HINT)


def _parameters(path: Path, class_name: str) -> list[str]:
    """The model names of the parameters a stage file's class binds (its PARAMETERS literal),
    read without running the file."""
    try:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name == class_name:
                for item in node.body:
                    if isinstance(item, ast.Assign) and any(
                            isinstance(t, ast.Name) and t.id == "PARAMETERS" for t in item.targets):
                        value = ast.literal_eval(item.value)
                        if isinstance(value, dict):
                            return [str(v) for v in value.values()]
    except (SyntaxError, ValueError, UnicodeDecodeError) as e:
        raise ProgramFolderError(f"{path} is no stage file fxpipe wrote ({type(e).__name__}: "
                                 f"{e})", hint=REWRITE_HINT) from None
    return []


def check_names(folder: Path, aliases: Mapping[str, Sequence[str]],
                structure: Structure | None = None, *,
                info: dict[str, Any] | None = None) -> None:
    """Checks program.json's aliases (a tensor a stage binds -> the model's state_dict keys for
    it, where they are not its own name alone) against weights.json and the model's structure.
    --save and --resume write and read every tensor under these keys, so an edited map would
    swap weights without a word."""
    info = _info(folder) if info is None else info
    tensors = info.get("tensors")
    # the model's keys: program.json's structure (weights.json listed them before it was kept)
    state_keys = list(structure.tensors) if structure is not None else info.get("state_keys")
    if not isinstance(tensors, dict) or not isinstance(state_keys, list):
        return  # written before weights.json listed them: nothing to check against
    known = set(state_keys)
    names = StateNames.completed(aliases, state_keys)
    problems: list[str] = []
    owner: dict[str, str] = {}
    problems += [f"aliases names {q!r}, which no stage binds" for q in sorted(aliases)
                 if q not in tensors]
    for q, keys in sorted(names.keys.items()):
        if q not in tensors and q not in aliases:
            continue  # a key of the model that no stage binds
        if q in known and q not in keys:
            problems.append(f"aliases[{q!r}] is {list(keys)}, without {q!r}: the model's own "
                            "name for that tensor")
        for key in keys:
            if key not in known:
                problems.append(f"aliases[{q!r}] holds {key!r}, which is no state_dict key of "
                                "the model")
            elif key in owner:
                problems.append(f"aliases gives {key!r} to both {owner[key]!r} and {q!r}")
            owner.setdefault(key, q)
            spec = structure.tensors.get(key) if structure is not None else None
            entry = tensors.get(q)
            bound = (entry.get("dtype"), list(entry.get("shape", []))) \
                if isinstance(entry, dict) else None
            if spec is not None and bound is not None and bound != (spec.dtype, list(spec.shape)):
                problems.append(f"aliases[{q!r}] holds {key!r}, a {spec} in the model, but {q} is "
                                f"a {bound[0]}{bound[1]}")
    problems += [f"aliases lacks {q!r}, a tensor the stages bind and a state_dict key of the model"
                 for q in sorted(tensors) if q in known and q not in names.keys]
    if problems:
        raise ProgramFolderError(
            f"{folder}/program.json: the field aliases does not agree with weights.json and the "
            "stages (was it edited by hand?): " + "; ".join(problems[:6])
            + (f"; and {len(problems) - 6} more" if len(problems) > 6 else ""),
            hint=REWRITE_HINT)


def _templates(info: dict[str, Any], wanted: list[str]) -> dict[str, torch.Tensor]:
    """Meta tensors with each wanted tensor's shape, dtype and kind, from weights.json."""
    described = info.get("tensors")
    if described is None:
        raise CheckpointError("this program was written by an older fxpipe, without "
                              "weights.json, so --weights and --init cannot check its tensors",
                              hint="write the program again")
    return {q: _template(described[q]) for q in wanted}


def _skeleton(folder: Path, info: dict[str, Any]) -> nn.Module:
    if info.get("model") is None:
        reason = info.get("model_error")
        raise CheckpointError(
            "--init needs the model's initializers, and this program was written without "
            "model.pt" + (f" (pickling the model failed: {reason})" if reason else
                          " (its model had weights, which weights.pt holds)"),
            hint="run it with --weights PATH, or without --init")
    model = torch.load(folder / str(info["model"]), weights_only=False)
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"model.pt holds a {type(model).__name__}, not a module",
                              hint="write the program again")
    return model


def _resolve(model: nn.Module, qualname: str) -> torch.Tensor:
    owner, _, attr = qualname.rpartition(".")
    value = getattr(model.get_submodule(owner) if owner else model, attr)
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{qualname} is not a tensor of the model in model.pt",
                              hint="write the program again")
    return value

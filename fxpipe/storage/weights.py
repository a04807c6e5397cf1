"""A model's weights read by its state_dict names, one tensor at a time, straight to a device.

Three layouts are understood:

    a torch state dict      model.pt / pytorch_model.bin: torch.load(mmap=True, weights_only=True)
    a safetensors file      model.safetensors: safe_open, one tensor per read
    a folder                what transformers' save_pretrained writes: model.safetensors or
                            pytorch_model.bin, or shards listed in *.index.json ("weight_map")

Only the names and shapes of the whole checkpoint are read up front (headers, the index, the
pickle's metadata); a tensor's bytes are read when a process asks for it, so a process that
holds one stage reads only that stage's tensors. A safetensors read copies chunks of at most
CHUNK_BYTES, reopening the file for each, so the pages it mapped are released after the copy and
the process's peak memory grows with what it keeps, not with the file or its largest tensor.

Whatever is wrong with a file (a damaged or lying safetensors header, a malformed index, an
index naming a file outside its folder, a link to a device) is a CheckpointError naming it.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fxpipe.errors import CheckpointError

__all__ = ["WeightsSource", "open_weights", "match_names", "INDEX_FILES", "SINGLE_FILES"]

INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_FILES = ("model.safetensors", "pytorch_model.bin", "model.pt", "model.bin")
CHUNK_BYTES = 32 * 2**20  # the most a safetensors read maps at once

_HINT = ("pass a torch state dict (torch.save(model.state_dict(), path)), a .safetensors file, "
         "or a folder written by save_pretrained")


@dataclass
class WeightsSource:
    """Where every tensor of a checkpoint lies; `read` fetches one."""

    path: str
    files: dict[str, str]  # state_dict key -> the file that holds it
    shapes: dict[str, tuple[int, ...]]
    _torch_files: dict[str, Mapping[str, torch.Tensor]]  # memory-mapped, read lazily

    @staticmethod
    def of_state_dict(state: Mapping[str, torch.Tensor]) -> WeightsSource:
        """A state dict already in memory (an fxpipe checkpoint's "model"), read the same way."""
        return WeightsSource("<state dict>", dict.fromkeys(state, "<state dict>"),
                             {k: tuple(v.shape) for k, v in state.items()},
                             {"<state dict>": state})

    def keys(self) -> list[str]:
        return sorted(self.files)

    def read(self, key: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The tensor `key` on `device` in `dtype`, in memory of its own (not the file's)."""
        file = self.files[key]
        shape = self.shapes[key]
        out = torch.empty(shape, dtype=dtype, device=device)
        with torch.no_grad():
            if not file.endswith(".safetensors"):
                out.copy_(self._torch_files[file][key])
                return out
            rows = shape[0] if shape else 1
            row_bytes = out.element_size() * max(math.prod(shape[1:]), 1)
            step = max(1, CHUNK_BYTES // row_bytes)
            for start in range(0, rows, step):
                # Reopened per chunk: the pages a chunk mapped are released before the next,
                # so reading adds at most one chunk to this process's memory.
                try:
                    with _safe_open(file) as f:
                        if not shape:
                            out.copy_(f.get_tensor(key))
                        else:
                            out[start:start + step].copy_(f.get_slice(key)[start:start + step])
                except CheckpointError:
                    raise
                except Exception as e:  # noqa: BLE001 - safetensors' errors have no common base
                    raise _damaged(file, f"reading {key!r}", e) from None
        return out


def open_weights(path: str | os.PathLike[str]) -> WeightsSource:
    """Reads the names and shapes of a checkpoint's tensors (not their data)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"no weights at {path!r}", hint=_HINT)
    files = _weight_files(path)
    source = WeightsSource(path, {}, {}, {})
    for file in files:
        if file.endswith(".safetensors"):
            _index_safetensors(file, source)
        else:
            _index_torch(file, source)
    if not source.files:
        raise CheckpointError(f"{path!r} holds no tensors", hint=_HINT)
    return source


def _weight_files(path: str) -> list[str]:
    if not os.path.isdir(path):
        return [_regular(path, path)]
    for name in INDEX_FILES:
        index = os.path.join(path, name)
        if os.path.exists(index):
            return [_regular(os.path.join(path, file), index) for file in _index_files(index)]
    for name in SINGLE_FILES:
        if os.path.exists(os.path.join(path, name)):
            return [_regular(os.path.join(path, name), os.path.join(path, name))]
    found = sorted(os.listdir(path))[:8]
    raise CheckpointError(f"found no weights in the folder {path!r} (it holds {found})",
                          hint=f"expected one of {[*INDEX_FILES, *SINGLE_FILES]}; {_HINT}")


def _regular(file: str, named_by: str) -> str:
    """`file`, refused unless it is a regular file (not a device such as /dev/zero, a link
    to one, or a missing shard)."""
    if not os.path.isfile(file):
        what = "does not exist" if not os.path.lexists(file) else "is not a regular file" + (
            f" (a link to {os.path.realpath(file)})" if os.path.islink(file) else "")
        raise CheckpointError(f"{file} {what}" + (f", and {named_by} names it"
                                                  if named_by != file else ""), hint=_HINT)
    return file


def _index_files(index: str) -> list[str]:
    """The shard files an index (model.safetensors.index.json) names, each a plain name or a
    path inside the index's folder: a name leading out of it is refused, not followed."""
    hint = "write the checkpoint again with save_pretrained, or restore the index from a copy"
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{index} cannot be read as JSON ({type(e).__name__}: {e})",
                              hint=hint) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has no weight_map (an object of tensor name -> file), "
                              f"it holds a JSON {type(data).__name__}"
                              + (f" with keys {sorted(data)[:8]}" if isinstance(data, dict)
                                 else ""), hint=hint)
    bad = sorted({f"{k!r}: {v!r}" for k, v in weight_map.items() if not isinstance(v, str)})
    if bad:
        raise CheckpointError(f"{index}: weight_map entries name no file: {', '.join(bad[:5])}",
                              hint=hint)
    files = sorted(set(weight_map.values()))
    outside = [f for f in files if not f or os.path.isabs(f)
               or os.path.normpath(f).split(os.sep)[0] == os.pardir or "\0" in f]
    if outside:
        raise CheckpointError(f"{index} names files outside its folder: {', '.join(outside[:5])}",
                              hint="an index names its shards by their names in its own folder; "
                                   "move the shards there and name them so")
    return files


def _damaged(file: str, doing: str, error: Exception) -> CheckpointError:
    cause = str(error).splitlines()[0] if str(error) else ""
    return CheckpointError(f"cannot read the safetensors file {file!r} ({doing}): "
                           f"{type(error).__name__}: {cause} - the file is damaged, truncated or "
                           "not safetensors", hint="restore the file from a copy, or save the "
                                                   "checkpoint again")


def _safe_open(file: str, device: str = "cpu") -> Any:
    """safetensors' reader of one file (an optional dependency, imported when one is read)."""
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise CheckpointError(f"reading {file!r} needs the safetensors package",
                              hint="pip install safetensors") from e
    return safe_open(file, framework="pt", device=device)


def _index_safetensors(file: str, source: WeightsSource) -> None:
    try:
        with _safe_open(file) as f:
            for key in f.keys():
                _add(source, key, file, tuple(f.get_slice(key).get_shape()))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' errors have no common base
        raise _damaged(file, "reading its header", e) from None


def _index_torch(file: str, source: WeightsSource) -> None:
    try:
        loaded: Any = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # files in torch's legacy (non-zip) format cannot be memory-mapped
        loaded = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling errors come in many kinds
        raise CheckpointError(f"cannot read {file!r} as a torch state dict: {e}",
                              hint=_HINT) from e
    if not isinstance(loaded, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
        kind = type(loaded).__name__
        keys = list(loaded)[:5] if isinstance(loaded, Mapping) else []
        raise CheckpointError(f"{file!r} holds a {kind} {keys}, not a state dict of tensors",
                              hint=_HINT)
    source._torch_files[file] = loaded
    for key, value in loaded.items():
        _add(source, key, file, tuple(value.shape))


def _add(source: WeightsSource, key: str, file: str, shape: tuple[int, ...]) -> None:
    if key in source.files and source.files[key] != file:
        raise CheckpointError(f"the tensor {key!r} is in two files: {source.files[key]!r} and "
                              f"{file!r}", hint="remove the stale shard")
    source.files[key] = file
    source.shapes[key] = shape


def match_names(available: Collection[str], wanted: Mapping[str, tuple[str, ...]],
                known: Collection[str], *, strict: bool = True) -> dict[str, str]:
    """Which checkpoint key each wanted tensor reads: the first of its model keys (a tied weight
    has several) that the checkpoint holds.

    Raises CheckpointError naming every wanted tensor none of whose keys is in the checkpoint,
    and (when strict) every checkpoint key the model does not have (`known`).
    """
    chosen: dict[str, str] = {}
    missing: list[str] = []
    present = set(available)
    for name, keys in sorted(wanted.items()):
        key = next((k for k in keys if k in present), None)
        if key is None:
            missing.append(" or ".join(keys) if len(keys) > 1 else keys[0])
        else:
            chosen[name] = key
    extra = sorted(present - set(known)) if strict else []
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensors of the model are missing: "
                         f"{_listing(missing)}")
        if extra:
            parts.append(f"{len(extra)} names are not the model's: {_listing(extra)}")
        raise CheckpointError(
            "the checkpoint does not match the model: " + "; ".join(parts),
            hint="load a checkpoint of this model (names as in model.state_dict()); "
                 "strict=False ignores names the model does not have" if extra else
                 "load a checkpoint of this model (names as in model.state_dict())")
    return chosen


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")

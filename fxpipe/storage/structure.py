"""The shape of a model's state, which a checkpoint records so that loading can check it.

A Structure is the model's class name and, for every state_dict key, the tensor's shape and
dtype. Its fingerprint (sha256 of the sorted (key, shape, dtype) list) is written into every
checkpoint; a checkpoint whose model or fingerprint differs from the loading model's was saved
from another model. A written program keeps its model's Structure in program.json.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fxpipe.errors import CheckpointError

__all__ = ["Structure", "TensorSpec"]


@dataclass(frozen=True)
class TensorSpec:
    """A tensor without its values."""

    shape: tuple[int, ...]
    dtype: str  # "float32", as torch prints it without the "torch." prefix

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(int(d) for d in tensor.shape),
                          str(tensor.dtype).removeprefix("torch."))

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class Structure:
    """A model's class name and its state_dict's keys, shapes and dtypes."""

    model: str
    tensors: Mapping[str, TensorSpec]

    @staticmethod
    def of_state(model: str, state: Mapping[str, torch.Tensor]) -> Structure:
        return Structure(model, {k: TensorSpec.of(v) for k, v in sorted(state.items())})

    def fingerprint(self) -> str:
        rows = [[k, list(s.shape), s.dtype] for k, s in sorted(self.tensors.items())]
        return hashlib.sha256(json.dumps(rows).encode()).hexdigest()

    def to_json(self) -> dict[str, object]:
        return {"model": self.model,
                "tensors": {k: [list(s.shape), s.dtype] for k, s in sorted(self.tensors.items())}}

    @staticmethod
    def from_json(data: object, *, where: str) -> Structure:
        """Reads what to_json wrote; `where` names the file in the error a bad entry raises."""
        model = data.get("model") if isinstance(data, dict) else None
        tensors = data.get("tensors") if isinstance(data, dict) else None
        try:
            if not isinstance(model, str) or not isinstance(tensors, dict):
                raise TypeError(f"expected {{'model': str, 'tensors': dict}}, found {data!r:.80}")
            return Structure(model, {str(k): TensorSpec(tuple(int(d) for d in shape), str(dtype))
                                     for k, (shape, dtype) in tensors.items()})
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: the model structure is malformed ({e})",
                                  hint="write it again with this fxpipe version") from None

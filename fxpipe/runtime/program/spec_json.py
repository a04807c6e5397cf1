"""program.json's fields as fxpipe writes them: the JSON shape of the runtime plan
(fxpipe.runtime.program.spec.ProgramSpec), which fxpipe.runtime.program.spec_check checks a file
against before anything reads it. Shapes are integer polynomial coefficients in the micro-batch size
b, dtypes by name."""
from __future__ import annotations

from typing import Literal, TypeAlias, TypedDict

import torch

from fxpipe.runtime.planning.timeline import EventJSON

__all__ = ["Constant", "SizeJSON", "TensorJSON", "TupleJSON", "ScalarJSON", "ValueJSON",
           "LeafJSON", "SignatureJSON", "CommJSON", "StageJSON", "ProgramJSON", "DTYPES",
           "REWRITE_HINT"]

SizeJSON: TypeAlias = list[int] | int | float
"""A size: integer polynomial coefficients in b (constant first), or a constant."""
Constant: TypeAlias = bool | int | float | str | None
"""A value JSON writes as it is."""


class TensorJSON(TypedDict):
    kind: Literal["tensor"]
    shape: list[SizeJSON]
    dtype: str  # without the "torch." prefix
    batch_dim: int | None
    requires_grad: bool


class TupleJSON(TypedDict):
    kind: Literal["tuple"]
    items: list[ValueJSON]


class ScalarJSON(TypedDict):
    kind: Literal["scalar"]
    value: SizeJSON | bool | None


ValueJSON: TypeAlias = TensorJSON | TupleJSON | ScalarJSON
"""An ir.ValueInfo crossing stages."""


class LeafJSON(TypedDict):
    name: str
    is_tensor: bool
    dtype: str | None
    shape: list[int]
    batch_dim: int | None
    constant: Constant


class _SignatureFields(TypedDict):
    leaves: list[LeafJSON]
    out_batch_dims: list[int | None]
    out_is_tensor: list[bool]
    out_spec: str | None  # pytree.treespec_dumps, None when the outputs do not serialise
    pytree_modules: list[str]  # modules that register the output's container types


class SignatureJSON(_SignatureFields, total=False):
    # programs written before these were kept lack them, and take their inputs flat
    in_spec: str | None  # the inputs' structure (args, kwargs), None when it does not serialise
    forward: list[list[str]] | None  # the forward's parameters, [name, kind] (inspect's kinds)
    out_batch_free: list[bool]  # per output: the same on every micro-batch (Signature)


class _CommFields(TypedDict):
    peer: int
    tag: str
    value: ValueJSON


class CommJSON(_CommFields, total=False):
    written: bool  # present (true) only on a receive the stage writes into


class StageJSON(TypedDict):
    index: int
    file: str
    class_name: str
    inputs: list[int]
    random: bool
    recvs: list[CommJSON]
    sends: list[CommJSON]


class _ProgramJSON(TypedDict):
    fxpipe: str  # the version that wrote it
    model: str
    chunks: int
    remat: str
    schedule: str
    signature: SignatureJSON
    stages: list[StageJSON]
    shared: dict[str, list[int]]
    edges: list[tuple[str, int, int]]  # JSON arrays [tag, src, dst]
    loss: str
    lr: float
    reference_losses: list[float]
    deterministic: bool


class ProgramJSON(_ProgramJSON, total=False):
    """program.json; programs written before aliases and predicted events lack them."""

    aliases: dict[str, list[str]]
    predicted_events: list[EventJSON]
    autocast: str | None
    structure: dict[str, object] | None
    files: dict[str, str]  # every other file of the program -> its sha256, hex
    stages_per_rank: int  # under a looped schedule; absent: 1
    # a step that depends on how the batch is split (dropout, BatchNorm in training): the
    # plain model's losses as R data-parallel replicas compute them, by R
    replica_reference_losses: dict[str, list[float]]
    split_dependent: bool  # absent: false
    shard: str  # what data-parallel replicas split (fxpipe.choices.SHARD_MODES); absent: none


REWRITE_HINT = "write the program again (program.write(DIR) or fxpipe compile ... --out DIR)"



# the dtypes a value crossing stages or an input may have, by name
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}

"""program.json: what a written program's launcher needs, as plain JSON (no pickles, no eval).

Shapes are stored as integer polynomial coefficients in the micro-batch size b, dtypes by name,
so reading the file back never executes anything it contains.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import sympy  # type: ignore[import-untyped]  # sympy ships no type annotations
import torch
import torch.utils._pytree as pytree

from fxpipe import ir
from fxpipe.errors import CheckpointError, CodegenError
from fxpipe.signature import LeafSpec, Signature

__all__ = ["StageSpec", "ProgramSpec", "value_to_json", "value_from_json", "signature_to_json",
           "signature_from_json"]

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def _dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r} in program.json",
                              hint="write the program again with this fxpipe version") from None


def _poly(expr: Any) -> list[int] | int | float:
    expr = sympy.sympify(expr)
    if not expr.free_symbols:
        return int(expr) if expr.is_Integer else float(expr)
    if expr.free_symbols != {ir.BATCH}:
        raise CodegenError(f"size {expr} depends on more than the micro-batch size",
                           hint="capture with static sizes apart from the batch dimension")
    poly = sympy.Poly(expr, ir.BATCH)
    coeffs = poly.all_coeffs()[::-1]  # constant first
    if not all(c.is_Integer for c in coeffs):
        raise CodegenError(f"size {expr} is not an integer polynomial in b",
                           hint="use a batch size that every reshape divides")
    return [int(c) for c in coeffs]


def _unpoly(value: Any) -> sympy.Expr:
    if isinstance(value, list):
        return sympy.expand(sum(sympy.Integer(int(c)) * ir.BATCH**i for i, c in enumerate(value)))
    return sympy.sympify(float(value)) if isinstance(value, float) else sympy.Integer(int(value))


def value_to_json(info: Any) -> dict[str, Any]:
    if isinstance(info, ir.TensorInfo):
        return {"kind": "tensor", "shape": [_poly(d) for d in info.shape],
                "dtype": str(info.dtype).removeprefix("torch."), "batch_dim": info.batch_dim,
                "requires_grad": info.requires_grad}
    if isinstance(info, tuple):
        return {"kind": "tuple", "items": [value_to_json(i) for i in info]}
    value = info.value
    if isinstance(value, sympy.Expr):
        return {"kind": "scalar", "value": _poly(value)}
    if value is None or isinstance(value, (bool, int, float)):
        return {"kind": "scalar", "value": value}
    raise CodegenError(f"cannot describe a {type(value).__name__} crossing stages in JSON",
                       hint="please report this model")


def value_from_json(data: dict[str, Any]) -> Any:
    kind = data["kind"]
    if kind == "tensor":
        return ir.TensorInfo(tuple(_unpoly(d) for d in data["shape"]), _dtype(data["dtype"]),
                             data["batch_dim"], bool(data["requires_grad"]))
    if kind == "tuple":
        return tuple(value_from_json(i) for i in data["items"])
    value = data["value"]
    return ir.ScalarInfo(_unpoly(value) if isinstance(value, list) else value)


def _json_constant(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return None  # not representable: the launcher feeds tensors only, constants are baked


def signature_to_json(sig: Signature) -> dict[str, Any]:
    try:
        out_spec = pytree.treespec_dumps(sig.out_spec)
    except Exception:  # noqa: BLE001 - custom containers (e.g. ModelOutput) may not serialise
        out_spec = None
    return {
        "leaves": [{"name": leaf.name, "is_tensor": leaf.is_tensor,
                    "dtype": str(leaf.dtype).removeprefix("torch.") if leaf.dtype else None,
                    "shape": list(leaf.shape), "batch_dim": leaf.batch_dim,
                    "constant": _json_constant(leaf.constant)} for leaf in sig.leaves],
        "out_batch_dims": list(sig.out_batch_dims),
        "out_is_tensor": list(sig.out_is_tensor),
        "out_spec": out_spec,
        "pytree_modules": _pytree_modules(sig.out_spec) if out_spec else [],
    }


def _pytree_modules(spec: pytree.TreeSpec) -> list[str]:
    """The modules defining the output's container types (a library's ModelOutput): a fresh
    process imports them, which registers the types with pytree, before reading the spec."""
    modules: set[str] = set()
    stack = [spec]
    while stack:
        node = stack.pop()
        kind = getattr(node, "type", None)
        module = getattr(kind, "__module__", None)
        if isinstance(module, str) and module != "builtins":
            modules.add(module)
        children = getattr(node, "children", None)  # torch >= 2.13; children_specs before
        stack.extend(children() if callable(children) else node.children_specs)
    return sorted(modules)


def _import_pytree_modules(modules: list[str]) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any failure to import means the same here
            raise CheckpointError(
                f"the program's output type is defined in {module}, which cannot be imported "
                f"({type(e).__name__}: {e})",
                hint=f"install the library that provides {module} (or put it on PYTHONPATH) "
                     "where the program runs, as where it was written") from e


def signature_from_json(data: dict[str, Any]) -> Signature:
    leaves = [LeafSpec(x["name"], x["is_tensor"], _dtype(x["dtype"]) if x["dtype"] else None,
                       tuple(x["shape"]), x["batch_dim"], x["constant"]) for x in data["leaves"]]
    n_out = len(data["out_is_tensor"])
    _import_pytree_modules(list(data.get("pytree_modules", [])))
    out_spec = pytree.treespec_loads(data["out_spec"]) if data["out_spec"] else \
        pytree.tree_flatten(tuple(range(n_out)))[1]
    in_spec = pytree.tree_flatten((tuple(range(len(leaves))), {}))[1]
    return Signature(in_spec, leaves, out_spec, data["out_batch_dims"], data["out_is_tensor"])


@dataclass(frozen=True)
class StageSpec:
    index: int
    file: str
    class_name: str
    inputs: tuple[int, ...]
    random: bool
    recvs: tuple[ir.CommInfo, ...]
    sends: tuple[ir.CommInfo, ...]


@dataclass(frozen=True)
class ProgramSpec:
    model: str
    stages: tuple[StageSpec, ...]
    chunks: int
    remat: str
    schedule: str
    signature: Signature
    shared: dict[str, list[int]]
    edges: tuple[tuple[str, int, int], ...]
    loss: str
    lr: float
    reference_losses: tuple[float, ...]
    deterministic: bool
    aliases: dict[str, list[str]]  # tensor name -> every state_dict name of the model for it
    predicted_events: tuple[dict[str, Any], ...] = ()  # the cost model's timeline of one step

    @staticmethod
    def from_json(data: dict[str, Any]) -> ProgramSpec:
        def comm(c: dict[str, Any], kind: str) -> ir.CommInfo:
            return ir.CommInfo(kind, c["peer"], c["tag"], value_from_json(c["value"]))

        stages = tuple(StageSpec(s["index"], s["file"], s["class_name"], tuple(s["inputs"]),
                                 s["random"], tuple(comm(c, "recv") for c in s["recvs"]),
                                 tuple(comm(c, "send") for c in s["sends"]))
                       for s in data["stages"])
        return ProgramSpec(data["model"], stages, data["chunks"], data["remat"],
                           data["schedule"], signature_from_json(data["signature"]),
                           {k: list(v) for k, v in data["shared"].items()},
                           tuple(tuple(e) for e in data["edges"]), data["loss"], data["lr"],
                           tuple(data["reference_losses"]), data["deterministic"],
                           {k: list(v) for k, v in data.get("aliases", {}).items()},
                           tuple(data.get("predicted_events", ())))


def comm_to_json(c: ir.CommInfo) -> dict[str, Any]:
    return {"peer": c.peer, "tag": c.tag, "value": value_to_json(c.value)}

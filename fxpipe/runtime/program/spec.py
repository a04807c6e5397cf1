"""The runtime plan (ProgramSpec) and program.json, the plan as plain JSON (no pickles, no eval).

Shapes are stored as integer polynomial coefficients in the micro-batch size b, dtypes by name
(the fields: fxpipe.runtime.program.spec_json), so reading the file back never executes anything it
contains. Every field is checked against what fxpipe writes before anything reads it
(fxpipe.runtime.program.spec_check). The code a program imports (its loss, its output types'
modules) is named in program.py, never by this file alone (fxpipe.runtime.program.imports).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import sympy  # type: ignore[import-untyped]  # sympy ships no type annotations
import torch
import torch.utils._pytree as pytree

from fxpipe import ir
from fxpipe.errors import CheckpointError, CodegenError, ProgramFolderError
from fxpipe.runtime.execution.stagespec import StageSpec
from fxpipe.runtime.planning.schedule import placement
from fxpipe.runtime.planning.timeline import EventJSON
from fxpipe.runtime.program.spec_check import out_spec_problem, spec_problems
from fxpipe.runtime.program.spec_json import (
    DTYPES,
    REWRITE_HINT,
    CommJSON,
    Constant,
    ProgramJSON,
    SignatureJSON,
    SizeJSON,
    StageJSON,
    ValueJSON,
)
from fxpipe.signature import LeafSpec, Signature
from fxpipe.storage.state import StateNames
from fxpipe.storage.structure import Structure
from fxpipe.version import __version__

__all__ = ["ProgramSpec", "stage_to_json", "stage_from_json", "value_to_json", "value_from_json",
           "signature_to_json", "signature_from_json", "comm_to_json"]


def _dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r} in program.json",
                              hint="write the program again with this fxpipe version") from None


def _poly(expr: ir.Expr) -> SizeJSON:
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


def _unpoly(value: SizeJSON) -> sympy.Expr:
    if isinstance(value, list):
        return sympy.expand(sum(sympy.Integer(int(c)) * ir.BATCH**i for i, c in enumerate(value)))
    return sympy.sympify(float(value)) if isinstance(value, float) else sympy.Integer(int(value))


def value_to_json(info: ir.ValueInfo) -> ValueJSON:
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


def value_from_json(data: ValueJSON) -> ir.ValueInfo:
    if data["kind"] == "tensor":
        return ir.TensorInfo(tuple(_unpoly(d) for d in data["shape"]), _dtype(data["dtype"]),
                             data["batch_dim"], bool(data["requires_grad"]))
    if data["kind"] == "tuple":
        return tuple(value_from_json(i) for i in data["items"])
    value = data["value"]
    return ir.ScalarInfo(_unpoly(value) if isinstance(value, list) else value)


def _json_constant(value: object) -> Constant:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return None  # not representable: the launcher feeds tensors only, constants are baked


def signature_to_json(sig: Signature) -> SignatureJSON:
    try:
        out_spec = pytree.treespec_dumps(sig.out_spec)
    except Exception:  # noqa: BLE001 - custom containers (e.g. ModelOutput) may not serialise
        out_spec = None
    # the inputs' structure where it is of tuples, lists and dicts alone: a container type of
    # the user's would have to be imported before program.json could be read
    in_spec = pytree.treespec_dumps(sig.in_spec) if _builtin_containers(sig.in_spec) else None
    return {
        "in_spec": in_spec,
        "forward": [list(p) for p in sig.forward] if sig.forward is not None else None,
        "leaves": [{"name": leaf.name, "is_tensor": leaf.is_tensor,
                    "dtype": str(leaf.dtype).removeprefix("torch.") if leaf.dtype else None,
                    "shape": list(leaf.shape), "batch_dim": leaf.batch_dim,
                    "constant": _json_constant(leaf.constant)} for leaf in sig.leaves],
        "out_batch_dims": list(sig.out_batch_dims),
        "out_is_tensor": list(sig.out_is_tensor),
        "out_batch_free": list(sig.out_batch_free),
        "out_spec": out_spec,
        "pytree_modules": _pytree_modules(sig.out_spec) if out_spec else [],
    }


def _builtin_containers(spec: pytree.TreeSpec) -> bool:
    return all(node.type in (None, tuple, list, dict) for node in _nodes(spec))


def _nodes(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    """Every node of a tree spec, the root first."""
    found, stack = [], [spec]
    while stack:
        node = stack.pop()
        found.append(node)
        children = getattr(node, "children", None)  # torch >= 2.13; children_specs before
        stack.extend(children() if callable(children) else node.children_specs)
    return found


def _pytree_modules(spec: pytree.TreeSpec) -> list[str]:
    """The modules defining the output's container types (a library's ModelOutput): a fresh
    process imports them, which registers the types with pytree, before reading the spec."""
    modules = {getattr(node.type, "__module__", None) for node in _nodes(spec)}
    return sorted(m for m in modules if isinstance(m, str) and m != "builtins")


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


def signature_from_json(data: SignatureJSON) -> Signature:
    leaves = [LeafSpec(leaf["name"], leaf["is_tensor"],
                       _dtype(leaf["dtype"]) if leaf["dtype"] else None, tuple(leaf["shape"]),
                       leaf["batch_dim"], leaf["constant"]) for leaf in data["leaves"]]
    n_out = len(data["out_is_tensor"])
    _import_pytree_modules(list(data.get("pytree_modules", [])))  # older specs lack it
    problem = out_spec_problem(data["out_spec"], n_out, parse=True) if data["out_spec"] else None
    if problem:  # its container types are registered now
        raise ProgramFolderError(f"program.json is not as fxpipe writes it (was it edited by "
                                 f"hand?): {problem}", hint=REWRITE_HINT)
    out_spec = pytree.treespec_loads(data["out_spec"]) if data["out_spec"] else \
        pytree.tree_flatten(tuple(range(n_out)))[1]
    written = data.get("in_spec")  # checked against the leaves by spec_check
    in_spec = pytree.treespec_loads(written) if written else \
        pytree.tree_flatten((tuple(range(len(leaves))), {}))[1]  # flat: as older programs
    forward = data.get("forward")
    return Signature(in_spec, leaves, out_spec, data["out_batch_dims"], data["out_is_tensor"],
                     [(name, kind) for name, kind in forward] if forward is not None else None,
                     data.get("out_batch_free"))  # absent from older programs: none


def stage_to_json(stage: StageSpec) -> StageJSON:
    return {"index": stage.index, "file": stage.file, "class_name": stage.class_name,
            "inputs": list(stage.inputs), "random": stage.random,
            "recvs": [comm_to_json(c) for c in stage.recvs],
            "sends": [comm_to_json(c) for c in stage.sends]}


def stage_from_json(data: StageJSON) -> StageSpec:
    def comm(c: CommJSON, kind: str) -> ir.CommInfo:
        return ir.CommInfo(kind, c["peer"], c["tag"], value_from_json(c["value"]),
                           bool(c.get("written", False)))

    return StageSpec(data["index"], data["file"], data["class_name"], tuple(data["inputs"]),
                     data["random"], tuple(comm(c, "recv") for c in data["recvs"]),
                     tuple(comm(c, "send") for c in data["sends"]))


@dataclass(frozen=True)
class ProgramSpec:
    """The runtime plan: what everything after the compiler reads (Program, the written program,
    the report, the bench). fxpipe.pipeline.build makes it; a written program's program.json is
    this value, with what the writer recorded besides (the loss, lr and the plain model's
    losses for --verify, the state's names and structure)."""

    model: str
    stages: tuple[StageSpec, ...]
    chunks: int  # micro-batches per step
    remat: str
    schedule: str
    signature: Signature
    shared: dict[str, list[int]]  # tied tensor -> the stages that hold it
    edges: tuple[tuple[str, int, int], ...]  # every (value, src stage, dst stage), sorted
    autocast: str | None = None  # "bf16" / "fp16": every stage under torch.autocast
    stages_per_rank: int = 1  # more than 1 under a looped schedule
    predicted_events: tuple[EventJSON, ...] = ()  # the cost model's timeline of one step
    # recorded when the program is written
    loss: str = ""
    lr: float = 0.0
    reference_losses: tuple[float, ...] = ()  # the plain model's, for --verify
    # tensor -> its state_dict names, for the tensors not named by their own key alone (tied,
    # renamed): the rest follow from the structure's keys (state_names)
    aliases: dict[str, list[str]] = field(default_factory=dict)
    structure: Structure | None = None  # the model's state, which checkpoints record
    # replicas -> the plain model's losses as they compute them, for a step that depends on how
    # the batch is split (empty: it does not, or the program predates the record)
    replica_reference_losses: dict[int, tuple[float, ...]] = field(default_factory=dict)
    split_dependent: bool = False  # dropout or BatchNorm in training
    shard: str = "none"  # what data-parallel replicas split: the optimizer's state, or nothing

    @property
    def deterministic(self) -> bool:
        """No stage draws random numbers."""
        return not any(st.random for st in self.stages)

    def state_names(self) -> StateNames:
        """Each tensor the stages bind -> the model's state_dict keys for it: the aliases, and
        every other key of the model naming itself (a program written before the structure was
        recorded lists every tensor in its aliases)."""
        return StateNames.completed(self.aliases, self.structure.tensors if self.structure
                                    else ())

    @property
    def ranks(self) -> int:
        """Pipeline ranks of one replica."""
        return len(self.stages) // self.stages_per_rank

    @property
    def placement(self) -> list[int]:
        """placement[s]: the pipeline rank of stage s."""
        return placement(self.schedule, len(self.stages), self.ranks)

    def to_json(self) -> ProgramJSON:
        """program.json, without the files' digests (the writer adds them)."""
        data: ProgramJSON = {
            "fxpipe": __version__, "model": self.model, "chunks": self.chunks,
            "remat": self.remat, "schedule": self.schedule,
            "signature": signature_to_json(self.signature),
            "stages": [stage_to_json(st) for st in self.stages],
            "shared": {k: list(v) for k, v in self.shared.items()},
            "edges": [(tag, src, dst) for tag, src, dst in self.edges],
            "loss": self.loss, "lr": self.lr, "reference_losses": list(self.reference_losses),
            "deterministic": self.deterministic,
            "aliases": {k: list(v) for k, v in self.aliases.items()},
            "structure": None if self.structure is None else self.structure.to_json(),
            "autocast": self.autocast, "predicted_events": list(self.predicted_events)}
        if self.stages_per_rank > 1:
            data["stages_per_rank"] = self.stages_per_rank
        if self.shard != "none":
            data["shard"] = self.shard
        if self.split_dependent:
            data["split_dependent"] = True
            data["replica_reference_losses"] = {
                str(r): list(losses) for r, losses in sorted(self.replica_reference_losses.items())}
        return data

    @staticmethod
    def from_json(data: ProgramJSON) -> ProgramSpec:
        """The spec program.json holds; raises ProgramFolderError naming every field fxpipe would
        not have written, before any of them can fail later with a raw error."""
        problems = spec_problems(data)
        if problems:
            raise ProgramFolderError("program.json is not as fxpipe writes it (was it edited by "
                                     "hand?): " + "; ".join(problems), hint=REWRITE_HINT)
        return ProgramSpec(
            model=data["model"], stages=tuple(stage_from_json(s) for s in data["stages"]),
            chunks=data["chunks"], remat=data["remat"], schedule=data["schedule"],
            signature=signature_from_json(data["signature"]),
            shared={k: list(v) for k, v in data["shared"].items()},
            edges=tuple((tag, src, dst) for tag, src, dst in data["edges"]),
            autocast=data.get("autocast"), stages_per_rank=data.get("stages_per_rank", 1),
            predicted_events=tuple(data.get("predicted_events", ())),
            loss=data["loss"], lr=data["lr"], reference_losses=tuple(data["reference_losses"]),
            aliases={k: list(v) for k, v in data.get("aliases", {}).items()},
            structure=_structure(data.get("structure")),
            replica_reference_losses={int(k): tuple(v) for k, v in
                                      data.get("replica_reference_losses", {}).items()},
            split_dependent=data.get("split_dependent", False),
            shard=data.get("shard", "none"))


def _structure(data: object) -> Structure | None:
    return None if data is None else Structure.from_json(data, where="program.json")


def comm_to_json(c: ir.CommInfo) -> CommJSON:
    out: CommJSON = {"peer": c.peer, "tag": c.tag, "value": value_to_json(c.value)}
    if c.written:
        out["written"] = True
    return out

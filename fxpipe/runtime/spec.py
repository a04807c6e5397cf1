"""program.json: what a written program's launcher needs, as plain JSON (no pickles, no eval).

Shapes are stored as integer polynomial coefficients in the micro-batch size b, dtypes by name,
so reading the file back never executes anything it contains. spec_problems() checks every
field against what fxpipe writes before anything reads it: an edited file is refused with the
field, its value and what is allowed. The code a program imports (its loss, its output types'
modules) is named in program.py, never by this file alone (fxpipe.runtime.imports).
"""
from __future__ import annotations

import importlib
import json
import math
import posixpath
from dataclasses import dataclass, field
from typing import Literal, TypeAlias, TypedDict

import sympy  # type: ignore[import-untyped]  # sympy ships no type annotations
import torch
import torch.utils._pytree as pytree

from fxpipe import ir
from fxpipe.choices import SHARD_MODES
from fxpipe.errors import CheckpointError, CodegenError, ConfigError, ProgramFolderError
from fxpipe.remat_policy import REMAT_MODES
from fxpipe.runtime.amp import AUTOCAST_DTYPES
from fxpipe.runtime.schedule import SCHEDULES, check_layout, placement
from fxpipe.runtime.stagespec import StageSpec
from fxpipe.runtime.timeline import EventJSON
from fxpipe.signature import LeafSpec, Signature
from fxpipe.structure import Structure
from fxpipe.version import __version__

__all__ = ["ProgramSpec", "stage_to_json", "stage_from_json", "value_to_json", "value_from_json",
           "signature_to_json", "signature_from_json", "Constant", "SizeJSON", "TensorJSON",
           "TupleJSON", "ScalarJSON", "ValueJSON", "LeafJSON", "SignatureJSON", "CommJSON",
           "StageJSON", "ProgramJSON", "spec_problems", "is_inside_path", "REWRITE_HINT"]

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


class SignatureJSON(TypedDict):
    leaves: list[LeafJSON]
    out_batch_dims: list[int | None]
    out_is_tensor: list[bool]
    out_spec: str | None  # pytree.treespec_dumps, None when the outputs do not serialise
    pytree_modules: list[str]  # modules that register the output's container types


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


def is_inside_path(path: object) -> bool:
    """Whether `path` names a file inside the folder it is read from: relative, with no `..`."""
    return isinstance(path, str) and path != "" and "\\" not in path and ":" not in path \
        and not posixpath.isabs(path) and ".." not in path.split("/")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(float(value))  # type: ignore[arg-type]


def spec_problems(data: object) -> list[str]:
    """Every field of program.json that fxpipe would not have written, as `field is value
    (allowed: ...)`; empty when the spec is sound."""
    if not isinstance(data, dict):
        return [f"program.json holds a {type(data).__name__}, not an object"]
    known = ProgramJSON.__required_keys__ | ProgramJSON.__optional_keys__
    problems = [f"unknown field {k!r} (allowed: {', '.join(sorted(known))})"
                for k in sorted(set(data) - known)]
    problems += [f"field {k!r} is missing"
                 for k in sorted(ProgramJSON.__required_keys__ - set(data))]
    if problems:
        return problems

    def check(ok: bool, name: str, allowed: str) -> None:
        if not ok:
            problems.append(f"{name} is {data.get(name)!r} (allowed: {allowed})")

    check(_is_int(data["chunks"]) and data["chunks"] >= 1, "chunks", "an integer >= 1")
    named = {k: data.get(k) if isinstance(data.get(k), str) else "" for k in
             ("remat", "schedule", "autocast")}  # a list or an object is no key of the choices
    check(named["remat"] in REMAT_MODES, "remat", ", ".join(REMAT_MODES))
    check(named["schedule"] in SCHEDULES, "schedule", ", ".join(SCHEDULES))
    check(data.get("autocast") is None or named["autocast"] in AUTOCAST_DTYPES, "autocast",
          "null, " + ", ".join(AUTOCAST_DTYPES))
    check(_is_number(data["lr"]) and data["lr"] > 0, "lr", "a finite number > 0")
    check(isinstance(data["loss"], str), "loss", "a loss name or MODULE:FUNCTION")
    check(isinstance(data["deterministic"], bool), "deterministic", "true, false")
    check(isinstance(data["reference_losses"], list)
          and all(_is_number(x) for x in data["reference_losses"]), "reference_losses",
          "a list of finite numbers")
    replicas = data.get("replica_reference_losses", {})
    check(isinstance(replicas, dict) and all(
        isinstance(k, str) and k.isdigit() and int(k) >= 2 and isinstance(v, list)
        and all(_is_number(x) for x in v) for k, v in replicas.items()),
        "replica_reference_losses", "replica counts >= 2 -> lists of finite numbers")
    check(isinstance(data.get("split_dependent", False), bool), "split_dependent", "true, false")
    check(data.get("shard", "none") in SHARD_MODES, "shard", ", ".join(SHARD_MODES))
    files = data.get("files", {})
    check(isinstance(files, dict)
          and all(is_inside_path(k) and isinstance(v, str) for k, v in files.items()),
          "files", "file names inside the folder -> sha256")
    check(isinstance(data["fxpipe"], str), "fxpipe", "the version that wrote the program")
    check(isinstance(data["model"], str), "model", "the model's name")
    aliases = data.get("aliases", {})
    check(isinstance(aliases, dict) and all(
        isinstance(k, str) and isinstance(v, list) and v and all(isinstance(x, str) for x in v)
        for k, v in aliases.items()), "aliases", "tensor name -> its state_dict keys")
    events = data.get("predicted_events", [])
    check(isinstance(events, list) and all(
        isinstance(e, dict) and set(e) == set(EventJSON.__required_keys__) for e in events),
        "predicted_events",
        "a list of events with keys " + ", ".join(sorted(EventJSON.__required_keys__)))
    if data.get("structure") is not None:
        try:
            Structure.from_json(data["structure"], where="program.json")
        except CheckpointError as e:
            problems.append(f"structure is {data['structure']!r:.80} (allowed: the model's "
                            f"state_dict keys, shapes and dtypes; {e.message})")
    problems += _signature_problems(data["signature"])
    stages = data["stages"]
    if not isinstance(stages, list) or not stages:
        return [*problems, f"stages is {stages!r} (allowed: a non-empty list)"]
    per_rank = data.get("stages_per_rank", 1)
    if named["schedule"] in SCHEDULES:
        try:
            check_layout(data["schedule"], len(stages), per_rank)
        except ConfigError as e:
            problems.append(f"stages_per_rank is {per_rank!r} with {len(stages)} stages under "
                            f"{data['schedule']} (allowed: {e.hint})")
    return problems + _stage_problems(stages, data)


def _is_size(value: object) -> bool:
    """A SizeJSON: a finite number, or integer polynomial coefficients in b."""
    return _is_number(value) or (isinstance(value, list) and bool(value)
                                 and all(_is_int(c) for c in value))


def _value_problem(value: object, where: str) -> str | None:
    """What is wrong with a ValueJSON (a tensor, tuple or scalar crossing stages), if anything."""
    kind = value.get("kind") if isinstance(value, dict) else None
    if isinstance(value, dict) and kind == "tuple" and set(value) == {"kind", "items"} \
            and isinstance(value["items"], list):
        return next((p for i, item in enumerate(value["items"])
                     if (p := _value_problem(item, f"{where}.items[{i}]"))), None)
    if isinstance(value, dict) and kind == "scalar" and set(value) == {"kind", "value"} \
            and (value["value"] is None or isinstance(value["value"], bool)
                 or _is_size(value["value"])):
        return None
    if isinstance(value, dict) and kind == "tensor" \
            and set(value) == set(TensorJSON.__required_keys__):
        shape, dim = value["shape"], value["batch_dim"]
        if isinstance(shape, list) and all(_is_size(d) for d in shape) \
                and value["dtype"] in _DTYPES and isinstance(value["requires_grad"], bool) \
                and (dim is None or (_is_int(dim) and 0 <= dim < len(shape))):
            return None
    return f"{where} is {value!r:.120} (allowed: a tensor, tuple or scalar as fxpipe describes it)"


def _signature_problems(sig: object) -> list[str]:
    """The inputs (leaves) and outputs of the program, as signature_to_json writes them."""
    if not isinstance(sig, dict) or set(sig) != set(SignatureJSON.__required_keys__):
        return [f"signature is {sig!r:.120} (allowed: an object with keys "
                f"{', '.join(sorted(SignatureJSON.__required_keys__))})"]
    problems = []
    leaves = sig["leaves"]
    for i, leaf in enumerate(leaves if isinstance(leaves, list) else [None]):
        ok = isinstance(leaf, dict) and set(leaf) == set(LeafJSON.__required_keys__) \
            and isinstance(leaf["name"], str) and isinstance(leaf["is_tensor"], bool) \
            and (leaf["dtype"] is None or leaf["dtype"] in _DTYPES) \
            and isinstance(leaf["shape"], list) and all(_is_int(d) for d in leaf["shape"]) \
            and (leaf["batch_dim"] is None or (_is_int(leaf["batch_dim"])
                                               and 0 <= leaf["batch_dim"] < len(leaf["shape"]))) \
            and (leaf["constant"] is None or isinstance(leaf["constant"], (bool, int, float, str)))
        if not ok:
            keys = ", ".join(sorted(LeafJSON.__required_keys__))
            problems.append(f"signature.leaves[{i}] is {leaf!r:.120} (allowed: an input as "
                            f"fxpipe describes it, keys {keys})")
    dims, tensors = sig["out_batch_dims"], sig["out_is_tensor"]
    if not (isinstance(tensors, list) and all(isinstance(t, bool) for t in tensors)):
        problems.append(f"signature.out_is_tensor is {tensors!r:.120} (allowed: a list of true, "
                        "false)")
    elif not (isinstance(dims, list) and len(dims) == len(tensors)
              and all(d is None or (_is_int(d) and d >= 0) for d in dims)):
        problems.append(f"signature.out_batch_dims is {dims!r:.120} (allowed: a batch dimension "
                        f"or null for each of the {len(tensors)} outputs)")
    modules = sig["pytree_modules"]
    if not (isinstance(modules, list) and all(isinstance(m, str) and m for m in modules)):
        problems.append(f"signature.pytree_modules is {modules!r:.120} (allowed: module names)")
    out_spec = sig["out_spec"]
    if out_spec is not None and not problems:
        problem = _out_spec_problem(out_spec, len(tensors), parse=not modules)
        if problem:
            problems.append(problem)
    return problems


def _out_spec_problem(out_spec: object, outputs: int, *, parse: bool) -> str | None:
    """What is wrong with signature.out_spec: not a pytree spec of `outputs` leaves. Without
    `parse`, its container types come from modules not imported yet: only its JSON is read."""
    allowed = f"a tree spec of the {outputs} outputs, as torch.utils._pytree.treespec_dumps writes"
    try:
        if not isinstance(out_spec, str) or not isinstance(json.loads(out_spec), list):
            raise ValueError("not a JSON list")
        if parse and pytree.treespec_loads(out_spec).num_leaves != outputs:
            return f"signature.out_spec is {out_spec!r:.120} (allowed: {allowed}; it has " \
                   f"{pytree.treespec_loads(out_spec).num_leaves} leaves)"
    except Exception as e:  # noqa: BLE001 - treespec_loads raises many kinds on a bad spec
        return f"signature.out_spec is {out_spec!r:.120} (allowed: {allowed}; " \
               f"{type(e).__name__}: {e})"
    return None


def _stage_problems(stages: list[object], data: dict[str, object]) -> list[str]:
    """The stages, their messages and the edges between them: indexes 0..n-1 in order, peers in
    range, every send received by its peer, edges as the sends say."""
    n, problems = len(stages), []
    files: list[object] = []
    sig = data["signature"]
    leaves = len(sig["leaves"]) if isinstance(sig, dict) and isinstance(sig.get("leaves"), list) \
        else 0
    sends: set[tuple[str, object, object]] = set()
    recvs: set[tuple[str, object, object]] = set()
    for i, st in enumerate(stages):
        where = f"stages[{i}]"
        if not isinstance(st, dict) or set(st) != set(StageJSON.__required_keys__):
            problems.append(f"{where} is not a stage (allowed keys: "
                            f"{', '.join(sorted(StageJSON.__required_keys__))})")
            continue
        if st["index"] != i:
            problems.append(f"{where}.index is {st['index']!r} (allowed: {i}, its position)")
        if not is_inside_path(st["file"]) or not str(st["file"]).endswith(".py"):
            problems.append(f"{where}.file is {st['file']!r} (allowed: a .py file inside the "
                            "program's folder, no absolute path, no '..')")
        if not (isinstance(st["class_name"], str) and st["class_name"].isidentifier()):
            problems.append(f"{where}.class_name is {st['class_name']!r} (allowed: an identifier)")
        if st["file"] in files:
            problems.append(f"{where}.file is {st['file']!r}, as stages[{files.index(st['file'])}]"
                            "'s (allowed: a file of its own)")
        files.append(st["file"])
        inputs = st["inputs"]
        if not (isinstance(inputs, list) and all(_is_int(x) and 0 <= x < leaves for x in inputs)
                and len(set(inputs)) == len(inputs)):
            problems.append(f"{where}.inputs is {inputs!r:.120} (allowed: distinct indexes of the "
                            f"program's {leaves} inputs, 0..{leaves - 1})")
        if not isinstance(st["random"], bool):
            problems.append(f"{where}.random is {st['random']!r} (allowed: true, false)")
        for kind, messages, into in (("recvs", st["recvs"], recvs), ("sends", st["sends"], sends)):
            for c in messages if isinstance(messages, list) else [None]:
                peer = c.get("peer") if isinstance(c, dict) else None
                tag = c.get("tag") if isinstance(c, dict) else None
                if not (_is_int(peer) and peer in range(n) and peer != i):
                    problems.append(f"{where}.{kind} has peer {peer!r} (allowed: another stage, "
                                    f"0..{n - 1})")
                elif not isinstance(tag, str):
                    problems.append(f"{where}.{kind} has tag {tag!r} (allowed: a string)")
                elif not isinstance(c, dict) or set(c) != set(CommJSON.__required_keys__):
                    problems.append(f"{where}.{kind} has {c!r:.120} (allowed: keys "
                                    f"{', '.join(sorted(CommJSON.__required_keys__))})")
                elif (problem := _value_problem(c["value"], f"{where}.{kind}[{tag!r}].value")):
                    problems.append(problem)
                else:
                    into.add((tag, i, peer) if kind == "sends" else (tag, peer, i))
    if problems:
        return problems
    if sends != recvs:
        problems.append(f"stages send and receive different messages (sent, not received: "
                        f"{sorted(map(str, sends - recvs))}; received, not sent: "
                        f"{sorted(map(str, recvs - sends))})")
    edges = data["edges"]
    if not isinstance(edges, list) or not all(
            isinstance(e, list) and all(isinstance(x, (str, int)) for x in e) for e in edges) \
            or {tuple(e) for e in edges} != sends:
        problems.append(f"edges is {edges!r} (allowed: the stages' sends as [tag, src, dst])")
    shared = data["shared"]
    if not isinstance(shared, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(_is_int(s) and 0 <= s < n for s in v)
            for k, v in shared.items()):
        problems.append(f"shared is {shared!r} (allowed: tensor name -> stages 0..{n - 1})")
    return problems


_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def _dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
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


def signature_from_json(data: SignatureJSON) -> Signature:
    leaves = [LeafSpec(leaf["name"], leaf["is_tensor"],
                       _dtype(leaf["dtype"]) if leaf["dtype"] else None, tuple(leaf["shape"]),
                       leaf["batch_dim"], leaf["constant"]) for leaf in data["leaves"]]
    n_out = len(data["out_is_tensor"])
    _import_pytree_modules(list(data.get("pytree_modules", [])))  # older specs lack it
    problem = _out_spec_problem(data["out_spec"], n_out, parse=True) if data["out_spec"] else None
    if problem:  # its container types are registered now
        raise ProgramFolderError(f"program.json is not as fxpipe writes it (was it edited by "
                                 f"hand?): {problem}", hint=REWRITE_HINT)
    out_spec = pytree.treespec_loads(data["out_spec"]) if data["out_spec"] else \
        pytree.tree_flatten(tuple(range(n_out)))[1]
    in_spec = pytree.tree_flatten((tuple(range(len(leaves))), {}))[1]
    return Signature(in_spec, leaves, out_spec, data["out_batch_dims"], data["out_is_tensor"])


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
    aliases: dict[str, list[str]] = field(default_factory=dict)  # tensor -> state_dict names
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

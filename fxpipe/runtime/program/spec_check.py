"""Checks a program.json against what fxpipe writes (fxpipe.runtime.program.spec_json) before
anything reads it: an edited file is refused with every field that is wrong, its value and what is
allowed, never a raw error later."""
from __future__ import annotations

import json
import math
import posixpath

import torch.utils._pytree as pytree

from fxpipe.choices import SHARD_MODES
from fxpipe.errors import CheckpointError, ConfigError
from fxpipe.remat_policy import REMAT_MODES
from fxpipe.runtime.execution.amp import AUTOCAST_DTYPES
from fxpipe.runtime.planning.schedule import SCHEDULES, check_layout
from fxpipe.runtime.planning.timeline import EventJSON
from fxpipe.runtime.program.spec_json import (
    DTYPES,
    CommJSON,
    LeafJSON,
    ProgramJSON,
    SignatureJSON,
    StageJSON,
    TensorJSON,
)
from fxpipe.signature import PARAMETER_KINDS
from fxpipe.storage.structure import Structure

__all__ = ["spec_problems", "out_spec_problem", "is_inside_path"]


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
                and value["dtype"] in DTYPES and isinstance(value["requires_grad"], bool) \
                and (dim is None or (_is_int(dim) and 0 <= dim < len(shape))):
            return None
    return f"{where} is {value!r:.120} (allowed: a tensor, tuple or scalar as fxpipe describes it)"


def _signature_problems(sig: object) -> list[str]:
    """The inputs (leaves) and outputs of the program, as signature_to_json writes them."""
    if not isinstance(sig, dict) or not (set(SignatureJSON.__required_keys__) <= set(sig) <= {
            *SignatureJSON.__required_keys__, *SignatureJSON.__optional_keys__}):
        return [f"signature is {sig!r:.120} (allowed: an object with keys "
                f"{', '.join(sorted(SignatureJSON.__required_keys__))}, and "
                f"{' and '.join(sorted(SignatureJSON.__optional_keys__))} where kept)"]
    problems = _call_problems(sig)
    leaves = sig["leaves"]
    for i, leaf in enumerate(leaves if isinstance(leaves, list) else [None]):
        ok = isinstance(leaf, dict) and set(leaf) == set(LeafJSON.__required_keys__) \
            and isinstance(leaf["name"], str) and isinstance(leaf["is_tensor"], bool) \
            and (leaf["dtype"] is None or leaf["dtype"] in DTYPES) \
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
    free = sig.get("out_batch_free", [False] * len(tensors) if isinstance(tensors, list) else [])
    if not (isinstance(free, list) and isinstance(tensors, list) and len(free) == len(tensors)
            and all(isinstance(f, bool) for f in free)):
        problems.append(f"signature.out_batch_free is {free!r:.120} (allowed: true or false for "
                        f"each output)")
    elif isinstance(dims, list) and any(f and d is not None for f, d in zip(free, dims)):
        problems.append(f"signature.out_batch_free is {free!r:.120}, but an output it marks has "
                        f"a batch dimension in out_batch_dims {dims!r:.120}")
    modules = sig["pytree_modules"]
    if not (isinstance(modules, list) and all(isinstance(m, str) and m for m in modules)):
        problems.append(f"signature.pytree_modules is {modules!r:.120} (allowed: module names)")
    out_spec = sig["out_spec"]
    if out_spec is not None and not problems:
        problem = out_spec_problem(out_spec, len(tensors), parse=not modules)
        if problem:
            problems.append(problem)
    return problems


def _call_problems(sig: dict[str, object]) -> list[str]:
    """signature.in_spec (the inputs' structure, one leaf per signature.leaves) and
    signature.forward (the forward's parameters), where present."""
    problems = []
    in_spec, leaves = sig.get("in_spec"), sig["leaves"]
    if in_spec is not None:
        allowed = "a tree spec of (args, kwargs), as torch.utils._pytree.treespec_dumps writes"
        try:
            spec = pytree.treespec_loads(in_spec) if isinstance(in_spec, str) else None
            count = spec.num_leaves if spec is not None else None
        except Exception as e:  # noqa: BLE001 - treespec_loads raises many kinds on a bad spec
            count, allowed = None, f"{allowed}; {type(e).__name__}: {e}"
        if not isinstance(leaves, list) or count != len(leaves):
            problems.append(f"signature.in_spec is {in_spec!r:.120} (allowed: {allowed}, "
                            "with a leaf for each of signature.leaves)")
    forward = sig.get("forward")
    if forward is not None and not (isinstance(forward, list) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and p[0].isidentifier()
            and p[1] in PARAMETER_KINDS for p in forward)):
        problems.append(f"signature.forward is {forward!r:.120} (allowed: a list of [name, "
                        f"kind], kind one of {', '.join(PARAMETER_KINDS)})")
    return problems


def out_spec_problem(out_spec: object, outputs: int, *, parse: bool) -> str | None:
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

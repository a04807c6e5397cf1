"""Stage graphs to standalone, readable Python source (pure: no torch execution).

Each stage becomes a StageModule subclass: a provenance header, the parameters it binds, then
forward(comm, *inputs) with receives at the top, the model's operations in the middle (named
after the model's modules, shape-annotated, the user's source line as a comment where it
changes), sends at the bottom, and remat regions as methods run through `checkpoint`. Nothing
taken from the model is ever executed as code: names become sanitised identifiers, and strings
and numbers are written with repr().
"""
from __future__ import annotations

import builtins
import keyword
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from fxpipe import ir, source
from fxpipe.source import identifier
from fxpipe.errors import CodegenError
from fxpipe.runtime import ops

__all__ = ["StageHeader", "generate_stage", "load_stage_class"]

_RESERVED = {"self", "comm", "torch", "operator", "math", "checkpoint", "StageModule",
             "annotations"}
_INFIX = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
          operator.floordiv: "//", operator.mod: "%", operator.pow: "**", operator.matmul: "@",
          operator.and_: "&", operator.or_: "|", operator.xor: "^", operator.lshift: "<<",
          operator.rshift: ">>", operator.eq: "==", operator.ne: "!=", operator.lt: "<",
          operator.le: "<=", operator.gt: ">", operator.ge: ">="}
_UNARY = {operator.neg: "-", operator.pos: "+", operator.invert: "~", operator.not_: "not "}
_PUBLIC_HOMES = ("torch.nn.functional", "torch", "torch.special", "torch.linalg", "torch.fft")


@dataclass(frozen=True)
class StageHeader:
    """Deterministic facts shown at the top of a stage file."""

    command: str
    model: str
    stage: int
    num_stages: int
    span: str
    lines: tuple[str, ...] = ()  # cost, params, recv/send, remat ... already formatted
    passes: str = "capture > annotate_costs > partition > split_stages > mark_remat"
    version: str = "0.1.0"


@dataclass
class _Context:
    gm: GraphModule
    names: dict[Node, str] = field(default_factory=dict)
    attrs: dict[str, str] = field(default_factory=dict)  # get_attr target -> attribute
    imports: set[str] = field(default_factory=set)


def _literal(value: Any, node: Node) -> str:
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "float('nan')"
        if math.isinf(value):
            return "float('inf')" if value > 0 else "float('-inf')"
        return repr(value)
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):
        return "comm.device"  # a stage's constants live where the stage runs
    if isinstance(value, (torch.memory_format, torch.layout)):
        return str(value)
    if value is Ellipsis:
        return "..."
    raise CodegenError(f"cannot write constant {type(value).__name__} of {node.name} "
                       f"({node.op} {node.target}) as code", hint="please report this model")


def _render(arg: Any, ctx: _Context, node: Node) -> str:
    if isinstance(arg, Node):
        if arg.op == "get_attr":
            return f"self.{ctx.attrs[arg.target]}"
        return ctx.names[arg]
    if isinstance(arg, tuple):
        inner = ", ".join(_render(a, ctx, node) for a in arg)
        return f"({inner},)" if len(arg) == 1 else f"({inner})"
    if isinstance(arg, list):
        return "[" + ", ".join(_render(a, ctx, node) for a in arg) + "]"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{_literal(k, node)}: {_render(v, ctx, node)}"
                               for k, v in arg.items()) + "}"
    if isinstance(arg, slice):
        return f"slice({_render(arg.start, ctx, node)}, {_render(arg.stop, ctx, node)}, " \
               f"{_render(arg.step, ctx, node)})"
    return _literal(arg, node)


def _call_args(node: Node, ctx: _Context, skip: int = 0) -> str:
    parts = [_render(a, ctx, node) for a in node.args[skip:]]
    parts += [f"{k}={_render(v, ctx, node)}" for k, v in node.kwargs.items()]
    return ", ".join(parts)


def _function_name(target: Any, node: Node, ctx: _Context) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target.namespace}.{target._schema.name.split('::')[1]}." \
               f"{target._overloadname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"torch.ops.{target._qualified_op_name.replace('::', '.')}"
    name = getattr(target, "__name__", None)
    if name:
        for home in _PUBLIC_HOMES:
            module = _resolve(home)
            if module is not None and getattr(module, name, None) is target:
                return f"{home}.{name}"
        if getattr(builtins, name, None) is target:
            return name
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        raise CodegenError(f"{node.name} calls {target!r}, which cannot be imported by name",
                           hint="define the function at module level in an importable module")
    ctx.imports.add(module)
    return f"{module}.{qualname}"


def _resolve(dotted: str) -> Any:
    obj: Any = torch
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part, None)
    return obj


def _expression(node: Node, ctx: _Context) -> str:
    target = node.target
    if node.op == "call_module":
        return f"self.{ctx.attrs[target]}({_call_args(node, ctx)})"
    if node.op == "call_method":
        obj = _render(node.args[0], ctx, node)
        return f"{obj}.{target}({_call_args(node, ctx, skip=1)})"
    if target is ops.recv:
        return f"comm.recv({node.args[1]!r}, src={node.kwargs['src']!r})"
    if target is ops.send:
        value = _render(node.args[1], ctx, node)
        return f"comm.send({value}, {node.args[2]!r}, dst={node.kwargs['dst']!r})"
    if target is operator.getitem and not node.kwargs:
        return f"{_render(node.args[0], ctx, node)}[{_render(node.args[1], ctx, node)}]"
    if target is getattr and len(node.args) == 2 and isinstance(node.args[1], str) \
            and node.args[1].isidentifier() and not keyword.iskeyword(node.args[1]):
        return f"{_render(node.args[0], ctx, node)}.{node.args[1]}"
    if target in _INFIX and len(node.args) == 2 and not node.kwargs:
        a, b = (_render(x, ctx, node) for x in node.args)
        return f"{a} {_INFIX[target]} {b}"
    if target in _UNARY and len(node.args) == 1 and not node.kwargs:
        return f"{_UNARY[target]}{_render(node.args[0], ctx, node)}"
    return f"{_function_name(target, node, ctx)}({_call_args(node, ctx)})"


def _annotation(node: Node) -> str:
    info = node.meta.get(ir.TENSOR)
    if isinstance(info, ir.TensorInfo) or (isinstance(info, tuple) and info and all(
            isinstance(i, ir.TensorInfo) for i in info)):
        return f': "{ir.format_shape(info)}"'
    return ""


def _where(node: Node) -> str | None:
    line = source.from_stack_trace(node.meta.get("stack_trace"))
    return source.safe_comment(str(line)) if line else None


# --- the file ---------------------------------------------------------------------------------

def generate_stage(gm: GraphModule, header: StageHeader, *, class_name: str | None = None,
                   qualnames: dict[str, str] | None = None) -> str:
    """The source text of one stage (see the module docstring).

    qualnames maps graph attribute names to the model's names where they differ (aliases).
    """
    qualnames = qualnames or {}
    ctx = _Context(gm)
    taken: set[str] = set()
    attr_taken: set[str] = set()
    nodes = list(gm.graph.nodes)
    params, frozen, buffers, modules = {}, [], {}, {}
    for node in nodes:
        if node.op in ("get_attr", "call_module") and node.target not in ctx.attrs:
            name = qualnames.get(str(node.target), str(node.target))
            attr = identifier(name, attr_taken, reserved=_RESERVED, attribute=True)
            ctx.attrs[node.target] = attr
            value = _attr(gm, str(node.target))
            if node.op == "call_module":
                modules[attr] = name
            elif isinstance(value, nn.Parameter):
                params[attr] = name
                if not value.requires_grad:
                    frozen.append(attr)
            elif isinstance(value, torch.Tensor):
                buffers[attr] = name
            else:
                raise CodegenError(f"attribute {node.target!r} is a {type(value).__name__}, "
                                   "not a tensor", hint="please report this model")
    for node in nodes:
        if node.op not in ("get_attr", "output"):
            base = "comm_" if node.op == "placeholder" and node.name == "comm" else node.name
            ctx.names[node] = "comm" if node is nodes[0] else identifier(base, taken, reserved=_RESERVED)
    cls = class_name or f"Stage{header.stage}"
    body = _forward(nodes, ctx)
    lines = _header(header)
    lines += ["from __future__ import annotations", ""]
    lines += [f"import {m}" for m in sorted({"torch", *ctx.imports} - {"builtins"})]
    lines += ["", "from fxpipe.runtime.stage import StageModule, checkpoint", "", ""]
    lines += [f"class {cls}(StageModule):",
              f'    """Stage {header.stage} of {header.num_stages} of {_doc(header.model)}: '
              f'{_doc(header.span)}."""', "",
              f"    STAGE = {header.stage}",
              f"    INPUTS = {tuple(ctx.names[n] for n in nodes[1:] if n.op == 'placeholder')!r}"]
    lines += _mapping("PARAMETERS", params, "attribute -> name in the model's state_dict")
    if frozen:
        lines.append(f"    FROZEN = {tuple(frozen)!r}")
    lines += _mapping("BUFFERS", buffers, None)
    lines += _mapping("MODULES", modules, "leaf modules, bound from the model")
    lines += [""] + body
    return "\n".join(lines).rstrip() + "\n"


def _doc(text: str) -> str:
    return source.safe_comment(text).replace('"""', "'''").replace("\\", "\\\\")


def _mapping(name: str, items: dict[str, str], comment: str | None) -> list[str]:
    if not items:
        return []
    out = [f"    {name} = {{" + (f"  # {comment}" if comment else "")]
    out += [f"        {attr!r}: {qual!r}," for attr, qual in items.items()]
    return out + ["    }"]


def _header(header: StageHeader) -> list[str]:
    out = [f"# Generated by fxpipe {header.version} -- do not edit. Regenerate with:",
           f"#   {source.safe_comment(header.command, limit=400)}", "#",
           f"# Stage {header.stage} of {header.num_stages}: {source.safe_comment(header.span)}"]
    out += [f"#   {source.safe_comment(line, limit=400)}" for line in header.lines]
    out.append(f"#   passes  {header.passes}")
    return out


def _attr(gm: GraphModule, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _regions(nodes: Sequence[Node]) -> dict[str, list[Node]]:
    regions: dict[str, list[Node]] = {}
    for node in nodes:
        region = node.meta.get(ir.REMAT)
        if region is not None:
            regions.setdefault(region, []).append(node)
    return regions


def _forward(nodes: list[Node], ctx: _Context) -> list[str]:
    regions = _regions(nodes)
    placeholders = [n for n in nodes[1:] if n.op == "placeholder"]
    sig = ", ".join(["self", "comm"] + [f'{ctx.names[p]}{_annotation(p)}' for p in placeholders])
    lines = [f"    def forward({sig}):"]
    statements: list[tuple[list[str], set[Node], list[Node]]] = []  # (lines, uses, defines)
    methods: list[str] = []
    done: set[Node] = set()
    last_where: str | None = None
    for node in nodes:
        if node.op in ("placeholder", "get_attr") or node in done:
            continue
        if node.op == "output":
            value = node.args[0]
            text = "return None" if value is None else f"return {_render(value, ctx, node)}"
            statements.append(([text], set(node.all_input_nodes), []))
            continue
        region = node.meta.get(ir.REMAT)
        if region is not None:
            members = regions[region]
            done.update(members)
            call, uses, outs, method = _region(region, members, ctx)
            methods += method
            statements.append((["", f"# remat region {region}: {len(members)} operations, "
                                    "recomputed in backward instead of saved", call], uses, outs))
            last_where = None
            continue
        where = _where(node)
        text = []
        if where and where != last_where and not ir.is_comm(node):
            text += ["", f"# {where}"]
            last_where = where
        if node.target is ops.send or not node.users:
            text.append(_expression(node, ctx))
        else:
            text.append(f"{ctx.names[node]}{_annotation(node)} = {_expression(node, ctx)}")
        statements.append((text, set(node.all_input_nodes), [node]))
    body = _with_deletes(statements, ctx)
    return lines + [f"        {line}" if line else "" for line in body] + methods


def _with_deletes(statements, ctx: _Context) -> list[str]:
    """Statement lines plus `del` on its own line after each value's last use."""
    last_use: dict[Node, int] = {}
    for i, (_, uses, _) in enumerate(statements):
        for u in uses:
            last_use[u] = i
    out: list[str] = []
    for i, (text, _, defines) in enumerate(statements):
        out += text
        dead = sorted({ctx.names[n] for n, j in last_use.items()
                       if j == i and n in ctx.names and n.op != "get_attr"
                       and ctx.names[n] != "comm"} - {"comm"})
        if dead and not text[-1].startswith("return"):
            out.append(f"del {', '.join(dead)}")
    return out


def _region(region: str, members: list[Node], ctx: _Context) -> tuple[str, set, list, list[str]]:
    inside = set(members)
    inputs: list[Node] = []
    for node in members:
        for arg in node.all_input_nodes:
            if arg not in inside and arg.op != "get_attr" and arg not in inputs:
                inputs.append(arg)
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    names = [ctx.names[n] for n in inputs]
    if any(_uses_device(n) for n in members):
        names.insert(0, "comm")  # device constants are written as comm.device
    in_names = ", ".join(names)
    out_names = ", ".join(ctx.names[n] for n in outputs)
    args = f"self.{region}, comm.remat" + (f", {in_names}" if names else "")
    if len(outputs) == 1:
        call = f"{out_names}{_annotation(outputs[0])} = checkpoint({args})"
    elif outputs:
        call = f"{out_names} = checkpoint({args})"
    else:
        call = f"checkpoint({args})"
    method = ["", f"    def {region}(self{', ' if names else ''}{in_names}):",
              f'        """Remat region {region}: recomputed in the backward pass instead of '
              f'saved."""']
    last_where = None
    for node in members:
        where = _where(node)
        if where and where != last_where:
            method += [f"        # {where}"]
            last_where = where
        method.append(f"        {ctx.names[node]}{_annotation(node)} = {_expression(node, ctx)}")
    ret = out_names if len(outputs) != 1 else ctx.names[outputs[0]]
    method.append(f"        return {ret}" if outputs else "        return None")
    return call, set(inputs), outputs, method


def _uses_device(node: Node) -> bool:
    found = []
    torch.fx.node.map_aggregate((node.args, node.kwargs),
                                lambda a: found.append(a) if isinstance(a, torch.device) else a)
    return bool(found)


def load_stage_class(text: str, filename: str, class_name: str) -> type:
    """Executes generated stage source (fxpipe's own output) and returns its class."""
    import linecache
    import types

    module = types.ModuleType(filename.rsplit("/", 1)[-1].removesuffix(".py"))
    module.__file__ = filename
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    exec(compile(text, filename, "exec"), module.__dict__)  # noqa: S102 - generated code
    return getattr(module, class_name)

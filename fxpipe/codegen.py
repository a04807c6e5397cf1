"""Stage graphs to standalone, readable Python source (pure: no torch execution).

Each stage becomes a StageModule subclass: a provenance header, the parameters it binds, then
forward(comm, *inputs) with receives at the top, the model's operations in the middle (named
after the model's modules, shape-annotated, the user's source line as a comment where it
changes), sends at the bottom, and remat regions as methods run through `checkpoint`. Nothing
taken from the model is ever executed as code: names become sanitised identifiers, and strings
and numbers are written with repr().
"""
from __future__ import annotations

import functools
import keyword
import linecache
import math
import operator
import sys
import textwrap
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from fxpipe import ir, source
from fxpipe.callable_names import callable_name
from fxpipe.errors import CodegenError
from fxpipe.runtime import ops
from fxpipe.runtime.stage import StageModule
from fxpipe.source import identifier
from fxpipe.version import __version__

__all__ = ["FileHeader", "generate_stage", "load_stage_class"]

_RESERVED = {"self", "comm", "torch", "operator", "math", "checkpoint", "StageModule",
             "MicrobatchComm", "annotations"}
_INFIX = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
          operator.floordiv: "//", operator.mod: "%", operator.pow: "**", operator.matmul: "@",
          operator.and_: "&", operator.or_: "|", operator.xor: "^", operator.lshift: "<<",
          operator.rshift: ">>", operator.eq: "==", operator.ne: "!=", operator.lt: "<",
          operator.le: "<=", operator.gt: ">", operator.ge: ">="}
_UNARY = {operator.neg: "-", operator.pos: "+", operator.invert: "~", operator.not_: "not "}


_WIDTH = 100  # generated lines stay within this many characters
_BODY = 8  # indentation of statements inside a method


@dataclass(frozen=True)
class FileHeader:
    """The facts shown at the top of a stage file: the same command writes the same bytes on
    every machine, so nothing in it is measured or predicted from a device profile."""

    command: str  # how the program was compiled
    runnable: bool  # `command` is a shell command that regenerates the files
    model: str
    stage: int
    num_stages: int
    span: str
    lines: tuple[tuple[str, str], ...] = ()  # (label, text): flops, params, recv/send, remat ...
    passes: tuple[str, ...] = ()  # the passes that ran, in order
    version: str = __version__


@dataclass(frozen=True)
class _Call:
    """A call (or a list or tuple literal) kept in parts, so a long one can be wrapped at its
    arguments."""

    head: str  # what is called: "torch.nn.functional.linear", "x.view", "comm.send"; "" for a
    args: tuple[Expression, ...]  # literal
    brackets: str = "()"

    def __str__(self) -> str:
        return f"{self.head}{self.brackets[0]}{', '.join(map(str, self.args))}{self.brackets[1]}"


Expression = str | _Call


def _format(prefix: str, expr: Expression, indent: int = _BODY) -> list[str]:
    """`prefix + expr` as lines of at most _WIDTH characters once indented by `indent`: a long
    call breaks after its opening parenthesis, its arguments packed on the following lines (an
    argument too long itself is broken the same way); if even `prefix + callee(` is too long,
    the call moves into parentheses on the next line."""
    text = prefix + str(expr)
    if indent + len(text) <= _WIDTH or not isinstance(expr, _Call) or not expr.args:
        return [text]
    if prefix and indent + len(prefix + expr.head) + 1 > _WIDTH:
        inner = _format("", expr, indent + 4)
        return [prefix + "(", *("    " + line for line in inner[:-1]), "    " + inner[-1] + ")"]
    lines, current = [prefix + expr.head + expr.brackets[0]], ""
    for i, arg in enumerate(expr.args):
        end = "," if i < len(expr.args) - 1 else expr.brackets[1]
        piece = str(arg) + end
        candidate = f"{current} {piece}" if current else piece
        if indent + 4 + len(candidate) <= _WIDTH:
            current = candidate
            continue
        if current:
            lines.append("    " + current)
        if indent + 4 + len(piece) > _WIDTH and isinstance(arg, _Call):
            inner = _format("", arg, indent + 4)
            lines += ["    " + line for line in inner[:-1]]
            current = inner[-1] + end
        else:
            current = piece
    return [*lines, "    " + current]


def _comment(text: str, indent: int = _BODY) -> str:
    """A one-line comment of user text that fits the width."""
    return "# " + source.safe_comment(text, limit=_WIDTH - indent - 2)


@dataclass
class _Context:
    gm: GraphModule
    names: dict[Node, str] = field(default_factory=dict)
    attrs: dict[str, str] = field(default_factory=dict)  # get_attr target -> attribute
    imports: set[str] = field(default_factory=set)  # modules for `import m`
    from_imports: set[str] = field(default_factory=set)  # whole `from m import f as g` lines


def _literal(value: Any, node: Node) -> str:
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "float('nan')"
        if math.isinf(value):
            return "float('inf')" if value > 0 else "float('-inf')"
        return repr(value)
    if isinstance(value, complex):  # 1j, or complex(float('nan'), 1.0) where repr is no code
        return repr(value) if all(math.isfinite(x) for x in (value.real, value.imag)) else \
            f"complex({_literal(value.real, node)}, {_literal(value.imag, node)})"
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
            return f"self.{ctx.attrs[str(arg.target)]}"
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


def _call_args(node: Node, ctx: _Context, skip: int = 0) -> tuple[Expression, ...]:
    parts = [_argument(a, ctx, node) for a in node.args[skip:]]
    parts += [f"{k}={_render(v, ctx, node)}" for k, v in node.kwargs.items()]
    return tuple(parts)


def _argument(arg: Any, ctx: _Context, node: Node) -> Expression:
    """An argument; a list or tuple of several items stays in parts, so it can be wrapped."""
    if isinstance(arg, (list, tuple)) and len(arg) > 1:
        return _Call("", tuple(_render(a, ctx, node) for a in arg),
                     "[]" if isinstance(arg, list) else "()")
    return _render(arg, ctx, node)


def _expression(node: Node, ctx: _Context) -> Expression:
    target = node.target
    if node.op == "call_module":
        return _Call(f"self.{ctx.attrs[str(target)]}", _call_args(node, ctx))
    if node.op == "call_method":
        obj = _render(node.args[0], ctx, node)
        return _Call(f"{obj}.{target}", _call_args(node, ctx, skip=1))
    if target is ops.recv:
        return _Call("comm.recv", (repr(node.args[1]), f"src={node.kwargs['src']!r}"))
    if target is ops.send:
        value = _render(node.args[1], ctx, node)
        return _Call("comm.send", (value, repr(node.args[2]), f"dst={node.kwargs['dst']!r}"))
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
    return _Call(callable_name(target, node.name, ctx.imports, ctx.from_imports),
                 _call_args(node, ctx))


def _annotation(node: Node) -> str:
    info = node.meta.get(ir.TENSOR)
    if isinstance(info, ir.TensorInfo) or (isinstance(info, tuple) and info and all(
            isinstance(i, ir.TensorInfo) for i in info)):
        return f': "{_shape_text(info)}"'
    return ""


# Stamped blocks (fxpipe.frontend.stamp) share their shapes and stack traces with the block they
# copy: each distinct one is formatted once, not once per node of 1,000 blocks.
_shape_text = functools.lru_cache(maxsize=4096)(ir.format_shape)


def _where(node: Node) -> str | None:
    """The user's source line the node came from, as a comment that fits the width."""
    return _source_comment(node.meta.get("stack_trace"), len(sys.modules))


@functools.lru_cache(maxsize=4096)
def _source_comment(stack_trace: str | None, _modules: int) -> str | None:
    """Keyed on the number of modules too: source.display_path's answer may change with an
    import (a file imported under a more qualified name)."""
    line = source.from_stack_trace(stack_trace)
    return _comment(str(line)) if line else None


# --- the file ---------------------------------------------------------------------------------

def generate_stage(gm: GraphModule, header: FileHeader, *, class_name: str | None = None,
                   qualnames: dict[str, str] | None = None) -> str:
    """The source text of one stage (see the module docstring).

    qualnames maps graph attribute names to the model's names where they differ (aliases).
    """
    qualnames = qualnames or {}
    ctx = _Context(gm)
    nodes = list(gm.graph.nodes)
    params, frozen, buffers, modules = _bind_attributes(gm, nodes, ctx, qualnames)
    taken: set[str] = set()
    for node in nodes:
        if node.op not in ("get_attr", "output"):
            base = "comm_" if node.op == "placeholder" and node.name == "comm" else node.name
            ctx.names[node] = "comm" if node is nodes[0] else identifier(base, taken,
                                                                        reserved=_RESERVED)
    cls = class_name or f"Stage{header.stage}"
    body = _forward(nodes, ctx)
    inputs = tuple(ctx.names[n] for n in nodes[1:] if n.op == "placeholder")
    doc = f"Stage {header.stage} of {header.num_stages} of {header.model}: {header.span}."
    lines = _header(header)
    lines += ["from __future__ import annotations", ""]
    lines += [f"import {m}" for m in sorted({"torch", *ctx.imports} - {"builtins"})]
    lines += sorted(ctx.from_imports)
    lines += ["", "from fxpipe.runtime.comm import MicrobatchComm",
              "from fxpipe.runtime.stage import StageModule, checkpoint", "", ""]
    lines += [f"class {cls}(StageModule):", *_docstring(doc, 4), ""]
    lines += [f"    STAGE = {header.stage}"]
    lines += _constant("INPUTS", inputs)
    lines += _mapping("PARAMETERS", params, "attribute -> name in the model's state_dict")
    if frozen:
        lines += _constant("FROZEN", tuple(frozen))
    lines += _mapping("BUFFERS", buffers, None)
    lines += _mapping("MODULES", modules, "leaf modules, bound from the model")
    lines += ["", *body]
    return "\n".join(lines).rstrip() + "\n"


def _constant(name: str, items: tuple[str, ...]) -> list[str]:
    """`NAME = ('a', 'b')` at class level, wrapped when long."""
    literal = repr(items)
    if len(items) < 2 or 4 + len(name) + 3 + len(literal) <= _WIDTH:
        return [f"    {name} = {literal}"]
    return ["    " + line for line in _format(f"{name} = ", _Call("", tuple(map(repr, items))),
                                              indent=4)]


def _bind_attributes(gm: GraphModule, nodes: list[Node], ctx: _Context,
                     qualnames: dict[str, str]) -> tuple[dict[str, str], list[str],
                                                         dict[str, str], dict[str, str]]:
    """Attribute names for the graph's parameters, buffers and leaf modules (in ctx.attrs),
    returned as {attribute: model name} maps (and the frozen parameters)."""
    params: dict[str, str] = {}
    frozen: list[str] = []
    buffers: dict[str, str] = {}
    modules: dict[str, str] = {}
    taken: set[str] = set()
    for node in nodes:
        target = str(node.target)
        if node.op not in ("get_attr", "call_module") or target in ctx.attrs:
            continue
        name = qualnames.get(target, target)
        attr = identifier(name, taken, reserved=_RESERVED, attribute=True)
        ctx.attrs[target] = attr
        value = _attr(gm, target)
        if node.op == "call_module":
            modules[attr] = name
        elif isinstance(value, nn.Parameter):
            params[attr] = name
            if not value.requires_grad:
                frozen.append(attr)
        elif isinstance(value, torch.Tensor):
            buffers[attr] = name
        else:
            raise CodegenError(f"attribute {target!r} is a {type(value).__name__}, "
                               "not a tensor", hint="please report this model")
    return params, frozen, buffers, modules


def _docstring(text: str, indent: int) -> list[str]:
    """A docstring of user text (quotes and backslashes made harmless), wrapped to the width."""
    quotes = '"' * 3
    safe = source.safe_comment(text, limit=10_000).replace("\\", "\\\\")
    safe = safe.replace(quotes, "'" * 3)
    pad = " " * indent
    one = f"{pad}{quotes}{safe}{quotes}"
    if len(one) <= _WIDTH:
        return [one]
    wrapped = textwrap.wrap(safe, _WIDTH - indent - 3, break_on_hyphens=False)
    return [f"{pad}{quotes}{wrapped[0]}"] + [pad + line for line in wrapped[1:]] \
        + [f"{pad}{quotes}"]


def _mapping(name: str, items: dict[str, str], comment: str | None) -> list[str]:
    if not items:
        return []
    out = [f"    {name} = {{" + (f"  # {comment}" if comment else "")]
    for attr, qual in items.items():
        entry = f"        {attr!r}: {qual!r},"
        out += [entry] if len(entry) <= _WIDTH else [f"        {attr!r}:", f"            {qual!r},"]
    return [*out, "    }"]


def _header(header: FileHeader) -> list[str]:
    verb = "Regenerate with" if header.runnable else "Compiled with"
    out = [f"# Generated by fxpipe {header.version} -- do not edit. {verb}:"]
    command = _wrapped_comment(header.command, "#   ", "#     ", width=_WIDTH - 2)
    if header.runnable:  # a shell command: continued lines end with a backslash
        command = [line + " \\" for line in command[:-1]] + command[-1:]
    out += command
    out += ["#"]
    out += _wrapped_comment(f"Stage {header.stage} of {header.num_stages} of {header.model}: "
                            f"{header.span}", "# ", "#   ")
    for label, text in header.lines:
        out += _wrapped_comment(text, f"#   {label:<8}", "#   " + " " * 10)
    if header.passes:
        out += _wrapped_comment(" > ".join(header.passes), "#   passes  ", "#   " + " " * 10)
    return out


def _wrapped_comment(text: str, first: str, rest: str, width: int = _WIDTH) -> list[str]:
    """Comment lines of user text: `first` starts the first line, `rest` the following ones."""
    safe = source.safe_comment(text, limit=10_000)
    lines = textwrap.wrap(safe, width, initial_indent=first, subsequent_indent=rest,
                          break_on_hyphens=False, break_long_words=True)
    return lines or [first.rstrip()]


def _attr(gm: GraphModule, target: str) -> object:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _regions(nodes: Sequence[Node]) -> dict[str, list[Node]]:
    regions: dict[str, list[Node]] = {}
    for node in nodes:
        region = node.meta.get(ir.REMAT)
        if region is not None:
            regions.setdefault(region, []).append(node)
    return regions


_COMM = "comm: MicrobatchComm"  # the view of the stage's communication its code is given


def _signature(name: str, params: Sequence[str]) -> list[str]:
    """`def name(self, comm: MicrobatchComm, x: "f32[b, 64]", ...):`, wrapped when long."""
    lines = _format(f"def {name}", _Call("", ("self", *params)), indent=4)
    lines[-1] += ":"
    return ["    " + line for line in lines]


def _parameter(node: Node, ctx: _Context) -> str:
    """A method's parameter for `node`'s value: its name and, for a tensor, its shape (values
    cross stages and enter remat regions as tensors; sizes are read again from them)."""
    return ctx.names[node] + _annotation(node)


# (lines, values it uses, values it defines, the grad-mode and autocast regions it runs in)
Statement = tuple[list[str], set[Node], list[Node], ir.Mode]


def _forward(nodes: list[Node], ctx: _Context) -> list[str]:
    regions = _regions(nodes)
    placeholders = [n for n in nodes[1:] if n.op == "placeholder"]
    statements: list[Statement] = []
    methods: list[str] = []
    done: set[Node] = set()
    last_where: str | None = None
    for node in nodes:
        if node.op in ("placeholder", "get_attr") or node in done:
            continue
        if node.op == "output":
            value = node.args[0]
            returned = "return None" if value is None else f"return {_render(value, ctx, node)}"
            statements.append(([returned], set(node.all_input_nodes), [], ()))
            continue
        region = node.meta.get(ir.REMAT)
        if region is not None:
            members = regions[region]
            done.update(members)
            call, uses, outs, method = _region(region, members, ctx)
            methods += method
            note = (f"# remat region {region}: {len(members)} operations, recomputed in "
                    "backward instead of saved")
            statements.append((["", note, *call], uses, outs, ()))
            last_where = None
            continue
        where = _where(node)
        text: list[str] = []
        if where and where != last_where and not ir.is_comm(node):
            text += ["", where]
            last_where = where
        expr = _expression(node, ctx)
        mode = ir.mode(node)
        indent = _BODY + 4 * len(mode)
        if node.target is ops.send or not node.users:
            text += _format("", expr, indent)
        else:
            text += _format(f"{ctx.names[node]}{_annotation(node)} = ", expr, indent)
        statements.append((text, set(node.all_input_nodes), [node], mode))
    body = _with_deletes(statements, ctx)
    params = (_COMM, *(_parameter(p, ctx) for p in placeholders))
    return _signature("forward", params) + [" " * _BODY + line if line else "" for line in body] \
        + methods


def _with_deletes(statements: list[Statement], ctx: _Context) -> list[str]:
    """Statement lines plus `del` on its own line after each value's last use."""
    last_use: dict[Node, int] = {}
    for i, (_, uses, _, _) in enumerate(statements):
        for u in uses:
            last_use[u] = i
    chunks: list[tuple[list[str], ir.Mode]] = []
    for i, (text, _, _, mode) in enumerate(statements):
        lines = list(text)
        dead = sorted({ctx.names[n] for n, j in last_use.items()
                       if j == i and n in ctx.names and n.op != "get_attr"
                       and ctx.names[n] != "comm"})
        if dead and not text[-1].startswith("return"):
            one = f"del {', '.join(dead)}"
            indent = _BODY + 4 * len(mode)
            lines += [one] if indent + len(one) <= _WIDTH \
                else _format("del ", _Call("", tuple(dead)), indent)
        chunks.append((lines, mode))
    return _in_modes(chunks)


def _in_modes(chunks: list[tuple[list[str], ir.Mode]]) -> list[str]:
    """Statement lines, each run of statements in the same grad-mode and autocast regions
    inside the `with` statements the model's forward wrote (fxpipe.frontend.regions); a
    statement's leading comment stays above its `with`."""
    out: list[str] = []
    current: ir.Mode = ()
    for lines, mode in chunks:
        depth = len(mode)
        if mode != current:
            lead = 0
            while lead < len(lines) and (not lines[lead] or lines[lead].startswith("#")):
                lead += 1
            out += lines[:lead]
            out += ["    " * i + f"with {_context(m)}:" for i, m in enumerate(mode)]
            lines = lines[lead:]
            current = mode
        out += ["    " * depth + line if line else "" for line in lines]
    return out


def _context(m: ir.GradMode | ir.AutocastMode) -> str:
    """The context manager that enters one region, as the model wrote it."""
    if isinstance(m, ir.GradMode):
        return "torch.enable_grad()" if m.enabled else "torch.no_grad()"
    parts = [repr(m.device_type)]
    if m.dtype is not None:
        parts.append(f"dtype={m.dtype}")
    parts.append(f"enabled={m.enabled}")
    if m.cache_enabled is not None:
        parts.append(f"cache_enabled={m.cache_enabled}")
    return f"torch.autocast({', '.join(parts)})"


def _region(region: str, members: list[Node],
            ctx: _Context) -> tuple[list[str], set[Node], list[Node], list[str]]:
    """The call of a remat region in forward, the values it uses and defines, and its method."""
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
    out_names = ", ".join(ctx.names[n] for n in outputs)
    call = _Call("checkpoint", (f"self.{region}", *names, "enabled=comm.remat"))
    if len(outputs) == 1:
        lines = _format(f"{out_names}{_annotation(outputs[0])} = ", call)
    elif outputs:
        lines = _format(f"{out_names} = ", call)
    else:
        lines = _format("", call)
    params = [_parameter(n, ctx) for n in inputs]
    if names and names[0] == "comm":
        params.insert(0, _COMM)
    method = ["", *_signature(region, params),
              f'        """Remat region {region}: recomputed in the backward pass instead of '
              'saved."""']
    last_where = None
    chunks: list[tuple[list[str], ir.Mode]] = []
    for node in members:
        where = _where(node)
        text = [where] if where and where != last_where else []
        last_where = where or last_where
        mode = ir.mode(node)
        text += _format(f"{ctx.names[node]}{_annotation(node)} = ", _expression(node, ctx),
                        _BODY + 4 * len(mode))
        chunks.append((text, mode))
    method += [" " * _BODY + line for line in _in_modes(chunks)]
    ret = out_names if len(outputs) != 1 else ctx.names[outputs[0]]
    method.append(f"        return {ret}" if outputs else "        return None")
    return lines, set(inputs), outputs, method


def _uses_device(node: Node) -> bool:
    found: list[torch.device] = []
    torch.fx.node.map_aggregate((node.args, node.kwargs),
                                lambda a: found.append(a) if isinstance(a, torch.device) else a)
    return bool(found)


class _StageSource:
    """A stage module's loader as linecache reads it: the source's lines are made when a
    traceback (or inspect) first asks for them, not kept as lines for every stage of a deep
    model at compile time."""

    def __init__(self, text: str) -> None:
        self.text = text

    def get_source(self, name: str) -> str:
        return self.text


def load_stage_class(text: str, filename: str, class_name: str) -> type[StageModule]:
    """Executes generated stage source (fxpipe's own output) and returns its class. Its lines
    show in tracebacks under `filename` (not of the form "<...>", which linecache reads from
    no loader), the latest stage loaded under that name winning."""
    module = types.ModuleType(filename.rsplit("/", 1)[-1].removesuffix(".py"))
    module.__file__ = filename
    linecache.cache.pop(filename, None)
    linecache.lazycache(filename, {"__name__": module.__name__, "__loader__": _StageSource(text)})
    exec(compile(text, filename, "exec"), module.__dict__)  # noqa: S102 - generated code
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, StageModule)):
        raise CodegenError(f"{filename} defines no stage class {class_name!r}",
                           hint="write the program again with this fxpipe version")
    return cls

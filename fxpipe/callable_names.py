"""How generated code names a callable the graph calls: a spelling that evaluates to that very
object (a public torch home, a builtin, an op overload, or the module that defines it), and the
imports that spelling needs. Pure: it only reads attributes of loaded modules."""
from __future__ import annotations

import builtins
import sys
from typing import Any

import torch

from fxpipe.errors import CodegenError

__all__ = ["callable_name"]

# where a public torch function is spelled from first
_PUBLIC_HOMES = ("torch.nn.functional", "torch", "torch.special", "torch.linalg", "torch.fft")


def callable_name(target: Any, node_name: str, imports: set[str], from_imports: set[str]) -> str:
    """How generated code spells the callable `target` that node `node_name` calls; the
    modules it needs go into `imports` (`import m`), whole from-import lines into
    `from_imports`. Raises CodegenError for a callable no import reaches."""
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target.namespace}.{target._schema.name.split('::')[1]}." \
               f"{target._overloadname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"torch.ops.{target._qualified_op_name.replace('::', '.')}"
    name: str | None = getattr(target, "__name__", None)
    if name:
        for home in _PUBLIC_HOMES:
            namespace = _resolve(home)
            if namespace is not None and getattr(namespace, name, None) is target:
                return f"{home}.{name}"
        if getattr(builtins, name, None) is target:
            return name
    module: str | None = getattr(target, "__module__", None)
    qualname: str | None = getattr(target, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        raise CodegenError(f"{node_name} calls {target!r}, which cannot be imported by name",
                           hint=_unimportable_hint(module, qualname))
    return _importable_name(target, module, qualname, imports, from_imports)


def _unimportable_hint(module: str | None, qualname: str | None) -> str:
    """How to make a callable importable by name, for why it is not."""
    if module == "__main__" and qualname and "<" not in qualname:
        return ("it is defined in the script run as __main__, which stage code cannot import "
                "(a written program's __main__ is its own program.py): move it into a module "
                "of its own and import it from there")
    if qualname and "<lambda>" in qualname:
        return "give it a name: a function defined with def at module level of a module"
    return "define it at module level of an importable module (not inside a function)"


def _importable_name(target: Any, module: str, qualname: str, imports: set[str],
                     from_imports: set[str]) -> str:
    """A spelling of `target` that resolves to `target` itself, with its import.

    `module.qualname` is written when attribute access from the top-level package reaches the
    target. It does not when a package re-exports a function under the name of the module that
    defines it (torchvision.ops.stochastic_depth is the function, not its module): then the
    shortest package attribute that holds the target, else a from-import, which loads the module
    through sys.modules and never through attributes.
    """
    dotted = f"{module}.{qualname}"
    if _resolves_to(dotted, target):
        imports.add(module)
        return dotted
    name = qualname.split(".")[0]
    parts = module.split(".")
    for end in range(1, len(parts)):
        package = ".".join(parts[:end])
        spelled = f"{package}.{qualname}"
        if "." not in qualname and _resolves_to(spelled, target):
            imports.add(package)
            return spelled
    alias = "_".join([*parts, "", name])
    from_imports.add(f"from {module} import {name} as {alias}")
    rest = qualname[len(name):]
    if not _resolves_to_object(getattr(sys.modules.get(module), name, None), rest, target):
        raise CodegenError(f"{dotted} does not name the function the graph calls ({target!r})",
                           hint="define the function at module level under its own name")
    return alias + rest


def _resolves_to(dotted: str, target: Any) -> bool:
    """Whether `import <modules>; <dotted>` evaluates to `target` (by attribute access from the
    top-level package, as the generated code will)."""
    top, _, rest = dotted.partition(".")
    return _resolves_to_object(sys.modules.get(top), "." + rest if rest else "", target)


def _resolves_to_object(obj: Any, attributes: str, target: Any) -> bool:
    for part in attributes.split(".")[1:]:
        obj = getattr(obj, part, None)
    return obj is target


def _resolve(dotted: str) -> Any:
    obj: Any = torch
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part, None)
    return obj

"""Runs of alike blocks: the children of an nn.ModuleList (or nn.Sequential) that can be captured
as three and stamped out (fxpipe.frontend.stamp), or one line saying why they cannot.

Alike means one class, the same parameter and buffer names, shapes, dtypes and requires_grad, the
same attributes apart from an int equal to the block's position (transformers' `layer_idx`), no
hooks and no weights shared, between blocks or with the rest of the model. Block 0 is traced
apart, so it may differ (T5's first block owns the position bias). `reduced` cuts such a list
to its first, second and last block for the length of a trace, and `indices_watched` notes a
traced block that reads its position while it runs: a block that branches on it (`if
self.layer_idx == 2: x = x.detach()`) may compute otherwise than the blocks traced, in ways no
check of values finds, so its list is not stamped.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["MIN_BLOCKS", "BlockRun", "alike", "find_blocks", "find_runs", "reduced",
           "indices_watched"]

MIN_BLOCKS = 4  # three are traced; below four nothing is left to stamp
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_SKIPPED = frozenset({"_parameters", "_buffers", "_modules", *_HOOKS,
                      "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                      "_forward_pre_hooks_with_kwargs"})


@dataclass(frozen=True)
class BlockRun:
    """A list of alike blocks: its qualified name and its number of children."""

    path: str
    count: int


# --- finding the blocks ---------------------------------------------------------------------------

def find_blocks(model: nn.Module) -> BlockRun | str:
    """The longest list of alike blocks, or one line saying why none can be stamped."""
    found = find_runs(model)
    return found[0] if isinstance(found, list) else found


def find_runs(model: nn.Module) -> list[BlockRun] | str:
    """Every list of alike blocks, longest first, none inside another (T5's encoder and decoder
    stacks), or one line saying why none can be stamped."""
    candidates = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or not path:
            continue
        children = list(module._modules.values())
        keys = list(module._modules)
        if len(children) < MIN_BLOCKS or keys != [str(i) for i in range(len(children))]:
            continue
        if all(type(c) is type(children[1]) for c in children[1:]):
            candidates.append((path, children))
    if not candidates:
        return f"no nn.ModuleList or nn.Sequential holds {MIN_BLOCKS} or more blocks of one class"
    candidates.sort(key=lambda c: -len(c[1]))
    first_reason = ""
    runs: list[BlockRun] = []
    for path, blocks in candidates:
        if any(_nested(path, run.path) for run in runs):
            continue
        reason = _unlike(model, path, blocks)
        if reason is None:
            runs.append(BlockRun(path, len(blocks)))
        else:
            first_reason = first_reason or reason
    return runs or first_reason


def _nested(a: str, b: str) -> bool:
    """Whether one of two module paths is inside the other (or they are one)."""
    return a == b or a.startswith(f"{b}.") or b.startswith(f"{a}.")


def _unlike(model: nn.Module, path: str, blocks: list[nn.Module]) -> str | None:
    """Why the blocks of `path` cannot be stamped (None if they can). Block 0 is traced, so it
    may differ from the rest."""
    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for name, t in [*block.named_parameters(remove_duplicate=False),
                        *block.named_buffers(remove_duplicate=False)]:
            j = owner.setdefault(id(t), i)
            if j != i:
                return f"blocks {j} and {i} of {path} share the weight {name!r}"
        for name, m in block.named_modules(remove_duplicate=False):
            hooked = [h for h in _HOOKS if getattr(m, h, None)]
            if hooked:
                where = f"{path}.{i}" + (f".{name}" if name else "")
                return f"{where} has a hook ({hooked[0].strip('_').replace('_', ' ')[:-1]})"
    inside = {id(t) for b in blocks for t in [*b.parameters(), *b.buffers()]}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        if id(t) in inside and not name.startswith(f"{path}."):
            return f"a block of {path} shares its weight with {name!r} outside the list"
    template = _layout(blocks[1])
    for i in range(2, len(blocks)):
        difference = _difference(template, _layout(blocks[i]), i)
        if difference is not None:
            return f"blocks 1 and {i} of {path} differ: {difference}"
    return None


def _layout(block: nn.Module) -> dict[str, Any]:
    """What must be equal between two blocks: weights' metadata and the modules' attributes."""
    out: dict[str, Any] = {}
    for name, p in block.named_parameters(remove_duplicate=False):
        out[f"parameter {name!r}"] = (tuple(p.shape), p.dtype, p.requires_grad)
    for name, b in block.named_buffers(remove_duplicate=False):
        out[f"buffer {name!r}"] = (tuple(b.shape), b.dtype)
    for name, m in block.named_modules(remove_duplicate=False):
        out[f"module {name!r}"] = type(m)
        for key, value in vars(m).items():
            if key not in _SKIPPED:
                out[f"attribute {(name + '.' if name else '') + key!r}"] = value
    return out


def _difference(template: dict[str, Any], other: dict[str, Any], index: int) -> str | None:
    """The first difference between block 1's layout and block `index`'s; an int equal to each
    block's position (an index kept for bookkeeping) is no difference."""
    if template.keys() != other.keys():
        missing = sorted(template.keys() ^ other.keys())
        return f"{missing[0]} is in one of them only"
    for key, a in template.items():
        b = other[key]
        if alike(a, b):
            continue
        if type(a) is int and type(b) is int and a == 1 and b == index:
            continue
        return f"{key} is {_short(a)} in block 1, {_short(b)} in block {index}"
    return None


def alike(a: Any, b: Any, depth: int = 3) -> bool:
    """Equal as attributes of two blocks: containers element by element, and a module held in
    a plain attribute (transformers' per-block kernel wrappers in a dict) by its class and its
    own layout, a few levels deep; anything else by `==`."""
    if a is b:
        return True
    if depth > 0 and isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(alike(a[k], b[k], depth - 1) for k in a)
    if depth > 0 and isinstance(a, (list, tuple)) and type(a) is type(b):
        return len(a) == len(b) and all(alike(x, y, depth - 1) for x, y in zip(a, b))
    if isinstance(a, nn.Module) and isinstance(b, nn.Module):
        if type(a) is not type(b) or depth <= 0:
            return False
        mine, theirs = _layout(a), _layout(b)
        return mine.keys() == theirs.keys() and \
            all(alike(mine[k], theirs[k], depth - 1) for k in mine)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return False
        return a.is_meta or bool(torch.equal(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        equal = a == b
    except Exception:  # noqa: BLE001 - any object may be an attribute
        return False
    return equal if isinstance(equal, bool) else False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- the reduced model ----------------------------------------------------------------------------

@contextlib.contextmanager
def reduced(model: nn.Module, run: BlockRun) -> Iterator[None]:
    """The model with the list holding its first, second and last block only, as the children
    "0", "1" and "2"; the list is put back as it was afterwards, also on error."""
    blocks = model.get_submodule(run.path)
    kept = blocks._modules
    children = list(kept.values())
    three = type(kept)()
    three.update({"0": children[0], "1": children[1], "2": children[-1]})
    blocks.__dict__["_modules"] = three
    try:
        yield
    finally:
        blocks.__dict__["_modules"] = kept


# --- blocks that read their position --------------------------------------------------------------

class _WatchedIndex:
    """Stands for a block's position while a traced block runs: anything that reads its value
    (a comparison, arithmetic, indexing with it, printing) notes the block's attribute in
    `reads`; C code that takes it for an int reads it through __index__ or raises, which the
    trace reports. It is no int (isinstance says so), so that isinstance checks over a module's
    attributes (fxpipe's own, as the trace starts) are no reads."""

    def __init__(self, value: int, name: str, reads: list[str]) -> None:
        object.__setattr__(self, "_watched", (value, name, reads))

    def _read(self) -> int:
        value, name, reads = object.__getattribute__(self, "_watched")
        if name not in reads:
            reads.append(name)
        return int(value)


def _reading(name: str) -> Any:
    def method(self: _WatchedIndex, *args: Any) -> Any:
        return getattr(self._read(), name)(*args)
    method.__name__ = name
    return method


for _name in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__",
              "__index__", "__int__", "__float__", "__hash__", "__str__", "__repr__",
              "__format__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__",
              "__rmod__", "__divmod__", "__rdivmod__", "__pow__", "__rpow__", "__neg__",
              "__pos__", "__abs__", "__invert__", "__and__", "__rand__", "__or__", "__ror__",
              "__xor__", "__rxor__", "__lshift__", "__rlshift__", "__rshift__", "__rrshift__",
              "__round__", "__trunc__", "__floor__", "__ceil__"):
    setattr(_WatchedIndex, _name, _reading(_name))


def _indices(blocks: list[nn.Module]) -> list[tuple[nn.Module, str, int, str]]:
    """(module, attribute, value, name) of each int attribute that holds its block's position
    in every block from 1 on (the differences `_difference` lets pass), and in block 0 where
    block 0 holds it too."""
    def ints(block: nn.Module) -> dict[tuple[str, str], tuple[nn.Module, int]]:
        return {(name, key): (m, value) for name, m in block.named_modules(remove_duplicate=False)
                for key, value in vars(m).items() if key not in _SKIPPED and type(value) is int}

    found = [ints(block) for block in blocks]
    positions = [k for k in found[1] if all(k in f and f[k][1] == i
                                            for i, f in enumerate(found) if i > 0)]
    return [(f[k][0], k[1], i, f"{k[0]}.{k[1]}" if k[0] else k[1])
            for k in positions for i, f in enumerate(found) if k in f and f[k][1] == i]


@contextlib.contextmanager
def indices_watched(model: nn.Module, runs: list[BlockRun]) -> Iterator[dict[str, list[str]]]:
    """While each block of `runs` (whole lists: cut them after) holds a watcher in place of
    each position it keeps (see _WatchedIndex), yields {list path: the attributes its blocks
    read}; puts the ints back afterwards, also on error."""
    reads: dict[str, list[str]] = {run.path: [] for run in runs}
    swapped: list[tuple[nn.Module, str, int]] = []
    try:
        for run in runs:
            blocks = [b for b in model.get_submodule(run.path)._modules.values() if b is not None]
            for module, key, value, name in _indices(blocks):
                vars(module)[key] = _WatchedIndex(value, name, reads[run.path])
                swapped.append((module, key, value))
        yield reads
    finally:
        for module, key, value in swapped:
            vars(module)[key] = value

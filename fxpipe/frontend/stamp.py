"""Repeated blocks captured once: the layers of a ModuleList traced as three, the rest stamped.

A deep model spends most of its capture tracing the same block again and again. When the
children of one nn.ModuleList (or nn.Sequential) are alike (fxpipe.frontend.blocks), the model
is captured with that list cut to three blocks: the first (which may differ: T5's owns the position
bias), the second and the last. When the second and third come out as the same graph up to
parameter names, reading the previous block's outputs (a chain) and values from outside the loop
(masks, position embeddings), the other blocks are copies of the third with their parameter
targets renamed and the metadata (shapes, export's values, module stacks) copied. Every such
list not inside another is cut at once (T5's encoder and decoder stacks): one trace for all. A
list whose graph does not show this is left whole (the model traced again without cutting it);
anything else falls back to the full capture, and the reasons are kept for the report.

The reduced model is the user's model with each list's children swapped for three, put back
when the trace ends (also on error). A list whose traced blocks read their position while
traced (`layer_idx`, fxpipe.frontend.blocks.indices_watched) is left whole: a block not traced
could branch otherwise in ways no check of values finds (a detach, a clamp the example batch
does not reach).
"""
from __future__ import annotations

import contextlib
import functools
import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxpipe import ir
from fxpipe.frontend.blocks import BlockRun, alike, find_runs, indices_watched, reduced
from fxpipe.frontend.lazy_code import recompile_lazily

__all__ = ["BLOCKS", "StampedBlocks", "Stamper"]

BLOCKS = "fxpipe_stamped_blocks"
"""GraphModule.meta key: a tuple of StampedBlocks, one per list, its blocks node for node
(passes.cost hands the costs of one block over to its copies)."""


@dataclass(frozen=True)
class StampedBlocks:
    """The blocks 1..N-1 of a stamped list, each as its nodes in the order of block 2's: the
    i-th node of every block computes what block 2's i-th node computes (block 0 may differ)."""

    path: str
    blocks: tuple[tuple[fx.Node, ...], ...]  # blocks[k - 1]: block k


class StampRefused(Exception):
    """The reduced graph does not show a chain of equal blocks: capture the whole model."""


class Stamper:
    """Captures a model through its reduced twin when it has runs of alike blocks.

    `note` says afterwards what happened, in one line: how many blocks of which lists were
    stamped, or why the model was captured whole."""

    def __init__(self, model: nn.Module, outputs: int = -1) -> None:
        self.model = model
        self.outputs = outputs  # tensor and constant leaves of the model's output (set later)
        found = find_runs(model)
        self.runs: list[BlockRun] = found if isinstance(found, list) else []
        self.found = len(self.runs)
        self.stamped = 0
        self.note = "" if self.runs else f"not stamped: {found}"
        self.cutting = False  # the model is cut to three blocks a list now
        self.refused: list[str] = []  # why lists were left whole, kept across captures

    @property
    def stamped_every_list(self) -> bool:
        """Whether every list found was stamped: then the model cut to three blocks a list,
        with the stamped graph, stands for the whole model (fxpipe.frontend.capture)."""
        return self.stamped > 0 and len(self.runs) == self.found

    @contextlib.contextmanager
    def cut(self) -> Iterator[None]:
        """The model with each of its lists cut to three blocks (see reduced())."""
        with contextlib.ExitStack() as stack:
            for run in self.runs:
                stack.enter_context(reduced(self.model, run))
            self.cutting = True
            try:
                yield
            finally:
                self.cutting = False

    def capture(self, front: Callable[[], fx.GraphModule]) -> fx.GraphModule:
        """`front()` (a trace of self.model) on the reduced model, stamped out to the whole one;
        a list whose reduced graph is not a chain of equal blocks is left whole (the model
        traced again without it), and the model is traced whole when none is left."""
        if not self.runs:
            return front()
        refused = self.refused
        while self.runs:
            try:
                with indices_watched(self.model, self.runs) as reads, self.cut():
                    gm = front()
            except Exception as error:  # noqa: BLE001 - then the whole model says what is wrong
                whole = front()  # a front end that fails on the whole model too raises here
                first = str(error).strip().splitlines()[0] if str(error).strip() else ""
                lists = " and ".join(run.path for run in self.runs)
                self.refuse(f"the model with 3 blocks of {lists} was not captured: "
                            f"{type(error).__name__}: {first}"[:300])
                return whole
            reading = [run for run in self.runs if reads[run.path]]
            if reading:  # a block not traced may branch otherwise: those lists left whole
                for run in reading:
                    refused.append(f"the blocks of {run.path} read their position "
                                   f"({', '.join(reads[run.path][:2])}) in forward, so a "
                                   f"block not traced may compute otherwise")
                    self.runs.remove(run)
                continue
            try:
                for run in self.runs:
                    gm = stamp(gm, run, self.model, self.outputs)
            except StampRefused as refusal:
                refused.append(str(refusal))
                self.runs.remove(run)
                continue
            self.stamped = sum(run.count - 3 for run in self.runs)
            self.note = "stamped " + " and ".join(
                f"{run.count - 3} of the {run.count} blocks of {run.path}" for run in self.runs) \
                + " from the graph of one" + "".join(f"; not stamped: {r}" for r in refused)
            return gm
        self.refuse("; ".join(refused))
        return front()

    def refuse(self, reason: str) -> None:
        """No stamping from here on; `reason` goes into the note."""
        self.runs = []
        self.stamped = 0
        self.note = f"not stamped: {reason}"


def _block_of(node: fx.Node, path: str) -> int | None:
    """Which of the list's blocks a node belongs to (None: outside the list)."""
    if node.op in ("get_attr", "call_module"):
        return _index_in(str(node.target), path)
    for value in (node.meta.get("nn_module_stack") or {}).values():
        where = value[0] if isinstance(value, tuple) else value
        index = _index_in(ir.clean_module_path(str(where)), path)
        if index is not None:
            return index
    return None


def _index_in(qualname: str, path: str) -> int | None:
    if not qualname.startswith(f"{path}."):
        return None
    head = qualname[len(path) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def stamp(gm: fx.GraphModule, run: BlockRun, model: nn.Module, outputs: int) -> fx.GraphModule:
    """The graph of the whole model from the reduced model's: blocks 3..N-1 copies of block 2,
    chained, the nodes after the loop reading the last block. Raises StampRefused when blocks 1
    and 2 are not the same graph or the data flow is not a chain."""
    if gm.meta.get(ir.QUALNAMES):
        raise StampRefused("attribute names that need aliases in generated code")
    graph = gm.graph
    nodes = list(graph.nodes)
    output = nodes[-1]
    if len(_leaves(output.args[0])) != outputs:
        raise StampRefused(f"the model's outputs depend on the number of blocks of {run.path}")
    block = {n: _block_of(n, run.path) for n in nodes}
    members: list[list[fx.Node]] = [[n for n in nodes if block[n] == i] for i in range(3)]
    if any(not m for m in members):
        raise StampRefused(f"a block of {run.path} has no operation in the graph")
    position = {n: i for i, n in enumerate(nodes)}
    computing = [[n for n in m if n.op != "get_attr"] for m in members]
    first, last = position[computing[0][0]], position[computing[2][-1]]
    for n in nodes[first:last + 1]:
        if block[n] is None and n.op != "get_attr":
            raise StampRefused(f"{_shown(n)} runs between the blocks of {run.path}")
    for i in range(2):
        if position[computing[i][-1]] > position[computing[i + 1][0]]:
            raise StampRefused(f"blocks {i} and {i + 1} of {run.path} interleave")
    one, two = members[1], members[2]
    twin = _match(one, two, block, run.path)  # block 1 node -> block 2 node
    for n in one:
        for user in n.users:
            if block[user] not in (1, 2):
                raise StampRefused(f"{user.name} after the loop reads block 1 of {run.path}: "
                                   f"not a chain")
    template = {n.target: _attribute(gm, str(n.target)) for n in two
                if n.op in ("get_attr", "call_module")}
    hoisted = all(position[n] < position[computing[0][0]] for n in two if n.op == "get_attr")
    last_attr = max((n for n in two if n.op == "get_attr"), key=position.__getitem__,
                    default=computing[2][-1])
    previous = {n: n for n in two}  # block 2's node -> its copy in the block before
    after = {"op": computing[2][-1], "attr": last_attr if hoisted else computing[2][-1]}
    of_two = {b: a for a, b in twin.items()}
    aligned = [tuple(of_two[n] for n in two), tuple(two)]
    for k in range(3, run.count):
        previous = _copy_block(graph, two, k, previous, twin, block, after, hoisted, run.path)
        aligned.append(tuple(previous[n] for n in two))
    outside = {n for n in nodes if block[n] is None}
    for n in two:
        for user in list(n.users):
            if user in outside:
                user.replace_input_with(n, previous[n])
    _bind(gm, model, run, template)
    gm.meta[BLOCKS] = (*gm.meta.get(BLOCKS, ()), StampedBlocks(run.path, tuple(aligned)))
    graph.lint()
    # generating the code of 50k nodes takes seconds: what calls the module first generates it
    recompile_lazily(gm)
    return gm


def _copy_block(graph: fx.Graph, two: list[fx.Node], k: int, previous: dict[fx.Node, fx.Node],
                twin: dict[fx.Node, fx.Node], block: dict[fx.Node, int | None],
                after: dict[str, fx.Node], hoisted: bool, path: str) -> dict[fx.Node, fx.Node]:
    """Block k as a copy of block 2, reading block k-1 (`previous`: block 2's node -> its copy
    there) where block 2 reads block 1; inserted after `after` (the last operation, and the
    last attribute when the front end puts attributes first). Returns block 2's node -> copy."""
    copies: dict[fx.Node, fx.Node] = {}
    stacks: dict[Any, Any] = {}  # block 2's module stack -> block k's, shared by its nodes

    def source(x: fx.Node) -> fx.Node:
        if x in copies:
            return copies[x]
        if block[x] == 1:  # the chain: what the block before computed
            return previous[twin[x]]
        return x  # a value from outside the loop, or from block 0, shared

    for n in two:
        cursor = "attr" if n.op == "get_attr" and hoisted else "op"
        with graph.inserting_after(after[cursor]):
            copy = graph.create_node(
                n.op, _renamed_target(n, path, k), fx.map_arg(n.args, source),
                fx.map_arg(n.kwargs, source), name=_copy_name(n, path, k))
        copy.meta = _renamed_meta(n.meta, path, k, stacks)
        copies[n] = copy
        after[cursor] = copy
        if not hoisted:
            after["attr"] = copy
    return copies


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


def _match(one: list[fx.Node], two: list[fx.Node], block: dict[fx.Node, int | None],
           path: str) -> dict[fx.Node, fx.Node]:
    """Block 1's nodes paired with block 2's when the two are the same graph up to names, each
    input of block 2 either block 1's output where block 1 read block 0 (the chain) or the value
    block 1 reads too (shared); else StampRefused saying where they differ."""
    if len(one) != len(two):
        raise StampRefused(f"blocks 1 and 2 of {path} are graphs of {len(one)} and {len(two)} "
                           f"nodes")
    twin = dict(zip(one, two))
    inputs: list[tuple[fx.Node, fx.Node]] = []

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, fx.Node) or isinstance(b, fx.Node):
            if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
                return False
            if a in twin:
                return twin[a] is b
            if block[b] == 2:
                return False
            inputs.append((a, b))
            return True
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) \
                and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
        return type(a) is type(b) and alike(a, b)

    for a, b in zip(one, two):
        relative_a = _relative(a, path, 1)
        relative_b = _relative(b, path, 2)
        if a.op != b.op or relative_a != relative_b or not same(a.args, b.args) \
                or not same(a.kwargs, b.kwargs) or not _same_value(a, b):
            raise StampRefused(f"blocks 1 and 2 of {path} differ at {_shown(b)} "
                               f"(block 1: {_shown(a)})")
    for a, b in inputs:
        if block[b] == 1:
            if block[a] != 0:
                raise StampRefused(f"block 2 of {path} reads {b.name} of block 1 where block 1 "
                                   f"reads {a.name}, not block 0's output: not a chain")
        elif a is not b:
            raise StampRefused(f"blocks 1 and 2 of {path} read {a.name} and {b.name}, neither "
                               f"the block before's output nor one value: not a chain")
    return twin


def _shown(node: fx.Node) -> str:
    """The node as fx prints it, shortened for a one-line reason."""
    text = node.format_node() or node.name
    return text if len(text) <= 100 else text[:97] + "..."


def _relative(node: fx.Node, path: str, index: int) -> Any:
    if node.op in ("get_attr", "call_module"):
        target = str(node.target)
        prefix = f"{path}.{index}"
        if target == prefix or target.startswith(f"{prefix}."):
            return target[len(prefix):]
    return node.target


def _same_value(a: fx.Node, b: fx.Node) -> bool:
    """Equal metadata that decides what a node computes: shapes, dtypes, grad and autocast."""
    if a.meta.get(ir.MODE) != b.meta.get(ir.MODE):
        return False
    va, vb = a.meta.get("val"), b.meta.get("val")
    if isinstance(va, torch.Tensor) or isinstance(vb, torch.Tensor):
        return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) \
            and str(va.shape) == str(vb.shape) and va.dtype == vb.dtype
    return True


def _renamed(text: str, path: str, k: int) -> str:
    return _block_two(path).sub(lambda _: f"{path}.{k}", text)


@functools.lru_cache(maxsize=64)
def _block_two(path: str) -> re.Pattern[str]:
    """`path.2` as a whole name part (compiled once: it renames every node of every copy)."""
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(path)}\.2(?=$|\.)")


def _copy_name(node: fx.Node, path: str, k: int) -> str:
    """The name of block 2's node for block k's copy, without fx's counter (the graph numbers
    it again), so that names derived from it later are the ones a full capture gets."""
    if node.op == "get_attr":  # named after its target, as the front end spelled it
        flat = re.escape(re.sub(r"\W", "_", path))
        return re.sub(rf"(?<![A-Za-z0-9])({flat})_2(?=_|$)", rf"\g<1>_{k}", node.name, count=1)
    return re.sub(r"_\d+$", "", node.name)


def _renamed_target(node: fx.Node, path: str, k: int) -> Any:
    if node.op in ("get_attr", "call_module"):
        return _renamed(str(node.target), path, k)
    return node.target


def _renamed_meta(meta: dict[str, Any], path: str, k: int,
                  stacks: dict[Any, Any]) -> dict[str, Any]:
    """The metadata of block 2's node for block k's copy: the module stack renamed, the rest
    (shapes, export's values, costs) shared. The nodes of one module share one renamed stack
    (`stacks`, one per copy): at thousands of blocks, a stack per node was a tenth of the
    compile's memory."""
    out = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        try:
            key: Any = tuple(stack.items())
            hash(key)
        except TypeError:  # an unhashable entry: this node's stack alone
            key = id(stack)
        renamed = stacks.get(key)
        if renamed is None:
            renamed = stacks[key] = type(stack)(
                (_renamed(str(name), path, k),
                 (_renamed(str(value[0]), path, k), *value[1:]) if isinstance(value, tuple)
                 else _renamed(str(value), path, k))
                for name, value in stack.items())
        out["nn_module_stack"] = renamed
    return out


def _attribute(gm: fx.GraphModule, target: str) -> tuple[str, bool]:
    """How the GraphModule holds block 2's attribute: its kind and, for a buffer, whether it is
    saved in the state_dict (stamped blocks hold theirs alike)."""
    owner_path, _, name = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    if name in owner._parameters:
        return "parameter", True
    if name in owner._buffers:
        return "buffer", name not in owner._non_persistent_buffers_set
    if name in owner._modules:
        return "module", True
    return "attribute", True


def _bind(gm: fx.GraphModule, model: nn.Module, run: BlockRun,
          template: dict[Any, tuple[str, bool]]) -> None:
    """Points the targets of blocks 2..N-1 at the model's own weights and modules (block 2's
    pointed at the last block's while the model was reduced), held as block 2's are held."""
    for target, (kind, persistent) in template.items():
        for k in range(2, run.count):
            qualname = _renamed(str(target), run.path, k)
            owner_path, _, name = qualname.rpartition(".")
            owner = _module_at(gm, owner_path)
            value = operator.attrgetter(qualname)(model)
            if kind == "parameter":
                owner._parameters[name] = value
            elif kind == "buffer":
                owner._buffers[name] = value
                if not persistent:
                    owner._non_persistent_buffers_set.add(name)
            elif kind == "module":
                owner._modules[name] = value
            else:
                setattr(owner, name, value)


def _module_at(gm: nn.Module, path: str) -> nn.Module:
    """The GraphModule's module at `path`, made (as plain modules) where missing."""
    module = gm
    for part in path.split(".") if path else []:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module._modules[part] = child
        module = child
    return module


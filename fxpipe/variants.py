"""The program for another train/eval mode or other input shapes: the model captured again for
them, cut where the program is cut.

The mode is part of a captured graph (dropout's `training=True`, BatchNorm's batch statistics,
a model's own `if self.training:`), and so is every size but the batch's (a sequence length in
a view). A call in another mode (after `program.eval()` or `program.train()`) or with inputs of
other shapes beyond the batch dimension (a batch padded to another length) gets the program's
variant for them: the model captured again for the call's inputs in that mode (every module's
flag set, and put back after), costed, and cut at the first nodes of the program's stages, with
the program's micro-batches, schedule and placement. Every stage of the variant holds the
tensors the same stage holds in the program, so the stages keep the same parameters, buffers
and gradients (an optimizer over program.parameters() is untouched), and under torchrun no
tensor changes rank. A model whose other mode or shape takes another path through its layers,
so that the cut or a stage's tensors do not carry over, is refused, saying which.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from fxpipe import ir
from fxpipe.built import Built
from fxpipe.errors import ConfigError, PartitionError, RuntimeInputError
from fxpipe.pipeline import PlanAgreement, build, rebuild
from fxpipe.rebalance import cut_of, moves
from fxpipe.signature import copy_inputs, shape_text
from fxpipe.untouched import modes_kept

__all__ = ["KEPT", "Variants", "build_variant", "carried_cut", "in_mode", "mode_name"]


Shapes = tuple[tuple[int, ...], ...]  # a call's tensor shapes, each batch dimension as -1


KEPT = 8
"""Plans kept besides the installed one: a few modes and lengths, never one per length of a
dataset's sequences (each holds its graphs and code, a few MB for a small GPT)."""


class Variants:
    """The plans a program was built for, by train/eval mode and input shapes: each made once
    and kept for when calls come back to it, the `kept` used last (a plan dropped is made again
    when called for)."""

    def __init__(self, kept: int | None = None) -> None:
        self.made: OrderedDict[tuple[bool, Shapes], Built] = OrderedDict()
        self.kept = KEPT if kept is None else kept
        self.dropped = 0

    def plan_for(self, built: Built, model: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any], training: bool, *, agree: PlanAgreement | None,
                 caller: int, sharded: bool) -> Built:
        """The plan for a call of the program that runs `built`, in mode `training`, whose
        inputs differ from built's in mode or shapes beyond the batch dimension. `sharded`:
        FSDP2 shards the stages over replicas, which a new plan cannot rebuild; `caller`: the
        user's frame counted from here, for the warning that a new shape compiles."""
        signature = built.signature
        compiled = (built.capture_info.training, signature.shapes)
        now = (training, signature.call_shapes(args, kwargs) or signature.shapes)
        if sharded:
            raise ConfigError(
                f"the program was compiled in {mode_name(compiled[0])} mode for inputs of "
                f"shapes {_shapes(compiled[1])}, and is called in {mode_name(now[0])} mode "
                f"with {_shapes(now[1])}: its stages would be built again for that, and FSDP2 "
                "shards their parameters over the replicas (shard='full')",
                hint="compile one program per mode and input shapes, or shard='optimizer'")
        known = self.made.pop(now, None)
        reshaped = known is None and now[1] != compiled[1]
        if reshaped:
            warnings.warn(f"compiling the program again for inputs of shapes {_shapes(now[1])} "
                          f"(compiled for {_shapes(compiled[1])}); each new shape compiles "
                          f"once\nhint: pad inputs to a few lengths (e.g. a tokenizer's "
                          "pad_to_multiple_of) to compile a few programs", UserWarning,
                          stacklevel=caller)
        example = signature.example_like(args, kwargs, built.capture_info.batch_size)
        try:
            variant = build_variant(built, model, *example, now[0], known=known, agree=agree)
        except ConfigError:
            raise
        except Exception as e:
            if not reshaped:
                raise
            raise RuntimeInputError(
                f"inputs of shapes {_shapes(now[1])} differ from the compiled "
                f"{_shapes(compiled[1])} beyond the batch dimension, and compiling the program "
                f"for them failed: {type(e).__name__}: {str(e).splitlines()[0]}",
                hint="pass inputs of shapes the model takes (the compiled ones differ only in "
                     "the batch dimension B)") from e
        self._keep(compiled, built, caller)
        return variant

    def _keep(self, key: tuple[bool, Shapes], built: Built, caller: int) -> None:
        """Keeps `built` as the plan used last, dropping the one used longest ago beyond
        `kept`; the first drop warns, as from then on a shape that comes back compiles again."""
        self.made[key] = built
        self.made.move_to_end(key)
        while len(self.made) > self.kept:
            self.made.popitem(last=False)
            self.dropped += 1
            if self.dropped == 1:
                warnings.warn(
                    f"the program has been called with more than {self.kept + 1} input shapes "
                    "and modes; it keeps the plans of the last ones, and compiles again for a "
                    "shape it dropped\nhint: pad inputs to a few lengths (e.g. a tokenizer's "
                    "pad_to_multiple_of)", UserWarning, stacklevel=caller + 1)


def _shapes(shapes: Shapes) -> str:
    """Input shapes as a message shows them, B for the batch dimension."""
    return ", ".join(shape_text(shape) for shape in shapes)


def mode_name(training: bool) -> str:
    return "train" if training else "eval"


@contextlib.contextmanager
def in_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Runs the block with `model.train(training)`, then puts every module's own flag back
    (a model may hold a BatchNorm in eval mode inside a model in train mode)."""
    with modes_kept(model):
        model.train(training)
        yield


@torch.inference_mode(False)  # capturing tracks versions, which inference tensors lack
def build_variant(built: Built, model: nn.Module, args: tuple[Any, ...],
                  kwargs: dict[str, Any], training: bool, *,
                  known: Built | None = None, agree: PlanAgreement | None = None) -> Built:
    """The program `built` in mode `training` for the example batch (args, kwargs): the model
    captured so (or `known`, the variant made before) and cut where `built` is cut."""
    what = f"{mode_name(training)} mode" if training != built.capture_info.training else \
        "these input shapes"
    try:
        if known is None:
            # the cut is given: node counts of the other graph and split points do not apply
            config = replace(built.config, chunks=built.spec.chunks, split_points=None,
                             balance=built.config.balance
                             if isinstance(built.config.balance, str) else "cost")
            args, kwargs = copy_inputs(args, kwargs)
            with contextlib.ExitStack() as modes:
                modes.enter_context(in_mode(model, training))
                if isinstance(config.check, nn.Module):  # a meta model's twin runs alike
                    modes.enter_context(in_mode(config.check, training))
                variant = build(model, args, kwargs, config, agree=agree,
                                cut=lambda gm: carried_cut(built, gm))
        else:
            starts = carried_cut(built, known.captured)
            variant = known if cut_of(known) == starts else rebuild(known, {}, agree=agree,
                                                                     starts=starts)
    except PartitionError as e:
        raise ConfigError(
            f"the program's cut does not carry over to {what}: {str(e).splitlines()[0]}",
            hint=f"the model's forward takes another path for {what}; compile a program for "
                 "them (fxpipe.compile(model, example) in that mode, with such inputs)") from e
    moved = moves(built, variant)
    if moved:
        src, dst, name = moved[0]
        raise ConfigError(
            f"for {what} stage {dst} reads {name}, which stage {src} holds in the program "
            f"as compiled ({len(moved)} tensors would change stage)",
            hint=f"the model's forward uses its tensors elsewhere for {what}; compile a "
                 "program for them (fxpipe.compile(model, example) in that mode, with such "
                 "inputs)")
    return variant


def carried_cut(built: Built, other: GraphModule) -> tuple[str, ...]:
    """`built`'s cut in the graph `other` captured for another mode or shapes: each stage's
    first node where `other` has a node of that name, else of that place (the same module's
    n-th node: BatchNorm's `bn_add_` in train mode is `bn` in eval mode), else the first node
    after it that `other` has so."""
    mine, theirs = _places(built.captured), _places(other)
    names = {name for name, _ in theirs}
    by_place = {place: name for name, place in theirs}
    at = {name: i for i, (name, _) in enumerate(mine)}
    starts = []
    for start in cut_of(built):
        found = None
        for name, place in mine[at.get(start, len(mine)):]:
            found = name if name in names else by_place.get(place)
            if found is not None:
                break
        starts.append(found or start)  # else the partition names the node it cannot find
    return tuple(starts)


def _places(gm: GraphModule) -> list[tuple[str, tuple[str, int]]]:
    """Each compute node's name and place: its module and how many of that module's nodes
    come before it."""
    seen: dict[str, int] = {}
    out = []
    for node in ir.compute_nodes(gm.graph):
        path = ir.module_path(node)
        out.append((node.name, (path, seen.get(path, 0))))
        seen[path] = seen.get(path, 0) + 1
    return out

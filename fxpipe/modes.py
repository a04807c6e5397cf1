"""Train and eval mode of one program: the model captured in the other mode, cut where the
program is cut.

The mode is part of a captured graph (dropout's `training=True`, BatchNorm's batch statistics,
a model's own `if self.training:`), so a program compiled in train mode cannot run in eval
mode as it is. `program.eval()` and `program.train()` instead give the program its twin for
that mode: the model captured again in the mode (every module's flag set, and put back
after), costed, and cut at the first nodes of the program's stages, with the program's
micro-batches, schedule and placement. Every stage of the twin holds the tensors the same
stage holds in the program, so the stages keep the same parameters, buffers and gradients
(an optimizer over program.parameters() is untouched), and under torchrun no tensor changes
rank. A model whose other mode takes another path through its layers, so that the cut or a
stage's tensors do not carry over, is refused, saying which.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from torch import nn

from fxpipe import ir
from fxpipe.built import Built
from fxpipe.errors import ConfigError, PartitionError
from fxpipe.pipeline import PlanAgreement, build, rebuild
from fxpipe.rebalance import cut_of, moves
from fxpipe.signature import copy_inputs

__all__ = ["build_in_mode", "carried_cut", "in_mode"]


@contextlib.contextmanager
def in_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Runs the block with `model.train(training)`, then puts every module's own flag back
    (a model may hold a BatchNorm in eval mode inside a model in train mode)."""
    flags = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def build_in_mode(built: Built, model: nn.Module, args: tuple[Any, ...],
                  kwargs: dict[str, Any], training: bool, *,
                  known: Built | None = None, agree: PlanAgreement | None = None) -> Built:
    """The program `built` in the other mode, for the example batch (args, kwargs): the model
    captured in that mode (or `known`, an earlier twin) and cut where `built` is cut."""
    mode = "train" if training else "eval"
    try:
        if known is None:
            config = replace(built.config, chunks=built.spec.chunks)
            args, kwargs = copy_inputs(args, kwargs)
            with in_mode(model, training):
                known = build(model, args, kwargs, config, agree=agree)
        starts = carried_cut(built, known)
        twin = known if cut_of(known) == starts else rebuild(known, {}, agree=agree,
                                                              starts=starts)
    except PartitionError as e:
        raise ConfigError(
            f"the program's cut does not carry over to {mode} mode: {str(e).splitlines()[0]}",
            hint=f"the model's forward takes another path in {mode} mode; compile one program "
                 f"per mode, e.g. fxpipe.compile(model.{mode}(), ...)") from e
    moved = moves(built, twin)
    if moved:
        src, dst, name = moved[0]
        raise ConfigError(
            f"in {mode} mode stage {dst} reads {name}, which stage {src} holds in the program "
            f"as compiled ({len(moved)} tensors would change stage)",
            hint=f"the model's forward uses its tensors elsewhere in {mode} mode; compile one "
                 f"program per mode, e.g. fxpipe.compile(model.{mode}(), ...)")
    return twin


def carried_cut(built: Built, other: Built) -> tuple[str, ...]:
    """`built`'s cut in `other`'s graph: each stage's first node where `other` has a node of
    that name, else of that place (the same module's n-th node: BatchNorm's `bn_add_` in train
    mode is `bn` in eval mode), else the first node after it that `other` has so."""
    mine, theirs = _places(built), _places(other)
    names = {name for name, _ in theirs}
    by_place = {place: name for name, place in theirs}
    order = [name for name, _ in mine]
    at = {name: i for i, name in enumerate(order)}
    starts = []
    for start in cut_of(built):
        found = None
        for name, place in mine[at.get(start, len(mine)):]:
            found = name if name in names else by_place.get(place)
            if found is not None:
                break
        starts.append(found or start)  # else the partition names the node it cannot find
    return tuple(starts)


def _places(built: Built) -> list[tuple[str, tuple[str, int]]]:
    """Each compute node's name and place: its module and how many of that module's nodes
    come before it."""
    seen: dict[str, int] = {}
    out = []
    for node in ir.compute_nodes(built.captured.graph):
        path = ir.module_path(node)
        out.append((node.name, (path, seen.get(path, 0))))
        seen[path] = seen.get(path, 0) + 1
    return out

"""A stage as the runtime knows it: its plan (`StageSpec`, from fxpipe.pipeline.build or a
written program's program.json) and, in the process that holds it, its module on its device
(`HeldStage`), which both executors run."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule

from fxpipe import ir
from fxpipe.runtime.stage import StageModule

__all__ = ["StageSpec", "HeldStage"]


@dataclass(frozen=True)
class StageSpec:
    """What the runtime knows of one stage besides its code: where its class is, the flat model
    inputs it reads, its messages, and whether it draws random numbers."""

    index: int
    file: str  # its stage file in a written program
    class_name: str
    inputs: tuple[int, ...]  # indexes into the flat tensor inputs
    random: bool  # each micro-batch then gets its own RNG stream
    recvs: tuple[ir.CommInfo, ...]
    sends: tuple[ir.CommInfo, ...]

    @property
    def messages(self) -> dict[tuple[str, int, int], ir.ValueInfo]:
        """(value, src stage, dst stage) -> what it carries, for every message of the stage."""
        info = {(c.tag, c.peer, self.index): c.value for c in self.recvs}
        info.update({(c.tag, self.index, c.peer): c.value for c in self.sends})
        return info

    @property
    def written_recvs(self) -> frozenset[tuple[str, int, int]]:
        """(value, src stage, dst stage) of the receives the stage writes into in place (it
        gets a copy of a received leaf that requires grad)."""
        return frozenset((c.tag, c.peer, self.index) for c in self.recvs if c.written)


@dataclass
class HeldStage:
    """A stage this process runs: its plan, its module and the device that module sits on."""

    spec: StageSpec
    module: StageModule
    device: torch.device
    graph: GraphModule | None = None  # its graph when known, to name the node of a NaN/Inf

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def inputs(self) -> tuple[int, ...]:
        return self.spec.inputs

    @property
    def random(self) -> bool:
        return self.spec.random

"""What compiling produces: the captured graph, the partition plan and the generated stages.

A `Built` is plain data that the report, the writer, the checkpoint naming and the executors
read; `fxpipe.pipeline.build` makes it. Its `spec` is the runtime plan
(fxpipe.runtime.program.spec): what everything after the compiler runs by, the one home of chunks,
schedule and remat there.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch.fx import GraphModule

from fxpipe import ir
from fxpipe.config import CompileConfig
from fxpipe.frontend.capture import CaptureInfo
from fxpipe.passes.partition import BalanceRound, PartitionPlan
from fxpipe.passes.remat import RematRegion
from fxpipe.passes.split import StageGraph
from fxpipe.profile import DeviceProfile
from fxpipe.runtime.program.spec import ProgramSpec
from fxpipe.signature import Signature

__all__ = ["Snapshot", "BuiltStage", "Built"]


@dataclass(frozen=True)
class Snapshot:
    """The graph after one pass, as fx prints its code (cf. thunder.last_traces)."""

    after: str
    source: str | GraphModule  # the code, or a stage graph (left unchanged) whose code fx
    # writes when first read: a build of 128 stages need not generate them all

    @property
    def text(self) -> str:
        return self.source if isinstance(self.source, str) else self.source.code


@dataclass
class BuiltStage:
    """One stage as the compiler made it: its graph (with send/recv), remat regions and
    generated source. What the runtime reads of it is in Built.spec.stages."""

    graph: StageGraph  # the split's stage: its graph, inputs and messages
    source: str
    regions: list[RematRegion]

    @property
    def index(self) -> int:
        return self.graph.index

    @property
    def graph_module(self) -> GraphModule:  # with explicit send/recv nodes
        return self.graph.graph_module

    @property
    def recvs(self) -> tuple[ir.CommInfo, ...]:
        return self.graph.recvs

    @property
    def sends(self) -> tuple[ir.CommInfo, ...]:
        return self.graph.sends


@dataclass
class Built:
    """Everything one compile produced, for one example batch."""

    captured: GraphModule  # the whole graph, with costs and stages on its nodes
    plan: PartitionPlan
    stages: list[BuiltStage]
    profile: DeviceProfile
    config: CompileConfig  # with the schedule resolved
    spec: ProgramSpec  # the runtime plan
    history: list[Snapshot] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per pass
    model_name: str = ""  # the model's class name, as stage headers show it
    # node name -> factor its estimated time was multiplied by after measuring the stages
    # (balance="dynamic", program.rebalance()); "(loss)" for the loss
    corrections: dict[str, float] = field(default_factory=dict)
    # what balancing by measurement tried: each cut with its predicted and measured stages
    rounds: list[BalanceRound] = field(default_factory=list)
    cpu_timings: dict[str, float] = field(default_factory=dict)  # CPU seconds per pass
    # (schedule, ranks) -> the plan's simulated (step time, bubble), shared by its reports
    simulated: dict[tuple[str, int], tuple[float, float]] = field(
        default_factory=dict, repr=False, compare=False)

    @property
    def capture_info(self) -> CaptureInfo:
        info: CaptureInfo = self.captured.meta[ir.CAPTURE]
        return info

    @property
    def signature(self) -> Signature:
        return self.capture_info.signature

    @property
    def shared(self) -> dict[str, list[int]]:
        """Tied parameter -> the stages that hold it."""
        return self.spec.shared

    @property
    def edges(self) -> list[tuple[str, int, int]]:
        """Every (value, src stage, dst stage) that crosses stages, sorted."""
        return list(self.spec.edges)

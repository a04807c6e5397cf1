"""torch.distributed.pipelining at its best, for `fxpipe bench` to race against.

Both of its frontends, each at its natural cut (equal numbers of blocks per stage, as its
examples cut) and at fxpipe's cut, with every schedule it has for this configuration:
ScheduleGPipe and Schedule1F1B (one stage per rank), ScheduleInterleaved1F1B and
ScheduleInterleavedZeroBubble (two stages per rank, stage s on rank s % ranks) and
ScheduleZBVZeroBubble (two stages per rank, V-shaped: rank r holds stages r and 2R-1-r).

- traced: `pipeline()` with a split_spec at the first module of each stage; stage modules run as
  generated code (torch.export.unflatten's interpreter off, its faster mode).
- manual: eager stage modules holding the model's own submodules, cut at block boundaries (half
  blocks for the GPT: attention, MLP), built by hand as its documentation's examples do. Only
  models with a `blocks` stack whose forward this module knows (the bundled GPT and MLP); fxpipe's
  cut is rounded to the nearest boundary they can express.

Tied weights are copies per stage in torch pipelining: their gradients are summed by hand (on
the rank, then across the ranks that hold one). Every variant uses the same loss, micro-batches
and SGD as fxpipe's, so the first losses agree.
"""
from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.losses import default_loss
from fxpipe.runtime.communication.mesh import group_over

__all__ = ["TorchVariant", "SCHEDULES", "plan_variants", "build_torch_step", "failure_note",
           "error_line", "natural_points", "units_of", "rank_stages"]

# name -> (class name in torch.distributed.pipelining, stages per rank, placement)
SCHEDULES: dict[str, tuple[str, int, str]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
    "interleaved_1f1b_v4": ("ScheduleInterleaved1F1B", 4, "loop"),
}

Step = Callable[[], float]


@dataclass(frozen=True)
class TorchVariant:
    """One torch.distributed.pipelining configuration of the race."""

    frontend: str  # "traced" | "manual"
    cut: str  # "natural" | "fxpipe"
    schedule: str  # a key of SCHEDULES
    points: tuple[str, ...]  # traced: module names where stages 1.. begin
    units: tuple[int, ...]  # manual: the first unit (block or half block) of stages 1..

    @property
    def name(self) -> str:
        return f"torch_{self.frontend}_{self.cut}_{self.schedule}"

    @property
    def stages(self) -> int:
        return len(self.points or self.units) + 1


def _blocks(model: nn.Module) -> list[nn.Module] | None:
    """The model's `blocks` stack, if it has one."""
    blocks = getattr(model, "blocks", None)
    return list(blocks) if isinstance(blocks, (nn.ModuleList, nn.Sequential)) else None


def natural_points(model: nn.Module, stages: int) -> tuple[str, ...] | None:
    """Equal numbers of blocks per stage, as torch pipelining's examples cut (None without a
    `blocks` stack that divides)."""
    blocks = _blocks(model)
    if blocks is None or len(blocks) % stages:
        return None
    per = len(blocks) // stages
    return tuple(f"blocks.{s * per}" for s in range(1, stages))


def _is_gpt(model: nn.Module) -> bool:
    return type(model).__name__ == "GPT" and hasattr(model, "wte")


def units_of(model: nn.Module, module: str) -> int | None:
    """The manual frontend's unit where a stage starting at `module` starts: blocks for the MLP,
    half blocks for the GPT (attention part 2i, MLP part 2i+1), the nearest one."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "blocks" or not parts[1].isdigit():
        return None
    block = int(parts[1])
    if not _is_gpt(model):
        return block
    rest = ".".join(parts[2:])
    if rest in ("", "ln_1", "attn", "attn.c_attn"):
        return 2 * block
    if rest in ("ln_2", "mlp", "mlp.c_fc", "attn.c_proj", "attn.resid_dropout"):
        return 2 * block + 1
    return 2 * block + 2  # inside the MLP: the next block is nearer its end


def plan_variants(model: nn.Module, ranks: int, fxpipe_points: dict[int, Sequence[str]],
                  schedules: Sequence[str]) -> tuple[list[TorchVariant], list[str]]:
    """Every variant to run, and a note for each one that cannot (and why).

    fxpipe_points: stages -> the modules where fxpipe's stages 1.. begin, for each stage count.
    """
    variants, skipped = [], []
    manual = _blocks(model) is not None and (_is_gpt(model) or type(model).__name__ == "MLP")
    for schedule in schedules:
        per_rank = SCHEDULES[schedule][1]
        stages = ranks * per_rank
        cuts = {"natural": natural_points(model, stages),
                "fxpipe": tuple(fxpipe_points[stages]) if stages in fxpipe_points else None}
        for cut, points in cuts.items():
            if points is None:
                skipped.append(f"torch_*_{cut}_{schedule}: no {cut} cut into {stages} stages")
                continue
            variants.append(TorchVariant("traced", cut, schedule, tuple(points), ()))
            found = [units_of(model, p) for p in points]
            units = [u for u in found if u is not None]
            if not manual or len(units) < len(found):
                skipped.append(f"torch_manual_{cut}_{schedule}: the manual frontend needs the "
                               "bundled GPT or MLP")
            elif len(set(units)) < len(units) or sorted(units) != units or units[0] == 0:
                skipped.append(f"torch_manual_{cut}_{schedule}: cut {points} rounds to empty "
                               "stages")
            else:
                variants.append(TorchVariant("manual", cut, schedule, (), tuple(units)))
    return variants, skipped


def rank_stages(schedule: str, rank: int, ranks: int) -> list[int]:
    """The stages `rank` holds under `schedule`."""
    _, per_rank, placement = SCHEDULES[schedule]
    if per_rank == 1:
        return [rank]
    if placement == "v":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(per_rank)]


# --- the manual frontend -----------------------------------------------------------------------

class _GPTPart(nn.Module):
    """Units [first, last) of the bundled GPT: the embeddings before unit 0, half blocks (unit
    2i: ln_1 and attention of block i; 2i+1: ln_2 and MLP), the final LayerNorm and LM head
    after the last unit. It holds only its own modules (the model's), except the LM head, whose
    weight is tied to the embedding: a copy, like the traced frontend's, summed by hand."""

    def __init__(self, model: Any, first: int, last: int, total: int) -> None:
        super().__init__()
        self.first, self.last, self.total = first, last, total
        if first == 0:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.units = nn.ModuleList()
        for unit in range(first, last):
            block = list(model.blocks)[unit // 2]
            pair = (block.ln_1, block.attn) if unit % 2 == 0 else (block.ln_2, block.mlp)
            self.units.append(nn.ModuleList(pair))
        if last == total:
            head = model.lm_head
            self.ln_f = model.ln_f
            self.lm_head = nn.Linear(head.in_features, head.out_features, bias=False)
            self.lm_head.weight = nn.Parameter(head.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first == 0:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for unit in self.units:
            norm, sub = list(unit.children())
            x = x + sub(norm(x))
        if self.last == self.total:
            x = self.lm_head(self.ln_f(x))
        return x


class _MLPPart(nn.Module):
    """Blocks [first, last) of the bundled MLP, with its projection and head at the ends."""

    def __init__(self, model: Any, first: int, last: int, total: int) -> None:
        super().__init__()
        self.first, self.last, self.total = first, last, total
        if first == 0:
            self.proj = model.proj
        self.blocks = nn.ModuleList(list(model.blocks)[first:last])
        if last == total:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first == 0:
            x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        if self.last == self.total:
            x = self.head(self.ln_f(x))
        return x


def _manual_parts(model: nn.Module, units: Sequence[int]) -> list[nn.Module]:
    blocks = _blocks(model)
    assert blocks is not None
    total = 2 * len(blocks) if _is_gpt(model) else len(blocks)
    bounds = [0, *units, total]
    part = _GPTPart if _is_gpt(model) else _MLPPart
    return [part(model, a, b, total) for a, b in zip(bounds, bounds[1:])]


# --- building a step ---------------------------------------------------------------------------

@contextlib.contextmanager
def _generated_code() -> Iterator[None]:
    """Traced stages as generated code, not through an fx interpreter (its faster mode)."""
    try:
        from torch.export.unflatten import _disable_interpreter
    except ImportError:  # older torch: the interpreter it has
        yield
        return
    with _disable_interpreter():
        yield


def _traced(model: nn.Module, microbatch: tuple[Any, ...], variant: TorchVariant,
            mine: list[int], device: torch.device,
            group: Any) -> tuple[list[Any], list[nn.Module], list[dict[int, str]]]:
    from torch.distributed.pipelining import SplitPoint, pipeline

    with _generated_code(), warnings.catch_warnings():
        # pipeline() copies torch.export's tree specs, which torch's own deprecation of
        # LeafSpec reports on every copy: nothing the bench or its user can change
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                FutureWarning)
        pipe = pipeline(model, microbatch,
                        split_spec={p: SplitPoint.BEGINNING for p in variant.points})
        if pipe.num_stages != variant.stages:
            raise ValueError(f"split at {variant.points} made {pipe.num_stages} stages")
        stages = [pipe.build_stage(i, device, group) for i in mine]
        modules = [pipe.get_stage_module(i) for i in mine]
    # tied weights: {submod_pp_i: attribute} per copy
    ties = [{int(k.rsplit("_", 1)[1]): v for k, v in mapping.items()}
            for mapping in pipe.replicated_params]
    return stages, modules, ties


def _manual(model: nn.Module, microbatch: tuple[Any, ...], variant: TorchVariant,
            mine: list[int], device: torch.device,
            group: Any) -> tuple[list[Any], list[nn.Module], list[dict[int, str]]]:
    from torch.distributed.pipelining import PipelineStage

    parts = _manual_parts(model, variant.units)
    stages = [PipelineStage(parts[i], i, variant.stages, device, group=group) for i in mine]
    ties = [{0: "wte.weight", variant.stages - 1: "lm_head.weight"}] if _is_gpt(model) else []
    return stages, [parts[i] for i in mine], ties


def _tie_groups(ties: list[dict[int, str]], modules: list[nn.Module], mine: list[int],
                placement: Callable[[int], int], group: Any,
                made: dict[tuple[int, ...], Any]) -> list[tuple[list[nn.Parameter], Any]]:
    """Per tied weight: this rank's copies and the group of ranks that hold one (None: alone).
    A tie over every rank uses the variant's `group`; others a group of their ranks, made once
    per set of ranks and kept in `made` (fxpipe.runtime.communication.mesh.group_over)."""
    out = []
    for tie in ties:
        ranks = sorted({placement(s) for s in tie})
        holders = group_over(ranks, made, group) if len(ranks) > 1 else None
        params = list({id(p): p for p in (modules[mine.index(s)].get_parameter(name)
                                          for s, name in tie.items() if s in mine)}.values())
        if params:
            out.append((params, holders))
    return out


def build_torch_step(variant: TorchVariant, model: nn.Module, inputs: tuple[Any, ...],
                     target: torch.Tensor, chunks: int, rank: int, ranks: int,
                     group: Any = None,
                     tie_groups: dict[tuple[int, ...], Any] | None = None) -> Step:
    """A training step (forward, backward, tied-weight sums, SGD) of `variant` on this rank;
    returns the batch's loss on every rank. `group`: the process group of all ranks it runs
    on (None: the default group); `tie_groups`: the groups of tied weights held by some of the
    ranks, by their ranks, made on first use and shared by the variants given the same dict."""
    from torch.distributed import pipelining

    cls_name, per_rank, placement = SCHEDULES[variant.schedule]
    mine = rank_stages(variant.schedule, rank, ranks)
    device = torch.device("cpu")
    microbatch = tuple(x.tensor_split(chunks, dim=0)[0] for x in inputs)
    build = _traced if variant.frontend == "traced" else _manual
    stages, modules, ties = build(model, microbatch, variant, mine, device, group)
    total = variant.stages

    def owner(stage: int) -> int:
        return rank_stages_owner(variant.schedule, stage, ranks)

    tied = _tie_groups(ties, modules, mine, owner, group,
                       tie_groups if tie_groups is not None else {})
    cls = getattr(pipelining, cls_name)
    schedule = cls(stages[0] if per_rank == 1 else stages, chunks, loss_fn=default_loss)
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    optimizer = torch.optim.SGD(params, lr=1e-3)
    last = owner(total - 1)

    def step() -> float:
        losses: list[torch.Tensor] = []
        schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        for copies, holders in tied:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in copies]
            summed = torch.stack(grads).sum(0)
            if holders is not None:
                dist.all_reduce(summed, group=holders)
            for p in copies:
                p.grad = summed.clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = torch.tensor([float(sum(loss.detach() for loss in losses) / len(losses))
                              if losses else 0.0])
        dist.broadcast(value, src=last, group=group)
        return float(value)

    return step


def rank_stages_owner(schedule: str, stage: int, ranks: int) -> int:
    """The rank that holds `stage` under `schedule`."""
    for rank in range(ranks):
        if stage in rank_stages(schedule, rank, ranks):
            return rank
    raise ValueError(f"no rank holds stage {stage} of {schedule} on {ranks} ranks")


# how a rank's operations end when another rank stops: not a cause
_STOPPED_WITH_PEER = ("Connection closed by peer", "Connection reset by peer")
# gloo's refusal of a pair never connected; "$N" is the peer's rank
_UNCONNECTED_PAIR = re.compile(r"Pair is not connected \(\[[^\]]*\]:\d+\$(\d+) <--> \[none\]\)")


def error_line(e: BaseException) -> str:
    """One line on an exception: its type and the first line of its message that says
    something, and its cause's where it has one (torch wraps a stage's failure in an error
    whose message is the stage's inputs)."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    line = f"{type(e).__name__}: {first}"
    return line if e.__cause__ is None else f"{line} (from {error_line(e.__cause__)})"


def failure_note(name: str, errors: Sequence[str]) -> str:
    """One line on why a torch variant did not run, from every rank's error ("" where none):
    the ranks that failed first, then those that stopped with them (a closed connection)."""
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    causes = [(r, e) for r, e in failed if not any(m in e for m in _STOPPED_WITH_PEER)] or failed
    parts = []
    for rank, error in causes:
        pair = _UNCONNECTED_PAIR.search(error)
        if pair and int(pair.group(1)) == rank:
            error += (f" (a send from rank {rank} to itself, which gloo refuses: torch's traced "
                      "stages warm their connections up with a message to each neighbouring "
                      "stage, also to one on the same rank, where a V-shaped schedule puts it)")
        parts.append(f"rank {rank}: {error}")
    stopped = [f"rank {r} ({next((m for m in _STOPPED_WITH_PEER if m in e), e[:80])})"
               for r, e in failed if (r, e) not in causes]
    if stopped:
        parts.append(f"stopped with it: {', '.join(stopped)}")
    return f"{name}: {'; '.join(parts)}"

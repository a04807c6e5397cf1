"""Program: what fxpipe.compile returns. Call it, step it, write it, report it.

A Program is an nn.Module whose parameters are its stages' parameters (the model's own tensors,
shared, so the model trains with it). It is built on the first call when compiled without
example inputs, as torch.compile does.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.fx import GraphModule

from fxpipe import codegen, ir
from fxpipe.built import Built, BuiltStage, Snapshot
from fxpipe.checkpoint import load_checkpoint, restore, save_shard
from fxpipe.config import CompileConfig
from fxpipe.errors import CheckpointError, ConfigError, NotBuiltError, RuntimeInputError
from fxpipe.losses import LossFn, default_loss, loss_name, resolve_loss
from fxpipe.passes.partition import BalanceRound, PartitionPlan
from fxpipe.passes.remat import RematRegion
from fxpipe.pipeline import build, rebuild
from fxpipe.rebalance import (
    balance_by_measurement,
    balance_key,
    cut_of,
    load_balance,
    measure_local,
    measure_ranks,
    move_optimizer_state,
    move_state,
    save_balance,
    untouched,
)
from fxpipe.reference import reference_losses
from fxpipe.report import Report, build_report, cost_table, predicted_kept
from fxpipe.runtime.local import LocalExecutor, LocalStage
from fxpipe.runtime.memory import KeptMemory
from fxpipe.runtime.mesh import make_groups
from fxpipe.runtime.rank import (
    RankStage,
    StageWiring,
    mesh_of_world,
    rank_device,
    setup_rank,
    stage_devices,
)
from fxpipe.runtime.stage import StageModule
from fxpipe.state import StateNames, graph_tensors
from fxpipe.writer import ProgramFiles, write_program

__all__ = ["Program", "Stage"]


@dataclass
class Stage:
    """One stage of a built program."""

    index: int
    graph_module: GraphModule  # with explicit send/recv nodes
    source: str  # the generated Python file
    module: StageModule | None  # built here: every stage locally, this rank's under torchrun
    built: BuiltStage

    @property
    def recvs(self) -> tuple[ir.CommInfo, ...]:
        return self.built.graph.recvs

    @property
    def sends(self) -> tuple[ir.CommInfo, ...]:
        return self.built.graph.sends

    @property
    def regions(self) -> list[RematRegion]:
        return self.built.regions


class Program(nn.Module):
    """A model compiled into a pipeline (see fxpipe.compile)."""

    def __init__(self, model: nn.Module, config: CompileConfig) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: parameters() = the stages'
        self.model: nn.Module
        self.config = config
        self._built: Built | None = None
        self._names: StateNames | None = None
        self._example: list[torch.Tensor] = []
        self._local: LocalExecutor | None = None
        self._rank: RankStage | None = None
        self.stage_modules = nn.ModuleList()
        self._stage_views: list[Stage] = []
        self.measured: dict[str, Any] = {}
        self._last_batch: tuple[list[torch.Tensor], torch.Tensor | None, LossFn] | None = None

    # -- building -------------------------------------------------------------------------------

    @property
    def is_built(self) -> bool:
        return self._built is not None

    def build(self, *args: Any, **kwargs: Any) -> Program:
        """Compiles for this example batch (called by the first call when no example was given)."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        # The device first: under NCCL the plan's broadcast already runs on it.
        device = rank_device() if distributed else None
        built = build(self.model, args, kwargs, self.config,
                      agree=_broadcast_plan if distributed else None)
        self._names = StateNames.of_model(self.model, built.captured)
        self._example = [t.detach() for t in built.signature.flatten_inputs(args, kwargs)]
        self._install(built, device)
        if self.config.balance == "dynamic":
            self._balance_at_build(device)
        return self

    def _install(self, built: Built, device: torch.device | None) -> None:
        """Builds the stage modules and the executor of a built plan (every stage locally, this
        rank's under torchrun); `device` is this rank's, None in one process."""
        self._built = built
        if self._local is not None:
            self._local.close()
            self._local = None
        classes = [codegen.load_stage_class(s.source, f"<fxpipe stage {s.index}>", s.class_name)
                   for s in built.stages]
        tensors = graph_tensors(built.captured)
        modules = {ir.qualname(built.captured, k): v for k, v in built.captured.named_modules()}
        self.stage_modules = nn.ModuleList()
        self._stage_views = []
        if device is None:
            local = []
            for st, cls, stage_device in zip(built.stages, classes,
                                             stage_devices(self.config.stages,
                                                           self.config.devices)):
                module = cls(tensors, modules)
                _place(module, stage_device)
                self.stage_modules.append(module)
                local.append(LocalStage(module, stage_device, st.input_indexes, st.random,
                                        st.graph_module))
                self._stage_views.append(Stage(st.index, st.graph_module, st.source, module, st))
            self._local = LocalExecutor(local, built.signature, built.plan.chunks,
                                        self.config.remat, check_finite=self.config.check_finite)
        else:
            mesh = mesh_of_world(self.config.stages)
            st = built.stages[mesh.stage]
            module = classes[mesh.stage](tensors, modules)
            _place(module, device)
            self.stage_modules.append(module)
            for other in built.stages:
                self._stage_views.append(Stage(other.index, other.graph_module, other.source,
                                               module if other.index == mesh.stage else None,
                                               other))
            self._rank = setup_rank(
                module, StageWiring(st.index, st.input_indexes, st.graph.recvs, st.graph.sends,
                                    st.random),
                mesh=mesh, groups=make_groups(mesh, built.shared), device=device,
                signature=built.signature, edges=built.edges, shared=built.shared,
                chunks=built.plan.chunks, remat=self.config.remat,
                schedule=self.config.schedule, check_finite=self.config.check_finite,
                dp_bucket_mb=self.config.dp_bucket_mb, graph=st.graph_module)

    # -- balancing by measurement ----------------------------------------------------------------

    def _balance_at_build(self, device: torch.device | None) -> None:
        """balance="dynamic": the cut remembered for this model and machine, else measured."""
        built = self._require_built("plan")
        distributed = device is not None
        key = balance_key(built, dist.get_world_size() if distributed else 1)
        box: list[Any] = [load_balance(key) if not distributed or dist.get_rank() == 0 else None]
        if distributed:
            dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            starts, corrections, rounds = box[0]
            agreed = rebuild(built, corrections, agree=_broadcast_plan if distributed else None,
                             starts=starts)
            agreed.rounds = rounds
            self._install(agreed, device)
            self.measured["balance"] = "dynamic, the cut measured before on this machine (cache)"
            return
        self._run_balance(self._example, None, default_loss, steps=2, rounds=4, verbose=False)
        self.measured["balance"] = "dynamic, measured while compiling"

    def rebalance(self, *args: Any, target: torch.Tensor | None = None,
                  loss_fn: LossFn | None = None, optimizer: torch.optim.Optimizer | None = None,
                  steps: int = 2, rounds: int = 4, verbose: bool = False,
                  **kwargs: Any) -> list[BalanceRound]:
        """Measures each stage's compute time in a few training steps and moves the cut until
        the stages are balanced (as balance="dynamic" does when compiling), between steps of a
        running program. Parameters keep their values; under torchrun the ones that change rank
        move there with their optimizer state (pass `optimizer`, built on every rank over
        program.parameters(); it then holds this rank's new parameters).

        Without a batch it measures on the last step's batch, target and loss (else the example
        batch). The measuring steps change nothing: gradients, buffers and RNG state are
        restored. Every rank calls it. Returns the rounds (cut, predicted and measured time per
        stage), also in the report.
        """
        built = self._require_built("plan to rebalance")
        if args or kwargs:
            flat = built.signature.flatten_inputs(args, kwargs)
        else:
            flat, target, loss_fn = self._last_batch or (self._example, target, loss_fn)
        before = built
        after = self._run_balance(flat, target, loss_fn or default_loss, steps=steps,
                                  rounds=rounds, verbose=verbose)
        if self._rank is not None and cut_of(after) != cut_of(before):
            move_state(before, after, self._rank.mesh, graph_tensors(after.captured), optimizer)
        elif optimizer is not None:
            move_optimizer_state(optimizer)
        return after.rounds

    def _run_balance(self, flat: list[torch.Tensor], target: torch.Tensor | None,
                     loss_fn: LossFn, *, steps: int, rounds: int, verbose: bool) -> Built:
        built = self._require_built("plan to balance")
        device = self._rank.executor.device if self._rank is not None else None

        def measure(current: Built) -> list[float]:
            with untouched(self.model):
                if self._rank is not None:
                    return measure_ranks(self._rank, flat, target, loss_fn, steps)
                executor = self._local_executor("balancing")
                return measure_local(executor, current.signature, current.plan.chunks,
                                     self.config.remat, flat, target, loss_fn, steps)

        show = verbose and (device is None or dist.get_rank() == 0)
        after = balance_by_measurement(
            built, measure=measure, install=lambda b: self._install(b, device),
            agree=_broadcast_plan if device is not None else None, rounds=rounds,
            progress=(lambda line: print(f"[fxpipe] {line}", flush=True)) if show else None)
        if device is None or dist.get_rank() == 0:
            save_balance(balance_key(after, dist.get_world_size() if device else 1), after)
        return after

    def _require_built(self, what: str) -> Built:
        if self._built is None:
            raise NotBuiltError(f"the program has not been built yet, so it has no {what}",
                                hint="call it once with a batch (program(x)), or pass "
                                     "example_inputs to fxpipe.compile")
        return self._built

    def _local_executor(self, what: str) -> LocalExecutor:
        if self._local is None:
            raise ConfigError(f"{what} runs every stage in this process, but this process "
                              "holds one stage of a distributed pipeline",
                              hint="use program.step(inputs, target=...) on every rank")
        return self._local

    # -- running --------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the pipeline locally; outputs are differentiable into the model's parameters."""
        if self._built is None:
            self.build(*args, **kwargs)
        built = self._require_built("forward")
        executor = self._local_executor("calling a program")
        self._check_mode(built)
        flat = built.signature.flatten_inputs(args, kwargs)
        return built.signature.unflatten_outputs(executor.run(flat))

    def measure_activations(self, *args: Any, **kwargs: Any) -> list[dict[str, float]]:
        """Activation bytes each stage keeps for backward at the peak of a GPipe step (after all
        forwards), measured with saved-tensor hooks on a real forward, next to the prediction."""
        if self._built is None:
            self.build(*args, **kwargs)
        built = self._require_built("activations")
        executor = self._local_executor("measure_activations")
        trackers = [KeptMemory(module.parameters()) for module in self.stage_modules]
        flat = built.signature.flatten_inputs(args, kwargs)
        with torch.enable_grad():
            outputs = executor.run(flat, trackers)
        del outputs  # frees the graph: this was a measurement, not a step
        result = [{"stage": i, "measured_bytes": float(t.peak), "predicted_bytes": p}
                  for i, (t, p) in enumerate(zip(trackers, predicted_kept(built)))]
        self.measured["kept_activations"] = result
        return result

    def step(self, *args: Any, target: torch.Tensor | None = None,
             loss_fn: LossFn | None = None, scaler: torch.amp.GradScaler | None = None,
             **kwargs: Any) -> float:
        """One training step (forward and backward of every micro-batch); returns the loss.

        Gradients accumulate into the stage parameters with the scaling of one full-batch mean
        loss; call your optimizer on program.parameters() afterwards. Under torchrun every rank
        calls step() with the same batch; each computes its own stage. Under `torch.autocast`
        every stage runs in mixed precision. With `scaler` (a torch.amp.GradScaler) the backward
        runs on the scaled loss; then call scaler.step(optimizer) and scaler.update() as usual
        (every rank skips the step if any rank's gradients are not finite).
        """
        loss_fn = loss_fn or default_loss
        if self._built is None:
            self.build(*args, **kwargs)
        built = self._require_built("step")
        self._check_mode(built)
        self._last_batch = (built.signature.flatten_inputs(args, kwargs), target, loss_fn)
        if self._rank is not None:
            flat = self._last_batch[0]
            loss, result = self._rank.step(flat, target, loss_fn, scaler)
            self.measured["last_step_events"] = result.events
            self.measured["kept_bytes"] = result.kept_bytes
            return loss
        output = self(*args, **kwargs)
        value = loss_fn(output, target) if target is not None else loss_fn(output)
        torch.autograd.backward(scaler.scale(value) if scaler is not None else value)
        return float(value.detach())

    def _check_mode(self, built: Built) -> None:
        captured = built.capture_info.training
        if self.training != captured:
            raise RuntimeInputError(
                f"the program was compiled in {'train' if captured else 'eval'} mode and is now "
                f"in {'train' if self.training else 'eval'} mode; the mode is part of the graph",
                hint="compile one program per mode, e.g. fxpipe.compile(model.eval(), ...)")

    def train(self, mode: bool = True) -> Program:
        super().train(mode)
        return self

    # -- inspecting -----------------------------------------------------------------------------

    @property
    def built(self) -> Built:
        """Everything the compile produced (graphs, plan, sources, pass timings)."""
        return self._require_built("built plan")

    @property
    def stages(self) -> list[Stage]:
        self._require_built("stages")
        return self._stage_views

    @property
    def history(self) -> list[Snapshot]:
        return self._require_built("history").history

    @property
    def plan(self) -> PartitionPlan:
        return self._require_built("partition plan").plan

    @property
    def graph_module(self) -> GraphModule:
        """The whole captured graph, with costs and stages on its nodes."""
        return self._require_built("graph").captured

    def report(self) -> Report:
        built = self._require_built("report")
        report = build_report(built, type(self.model).__name__,
                              self._rank.mesh if self._rank is not None else None)
        for entry in self.measured.get("kept_activations", []):
            report.stages[entry["stage"]]["kept_measured_bytes"] = entry["measured_bytes"]
        report.measured.update({k: v for k, v in self.measured.items()
                                if k not in ("last_step_events", "kept_activations")})
        return report

    def cost_table(self, *, sort: str | None = "time", by_module: bool = False,
                   top: int | None = None) -> str:
        """Per-node (or per-module) costs at the compiled micro-batch size, as a table."""
        built = self._require_built("costs")
        return cost_table(built.captured, b=built.plan.microbatch_size, profile=built.profile,
                          sort=sort, by_module=by_module, top=top)

    def write(self, directory: str, *, loss_fn: LossFn | str | None = None,
              target: torch.Tensor | None = None, reference_steps: int = 6,
              lr: float = 0.01) -> list[str]:
        """Writes the stage files, the launcher program.py, weights, example batch and report.

        reference_steps: SGD steps of a copy of the model on the example batch whose losses are
        recorded for the launcher's --verify (0 records none).
        """
        built = self._require_built("code to write")
        if len(self.stage_modules) < len(built.stages):
            raise CheckpointError("this process holds one stage of a distributed program",
                                  hint="write the program from a single process")
        name = loss_name(loss_fn)
        reference = reference_losses(self.model, built.signature, self._example, target,
                                     resolve_loss(name), reference_steps, lr) \
            if reference_steps else []
        tensors: dict[str, torch.Tensor] = {}
        for module in self._stage_modules():
            tensors.update(module.named_model_tensors())
        files = ProgramFiles(type(self.model).__name__, tensors, self._state_names(),
                             self._example, target, name, lr, reference, self.report())
        return write_program(built, directory, files)

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, directory: str, *, optimizer: torch.optim.Optimizer | None = None,
             step: int | None = None) -> None:
        """Writes a checkpoint (this process's stages and optimizer state, in the model's names).

        Under torchrun every rank calls it; fxpipe.load_checkpoint(directory)["model"] loads
        into the plain model too.
        """
        self._require_built("state to save")
        names = self._state_names().canonical(self._stage_modules()) if optimizer else {}
        save_shard(directory, dict(self.state_dict()), optimizer, names, step=step,
                   model=type(self.model).__name__)

    def load(self, directory: str, *, optimizer: torch.optim.Optimizer | None = None) -> int | None:
        """Restores parameters, buffers and (if given) optimizer state; returns the saved step."""
        self._require_built("state to load into")
        checkpoint = load_checkpoint(directory)
        self.load_state_dict(checkpoint["model"])
        if optimizer is not None:
            if checkpoint["optimizer"] is None:
                raise RuntimeInputError(f"checkpoint {directory} has no optimizer state",
                                        hint="save it with program.save(dir, optimizer=opt)")
            restore(optimizer, checkpoint["optimizer"],
                    self._state_names().canonical(self._stage_modules()))
        step: int | None = checkpoint["step"]
        return step

    # -- state in the model's own names ---------------------------------------------------------

    def _state_names(self) -> StateNames:
        self._require_built("state")
        assert self._names is not None  # set together with _built
        return self._names

    def _stage_modules(self) -> Iterator[StageModule]:
        for module in self.stage_modules:
            assert isinstance(module, StageModule)
            yield module

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """This process's parameters and buffers under the model's state_dict keys."""
        out = {k: v.detach() for k, v in self._state_names().state_dict(
            self._stage_modules()).items()}
        if self._holds_first_stage():
            # State no stage reads (unused parameters, BatchNorm counters in eval mode) stays
            # with the model; the process of stage 0 carries it, so shards add up to the model.
            out.update({name: value.detach() for name, value in self._unused_state().items()})
        return OrderedDict(sorted(out.items()))

    def _holds_first_stage(self) -> bool:
        return self._rank is None or self._rank.mesh.stage == 0

    def _unused_state(self) -> dict[str, torch.Tensor]:
        used = {id(t) for t in graph_tensors(self.graph_module).values()}
        return {k: v for k, v in self.model.state_dict(keep_vars=True).items() if id(v) not in used}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> Any:
        """Loads tensors by the model's keys into this process's stages."""
        mine = self.state_dict()
        missing = [k for k in mine if k not in state_dict]
        if strict and missing:
            raise RuntimeInputError(f"state_dict lacks {len(missing)} keys this program needs "
                                    f"(e.g. {missing[:3]})", hint="save it from the same model")
        self._state_names().load(self._stage_modules(), state_dict)
        if self._holds_first_stage():
            with torch.no_grad():
                for name, tensor in self._unused_state().items():
                    if name in state_dict:
                        tensor.copy_(state_dict[name])
        return None


def _place(module: nn.Module, device: torch.device) -> None:
    """Moves a stage's tensors to its device in place (the model's own tensors move with it)."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.device != device:
                tensor.data = tensor.data.to(device)


def _broadcast_plan(gm: GraphModule, plan: PartitionPlan) -> PartitionPlan:
    """Every rank uses rank 0's partition (measured profiles differ between processes)."""
    stages = {n.name: n.meta[ir.STAGE] for n in ir.compute_nodes(gm.graph)}
    payload: list[Any] = [stages, plan]
    dist.broadcast_object_list(payload, src=0)
    stages, agreed = payload
    for node in ir.compute_nodes(gm.graph):
        node.meta[ir.STAGE] = stages[node.name]
    result: PartitionPlan = agreed
    return result

"""Program: what fxpipe.compile returns. Call it, step it, write it, report it.

A Program is an nn.Module whose parameters are its stages' parameters (the model's own tensors,
shared, so the model trains with it). It is built on the first call when compiled without
example inputs, as torch.compile does. A model built on the meta device compiles without a byte
of weights; `load_weights(path)` or `init_weights()` then gives each process real tensors for
its own stages only (the model itself stays on meta).
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.fx import GraphModule

from fxpipe import codegen
from fxpipe.built import Built, BuiltStage, Snapshot
from fxpipe.config import CompileConfig
from fxpipe.conversion import converted_after_compiling, refuse_changing
from fxpipe.costs import cost_table
from fxpipe.errors import (
    CheckpointError,
    ConfigError,
    PipelineRuntimeError,
    RuntimeInputError,
)
from fxpipe.frontend.meta import is_meta_model
from fxpipe.frontend.module_hooks import HookWatch
from fxpipe.full_gc import full_collections_deferred
from fxpipe.held import held_tensors, hold_built
from fxpipe.losses import LossFn, loss_function, loss_name, needs_target, resolve_loss
from fxpipe.model_modes import ModeWatch
from fxpipe.module_settings import SettingWatch
from fxpipe.passes.partition import PartitionPlan
from fxpipe.pipeline import broadcast_plan, build
from fxpipe.program_balance import Batch, ProgramBalance
from fxpipe.reference import (
    depends_on_split,
    reference_device,
    reference_losses,
    replica_counts,
)
from fxpipe.reparametrized import derived_memo
from fxpipe.replaced import ModelSlots
from fxpipe.report import Report, build_report
from fxpipe.runtime.communication.mesh import GroupCache, Mesh
from fxpipe.runtime.execution.amp import compiled_autocast
from fxpipe.runtime.execution.grad_norm import clip_rank_gradients
from fxpipe.runtime.execution.hold import HeldStages, RunSettings, local_loss
from fxpipe.runtime.execution.local import LocalExecutor
from fxpipe.runtime.execution.memory import KeptMemory
from fxpipe.runtime.execution.rank import RankPipeline, mesh_of_world, rank_device
from fxpipe.runtime.stage import StageModule
from fxpipe.signature import copy_inputs
from fxpipe.stage_facts import predicted_kept
from fxpipe.storage.state import StateNames, graph_tensors
from fxpipe.targets import Target
from fxpipe.untouched import untouched
from fxpipe.variants import Variants, in_mode, mode_name
from fxpipe.writer import ProgramFiles, write_program

__all__ = ["Program"]


class Program(ProgramBalance):
    """A model compiled into a pipeline (see fxpipe.compile)."""

    def __init__(self, model: nn.Module, config: CompileConfig) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: parameters() = the stages'
        self.model: nn.Module
        self.config = config
        self._built: Built | None = None
        self._names: StateNames | None = None
        # every tensor this process's stages held under any plan installed, by qualified name
        self._owned: dict[str, torch.Tensor] = {}
        self._example: list[torch.Tensor] = []
        self._compiled_training = True  # the mode of the first build
        self._local: LocalExecutor | None = None
        self._rank: RankPipeline | None = None
        self._groups = GroupCache()  # the process groups of every cut installed, made once
        self._mesh: Mesh | None = None  # this rank's place, under torchrun
        self._device: torch.device | None = None  # this rank's device, under torchrun
        self._classes: list[type[StageModule]] = []
        self._meta: list[str] = []  # tensors of this process's stages without weights yet
        self._held: HeldStages | None = None
        self._slots = ModelSlots()  # where the stages' tensors sit in the model
        self._hooks = HookWatch()  # the model's forward hooks seen (made at the first install)
        self._modes = ModeWatch()  # the model's modules' train/eval flags (made by build)
        self._settings = SettingWatch()  # their plain attributes, read as constants (build)
        self.stage_modules = nn.ModuleList()
        self.measured: dict[str, Any] = {}
        self._last_batches: tuple[Batch, ...] = ()
        self._variants = Variants()  # the plan for each mode and input shapes called with

    # -- building -------------------------------------------------------------------------------

    @property
    def is_built(self) -> bool:
        return self._built is not None

    @torch.inference_mode(False)  # capturing tracks versions, which inference tensors lack
    def build(self, *args: Any, **kwargs: Any) -> Program:
        """Compiles for this example batch (called by the first call when no example was given).
        Under torch.inference_mode the batch is copied out of it: the kept example trains."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        # The device first: under NCCL the plan's broadcast already runs on it.
        device = rank_device() if distributed else None
        args, kwargs = copy_inputs(args, kwargs)  # compiling runs the model, not on the caller's
        # in the program's mode: program.eval() before a lazy program's first call
        settings = SettingWatch.of(self.model)  # what forward writes is state, not settings
        with contextlib.nullcontext() if self.training == self.model.training else \
                in_mode(self.model, self.training), settings.capturing():
            built = build(self.model, args, kwargs, self.config,
                          agree=broadcast_plan if distributed else None)
        self._modes = ModeWatch.of(self.model, self.training,
                                   uniform=self.training != self.model.training)
        self._settings = settings
        self._names = StateNames.of_model(self.model, built.captured)
        self._example = [t.detach() for t in self._flat_inputs(built, args, kwargs)]
        self._compiled_training = built.capture_info.training
        self._install(built, device)
        if self.config.balance == "dynamic":
            self._balance_at_build(device)
        return self

    def _install(self, built: Built, device: torch.device | None,
                 held: Mapping[str, torch.Tensor] | None = None) -> None:
        """Builds the stage modules and the executor of a built plan (every stage locally, this
        rank's under torchrun); `device` is this rank's, None in one process; `held`: tensors
        the stages take instead of the plan's (by qualified name): a plan of another mode or
        shape, cut where this one is, whose process keeps what its stages held before
        (`_owned`); without them, a new cut (a build, a rebalance) starts afresh."""
        self._built = built
        if held is None:
            self._owned = {}
        if not self._hooks.modules:
            self._hooks = HookWatch.of(self.model)
        if self._local is not None:
            self._local.close()
            self._local = None
        self._classes = [codegen.load_stage_class(s.source, f"<fxpipe stage {s.index}>.py",
                                                  runs.class_name)
                         for s, runs in zip(built.stages, built.spec.stages)]
        self._mesh = mesh_of_world(built.spec.placement) if device is not None else None
        self._device = device
        self._instantiate({**graph_tensors(built.captured), **(held or {})})

    def __deepcopy__(self, memo: dict[int, Any]) -> Program:
        """An independent program over a deep copy of the model: its plan's tensors are the
        copy's, its stages hold copies of this program's (weights loaded into a meta model's
        stages included), and it runs on threads of its own. Not for one rank of a distributed
        pipeline, whose process groups belong to this process."""
        if self._mesh is not None:
            raise ConfigError("this program holds one rank's stages of a distributed pipeline, "
                              "whose process groups cannot be copied",
                              hint="copy the model and compile it on every rank")
        memo.update(derived_memo(self.model))  # a weight_norm's weight: derived anew
        clone = Program(copy.deepcopy(self.model, memo), self.config)
        clone.train(self.training)
        clone.measured = copy.deepcopy(self.measured, memo)
        if self._built is None:
            return clone
        held, _ = self._held_tensors()  # the model's tensors copied first: the same copies
        built, tensors = copy.deepcopy((self._built, held), memo)
        clone._names = self._names
        clone._owned = copy.deepcopy(self._owned, memo)  # the copies of the model's tensors
        clone._example = copy.deepcopy(self._example, memo)
        clone._compiled_training = self._compiled_training
        clone._install(built, None, tensors)
        clone._modes = copy.deepcopy(self._modes, memo)  # over the copy's modules
        clone._settings = copy.deepcopy(self._settings, memo)
        return clone

    def __getstate__(self) -> dict[str, Any]:
        """Pickling (torch.save(program)): a lazy program's state; a built one holds generated
        classes and running executors, so it says what to save instead."""
        if self._built is not None:
            raise ConfigError("a built program is not pickled: its stages are classes generated "
                              "in this process and its executor runs threads",
                              hint="save its state with program.save(dir) (or torch.save("
                                   "program.state_dict())), its code with program.write(dir), "
                                   "or copy it in this process with copy.deepcopy(program)")
        state: dict[str, Any] = super().__getstate__()  # type: ignore[no-untyped-call]
        return state

    def _instantiate(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Builds this process's stage modules on `tensors` (qualified name -> tensor) and
        their executor; stages that hold meta tensors get one once they have weights."""
        if self._rank is not None:  # its hooks go; its process groups stay in the cache
            self._rank.close()
            self._rank = None
        built = self._require_built("stages")
        settings = RunSettings(self.config.check_finite, self.config.dp_bucket_mb,
                               self.config.devices)
        held = hold_built(built, self._classes, settings, tensors, self._mesh, self._device,
                          self._groups)
        self._held = held
        self.stage_modules = nn.ModuleList(held.modules)
        self._local, self._rank, self._meta = held.local, held.rank, held.meta
        assert self._names is not None  # set with the plan
        tensors_held = held_tensors(held)[0]
        self._owned.update(tensors_held)
        self._slots = ModelSlots.of(self.model, self._names, tensors_held)
        if held.rank is not None:  # a loss may read only this rank's parameters
            own = {id(p) for p in held.rank.executor.parameters()}
            held.rank.executor.foreign = {
                id(t): name for name, t in tensors.items()
                if isinstance(t, nn.Parameter) and id(t) not in own}

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
        self._require_weights()
        self._hooks.check_added(stacklevel=4)
        self._settings.check(stacklevel=4)
        self._follow_model_mode()
        try:
            built, flat = self._variant(self._require_built("forward"), args, kwargs, caller=5)
            executor = self._local_executor("calling a program")
            with compiled_autocast(self.config.autocast, self.devices):
                return built.signature.unflatten_outputs(executor.run(flat))
        except (RuntimeInputError, PipelineRuntimeError) as e:
            if (converted := self._converted()) is None:
                raise
            raise converted from e

    def measure_activations(self, *args: Any, **kwargs: Any) -> list[dict[str, float]]:
        """Activation bytes each stage keeps for backward at the peak of a GPipe step (after all
        forwards), measured with saved-tensor hooks on a real forward, next to the prediction.
        In one process, without a loss; under torchrun, measure_kept measures a whole step."""
        if self._built is None:
            self.build(*args, **kwargs)
        built = self._require_built("activations")
        self._require_weights()
        executor = self._local_executor("measure_activations")
        trackers = [KeptMemory(module.parameters()) for module in self.stage_modules]
        flat = self._flat_inputs(built, args, kwargs)
        with torch.enable_grad():
            outputs = executor.run(flat, trackers)
        del outputs  # frees the graph: this was a measurement, not a step
        result = [{"stage": i, "measured_bytes": float(t.peak), "predicted_bytes": p}
                  for i, (t, p) in enumerate(zip(trackers, predicted_kept(built)))]
        self.measured["kept_activations"] = result
        return result

    def measure_kept(self, *args: Any, target: Target = None,
                     loss_fn: LossFn | None = None, **kwargs: Any) -> dict[str, float]:
        """Under torchrun: one training step (its gradients accumulate as any step's) with the
        activation bytes this rank's stages keep for their backwards tracked by autograd's
        saved-tensor hooks (the loss's included; each storage once, parameters never), their
        peak beside the prediction for the program's schedule (Report.kept_by_rank): {"rank",
        "loss", "measured_bytes", "predicted_bytes"}."""
        if self._rank is None:
            raise ConfigError("measure_kept measures one rank of a distributed pipeline, but "
                              "this process runs every stage",
                              hint="use program.measure_activations(x) in one process")
        self._rank.executor.record_memory = True
        try:
            loss = self.step(*args, target=target, loss_fn=loss_fn, **kwargs)
        finally:
            self._rank.executor.record_memory = False
        report = self.report()
        mesh = self._rank.mesh  # replicas each take their share of the batch
        predicted = report.kept_by_rank(report.schedule, report.ranks)[mesh.pipe_rank]
        return {"rank": float(mesh.rank), "loss": loss,
                "measured_bytes": float(self.measured["kept_bytes"]),
                "predicted_bytes": predicted / mesh.replicas}

    def step(self, *args: Any, target: Target = None,
             loss_fn: LossFn | str | None = None, scaler: torch.amp.GradScaler | None = None,
             **kwargs: Any) -> float:
        """One training step (forward and backward of every micro-batch); returns the loss.

        Gradients accumulate into the stage parameters as those of the loss on the whole batch
        (under torchrun a mean or a sum over examples, else LossError); call your optimizer on
        program.parameters() afterwards. Under torchrun every rank calls step() with the same
        batch; each computes its own stage. Under `torch.autocast` every stage runs in mixed
        precision. With `scaler` (a torch.amp.GradScaler) the backward runs on the scaled
        loss; then call scaler.step(optimizer) and scaler.update() as usual (every rank skips
        the step if any rank's gradients are not finite).
        """
        if not torch.is_grad_enabled():
            raise ConfigError("step() trains (a backward after the forwards), and it was called "
                              "with gradients off (under torch.no_grad() or "
                              "torch.inference_mode())",
                              hint="call step() outside that block, or program.evaluate(...) for "
                                   "the loss without training")
        try:
            flat, loss_fn = self._batch_for("step", args, kwargs, loss_fn)
            # the last two: when the last is an epoch's short one, rebalance() takes the one
            # before
            self._last_batches = ((flat, target, loss_fn), *self._last_batches[:1])
            if self._rank is not None:
                with compiled_autocast(self.config.autocast, self.devices):
                    loss, result = self._rank.step(flat, target, loss_fn, scaler)
                self.measured["last_step_events"] = result.events
                self.measured["kept_bytes"] = result.kept_bytes
                return loss
            executor = self._local_executor("calling a program")
            with compiled_autocast(self.config.autocast, self.devices):
                value = local_loss(executor, flat, target, loss_fn)
        except (RuntimeInputError, PipelineRuntimeError) as e:
            if (converted := self._converted()) is None:
                raise
            raise converted from e
        torch.autograd.backward(scaler.scale(value) if scaler is not None else value)
        return float(value.detach())

    def evaluate(self, *args: Any, target: Target = None,
                 loss_fn: LossFn | str | None = None, **kwargs: Any) -> float:
        """The loss of the batch without training on it (validation): every micro-batch
        forward in the program's mode, no gradients, the stages' buffers (BatchNorm's running
        statistics) and the random streams left as they were. Under torchrun every rank calls
        it with the same batch and every rank gets the loss. It runs in the program's mode:
        call program.eval() first for validation without dropout and with BatchNorm's running
        statistics (fxpipe.variants), and program.train() before training on."""
        try:
            flat, loss_fn = self._batch_for("evaluate", args, kwargs, loss_fn)
            with compiled_autocast(self.config.autocast, self.devices):
                if self._rank is not None:
                    return self._rank.evaluate(flat, target, loss_fn)
                executor = self._local_executor("evaluate")
                with torch.no_grad(), untouched([], list(self.buffers())):
                    return float(local_loss(executor, flat, target, loss_fn))
        except (RuntimeInputError, PipelineRuntimeError) as e:
            if (converted := self._converted()) is None:
                raise
            raise converted from e

    def _follow_model_mode(self) -> None:
        """Takes the mode the model was put in since the last call (model.eval() before
        validating), as program.eval() would (fxpipe.model_modes)."""
        mode = self._modes.followed()
        if mode is not None and mode != self.training:
            self.train(mode)

    def _converted(self) -> ConfigError | None:
        """After a call failed: the error that says the model was converted since compiling
        (what failed is then the conversion's doing), if it was."""
        if self._held is None or self._built is None:
            return None
        tensors, devices = self._held_tensors()
        return converted_after_compiling(self._built.captured, tensors, devices)

    def _batch_for(self, what: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   loss_fn: LossFn | str | None) -> tuple[list[torch.Tensor], LossFn]:
        """A step's or an evaluation's flat inputs and loss function (a built-in by name, by
        default the default loss), the program built on this batch when it is lazy, with
        weights and in the mode it was compiled in."""
        loss_fn = loss_function(loss_fn)
        if self._built is None:
            self.build(*args, **kwargs)
        self._require_weights()
        self._hooks.check_added(stacklevel=3)
        self._settings.check(stacklevel=3)
        self._follow_model_mode()
        _, flat = self._variant(self._require_built(what), args, kwargs, caller=4)
        return flat, loss_fn

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clips the gradients by the norm of all of them together, as
        torch.nn.utils.clip_grad_norm_ clips the plain model's, and returns that norm (before
        clipping). Under torchrun every rank calls it after step() (unscale a GradScaler's
        gradients first): the norm is the whole model's, added over the ranks, where torch's
        own function on one rank's parameters would clip each rank by its part alone."""
        if self._rank is None:
            return torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm, norm_type,
                                                  error_if_nonfinite)
        return clip_rank_gradients(self._rank.executor, max_norm, norm_type,
                                   error_if_nonfinite)

    def _flat_inputs(self, built: Built, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The call's tensor inputs, checked against the compiled ones. Inputs given by
        position that the example gave by keyword, or the other way, are taken as forward's
        signature binds them (looked at only when the call does not match as it is)."""
        return built.signature.flatten_call(args, kwargs)

    def _variant(self, built: Built, args: tuple[Any, ...], kwargs: dict[str, Any],
                 caller: int) -> tuple[Built, list[torch.Tensor]]:
        """The plan for this call and the call's flat inputs: `built`, or its variant for the
        program's train/eval mode and the call's input shapes (fxpipe.variants), made when
        first called for and installed on the stages' own tensors. Under torchrun every rank
        switches in the same call, as every rank calls step() with the same batch. `caller`:
        the user's frame, for warnings."""
        if self.training == built.capture_info.training:  # a step's: inputs flattened once
            try:
                return built, self._flat_inputs(built, args, kwargs)
            except RuntimeInputError:
                if built.signature.call_shapes(args, kwargs) in (None, built.signature.shapes):
                    raise  # not a matter of shapes: the error says what differs
        rank = self._rank
        with self._settings.capturing():
            variant = self._variants.plan_for(
                built, self.model, args, kwargs, self.training,
                agree=broadcast_plan if self._mesh is not None else None, caller=caller + 1,
                sharded=self.config.shard == "full" and rank is not None
                and rank.mesh.replicas > 1)
        held, _ = self._held_tensors()
        assert self._names is not None  # set with the plan
        self._names = self._names.merged(StateNames.of_model(self.model, variant.captured))
        self._install(variant, self._device, held)
        return variant, self._flat_inputs(variant, args, kwargs)

    def extra_repr(self) -> str:
        """What print(program) shows above its stages: the plan in a line."""
        if self._built is None:
            config = self.config
            return (f"{type(self.model).__name__}: {config.stages} stages x {config.chunks} "
                    f"micro-batches, schedule {config.schedule}, remat {config.remat} (built on "
                    "its first call)")
        built = self._built
        spec = built.spec
        where = f", this process rank {self._mesh.rank}" if self._mesh is not None else ""
        return (f"{built.model_name}: {len(built.stages)} stages x {spec.chunks} micro-batches, "
                f"schedule {built.config.schedule}, remat {built.config.remat}, "
                f"{mode_name(self.training)} mode{where}")

    def train(self, mode: bool = True) -> Program:
        """The program's mode (program.eval() is train(False)); the model's flags as they are
        now count as seen, so a call follows only the model's changes after this."""
        super().train(mode)
        self._modes.look()
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> Program:
        """to(), double(), cuda() ...: before the build, of the model it is built from; after,
        refused if a dtype or device would change (fxpipe.conversion)."""
        if self._built is None:
            self.model._apply(fn, recurse)  # type: ignore[no-untyped-call]
            return self
        refuse_changing(fn, [*self.parameters(), *self.buffers()])
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        return self

    # -- inspecting -----------------------------------------------------------------------------

    @property
    def built(self) -> Built:
        """Everything the compile produced (graphs, plan, sources, pass timings)."""
        return self._require_built("built plan")

    @property
    def devices(self) -> list[torch.device]:
        """The devices this process's stages run on, in stage order."""
        self._require_built("devices")
        assert self._held is not None  # built with the plan
        return list(self._held.devices)

    @property
    def stages(self) -> list[BuiltStage]:
        """Every stage as the compiler made it: its graph, messages, remat regions and
        generated source (`module_of(i)` is its module where this process holds it)."""
        return self._require_built("stages").stages

    def module_of(self, stage: int) -> StageModule | None:
        """Stage `stage`'s module where this process holds it (every stage in one process,
        this rank's under torchrun), else None."""
        built = self._require_built("stage modules")
        if not (isinstance(stage, int) and 0 <= stage < len(built.stages)):
            raise ConfigError(f"the program has no stage {stage!r}: its stages are 0 to "
                              f"{len(built.stages) - 1}", hint="pass a stage index in that range")
        assert self._held is not None  # built with the plan
        return next((st.module for st in self._held.stages if st.spec.index == stage), None)

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

    @full_collections_deferred()
    def write(self, directory: str, *, loss_fn: LossFn | str | None = None,
              target: Target = None, reference_steps: int = 6,
              lr: float = 0.01) -> list[str]:
        """Writes the stage files, the launcher program.py, weights, example batch and report.

        reference_steps: SGD steps of a copy of the model on the example batch whose losses are
        recorded for the launcher's --verify (0 records none; a model on the meta device has no
        losses to record).

        A program whose stages have no weights yet (a model built on the meta device) is
        written without weights.pt; it trains with `program.py --weights PATH` or `--init`.

        It is the plan for the example batch in the program's mode (program.train() or
        eval()), whatever the last call ran: written after evaluating in eval mode, it would
        train in eval mode, which a warning says when it differs from the compiled mode.
        """
        built = self._require_built("code to write")
        if len(self.stage_modules) < len(built.stages):
            raise CheckpointError("this process holds one stage of a distributed program",
                                  hint="write the program from a single process")
        if any(t.is_meta for t in self._example):
            raise ConfigError("the example batch is on the meta device, and a written program "
                              "trains on it", hint="compile with real example inputs (a model "
                                                   "on the meta device reads only their shapes)")
        name = loss_name(loss_fn)
        if target is None and needs_target(resolve_loss(name)):
            raise ConfigError(f"the loss {name} takes a target, and write() was given none: the "
                              "written program trains on the example batch and this target",
                              hint="pass write(directory, loss_fn=..., target=y), y the targets "
                                   "of the example batch; or a loss of the output alone")
        built, _ = self._variant(built, *built.signature.unflatten_inputs(self._example),
                                 caller=4)
        if self.training != self._compiled_training:
            warnings.warn(f"writing the program in {mode_name(self.training)} mode, as "
                          f"program.{mode_name(self.training)}() set it, though it was "
                          f"compiled in {mode_name(not self.training)} mode: the written "
                          f"program trains in {mode_name(self.training)} mode\nhint: call "
                          f"program.{mode_name(not self.training)}() before write() to write "
                          "it as compiled", UserWarning, stacklevel=2)
        meta_model = is_meta_model(self.model)
        draws_random = not built.spec.deterministic

        def recorded(replicas: int) -> list[float]:
            with in_mode(self.model, self.training):  # as the written stages run
                return reference_losses(self.model, built.signature, self._example, target,
                                        resolve_loss(name), reference_steps, lr,
                                        chunks=built.spec.chunks, draws_random=draws_random,
                                        device=reference_device(self.model, self.devices[0]),
                                        autocast=self.config.autocast, replicas=replicas)

        reference = recorded(1) if reference_steps and not meta_model else []
        # replicas see other micro-batches than one process where the split matters
        split_dependent = depends_on_split(self.model, draws_random)
        by_replicas: dict[int, list[float]] = {}
        for replicas in replica_counts(built.signature.batch_size(self._example),
                                       built.spec.chunks) if reference and split_dependent else []:
            try:
                by_replicas[replicas] = recorded(replicas)
            except (RuntimeError, ValueError):  # e.g. BatchNorm of one example a micro-batch:
                continue  # that many replicas cannot train it; --verify says none was recorded
        tensors, devices = self._held_tensors()
        keys = self._state_names().keys
        state = {q: t for q, t in tensors.items() if not keys.get(q)}
        cpu = torch.device("cpu")
        files = ProgramFiles(type(self.model).__name__, tensors, self._state_names(),
                             self._example, target, name, lr, reference, self.report(),
                             state=self._initialized(state, dict.fromkeys(state, cpu), 0)
                             if self._meta else {},
                             model=self.model if self._meta else None,
                             structure=self._structure(),
                             replica_reference_losses={r: v for r, v in by_replicas.items() if v},
                             split_dependent=split_dependent)
        return write_program(built, directory, files)

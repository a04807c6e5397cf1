"""Program: what fxpipe.compile returns. Call it, step it, write it, report it.

A Program is an nn.Module whose parameters are its stages' parameters (the model's own tensors,
shared, so the model trains with it). It is built on the first call when compiled without
example inputs, as torch.compile does.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.fx import GraphModule

from fxpipe import codegen, ir
from fxpipe.compile import Built, BuiltStage, CompileConfig, Snapshot, build, devices_for
from fxpipe.errors import ConfigError, NotBuiltError, RuntimeInputError
from fxpipe.losses import default_loss
from fxpipe.report import Report, build_report
from fxpipe.runtime.distributed import DistributedExecutor, Mesh, stage_info
from fxpipe.runtime.local import LocalExecutor, LocalStage
from fxpipe.runtime.stage import StageModule

__all__ = ["Program", "Stage"]


@dataclass
class Stage:
    """One stage of a built program."""

    index: int
    graph_module: GraphModule  # with explicit send/recv nodes
    source: str  # the generated Python file
    module: StageModule | None  # instantiated here (all stages locally, one per rank under torchrun)
    built: BuiltStage

    @property
    def recvs(self) -> tuple[ir.CommInfo, ...]:
        return self.built.graph.recvs

    @property
    def sends(self) -> tuple[ir.CommInfo, ...]:
        return self.built.graph.sends

    @property
    def regions(self) -> list:
        return self.built.regions


class Program(nn.Module):
    def __init__(self, model: nn.Module, config: CompileConfig) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: parameters() = the stages'
        self.config = config
        self._built: Built | None = None
        self._local: LocalExecutor | None = None
        self._dist: DistributedExecutor | None = None
        self.stage_modules = nn.ModuleList()
        self._stage_views: list[Stage] = []
        self.measured: dict[str, Any] = {}

    # -- building -------------------------------------------------------------------------------

    @property
    def is_built(self) -> bool:
        return self._built is not None

    def build(self, *args: Any, **kwargs: Any) -> Program:
        """Compiles for this example batch (called by the first call when no example was given)."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        mesh = self._mesh() if distributed else None
        built = build(self.model, args, kwargs, self.config,
                      agree=_broadcast_plan if distributed else None)
        self._built = built
        self._example_flat = [t.detach() for t in built.signature.flatten_inputs(args, kwargs)]
        classes = [codegen.load_stage_class(s.source, f"<fxpipe stage {s.index}>", s.class_name)
                   for s in built.stages]
        tensors = _graph_tensors(built.captured)
        modules = {ir.qualname(built.captured, k): v for k, v in built.captured.named_modules()}
        self.stage_modules = nn.ModuleList()
        self._stage_views = []
        if mesh is None:
            devices = devices_for(self.config)
            local = []
            for st, cls, device in zip(built.stages, classes, devices):
                module = cls(tensors, modules)
                _place(module, device)
                self.stage_modules.append(module)
                local.append(LocalStage(module, device, st.input_indexes, st.random,
                                        st.graph_module))
                self._stage_views.append(Stage(st.index, st.graph_module, st.source, module, st))
            self._local = LocalExecutor(local, built.signature, built.plan.chunks, self.config.remat,
                                        check_finite=self.config.check_finite)
        else:
            self._setup_distributed(built, classes, tensors, modules, mesh)
        return self

    def _mesh(self) -> Mesh:
        world, k = dist.get_world_size(), self.config.stages
        if world % k:
            raise ConfigError(f"world size {world} is not a multiple of the number of stages ({k})",
                              hint=f"launch {k} x replicas processes (e.g. torchrun "
                                   f"--nproc-per-node {k}), or compile with stages dividing {world}")
        return Mesh(k, world // k, dist.get_rank())

    def _setup_distributed(self, built: Built, classes: list, tensors: dict, modules: dict,
                           mesh: Mesh) -> None:
        from fxpipe.runtime.mesh import make_groups

        groups = make_groups(mesh, built.shared)
        device = _rank_device()
        st = built.stages[mesh.stage]
        module = classes[mesh.stage](tensors, modules)
        _place(module, device)
        self.stage_modules.append(module)
        for other in built.stages:
            self._stage_views.append(Stage(other.index, other.graph_module, other.source,
                                           module if other.index == mesh.stage else None, other))
        self._dist = DistributedExecutor(
            module=module, mesh=mesh, signature=built.signature, input_indexes=st.input_indexes,
            comm_info=stage_info(st.graph.recvs, st.graph.sends, st.index), edges=built.edges,
            random=st.random, device=device, pp_group=groups.pp, dp_group=groups.dp,
            shared=built.shared, shared_groups=groups.shared,
            check_finite=self.config.check_finite, graph=st.graph_module,
            dp_bucket_bytes=int(self.config.dp_bucket_mb * 2**20))

    def _require_built(self, what: str) -> Built:
        if self._built is None:
            raise NotBuiltError(f"the program has not been built yet, so it has no {what}",
                                hint="call it once with a batch (program(x)), or pass "
                                     "example_inputs to fxpipe.compile")
        return self._built

    # -- running --------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the pipeline locally; outputs are differentiable into the model's parameters."""
        if self._built is None:
            self.build(*args, **kwargs)
        if self._local is None:
            raise ConfigError("calling a program runs every stage in this process, but this "
                              "process holds one stage of a distributed pipeline",
                              hint="use program.step(inputs, target=...) on every rank")
        self._check_mode()
        signature = self._built.signature
        flat = signature.flatten_inputs(args, kwargs)
        return signature.unflatten_outputs(self._local.run(flat))

    def measure_activations(self, *args: Any, **kwargs: Any) -> list[dict[str, float]]:
        """Activation bytes each stage keeps for backward at the peak of a GPipe step (after all
        forwards), measured with saved-tensor hooks on a real forward, next to the prediction."""
        from fxpipe.report import predicted_kept
        from fxpipe.runtime.memory import KeptMemory

        if self._built is None:
            self.build(*args, **kwargs)
        if self._local is None:
            raise ConfigError("measure_activations runs every stage in this process",
                              hint="call it on a program compiled outside torchrun")
        trackers = [KeptMemory(module.parameters()) for module in self.stage_modules]
        flat = self._built.signature.flatten_inputs(args, kwargs)
        with torch.enable_grad():
            outputs = self._local.run(flat, trackers)
        del outputs  # frees the graph: this was a measurement, not a step
        predicted = predicted_kept(self._built)
        result = [{"stage": i, "measured_bytes": float(t.peak), "predicted_bytes": p}
                  for i, (t, p) in enumerate(zip(trackers, predicted))]
        self.measured["kept_activations"] = result
        return result

    def step(self, *args: Any, target: torch.Tensor | None = None,
             loss_fn: Callable[..., torch.Tensor] | None = None, scaler: Any = None,
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
        self._check_mode()
        if self._dist is not None:
            return self._distributed_step(args, kwargs, target, loss_fn, scaler)
        output = self(*args, **kwargs)
        loss = loss_fn(output, target) if target is not None else loss_fn(output)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return float(loss.detach())

    def _distributed_step(self, args, kwargs, target, loss_fn, scaler=None) -> float:
        built = self._built
        signature = built.signature
        flat = signature.flatten_inputs(args, kwargs)
        mesh = self._dist.mesh
        if mesh.replicas > 1:
            flat, target = _shard(signature, flat, target, mesh)
        result = self._dist.step(flat, target, loss_fn, chunks=built.plan.chunks,
                                 remat=self.config.remat, schedule=self.config.schedule,
                                 scaler=scaler)
        self.measured["last_step_events"] = result.events
        self.measured["kept_bytes"] = result.kept_bytes
        if mesh.replicas > 1:
            from fxpipe.runtime.mesh import average_over_replicas

            return average_over_replicas(result.loss, self._dist.dp_group, mesh.replicas)
        return result.loss

    def _check_mode(self) -> None:
        captured = self._built.captured.meta[ir.CAPTURE].training
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
    def stages(self) -> list[Stage]:
        self._require_built("stages")
        return self._stage_views

    @property
    def history(self) -> list[Snapshot]:
        return self._require_built("history").history

    @property
    def plan(self) -> Any:
        return self._require_built("partition plan").plan

    @property
    def graph_module(self) -> GraphModule:
        """The whole captured graph, with costs and stages on its nodes."""
        return self._require_built("graph").captured

    def report(self) -> Report:
        built = self._require_built("report")
        report = build_report(built, type(self.model).__name__,
                              self._dist.mesh if self._dist is not None else None)
        for entry in self.measured.get("kept_activations", []):
            report.stages[entry["stage"]]["kept_measured_bytes"] = entry["measured_bytes"]
        report.measured.update({k: v for k, v in self.measured.items()
                                if k not in ("last_step_events", "kept_activations")})
        return report

    def cost_table(self, *, sort: str | None = "time", by_module: bool = False,
                   top: int | None = None) -> str:
        """Per-node (or per-module) costs at the compiled micro-batch size, as a table."""
        from fxpipe.report import cost_table

        built = self._require_built("costs")
        return cost_table(built.captured, b=built.plan.microbatch_size, profile=built.profile,
                          sort=sort, by_module=by_module, top=top)

    def write(self, directory: str, *, loss_fn: Any = None, target: torch.Tensor | None = None,
              reference_steps: int = 6, lr: float = 0.01) -> list[str]:
        """Writes the stage files, the launcher program.py, weights, example batch and report."""
        from fxpipe.writer import write_program

        self._require_built("code to write")
        return write_program(self, directory, loss_fn=loss_fn, target=target,
                             reference_steps=reference_steps, lr=lr)

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, directory: str, *, optimizer: torch.optim.Optimizer | None = None,
             step: int | None = None) -> None:
        """Writes a checkpoint (this process's stages and optimizer state, in the model's names).

        Under torchrun every rank calls it; fxpipe.load_checkpoint(directory)["model"] loads
        into the plain model too.
        """
        from fxpipe.checkpoint import save_checkpoint

        self._require_built("state to save")
        save_checkpoint(self, directory, optimizer=optimizer, step=step)

    def load(self, directory: str, *, optimizer: torch.optim.Optimizer | None = None) -> int | None:
        """Restores parameters, buffers and (if given) optimizer state; returns the saved step."""
        from fxpipe.checkpoint import load_checkpoint, param_names, restore

        self._require_built("state to load into")
        checkpoint = load_checkpoint(directory)
        self.load_state_dict(checkpoint["model"])
        if optimizer is not None:
            if checkpoint["optimizer"] is None:
                raise RuntimeInputError(f"checkpoint {directory} has no optimizer state",
                                        hint="save it with program.save(dir, optimizer=opt)")
            restore(optimizer, checkpoint["optimizer"], param_names(self))
        return checkpoint["step"]

    # -- state in the model's own names ---------------------------------------------------------

    def _aliases(self) -> dict[int, list[str]]:
        keys: dict[int, list[str]] = {}
        for name, value in self.model.state_dict(keep_vars=True).items():
            keys.setdefault(id(value), []).append(name)
        return keys

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """This process's parameters and buffers under the model's state_dict keys."""
        built = self._require_built("state")
        model_keys = set(self.model.state_dict().keys())
        graph_tensors = _graph_tensors(built.captured)
        aliases = self._aliases()
        out: dict[str, torch.Tensor] = OrderedDict()
        for module in self.stage_modules:
            for attr, target in module.qualified_names().items():
                value = getattr(module, attr)
                names = aliases.get(id(graph_tensors.get(target)), [target])
                for name in names:
                    if name in model_keys:
                        out[name] = value.detach()
        if self._holds_first_stage():
            # State no stage reads (unused parameters, BatchNorm counters in eval mode) stays
            # with the model; the process of stage 0 carries it, so shards add up to the model.
            for name, value in self._unused_state().items():
                out[name] = value.detach()
        return OrderedDict(sorted(out.items()))

    def _holds_first_stage(self) -> bool:
        return self._dist is None or self._dist.mesh.stage == 0

    def _unused_state(self) -> dict[str, torch.Tensor]:
        used = {id(t) for t in _graph_tensors(self._built.captured).values()}
        return {k: v for k, v in self.model.state_dict(keep_vars=True).items() if id(v) not in used}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> Any:  # type: ignore[override]
        """Loads tensors by the model's keys into this process's stages."""
        mine = self.state_dict()
        missing = [k for k in mine if k not in state_dict]
        if strict and missing:
            raise RuntimeInputError(f"state_dict lacks {len(missing)} keys this program needs "
                                    f"(e.g. {missing[:3]})", hint="save it from the same model")
        current = {}
        for module in self.stage_modules:
            current.update(module.named_model_tensors())
        aliases = self._aliases()
        graph_tensors = _graph_tensors(self._built.captured)
        with torch.no_grad():
            for target, tensor in current.items():
                for name in aliases.get(id(graph_tensors.get(target)), [target]):
                    if name in state_dict:
                        tensor.copy_(state_dict[name])
                        break
            if self._holds_first_stage():
                for name, tensor in self._unused_state().items():
                    if name in state_dict:
                        tensor.copy_(state_dict[name])
        return None


def _graph_tensors(gm: GraphModule) -> dict[str, Any]:
    """The graph's parameters, buffers and constants by the model's qualified names."""
    out: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            owner, _, name = str(node.target).rpartition(".")
            out[ir.qualname(gm, node.target)] = getattr(
                gm.get_submodule(owner) if owner else gm, name)
    return out


def _place(module: nn.Module, device: torch.device) -> None:
    """Moves a stage's tensors to its device in place (the model's own tensors move with it)."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.device != device:
                tensor.data = tensor.data.to(device)


def _rank_device() -> torch.device:
    import os

    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _broadcast_plan(gm: GraphModule, plan: Any) -> Any:
    """Every rank uses rank 0's partition (measured profiles differ between processes)."""
    stages = {n.name: n.meta[ir.STAGE] for n in ir.compute_nodes(gm.graph)}
    payload = [stages, plan]
    dist.broadcast_object_list(payload, src=0)
    stages, plan = payload
    for node in ir.compute_nodes(gm.graph):
        node.meta[ir.STAGE] = stages[node.name]
    return plan


def _shard(signature: Any, flat: list, target: Any, mesh: Mesh) -> tuple[list, Any]:
    """This replica's share of the global batch."""
    batch = signature.batch_size(flat)
    if batch % mesh.replicas:
        raise RuntimeInputError(f"global batch {batch} cannot be split over {mesh.replicas} "
                                "data-parallel replicas", hint=f"use a multiple of {mesh.replicas}")
    size = batch // mesh.replicas
    start = mesh.replica * size
    sharded = [t if leaf.batch_dim is None else t.narrow(leaf.batch_dim, start, size)
               for leaf, t in zip(signature.tensor_leaves, flat)]
    if target is not None:
        dim = next((d for d in signature.out_batch_dims if d is not None), 0)
        target = target.narrow(dim, start, size)
    return sharded, target

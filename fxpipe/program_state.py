"""What a program holds, in the model's names: the weights of its stages (loaded or initialized
for a model built on the meta device), its state_dict, alone or inside a parent module, its
optimizer and its checkpoints. fxpipe.program.Program builds and runs on top of it."""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.built import Built
from fxpipe.config import CompileConfig
from fxpipe.errors import ConfigError, NotBuiltError, RuntimeInputError
from fxpipe.held import held_tensors
from fxpipe.replaced import ModelSlots
from fxpipe.runtime.communication.mesh import Mesh
from fxpipe.runtime.execution.hold import HeldStages
from fxpipe.runtime.execution.rank import RankPipeline
from fxpipe.runtime.program.loading import load_named
from fxpipe.runtime.program.materialize import initialize
from fxpipe.runtime.stage import StageModule
from fxpipe.sharding import make_optimizer
from fxpipe.storage.checkpoint import load_checkpoint, save_shard
from fxpipe.storage.loss_scale import restore_scaler, scaler_state
from fxpipe.storage.random_state import restore_random_state
from fxpipe.storage.resume import fit_state, restore_optimizer
from fxpipe.storage.state import HoldsModelTensors, StateNames, graph_tensors
from fxpipe.storage.structure import Structure
from fxpipe.storage.weights import WeightsSource, open_weights

__all__ = ["ProgramState"]


class ProgramState(nn.Module):
    """The state half of a Program: its attributes are set by Program.__init__ and its build."""

    model: nn.Module  # not a submodule: parameters() are the stages'
    config: CompileConfig
    stage_modules: nn.ModuleList
    _built: Built | None
    _names: StateNames | None  # those of every plan installed (fxpipe.program)
    _owned: dict[str, torch.Tensor]  # every tensor this process's stages held, any plan
    _held: HeldStages | None
    _meta: list[str]  # tensors of this process's stages without weights yet
    _slots: ModelSlots  # where the stages' tensors sit in the model (fxpipe.replaced)
    _mesh: Mesh | None
    _rank: RankPipeline | None

    def __init__(self) -> None:
        super().__init__()
        # a parent's load_state_dict reaches the stage modules by names of their own
        self.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
            ProgramState._own_keys_only)

    def _instantiate(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Builds this process's stage modules on `tensors` (Program's)."""
        raise NotImplementedError

    def _require_built(self, what: str) -> Built:
        if self._built is None:
            raise NotBuiltError(f"the program has not been built yet, so it has no {what}",
                                hint="call it once with a batch (program(x)), or pass "
                                     "example_inputs to fxpipe.compile")
        return self._built

    # -- weights of a model built on the meta device --------------------------------------------

    def load_weights(self, path: str | os.PathLike[str], *, strict: bool = True) -> None:
        """Loads the tensors of this process's stages from a checkpoint, by the model's
        state_dict names: a torch state dict (.pt/.bin, memory-mapped), a .safetensors file, or
        a folder written by save_pretrained (one file, or shards with an index file).

        Only these stages' tensors are read (under torchrun: this rank's stage, onto its
        device); a stage of a model built on the meta device gets real tensors, one with
        weights is overwritten in place. Tensors no checkpoint holds (non-persistent buffers)
        come from the model's initializers. Values are cast to the model's dtypes.

        Raises:
            CheckpointError: names of the model the checkpoint lacks, names it holds that the
                model does not have (unless strict=False), shapes that differ.
        """
        self._require_built("stages to load weights into")
        self._load_source(open_weights(path), strict=strict)

    def _load_source(self, source: WeightsSource, *, strict: bool) -> None:
        templates, devices = self._held_tensors()
        keys = self._state_names().keys
        in_file = {q: t for q, t in templates.items() if keys.get(q)}
        values = load_named(source, in_file, keys, devices,
                            known=self.model.state_dict(keep_vars=True).keys(), strict=strict)
        values.update(self._initialized(
            {q: t for q, t in templates.items() if q not in in_file and t.is_meta}, devices, 0))
        self._set_tensors(templates, values)

    def init_weights(self, *, seed: int = 0) -> None:
        """Gives this process's stages (under torchrun: this rank's) real tensors on their
        devices, filled by the model's own initializers module by module: reset_parameters()
        and the model's _init_weights(module), with a seed per module and `seed`, so the values
        do not depend on the partition (see fxpipe.runtime.program.materialize). For a model built
        on the meta device; no tensor of another process's stages is allocated."""
        self._require_built("stages to initialize")
        templates, devices = self._held_tensors()
        if not any(t.is_meta for t in templates.values()):
            raise ConfigError(f"{type(self.model).__name__} already has weights, so there is "
                              "nothing to initialize",
                              hint="init_weights() is for a model built on the meta device; "
                                   "use program.load_weights(path) to replace its weights")
        self._set_tensors(templates, self._initialized(templates, devices, seed))

    def apply(self, fn: Callable[[nn.Module], None]) -> ProgramState:
        """`fn` on every module of the model, whose tensors the stages hold (so that an
        initializer, `program.apply(init)`, reaches the layers it looks for), then on the
        program's own modules. Refused where the stages hold tensors of their own (a model built
        on the meta device: init_weights() and load_weights() give them values)."""
        if self._built is not None and self._held is not None:
            state = self.model.state_dict(keep_vars=True)
            keys = self._state_names().keys
            tensors, _ = self._held_tensors()
            own = [keys[q][0] for q, t in tensors.items() if keys.get(q)
                   and state.get(keys[q][0]) is not t]
            if own:
                raise ConfigError(
                    f"the stages hold {len(own)} tensors that are not the model's (e.g. "
                    f"{own[:3]}), so a function applied to the model's modules would not reach "
                    f"them", hint="program.init_weights() runs the model's initializers on the "
                                  "stages' tensors; program.load_weights(path) loads them")
        self.model.apply(fn)
        super().apply(fn)
        return self

    def _held_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.device]]:
        assert self._held is not None  # built with the plan
        return held_tensors(self._held)

    def _initialized(self, templates: Mapping[str, torch.Tensor],
                     devices: Mapping[str, torch.device], seed: int) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for device in dict.fromkeys(devices[q] for q in templates):
            group = {q: t for q, t in templates.items() if devices[q] == device}
            out.update(initialize(self.model, group, device, seed=seed))
        return out

    def _set_tensors(self, templates: Mapping[str, torch.Tensor],
                     values: Mapping[str, torch.Tensor]) -> None:
        """Meta tensors are replaced (the stages are rebuilt on the new ones), real ones are
        overwritten in place (so the model and an optimizer keep seeing them)."""
        with torch.no_grad():
            for name, value in values.items():
                if not templates[name].is_meta and templates[name] is not value:
                    templates[name].copy_(value)
        if any(templates[name].is_meta for name in values):
            built = self._require_built("stages")
            self._instantiate({**graph_tensors(built.captured), **templates, **values})

    def _require_weights(self) -> None:
        if self._meta:
            raise NotBuiltError(
                f"this process's stages hold {len(self._meta)} tensors on the meta device "
                f"(e.g. {self._meta[:3]}): the model was built without weights",
                hint="call program.load_weights(path) (a checkpoint of the model) or "
                     "program.init_weights() first")
        if (replaced := self._slots.replaced()) is not None:
            raise replaced

    # -- training -------------------------------------------------------------------------------

    def optimizer(self, optimizer_class: type[Any],
                  **kwargs: Any) -> torch.optim.Optimizer | None:
        """`optimizer_class(program.parameters(), **kwargs)`, right for the program's shard
        mode: under shard="optimizer" with data-parallel replicas (torchrun), a
        torch.distributed.optim.ZeroRedundancyOptimizer of it over this stage's replicas (each
        holds about 1/R of the state); under shard="full" the plain one over the FSDP2-sharded
        parameters (DTensors: each replica holds 1/R of the state too). None on a rank whose
        stages hold no parameters.
        `program.save(dir, optimizer=...)` and `program.load(dir, optimizer=...)` take it."""
        self._require_built("parameters to optimize")
        self._require_weights()
        rank = self._rank
        replicas = rank.mesh.replicas if rank is not None else 1
        return make_optimizer(self.parameters(), optimizer_class, shard=self.config.shard,
                              group=rank.groups.dp if rank is not None else None,
                              replicas=replicas, **kwargs)

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, directory: str, *, optimizer: torch.optim.Optimizer | None = None,
             step: int | None = None, scaler: torch.amp.GradScaler | None = None) -> None:
        """Writes a checkpoint (this process's stages, optimizer state and, with `scaler`, the
        GradScaler's loss scale, in the model's names).

        Under torchrun every rank calls it; the checkpoint counts once every rank's shard is
        written (fxpipe.storage.checkpoint), and fxpipe.load_checkpoint(directory)["model"] loads
        into the plain model too.
        """
        self._require_built("state to save")
        self._require_weights()
        names = self._optimizer_names(optimizer) if optimizer else {}
        save_shard(directory, dict(self.state_dict()), optimizer, names, step=step,
                   structure=self._structure(), scaler=scaler_state(scaler))

    def load(self, directory: str, *, optimizer: torch.optim.Optimizer | None = None,
             strict: bool = True, random_state: bool = True,
             scaler: torch.amp.GradScaler | None = None) -> int | None:
        """Restores parameters, buffers, (if given) optimizer state and GradScaler state, and
        (unless `random_state` is False) this process's random generators as the save left
        them, so that dropout after a resume draws what the saving run drew next; returns the
        saved step.

        strict: refuse (CheckpointError) a checkpoint of another model, unexpected or missing
        keys, other shapes or dtypes, optimizer state of another class or none, and no scaler
        state when `scaler` is given; False loads what fits and warns naming everything it
        skipped.
        """
        self._require_built("state to load into")
        if optimizer is not None and self._meta:
            raise ConfigError("the optimizer was made before the stages had weights, so it "
                              "holds tensors on the meta device",
                              hint="program.load(directory) first, then make the optimizer on "
                                   "program.parameters() and call program.load(directory, "
                                   "optimizer=...)")
        checkpoint = load_checkpoint(directory)
        state = fit_state(checkpoint, self._structure(), self.state_dict(), strict=strict)
        self.load_state_dict(state, strict=False)  # fit_state checked for missing keys
        if optimizer is not None:
            restore_optimizer(optimizer, checkpoint, self._optimizer_names(optimizer),
                              strict=strict, skip=set(checkpoint["model"]) - set(state))
        rank, world = (dist.get_rank(), dist.get_world_size()) \
            if dist.is_available() and dist.is_initialized() else (0, 1)
        restore_scaler(scaler, checkpoint["scaler"], rank, directory, strict=strict)
        if random_state:
            restore_random_state(checkpoint["rng"], rank, world, directory)
        step: int | None = checkpoint["step"]
        return step

    def _optimizer_names(self, optimizer: torch.optim.Optimizer) -> dict[int, str]:
        """id(parameter) -> the model key its optimizer state is saved under; refuses an
        optimizer that holds a parameter this process's stages do not."""
        names = self._state_names().canonical(self._holders())
        model = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        outside = [f"group {g} position {i}: " + (f"the model's {model[id(p)]} (not held here)"
                                                  if id(p) in model else
                                                  f"a tensor of shape {tuple(p.shape)}")
                   for g, group in enumerate(optimizer.param_groups)
                   for i, p in enumerate(group["params"]) if id(p) not in names]
        if outside:
            raise ConfigError(
                f"the optimizer holds {len(outside)} parameter(s) that are not this program's "
                f"({'; '.join(outside[:5])}{'; ...' if len(outside) > 5 else ''}), so their "
                "state has no name to be saved or loaded under",
                hint="build the optimizer over program.parameters() (under torchrun, on every "
                     "rank: that rank's stages), and give other parameters an optimizer and a "
                     "checkpoint of their own")
        return names

    def _structure(self) -> Structure:
        """The model's state as checkpoints record it (class, keys, shapes, dtypes)."""
        return Structure.of_state(type(self.model).__name__,
                                  self.model.state_dict(keep_vars=True))

    # -- state in the model's own names ---------------------------------------------------------

    def _state_names(self) -> StateNames:
        self._require_built("state")
        assert self._names is not None  # set together with _built
        return self._names

    def _stage_modules(self) -> Iterator[StageModule]:
        for module in self.stage_modules:
            assert isinstance(module, StageModule)
            yield module

    def _holders(self) -> list[HoldsModelTensors]:
        """The stage modules, and the tensors this process's stages held under another plan
        (another mode or input shapes) that the installed one does not read: a layer used in
        training only, while an eval-mode plan is installed, is still this process's, trained
        here and named, saved and loaded here (the model's copy elsewhere is not)."""
        stages = list(self._stage_modules())
        installed = {id(t) for stage in stages for t in stage.named_model_tensors().values()}
        return [*stages, _Held({q: t for q, t in self._owned.items()
                                if id(t) not in installed and not t.is_meta})]

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The stages' parameters under the model's names (as state_dict() names them); before
        a lazy program's first call, the model's own.

        The stages hold the model's parameter objects, so an optimizer made before the first
        call (`torch.optim.Adam(program.parameters())`) trains the built program, as it would
        the model.
        """
        if self._built is None:
            return self.model.named_parameters(prefix, recurse, remove_duplicate)
        canonical = self._state_names().canonical(self._holders())
        dot = f"{prefix}." if prefix else ""
        return ((dot + canonical.get(id(p), name), p)
                for name, p in super().named_parameters("", recurse, remove_duplicate))

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The stages' buffers under the model's names, as named_parameters names parameters
        (what `torch.optim.swa_utils.AveragedModel(program, use_buffers=True)` or a match by
        name reads); before a lazy program's first call, the model's own."""
        if self._built is None:
            return self.model.named_buffers(prefix, recurse, remove_duplicate)
        canonical = self._state_names().canonical(self._holders())
        dot = f"{prefix}." if prefix else ""
        return ((dot + canonical.get(id(b), name), b)
                for name, b in super().named_buffers("", recurse, remove_duplicate))

    def state_dict(self, *, destination: dict[str, Any] | None = None,  # type: ignore[override]
                   prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """This process's parameters and buffers under the model's state_dict keys, whole (under
        shard="full" gathered over the stage's replicas: every rank calls it, as save and load
        do); before a lazy program's first call, the model's. As a submodule of another module
        its keys follow the prefix the parent gives, in the parent's dict."""
        if self._built is None:
            if destination is None:
                return self.model.state_dict(prefix=prefix, keep_vars=keep_vars)
            return self.model.state_dict(destination=destination, prefix=prefix,
                                         keep_vars=keep_vars)
        out = self._state_names().state_dict(self._holders())
        if self._holds_first_stage():
            # State no stage reads (unused parameters, BatchNorm counters in eval mode) stays
            # with the model; the process of stage 0 carries it, so shards add up to the model.
            out.update(self._unused_state())
        target: dict[str, Any] = OrderedDict() if destination is None else destination
        for key, value in sorted(out.items()):
            target[prefix + key] = value if keep_vars else value.detach()
        return target

    def _holds_first_stage(self) -> bool:
        return self._mesh is None or 0 in self._mesh.held

    def _unused_state(self) -> dict[str, torch.Tensor]:
        """The model's state no plan installed so far reads (a stage holds the rest, on the
        process that trains it)."""
        used = {id(t) for t in graph_tensors(self._require_built("graph").captured).values()}
        named = {k for keys in self._state_names().keys.values() for k in keys}
        return {k: v for k, v in self.model.state_dict(keep_vars=True).items()
                if id(v) not in used and k not in named and not v.is_meta}  # meta: no values

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> Any:
        """Loads tensors by the model's keys into this process's stages (stages without
        weights yet get them, as with load_weights); before a lazy program's first call, into
        the model."""
        if self._built is None:
            return self.model.load_state_dict(state_dict, strict, assign)
        if self._meta:
            self._load_source(WeightsSource.of_state_dict(state_dict), strict=False)
            return None
        missing = [k for k in self.state_dict() if k not in state_dict] if strict else []
        if missing:
            raise RuntimeInputError(f"state_dict lacks {len(missing)} keys this program needs "
                                    f"(e.g. {missing[:3]})", hint="save it from the same model")
        self._state_names().load(self._holders(), state_dict)
        if self._holds_first_stage():
            with torch.no_grad():
                for name, tensor in self._unused_state().items():
                    if name in state_dict:
                        tensor.copy_(state_dict[name])
        return None

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str,
                              local_metadata: dict[str, Any], strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """As a submodule, loaded by the parent's load_state_dict: the keys under `prefix` are
        the model's, loaded as load_state_dict loads them; _own_keys_only then drops what the
        stage modules, which hold the tensors under names of their own, report missing."""
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        wanted = self.state_dict(keep_vars=True)
        for key, value in mine.items():
            if key in wanted and value.shape != wanted[key].shape:
                error_msgs.append(f"size mismatch for {prefix}{key}: copying a param with shape "
                                  f"{tuple(value.shape)} from checkpoint, the shape in current "
                                  f"model is {tuple(wanted[key].shape)}.")
        missing_keys += [prefix + k for k in wanted if k not in mine]
        unexpected_keys += [prefix + k for k in mine if k not in wanted]
        if not any(m.startswith("size mismatch for " + prefix) for m in error_msgs):
            self.load_state_dict({k: v for k, v in mine.items() if k in wanted}, strict=False)
        self._loading_prefix = prefix

    @staticmethod
    def _own_keys_only(module: nn.Module, keys: Any) -> None:
        """Post-hook of a load by the parent: the stage modules' own names are not keys of the
        program's state_dict (their tensors were loaded by the model's keys)."""
        assert isinstance(module, ProgramState)
        inner = f"{module.__dict__.pop('_loading_prefix', '')}stage_modules."
        keys.missing_keys[:] = [k for k in keys.missing_keys if not k.startswith(inner)]
        keys.unexpected_keys[:] = [k for k in keys.unexpected_keys if not k.startswith(inner)]


class _Held:
    """Tensors by qualified name, named as a stage's are (StateNames takes either)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def named_model_tensors(self) -> dict[str, torch.Tensor]:
        return self.tensors

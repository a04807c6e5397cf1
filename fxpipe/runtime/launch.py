"""What a written program.py runs: build this rank's stages from the files, train, verify."""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

from fxpipe.errors import CheckpointError, FxPipeError, PeerLostError, ProgramFolderError
from fxpipe.losses import LossFn
from fxpipe.runtime.communication.backend import choose_backend
from fxpipe.runtime.communication.mesh import GroupCache, limit_waits, make_groups
from fxpipe.runtime.execution.amp import ScaleFollower, compiled_autocast
from fxpipe.runtime.execution.grad_norm import clip_rank_gradients
from fxpipe.runtime.execution.hold import RunSettings, hold_stages, local_loss
from fxpipe.runtime.execution.rank import mesh_of_world, rank_device
from fxpipe.runtime.planning.schedule import stages_on
from fxpipe.runtime.planning.timeline import Event, write_chrome_trace
from fxpipe.runtime.program.arguments import parse_program_args
from fxpipe.runtime.program.data import user_batches
from fxpipe.runtime.program.folder import check_program
from fxpipe.runtime.program.imports import code_of_launcher, import_folders, program_loss
from fxpipe.runtime.program.spec import ProgramSpec
from fxpipe.runtime.program.spec_json import REWRITE_HINT
from fxpipe.runtime.program.written import check_written, stage_tensors
from fxpipe.runtime.stage import StageModule
from fxpipe.sharding import make_optimizer, optimizer_kind
from fxpipe.storage.checkpoint import META, load_checkpoint, save_shard
from fxpipe.storage.loss_scale import restore_scaler, scaler_state
from fxpipe.storage.resume import fit_state, restore_optimizer
from fxpipe.storage.structure import Structure
from fxpipe.targets import Target

__all__ = ["main", "build_stage", "load_spec", "rank_stages"]

StepFn: TypeAlias = Callable[[list[torch.Tensor], "torch.Tensor | None", LossFn,
                             torch.amp.GradScaler], tuple[float, bool]]
"""One training step on the batch (inputs, target): forward, loss, scaled backward; returns the
loss and whether some rank's gradients were not finite (with a scaler: every rank skips)."""

ClipFn: TypeAlias = Callable[[float], object]
"""Clips the step's gradients by the whole model's 2-norm (every rank of a pipeline calls it)."""

Replicas: TypeAlias = tuple[object, int]
"""This rank's data-parallel group (None without one) and its number of replicas."""


def load_spec(folder: Path) -> ProgramSpec:
    """The program in `folder`, checked (fxpipe.runtime.program.folder), with the folders of the
    user's modules on sys.path, since reading the spec imports its outputs' types."""
    checked = check_program(folder, contents=False)
    for entry in import_folders(checked.code, Path(folder)):
        if entry not in sys.path:
            sys.path.append(entry)
    spec = ProgramSpec.from_json(checked.data)
    check_written(Path(folder), spec)
    return spec


def _stage_class(folder: Path, spec: ProgramSpec, index: int) -> type[StageModule]:
    stage = spec.stages[index]
    module_spec = importlib.util.spec_from_file_location(f"fxpipe_stage_{index}",
                                                         folder / stage.file)
    if module_spec is None or module_spec.loader is None:
        raise CheckpointError(f"cannot load the stage file {folder / stage.file}",
                              hint="write the program again")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)  # the generated stage file written beside this one
    cls = getattr(module, stage.class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, StageModule)):
        raise ProgramFolderError(f"program.json's stages[{index}].class_name is "
                                 f"{stage.class_name!r}, which {stage.file} does not define",
                                 hint=REWRITE_HINT)
    return cls


def _tensors(folder: Path, spec: ProgramSpec, classes: list[type[StageModule]],
             device: torch.device,
             args: argparse.Namespace | None = None) -> dict[str, torch.Tensor]:
    """The tensors of these stages: weights.pt, or --weights PATH, or --init."""
    return stage_tensors(folder, classes, spec.state_names(), device,
                         weights=getattr(args, "weights", None), init=getattr(args, "init", False),
                         seed=getattr(args, "seed", 0))


def build_stage(folder: Path, index: int,
                weights: dict[str, torch.Tensor] | None = None) -> StageModule:
    spec = load_spec(Path(folder))
    cls = _stage_class(Path(folder), spec, index)
    return cls(weights if weights is not None
               else _tensors(Path(folder), spec, [cls], torch.device("cpu")))


def rank_stages(placement: Sequence[int], rank: int) -> str:
    """What global rank `rank` runs, as its messages name it: "stage 1", or "stages [0, 3]"."""
    held = stages_on(placement, rank % (max(placement) + 1))
    return f"stage {held[0]}" if len(held) == 1 else f"stages {held}"


def main(folder: Path, argv: list[str] | None = None) -> int:
    folder = Path(folder)
    who = f"rank {os.environ.get('RANK', 0)}"
    try:
        spec = load_spec(folder)
        who += f" ({rank_stages(spec.placement, int(os.environ.get('RANK', 0)))})"
        args = parse_program_args(list(argv if argv is not None else sys.argv[1:]), spec)
        return _run(folder, spec, args)
    except PeerLostError as e:
        # Not this rank's fault: the rank that failed prints the error; say why we stop.
        print(f"{who}: stopping, another rank failed or exited ({e.message})", file=sys.stderr)
        return 1
    except FxPipeError as e:
        print(f"{who}: error: {e}", file=sys.stderr)
        return 2


def _run(folder: Path, spec: ProgramSpec, args: argparse.Namespace) -> int:
    batch = torch.load(folder / "batch.pt", map_location="cpu", weights_only=True)
    inputs: list[torch.Tensor] = batch["inputs"]
    target: Target = batch["target"]
    code = code_of_launcher(folder)
    loss_fn = program_loss(spec.loss, code, folder)
    batches = user_batches(args.data, spec.signature, code, folder) \
        if args.data else None
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        step, clip, rank, modules, devices, (group, replicas) = _distributed(folder, spec, args)
    else:
        step, clip, rank, modules, devices, (group, replicas) = _local(folder, spec, args)
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    # A rank whose stages hold no parameters (an activation, a skip's addition) has nothing to
    # update: no optimizer, and its loss scale follows the ranks that step. Under
    # shard="optimizer" the replicas of a stage share one, under shard="full" it steps FSDP2's
    # shards of the parameters (fxpipe.sharding).
    optimizer_class, settings = _optimizer_of(args)
    optimizer = make_optimizer(params, optimizer_class, shard=spec.shard, group=group,
                               replicas=replicas, **settings)
    # fp16 gradients underflow without loss scaling; bf16 has fp32's range
    scaler = torch.amp.GradScaler(devices[0].type, enabled=spec.autocast == "fp16")
    follower = ScaleFollower()
    first = 0
    saved: int | None = None  # the steps of this run's last save
    if args.resume:
        first = _resume(args.resume, modules, optimizer, spec, scaler, follower, rank)
        if batches is not None and first:
            # the checkpoint's steps trained on the first batches: go on from where they ended,
            # as the run that saved it would have
            skipped = sum(1 for _ in itertools.islice(batches, first))
            if rank == 0:
                print(f"--data {args.data}: skipped its first {skipped} batches, which the "
                      f"{first} steps before the checkpoint trained on", flush=True)
    losses: list[float] = []
    for i in range(first, first + args.steps):
        if batches is not None:
            batch_i = next(batches, None)
            if batch_i is None:
                if rank == 0:
                    print(f"--data {args.data} ended after {i - first} steps", flush=True)
                break
            inputs, target = batch_i
        if args.warmup_steps and optimizer is not None:
            for group_of_params in optimizer.param_groups:  # ZeRO passes them on in its step
                group_of_params["lr"] = args.lr * min(1.0, (i + 1) / args.warmup_steps)
        start = time.perf_counter()
        torch.manual_seed(i)  # as the reference losses: step i draws the same random numbers
        with compiled_autocast(spec.autocast, devices):
            loss, overflow = step(inputs, target, loss_fn, scaler)
        if args.clip_grad_norm is not None:
            if optimizer is not None:
                scaler.unscale_(optimizer)  # the norm of the gradients, not of the scaled ones
            clip(args.clip_grad_norm)
        if optimizer is not None:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        else:
            follower.update(scaler, overflow)
        losses.append(loss)
        if rank == 0:
            print(f"step {i} loss {loss:.6f} ({time.perf_counter() - start:.4f} s)", flush=True)
        if args.save_every and (i + 1) % args.save_every == 0:
            saved = _save_and_say(args.save, modules, optimizer, spec, i + 1, rank,
                                  _scale(scaler, optimizer, follower))
    done = first + len(losses)
    if args.save and saved != done:
        _save_and_say(args.save, modules, optimizer, spec, done, rank,
                      _scale(scaler, optimizer, follower))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    replicas = int(os.environ["WORLD_SIZE"]) // spec.ranks if distributed else 1
    return _verify(spec, losses, args.lr, first, replicas) if args.verify and rank == 0 else 0


def _optimizer_of(args: argparse.Namespace) -> tuple[type[torch.optim.Optimizer],
                                                     dict[str, Any]]:
    """--optimizer's class and its settings (the learning rate and the weight decay given)."""
    settings: dict[str, Any] = {"lr": args.lr, "weight_decay": args.weight_decay}
    if args.optimizer == "adamw":
        return torch.optim.AdamW, settings
    return torch.optim.SGD, {**settings, "momentum": 0.9}


def _scale(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer | None,
           follower: ScaleFollower) -> dict[str, Any] | None:
    """The loss scale to save: the scaler's, counted by the follower where no optimizer
    steps the scaler."""
    return scaler_state(scaler, None if optimizer is not None else follower.steps_taken)


def _save_and_say(directory: str, modules: list[StageModule],
                  optimizer: torch.optim.Optimizer | None, spec: ProgramSpec, step: int,
                  rank: int, scale: dict[str, Any] | None) -> int:
    """Saves the checkpoint of `step` steps and says where (rank 0); returns `step`."""
    folder_name = _save(directory, modules, optimizer, spec, step, scale)
    if rank == 0:
        print(f"saved the model and optimizer after step {step - 1} to "
              f"{os.path.join(directory, folder_name)} (resume with --resume {directory})",
              flush=True)
    return step


def _save(directory: str, modules: list[StageModule],
          optimizer: torch.optim.Optimizer | None, spec: ProgramSpec, step: int,
          scale: dict[str, Any] | None) -> str:
    """Saves the checkpoint of `step` steps; returns the folder it was published as."""
    names = spec.state_names()
    save_shard(directory, names.state_dict(modules), optimizer, names.canonical(modules),
               step=step, structure=_structure(spec), scaler=scale)
    with open(os.path.join(directory, META), encoding="utf-8") as f:
        return str(json.load(f)["folder"])  # published on every rank by now


def _resume(directory: str, modules: list[StageModule],
            optimizer: torch.optim.Optimizer | None, spec: ProgramSpec,
            scaler: torch.amp.GradScaler, follower: ScaleFollower, rank: int) -> int:
    structure = _structure(spec)
    checkpoint = load_checkpoint(directory)
    names = spec.state_names()
    names.load(modules, fit_state(checkpoint, structure, names.state_dict(modules)))
    if optimizer is not None:  # None: this rank's stages hold no parameters
        _check_optimizer_kind(directory, checkpoint["optimizer_class"], optimizer)
        restore_optimizer(optimizer, checkpoint, names.canonical(modules))
    # a checkpoint of program.save without scaler= has none: warned of, the scale starts afresh
    steps_taken = restore_scaler(scaler, checkpoint["scaler"], rank, directory, strict=False)
    if steps_taken is not None:
        follower.steps_taken = steps_taken
    return int(checkpoint["step"] or 0)  # (its generators: each step seeds with its index)


def _check_optimizer_kind(directory: str, saved: str | None,
                          optimizer: torch.optim.Optimizer) -> None:
    """Refuses a checkpoint of another optimizer than --optimizer's, naming the option that
    resumes it (restore_optimizer's own message speaks of program.load's arguments)."""
    ours = optimizer_kind(optimizer)
    if saved is None or saved == ours:
        return
    option = {"SGD": "sgd", "AdamW": "adamw"}
    raise CheckpointError(
        f"{directory} holds the state of {saved}, and this run trains with {ours} "
        f"(--optimizer {option.get(ours, ours)})",
        hint=f"resume with --optimizer {option[saved]}" if saved in option else
        f"program.py trains with {' or '.join(option.values())}: resume a checkpoint of {saved} "
        "with program.load(directory, optimizer=...) in your own loop")


def _structure(spec: ProgramSpec) -> Structure:
    """The model's structure, which checkpoints record and a resume checks."""
    if spec.structure is None:
        raise CheckpointError("program.json lacks the model's structure, which --save records "
                              "and --resume checks (the program was written by an older fxpipe)",
                              hint="write the program again with this fxpipe version")
    return spec.structure


def _local(folder: Path, spec: ProgramSpec, args: argparse.Namespace
           ) -> tuple[StepFn, ClipFn, int, list[StageModule], list[torch.device], Replicas]:
    classes = [_stage_class(folder, spec, s.index) for s in spec.stages]
    weights = _tensors(folder, spec, classes, torch.device("cpu"), args)
    held = hold_stages(spec, lambda s: classes[s](weights), _settings(args))
    executor = held.local
    assert executor is not None  # the weights are real

    def step(inputs: list[torch.Tensor], target: Target, loss_fn: LossFn,
             scaler: torch.amp.GradScaler) -> tuple[float, bool]:
        loss = local_loss(executor, inputs, target, loss_fn)
        torch.autograd.backward(scaler.scale(loss))
        return float(loss.detach()), False  # one process: its scaler sees every gradient

    params = list({id(p): p for m in held.modules for p in m.parameters()}.values())

    def clip(max_norm: float) -> object:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    return step, clip, 0, held.modules, sorted(set(held.devices), key=str), (None, 1)


def _settings(args: argparse.Namespace) -> RunSettings:
    return RunSettings(check_finite=args.check_finite, dp_bucket_mb=args.dp_bucket_mb)


def _distributed(folder: Path, spec: ProgramSpec, args: argparse.Namespace
                 ) -> tuple[StepFn, ClipFn, int, list[StageModule], list[torch.device],
                            Replicas]:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    backend = choose_backend(world, rank, torch.cuda.device_count())
    device = rank_device(backend, say=False)  # before the process group: NCCL binds to it
    # Starting and loading may take long (a stage of several GB): the ranks wait for each other
    # up to --setup-timeout, then every wait gets the step's --timeout. NCCL's watchdog reads
    # a group's timeout per operation, so its groups start long and are shortened after the
    # load; gloo's point-to-point waits keep the timeout the group was made with, so its group
    # starts short and the wait for the load says its own (limit_waits).
    # device_id binds the NCCL communicator to this rank's GPU at once (no guessing later)
    start = args.timeout if backend == "gloo" else args.setup_timeout
    dist.init_process_group(backend, timeout=timedelta(seconds=start),
                            device_id=device if device.type == "cuda" else None)
    mesh = mesh_of_world(spec.placement)
    cache = GroupCache()
    groups = make_groups(mesh, spec.shared, device.type, cache)  # before the load: collective
    classes = {s: _stage_class(folder, spec, s) for s in mesh.held}
    weights = _tensors(folder, spec, list(classes.values()), device, args)  # these stages' only
    held = hold_stages(spec, lambda s: classes[s](weights), _settings(args), mesh=mesh,
                       device=device, groups=cache)
    rank_stage = held.rank
    assert rank_stage is not None  # the weights are real
    limit_waits(groups, args.timeout, args.setup_timeout)  # once every rank has loaded
    rank_stage.executor.transport.set_timeout(args.timeout)

    def step(inputs: list[torch.Tensor], target: Target, loss_fn: LossFn,
             scaler: torch.amp.GradScaler) -> tuple[float, bool]:
        loss, result = rank_stage.step(inputs, target, loss_fn, scaler)
        if args.timeline:
            _write_timeline(args.timeline, list(result.events), mesh.rank, spec)
        return loss, result.overflow

    def clip(max_norm: float) -> object:
        return clip_rank_gradients(rank_stage.executor, max_norm, 2.0, False)

    return step, clip, mesh.rank, held.modules, [device], (groups.dp, mesh.replicas)


def _write_timeline(path: str, events: list[Event], rank: int, spec: ProgramSpec) -> None:
    """The measured step of every rank, and the cost model's prediction, in one trace."""
    gathered: list[list[Event]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, events)  # replaces every entry
    if rank == 0:
        merged = [e for evs in gathered for e in evs]
        predicted = [Event(**e) for e in spec.predicted_events]
        write_chrome_trace(path, {"measured": merged, "predicted": predicted})


# Micro-batches sum in another order than the full batch: float32 keeps that within 1e-4;
# under autocast the matmuls round to 8 (bf16) or 11 (fp16) bits.
_VERIFY_TOLERANCE: dict[str | None, float] = {None: 1e-4, "fp16": 5e-3, "bf16": 2e-2}


def _reference(spec: ProgramSpec, replicas: int) -> tuple[tuple[float, ...], str] | None:
    """The losses a run of `replicas` data-parallel replicas is compared with, and what they
    are; None when none was recorded for that many."""
    if replicas == 1:
        return spec.reference_losses, "the plain model"
    if replicas in spec.replica_reference_losses:
        return (spec.replica_reference_losses[replicas],
                f"the plain model over each of the {replicas} replicas' shares of the batch")
    if spec.split_dependent or not spec.deterministic:
        return None  # the step depends on how the batch is split
    return spec.reference_losses, (f"the plain model (the step does not depend on how the batch "
                                   f"is split among the {replicas} replicas)")


def _verify(spec: ProgramSpec, losses: list[float], lr: float, first: int = 0,
            replicas: int = 1) -> int:
    """Prints the verdict: OK on stdout; a failure as rank 0's error on stderr, the line
    `fxpipe run` tells."""
    ok, verdict = _verdict(spec, losses, lr, first, replicas)
    if ok:
        print(verdict, flush=True)
        return 0
    print(f"rank 0 ({rank_stages(spec.placement, 0)}): error: {verdict}", file=sys.stderr,
          flush=True)
    return 1


def _verdict(spec: ProgramSpec, losses: list[float], lr: float, first: int,
             replicas: int) -> tuple[bool, str]:
    chosen = _reference(spec, replicas)
    if chosen is None:
        recorded = sorted(spec.replica_reference_losses)
        return False, (f"verify: the model's step depends on how the batch is split (dropout "
                       f"or BatchNorm in training), and no reference was recorded for "
                       f"{replicas} data-parallel replicas (recorded: "
                       f"1{''.join(f', {r}' for r in recorded)}); run with a replica count "
                       f"recorded, or write with a batch that splits evenly among {replicas} "
                       "replicas")
    reference, against = chosen[0][first:], chosen[1]
    if not chosen[0]:
        return False, ("verify: the program holds no reference losses: it was written with "
                       "reference_steps=0, or from a model on the meta device, which has no "
                       "weights to record them with; write it from the model with weights (a "
                       "smaller instance of it, to check the pipeline), or run without --verify")
    if not reference:
        return False, (f"verify: no reference losses were recorded for steps {first} and later "
                       f"({len(chosen[0])} recorded; write with a larger reference_steps)")
    if not spec.deterministic and torch.cuda.is_available():
        return False, ("verify: the model draws random numbers (dropout) and the reference was "
                       "recorded on the CPU, whose generator draws other numbers than a GPU's; "
                       "verify on CPU processes, or compile without dropout")
    if lr != spec.lr:  # true for a NaN too, unlike abs(lr - spec.lr) > 0
        return False, f"verify: the reference was recorded with lr={spec.lr}; run with that lr"
    n = min(len(reference), len(losses))
    if n == 0:
        return False, (f"verify: FAILED: no step ran, so no loss was checked (steps {first} and "
                       "later have reference losses); run at least one step")
    pairs = list(zip(losses[:n], reference[:n]))
    for i, (loss, ref) in enumerate(pairs):
        if not (math.isfinite(loss) and math.isfinite(ref)):
            return False, (f"verify: MISMATCH: step {first + i} loss {loss} against the plain "
                           f"model's {ref}: a loss that is not finite never verifies")
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)
    tolerance = _VERIFY_TOLERANCE[spec.autocast]
    ok = worst <= tolerance
    return ok, (f"verify: {'OK' if ok else 'MISMATCH'}: steps {first}..{first + n - 1} against "
                f"{against}, largest relative loss difference {worst:.2e} (tolerance "
                f"{tolerance:.0e})")

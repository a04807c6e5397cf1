"""fxpipe.compile(): any model in, a Program out (built now, or on its first call)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.config import CompileConfig, check_config
from fxpipe.errors import ConfigError
from fxpipe.optimizers import optimizer_memory
from fxpipe.profile import DeviceProfile
from fxpipe.program import Program
from fxpipe.units import byte_size

__all__ = ["compile"]


def compile(  # noqa: A001 - the name users know from torch.compile
    model: nn.Module,
    example_inputs: Any = None,
    *,
    example_kwargs: dict[str, Any] | None = None,
    stages: int = 2,
    chunks: int | str = 4,
    remat: str = "except_last",
    balance: str | Sequence[int] = "cost",
    split_points: Sequence[str] | None = None,
    memory_limit: float | str | None = None,
    devices: Sequence[str | torch.device] | None = None,
    capture: str = "auto",
    schedule: str = "gpipe",
    profile: DeviceProfile | str | None = None,
    leaf_modules: Sequence[Any] = (),
    deferred_batch_norm: bool = False,
    check_finite: bool = False,
    dp_bucket_mb: float = 25.0,
    autocast: str | None = None,
    command: str | None = None,
    check: str | nn.Module | None = None,
    batch_dims: Sequence[int | None] | None = None,
    stages_per_rank: int | None = None,
    optimizer: Any = "adam",
    master_weights: bool = False,
    stamp: bool = True,
    shard: str = "none",
    replicas: int | None = None,
) -> Program:
    """Compiles `model` into a GPipe pipeline of `stages` stages.

    Args:
        model: any nn.Module (its train/eval mode is captured).
        example_inputs: a batch (tensor or tuple). Without it (and without example_kwargs) the
            program is built on its first call from that call's inputs, as torch.compile does.
        example_kwargs: keyword inputs of the example batch; enough alone for a model that
            takes keywords only (a Hugging Face model's input_ids=, attention_mask=).
        stages: number of pipeline stages (stage files). Each runs on its own device, or
            process under torchrun, except under a looped schedule, where a rank holds
            `stages_per_rank` of them.
        chunks: micro-batches per batch, or "auto" to pick the divisor of the batch size with
            the best predicted step time.
        remat: "except_last" (GPipe's default), "always", "never", or "auto" (fit memory_limit
            with the least recomputation).
        balance: "cost" (cost model), "dynamic" (the cost model corrected by measuring each
            stage in a few training steps until the stages are within 5%; remembered per
            machine), "time" (measured per node), "params", or a list of node counts per stage.
        split_points: qualified module names where stages 1.. begin (instead of balancing).
        memory_limit: bytes per rank the partition (and remat="auto") must respect, or a size
            such as "16GB" or "8GiB"; a rank holding several stages gives each an equal share.
        devices: one device per rank for the local executor, i.e. per stage under a flat
            schedule (default: the GPUs this process sees, one per rank or in turn when fewer;
            the CPU without any).
        capture: "auto", "fx", "export" or "follow_branches" (see fxpipe.capture).
        schedule: "gpipe" (fill-drain), "1f1b" (same bubble, fewer activations in flight),
            "zb-h1" (zero-bubble H1 in the paper's order: the backward split into input and
            weight gradients, stage s deferring its weight gradients by s micro-batches into the
            bubble; each stage holds what 1F1B's first stage holds), and the looped schedules,
            which place several stages on each rank: "interleaved-1f1b" (stage s on rank
            s mod ranks; the bubble shrinks by stages_per_rank), "zb-v" (two stages per
            rank in a V, split backward: near zero bubble with 1F1B's memory) and "dualpipev"
            (ZB-V's V and bubble, the backward split only at the step's ends); or "auto" (the
            fastest schedule by the stages' simulated costs that fits memory_limit, on the
            same number of ranks: a looped one cuts the model into stages_per_rank (2) times
            more stages; the report lists each one's time). The distributed executor runs
            every schedule; the local executor (one process) runs the schedule's forwards
            in its order and one autograd backward of the joined outputs.
        stages_per_rank: stages each rank holds: 1 for the flat schedules, 2 (the default) or
            more for "interleaved-1f1b", exactly 2 for "zb-v" and "dualpipev".
        profile: a DeviceProfile, a preset name ("a100", "h100", or "h100:bf16" with its
            precision; else the model's dtype, autocast and allow_tf32 choose it), or None for
            the profile measured on this machine (cached in the user's cache folder).
        leaf_modules: modules to keep opaque when tracing.
        deferred_batch_norm: update BatchNorm running statistics once per batch, from all its
            micro-batches (equal to the plain model's), instead of once per micro-batch.
        check_finite: after every stage forward, check for NaN/Inf and name the stage,
            micro-batch and node where they first appear.
        dp_bucket_mb: with data-parallel replicas (torchrun with a multiple of `stages`
            processes), gradients are averaged in buckets of this size while the last backward
            still runs, as DDP does; 0 averages them after it.
        autocast: "bf16" or "fp16" runs every stage under torch.autocast with that dtype, in
            program(...), program.step(...) and the written program (which then scales fp16
            losses with a GradScaler); the same as wrapping each call in torch.autocast.
        command: the command that regenerates the program, shown in stage headers.
        check: for a model built on the meta device (which has no values to compare with the
            graph's): a twin, i.e. a small instance of the same model class on the CPU that
            accepts the example inputs, whose capture is checked against its eager outputs; or
            "shapes" to check only output shapes and dtypes. Then `program.load_weights(path)`
            or `program.init_weights()` gives each process the weights of its own stages.
        optimizer: what the training's optimizer holds, for the memory each stage is charged
            (memory_limit, remat="auto", schedule="auto", the report): a name ("adam",
            "adamw", "sgd", "momentum", "adagrad", "rmsprop", "adafactor", ...), a
            torch.optim class or instance, or bytes per parameter element beyond the weight.
        master_weights: the optimizer keeps a float32 copy of parameters stored below float32
            and its state in float32 (mixed precision with master weights).
        batch_dims: the batch dimension of each tensor input (None for unbatched ones, e.g.
            [0, None]); inferred when omitted. The example batch needs at least 2 samples
            either way: the batch dimension is checked on two halves of it.
        shard: what the data-parallel replicas of each stage split among themselves: "none"
            (each holds everything) or "optimizer" (ZeRO-1: torch's ZeroRedundancyOptimizer
            over the stage's replicas holds 1/R of the optimizer's state on each; make the
            optimizer with `program.optimizer(torch.optim.Adam, lr=...)`), or "full" (FSDP2's
            fully_shard over the stage's replicas: parameters, gradients and the optimizer's
            state, 1/R of each on each). The memory model charges each rank its share.
        replicas: the data-parallel replicas the memory model shards over (default: under
            torchrun, the world size over the pipeline ranks; else 1).
        stamp: trace each run of alike blocks (the layers of a ModuleList: same class, weight
            shapes and attributes, no hooks) as three and stamp out the others (on by default;
            False traces every block), which makes the
            capture of a deep model about as fast as a shallow one's. The graph is the one a
            full capture gives, checked against the whole model; where the blocks differ it
            falls back to the full capture, and the report says why.

    Returns:
        A Program: call it like the model (drop-in, differentiable), `step()` it to train
        (locally or under torchrun), `report()` it, `write()` its code.

    Example:
        >>> model, (x,) = fxpipe.models.mlp.build()
        >>> program = fxpipe.compile(model, (x,), stages=2, chunks=4)
        >>> program(x).shape
        torch.Size([8, 10])
    """
    if not isinstance(model, nn.Module):
        raise _not_a_module(model)
    config = CompileConfig(
        stages=stages, chunks=chunks, remat=remat,
        balance=balance if isinstance(balance, str) else tuple(balance),
        split_points=tuple(split_points) if split_points is not None else None,
        memory_limit=byte_size(memory_limit, "memory_limit"),
        devices=tuple(str(d) for d in devices) if devices is not None else None,
        capture=capture, schedule=schedule, profile=profile, leaf_modules=tuple(leaf_modules),
        deferred_batch_norm=deferred_batch_norm, check_finite=check_finite,
        dp_bucket_mb=dp_bucket_mb, autocast=autocast, command=command, check=check,
        batch_dims=tuple(batch_dims) if batch_dims is not None else None,
        stages_per_rank=stages_per_rank, stamp=stamp, shard=shard, replicas=replicas,
        optimizer=optimizer_memory(optimizer, master_weights))
    check_config(config)
    config = dataclasses.replace(config, optimizer=config.optimizer.sharded(
        shard, _replicas(config)))
    program = Program(model, config)
    program.train(model.training)
    if example_inputs is not None or example_kwargs:
        args = () if example_inputs is None else tuple(example_inputs) \
            if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        program.build(*args, **(example_kwargs or {}))
    return program


def _replicas(config: CompileConfig) -> int:
    """The data-parallel replicas the memory model shards over: as given, else those torchrun
    started (the world size over the pipeline ranks), else 1."""
    if config.replicas is not None:
        return config.replicas
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        return world // config.ranks if world % config.ranks == 0 else 1
    return 1


def _not_a_module(model: Any) -> ConfigError:
    """The error for a first argument that is not a module, with the likely fix: a (model,
    example) pair (what fxpipe.models' build() returns) is unpacked, a function wrapped."""
    if isinstance(model, (tuple, list)) and model and isinstance(model[0], nn.Module):
        return ConfigError(
            f"fxpipe.compile needs a torch.nn.Module, and got a {type(model).__name__} of "
            f"{len(model)} whose first item is the module {type(model[0]).__name__}",
            hint="unpack it: model, example = ...; fxpipe.compile(model, example)")
    text = repr(model).replace("\n", " ")
    got = f"{type(model).__name__} {text[:60]}{' ...' if len(text) > 60 else ''}"
    return ConfigError(f"fxpipe.compile needs a torch.nn.Module (got {got})",
                       hint="wrap a function in a module: class Fn(torch.nn.Module): "
                            "def forward(self, x): return fn(x); then fxpipe.compile(Fn(), ...)")

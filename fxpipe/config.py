"""CompileConfig: every option of fxpipe.compile, checked before any work is done."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fxpipe.choices import SHARD_MODES
from fxpipe.errors import ConfigError
from fxpipe.frontend.capture import METHODS
from fxpipe.optimizers import ADAM, OptimizerMemory
from fxpipe.passes.partition import BALANCE_MODES
from fxpipe.profile import DeviceProfile
from fxpipe.remat_policy import REMAT_MODES, RematPolicy
from fxpipe.runtime.execution.amp import AUTOCAST_DTYPES
from fxpipe.runtime.planning.schedule import SCHEDULES, ScheduleKind, schedule_kind

__all__ = ["AUTO", "CompileConfig", "check_config", "check_shard"]

AUTO = "auto"  # schedule="auto": the fastest simulated schedule that fits memory (pipeline.py)


@dataclass(frozen=True)
class CompileConfig:
    """The options of fxpipe.compile (see its docstring); frozen, so a built plan keeps them."""

    stages: int = 2
    chunks: int | str = 4
    remat: str = "except_last"
    balance: str | tuple[int, ...] = "cost"
    split_points: tuple[str, ...] | None = None
    memory_limit: float | None = None
    devices: tuple[str, ...] | None = None
    capture: str = "auto"
    schedule: str = "gpipe"
    profile: DeviceProfile | str | None = None  # a profile, a preset name, or None (measured)
    leaf_modules: tuple[Any, ...] = ()  # module types, instances or qualified names
    deferred_batch_norm: bool = False
    check_finite: bool = False
    dp_bucket_mb: float = 25.0  # data-parallel gradient buckets; 0 averages after the backward
    autocast: str | None = None  # "bf16" or "fp16": every stage under torch.autocast
    command: str | None = None  # how to regenerate, shown in stage headers
    check: Any = None  # a meta model's capture check: a twin nn.Module or "shapes"
    batch_dims: tuple[int | None, ...] | None = None  # per tensor input; None: inferred
    stages_per_rank: int | None = None  # None: the schedule's (2 for the looped ones, else 1)
    optimizer: OptimizerMemory = ADAM  # what training holds per parameter (fxpipe.optimizers)
    stamp: bool = True  # repeated blocks traced once, the rest stamped (fxpipe.frontend.stamp)
    shard: str = "none"  # what data-parallel replicas split (fxpipe.choices.SHARD_MODES)
    replicas: int | None = None  # replicas the memory model shards over; None: from torchrun

    @property
    def fixed_chunks(self) -> int | None:
        """The number of micro-batches when given, None for "auto"."""
        return self.chunks if isinstance(self.chunks, int) else None

    @property
    def per_rank(self) -> int:
        """Stages each pipeline rank holds (before schedule="auto" is resolved: as given, 1
        by default)."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 1 if self.schedule == AUTO else self.schedule_kind.default_stages_per_rank

    @property
    def ranks(self) -> int:
        """Pipeline ranks of one replica: processes under torchrun, devices in one process.
        schedule="auto" keeps this number whichever schedule it picks."""
        return max(self.stages // self.per_rank, 1)

    @property
    def remat_policy(self) -> RematPolicy:
        """Which micro-batches recompute, and what a stage keeps (fxpipe.remat_policy)."""
        return RematPolicy(self.remat)

    @property
    def schedule_kind(self) -> ScheduleKind:
        """The schedule this config runs (after schedule="auto" is resolved)."""
        if self.schedule == AUTO:
            raise ConfigError('schedule="auto" is not resolved yet',
                              hint="ask the config returned by the build, which names the "
                                   "schedule it chose")
        return schedule_kind(self.schedule)

    @property
    def placement(self) -> list[int]:
        """placement[s]: the pipeline rank of stage s (the schedule resolved)."""
        return self.schedule_kind.placement(self.stages, self.ranks)


def check_config(config: CompileConfig) -> None:
    """Rejects bad arguments before any work is done, with the values and a fix."""
    if not _is_int(config.stages) or config.stages < 1:
        raise ConfigError(f"stages must be an integer >= 1 (got {config.stages!r})",
                          hint="use stages=2 or more to pipeline, 1 to run unsplit")
    if config.chunks != "auto" and (not _is_int(config.chunks) or int(config.chunks) < 1):
        raise ConfigError(f"chunks must be an integer >= 1 or 'auto' (got {config.chunks!r})",
                          hint="chunks is the number of micro-batches per batch, e.g. 4 x stages")
    if isinstance(config.balance, tuple) and not all(_is_int(n) for n in config.balance):
        raise ConfigError(f"balance must be a mode or a list of integer node counts (got "
                          f"{list(config.balance)!r})", hint="e.g. balance=[20, 21]")
    if config.batch_dims is not None and not all(d is None or (_is_int(d) and int(d) >= 0)
                                                 for d in config.batch_dims):
        raise ConfigError(f"batch_dims must hold a dimension index or None per tensor input "
                          f"(got {list(config.batch_dims)!r})", hint="e.g. batch_dims=[0, None]")
    if config.remat not in REMAT_MODES:
        raise ConfigError(f"unknown remat mode {config.remat!r}", hint=f"use one of {REMAT_MODES}")
    if isinstance(config.balance, str) and config.balance not in BALANCE_MODES:
        raise ConfigError(f"unknown balance mode {config.balance!r}",
                          hint=f"use one of {BALANCE_MODES} or a list of node counts per stage")
    if config.schedule not in SCHEDULES and config.schedule != AUTO:
        raise ConfigError(f"unknown schedule {config.schedule!r}",
                          hint=f"use one of {(*SCHEDULES, AUTO)}")
    if config.schedule != AUTO:
        config.schedule_kind.check_layout(config.stages, config.per_rank)
    elif config.stages_per_rank is not None and (not _is_int(config.stages_per_rank)
                                                 or config.stages % config.stages_per_rank):
        raise ConfigError(f"stages_per_rank={config.stages_per_rank!r} does not divide "
                          f"{config.stages} stages", hint="pass a divisor of stages, or leave "
                                                          "stages_per_rank out")
    if config.capture not in METHODS:
        raise ConfigError(f"unknown capture method {config.capture!r}",
                          hint=f"use one of {METHODS}")
    if config.memory_limit is not None and (isinstance(config.memory_limit, bool)
                                            or not config.memory_limit > 0):
        raise ConfigError(f"memory_limit must be a positive number of bytes (got "
                          f"{config.memory_limit!r})", hint="e.g. memory_limit=8 * 2**30 or '8GiB'")
    if config.remat_policy.chooses_regions and config.memory_limit is None:
        raise ConfigError("remat='auto' chooses what to recompute to fit memory_limit, "
                          "but no memory_limit was given",
                          hint="pass memory_limit (bytes per rank), or remat='always'")
    if not isinstance(config.dp_bucket_mb, (int, float)) or isinstance(config.dp_bucket_mb, bool) \
            or not config.dp_bucket_mb >= 0:
        raise ConfigError(f"dp_bucket_mb must be a number >= 0 (got {config.dp_bucket_mb!r})",
                          hint="use e.g. 25 (DDP's default), or 0 to average after the backward")
    check_shard(config.shard, config.replicas)
    if config.autocast is not None and config.autocast not in AUTOCAST_DTYPES:
        raise ConfigError(f"unknown autocast dtype {config.autocast!r}",
                          hint=f"use one of {sorted(AUTOCAST_DTYPES)}, or None for full precision")
    if config.devices is not None:
        _check_devices(config.devices)
    if config.devices is not None and len(config.devices) < config.ranks:
        what = "stages" if config.per_rank == 1 else f"ranks ({config.stages} stages, " \
            f"{config.per_rank} per rank)"
        raise ConfigError(f"fewer devices than {what} ({len(config.devices)} < {config.ranks})",
                          hint=f"give {config.ranks} devices (e.g. ['cpu'] * {config.ranks}), "
                               "or fewer stages")


def _check_devices(devices: tuple[str, ...]) -> None:
    """Refuses a device torch does not know and a CUDA device this process does not see."""
    parsed = []
    for i, name in enumerate(devices):
        try:
            parsed.append(torch.device(name))
        except RuntimeError as error:
            raise ConfigError(f"devices[{i}] = {name!r} is not a torch device ({error})",
                              hint="name devices as torch does, e.g. 'cpu', 'cuda:0'") from None
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    beyond = [str(d) for d in parsed if d.type == "cuda" and (d.index or 0) >= seen]
    if beyond:
        sees = f"sees {seen} CUDA device(s)" if seen else \
            f"sees no CUDA device (torch {torch.__version__}, CUDA available: False)"
        raise ConfigError(f"devices name {beyond}, but this process {sees}",
                          hint="name the devices this process sees (CUDA_VISIBLE_DEVICES "
                               "renumbers them from cuda:0), or devices=['cpu'] * N to run "
                               "the stages on the CPU")


def check_shard(shard: object, replicas: object = None) -> None:
    """Refuses an unknown shard mode and a replica count that is not a positive integer."""
    if shard not in SHARD_MODES:
        raise ConfigError(f"unknown shard mode {shard!r}",
                          hint=f"use one of {SHARD_MODES}: 'optimizer' splits the optimizer's "
                               "state over the data-parallel replicas (ZeRO-1), 'full' the "
                               "parameters and gradients too (FSDP2)")
    if replicas is not None and not (isinstance(replicas, int) and not isinstance(replicas, bool)
                                     and replicas >= 1):
        raise ConfigError(f"replicas must be an integer >= 1 (got {replicas!r})",
                          hint="the data-parallel replicas the run will have, e.g. replicas=2, "
                               "or leave it out to take them from torchrun's world size")


def _is_int(value: object) -> bool:
    """An integer option: bool is an int to Python, but chunks=True is a mistake, not 1."""
    return isinstance(value, int) and not isinstance(value, bool)

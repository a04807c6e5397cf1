"""Measured profiles cached per machine, device, dtype and torch version, in the user's cache.

The folder is $FXPIPE_CACHE_DIR, else $XDG_CACHE_HOME/fxpipe, else ~/.cache/fxpipe. A profile is
measured once and then read back, so every compile on one machine uses the same numbers and cuts
a model the same way, however loaded the machine is at the time. Processes that start together
(the ranks of one torchrun) take a file lock: one measures, the others wait and read its result.
`fxpipe profile --refresh` measures again; so does a read of a cached profile that contradicts
itself (fxpipe.profile.checks), and a run whose stages measure far from what it predicted drops
it (check_against_run), both with a warning.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import re
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from fxpipe.errors import ConfigError
from fxpipe.profile.checks import implausible
from fxpipe.profile.device import MEASUREMENT, OVERHEADS, DeviceProfile
from fxpipe.profile.measure import measure
from fxpipe.profile.presets import PRECISIONS, compute_precision, preset
from fxpipe.storage.files import atomic_write

__all__ = ["cache_dir", "profile_key", "profile_path", "cached_profile", "get_profile",
           "select_profile", "model_dtype", "locked", "clear_memory", "clear_cache",
           "check_against_run", "RUN_FACTOR"]

_MEMORY: dict[str, DeviceProfile] = {}


def cache_dir() -> Path:
    """Where fxpipe keeps what it measured on this machine."""
    explicit = os.environ.get("FXPIPE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fxpipe"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1]
                break
    return f"{model} x{os.cpu_count()}"


def profile_key(device: str | torch.device, dtype: torch.dtype, threads: int | None = 1) -> str:
    """The cache key of a measured profile: machine, device, dtype, threads, torch version, and
    on a GPU whether fp32 matmuls and convolutions run in TF32 (several times faster)."""
    device = torch.device(device)
    parts = [platform.node() or "host", device.type, _device_name(device),
             str(dtype).replace("torch.", ""), f"t{threads}" if device.type == "cpu" else "",
             _tf32_flags() if device.type == "cuda" else "", f"torch{torch.__version__}"]
    return re.sub(r"[^A-Za-z0-9.+]+", "-", "-".join(p for p in parts if p)).strip("-").lower()


def _tf32_flags() -> str:
    """How fp32 matmuls (m) and convolutions (c) compute: tf32 (1) or full fp32 (0)."""
    matmul = torch.backends.cuda.matmul.allow_tf32
    conv = torch.backends.cudnn.allow_tf32
    return f"tf32m{int(matmul)}c{int(conv)}"


def profile_path(key: str) -> Path:
    return cache_dir() / "profiles" / f"{key}.json"


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """An exclusive lock shared by every process of this machine (a file in the cache)."""
    path = cache_dir() / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read(path: Path) -> DeviceProfile | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not set(OVERHEADS) <= set(data.get("overheads", ())) or \
                not {"op_forward_overheads", "region_overheads"} <= set(data):
            return None  # measured before some of a step's overheads were: measure again
        if data.get("measurement") != MEASUREMENT:
            return None  # measured another way (fxpipe.profile.device.MEASUREMENT): again
        return DeviceProfile.from_json(data)
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None  # missing or from another version: measure again


def cached_profile(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, *,
                   threads: int | None = 1, refresh: bool = False) -> DeviceProfile:
    """The measured profile of `device` for `dtype`: from this process, from the cache folder,
    or measured now (and cached)."""
    key = profile_key(device, dtype, threads)
    if not refresh and key in _MEMORY:
        return _MEMORY[key]
    path = profile_path(key)
    with locked(key):
        profile = None if refresh else _read(path)
        problems = implausible(profile) if profile is not None else []
        if problems:
            warnings.warn(f"the cached device profile {path} contradicts itself: "
                          f"{'; '.join(problems)}. It was measured while something else loaded "
                          "the machine; measuring it again now", stacklevel=2)
        if profile is None or problems:
            profile = measure(device, dtype=dtype, threads=threads, key=key)
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(str(path), json.dumps(profile.to_json(), indent=1) + "\n")
    _MEMORY[key] = profile
    return profile


RUN_FACTOR = 5.0
"""A run measuring stages this many times slower or faster than the profile predicts means the
profile no longer describes the machine (measured under load, or another machine's); a run's
wall time on a machine loaded 3-4x over its cores grows by about that much, not more."""


def check_against_run(profile: DeviceProfile, predicted: Sequence[float],
                      measured: Sequence[float]) -> bool:
    """Compares stage times a run measured with what `profile` predicted for them; when they
    differ by RUN_FACTOR or more, warns and drops the cached profile, so the next compile
    measures it again. Whether it was dropped (never a preset, which is not measured)."""
    want, got = sum(predicted), sum(measured)
    if want <= 0 or got <= 0 or 1 / RUN_FACTOR < got / want < RUN_FACTOR:
        return False
    if not profile.key or not profile.source.startswith("measured"):
        return False
    path = profile_path(profile.key)
    warnings.warn(f"the device profile {profile.name} [{profile.key}] predicts "
                  f"{want * 1e3:.3g} ms of stage compute where a run measured {got * 1e3:.3g} ms "
                  f"({got / want:.2f}x): it no longer describes this machine (measured under "
                  f"load?); removed {path}, so the next compile measures it again (as fxpipe "
                  "profile --refresh does)", stacklevel=2)
    with locked(profile.key):
        path.unlink(missing_ok=True)
    _MEMORY.pop(profile.key, None)
    return True


def clear_cache() -> int:
    """Removes every cached profile and balanced cut of this machine; returns how many."""
    removed = 0
    for folder in ("profiles", "balance"):
        for path in (cache_dir() / folder).glob("*.json"):
            path.unlink()
            removed += 1
    clear_memory()
    return removed


def clear_memory() -> None:
    """Forgets the profiles read in this process (the next use reads the cache folder)."""
    _MEMORY.clear()


def get_profile(spec: str | DeviceProfile | None = None, device: str | torch.device = "cpu", *,
                dtype: torch.dtype = torch.float32, precision: str | None = None
                ) -> DeviceProfile:
    """A profile: the given one; a preset by name ("a100", or "h100:bf16" with a precision);
    or None / "measure" for the cached measured profile of `device` in `dtype`.

    precision: a preset's arithmetic when the name does not say it (see
    fxpipe.profile.presets.compute_precision), default fp32.
    """
    if isinstance(spec, DeviceProfile):
        return spec
    if spec is None or spec == "measure":
        return cached_profile(device, dtype)
    name, _, given = spec.partition(":")
    chosen = given or precision or "fp32"
    if chosen not in PRECISIONS:
        raise ConfigError(f"unknown precision {chosen!r} in device profile {spec!r}",
                          hint=f"use one of {PRECISIONS}, e.g. h100:bf16")
    return preset(name, chosen)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The floating-point dtype most of the model's parameters have (float32 without any)."""
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return max(sizes, key=lambda d: sizes[d]) if sizes else torch.float32


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    for kind in dict.fromkeys((device.type, "cuda")):
        if torch.is_autocast_enabled(kind):
            return torch.get_autocast_dtype(kind)
    return None


def select_profile(spec: str | DeviceProfile | None, model: nn.Module,
                   device: str | torch.device) -> DeviceProfile:
    """The profile for `model` on `device`: measured there in the dtype it computes in (the
    autocast dtype when compiled under torch.autocast, else its parameters'), or a preset at the
    matching precision (fp32 models: TF32 only when torch.backends.cuda.matmul.allow_tf32)."""
    device = torch.device(device)
    dtype = model_dtype(model)
    autocast = _autocast_dtype(device)
    precision = compute_precision(dtype, autocast=autocast)
    return get_profile(spec, device, dtype=autocast or dtype, precision=precision)

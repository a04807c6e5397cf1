"""`fxpipe profile`: the device profile fxpipe predicts with, shown, measured or cleared."""
from __future__ import annotations

import sys

import torch
from tabulate import tabulate

from fxpipe.errors import ConfigError
from fxpipe.profile import cache_dir, cached_profile, get_profile, profile_key
from fxpipe.profile.cache import clear_cache, profile_path


def show_profile(*, clear: bool = False, preset: str | None = None, device: str = "cpu",
                 dtype: str = "float32", refresh: bool = False) -> int:
    """Prints a preset's profile or this machine's for `device` and `dtype` (measured once and
    cached; again with `refresh`), or removes the cached ones with `clear`."""
    if clear:
        removed = clear_cache()
        print(f"removed {removed} cached profiles and balanced cuts from {cache_dir()}")
        return 0
    if preset:
        profile = get_profile(preset)
        where = "datasheet preset"
    else:
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ConfigError(f"unknown dtype {dtype!r}", hint="e.g. float32, bfloat16")
        if not refresh and not profile_path(profile_key(device, torch_dtype)).exists():
            print(f"measuring {device} ({dtype}) once for this machine ...",
                  file=sys.stderr, flush=True)
        profile = cached_profile(device, torch_dtype, refresh=refresh)
        where = str(profile_path(profile.key))
    print(f"{profile.name} [{profile.key}]\n{profile.source}\n{where}\n")
    print(tabulate(profile.describe(), headers=["op class", "GFLOP/s (small .. large kernels)",
                                                "GB/s (small .. large kernels)"]))
    print(f"\nkernel launch: {profile.kernel_overhead * 1e6:.2f} us; link latency "
          f"{profile.link_latency * 1e6:.1f} us per message")
    if profile.matmul_in_model != 1.0:
        print(f"matrix products inside a model's step: {profile.matmul_in_model:.2f}x their "
              "time alone (the GFLOP/s above)")
    kinds = ", ".join(f"{kind} {seconds * 1e6:.1f} (forward "
                      f"{profile.operation_forward_overhead(kind) * 1e6:.1f})"
                      for kind, seconds in profile.op_overheads)
    print(f"beyond kernels, in us per operation by kind: {kinds}" if kinds else
          f"beyond kernels: {profile.op_overhead * 1e6:.1f} us per operation")
    regions = ", ".join(f"{kind} {seconds * 1e6:.1f}" for kind, seconds in
                        profile.region_overheads)
    print(f"remat, in us per recomputed operation by kind: {regions}; "
          f"{profile.checkpoint_overhead * 1e6:.1f} us per region" if regions else
          f"remat: {profile.region_overhead * 1e6:.1f} us per recomputed operation, "
          f"{profile.checkpoint_overhead * 1e6:.1f} us per region")
    print(f"executor: {profile.microbatch_overhead * 1e6:.1f} us per stage and micro-batch, "
          f"{profile.step_overhead * 1e6:.1f} us per step")
    print(f"on a pipeline rank: {profile.action_overhead * 1e6:.1f} us per forward or backward, "
          f"{profile.message_overhead * 1e6:.1f} us per message sent or received")
    return 0

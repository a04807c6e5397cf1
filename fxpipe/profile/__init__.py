"""Device profiles: the rates a roofline per op class turns FLOPs and bytes into seconds with.

    device.py    DeviceProfile: a rate curve per op class, kernel overhead, the link
    kernels.py   what one aten kernel costs: op class, FLOPs, bytes (shared with the cost pass)
    presets.py   datasheet GPUs by compute precision (fp32, tf32, bf16, fp16, fp64)
    measure.py   micro-benchmarks on this machine, the fastest of repeated runs
    cache.py     measured profiles cached per machine in the user's cache folder; get_profile
"""
from fxpipe.profile.cache import (
    cache_dir,
    cached_profile,
    get_profile,
    model_dtype,
    profile_key,
    select_profile,
)
from fxpipe.profile.device import OP_CLASSES, ClassRate, Curve, DeviceProfile
from fxpipe.profile.measure import measure, median_time, min_time
from fxpipe.profile.presets import PRECISIONS, PRESETS, compute_precision, preset

__all__ = ["DeviceProfile", "ClassRate", "Curve", "OP_CLASSES", "PRESETS", "PRECISIONS",
           "preset", "compute_precision", "measure", "median_time", "min_time", "get_profile",
           "cached_profile", "cache_dir", "profile_key", "select_profile", "model_dtype"]

"""Datasheet presets of GPUs, by the arithmetic the model runs in.

A preset is an upper bound (dense datasheet peaks, no sparsity), so estimates from it are
optimistic. Matrix multiplications, attention and convolutions run at the tensor-core peak of the
compute precision; fp32 matmuls use TF32 only when torch allows it
(torch.backends.cuda.matmul.allow_tf32, off by default), so an fp32 model gets the fp32 peak.
Element-wise work runs at the fp32 vector peak and HBM bandwidth. Links are per direction.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fxpipe.errors import ConfigError
from fxpipe.profile.device import OP_CLASSES, ClassRate, Curve, DeviceProfile

__all__ = ["GpuSpec", "SPECS", "PRESETS", "PRECISIONS", "preset", "compute_precision",
           "spec_of_device"]

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp64")

_NVLINK2, _NVLINK3, _NVLINK4 = 150e9, 300e9, 450e9
_PCIE4, _PCIE5 = 25e9, 50e9  # usable bytes/s per direction of an x16 slot


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures of one GPU."""

    name: str
    peaks: tuple[tuple[str, float], ...]  # precision -> dense tensor FLOP/s
    vector_flops: float  # fp32 FLOP/s of the CUDA cores (element-wise work)
    memory: float  # HBM / GDDR bytes/s
    memory_name: str
    link: float  # bytes/s per direction to the next stage's GPU
    link_name: str
    link_latency: float
    kernel_overhead: float

    def peak(self, precision: str) -> float:
        return dict(self.peaks)[precision]


def _peaks(fp32: float, tf32: float, half: float, fp64: float,
           bf16: float | None = None) -> tuple[tuple[str, float], ...]:
    return (("fp32", fp32), ("tf32", tf32), ("bf16", half if bf16 is None else bf16),
            ("fp16", half), ("fp64", fp64))


SPECS: dict[str, GpuSpec] = {
    # V100 has no TF32 or bf16 tensor cores: both run at the fp32 rate
    "v100": GpuSpec("NVIDIA V100 SXM2", _peaks(15.7e12, 15.7e12, 125e12, 7.8e12, bf16=15.7e12),
                    15.7e12, 900e9, "HBM2", _NVLINK2, "NVLink2", 10e-6, 5e-6),
    "a100": GpuSpec("NVIDIA A100 SXM4", _peaks(19.5e12, 156e12, 312e12, 19.5e12),
                    19.5e12, 2039e9, "HBM2e", _NVLINK3, "NVLink3", 10e-6, 5e-6),
    "a100-pcie": GpuSpec("NVIDIA A100 PCIe", _peaks(19.5e12, 156e12, 312e12, 19.5e12),
                         19.5e12, 1935e9, "HBM2e", _PCIE4, "PCIe 4.0 x16", 15e-6, 5e-6),
    "h100": GpuSpec("NVIDIA H100 SXM5", _peaks(67e12, 494e12, 989e12, 67e12),
                    67e12, 3350e9, "HBM3", _NVLINK4, "NVLink4", 8e-6, 4e-6),
    "h100-pcie": GpuSpec("NVIDIA H100 PCIe", _peaks(51e12, 378e12, 756e12, 51e12),
                         51e12, 2000e9, "HBM2e", _PCIE5, "PCIe 5.0 x16", 12e-6, 4e-6),
    "h200": GpuSpec("NVIDIA H200 SXM", _peaks(67e12, 494e12, 989e12, 67e12),
                    67e12, 4800e9, "HBM3e", _NVLINK4, "NVLink4", 8e-6, 4e-6),
    "l4": GpuSpec("NVIDIA L4", _peaks(30.3e12, 60e12, 121e12, 0.47e12),
                  30.3e12, 300e9, "GDDR6", _PCIE4, "PCIe 4.0 x16", 15e-6, 5e-6),
    "rtx4090": GpuSpec("NVIDIA RTX 4090", _peaks(82.6e12, 82.6e12, 165.2e12, 1.3e12),
                       82.6e12, 1008e9, "GDDR6X", _PCIE4, "PCIe 4.0 x16", 15e-6, 5e-6),
}

_TENSOR_CLASSES = ("matmul", "attention", "convolution", "recurrent")


def spec_of_device(name: str) -> str | None:
    """The preset of a GPU by the name CUDA gives it ("NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB",
    "NVIDIA H200"): its model, and the PCIe variant when the name says PCIe (an H100 PCIe has
    another link and other peaks than an H100 SXM)."""
    split = name.upper().replace("-", " ").replace("_", " ").split()
    words = {*split, *(a + b for a, b in zip(split, split[1:]))}  # "RTX 4090" names rtx4090
    pcie = "PCIE" in words
    for key in SPECS:
        model, _, variant = key.partition("-")
        if model.upper() in words and (variant == "pcie") == pcie:
            return key
    for key in SPECS:  # a PCIe part without a PCIe preset: its model's preset
        if key.partition("-")[0].upper() in words and "-" not in key:
            return key
    return None


def preset(name: str, precision: str = "fp32") -> DeviceProfile:
    """The datasheet profile of GPU `name` for models computing in `precision`."""
    if name not in SPECS:
        raise ConfigError(f"unknown device profile {name!r}",
                          hint=f"use 'measure' or a preset: {', '.join(sorted(SPECS))} "
                               "(optionally NAME:PRECISION, e.g. h100:bf16)")
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r} for preset {name!r}",
                          hint=f"use one of {PRECISIONS}")
    spec = SPECS[name]
    tensor = spec.peak(precision)
    memory = Curve.flat(spec.memory)
    rates = tuple((c, ClassRate(memory, Curve.flat(tensor if c in _TENSOR_CLASSES
                                                   else spec.vector_flops)))
                  for c in OP_CLASSES)
    source = (f"datasheet: {tensor / 1e12:.4g} TFLOP/s {precision} dense, "
              f"{spec.memory / 1e9:.4g} GB/s {spec.memory_name}, {spec.link_name} "
              f"{spec.link / 1e9:.4g} GB/s")
    return DeviceProfile(f"{spec.name} ({precision})", rates, spec.kernel_overhead,
                         Curve.flat(spec.link), spec.link_latency, source, precision,
                         key=f"{name}:{precision}")


PRESETS: dict[str, DeviceProfile] = {name: preset(name) for name in SPECS}
"""Every preset for fp32 models (no TF32): the profile of `get_profile(name)`."""


def compute_precision(dtype: torch.dtype, *, autocast: torch.dtype | None = None,
                      allow_tf32: bool | None = None) -> str:
    """The arithmetic of a model's matrix multiplications: the autocast dtype when autocast is
    on, else the parameters' dtype; float32 runs as TF32 only when torch allows it."""
    effective = autocast if autocast is not None else dtype
    if effective == torch.bfloat16:
        return "bf16"
    if effective == torch.float16:
        return "fp16"
    if effective == torch.float64:
        return "fp64"
    if allow_tf32 is None:
        allow_tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    return "tf32" if allow_tf32 else "fp32"

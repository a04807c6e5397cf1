"""Device profiles: the peak rates a roofline turns FLOPs and bytes into seconds with.

A profile is either measured on the current device by short micro-benchmarks (matmul FLOP/s,
copy bandwidth, the cost of launching one tiny kernel) or taken from a preset. GPU presets are
datasheet numbers and are named as such; they are upper bounds, so estimates are optimistic.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from fxpipe.errors import ConfigError

__all__ = ["DeviceProfile", "PRESETS", "measure", "get_profile", "median_time"]


@dataclass(frozen=True)
class DeviceProfile:
    """Rates of one device and of the link between two pipeline stages."""

    name: str
    peak_flops: float  # FLOP/s reachable by large matrix multiplications
    mem_bandwidth: float  # bytes/s reachable by large copies
    kernel_overhead: float  # seconds per kernel launch (dominates tiny ops)
    link_bandwidth: float  # bytes/s between two stages
    link_latency: float  # seconds per message
    source: str  # "measured ..." or "datasheet ..."

    def compute_time(self, flops: float, nbytes: float, kernels: int = 0) -> float:
        """Roofline: max(flops / peak, bytes / bandwidth), plus the launch cost of each kernel."""
        roofline = max(flops / self.peak_flops, nbytes / self.mem_bandwidth)
        return roofline + kernels * self.kernel_overhead

    def comm_time(self, nbytes: float, messages: int = 1) -> float:
        return nbytes / self.link_bandwidth + messages * self.link_latency if nbytes else 0.0

    def scaled(self, factor: float) -> DeviceProfile:
        """The same device `factor` times slower (e.g. calibrated against a measured step)."""
        return replace(self, peak_flops=self.peak_flops / factor,
                       mem_bandwidth=self.mem_bandwidth / factor,
                       kernel_overhead=self.kernel_overhead * factor,
                       source=f"{self.source}, scaled x{factor:.3g}")


# Datasheet numbers (dense, no sparsity). FP32 peak for float32 models; links per direction.
_NVLINK3, _NVLINK4, _PCIE4 = 300e9, 450e9, 25e9
PRESETS: dict[str, DeviceProfile] = {
    "v100": DeviceProfile("NVIDIA V100 SXM2 (fp32)", 15.7e12, 900e9, 5e-6, 150e9, 10e-6,
                          "datasheet: 15.7 TFLOP/s fp32, 900 GB/s HBM2, NVLink2"),
    "a100": DeviceProfile("NVIDIA A100 SXM4 (tf32)", 156e12, 2039e9, 5e-6, _NVLINK3, 10e-6,
                          "datasheet: 156 TFLOP/s tf32, 2039 GB/s HBM2e, NVLink3"),
    "a100-fp32": DeviceProfile("NVIDIA A100 SXM4 (fp32)", 19.5e12, 2039e9, 5e-6, _NVLINK3, 10e-6,
                               "datasheet: 19.5 TFLOP/s fp32, 2039 GB/s HBM2e, NVLink3"),
    "h100": DeviceProfile("NVIDIA H100 SXM5 (tf32)", 494e12, 3350e9, 4e-6, _NVLINK4, 8e-6,
                          "datasheet: 494 TFLOP/s tf32 dense, 3.35 TB/s HBM3, NVLink4"),
    "h200": DeviceProfile("NVIDIA H200 SXM (tf32)", 494e12, 4800e9, 4e-6, _NVLINK4, 8e-6,
                          "datasheet: 494 TFLOP/s tf32 dense, 4.8 TB/s HBM3e, NVLink4"),
    "l4": DeviceProfile("NVIDIA L4 (fp32)", 30.3e12, 300e9, 5e-6, _PCIE4, 15e-6,
                        "datasheet: 30.3 TFLOP/s fp32, 300 GB/s GDDR6, PCIe 4.0 x16"),
    "rtx4090": DeviceProfile("NVIDIA RTX 4090 (fp32)", 82.6e12, 1008e9, 5e-6, _PCIE4, 15e-6,
                             "datasheet: 82.6 TFLOP/s fp32, 1008 GB/s GDDR6X, PCIe 4.0 x16"),
}

# gloo point-to-point between two processes on one host (TCP loopback), measured on a 2-core
# x86-64 VM with 1 MB messages (0.8 GB/s; 16 MB messages reach 3.4 GB/s, 4 KB ones take 0.1 ms).
# Activations are about 1 MB per micro-batch, so that is the rate that matters.
CPU_LOOPBACK_BANDWIDTH = 0.8e9
CPU_LOOPBACK_LATENCY = 100e-6


def median_time(fn: Callable[[], object], *, warmup: int = 3, repeat: int = 7,
                sync: Callable[[], None] | None = None) -> float:
    """Median wall time of `fn` after warm-up (seconds)."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(device: str | torch.device = "cpu", *, threads: int | None = 1) -> DeviceProfile:
    """Measures peak matmul FLOP/s, copy bandwidth and kernel overhead on `device` (~0.5 s)."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    previous = torch.get_num_threads()
    if threads and device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        n = 1024 if device.type == "cpu" else 4096
        a = torch.randn(n, n, device=device)
        matmul = median_time(lambda: a @ a, sync=sync)
        big = torch.empty(16 * 2**20, device=device)  # 64 MiB: beyond the caches
        copy = median_time(lambda: big.clone(), sync=sync)
        tiny = torch.ones(8, device=device)
        overhead = median_time(lambda: tiny + 1, warmup=10, repeat=51, sync=sync)
    finally:
        torch.set_num_threads(previous)
    where = f"{device.type}, {threads} thread(s)" if device.type == "cpu" else str(device)
    link_bw, link_lat = (CPU_LOOPBACK_BANDWIDTH, CPU_LOOPBACK_LATENCY) if device.type == "cpu" \
        else (_PCIE4, 15e-6)
    return DeviceProfile(
        name=f"measured {where}",
        peak_flops=2 * n**3 / matmul,
        mem_bandwidth=2 * big.numel() * big.element_size() / copy,  # read + write
        kernel_overhead=overhead,
        link_bandwidth=link_bw,
        link_latency=link_lat,
        source=f"measured on {where}: {n}x{n} matmul, 64 MiB copy, 8-element add",
    )


_MEASURED: dict[str, DeviceProfile] = {}


def get_profile(spec: str | DeviceProfile | None = None, device: str = "cpu") -> DeviceProfile:
    """A profile by preset name, "measure" (cached per device), or the given profile."""
    if isinstance(spec, DeviceProfile):
        return spec
    if spec is None or spec == "measure":
        key = str(device)
        if key not in _MEASURED:
            _MEASURED[key] = measure(device)
        return _MEASURED[key]
    if spec in PRESETS:
        return PRESETS[spec]
    raise ConfigError(f"unknown device profile {spec!r}",
                      hint=f"use 'measure' or a preset: {', '.join(sorted(PRESETS))}")

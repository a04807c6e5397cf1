"""What a device profile says: how fast each class of operation runs, and the link between stages.

Each op class (fxpipe.profile.device.OP_CLASSES) has its own roofline. A kernel of class c with
F FLOPs and B bytes takes

    max(overhead, F / flop_rate_c(F), B / byte_rate_c(B))

where the rates depend on the kernel's size: small matrix multiplications run below peak, and an
element-wise kernel whose tensors fit in a cache runs faster than one that streams from memory.
A rate is a `Curve` of (size, rate) points, interpolated log-log and flat beyond its ends; a
measured rate includes launching the kernel, a datasheet preset has one point per curve. A
kernel too small for either rate to matter costs its launch (the overhead). Messages between
stages take size / link(size) plus a latency per message. A real step also pays per operation,
per remat region, per micro-batch and per step (fxpipe.profile.overheads), beyond its kernels;
a pipeline rank, per forward or backward it runs and per message it sends or receives
(fxpipe.profile.ranks).
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from fxpipe.errors import ConfigError

__all__ = ["Curve", "ClassRate", "DeviceProfile", "MEASUREMENT", "OP_CLASSES",
           "OVERHEADS"]

OVERHEADS = ("op_overhead", "region_overhead", "checkpoint_overhead", "microbatch_overhead",
             "step_overhead", "action_overhead", "message_overhead")
"""The DeviceProfile fields of what a real step pays beyond its kernels."""

MEASUREMENT = 4
"""How measured profiles are measured (1: compute-bound kernels timed inside a backward pass;
2: convolutions and a CPU's attention called directly, fxpipe.profile.measure; 3: remat regions'
bookkeeping under stage code's own checkpoint, without torch's determinism check; 4: matrix
products inside a model, fxpipe.profile.in_model): a cached profile of another measurement is
measured again."""

OP_CLASSES = ("matmul", "attention", "convolution", "recurrent", "embedding", "reduction",
              "random", "elementwise")
"""Classes of aten kernels that run at different rates (fxpipe.profile.kernels.op_class)."""


@dataclass(frozen=True)
class Curve:
    """A rate (per second) that depends on the size of the work: (size, rate) points."""

    points: tuple[tuple[float, float], ...]  # sizes ascending, rates > 0

    def __post_init__(self) -> None:
        if not self.points or any(r <= 0 or s <= 0 for s, r in self.points):
            raise ConfigError(f"a rate curve needs positive (size, rate) points (got "
                              f"{self.points})", hint="measure the profile again")

    @staticmethod
    def flat(rate: float) -> Curve:
        return Curve(((1.0, rate),))

    def at(self, size: float) -> float:
        """The rate at `size`: log-log interpolation, the nearest end outside the points."""
        points = self.points
        if size <= points[0][0] or len(points) == 1:
            return points[0][1]
        if size >= points[-1][0]:
            return points[-1][1]
        i = bisect.bisect_right([s for s, _ in points], size)
        (s0, r0), (s1, r1) = points[i - 1], points[i]
        w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))

    @property
    def peak(self) -> float:
        return max(r for _, r in self.points)

    def scaled(self, factor: float) -> Curve:
        return Curve(tuple((s, r / factor) for s, r in self.points))


@dataclass(frozen=True)
class ClassRate:
    """How fast one op class runs: FLOP/s by FLOPs per kernel (None: bound by memory alone)
    and bytes/s by bytes per kernel."""

    bandwidth: Curve
    flops: Curve | None = None

    def seconds(self, flops: float, nbytes: float, kernels: int, overhead: float = 0.0) -> float:
        """Time of `kernels` kernels doing `flops` and moving `nbytes` in all, each at least
        `overhead`."""
        per = max(kernels, 1)
        flops, nbytes = flops / per, nbytes / per
        by_bytes = nbytes / self.bandwidth.at(nbytes) if nbytes > 0 else 0.0
        by_flops = flops / self.flops.at(flops) if self.flops and flops > 0 else 0.0
        return per * max(overhead, by_bytes, by_flops) if kernels else max(by_bytes, by_flops)


# Measured profiles cached by earlier versions named their arithmetic by torch dtype.
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


@dataclass(frozen=True)
class DeviceProfile:
    """Rates of one device per op class, and of the link between two pipeline stages."""

    name: str
    rates: tuple[tuple[str, ClassRate], ...]  # one per class of OP_CLASSES
    kernel_overhead: float  # seconds per kernel launch (dominates tiny ops)
    link: Curve  # bytes/s between two stages, by message size
    link_latency: float  # seconds per message on top of the link curve
    source: str  # how the numbers were obtained: "measured ..." or "datasheet ..."
    precision: str = "fp32"  # the arithmetic the rates are for: fp32, tf32, bf16, fp16, fp64
    key: str = ""  # the preset name or the measured profile's cache key
    # what a real step pays beyond kernels (fxpipe.profile.overheads), in seconds: per graph
    # operation per micro-batch (forward and backward), per remat region recomputed, per stage
    # and micro-batch, per step; measured on CPUs, 0 in datasheet presets
    op_overhead: float = 0.0  # of an operation whose class has no figure in op_overheads
    region_overhead: float = 0.0
    checkpoint_overhead: float = 0.0  # per remat region a micro-batch recomputes: the call
    microbatch_overhead: float = 0.0
    step_overhead: float = 0.0
    # what a rank of a multi-process pipeline pays beyond that: per forward or backward of a
    # stage and micro-batch, and per message it posts and completes (a send or a receive);
    # measured with two processes on CPUs, 0 in datasheet presets
    action_overhead: float = 0.0
    message_overhead: float = 0.0
    # whether the ranks' own cores move a message's bytes (gloo between CPU processes: the
    # sender's post writes them to the socket, the receiver's side reads them), so that a
    # transfer is host work of both ends rather than a copy engine's or a NIC's beside their
    # compute; False in datasheet presets and on GPUs
    host_link: bool = False
    # per operation by its op class (a linear pays more than a ReLU) or "view" (glue that
    # makes a tensor without a kernel), forward and backward, and of that its forward's part:
    # (kind, seconds) pairs; measured on CPUs
    op_overheads: tuple[tuple[str, float], ...] = ()
    op_forward_overheads: tuple[tuple[str, float], ...] = ()
    # per operation of a remat region by its kind, what the checkpoint's bookkeeping costs
    # (a linear or a norm saves several tensors, a view none)
    region_overheads: tuple[tuple[str, float], ...] = ()
    # how much slower matrix products run inside a model's training step than alone, as the
    # matmul rates were timed (fxpipe.profile.in_model); measured on CPUs, 1 in presets
    matmul_in_model: float = 1.0

    def operation_overhead(self, kind: str) -> float:
        """Seconds an operation of `kind` (an op class or "view") pays beyond its kernels per
        micro-batch, forward and backward."""
        return dict(self.op_overheads).get(kind, self.op_overhead)

    def operation_forward_overhead(self, kind: str) -> float:
        """The forward's part of operation_overhead (half where not measured)."""
        return dict(self.op_forward_overheads).get(kind, self.operation_overhead(kind) / 2)

    def operation_region_overhead(self, kind: str) -> float:
        """Seconds an operation of `kind` pays a remat region's bookkeeping per micro-batch that
        recomputes it (region_overhead where not measured)."""
        return dict(self.region_overheads).get(kind, self.region_overhead)

    def rate(self, op_class: str) -> ClassRate:
        for name, rate in self.rates:
            if name == op_class:
                return rate
        raise ConfigError(f"device profile {self.name!r} has no rate for op class {op_class!r}",
                          hint=f"op classes are {OP_CLASSES}; measure the profile again "
                               "(fxpipe profile --refresh)")

    def class_time(self, op_class: str, flops: float, nbytes: float, kernels: int) -> float:
        """Seconds of `kernels` kernels of `op_class` doing `flops` and moving `nbytes` in a
        model's step (matrix products slower by matmul_in_model than their rates alone)."""
        seconds = self.rate(op_class).seconds(flops, nbytes, kernels, self.kernel_overhead)
        return seconds * self.matmul_in_model if op_class == "matmul" else seconds

    def compute_time(self, flops: float, nbytes: float, kernels: int = 0,
                     op_class: str = "elementwise") -> float:
        """Work of one class given as totals (max of FLOPs at its peak, bytes at its peak)."""
        rate = self.rate(op_class)
        by_flops = flops / rate.flops.peak if rate.flops else 0.0
        return max(by_flops, nbytes / rate.bandwidth.peak) + kernels * self.kernel_overhead

    def comm_time(self, nbytes: float, messages: int = 1) -> float:
        """Seconds to move `nbytes` in `messages` equal messages between two stages."""
        if not nbytes:
            return 0.0
        messages = max(messages, 1)
        size = nbytes / messages
        return messages * (size / self.link.at(size) + self.link_latency)

    @property
    def peak_flops(self) -> float:
        """FLOP/s of the largest matrix multiplications."""
        rate = self.rate("matmul").flops
        return rate.peak if rate else 0.0

    @property
    def mem_bandwidth(self) -> float:
        """Bytes/s of the largest element-wise kernels."""
        return self.rate("elementwise").bandwidth.peak

    @property
    def link_bandwidth(self) -> float:
        return self.link.peak

    def scaled(self, factor: float) -> DeviceProfile:
        """The same device `factor` times slower (e.g. calibrated against a measured step)."""
        rates = tuple((name, ClassRate(r.bandwidth.scaled(factor),
                                       r.flops.scaled(factor) if r.flops else None))
                      for name, r in self.rates)
        return replace(self, rates=rates, kernel_overhead=self.kernel_overhead * factor,
                       op_overhead=self.op_overhead * factor,
                       region_overhead=self.region_overhead * factor,
                       checkpoint_overhead=self.checkpoint_overhead * factor,
                       microbatch_overhead=self.microbatch_overhead * factor,
                       step_overhead=self.step_overhead * factor,
                       action_overhead=self.action_overhead * factor,
                       message_overhead=self.message_overhead * factor,
                       op_overheads=tuple((c, t * factor) for c, t in self.op_overheads),
                       op_forward_overheads=tuple((c, t * factor)
                                                  for c, t in self.op_forward_overheads),
                       region_overheads=tuple((c, t * factor) for c, t in self.region_overheads),
                       source=f"{self.source}, scaled x{factor:.3g}")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kernel_overhead": self.kernel_overhead,
                "link": [list(p) for p in self.link.points], "link_latency": self.link_latency,
                "source": self.source, "precision": self.precision, "key": self.key,
                "measurement": MEASUREMENT,
                "overheads": {name: getattr(self, name) for name in OVERHEADS},
                "op_overheads": dict(self.op_overheads),
                "op_forward_overheads": dict(self.op_forward_overheads),
                "region_overheads": dict(self.region_overheads),
                "matmul_in_model": self.matmul_in_model, "host_link": self.host_link,
                "rates": {name: {"bandwidth": [list(p) for p in r.bandwidth.points],
                                 "flops": [list(p) for p in r.flops.points] if r.flops else None}
                          for name, r in self.rates}}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> DeviceProfile:
        def curve(points: Any) -> Curve:
            return Curve(tuple((float(s), float(r)) for s, r in points))

        rates = tuple((name, ClassRate(curve(r["bandwidth"]),
                                       curve(r["flops"]) if r["flops"] else None))
                      for name, r in data["rates"].items())
        missing = [c for c in OP_CLASSES if c not in dict(rates)]
        if missing:
            raise ConfigError(f"device profile {data['name']!r} lacks op classes {missing}",
                              hint="measure it again: fxpipe profile --refresh")
        overheads = data.get("overheads", {})
        return DeviceProfile(str(data["name"]), rates, float(data["kernel_overhead"]),
                             curve(data["link"]), float(data["link_latency"]),
                             str(data["source"]),
                             _DTYPE_NAMES.get(str(data["precision"]), str(data["precision"])),
                             str(data["key"]),
                             **{name: float(overheads.get(name, 0.0)) for name in OVERHEADS},
                             op_overheads=_pairs(data.get("op_overheads", {})),
                             op_forward_overheads=_pairs(data.get("op_forward_overheads", {})),
                             region_overheads=_pairs(data.get("region_overheads", {})),
                             matmul_in_model=float(data.get("matmul_in_model", 1.0)),
                             # profiles measured before the field: a gloo link on the host
                             host_link=bool(data.get("host_link",
                                                     "gloo loopback" in str(data["source"]))))

    def describe(self) -> list[list[str]]:
        """Rows (class, FLOP/s at small and large kernels, bytes/s likewise) for a table."""
        rows = []
        for name, r in self.rates:
            flops = (f"{r.flops.points[0][1] / 1e9:.3g} .. {r.flops.points[-1][1] / 1e9:.3g}"
                     if r.flops else "-")
            bandwidth = f"{r.bandwidth.points[0][1] / 1e9:.3g} .. " \
                        f"{r.bandwidth.points[-1][1] / 1e9:.3g}"
            rows.append([name, flops, bandwidth])
        rows.append(["link", "-", f"{self.link.points[0][1] / 1e9:.3g} .. "
                                  f"{self.link.points[-1][1] / 1e9:.3g}"])
        return rows


def _pairs(data: Mapping[str, Any]) -> tuple[tuple[str, float], ...]:
    return tuple((str(key), float(value)) for key, value in data.items())

"""Measures a device profile: each op class timed at a few sizes, the minimum over repeats.

Another process that loads the machine can only slow a run down, never speed one up, so the
fastest of many short runs is the device's own speed: every micro-benchmark is a kernel of a few
milliseconds at most, repeated until enough samples are in, and the profile keeps the minimum.
Work is counted by fxpipe.profile.kernels, the counting the cost pass uses, so a rate measured
here applies to the counts of any model. On a GPU the kernels are launched back to back with one
synchronisation per batch of launches (a sync per call would add its own latency to each).

The link between stages is timed at the message sizes activations have, from 4 KiB to 16 MiB:
between two CUDA devices when there are two, else (CPU) as gloo point-to-point over loopback
between two process groups of this process.
"""
from __future__ import annotations

import datetime
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.profile.checks import dips, disagreeing, implausible
from fxpipe.profile.device import OP_CLASSES, ClassRate, Curve, DeviceProfile
from fxpipe.profile.kernels import KernelCounter
from fxpipe.profile.overheads import measure_overheads
from fxpipe.profile.presets import SPECS, compute_precision, spec_of_device
from fxpipe.profile.ranks import measure_rank_overheads

__all__ = ["measure", "min_time", "median_time", "MESSAGE_SIZES"]

MESSAGE_SIZES = tuple(4096 * 4**i for i in range(7))  # 4 KiB .. 16 MiB
_TINY = 8  # bytes: a message whose time is its latency
_PCIE4 = 25e9


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


def min_time(fn: Callable[[], object], *, sync: Callable[[], None] | None = None,
             inner: int = 1, samples: int = 30, budget: float = 0.25, warmup: int = 2) -> float:
    """The fastest run of `fn` (seconds per call): `inner` calls per sample with one sync after
    them, up to `samples` samples or `budget` seconds (at least 5 samples)."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    best = float("inf")
    start = time.perf_counter()
    for i in range(samples):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        if sync:
            sync()
        best = min(best, (time.perf_counter() - t0) / inner)
        if i >= 4 and time.perf_counter() - start > budget:
            break
    return best


@dataclass
class _Point:
    """One micro-benchmark: a call, the work its kernels of one class do, its fastest run."""

    curve: str  # "<class>.flops" or "<class>.bytes"
    fn: Callable[[], object]
    work: float  # FLOPs or bytes per kernel of the class
    kernels: int
    best: float = float("inf")  # seconds per call


class _Suite:
    """Micro-benchmarks timed round-robin: every point gets samples spread over the whole
    measurement, so a burst of load elsewhere cannot spoil all samples of one point."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        cuda = device.type == "cuda"
        self.sync: Callable[[], None] | None = \
            partial(torch.cuda.synchronize, device) if cuda else None
        self.inner = 10 if cuda else 1
        self.points: list[_Point] = []

    def tensor(self, *shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=self.dtype, requires_grad=grad)

    def add(self, op_class: str, axis: str, calls: Sequence[Callable[[], object]]) -> None:
        """Points of the curve `op_class`.`axis` ("flops" or "bytes"), one per call."""
        for fn in calls:
            counter = KernelCounter()
            with counter:
                fn()
            flops, nbytes, counted = counter.totals(op_class)
            kernels = max(counted, 1)
            work = (flops if axis == "flops" else nbytes) / kernels
            self.points.append(_Point(f"{op_class}.{axis}", fn, work, kernels))

    def run(self, budget: float, rounds: int = 40, least: int = 6,
            points: Sequence[_Point] | None = None) -> None:
        """Samples every point (or those given) once per round, `least` to `rounds` rounds within
        `budget` s; each sample follows an untimed call of the same point (caches warm, as in a
        model where each kernel reads what the previous one wrote)."""
        start = time.perf_counter()
        for i in range(rounds):
            for point in self.points if points is None else points:
                point.fn()
                if self.sync:
                    self.sync()
                t0 = time.perf_counter()
                for _ in range(self.inner):
                    point.fn()
                if self.sync:
                    self.sync()
                point.best = min(point.best, (time.perf_counter() - t0) / self.inner)
            if i + 1 >= least and time.perf_counter() - start > budget:
                break

    def again(self, budget: float, tries: int = 2) -> None:
        """Samples again the points slower than both neighbours on their curve
        (fxpipe.profile.checks.dips): load that hit one size more than the others."""
        for _ in range(tries):
            slow = []
            for name in {p.curve for p in self.points}:
                mine = [p for p in self.points if p.curve == name and p.work > 0]
                low = set(dips([(p.work, p.work * p.kernels / p.best) for p in mine]))
                slow += [p for p in mine if p.work in low]
            if not slow:
                return
            self.run(budget / 2, points=slow)

    def has(self, name: str) -> bool:
        """Whether the curve has a point: its calls ran kernels of its class."""
        return any(p.curve == name and p.work > 0 for p in self.points)

    def curve(self, name: str) -> Curve:
        """(work per kernel, work per second) of the points of one curve."""
        rates: dict[float, float] = {}
        for p in self.points:
            if p.curve == name and p.work > 0:
                rates[p.work] = p.work * p.kernels / p.best
        return Curve(tuple(sorted(rates.items())))


Call = Callable[[], object]


def _fwd_bwd(fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> Call:
    """fn(*args, **kwargs) and the backward of its sum."""
    def run() -> None:
        torch.autograd.backward(fn(*args, **kwargs).sum())
    return run


def _conv_products(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> object:
    """A convolution's kernels: forward, and backward's input and weight gradients, called as
    autograd calls them but without a backward pass around them, whose own work (the engine, a
    sum and its gradient) would count as the convolution's: half again its time at a model's
    small sizes on a CPU. What a model's convolution pays beyond its kernels is measured as an
    operation's overhead (fxpipe.profile.overheads)."""
    F.conv2d(x, w, padding=1)
    return torch.ops.aten.convolution_backward(g, x, w, None, [1, 1], [1, 1], [1, 1], False,
                                               [0, 0], 1, [True, True, False])


def _attention_products(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        g: torch.Tensor) -> object:
    """Causal attention's kernels on a CPU, forward and backward, without a backward pass
    around them (see _conv_products)."""
    aten = torch.ops.aten
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0,
                                                                     True)


def _launches(tiny: torch.Tensor) -> list[torch.Tensor]:
    return [tiny + 1 for _ in range(10)]


def _linear_products(x: torch.Tensor, w: torch.Tensor,
                     g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The three products of a linear layer: x @ w.T forward, g @ w and g.T @ x backward."""
    return x @ w.T, g @ w, g.T @ x


def _add_points(suite: _Suite) -> None:
    gpu = suite.device.type == "cuda"
    t = suite.tensor
    # launching a kernel: ten in a row, as a model's kernels follow one another
    suite.points.append(_Point("overhead", partial(_launches, torch.ones(8, device=suite.device)),
                               0.0, 10))
    # element-wise: x + y streams memory, gelu computes (8 FLOPs per element as counted)
    numels = [2**i for i in (range(16, 29, 2) if gpu else range(10, 23, 2))]
    pairs = [(t(n), t(n)) for n in numels]
    rows = [x.view(-1, 256) for x, _ in pairs]
    big = [x for x in rows if (2**14 if gpu else 2**10) <= x.numel() <= (2**24 if gpu else 2**20)]
    suite.add("elementwise", "bytes", [partial(torch.add, x, y) for x, y in pairs])
    suite.add("elementwise", "flops", [partial(F.gelu, x) for x in big])
    suite.add("reduction", "bytes", [partial(torch.sum, x, -1) for x in rows])
    # random: a dropout's mask, drawn per element
    suite.add("random", "bytes", [partial(torch.bernoulli, x, 0.9) for x, _ in pairs])
    suite.add("reduction", "flops", [partial(F.layer_norm, x, (256,)) for x in big])
    # compute-bound classes at their own FLOP/s (the memory's bandwidth for skinny shapes):
    # the products of linear layers, with an output 4x wider as in an MLP
    linear = [(t(n, n), t(4 * n, n), t(n, 4 * n))
              for n in ([1024, 2048, 4096] if gpu else [4, 8, 16, 32, 64, 128, 256])]
    suite.add("matmul", "flops", [partial(_linear_products, *xwg) for xwg in linear])
    heads = 16 if gpu else 4
    if gpu:  # the fused kernel SDPA picks, through autograd (large enough not to notice it)
        qkv = [[t(1, heads, s, 64, grad=True) for _ in range(3)] for s in (512, 1024, 2048)]
        attention = [_fwd_bwd(F.scaled_dot_product_attention, *q, is_causal=True) for q in qkv]
    else:
        attention = [partial(_attention_products, *[t(1, heads, s, 64) for _ in range(4)])
                     for s in (8, 16, 32, 64, 128)]
    suite.add("attention", "flops", attention)
    side, batch = (32, 8) if gpu else (16, 2)
    convs = [(t(batch, c, side, side), t(c, c, 3, 3), t(batch, c, side, side))
             for c in ([64, 128, 256] if gpu else [2, 4, 8, 16, 32, 64])]
    suite.add("convolution", "flops", [partial(_conv_products, *xwg) for xwg in convs])
    # recurrent: an LSTM layer over a sequence (a small matmul and its gates per time step)
    lstms = [(nn.LSTM(h, h).to(suite.device, suite.dtype), t(16, 32 if gpu else 2, h, grad=True))
             for h in ([256, 512, 1024] if gpu else [32, 64, 128])]
    suite.add("recurrent", "flops", [_fwd_bwd(_lstm_output, lstm, x) for lstm, x in lstms])
    # embedding: a gather forward, a scatter into the table's gradient backward
    table = t(4096, 256, grad=True)
    ids = [torch.randint(4096, (r,), device=suite.device)
           for r in ([4096, 16384, 65536] if gpu else [64, 256, 1024])]
    suite.add("embedding", "bytes", [_fwd_bwd(F.embedding, i, table) for i in ids])


def _lstm_output(lstm: nn.LSTM, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = lstm(x)[0]
    return out


def _class_rates(suite: _Suite) -> tuple[dict[str, ClassRate], list[str]]:
    """Each class's rates, and the classes rated as matmul because no kernel of theirs ran:
    in float64 on CPU an LSTM is matmuls and gates, not a fused recurrent kernel."""
    memory = suite.curve("elementwise.bytes")
    matmul = suite.curve("matmul.flops")
    stand_ins: list[str] = []

    def compute(op_class: str) -> Curve:
        if suite.has(f"{op_class}.flops"):
            return suite.curve(f"{op_class}.flops")
        stand_ins.append(op_class)
        return matmul

    return {"matmul": ClassRate(memory, matmul),
            "attention": ClassRate(memory, compute("attention")),
            "convolution": ClassRate(memory, compute("convolution")),
            "recurrent": ClassRate(memory, compute("recurrent")),
            "embedding": ClassRate(suite.curve("embedding.bytes")),
            "reduction": ClassRate(suite.curve("reduction.bytes"),
                                   suite.curve("reduction.flops")),
            "random": ClassRate(suite.curve("random.bytes")),
            "elementwise": ClassRate(memory, suite.curve("elementwise.flops"))}, stand_ins


def _link_curve(points: Sequence[tuple[float, float]]) -> Curve:
    return Curve(tuple(sorted((float(size), rate) for size, rate in points if rate > 0)))


def _gloo_link(passes: int = 3, again: int = 4) -> tuple[Curve, float]:
    """Gloo send/recv over loopback between two process groups of this process, ping-pong:
    every size in each of `passes` passes spread over the measurement (a burst of load cannot
    spoil all samples of one size), the fastest kept; sizes that disagree with a smaller one
    (fxpipe.profile.checks.disagreeing) are measured up to `again` more times. Returns the
    curve and the latency of a message (the one-way time of a few bytes): the curve's rates are
    of the time beyond it, so latency + size / rate is the time measured."""
    import torch.distributed as dist

    store = dist.HashStore()  # type: ignore[attr-defined]  # not re-exported in the stubs
    groups: list[Any] = [None, None]
    timeout = datetime.timedelta(seconds=60)

    def make(rank: int) -> None:
        prefixed = dist.PrefixStore("fxpipe-link", store)  # type: ignore[attr-defined]
        groups[rank] = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)

    _both(make)
    best = {size: float("inf") for size in (_TINY, *MESSAGE_SIZES)}

    def ping(sizes: Sequence[int], rank: int) -> None:
        group = groups[rank]
        assert group is not None
        for size in sizes:
            buffer = torch.ones(max(size // 4, 1))
            fastest = float("inf")
            for _ in range(4 if size <= 2**20 else 2):
                start = time.perf_counter()
                if rank == 0:
                    group.send([buffer], 1, 0).wait()
                    group.recv([buffer], 1, 1).wait()
                else:
                    group.recv([buffer], 0, 0).wait()
                    group.send([buffer], 0, 1).wait()
                fastest = min(fastest, (time.perf_counter() - start) / 2)
            if rank == 0:
                best[size] = min(best[size], fastest)

    for _ in range(passes):
        _both(partial(ping, (_TINY, *MESSAGE_SIZES)))
    for _ in range(again):
        slow = [int(s) for s in disagreeing([(size, size / t) for size, t in best.items()
                                             if size in MESSAGE_SIZES])]
        if not slow:
            break
        _both(partial(ping, slow))
    latency = best.pop(_TINY)
    return (_link_curve([(size, size / max(seconds - latency, 0.05 * seconds))
                         for size, seconds in best.items()]), latency)


def _both(fn: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=fn, args=(rank,), daemon=True) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _cuda_link(device: torch.device) -> tuple[Curve, str]:
    if torch.cuda.device_count() >= 2:
        other = torch.device("cuda", (device.index or 0) + 1 if (device.index or 0) + 1 <
                             torch.cuda.device_count() else 0)
        points = []
        for size in MESSAGE_SIZES:
            x = torch.empty(size // 4, device=device)
            seconds = min_time(partial(x.to, other, non_blocking=True),
                               sync=partial(_synchronize_both, device, other), inner=10,
                               samples=10)
            points.append((float(size), size / seconds))
        return _link_curve(points), f"copies {device} -> {other}"
    key = spec_of_device(torch.cuda.get_device_name(device))
    if key is not None:
        return Curve.flat(SPECS[key].link), f"{SPECS[key].link_name} from the {key} datasheet"
    return Curve.flat(_PCIE4), "PCIe 4.0 x16 assumed (one GPU: nothing to measure)"


def _synchronize_both(a: torch.device, b: torch.device) -> None:
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)


def measure(device: str | torch.device = "cpu", *, dtype: torch.dtype = torch.float32,
            threads: int | None = 1, link: bool = True, name: str = "", key: str = "",
            budget: float = 2.0, overheads: bool = True) -> DeviceProfile:
    """Measures every op class, the kernel overhead and the link on `device` (a few seconds).

    Args:
        device: where to measure ("cpu", "cuda:0", ...).
        dtype: the floating-point dtype the model computes in.
        threads: torch.set_num_threads during the measurement on CPU (restored afterwards);
            a pipeline runs one stage per process, one thread each.
        link: measure the link between stages too (else a constant for loopback gloo).
        budget: seconds of round-robin sampling of the op classes (at least 6 rounds).
        overheads: measure what a step pays beyond kernels (fxpipe.profile.overheads; CPU),
            and with `link` what a pipeline rank pays (fxpipe.profile.ranks: two processes).
    """
    device = torch.device(device)
    previous = torch.get_num_threads()
    if threads and device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        suite = _Suite(device, dtype)
        _add_points(suite)
        suite.run(budget)
        suite.again(budget)
        rates, stand_ins = _class_rates(suite)
        overhead = next(p.best / p.kernels for p in suite.points if p.curve == "overhead")
        latency = 0.0
        if device.type == "cuda":
            curve, how = _cuda_link(device)
        elif link:
            (curve, latency), how = _gloo_link(), "gloo loopback ping-pong, 4 KiB .. 16 MiB"
            for _ in range(2):  # the link contradicts the rates: measured under load, again
                draft = DeviceProfile("", tuple(rates.items()), overhead, curve, latency,
                                      f"measured: {how}")
                if not implausible(draft):
                    break
                again, later = _gloo_link()
                curve, latency = _faster(curve, again), min(latency, later)
        else:
            curve, how = Curve.flat(0.8e9), "gloo loopback assumed at 0.8 GB/s"
    finally:
        torch.set_num_threads(previous)
    where = f"{device.type}, {threads} thread(s)" if device.type == "cpu" else str(device)
    precision = str(dtype).replace("torch.", "")
    source = (f"measured on {where} in {precision}: each op class at 3-7 sizes, fastest of "
              f"round-robin runs" + (f" ({', '.join(stand_ins)} at matmul's rates: no kernel "
                                     f"of {'its' if len(stand_ins) == 1 else 'their'} own ran "
                                     f"in {precision})" if stand_ins else "")
              + f"; link: {how}")
    # the arithmetic by its name among the presets' (bf16, fp32, tf32 where a GPU uses it)
    arithmetic = compute_precision(dtype, allow_tf32=device.type == "cuda" and
                                   bool(torch.backends.cuda.matmul.allow_tf32))
    profile = DeviceProfile(name or f"measured {where} ({precision})",
                            tuple((c, rates[c]) for c in OP_CLASSES), overhead, curve,
                            latency, source, arithmetic, key, host_link=device.type == "cpu")
    if device.type == "cpu" and overheads:  # what a step pays beyond kernels, one thread
        previous = torch.get_num_threads()
        torch.set_num_threads(threads or previous)
        try:
            profile = measure_overheads(profile)
        finally:
            torch.set_num_threads(previous)
        if link:  # and what a rank of a multi-process pipeline pays beyond that
            action, message = measure_rank_overheads(profile)
            profile = replace(profile, action_overhead=action, message_overhead=message)
    problems = implausible(profile)
    if problems:
        warnings.warn(f"the device profile of {device} contradicts itself after measuring "
                      f"again: {'; '.join(problems)}. Something else was loading the machine; "
                      "measure it again when it is idle: fxpipe profile --refresh",
                      stacklevel=2)
    return profile


def _faster(a: Curve, b: Curve) -> Curve:
    """The faster rate of two measurements of one curve at each size."""
    rates = dict(a.points)
    for size, rate in b.points:
        rates[size] = max(rate, rates.get(size, 0.0))
    return Curve(tuple(sorted(rates.items())))

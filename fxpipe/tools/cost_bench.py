"""Benchmarks of the cost pass: annotation time of a deep GPT, and estimated against measured
step time of the reference GPT on this CPU.

Run as `python -m fxpipe.tools.cost_bench`.
"""
from __future__ import annotations

import time
from typing import TypedDict

import torch
from tabulate import tabulate

import fxpipe
from fxpipe import ir
from fxpipe.losses import default_loss
from fxpipe.models import gpt
from fxpipe.passes.cost import annotate_costs
from fxpipe.passes.estimate import estimate_time
from fxpipe.passes.timing import measure_times
from fxpipe.profile import DeviceProfile, cached_profile, min_time

__all__ = ["AnnotationBench", "EstimateBench", "benchmark_annotation", "benchmark_estimate", "main"]


class AnnotationBench(TypedDict):
    """benchmark_annotation's result (seconds)."""

    n_layer: int
    nodes: int
    capture_s: float
    annotate_s: float
    cache_hits: int


class EstimateBench(TypedDict):
    """benchmark_estimate's result (seconds, FLOP/s, bytes/s)."""

    b: int
    measured_s: float
    estimated_s: float
    estimated_fwd_s: float
    estimated_bwd_s: float
    ratio: float
    measured_nodes_s: float
    profile: str
    peak_flops: float
    mem_bandwidth: float
    kernel_overhead: float
    worst_nodes: list[tuple[str, float, float]]  # (node, estimated, measured alone)


def benchmark_annotation(n_layer: int = 48) -> AnnotationBench:
    """Times fxpipe.capture and annotate_costs on the reference GPT with `n_layer` blocks."""
    model, inputs = gpt.build(n_layer=n_layer)
    start = time.perf_counter()
    gm = fxpipe.capture(model, inputs, inline_modules=True)
    captured = time.perf_counter()
    summary = annotate_costs(gm)
    annotated = time.perf_counter()
    return {"n_layer": n_layer, "nodes": summary.nodes, "capture_s": captured - start,
            "annotate_s": annotated - captured, "cache_hits": summary.cache_hits}


def benchmark_estimate(*, profile: DeviceProfile | None = None, warmup: int = 2,
                       repeat: int = 5, worst: int = 5) -> EstimateBench:
    """Sum of per-node roofline estimates against the measured training step of the reference
    GPT (gpt.build(dropout=0.0): forward, default loss, backward; one thread).

    The profile, measured on this CPU (fxpipe.profile: a rate per op class, cached per
    machine), is the calibration; both sides keep the fastest of repeated runs. The loss is
    outside the captured graph, so the estimate leaves it out while the measured step includes
    it (a few percent for this model).

    Returns the measured and estimated seconds, their ratio (estimated / measured), the profile,
    and the `worst` nodes by |estimated - measured| per-node time (passes.timing) to show where
    an estimate goes wrong.
    """
    profile = profile or cached_profile("cpu")
    model, inputs = gpt.build(dropout=0.0)
    target = gpt.target(inputs)
    batch = inputs[0].shape[0]
    gm = fxpipe.capture(model, inputs, inline_modules=True)
    annotate_costs(gm)

    def step() -> None:
        torch.autograd.backward(default_loss(model(*inputs), target))

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measured = min_time(step, warmup=warmup, samples=max(repeat, 10), budget=2.0)
    finally:
        torch.set_num_threads(previous)
        model.zero_grad(set_to_none=True)
    nodes = ir.compute_nodes(gm.graph)
    estimates = {n.name: estimate_time(ir.cost(n), profile, batch) for n in nodes}
    fwd = sum(f for f, _ in estimates.values())
    bwd = sum(b for _, b in estimates.values())
    flat = gm.meta[ir.CAPTURE].signature.flatten_inputs(inputs, {})
    times = measure_times(gm, flat, microbatch_size=batch, warmup=warmup, repeat=repeat)
    by_error = sorted(nodes, key=lambda n: -abs(sum(estimates[n.name])
                                                - times[n.name].fwd - times[n.name].bwd))
    return {
        "b": batch, "measured_s": measured, "estimated_s": fwd + bwd, "estimated_fwd_s": fwd,
        "estimated_bwd_s": bwd, "ratio": (fwd + bwd) / measured,
        "measured_nodes_s": sum(t.fwd + t.bwd for t in times.values()),
        "profile": profile.name, "peak_flops": profile.peak_flops,
        "mem_bandwidth": profile.mem_bandwidth, "kernel_overhead": profile.kernel_overhead,
        "worst_nodes": [(n.name, sum(estimates[n.name]), times[n.name].fwd + times[n.name].bwd)
                        for n in by_error[:worst]],
    }


def main() -> None:
    """Prints both benchmarks as tables."""
    annotation = benchmark_annotation()
    print(tabulate([[annotation["n_layer"], annotation["nodes"], f"{annotation['capture_s']:.2f}",
                     f"{annotation['annotate_s']:.2f}", annotation["cache_hits"]]],
                   headers=["blocks", "compute nodes", "capture (s)", "annotate (s)",
                            "cache hits"]))
    print()
    est = benchmark_estimate()
    print(tabulate([[f"b={est['b']}", f"{est['measured_s'] * 1e3:.2f}",
                     f"{est['estimated_s'] * 1e3:.2f}", f"{est['estimated_fwd_s'] * 1e3:.2f}",
                     f"{est['estimated_bwd_s'] * 1e3:.2f}", f"{est['ratio']:.2f}"]],
                   headers=["reference GPT", "measured step (ms)", "estimated (ms)",
                            "est. fwd (ms)", "est. bwd (ms)", "estimated / measured"]))
    print(f"profile: {est['profile']}: {est['peak_flops'] / 1e9:.1f} GFLOP/s, "
          f"{est['mem_bandwidth'] / 1e9:.2f} GB/s, {est['kernel_overhead'] * 1e6:.2f} us/kernel")
    print()
    print(tabulate([[name, f"{e * 1e3:.3f}", f"{m * 1e3:.3f}"]
                    for name, e, m in est["worst_nodes"]],
                   headers=["node (largest error)", "estimated (ms)", "measured alone (ms)"]))


if __name__ == "__main__":
    main()

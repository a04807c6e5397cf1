"""The partition benchmark's instances (fxpipe.tools.bench_partition): the reference models'
atoms and cut times, and synthetic chains and skip-edge DAGs of a given number of atoms."""
from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence
from typing import TypeAlias, TypedDict

import numpy as np
import numpy.typing as npt

import fxpipe
from fxpipe.models import MODELS
from fxpipe.passes.cost import annotate_costs
from fxpipe.passes.partition.atoms import atoms_of, measure_atoms
from fxpipe.passes.partition.problem import PartitionProblem, partition_problem
from fxpipe.profile import get_profile

__all__ = ["FloatArray", "Instance", "InstanceInfo", "live_bytes", "model_instances",
           "synthetic_chain", "synthetic_dag"]

FloatArray: TypeAlias = npt.NDArray[np.float64]


# --------------------------------------------------------------------------------------------
# instances
# --------------------------------------------------------------------------------------------


class InstanceInfo(TypedDict, total=False):
    """How an instance was made (bench_partition.json), by kind of instance."""

    profile: str  # model
    microbatch: int
    remat: str
    comm: str  # synthetic
    seed: int
    compute: str
    edges: int  # dag
    skip_edges: int
    bandwidth_bytes_per_unit: float
    comm_frac: float


def synthetic_chain(n: int, seed: int) -> tuple[FloatArray, FloatArray, InstanceInfo]:
    """Log-normal compute (mean 1) and cut communication uniform in [0, 0.3 x mean compute]."""
    rng = np.random.default_rng(seed)
    compute = rng.lognormal(mean=-0.5, sigma=1.0, size=n)
    comm = rng.uniform(0.0, 0.3 * float(compute.mean()), size=n + 1)
    return compute, comm, {"comm": "uniform [0, 0.3 x mean compute]"}


def live_bytes(n: int, src: npt.ArrayLike, dst: npt.ArrayLike,
               nbytes: npt.ArrayLike) -> FloatArray:
    """Bytes live across each cut 0..n: edge u -> v (u < v) spans cuts u+1 .. v (difference
    array); cuts 0 and n are the model's input and output and carry 0."""
    diff = np.zeros(n + 2)
    np.add.at(diff, np.asarray(src) + 1, nbytes)
    np.subtract.at(diff, np.asarray(dst) + 1, nbytes)
    live = np.cumsum(diff)[: n + 1]
    live[0] = live[n] = 0.0
    return live


def synthetic_dag(n: int, seed: int, k: int, *, skip_prob: float = 0.3, reach: int = 50,
                  comm_frac: float = 0.1) -> tuple[FloatArray, FloatArray, InstanceInfo]:
    """A random DAG in topological order: edge i -> i+1 for every i and, with probability
    skip_prob, a skip edge i -> i+d (d uniform in 2..reach).  Cut p (between atoms p-1 and p)
    carries the bytes of every edge u -> v with u < p <= v; seconds = bytes / bandwidth, with the
    bandwidth set so that the mean cut costs comm_frac of an ideal stage (total compute / k)."""
    rng = np.random.default_rng(seed)
    compute = rng.lognormal(mean=-0.5, sigma=1.0, size=n)
    src = np.arange(n - 1)
    dst = src + 1
    chain_bytes = rng.lognormal(mean=0.0, sigma=0.5, size=n - 1)
    has_skip = rng.random(n) < skip_prob
    s_src = np.flatnonzero(has_skip)
    s_dst = np.minimum(s_src + rng.integers(2, reach + 1, size=s_src.shape[0]), n - 1)
    keep = s_dst > s_src + 1
    s_src, s_dst = s_src[keep], s_dst[keep]
    skip_bytes = rng.lognormal(mean=1.0, sigma=1.5, size=s_src.shape[0])
    live = live_bytes(n, np.concatenate((src, s_src)), np.concatenate((dst, s_dst)),
                      np.concatenate((chain_bytes, skip_bytes)))
    bandwidth = float(live[1:n].mean()) / (comm_frac * float(compute.sum()) / k)
    info: InstanceInfo = {"edges": int(n - 1 + s_src.shape[0]), "skip_edges": int(s_src.shape[0]),
                          "bandwidth_bytes_per_unit": bandwidth, "comm_frac": comm_frac,
                          "comm": f"live bytes across the cut / bandwidth "
                                  f"(mean = {comm_frac} x total/K)"}
    return compute, live / bandwidth, info


class Instance(TypedDict):
    """One partition problem of the benchmark."""

    name: str
    kind: str  # "model", "chain" or "dag"
    n: int  # atoms
    K: int  # stages
    unit: str  # of the bottlenecks in the tables: "us" (models) or "u" (mean atom compute)
    scale: float  # bottleneck x scale is in `unit`
    problem: PartitionProblem  # compute and cut communication, no memory model
    info: InstanceInfo


def model_instances(stages: int, log: Callable[[str], object] = print,
                    names: Sequence[str] | None = None) -> list[Instance]:
    """The reference models' (names, default all) atoms and cut times (preset "a100" profile,
    micro-batch batch/4, remat "never", 4 chunks) for K in {2, 4, min(stages, atoms)}."""
    out: list[Instance] = []
    for name in MODELS if names is None else names:
        t0 = time.perf_counter()
        module = importlib.import_module(f"fxpipe.models.{name}")
        config = {"dropout": 0.0} if name == "gpt" else {}
        model, inputs = module.build(**config)
        if name == "resnet":
            model.eval()
        kwargs = module.example_kwargs(inputs) if hasattr(module, "example_kwargs") else {}
        gm = fxpipe.capture(model, inputs, kwargs, inline_modules=True)
        annotate_costs(gm)
        groups = atoms_of(gm)
        b = max(1, int(inputs[0].shape[0]) // 4)
        atoms = measure_atoms(gm, groups, balance="cost", profile=get_profile("a100"), b=b,
                               remat="never", chunks=4)
        n = len(groups)
        log(f"  captured {name}: {n} atoms ({time.perf_counter() - t0:.1f} s)")
        for k in sorted({2, 4, min(stages, n)}):
            if k <= n:
                out.append({"name": f"{name}", "kind": "model", "n": n, "K": k, "unit": "us",
                            "scale": 1e6,
                            "problem": partition_problem(atoms.compute, k,
                                                         cut_comm=atoms.cut_comm),
                            "info": {"profile": "a100", "microbatch": b, "remat": "never"}})
    return out

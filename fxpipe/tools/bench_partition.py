"""`fxpipe bench-partition`: the exact stage partitioner against an oracle and two baselines.

On every instance (the reference models' atoms under the preset "a100" profile, and synthetic
chains and skip-edge DAGs of args.sizes atoms) it reports the bottleneck (slowest stage,
communication included, as `problem.evaluate` computes it) of

- fxpipe: `solver.solve_partition` (bisection with an exact probe), and its solve time;
- exact: `dp_partition` below, the textbook O(n^2 K) dynamic program, on every instance up to
  `DP_MAX_ATOMS` atoms (its i-range is banded by a baseline's bottleneck, an upper bound on the
  optimum, which keeps it exact); above that "= fxpipe (certified by bisection)";
- equal: `equal_count_cuts`, the same number of atoms per stage;
- bg: torchgpipe's "block partitions of sequences" heuristic (Barany & Grinberg), reimplemented
  from its description in the reference notes (algorithms.md section 1.3) as `bg_partition`,
  with torchgpipe's (x - min) / (max - min) normalisation; and bg_max, the same algorithm on
  x / max (no shift), which isolates the cost of the shift from that of the algorithm itself.

Both baselines see only the compute times (torchgpipe's balance_by_time has no communication
model); every method is scored on the same cost.  Every instance checks fxpipe <= every baseline
and fxpipe == DP (relative 1e-9) where the DP ran; the exit code is 1 when a check fails.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias, TypedDict

import numpy as np
import numpy.typing as npt
from tabulate import tabulate

import fxpipe
from fxpipe.models import MODELS
from fxpipe.passes.cost import annotate_costs
from fxpipe.passes.partition.atoms import atoms_of, measure_atoms
from fxpipe.passes.partition.problem import (
    Partition,
    PartitionProblem,
    equal_count_cuts,
    evaluate,
    partition_problem,
)
from fxpipe.passes.partition.solver import solve_partition
from fxpipe.profile import get_profile

__all__ = ["BGResult", "Comparison", "Instance", "InstanceInfo", "MethodResult",
           "PartitionBenchJSON", "PartitionBenchMeta", "Row",
           "bg_partition", "compare", "dp_partition", "live_bytes", "model_instances",
           "run_bench_partition", "synthetic_chain", "synthetic_dag"]

DP_MAX_ATOMS = 10_000  # above this the banded DP costs ~n^2 and the bisection's result stands
BG_MAX_MOVES_PER_ATOM = 64  # iteration bound: moves <= this x n x K
REL_TOL = 1e-9  # fxpipe's rel_tol: the largest relative gap allowed to the optimum
SEED = 0

Vector: TypeAlias = Sequence[float] | np.ndarray
"""Per-atom or per-cut numbers, as the solver takes them."""
FloatArray: TypeAlias = npt.NDArray[np.float64]
Baseline: TypeAlias = Literal["equal", "bg", "bg_max"]
BASELINES: tuple[Baseline, ...] = ("equal", "bg", "bg_max")
SCORED: tuple[Literal["equal", "bg", "bg_max", "exact"], ...] = (*BASELINES, "exact")
"""The methods whose bottleneck is compared with fxpipe's."""


# --------------------------------------------------------------------------------------------
# torchgpipe's heuristic (Barany & Grinberg), from its description
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BGResult:
    cuts: tuple[int, ...] | None  # None when the time budget ran out
    moves: int
    seconds: float
    status: str  # "ok", "iteration limit" or "skipped (too slow: O(kn^3))"
    repaired: int = 0  # empty blocks left at the end and made non-empty (never seen so far)


def bg_partition(seq: Vector, k: int, *, normalise: str = "minmax",
                 time_budget: float | None = None, max_moves: int | None = None) -> BGResult:
    """Cut `seq` into k contiguous blocks by Barany & Grinberg's algorithm.

    normalise: "minmax" maps x to (x - min) / (max - min) first, as torchgpipe does; "max" maps x
    to x / max (block sums stay proportional); "none" uses seq as it is (elements should be <= 1).
    Start from the even split by count (`equal_count_cuts`) and repeat, in normalised units:
      (1) let p be a largest block (lowest index on ties), M its sum;
      (2) stop if M <= m + 1, m the smallest block sum;
      (3) else let q be the smallest block closest to p (lower index on ties) and h the block
          next to q on p's side; move h's element nearest q into q (p < q: the last of B_{q-1};
          q < p: the first of B_{q+1}); go to (1) if h == p, else to (2).
    Block sums come from prefix sums, so a move costs O(k) here; torchgpipe's docstring states
    O(kn^3) for its version, which re-sums every block on each step.
    """
    t0 = time.perf_counter()
    x = np.asarray(seq, dtype=np.float64)
    n = int(x.shape[0])
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} elements into {k} non-empty blocks")
    if normalise == "minmax":
        lo, span = float(x.min()), float(x.max() - x.min())
        y = (x - lo) / span if span > 0 else np.zeros(n)
    elif normalise == "max":
        top = float(x.max())
        y = x / top if top > 0 else np.zeros(n)
    elif normalise == "none":
        y = x
    else:
        raise ValueError(f"unknown normalise {normalise!r}")
    Q = np.concatenate(([0.0], np.cumsum(y))).tolist()
    c = list(equal_count_cuts(n, k))
    sums = [Q[c[s + 1]] - Q[c[s]] for s in range(k)]
    limit = max_moves if max_moves is not None else BG_MAX_MOVES_PER_ATOM * n * k
    moves = 0
    status = "ok"
    while status == "ok":
        M = max(sums)  # (1)
        p = sums.index(M)
        while True:
            m = min(sums)  # (2)
            if M <= m + 1:
                status = "done"
                break
            q = min((abs(s - p), s) for s in range(k) if sums[s] == m)[1]  # (3)
            if p < q:
                h = q - 1
                c[q] -= 1
            else:
                h = q + 1
                c[q + 1] += 1
            for s in (h, q):
                sums[s] = Q[c[s + 1]] - Q[c[s]]
            moves += 1
            if moves >= limit:
                status = "iteration limit"
                break
            if time_budget is not None and moves % 256 == 0 \
                    and time.perf_counter() - t0 > time_budget:
                return BGResult(None, moves, time.perf_counter() - t0,
                                "skipped (too slow: O(kn^3))")
            if h == p:
                break
    # The algorithm never moves an element out of an empty block; a block can only be empty at
    # the end if all block sums are <= 1.  Keep the cuts strictly increasing regardless.
    repaired = sum(1 for s in range(k) if c[s + 1] <= c[s])
    for s in range(1, k):
        c[s] = max(c[s], c[s - 1] + 1)
    for s in range(k - 1, 0, -1):
        c[s] = min(c[s], c[s + 1] - 1)
    return BGResult(tuple(c), moves, time.perf_counter() - t0,
                    "ok" if status == "done" else status, repaired)


# --------------------------------------------------------------------------------------------
# the exact oracle
# --------------------------------------------------------------------------------------------


def dp_partition(problem: PartitionProblem, *, upper: float | None = None,
                 chunk: int = 256) -> Partition:
    """The bottleneck-optimal k-stage partition by D[s][j] = min_i max(D[s-1][i], T(i, j)) with
    T(i, j) = sum(compute[i:j]) + cut_comm[i] + cut_comm[j] (ends 0), vectorised over blocks of j.

    upper: the bottleneck of any k-stage partition (an upper bound on the optimum); stages with
    compute alone above it cannot be in an optimal partition, so i starts at the first position
    with P[j] - P[i] <= upper.  Costs use float prefix sums; the result is re-scored by evaluate.
    """
    x = np.asarray(problem.compute, dtype=np.float64)
    n, k = problem.num_atoms, problem.num_stages
    c = np.asarray(problem.cut_comm, dtype=np.float64)  # the ends are 0
    P = np.concatenate(([0.0], np.cumsum(x)))
    band = math.inf if upper is None else upper * (1 + 1e-9) + 1e-12 * float(P[-1])
    prev = np.full(n + 1, math.inf)
    prev[0] = 0.0
    arg = np.zeros((k + 1, n + 1), dtype=np.int64)
    for s in range(1, k + 1):
        cur = np.full(n + 1, math.inf)
        for j0 in range(s, n - k + s + 1, chunk):
            js = np.arange(j0, min(j0 + chunk, n - k + s + 1))
            i_lo = s - 1
            if not math.isinf(band):
                i_lo = max(i_lo, int(np.searchsorted(P, P[j0] - band, side="left")))
            starts = np.arange(i_lo, int(js[-1]))  # the i of every candidate stage [i, j)
            T = (P[js][None, :] - P[starts][:, None]) + c[starts][:, None] + c[js][None, :]
            T[starts[:, None] >= js[None, :]] = math.inf
            V = np.maximum(prev[starts][:, None], T)
            best = np.argmin(V, axis=0)
            cur[js] = V[best, np.arange(js.shape[0])]
            arg[s, js] = starts[best]
        prev = cur
    if not math.isfinite(prev[n]):
        raise AssertionError("dp_partition: no partition within the upper bound")
    cuts = [n]
    for s in range(k, 0, -1):
        cuts.append(int(arg[s, cuts[-1]]))
    return evaluate(problem, tuple(reversed(cuts)))


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


# --------------------------------------------------------------------------------------------
# one comparison
# --------------------------------------------------------------------------------------------


def _timed_solve(problem: PartitionProblem) -> tuple[Partition, float]:
    best, spent, part = math.inf, 0.0, None
    for _ in range(3):  # best of up to 3 runs while they take under 1 s in all
        t0 = time.perf_counter()
        part = solve_partition(problem, rel_tol=REL_TOL)
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
        if spent > 1.0:
            break
    assert part is not None
    return part, best


class MethodResult(TypedDict, total=False):
    """One method on one instance; which keys it has depends on the method."""

    bottleneck: float | None  # None: the method gave up (bg past its time budget)
    cuts: list[int] | None
    ratio_to_fxpipe: float | None  # every method but fxpipe
    solve_seconds: float  # fxpipe
    seconds: float  # bg, bg_max and the DP
    moves: int  # bg, bg_max
    status: str
    normalise: str
    repaired_blocks: int
    method: str  # exact: "dp" or "fxpipe (certified by bisection)"


class Comparison(TypedDict):
    """Every method on one instance, and the checks fxpipe must pass."""

    fxpipe: MethodResult
    equal: MethodResult
    bg: MethodResult
    bg_max: MethodResult
    exact: MethodResult
    checks: dict[str, bool]


def compare(problem: PartitionProblem, *, bg_budget: float | None = None) -> Comparison:
    """All methods on one instance: bottlenecks, ratios to fxpipe, checks."""
    n, k = problem.num_atoms, problem.num_stages
    fx, solve_s = _timed_solve(problem)
    eq = evaluate(problem, equal_count_cuts(n, k))
    bg: dict[str, MethodResult] = {}
    for key, norm in (("bg", "minmax"), ("bg_max", "max")):
        r = bg_partition(problem.compute, k, normalise=norm, time_budget=bg_budget)
        entry: MethodResult = {"seconds": r.seconds, "moves": r.moves, "status": r.status,
                               "normalise": norm, "repaired_blocks": r.repaired,
                               "bottleneck": None, "cuts": None}
        if r.cuts is not None:
            entry["bottleneck"] = evaluate(problem, r.cuts).bottleneck
            entry["cuts"] = list(r.cuts)
        bg[key] = entry
    res: Comparison = {
        "fxpipe": {"bottleneck": fx.bottleneck, "solve_seconds": solve_s, "cuts": list(fx.cuts)},
        "equal": {"bottleneck": eq.bottleneck, "cuts": list(eq.cuts)},
        "bg": bg["bg"], "bg_max": bg["bg_max"], "exact": {}, "checks": {}}
    baselines = [b for b in (res[m]["bottleneck"] for m in BASELINES) if b is not None]
    dp: Partition | None = None
    if n <= DP_MAX_ATOMS:
        t0 = time.perf_counter()
        dp = dp_partition(problem, upper=min(baselines))
        res["exact"] = {"bottleneck": dp.bottleneck, "method": "dp",
                        "seconds": time.perf_counter() - t0, "cuts": list(dp.cuts)}
    else:
        res["exact"] = {"bottleneck": fx.bottleneck, "method": "fxpipe (certified by bisection)"}
    for m in SCORED:
        b = res[m]["bottleneck"]
        res[m]["ratio_to_fxpipe"] = None if b is None else b / fx.bottleneck
    checks = {"fxpipe_le_baselines": all(fx.bottleneck <= b * (1 + REL_TOL) for b in baselines)}
    if dp is not None:
        checks["fxpipe_eq_dp"] = abs(fx.bottleneck - dp.bottleneck) <= REL_TOL * dp.bottleneck
    res["checks"] = checks
    return res


# --------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------


class Row(Comparison):
    """One instance's line of bench_partition.json: the instance without its data, the results."""

    name: str
    kind: str
    n: int
    K: int
    unit: str
    scale: float
    info: InstanceInfo


def _fmt_ratio(entry: MethodResult) -> str:
    r = entry.get("ratio_to_fxpipe")
    return entry.get("status", "n/a") if r is None else f"{r:.4f}"


Table: TypeAlias = list[list[str | int]]


def _tables(rows: list[Row]) -> tuple[list[str], Table, list[str], Table]:
    h1 = ["instance", "n", "K", "unit", "fxpipe", "solve ms", "exact", "equal/fx", "bg/fx",
          "bg_max/fx", "bg s (moves)", "checks"]
    h2 = ["instance", "K", "unit", "fxpipe", "exact", "equal", "bg", "bg_max"]
    t1: Table = []
    t2: Table = []
    for r in rows:
        sc = r["scale"]

        def val(e: MethodResult, sc: float = sc) -> str:
            return "skipped" if e["bottleneck"] is None else f"{e['bottleneck'] * sc:.6g}"

        ex = r["exact"]
        exact = f"DP {val(ex)}" if ex["method"] == "dp" else "= fxpipe (bisection)"
        ok = all(r["checks"].values())
        t1.append([r["name"], r["n"], r["K"], r["unit"], val(r["fxpipe"]),
                   f"{r['fxpipe']['solve_seconds'] * 1e3:.2f}", exact, _fmt_ratio(r["equal"]),
                   _fmt_ratio(r["bg"]), _fmt_ratio(r["bg_max"]),
                   f"{r['bg']['seconds']:.3f} ({r['bg']['moves']})", "ok" if ok else "FAIL"])
        t2.append([r["name"], r["K"], r["unit"], val(r["fxpipe"]),
                   val(ex) if ex["method"] == "dp" else "(= fxpipe)", val(r["equal"]),
                   val(r["bg"]), val(r["bg_max"])])
    return h1, t1, h2, t2


def _summary(rows: list[Row]) -> list[str]:
    lines = []
    for m in BASELINES:
        rs = [x for x in (r[m]["ratio_to_fxpipe"] for r in rows) if x is not None]
        if rs:
            lines.append(f"{m}/fxpipe over {len(rs)} instances: mean {np.mean(rs):.4f}, "
                         f"worst {max(rs):.4f}, equal to fxpipe on "
                         f"{sum(1 for x in rs if x <= 1 + REL_TOL)}")
    ndp = sum(1 for r in rows if r["exact"]["method"] == "dp")
    lines.append(f"DP oracle ran on {ndp}/{len(rows)} instances (n <= {DP_MAX_ATOMS}); the rest "
                 "are certified by fxpipe's bisection, and every baseline is >= fxpipe")
    return lines


class PartitionBenchMeta(TypedDict):
    sizes: list[int]
    stages: int
    seed: int
    rel_tol: float
    dp_max_atoms: int
    bg_budget_seconds_above_10000: float
    total_seconds: float
    numpy: str
    python: str
    bottleneck_units: str
    baselines_see: str


class PartitionBenchJSON(TypedDict):
    """bench_partition.json."""

    meta: PartitionBenchMeta
    instances: list[Row]
    summary: list[str]  # the summary lines
    failed: list[str]  # "instance K=k" of every instance that failed a check


def run_bench_partition(sizes: Sequence[int] = (1000, 10000, 100000), stages: int = 8,
                        out: str = ".", models: Sequence[str] | None = None,
                        bg_budget: float = 60.0) -> int:
    """Run the benchmark; print progress and the tables; write bench_partition.{json,md}.

    models: reference models to include (default all); bg_budget: seconds the block-partition
    heuristic may search on instances above 10,000 atoms.
    """
    t_start = time.perf_counter()
    sizes = list(sizes)

    def log(text: str) -> None:
        print(text, flush=True)

    log(f"bench-partition: sizes {sizes}, K = {stages}, seed {SEED}")
    instances = model_instances(stages, log, models)
    for i, n in enumerate(sizes):
        k = min(stages, n)
        for kind, seed in (("chain", SEED + i), ("dag", SEED + 100 + i)):
            compute, comm, info = (synthetic_chain(n, seed) if kind == "chain"
                                   else synthetic_dag(n, seed, k))
            instances.append({"name": f"{kind}-{n}", "kind": kind, "n": n, "K": k, "unit": "u",
                              "scale": 1.0,
                              "problem": partition_problem(compute, k, cut_comm=comm),
                              "info": {**info, "seed": seed,
                                       "compute": "log-normal, sigma 1, mean 1"}})
    rows: list[Row] = []
    for idx, inst in enumerate(instances, 1):
        t0 = time.perf_counter()
        budget = bg_budget if inst["n"] > 10_000 else None
        res = compare(inst["problem"], bg_budget=budget)
        # the instance without its data, then the results: the order of bench_partition.json
        row: Row = {"name": inst["name"], "kind": inst["kind"], "n": inst["n"], "K": inst["K"],
                    "unit": inst["unit"], "scale": inst["scale"], "info": inst["info"], **res}
        rows.append(row)
        log(f"  [{idx}/{len(instances)}] {inst['name']} n={inst['n']} K={inst['K']}: fxpipe "
            f"{res['fxpipe']['solve_seconds'] * 1e3:.2f} ms, bg {res['bg']['status']} "
            f"({res['bg']['seconds']:.2f} s), exact by {res['exact']['method']}, "
            f"checks {'ok' if all(res['checks'].values()) else 'FAIL ' + str(res['checks'])} "
            f"({time.perf_counter() - t0:.1f} s)")
    h1, t1, h2, t2 = _tables(rows)
    summary = _summary(rows)
    failed = [r["name"] + f" K={r['K']}" for r in rows if not all(r["checks"].values())]
    total = time.perf_counter() - t_start
    log("\n" + tabulate(t1, headers=h1, disable_numparse=True))
    log("\nbottlenecks (units: us for models; u = mean atom compute for synthetic)")
    log(tabulate(t2, headers=h2, disable_numparse=True))
    log("\n" + "\n".join(summary))
    log(f"failed checks: {', '.join(failed) if failed else 'none'}; total {total:.1f} s")
    os.makedirs(out, exist_ok=True)
    meta: PartitionBenchMeta = {
        "sizes": sizes, "stages": stages, "seed": SEED, "rel_tol": REL_TOL,
        "dp_max_atoms": DP_MAX_ATOMS, "bg_budget_seconds_above_10000": bg_budget,
        "total_seconds": total, "numpy": np.__version__, "python": platform.python_version(),
        "bottleneck_units": "seconds for models, mean-atom units for synthetic instances",
        "baselines_see": "compute only (no communication model), scored with communication"}
    result: PartitionBenchJSON = {"meta": meta, "instances": rows, "summary": summary,
                                  "failed": failed}
    with open(os.path.join(out, "bench_partition.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    with open(os.path.join(out, "bench_partition.md"), "w") as f:
        f.write("# fxpipe bench-partition\n\n" + (__doc__ or "").split("\n\n", 1)[1] + "\n")
        f.write(tabulate(t1, headers=h1, tablefmt="github", disable_numparse=True) + "\n\n")
        f.write("Bottlenecks (us for models; u = mean atom compute for synthetic):\n\n")
        f.write(tabulate(t2, headers=h2, tablefmt="github", disable_numparse=True) + "\n\n")
        f.write("\n".join(f"- {s}" for s in summary) + f"\n- total {total:.1f} s\n")
    return 1 if failed else 0

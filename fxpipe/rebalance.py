"""Balancing by measurement (balance="dynamic", program.rebalance()): measure, correct, cut
again; and the parameters and optimizer state that then change hands.

The loop: measure each stage's compute time on the current cut, correct every node's time by
its stage's measured / predicted ratio (passes.partition.correct), solve the partition again,
and repeat until the measured stages are within TOLERANCE of each other. When solving again comes
back to a cut already measured, the next cut is tried (nodes moved from the slowest stage to its
faster neighbour); the fastest cut measured is kept, and the last round says why balancing
stopped, so a cut kept far from balanced comes with its reason. A first round whose stages
measure far from the profile's prediction drops the cached profile (fxpipe.profile.cache).
Every rank of a torchrun job measures its own stage, all ranks share the numbers, and rank 0's
partition is the one every rank builds.

A balanced cut is remembered in the user's cache folder (fxpipe.profile.cache_dir()/balance),
keyed by the captured graph, the options, the device profile and the number of processes, so the
next compile of the same model on the same machine gets the same cut without measuring.

When a running program's cut changes under torchrun, parameters, buffers and optimizer state
move from the rank that held them to the rank that now holds them, one message per pair of
ranks, in an order every rank derives alike (a pair's two ranks reach it together).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.built import Built
from fxpipe.errors import RuntimeInputError
from fxpipe.losses import LossFn
from fxpipe.passes.partition import TOLERANCE, BalanceRound, best_round, corrected, next_cut
from fxpipe.pipeline import PlanAgreement, rebuild
from fxpipe.profile import cache_dir
from fxpipe.profile.cache import check_against_run
from fxpipe.remat_policy import RematPolicy, remat_policy
from fxpipe.runtime.communication.mesh import Mesh
from fxpipe.runtime.execution.local import LocalExecutor
from fxpipe.runtime.execution.rank import RankPipeline
from fxpipe.runtime.execution.stagetime import time_stages
from fxpipe.runtime.planning.timeline import busy_time
from fxpipe.signature import Signature
from fxpipe.storage.files import atomic_write
from fxpipe.storage.state import graph_tensors
from fxpipe.targets import Target
from fxpipe.version import __version__

__all__ = ["balance_by_measurement", "cut_of", "balance_key", "load_balance", "forget_balance",
           "save_balance", "moves", "move_state", "placed_state", "move_optimizer_state",
           "measure_local", "measure_ranks", "robust_time"]

Measure = Callable[[Built], list[float]]
"""Seconds of compute per micro-batch of each stage of a built program, measured."""


def cut_of(built: Built) -> tuple[str, ...]:
    """The first node of every stage: what identifies a cut."""
    return tuple(s.nodes[0] if s.nodes else "" for s in built.plan.stages)


def _round(built: Built, measured: Sequence[float]) -> BalanceRound:
    plan = built.plan
    return BalanceRound(cut_of(built), tuple(s.first_module for s in plan.stages),
                        tuple(s.compute_time for s in plan.stages), tuple(measured),
                        tuple(built.config.placement),
                        messages=tuple(plan.message_time(s) for s in plan.stages))


def balance_by_measurement(built: Built, *, measure: Measure, install: Callable[[Built], None],
                           agree: PlanAgreement | None = None, rounds: int = 4,
                           tolerance: float = TOLERANCE,
                           progress: Callable[[str], None] | None = None,
                           move: bool = True) -> Built:
    """Measures and re-cuts `built` (already installed) until balanced; returns the program
    built on the fastest cut measured, installed, with its rounds recorded. move=False (a cut
    the user fixed) measures it once and keeps it."""
    if not move:
        built.rounds = [replace(_round(built, measure(built)),
                                note="the cut was given (split_points or node counts): "
                                     "measured, not moved")]
        return built
    history: list[BalanceRound] = []
    made_with: dict[tuple[str, ...], dict[str, float]] = {}
    current = built
    for index in range(rounds):
        made_with[cut_of(current)] = dict(current.corrections)
        this = _round(current, measure(current))
        if index == 0 and not current.corrections:
            check_against_run(current.profile, this.predicted, this.measured)
        history.append(this)
        if progress:
            progress(f"balance round {index + 1}: stages start at {', '.join(this.modules)}; "
                     f"measured {_ms(this.measured)} ms per micro-batch (predicted "
                     f"{_ms(this.predicted)}), {this.spread:.1%} apart")
        if this.spread <= tolerance:
            break
        if index == rounds - 1:
            history[-1] = replace(this, note=f"the {rounds} rounds allowed were all measured")
            break
        stages = [list(s.nodes) for s in current.plan.stages]
        fixes = corrected(current.corrections, stages, this.predicted, this.measured)
        following = rebuild(current, fixes, agree=agree)
        if cut_of(following) in made_with:  # solving again returns a cut already measured
            starts = next_cut(stages, this.measured)
            if starts is not None:
                following = rebuild(current, fixes, agree=agree, starts=starts)
            if starts is None or cut_of(following) in made_with:
                history[-1] = replace(this, note=(
                    "solving again with the measured corrections returns a cut already "
                    "measured, and so does moving nodes from the slowest stage to its "
                    "faster neighbour" if starts is not None else
                    "solving again returns a cut already measured, and the slowest stage "
                    "is a single operation that cannot be split"))
                break
            history[-1] = replace(this, note="solving again returned a cut already measured: "
                                             "moved nodes from the slowest stage to its "
                                             "faster neighbour")
        install(following)
        current = following
    # The fastest cut measured, its nodes corrected by its own measurement: what it predicts
    # is what it measured.
    best = best_round(history)
    stages = _stage_nodes(current, best.starts, made_with[best.starts], agree)
    fixes = corrected(made_with[best.starts], stages, best.predicted, best.measured)
    final = rebuild(current, fixes, agree=agree, starts=best.starts)
    if cut_of(final) != cut_of(current):
        install(final)
    else:  # same stages: only the predictions changed
        current.plan, current.corrections = final.plan, final.corrections
        final = current
    final.rounds = history
    return final


def _stage_nodes(current: Built, starts: tuple[str, ...], corrections: dict[str, float],
                 agree: PlanAgreement | None) -> list[list[str]]:
    if cut_of(current) == starts:
        return [list(s.nodes) for s in current.plan.stages]
    return [list(s.nodes) for s in
            rebuild(current, corrections, agree=agree, starts=starts).plan.stages]


def _ms(times: Sequence[float]) -> str:
    return " / ".join(f"{t * 1e3:.2f}" for t in times)


# --- remembering balanced cuts -----------------------------------------------------------------

_KEPT_BY = "busiest rank with its messages over the mean compute, the next cut tried"
"""How the kept cut is chosen among the rounds (passes.partition.best_round); part of the key,
so cuts kept by an earlier rule are measured again."""


def balance_key(built: Built, world: int) -> str:
    """What a balanced cut depends on: the graph, the options, the device, the processes."""
    config = built.config
    parts = [built.captured.code, built.model_name, str(config.stages), str(built.spec.chunks),
             config.remat, config.schedule, str(config.per_rank), repr(config.devices),
             repr(config.memory_limit),
             built.profile.key or built.profile.name, str(world), torch.__version__, __version__,
             _KEPT_BY]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def load_balance(key: str
                 ) -> tuple[tuple[str, ...], dict[str, float], list[BalanceRound]] | None:
    """The cut (first node of each stage), corrections and rounds balanced before, or None
    (none remembered, or a damaged entry: forgotten with a warning)."""
    path = cache_dir() / "balance" / f"{key}.json"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as e:
        forget_balance(key, f"{type(e).__name__}: {e}")
        return None
    try:
        data = json.loads(text)
        rounds = [BalanceRound(tuple(r["starts"]), tuple(r["modules"]),
                               tuple(r["predicted_s"]), tuple(r["measured_s"]),
                               tuple(int(x) for x in r.get("ranks", ())), str(r.get("note", "")),
                               tuple(float(x) for x in r.get("messages_s", ())))
                  for r in data["rounds"]]
        corrections = {str(k): float(v) for k, v in data["corrections"].items()}
        if not all(math.isfinite(v) and v > 0 for v in corrections.values()):
            raise ValueError(f"corrections must be positive numbers, got {corrections}")
        starts = data["starts"]
        if not isinstance(starts, list) or not all(isinstance(n, str) for n in starts):
            raise ValueError(f"starts must be a list of node names, got {starts!r}")
        return tuple(starts), corrections, rounds
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        forget_balance(key, f"{type(e).__name__}: {e}")
        return None


def forget_balance(key: str, why: str) -> None:
    """Removes a remembered cut that cannot be used, with a warning naming its file: the cut
    is then measured again (and remembered anew), rather than every compile failing."""
    path = cache_dir() / "balance" / f"{key}.json"
    warnings.warn(f"the balanced cut remembered in {path} cannot be used ({why}); it is "
                  "removed and the cut measured again", UserWarning, stacklevel=2)
    with contextlib.suppress(OSError):
        path.unlink()


def save_balance(key: str, built: Built) -> None:
    path = cache_dir() / "balance" / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(str(path), json.dumps({"starts": list(cut_of(built)),
                                        "corrections": built.corrections,
                                        "rounds": [r.to_json() for r in built.rounds]},
                                       indent=1, sort_keys=True) + "\n")


# --- moving state between ranks ----------------------------------------------------------------

def _holders(built: Built) -> dict[str, list[int]]:
    """Model tensor (graph qualified name) -> the stages that hold it."""
    out: dict[str, list[int]] = {}
    for st in built.stages:
        for name in graph_tensors(st.graph_module):
            out.setdefault(name, []).append(st.index)
    return out


def moves(old: Built, new: Built) -> list[tuple[int, int, str]]:
    """(from stage, to stage, tensor) for every tensor a stage holds under `new` but not under
    `old`; it comes from the lowest stage that held it. Sorted: every rank walks one order."""
    before, after = _holders(old), _holders(new)
    out = []
    for name, stages in sorted(after.items()):
        held = before.get(name, [])
        for stage in stages:
            if stage not in held and held:
                out.append((min(held), stage, name))
    return sorted(out)


def move_state(old: Built, new: Built, mesh: Mesh, tensors: Mapping[str, torch.Tensor],
               optimizer: torch.optim.Optimizer | None) -> int:
    """Sends this rank's tensors (and their optimizer state) that another stage now holds, and
    receives those this stage now holds; then makes `optimizer` hold exactly the parameters of
    this rank's new stage. `tensors`: the model's tensors by graph qualified name (every rank
    holds the whole model; only the owner's copy is current). Returns the tensors received."""
    pairs: dict[tuple[int, int], list[str]] = {}
    for src, dst, name in moves(old, new):
        pairs.setdefault((src, dst), []).append(name)
    received = 0
    holders = _holders(new)
    for (src, dst), moved in sorted(pairs.items()):
        sender, receiver = mesh.rank_of(src), mesh.rank_of(dst)
        if sender == receiver:  # two stages of one rank: the tensors are here already
            continue
        if mesh.rank == sender:
            payload = {q: _packed(tensors[q], optimizer) for q in moved}
            dist.send_object_list([payload], dst=receiver)
            for q in moved:
                if not set(holders[q]) & set(mesh.held):  # no stage here holds it now
                    _given_away(tensors[q])
        elif mesh.rank == receiver:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=sender)
            for q, entry in box[0].items():
                _unpack(tensors[q], entry, optimizer)
                received += 1
    if optimizer is not None:
        _keep_only(optimizer, [tensors[q] for q, stages in holders.items()
                               if set(stages) & set(mesh.held)])
    return received


def _group_of(optimizer: torch.optim.Optimizer | None, tensor: torch.Tensor) -> int:
    if optimizer is not None:
        for i, group in enumerate(optimizer.param_groups):
            if any(p is tensor for p in group["params"]):
                return i
    return 0


def _packed(tensor: torch.Tensor, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    state: dict[str, Any] = {}
    if optimizer is not None and tensor in optimizer.state:
        state = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                 for k, v in optimizer.state[tensor].items()}
    return {"value": tensor.detach().cpu(), "state": state,
            "group": _group_of(optimizer, tensor)}


def _unpack(tensor: torch.Tensor, entry: Mapping[str, Any],
            optimizer: torch.optim.Optimizer | None) -> None:
    with torch.no_grad():
        tensor.copy_(entry["value"])
    if optimizer is None or not isinstance(tensor, torch.nn.Parameter):
        return
    groups = optimizer.param_groups
    if entry["state"]:
        group = groups[entry["group"]] if entry["group"] < len(groups) else {}
        optimizer.state[tensor] = {k: placed_state(tensor, k, v, group)
                                   for k, v in entry["state"].items()}
    if entry["group"] >= len(groups):
        raise RuntimeInputError(
            f"a parameter moving to this rank belonged to optimizer parameter group "
            f"{entry['group']}, but this rank's optimizer has {len(groups)} groups",
            hint="build the optimizer with the same parameter groups on every rank (empty ones "
                 "included)")
    if not any(p is tensor for g in groups for p in g["params"]):
        groups[entry["group"]]["params"].append(tensor)


def placed_state(param: torch.Tensor, key: str, value: Any, group: Mapping[str, Any]) -> Any:
    """An optimizer state value that arrived for `param`, placed as torch's optimizers place a
    loaded one: the step count stays a CPU scalar unless the group is fused or capturable
    (their kernels read it on the parameter's device, as float32); other tensors go to the
    parameter's device, floating ones in its dtype."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return value.to(device=param.device, dtype=torch.float32)
        return value
    if param.is_floating_point() and value.is_floating_point():
        return value.to(device=param.device, dtype=param.dtype)
    return value.to(device=param.device)


def _given_away(tensor: torch.Tensor) -> None:
    """A tensor this rank sent to the stage that now holds it: its copy here goes back to the
    CPU, where the model's tensors of other ranks' stages sit, freeing the device."""
    if tensor.device.type != "cpu" and not tensor.is_meta:
        with torch.no_grad():
            tensor.data = tensor.data.to("cpu")


def _keep_only(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
    """Drops from the optimizer (and its state) the parameters this rank no longer holds."""
    keep = {id(p) for p in params}
    for group in optimizer.param_groups:
        dropped = [p for p in group["params"] if id(p) not in keep]
        group["params"] = [p for p in group["params"] if id(p) in keep]
        for p in dropped:
            optimizer.state.pop(p, None)


def move_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Puts each parameter's optimizer state where that parameter now is (a stage moved it),
    as `placed_state` says (a fused or capturable group's step count too)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state:
                optimizer.state[p] = {k: placed_state(p, k, v, group) for k, v in state.items()}



# --- measuring a program's stages --------------------------------------------------------------



def measure_local(executor: LocalExecutor, signature: Signature, chunks: int,
                  remat: RematPolicy | str,
                  flat: Sequence[torch.Tensor], target: Target,
                  loss_fn: LossFn, steps: int) -> list[float]:
    """Seconds per micro-batch each stage computes, every stage timed alone in this process
    (CPU stages with one thread each, as one process per stage runs them)."""
    previous = torch.get_num_threads()
    if all(st.device.type == "cpu" for st in executor.stages):
        torch.set_num_threads(1)
    try:
        times = time_stages(executor.stages, signature, chunks, remat, flat, target, loss_fn,
                            steps=steps)
    finally:
        torch.set_num_threads(previous)
    return [robust_time(per_step, remat) for per_step in times]


def robust_time(samples: Sequence[Sequence[float]], remat: RematPolicy | str) -> float:
    """Seconds per micro-batch from samples[step][micro-batch]: among micro-batches that do the
    same work (those that recompute, and those that do not), the fastest sample, weighted by
    how many there are. Load elsewhere only slows samples down, so the fastest is the stage's
    own time; taking it over steps and micro-batches gives many chances to see it."""
    chunks = len(samples[0])
    policy = remat_policy(remat)
    groups: dict[bool, list[float]] = {}
    for per_mb in samples:
        for mb, seconds in enumerate(per_mb):
            groups.setdefault(policy.recomputes(mb, chunks), []).append(seconds)
    counts = {flag: sum(policy.recomputes(mb, chunks) == flag for mb in range(chunks))
              for flag in groups}
    return sum(min(times) * counts[flag] for flag, times in groups.items()) / chunks


def measure_ranks(rank: RankPipeline, flat: list[torch.Tensor], target: Target,
                  loss_fn: LossFn, steps: int) -> list[float]:
    """Seconds per micro-batch each stage computes in real pipeline steps (one warm-up, then
    the fastest of `steps`; waits excluded), the same list on every rank (averaged over
    data-parallel replicas)."""
    held = rank.mesh.held
    samples: dict[int, list[list[float]]] = {s: [] for s in held}
    for i in range(steps + 1):
        _, result = rank.step(flat, target, loss_fn)
        if i:
            for s in held:
                samples[s].append([busy_time([e for e in result.events if e.microbatch == mb],
                                             s) for mb in range(rank.spec.chunks)])
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [(s, robust_time(samples[s], rank.spec.remat)) for s in held])
    per_stage: dict[int, list[float]] = {}
    for stage, seconds in (pair for mine in everyone for pair in mine):
        per_stage.setdefault(stage, []).append(seconds)
    return [sum(v) / len(v) for _, v in sorted(per_stage.items())]

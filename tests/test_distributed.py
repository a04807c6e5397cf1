"""Transparency of the distributed executor: one process per stage, gloo on 127.0.0.1.

Starting processes is slow, so one group of worker processes per world size (2 and 3) runs every
configuration in turn. Configurations are models x remat x schedule, with stages == world size.
The workers send their results back through a queue. For each configuration, each rank
returns three things: the loss of each of 3 SGD steps, its parameters' gradients after step 1
(under the model's names), and its program.state_dict() after step 3. The parent trains a plain
copy of the model the same way and compares. Each configuration is asserted in its own test.

Modes follow tests/test_transparency.py: resnet is compared in eval mode, gpt is built with
dropout=0.0, and the other models train normally. Tolerances are assert_close's float32 defaults.
"""
from __future__ import annotations

import copy
import functools
import importlib
import io
import os
import queue as queue_module
import time
import traceback
from datetime import timedelta
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fxpipe
from fxpipe.losses import default_loss
from fxpipe.models import MODELS
from fxpipe.models import load as load_model
from fxpipe.runtime.planning.schedule import default_stages_per_rank
from fxpipe.runtime.program.torchrun import free_port

pytestmark = pytest.mark.distributed

REMATS = ("never", "always", "except_last")
CHUNKS = 4
STEPS = 3
SGD = dict(lr=0.05, momentum=0.9)
PROFILE = "a100"  # a preset: every rank gets the same partition without measuring
WORLD_TIMEOUT_S = 300  # the whole group of workers, all its configurations together

class Job(NamedTuple):
    model: str
    remat: str
    schedule: str = "gpipe"

    def __str__(self) -> str:
        return f"{self.model}-{self.remat}-{self.schedule}"


# 1F1B with remat="except_last" runs both a recomputed and a kept micro-batch. ZB-H1 on gpt:
# the split backward with the tied embedding summed over the first and last stage after the
# last W, with remat off and on. The looped schedules run two stages per rank: ZB-V puts the
# first and last stage (gpt's tied embedding and head) on rank 0, interleaving puts them on
# the first and last rank; unet's skip connections cross several stages.
JOBS: dict[int, list[Job]] = {
    2: [Job(m, r) for m in MODELS for r in REMATS] + [Job("gpt", "except_last", "1f1b")]
    + [Job("gpt", r, "zb-h1") for r in ("never", "always")]
    + [Job("gpt", "never", "zb-v"), Job("gpt", "always", "interleaved-1f1b"),
       Job("unet", "except_last", "zb-v")],
    3: [Job(m, r) for m in ("gpt", "unet", "branchy") for r in REMATS]
    + [Job("gpt", "except_last", "1f1b"), Job("gpt", "always", "zb-h1"),
       Job("gpt", "always", "zb-v"), Job("branchy", "except_last", "interleaved-1f1b"),
       Job("gpt", "except_last", "dualpipev")],
}
# Three ranks (skips across two boundaries, the tied embedding on the first and last rank) are
# the slow tier: one more group of processes.
CASES = [pytest.param(world, job, id=f"world{world}-{job}",
                      marks=[pytest.mark.slow] if world == 3 else [])
         for world, jobs in JOBS.items() for job in jobs]


# -- what every process builds (the parent too, for the reference) -----------------------------


def make_case(name: str) -> tuple[torch.nn.Module, tuple, dict, torch.Tensor]:
    model, inputs, kwargs = load_model(name, deterministic=True)
    return model, inputs, kwargs, importlib.import_module(f"fxpipe.models.{name}").target(inputs)


# -- the worker process -------------------------------------------------------------------------


def _run_job(job: Job, world: int) -> dict[str, Any]:
    model, inputs, kwargs, target = make_case(job.model)
    torch.manual_seed(0)
    stages = world * default_stages_per_rank(job.schedule)
    program = fxpipe.compile(model, inputs, example_kwargs=kwargs, stages=stages, chunks=CHUNKS,
                             remat=job.remat, schedule=job.schedule, profile=PROFILE)
    params = dict(model.named_parameters(remove_duplicate=False))
    own = {id(p) for p in program.parameters()}
    keys = list(program.state_dict())
    optimizer = torch.optim.SGD(program.parameters(), **SGD)
    losses, grads = [], {}
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        losses.append(program.step(*inputs, target=target, **kwargs))
        if step == 0:
            grads = {k: None if params[k].grad is None else params[k].grad.clone()
                     for k in keys if k in params}
        optimizer.step()
    try:
        copy.deepcopy(program)
        refused = ""
    except fxpipe.FxPipeError as e:
        refused = f"{type(e).__name__}: {e}"
    return {
        "copy_refused": refused,  # a rank's program holds process groups: not copied
        "losses": losses,
        "grads": grads,  # after step 1, of every parameter in this rank's state_dict
        "state": {k: v.clone() for k, v in program.state_dict().items()},  # after step 3
        "parameters": sorted(n for n, p in params.items() if id(p) in own),
    }


def _dumps(obj: Any) -> bytes:
    # Plain bytes through the queue: tensors pickled by torch.multiprocessing would move to
    # shared memory and need the sender alive when the parent reads them.
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _worker(rank: int, world: int, port: int, jobs: list[Job], results: Any) -> None:
    job = None
    try:
        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        for job in jobs:
            results.put((rank, tuple(job), "ok", _dumps(_run_job(job, world))))
        job = None
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, None, "done", b""))
    except BaseException:  # noqa: BLE001 - report anything; the parent stops the other ranks
        results.put((rank, None if job is None else tuple(job), "error",
                     traceback.format_exc().encode()))


# -- the parent: start one group per world size, collect, compare ------------------------------


class WorldResults:
    """Per configuration, what each rank sent back; or why nothing came."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.by_job: dict[Job, dict[int, dict[str, Any]]] = {}
        self.errors: list[str] = []

    def get(self, job: Job) -> list[dict[str, Any]]:
        ranks = self.by_job.get(job, {})
        if len(ranks) != self.world:
            problems = "\n".join(self.errors) or "no error reported (did the workers hang?)"
            pytest.fail(f"world {self.world}, {job}: results from ranks {sorted(ranks)} only; "
                        f"worker errors:\n{problems}")
        return [ranks[r] for r in range(self.world)]


def _run_world(world: int, jobs: list[Job]) -> WorldResults:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(rank, world, port, jobs, results), daemon=True)
             for rank in range(world)]
    for p in procs:
        p.start()
    out = WorldResults(world)
    done: set[int] = set()
    deadline = time.monotonic() + WORLD_TIMEOUT_S
    try:
        while len(done) < world and time.monotonic() < deadline:
            try:
                rank, job, status, payload = results.get(timeout=2)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and not p.is_alive()]
                if dead:
                    out.errors.append(f"ranks {dead} exited without reporting")
                    break
                continue
            if status == "ok":
                out.by_job.setdefault(Job(*job), {})[rank] = torch.load(io.BytesIO(payload))
            elif status == "done":
                done.add(rank)
            else:
                out.errors.append(f"rank {rank} failed in {Job(*job) if job else 'setup'}:\n"
                                  f"{payload.decode()}")
                break  # the other ranks wait for this one in vain: stop them below
        else:
            if len(done) < world:
                out.errors.append(f"timed out after {WORLD_TIMEOUT_S} s")
    finally:
        for p in procs:
            p.join(timeout=10 if len(done) == world else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return out


@pytest.fixture(scope="module")
def world_results() -> Any:
    cache: dict[int, WorldResults] = {}

    def get(world: int) -> WorldResults:
        if world not in cache:
            cache[world] = _run_world(world, JOBS[world])
        return cache[world]

    return get


# -- the reference: the plain model, trained the same way --------------------------------------


@functools.cache
def reference(name: str) -> dict[str, Any]:
    model, inputs, kwargs, target = make_case(name)
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), **SGD)
    losses, grads = [], {}
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = default_loss(model(*inputs, **kwargs), target)
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            grads = {n: None if p.grad is None else p.grad.clone()  # branchy's aux_head: None
                     for n, p in model.named_parameters(remove_duplicate=False)}
        optimizer.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "grads": grads, "state": state}


def _as_tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# -- the tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "job"), CASES)
def test_first_step_loss_and_every_gradient_match_the_model(world_results, world, job):
    ranks = world_results(world).get(job)
    expected = reference(job.model)
    torch.testing.assert_close(_as_tensor([ranks[0]["losses"][0]]),
                               _as_tensor([expected["losses"][0]]))
    seen = set()
    for rank, result in enumerate(ranks):
        missing = sorted(k for k, g in result["grads"].items()
                         if g is None and expected["grads"][k] is not None)
        assert not missing, f"rank {rank}: parameters without a gradient: {missing}"
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, expected["grads"][name],
                                       msg=lambda m, n=name, r=rank: f"rank {r}, grad of {n}: {m}")
        seen.update(result["grads"])
    assert seen == set(expected["grads"])  # every parameter is on some rank


@pytest.mark.parametrize(("world", "job"), CASES)
def test_step_returns_the_same_loss_on_every_rank_and_matches_the_model(world_results, world,
                                                                         job):
    ranks = world_results(world).get(job)
    losses = [r["losses"] for r in ranks]
    assert all(ls == losses[0] for ls in losses), losses  # identical, not merely close
    torch.testing.assert_close(_as_tensor(losses[0]), _as_tensor(reference(job.model)["losses"]))
    assert losses[0][-1] < losses[0][0]  # it really trained


@pytest.mark.parametrize(("world", "job"), CASES)
def test_parameters_after_three_sgd_steps_match_the_model(world_results, world, job):
    ranks = world_results(world).get(job)
    expected = reference(job.model)["state"]
    for rank, result in enumerate(ranks):
        for key, value in result["state"].items():
            torch.testing.assert_close(value, expected[key],
                                       msg=lambda m, k=key, r=rank: f"rank {r}, {k}: {m}")


@pytest.mark.parametrize(("world", "job"), CASES)
def test_state_dicts_of_the_ranks_together_hold_every_model_key(world_results, world, job):
    ranks = world_results(world).get(job)
    held = set().union(*(r["state"] for r in ranks))
    assert sorted(held) == sorted(reference(job.model)["state"])


@pytest.mark.parametrize(("world", "job"), CASES)
def test_a_ranks_program_is_not_deep_copied_and_says_why(world_results, world, job):
    for r in world_results(world).get(job):
        assert r["copy_refused"].startswith("ConfigError"), r["copy_refused"]
        assert "process groups cannot be copied" in r["copy_refused"]
        assert "compile it on every rank" in r["copy_refused"]


@pytest.mark.parametrize(("world", "job"), CASES)
def test_each_rank_holds_and_optimizes_only_its_own_stage(world_results, world, job):
    ranks = world_results(world).get(job)
    model = make_case(job.model)[0]
    tied = {n for n, p in model.named_parameters(remove_duplicate=False)
            if any(q is p and m != n for m, q in model.named_parameters(remove_duplicate=False))}
    for rank, result in enumerate(ranks):
        # program.parameters() on a rank are the parameters its state_dict names
        params = set(result["parameters"])
        assert params == set(result["grads"]), f"rank {rank}"
        assert params < set(dict(model.named_parameters(remove_duplicate=False))), f"rank {rank}"
    for a in range(world):
        for b in range(a + 1, world):
            shared = set(ranks[a]["state"]) & set(ranks[b]["state"])
            assert shared <= tied, f"ranks {a} and {b} both hold {sorted(shared - tied)}"


@pytest.mark.slow
@pytest.mark.parametrize("job", [j for j in JOBS[3] if j.model == "gpt"
                                 and j.schedule not in ("zb-v", "dualpipev")], ids=str)
def test_gpt_tied_embedding_on_first_and_last_rank_trains_like_the_model(world_results, job):
    ranks = world_results(3).get(job)
    tied = ("wte.weight", "lm_head.weight")
    assert [all(k in r["state"] for k in tied) for r in ranks] == [True, False, True]
    assert not any(k in ranks[1]["state"] for k in tied)
    expected = reference("gpt")
    for rank in (0, 2):
        # both halves of the tied gradient (embedding on rank 0, head on rank 2) are summed
        for key in tied:
            torch.testing.assert_close(ranks[rank]["grads"][key], expected["grads"][key])
            torch.testing.assert_close(ranks[rank]["state"][key], expected["state"][key])
    assert torch.equal(ranks[0]["state"]["wte.weight"], ranks[2]["state"]["wte.weight"])


@pytest.mark.parametrize(("world", "schedule"), [
    (2, "zb-v"), pytest.param(3, "zb-v", marks=pytest.mark.slow),
    pytest.param(3, "dualpipev", marks=pytest.mark.slow)])
def test_the_v_holds_the_tied_embedding_and_head_on_rank_0_as_one_parameter(world_results, world,
                                                                            schedule):
    ranks = world_results(world).get(next(j for j in JOBS[world] if j.schedule == schedule
                                          and j.model == "gpt"))
    tied = ("wte.weight", "lm_head.weight")
    assert [all(k in r["state"] for k in tied) for r in ranks] == [True] + [False] * (world - 1)
    # rank 0 trains the model's own Parameter under both names; had its two stages held a copy
    # each, each copy would get half the gradient below
    assert all(k in ranks[0]["parameters"] for k in tied)
    expected = reference("gpt")
    for key in tied:
        torch.testing.assert_close(ranks[0]["grads"][key], expected["grads"][key])
        torch.testing.assert_close(ranks[0]["state"][key], expected["state"][key])

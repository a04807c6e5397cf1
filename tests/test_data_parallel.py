"""Data parallel x pipeline parallel: 2 replicas x 2 stages on 4 gloo processes (127.0.0.1)."""
from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fxpipe
from fxpipe.errors import ConfigError
from fxpipe.losses import default_loss
from fxpipe.runtime.program.torchrun import free_port

pytestmark = pytest.mark.distributed

CASES = {  # name -> (model module, build config)
    "mlp": ("mlp", {}),
    "gpt_tied": ("gpt", {"dropout": 0.0, "batch": 8}),
}
STEPS = 3
LR = 0.05
# gradient averaging: in 4 KiB buckets during the last backward (several buckets per stage, so
# their order across replicas matters), or after the backward; under ZB-H1 the last backward is
# the last weight-gradient pass
BUCKET_MB = {"overlapped": (4 / 1024, "gpipe"), "after_backward": (0, "gpipe"),
             "overlapped_zb-h1": (4 / 1024, "zb-h1")}


def _build(name: str):
    import importlib

    module, config = CASES[name]
    mod = importlib.import_module(f"fxpipe.models.{module}")
    torch.manual_seed(0)
    model, inputs = mod.build(**config)
    return model, inputs, mod.target(inputs, **config)


def _worker(rank: int, world: int, port: int, queue) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        results = {}
        for name in CASES:
            for mode, (bucket_mb, schedule) in BUCKET_MB.items():
                model, inputs, target = _build(name)
                program = fxpipe.compile(model, inputs, stages=2, chunks=2, profile="a100",
                                         dp_bucket_mb=bucket_mb, schedule=schedule)
                optimizer = torch.optim.SGD(program.parameters(), lr=LR)
                losses = []
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    for _ in range(STEPS):
                        losses.append(program.step(*inputs, target=target))
                        optimizer.step()
                        optimizer.zero_grad()
                averager = program._rank.executor.averager
                results[name, mode] = {
                    "losses": losses, "state": program.state_dict(),
                    "hook_warnings": [str(w.message) for w in caught if "hook" in str(w.message)],
                    "report": program.report().text(),
                    "buckets": len(averager.buckets) if averager else 0,
                    "overlapped": averager.overlapped if averager else 0}
        results["freezing"] = _freezing_steps(fxpipe.compile, rank)
        results["unused_head"] = _unused_head_steps(fxpipe.compile, rank)
        results["presence"] = _averaged_where_present(rank, world)
        results["sparse"] = _sparse_refusal(world)
        dist.destroy_process_group()
        queue.put((rank, _bytes(results)))  # tensors as bytes: shared memory dies with the child
    except Exception:  # noqa: BLE001 - sent to the parent
        queue.put((rank, traceback.format_exc()))


def _freezing_steps(compile_fn, rank: int | None = None) -> dict:
    """The tied GPT trained by SGD with weight decay while its user freezes and unfreezes
    parameters: blocks.0 frozen when compiled and unfrozen after the first step, then the tied
    embedding (wte and lm_head) and blocks.1 frozen. A frozen parameter must get no gradient
    (a zero one would have weight decay move it) and an unfrozen one its replicas' average.
    `compile_fn`: fxpipe.compile, or the identity for the plain model."""
    model, inputs, target = _build("gpt_tied")
    model.blocks[0].requires_grad_(False)
    program = compile_fn(model, inputs, stages=2, chunks=2, profile="a100",
                         dp_bucket_mb=4 / 1024)
    optimizer = torch.optim.SGD(program.parameters(), lr=LR, momentum=0.9, weight_decay=0.5)
    losses = []
    for step in range(STEPS):
        if rank is None:
            loss = default_loss(model(*inputs), target)
            loss.backward()
            losses.append(float(loss.detach()))
        else:
            losses.append(program.step(*inputs, target=target))
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            model.blocks[0].requires_grad_(True)
            model.lm_head.weight.requires_grad_(False)  # wte.weight: the same tensor
            model.blocks[1].requires_grad_(False)
    return {"losses": losses, "state": program.state_dict()}


class _TwoHeads(torch.nn.Module):
    """A trunk with heads the training loss does not use (as a pretraining model's head that a
    fine-tuning loss ignores), one on the trunk and one on the input (on the first stage, its
    output sent to the last): their parameters get no gradient in the plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.early = torch.nn.Linear(6, 2)
        self.trunk = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(),
                                         torch.nn.Linear(16, 16), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 3)
        self.aux = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        e = self.early(x)
        h = self.trunk(x)
        return self.head(h), self.aux(h), e


def _first_output_mse(outputs, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(outputs[0], target)


def _unused_head_steps(compile_fn, rank: int | None = None) -> dict:
    """_TwoHeads trained by AdamW with weight decay on a loss of its first head only: the
    second head must keep no gradient on every replica, so that the optimizer leaves it as
    the plain model's leaves it."""
    torch.manual_seed(0)
    model = _TwoHeads()
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    program = compile_fn(model, (x,), stages=2, chunks=2, profile="a100", dp_bucket_mb=4 / 1024,
                         split_points=["trunk.2"])
    optimizer = torch.optim.AdamW(program.parameters(), lr=LR, weight_decay=0.5)
    losses = []
    for _ in range(STEPS):
        if rank is None:
            loss = _first_output_mse(model(x), y)
            loss.backward()
            losses.append(float(loss.detach()))
        else:
            losses.append(program.step(x, target=y, loss_fn=_first_output_mse))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "state": program.state_dict()}


def _averaged_where_present(rank: int, world: int) -> dict:
    """Gradients averaged over all `world` ranks, bucketed and one by one, where only ranks 0
    and 1 hold one for `some` and no rank holds one for `none`."""
    from fxpipe.runtime.communication.overlap import ReplicaAverager, average_present

    def params() -> list[torch.nn.Parameter]:
        every, some, none = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
        every.grad = torch.full((3,), float(rank))
        if rank < 2:
            some.grad = torch.full((3,), 1.0 + rank)
        return [every, some, none]

    bucketed = params()
    averager = ReplicaAverager(bucketed, None, world, bucket_bytes=1 << 20)
    averager.finish()
    averager.close()
    single = params()
    for param in single:
        average_present(param, None, world)
    return {kind: [p.grad for p in group]
            for kind, group in (("bucketed", bucketed), ("single", single))}


def _sparse_refusal(world: int) -> str:
    """What averaging a sparse gradient (nn.Embedding(sparse=True)) over replicas raises."""
    from fxpipe.runtime.communication.overlap import average_present

    table = torch.nn.Parameter(torch.zeros(5, 3))
    table.grad = torch.sparse_coo_tensor([[0, 2]], torch.ones(2, 3), (5, 3))
    try:
        average_present(table, None, world)
    except ConfigError as e:
        return str(e)
    return "averaged"


def _bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def two_by_two():
    world = 4
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, value = queue.get(timeout=600)
            if isinstance(value, str):
                pytest.fail(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=True)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results


def _reference(name: str):
    model, inputs, target = _build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = default_loss(model(*inputs), target)  # one process, the whole global batch
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model.state_dict()


@pytest.mark.parametrize("mode", list(BUCKET_MB))
@pytest.mark.parametrize("name", list(CASES))
def test_two_replicas_of_two_stages_train_like_one_process(two_by_two, name, mode):
    losses, state = _reference(name)
    for rank, results in two_by_two.items():
        assert results[name, mode]["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6), rank
    merged = {}
    for results in two_by_two.values():
        merged.update(results[name, mode]["state"])
    assert set(merged) == set(state)
    for key, value in state.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _assert_trained_like(two_by_two: dict, case: str, want: dict) -> None:
    """Every rank's losses of `case` are the plain model's, and the ranks' states together
    are its state."""
    merged = {}
    for rank, results in two_by_two.items():
        got = results[case]
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6), rank
        merged.update(got["state"])
    assert set(merged) == set(want["state"])
    for key, value in want["state"].items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_the_replica_averagers_own_hooks_are_not_warned_of(two_by_two):
    for rank, results in two_by_two.items():
        for name in CASES:
            for mode in BUCKET_MB:
                assert results[name, mode]["hook_warnings"] == [], (rank, name, mode)
    assert any(results[name, mode]["buckets"] for results in two_by_two.values()
               for name in CASES for mode in BUCKET_MB)  # the averager's hooks were on


def test_parameters_frozen_and_unfrozen_between_steps_train_like_one_process(two_by_two):
    _assert_trained_like(two_by_two, "freezing", _freezing_steps(lambda model, *a, **k: model))


def test_a_head_no_loss_reaches_keeps_no_gradient_and_trains_like_one_process(two_by_two):
    # aux.* unchanged by AdamW's weight decay, as in the plain model
    _assert_trained_like(two_by_two, "unused_head",
                         _unused_head_steps(lambda model, *a, **k: model))


def test_a_gradient_some_replicas_lack_is_averaged_and_one_all_lack_stays_none(two_by_two):
    for rank, results in two_by_two.items():
        for kind, (every, some, none) in results["presence"].items():
            torch.testing.assert_close(every, torch.full((3,), 1.5), msg=f"{kind} {rank}")
            # ranks 0 and 1 hold 1 and 2, ranks 2 and 3 count as zeros
            torch.testing.assert_close(some, torch.full((3,), 0.75), msg=f"{kind} {rank}")
            assert none is None, (kind, rank)


def test_a_sparse_gradient_under_replicas_is_refused_with_a_hint(two_by_two):
    for rank, results in two_by_two.items():
        assert "a parameter of shape (5, 3) has a sparse gradient" in results["sparse"], rank
        assert "hint: use sparse=False under replicas" in results["sparse"], rank


def test_replicas_hold_identical_copies_of_each_stage(two_by_two):
    for key in (k for k in two_by_two[0] if k not in ("presence", "sparse")):  # trained ones
        for stage in (0, 1):
            a, b = two_by_two[stage][key]["state"], two_by_two[2 + stage][key]["state"]
            assert a.keys() == b.keys()
            for name in a:
                assert torch.equal(a[name], b[name]), (key, name)


def test_small_buckets_are_averaged_while_the_last_backward_runs(two_by_two):
    for rank, results in two_by_two.items():
        for name in CASES:
            for mode in ("overlapped", "overlapped_zb-h1"):
                overlapped = results[name, mode]
                assert overlapped["buckets"] > 2, (rank, name, mode)
                # every bucket whose gradients the last backward produced left before it ended
                assert overlapped["overlapped"] == overlapped["buckets"], (rank, name, mode)
            assert results[name, "after_backward"]["buckets"] == 0


def test_report_shows_the_mesh_and_both_kinds_of_traffic(two_by_two):
    text = two_by_two[0]["gpt_tied", "overlapped"]["report"]
    assert "2 replica(s) x 2 ranks" in text
    assert "rank 3 = replica 1 stage 1" in text
    assert "point-to-point" in text and "data-parallel all-reduce" in text
    assert "tied-weight all-reduce" in text


def _bad_world(rank: int, world: int, port: int, queue) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        model, inputs, target = _build("mlp")
        try:
            fxpipe.compile(model, inputs, stages=2, chunks=2, profile="a100")
            queue.put((rank, "no error"))
        except ConfigError as e:
            queue.put((rank, str(e)))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        queue.put((rank, traceback.format_exc()))


@pytest.mark.slow
def test_world_size_that_is_not_a_multiple_of_the_stages_is_a_clear_error():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_bad_world, args=(r, 3, port, queue)) for r in range(3)]
    for p in procs:
        p.start()
    messages = [queue.get(timeout=300)[1] for _ in procs]
    for p in procs:
        p.join(timeout=30)
    for message in messages:
        assert "world size 3 is not a multiple of the number of stages (2)" in message
        assert "hint:" in message


@pytest.fixture(scope="module")
def written_gpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("program")
    model, inputs, target = _build("gpt_tied")
    program = fxpipe.compile(copy.deepcopy(model), inputs, stages=2, chunks=2, profile="a100")
    program.write(str(folder), target=target)
    return folder


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
def test_written_program_runs_as_two_by_two_under_fxpipe_run(written_gpt):
    result = _run([sys.executable, "-m", "fxpipe", "run", str(written_gpt), "--nproc", "4",
                   "--port", str(free_port()), "--steps", "3", "--verify"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verify: OK" in result.stdout


@pytest.mark.slow
def test_written_program_runs_under_torchrun_with_four_processes(written_gpt):
    result = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                   "--master-port", str(free_port()), str(written_gpt / "program.py"),
                   "--steps", "2", "--verify"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step 1 loss" in result.stdout and "verify: OK" in result.stdout


def test_buckets_group_consecutive_parameters_up_to_the_size_and_never_mix_dtypes():
    from fxpipe.runtime.communication.overlap import buckets

    f32, f16 = torch.float32, torch.float16
    assert buckets([(4, f32), (4, f32), (4, f32)], 8) == [[0, 1], [2]]
    assert buckets([(16, f32), (4, f32)], 8) == [[0], [1]]  # a large one alone
    assert buckets([(4, f32), (2, f16), (2, f16)], 100) == [[0], [1, 2]]
    assert buckets([], 8) == []


class _SplitDependent(torch.nn.Module):
    """BatchNorm in training and dropout: each replica's step depends on its share."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.drop = torch.nn.Dropout(0.2)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.bn(self.fc(x)))))


@pytest.fixture(scope="module")
def written_split_dependent(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bn_dropout")
    torch.manual_seed(0)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    program = fxpipe.compile(_SplitDependent(), (x,), stages=2, chunks=2)
    program.write(str(folder), target=y, loss_fn="mse", reference_steps=3)
    return folder


def test_a_split_dependent_program_records_what_replicas_compute(written_split_dependent):
    import json

    from fxpipe.runtime.launch import _reference
    from fxpipe.runtime.program.spec import ProgramSpec
    data = json.loads((written_split_dependent / "program.json").read_text())
    assert data["split_dependent"] is True
    # 8 examples in 2 micro-batches: 4 replicas would normalise single examples
    assert sorted(data["replica_reference_losses"]) == ["2"]
    spec = ProgramSpec.from_json(data)
    assert spec.replica_reference_losses[2] != spec.reference_losses  # other micro-batches
    assert _reference(spec, 2)[1].endswith("the 2 replicas' shares of the batch")
    assert _reference(spec, 3) is None  # not recorded: refused, never compared with another


@pytest.mark.slow
def test_verify_with_replicas_compares_with_what_the_replicas_compute(written_split_dependent):
    result = _run([sys.executable, "-m", "fxpipe", "run", str(written_split_dependent),
                   "--nproc", "4", "--port", str(free_port()), "--steps", "3", "--verify"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verify: OK" in result.stdout and "2 replicas' shares" in result.stdout

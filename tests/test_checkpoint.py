"""Checkpoints: atomic, in the model's names, and resuming gives exactly the uninterrupted run."""
from __future__ import annotations

import copy
import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import fxpipe
from fxpipe.errors import CheckpointError, ConfigError
from fxpipe.models import gpt, mlp
from fxpipe.runtime.program.torchrun import free_port
from fxpipe.storage.checkpoint import save_shard
from fxpipe.storage.structure import Structure


def _setup(stages: int, model):
    program = fxpipe.compile(copy.deepcopy(model), (X,), stages=stages, chunks=4, profile="a100")
    return program, torch.optim.Adam(program.parameters(), lr=1e-3)


def _train(program, optimizer, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(program.step(X, target=Y))
        optimizer.step()
        optimizer.zero_grad()
    return losses


torch.manual_seed(0)
MODEL, (X,) = gpt.build(dropout=0.0)
Y = gpt.target((X,))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-for-bit comparisons need a fixed reduction order
    yield
    torch.set_num_threads(threads)


def test_resuming_gives_exactly_the_losses_of_an_uninterrupted_run(tmp_path):
    program, optimizer = _setup(2, MODEL)
    uninterrupted = _train(program, optimizer, 6)
    program, optimizer = _setup(2, MODEL)
    first = _train(program, optimizer, 3)
    program.save(str(tmp_path / "ckpt"), optimizer=optimizer, step=3)
    program, optimizer = _setup(2, MODEL)  # a fresh process would start like this
    assert program.load(str(tmp_path / "ckpt"), optimizer=optimizer) == 3
    assert first + _train(program, optimizer, 3) == uninterrupted


def test_resuming_with_dropout_draws_the_masks_the_uninterrupted_run_draws(tmp_path):
    model, _ = gpt.build(dropout=0.2)
    torch.manual_seed(1)
    program, optimizer = _setup(2, model)
    uninterrupted = _train(program, optimizer, 4)
    torch.manual_seed(1)
    program, optimizer = _setup(2, model)
    first = _train(program, optimizer, 2)
    program.save(str(tmp_path / "ckpt"), optimizer=optimizer, step=2)
    torch.manual_seed(2)  # a fresh process's generator is elsewhere
    program, optimizer = _setup(2, model)
    program.load(str(tmp_path / "ckpt"), optimizer=optimizer)
    assert first + _train(program, optimizer, 2) == uninterrupted
    torch.manual_seed(2)
    program.load(str(tmp_path / "ckpt"), optimizer=optimizer, random_state=False)
    assert _train(program, optimizer, 2) != uninterrupted[2:]  # the masks differ


def test_a_random_state_saved_by_another_number_of_processes_is_not_restored():
    from fxpipe.storage.random_state import random_state, restore_random_state

    saved = [random_state(), random_state()]
    torch.manual_seed(3)
    before = torch.get_rng_state()
    with pytest.warns(UserWarning, match=r"saved by 2 process\(es\) and is loaded by 1: not "
                                         r"restored"):
        assert not restore_random_state(saved, 0, 1, "ckpt")
    assert torch.equal(torch.get_rng_state(), before)
    assert restore_random_state(saved[:1], 0, 1, "ckpt")
    assert torch.equal(torch.get_rng_state(), saved[0]["cpu"])


def test_a_checkpoint_resumes_with_another_number_of_stages(tmp_path):
    program, optimizer = _setup(2, MODEL)
    uninterrupted = _train(program, optimizer, 4)
    program, optimizer = _setup(2, MODEL)
    first = _train(program, optimizer, 2)
    program.save(str(tmp_path / "ckpt"), optimizer=optimizer, step=2)
    program, optimizer = _setup(3, MODEL)
    program.load(str(tmp_path / "ckpt"), optimizer=optimizer)
    second = _train(program, optimizer, 2)
    assert first + second == pytest.approx(uninterrupted, rel=1e-6)


def test_a_checkpoint_loads_into_the_plain_model(tmp_path):
    program, optimizer = _setup(2, MODEL)
    _train(program, optimizer, 2)
    program.save(str(tmp_path / "ckpt"))
    plain = copy.deepcopy(MODEL)
    plain.load_state_dict(fxpipe.load_checkpoint(str(tmp_path / "ckpt"))["model"])  # strict
    torch.testing.assert_close(plain(X), program(X))


def test_writes_are_atomic_and_loading_is_weights_only(tmp_path, monkeypatch):
    program, _ = _setup(2, MODEL)
    target = tmp_path / "ckpt"
    program.save(str(target))
    before = sorted(os.listdir(target))
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    fxpipe.load_checkpoint(str(target))
    assert calls and all(calls)  # every file is read with weights_only=True

    def crash(obj, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        program.save(str(target))
    assert sorted(os.listdir(target)) == before  # no temporary left behind, nothing replaced
    monkeypatch.undo()
    fxpipe.load_checkpoint(str(target))  # the old checkpoint is intact


def test_an_incomplete_checkpoint_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint.json"):
        fxpipe.load_checkpoint(str(tmp_path / "ckpt"))
    program, _ = _setup(2, MODEL)
    program.save(str(tmp_path / "ckpt2"))
    meta = json.loads((tmp_path / "ckpt2" / "checkpoint.json").read_text())
    meta["shards"].append({**meta["shards"][0], "file": "shard-00001.pt"})
    (tmp_path / "ckpt2" / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="lacks save-000001/shard-00001.pt"):
        fxpipe.load_checkpoint(str(tmp_path / "ckpt2"))


def _losses(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    return [line.split(" (")[0] for line in result.stdout.splitlines() if line.startswith("step ")]


@pytest.mark.slow
@pytest.mark.distributed
def test_distributed_resume_gives_exactly_the_losses_of_an_uninterrupted_run(tmp_path):
    program = fxpipe.compile(copy.deepcopy(MODEL), (X,), stages=2, chunks=4, profile="a100")
    program.write(str(tmp_path / "prog"), target=Y, reference_steps=0)
    script = str(tmp_path / "prog" / "program.py")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                               "2", "--master-port", str(free_port()), script, *args],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})

    whole = _losses(run("--steps", "4"))
    first = _losses(run("--steps", "2", "--save", str(tmp_path / "ckpt")))
    second = _losses(run("--steps", "2", "--resume", str(tmp_path / "ckpt")))
    assert first + second == whole
    assert second[0].startswith("step 2 ")


_STOPPING_DATA = """import os

import torch


def batches():
    generator = torch.Generator().manual_seed(7)
    for number in range(6):
        if str(number) == os.environ.get("FXPIPE_TEST_STOP_AT"):
            raise RuntimeError("the run stops here")
        yield torch.randn({x}, generator=generator), torch.randn({y}, generator=generator)
"""


def test_a_run_stopped_midway_resumes_from_its_last_periodic_save_as_one_run(tmp_path,
                                                                             monkeypatch, capsys):
    """program.py --save-every: a run that dies in step 3 left the save of step 1; resuming it
    with --data skips the two batches trained on and gives the uninterrupted run's losses."""
    from fxpipe.runtime import launch
    model, (x,) = mlp.build()
    target = torch.randn(model(x).shape)
    folder = tmp_path / "program"
    fxpipe.compile(model, (x,), stages=2, chunks=2).write(str(folder), target=target,
                                                           loss_fn="mse", reference_steps=0)
    (tmp_path / "fxpipe_stopping_data.py").write_text(
        _STOPPING_DATA.format(x=tuple(x.shape), y=tuple(target.shape)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "fxpipe_stopping_data", raising=False)
    data, ckpt = ["--data", "fxpipe_stopping_data:batches"], str(tmp_path / "ckpt")

    def steps(out: str) -> list[str]:
        return [line.split(" (")[0] for line in out.splitlines() if line.startswith("step ")]

    assert launch.main(folder, [*data, "--steps", "6"]) == 0
    whole = steps(capsys.readouterr().out)
    monkeypatch.setenv("FXPIPE_TEST_STOP_AT", "3")
    with pytest.raises(RuntimeError, match="the run stops here"):
        launch.main(folder, [*data, "--steps", "6", "--save", ckpt, "--save-every", "2"])
    out = capsys.readouterr().out
    assert steps(out) == whole[:3]
    assert f"saved the model and optimizer after step 1 to {ckpt}" in out
    monkeypatch.delenv("FXPIPE_TEST_STOP_AT")
    assert launch.main(folder, [*data, "--steps", "4", "--resume", ckpt]) == 0
    out = capsys.readouterr().out
    assert "skipped its first 2 batches" in out
    assert steps(out) == whole[2:]
    assert len(whole) == 6 and len(set(whole)) == 6  # six steps, each of its own batch


@pytest.mark.parametrize("argv, message", [
    (["--save-every", "2"], "--save-every 2 has no folder to save to"),
    (["--save", "ckpt", "--save-every", "0"], "--save-every 0 is no number of steps"),
])
def test_save_every_without_a_folder_or_steps_is_refused(argv, message):
    from fxpipe.runtime.program.arguments import _check_values, program_parser
    with pytest.raises(ConfigError, match=message):
        _check_values(program_parser(None).parse_args(["--lr", "0.1", *argv]))


def test_saves_every_n_steps_and_after_the_last_once(tmp_path, capsys):
    from fxpipe.runtime import launch
    program, _ = _setup(2, MODEL)
    program.write(str(tmp_path / "prog"), target=Y, reference_steps=0)
    ckpt = str(tmp_path / "ckpt")
    assert launch.main(tmp_path / "prog", ["--steps", "5", "--save", ckpt,
                                           "--save-every", "2"]) == 0
    saves = [line for line in capsys.readouterr().out.splitlines() if line.startswith("saved ")]
    assert [s.split(" to ")[0] for s in saves] == [
        f"saved the model and optimizer after step {i}" for i in (1, 3, 4)]
    assert fxpipe.load_checkpoint(ckpt)["step"] == 5
    assert launch.main(tmp_path / "prog", ["--steps", "4", "--save", ckpt, "--resume", ckpt,
                                           "--save-every", "2"]) == 0
    saves = [line for line in capsys.readouterr().out.splitlines() if line.startswith("saved ")]
    assert [s.split(" to ")[0] for s in saves] == [  # every second step counted from 0
        f"saved the model and optimizer after step {i}" for i in (5, 7, 8)]


def test_an_fp16_run_resumes_with_its_loss_scale_as_one_run(tmp_path, capsys):
    """A resume that started GradScaler's scale afresh would skip again the steps that
    overflowed before the save: program.py saves and restores the scale."""
    from fxpipe.runtime import launch
    torch.manual_seed(0)
    model, (x,) = mlp.build()
    target = 20 * torch.randn(model(x).shape)  # large enough for early steps to overflow
    folder = tmp_path / "program"
    fxpipe.compile(model, (x,), stages=2, chunks=2, autocast="fp16", profile="a100").write(
        str(folder), target=target, loss_fn="mse", reference_steps=0)

    def losses(*argv: str) -> list[str]:
        assert launch.main(folder, list(argv)) == 0
        out = capsys.readouterr().out
        return [line.split(" (")[0] for line in out.splitlines() if line.startswith("step ")]

    whole = losses("--steps", "6")
    ckpt = str(tmp_path / "ckpt")
    assert losses("--steps", "3", "--save", ckpt) + losses("--steps", "3", "--resume", ckpt) \
        == whole
    values = [line.split(" loss ")[1] for line in whole]
    assert values[0] == values[1] and len(set(values[3:])) == 3  # skipped early, learned later


def test_program_save_keeps_the_loss_scale_and_a_strict_load_wants_it(tmp_path):
    program, optimizer = _small_program()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.load_state_dict({**scaler.state_dict(), "scale": 256.0, "_growth_tracker": 7})
    program.save(str(tmp_path / "a"), optimizer=optimizer, scaler=scaler)
    restored = torch.amp.GradScaler("cpu")
    program.load(str(tmp_path / "a"), optimizer=optimizer, scaler=restored)
    assert restored.state_dict() == scaler.state_dict()
    program.save(str(tmp_path / "b"), optimizer=optimizer)
    with pytest.raises(CheckpointError, match="holds no GradScaler state"):
        program.load(str(tmp_path / "b"), optimizer=optimizer, scaler=torch.amp.GradScaler("cpu"))
    with pytest.warns(UserWarning, match="holds no GradScaler state"):
        program.load(str(tmp_path / "b"), optimizer=optimizer, scaler=torch.amp.GradScaler("cpu"),
                     strict=False)


def test_two_writes_of_a_program_give_identical_files(tmp_path):
    program, _ = _setup(2, MODEL)
    program.write(str(tmp_path / "a"), target=Y, reference_steps=0)
    program.write(str(tmp_path / "b"), target=Y, reference_steps=0)
    names = sorted(os.listdir(tmp_path / "a"))
    assert "weights.pt" in names and names == sorted(os.listdir(tmp_path / "b"))
    for name in names:  # torch.save embedded the temporary file's name before
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


# -- saves are transactions: a killed save leaves the previous checkpoint or the new one ---------


def _small_program():
    model, (x,) = mlp.build(depth=2, width=16, in_features=8, batch=4)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, profile="a100")
    optimizer = torch.optim.Adam(program.parameters(), lr=1e-3)
    program.step(x, target=torch.zeros(4, dtype=torch.long))
    optimizer.step()  # the optimizer has state to save
    return program, optimizer


def _stamp(program, optimizer, step: int) -> None:
    """Every tensor of the model and of the optimizer's state holds `step`."""
    with torch.no_grad():
        for tensor in [*program.state_dict().values(),
                       *(v for s in optimizer.state.values() for v in s.values())]:
            tensor.fill_(step)


def _stamps(checkpoint) -> set[float]:
    tensors = [*checkpoint["model"].values(),
               *(v for s in checkpoint["optimizer"]["state"].values() for v in s.values())]
    return {float(v) for t in tensors for v in t.flatten().unique()}


def _save_forever(program, optimizer, directory: str, step: int, report: int) -> None:
    """The child of a kill trial: saves steps step, step+1, ... and reports each one done."""
    torch.set_num_threads(1)
    while True:
        _stamp(program, optimizer, step)
        program.save(directory, optimizer=optimizer, step=step)
        os.write(report, f"{step}\n".encode())
        step += 1


def _read_line(fd: int) -> str:
    """One line from a pipe, read byte by byte so that nothing after it is consumed."""
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        assert byte, "the saving child exited before its first save"
        line += byte
    return line.decode().strip()


def _leftovers(directory) -> list[str]:
    meta = json.loads((directory / "checkpoint.json").read_text())
    found = [str(p.relative_to(directory)) for p in directory.rglob("*")]
    complete = {"checkpoint.json", "checkpoint.lock", meta["folder"],
                f"{meta['folder']}/shard-00000.pt"}
    return sorted(set(found) - complete)


def _kill_trials(directory, trials: int, seed: int) -> dict[str, int]:
    """Kills a process that saves in a loop at random moments (SIGKILL from here); after each
    kill the checkpoint must be the last one saved or the one being saved, every tensor of one
    step, and the next save must leave nothing else behind."""
    program, optimizer = _small_program()
    rng = random.Random(seed)
    took = []
    for _ in range(3):
        start = time.perf_counter()
        _stamp(program, optimizer, 0)
        program.save(str(directory), optimizer=optimizer, step=0)
        took.append(time.perf_counter() - start)
    window = 4 * sorted(took)[1]  # kills land within the first few saves, at random moments
    last, figures = 0, {"trials": trials, "torn": 0, "partial_left": 0, "leftovers": 0,
                        "saves": 0}
    for _ in range(trials):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns to pytest
            os.close(read)
            try:
                _save_forever(program, optimizer, str(directory), last + 1, write)
            finally:
                os._exit(1)
        os.close(write)
        first = _read_line(read)  # a fork (and its first save) on a loaded machine is slow:
        time.sleep(rng.uniform(0.0, window))  # the random moment counts from a finished save
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with os.fdopen(read) as f:
            done = [int(line) for line in [first, *f.read().split()]]
        figures["saves"] += len(done)
        previous = done[-1] if done else last
        figures["partial_left"] += bool(_leftovers(directory))
        checkpoint = fxpipe.load_checkpoint(str(directory))  # never refused: one is complete
        assert checkpoint["step"] in (previous, previous + 1), (checkpoint["step"], previous)
        figures["torn"] += _stamps(checkpoint) != {float(checkpoint["step"])}
        last = checkpoint["step"] + 1
        _stamp(program, optimizer, last)
        program.save(str(directory), optimizer=optimizer, step=last)  # the next save cleans up
        figures["leftovers"] += bool(_leftovers(directory))
        assert program.load(str(directory), optimizer=optimizer) == last
    return figures


def test_a_killed_save_leaves_the_previous_or_the_new_checkpoint(tmp_path):
    figures = _kill_trials(tmp_path / "ckpt", trials=10, seed=0)
    assert figures["torn"] == 0 and figures["leftovers"] == 0, figures
    assert figures["partial_left"] > 0, figures  # some kills landed in the middle of a save


@pytest.mark.slow
def test_fifty_killed_saves_leave_no_torn_checkpoint_and_no_leftovers(tmp_path):
    figures = _kill_trials(tmp_path / "ckpt", trials=50, seed=1)
    print("kill trials:", figures)
    assert figures["torn"] == 0 and figures["leftovers"] == 0, figures
    assert figures["partial_left"] > 0, figures


def _two_rank_saves(directory: str, store: str, rank: int, die_at_step: int | None) -> None:
    """A rank of a two-rank job (forked): saves steps 1 and 2, its tensors holding the step."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    structure = Structure.of_state("Toy", {"w0": torch.zeros(3), "w1": torch.zeros(3)})
    for step in (1, 2):
        if step == die_at_step and rank == 1:
            torch.save = lambda *args, **kwargs: os._exit(9)  # dies before its shard is written
        save_shard(directory, {f"w{rank}": torch.full((3,), float(step))}, None, {}, step=step,
                   structure=structure)


def _run_two_ranks(tmp_path, die_at_step: int | None) -> list[int]:
    return _on_two_ranks(lambda directory, store, rank: _two_rank_saves(directory, store, rank,
                                                                        die_at_step), tmp_path)


def _on_two_ranks(fn, tmp_path) -> list[int]:
    """fn(checkpoint folder, store file, rank) in two forked ranks; their exit statuses."""
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                fn(str(tmp_path / "ckpt"), str(tmp_path / "store"), rank)
            except BaseException:  # noqa: BLE001 - the exit status says it
                code = 1
            os._exit(code)
        pids.append(pid)
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]


def _save_where_rank_0_has_no_parameters(directory: str, store: str, rank: int) -> None:
    """Rank 0's stage holds no parameters, so it has no optimizer; rank 1 has an SGD."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    structure = Structure.of_state("Toy", {"w0": torch.zeros(3), "w1": torch.zeros(3)})
    if rank == 0:
        save_shard(directory, {"w0": torch.zeros(3)}, None, {}, step=1, structure=structure)
        return
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    weight.grad = torch.ones(3)
    optimizer.step()  # a momentum buffer to save
    save_shard(directory, {"w1": weight.detach()}, optimizer, {id(weight): "w1"}, step=1,
               structure=structure)


@pytest.mark.distributed
def test_a_checkpoint_keeps_the_optimizer_when_rank_0_has_none(tmp_path):
    from fxpipe.storage.resume import restore_optimizer

    assert _on_two_ranks(_save_where_rank_0_has_no_parameters, tmp_path) == [0, 0]
    checkpoint = fxpipe.load_checkpoint(str(tmp_path / "ckpt"))
    assert checkpoint["optimizer_class"] == "SGD"
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    restore_optimizer(optimizer, checkpoint, {id(weight): "w1"})  # strict: all of it is there
    assert optimizer.state[weight]["momentum_buffer"].tolist() == [1.0] * 3


@pytest.mark.distributed
def test_two_ranks_publish_a_step_only_when_both_shards_are_written(tmp_path):
    assert _run_two_ranks(tmp_path, die_at_step=None) == [0, 0]
    checkpoint = fxpipe.load_checkpoint(str(tmp_path / "ckpt"))
    assert checkpoint["step"] == 2
    assert {k: v.tolist() for k, v in checkpoint["model"].items()} == {"w0": [2.0] * 3,
                                                                       "w1": [2.0] * 3}


@pytest.mark.distributed
def test_a_rank_that_dies_before_its_shard_leaves_the_previous_step(tmp_path):
    assert _run_two_ranks(tmp_path, die_at_step=2) == [1, 9]  # rank 0 raised, rank 1 died
    checkpoint = fxpipe.load_checkpoint(str(tmp_path / "ckpt"))
    assert checkpoint["step"] == 1  # not rank 0's step-2 shard with rank 1's step-1 one
    assert {k: v.tolist() for k, v in checkpoint["model"].items()} == {"w0": [1.0] * 3,
                                                                       "w1": [1.0] * 3}
    assert any(p.name.startswith(".fxpipe-") for p in (tmp_path / "ckpt").iterdir())
    structure = Structure.of_state("Toy", {"w0": torch.zeros(3), "w1": torch.zeros(3)})
    save_shard(str(tmp_path / "ckpt"), {"w0": torch.zeros(3), "w1": torch.zeros(3)}, None, {},
               step=3, structure=structure)  # the next save removes what the failed one left
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "checkpoint.json", "checkpoint.lock", "save-000002"]

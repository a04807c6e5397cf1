"""The rules a first run on GPUs depends on, checked on the CPU: which backend and device a rank
takes (more ranks than GPUs, backend strings), the precision the cost model sizes for under
compile(autocast=...), process groups and hooks across re-installs, optimizer state placed as
torch places it, the reference's random streams and its device, the profile's keys and presets.
Where CUDA matters it is emulated (a fake device count, tensors on the meta device)."""
from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fxpipe
from fxpipe import reference
from fxpipe.errors import ConfigError
from fxpipe.models import mlp
from fxpipe.profile import cache
from fxpipe.profile.presets import spec_of_device
from fxpipe.rebalance import placed_state
from fxpipe.reference import copy_to, microbatched_forward, reference_device
from fxpipe.runtime.communication import backend
from fxpipe.runtime.execution import rank
from fxpipe.runtime.program.torchrun import free_port
from tests.ranks import spawn

# --- backend and device ------------------------------------------------------------------------


@pytest.mark.parametrize("name, cuda, expected", [
    ("nccl", True, True),
    ("gloo", True, False),  # gloo's point-to-point reads host memory
    ("cpu:gloo,cuda:nccl", True, True),
    ("cpu:gloo,cuda:gloo", True, False),
    ("undefined", True, True),  # no backend given: torch picks NCCL for CUDA tensors
    ("undefined", False, False),
    ("cpu:gloo", True, False),
    ("nccl", False, False),
])
def test_which_backend_strings_move_cuda_tensors(name, cuda, expected):
    assert backend.carries_cuda(name, cuda_available=cuda) is expected


@pytest.fixture
def one_gpu(monkeypatch):
    """A node whose torch sees one CUDA device (set_device recorded, not called)."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS_PER_NODE", "SLURM_LOCALID",
                 "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return chosen


def test_more_ranks_than_gpus_train_on_the_cpu_over_gloo_said_in_one_line(one_gpu, capsys,
                                                                          monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert backend.choose_backend(2, 0, gpus=1) == "gloo"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "2 ranks on this node but 1 GPU" in lines[0]
    assert rank.rank_device("gloo", say=False) == torch.device("cpu") and not one_gpu
    monkeypatch.setenv("LOCAL_RANK", "1")  # the other ranks say nothing
    assert backend.choose_backend(2, 1, gpus=1) == "gloo"
    assert capsys.readouterr().err == ""


def test_a_gpu_per_rank_gives_nccl_and_each_rank_its_own_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 4 ranks over 2 nodes of 2 GPUs
    assert backend.choose_backend(4, 3, gpus=2) == "nccl"
    assert backend.choose_backend(2, 0, gpus=0) == "gloo"
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert backend.cuda_index_for(3, 4, gpus=2) == 1


def test_nccl_with_two_ranks_on_one_gpu_is_refused_naming_the_counts(one_gpu, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"2 ranks on this node but 1 GPU.*rank 1"):
        rank.rank_device("nccl")
    assert not one_gpu  # refused before any device was made current


@pytest.mark.parametrize("name", ["cpu:gloo,cuda:nccl", "undefined", "nccl"])
def test_a_user_group_that_moves_cuda_tensors_puts_the_stages_on_the_gpu(one_gpu, monkeypatch,
                                                                        name):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert rank.rank_device(name) == torch.device("cuda", 0)
    assert one_gpu == [0]


def test_a_user_group_on_gloo_keeps_the_cpu_and_says_so_on_a_gpu_node(one_gpu, monkeypatch,
                                                                      capsys):
    monkeypatch.setenv("RANK", "0")
    assert rank.rank_device("cpu:gloo,cuda:gloo") == torch.device("cpu")
    err = capsys.readouterr().err
    assert "'cpu:gloo,cuda:gloo' moves no CUDA tensors" in err and "1 GPU" in err


# --- the precision the cost model sizes for ----------------------------------------------------


def _two_linears() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), torch.randn(8, 64)


def test_compile_autocast_sizes_costs_and_messages_for_its_precision():
    model, x = _two_linears()
    plain = fxpipe.compile(model, (x,), stages=2, chunks=2, profile="h100")
    bf16 = fxpipe.compile(model, (x,), stages=2, chunks=2, profile="h100", autocast="bf16")
    assert plain.built.profile.precision == "fp32"
    assert bf16.built.profile.precision == "bf16"  # 989, not 67 TFLOP/s
    (sent_plain,) = plain.built.stages[0].graph.sends
    (sent_bf16,) = bf16.built.stages[0].graph.sends
    assert sent_plain.value.dtype == torch.float32
    assert sent_bf16.value.dtype == torch.bfloat16  # a linear's output under autocast
    big = 1e12  # FLOPs per kernel: the peak of the curve
    assert bf16.built.profile.rate("matmul").flops.at(big) > \
        10 * plain.built.profile.rate("matmul").flops.at(big)
    assert "bf16[b, 64]" in bf16.built.stages[1].source


def test_balancing_by_measurement_runs_under_the_compiled_autocast(monkeypatch):
    from fxpipe import program_balance as program_module
    seen: list[bool] = []
    measure_local = program_module.measure_local

    def spy(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return measure_local(*args, **kwargs)

    monkeypatch.setattr(program_module, "measure_local", spy)
    model, x = _two_linears()
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, autocast="bf16")
    program.rebalance(steps=1, rounds=1)
    assert seen and all(seen)


# --- process groups and hooks across installs (2 replicas of one stage) -----------------------


def _reinstall_on_ranks(rank_: int, world: int) -> dict:
    model, (x,) = mlp.build()
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (x,), stages=1, chunks=2, profile="a100")
    first = program._rank
    groups = (first.groups.dp, first.groups.device_mesh)
    for _ in range(3):  # as balance rounds, rebalance and load_weights do
        program._install(program.built, program._device)
    now = program._rank
    param = next(model.parameters())
    hooks = len(getattr(param, "_post_accumulate_grad_hooks", None) or {})
    loss = program.step(x)
    shard = x.chunk(world)[rank_]
    out = plain(shard)
    ref = fxpipe.losses.default_loss(out, None)
    ref.backward()
    grads = [p.grad.clone() for p in plain.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g /= world
    return {"same_groups": now.groups.dp is groups[0] and now.groups.device_mesh is groups[1],
            "hooks": hooks, "loss": loss,
            "grad_ok": all(torch.allclose(p.grad, g, atol=1e-6)
                           for p, g in zip(model.parameters(), grads))}


@pytest.mark.distributed
def test_installing_a_cut_again_reuses_the_groups_and_leaves_one_hook_per_parameter():
    for out in spawn(2, __name__, "_reinstall_on_ranks", timeout=60, bound=180):
        assert out["same_groups"], out
        assert out["hooks"] == 1, out  # the averager of the executor in use, not of every one
        assert out["grad_ok"], out


# --- optimizer state that moves between ranks --------------------------------------------------


def test_moved_optimizer_state_is_placed_as_torch_places_a_loaded_one():
    # the meta device stands in for a GPU: a state left on the CPU would show
    param = nn.Parameter(torch.empty(4, 4, device="meta", dtype=torch.bfloat16))
    step, moment = torch.tensor(3.0), torch.randn(4, 4)
    fused = {"fused": True}
    assert placed_state(param, "step", step, fused).device.type == "meta"
    assert placed_state(param, "step", step, fused).dtype == torch.float32
    assert placed_state(param, "step", step, {"capturable": True}).device.type == "meta"
    assert placed_state(param, "step", step, {}).device.type == "cpu"  # as torch keeps it
    placed = placed_state(param, "exp_avg", moment, fused)
    assert (placed.device.type, placed.dtype) == ("meta", torch.bfloat16)
    counts = torch.zeros(4, dtype=torch.long)
    assert placed_state(param, "counts", counts, {}).dtype == torch.long
    assert placed_state(param, "lr", 0.1, {}) == 0.1


# --- the reference ------------------------------------------------------------------------------


def test_the_reference_seeds_the_generator_of_every_device_the_model_draws_on(monkeypatch):
    asked: list[object] = []
    devices = [torch.device("cuda", 1)]
    monkeypatch.setattr(reference, "stage_devices", lambda device, tensors: devices)

    def seeded(base, microbatch, found=()):
        asked.append(found)
        return torch.random.fork_rng()  # a context manager that seeds nothing

    monkeypatch.setattr(reference, "seeded_forward", seeded)
    model, (x,) = mlp.build()
    program = fxpipe.compile(model, (x,), stages=2, chunks=2)
    microbatched_forward(model, program.built.signature, [x], 2, draws_random=True)
    assert asked == [devices, devices]


def test_the_reference_runs_on_the_cpu_when_the_model_is_spread_over_devices():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert reference_device(model, torch.device("cpu")) == torch.device("cpu")
    model[1].to("meta")  # stands in for a second GPU
    assert reference_device(model, torch.device("meta")) == torch.device("cpu")
    model[0].to("meta")
    assert reference_device(model, torch.device("meta")) == torch.device("meta")


def test_the_reference_copy_is_made_tensor_by_tensor_on_its_device_keeping_ties():
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5))
    model[1].weight = model[0].weight  # tied
    model.register_buffer("steps", torch.tensor(7))
    copied = copy_to(model, torch.device("cpu"))
    assert copied[1].weight is copied[0].weight
    assert copied[0].weight is not model[0].weight
    assert copied[0].weight.data_ptr() != model[0].weight.data_ptr()
    torch.testing.assert_close(copied[0].weight, model[0].weight)
    assert int(copied.steps) == 7 and copied[1].weight.requires_grad


# --- profiles ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("Tesla V100-PCIE-32GB", "v100"),  # no PCIe preset: the model's
    ("AMD Instinct MI300X", None),
])
def test_a_gpu_name_picks_its_preset_and_a_pcie_part_its_pcie_preset(name, key):
    assert spec_of_device(name) == key


def test_the_profile_cache_key_tells_tf32_from_full_fp32_on_a_gpu(monkeypatch):
    monkeypatch.setattr(cache, "_device_name", lambda device: "NVIDIA H200")
    matmul, conv = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = True
        convolutions_tf32 = cache.profile_key("cuda:0", torch.float32)
        torch.backends.cudnn.allow_tf32 = False
        full = cache.profile_key("cuda:0", torch.float32)
        torch.backends.cuda.matmul.allow_tf32 = True
        matmuls_tf32 = cache.profile_key("cuda:0", torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, conv
    assert len({convolutions_tf32, full, matmuls_tf32}) == 3
    assert "tf32" not in cache.profile_key("cpu", torch.float32)



# --- written programs under torchrun, on an emulated node ---------------------------------------


@pytest.fixture(scope="module")
def written_mlp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("program")
    model, (x,) = mlp.build()
    fxpipe.compile(model, (x,), stages=2, chunks=2, profile="a100").write(str(folder))
    return folder


def _torchrun(folder, startup: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    """program.py on 2 ranks, each process starting with `startup` (a sitecustomize module)."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(startup))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--master-port", str(free_port()), str(folder / "program.py"),
                           "--steps", "2", "--verify", *args],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_on_a_node_with_one_gpu_train_on_the_cpu_and_say_so_once(written_mlp,
                                                                         tmp_path):
    result = _torchrun(written_mlp, """
        import torch
        torch.cuda.is_available = lambda: True   # a node whose torch sees one GPU
        torch.cuda.device_count = lambda: 1
    """, tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "verify: OK" in result.stdout
    assert out.count("2 ranks on this node but 1 GPU") == 1, out


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_that_loads_for_longer_than_the_timeout_is_waited_for(written_mlp, tmp_path):
    result = _torchrun(written_mlp, """
        import os, time
        if os.environ.get("RANK") == "1":   # this rank's stage takes 8 s to load
            import fxpipe.runtime.launch as launch
            load = launch._tensors
            def slow(*args, **kwargs):
                time.sleep(8)
                return load(*args, **kwargs)
            launch._tensors = slow
    """, tmp_path, "--timeout", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verify: OK" in result.stdout


def test_state_of_a_parameter_a_new_cut_moved_in_this_process_follows_it():
    from fxpipe.rebalance import move_optimizer_state
    param = nn.Parameter(torch.empty(3, device="meta"))  # where a new cut put it
    optimizer = torch.optim.AdamW([param], fused=True)
    # the state a step made while it was on the CPU
    optimizer.state[param] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3),
                              "exp_avg_sq": torch.zeros(3)}
    move_optimizer_state(optimizer)
    state = optimizer.state[param]
    assert {k: v.device.type for k, v in state.items()} == dict.fromkeys(state, "meta")
    assert state["step"].dtype == torch.float32


# --- what data-parallel replicas compute --------------------------------------------------------


class _NormNet(nn.Module):
    """Batch statistics and dropout: a step that depends on how the batch is split."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.bn(self.fc(x)))))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_loss_of_replicas_is_each_shard_in_its_micro_batches_combined_as_the_loss_is(
        reduction):
    from fxpipe.reference import replicated_loss
    from fxpipe.runtime.execution.forward import draw_base, seeded_forward
    torch.manual_seed(0)
    model, x, y = _NormNet(), torch.randn(8, 4), torch.randn(8, 3)
    program = fxpipe.compile(copy.deepcopy(model), (x,), stages=2, chunks=2)

    def loss(out, target):
        return nn.functional.mse_loss(out, target, reduction=reduction)

    torch.manual_seed(5)
    got = replicated_loss(model, program.built.signature, [x], y, loss, 2, True, replicas=2)
    torch.manual_seed(5)
    base = draw_base()
    per_replica = []
    for shard, target in zip(x.chunk(2), y.chunk(2)):  # replica r: its half, in 2 micro-batches
        outs = []
        for m, micro in enumerate(shard.chunk(2)):
            with seeded_forward(base, m):
                outs.append(model(micro))
        per_replica.append(loss(torch.cat(outs), target))
    combined = sum(per_replica) / (2 if reduction == "mean" else 1)
    assert got is not None
    torch.testing.assert_close(got, combined)
    std = replicated_loss(model, program.built.signature, [x], y,
                          lambda out, target: out.std(), 2, True, replicas=2)
    assert std is None  # replicas refuse it


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_whose_peer_stops_gives_up_within_the_timeout(written_mlp, tmp_path):
    """After the setup wait, a wait for a stopped peer ends at --timeout (a gloo group made
    with the long setup timeout would wait that long)."""
    import signal
    import time

    from tests.test_failures import _rank_pid
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run",
                                 "--nproc-per-node", "2", "--master-port", str(free_port()),
                                 str(written_mlp / "program.py"), "--steps", "100000",
                                 "--timeout", "5"], stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    stopped = None
    try:
        deadline = time.monotonic() + 120
        while "step 1 loss" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        stopped = _rank_pid(proc.pid, 1)
        assert stopped is not None, "training did not start: " + out.read_text()
        os.kill(stopped, signal.SIGSTOP)
        sent = time.monotonic()
        while "rank 0 (stage 0)" not in out.read_text() and time.monotonic() < sent + 60:
            time.sleep(0.2)
        elapsed = time.monotonic() - sent
        assert "rank 0 (stage 0)" in out.read_text(), out.read_text()[-2000:]
        assert elapsed < 5 + 10, f"rank 0 gave up {elapsed:.1f} s after its peer stopped"
    finally:
        for pid in [stopped, _rank_pid(proc.pid, 0)]:
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()

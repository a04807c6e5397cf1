"""No host sync per micro-batch: a steady-state step reads device values on the host only where
its result needs them, counted by fxpipe.testing.host_syncs on CPU as if every tensor lived on
the device.

The documented minimum per step: one read of the loss (step() returns it as a number; on the
ranks that read also carries the loss's kind, so a loss that stops splitting over micro-batches
is refused on the step it does), and, for a model that draws random numbers, one draw of the
step's seed from the caller's generator (a host tensor on every device, so no wait on a GPU).
The generator state handed between stages, the timeline, the same-rank hand-over and the
step's verdict add none. Each counted run also trains like the plain model.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
from ranks import spawn
from torch import nn

import fxpipe
from fxpipe.losses import default_loss
from fxpipe.models import gpt
from fxpipe.runtime.comm import LocalComm, MicrobatchComm
from fxpipe.runtime.communication.dist_comm import DistComm
from fxpipe.runtime.execution.devices import ReadLater
from fxpipe.runtime.planning.timeline import Event
from fxpipe.testing.host_syncs import HostSyncs
from fxpipe.testing.reference_step import reference_step

WARM, COUNTED = 2, 2


def _case(dropout: float) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    model, (idx,) = gpt.build(batch=16, dropout=dropout)
    return model, idx, gpt.target((idx,))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _counted(program: fxpipe.Program, idx: torch.Tensor, y: torch.Tensor
             ) -> tuple[float, list[str]]:
    """Syncs per steady-state step, and the files that made them."""
    for _ in range(WARM):
        program.step(idx, target=y)
    with HostSyncs(every_tensor=True) as syncs:
        for _ in range(COUNTED):
            program.step(idx, target=y)
    files = sorted({os.path.basename(site.split(" at ")[1].rsplit(":", 1)[0])
                    for site in syncs.sites})
    return syncs.count / COUNTED, files


def test_the_counter_counts_host_reads_and_copies_to_the_host():
    t = torch.ones(3)
    with HostSyncs(every_tensor=True) as syncs:
        t.sum().item()
        float(t[0])
        t.tolist()
        t.to("cpu", torch.uint8)
        t.cpu()
        t.to(torch.float64)  # a dtype change stays where it is: not counted
        t + 1
    assert syncs.count == 5, syncs.report()
    with HostSyncs() as syncs:  # a CPU tensor is on the host already
        t.sum().item()
    assert syncs.count == 0
    assert torch.Tensor.__dict__.get("item") is None  # every patch is undone


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_local_steps_read_only_the_loss_and_the_seed_and_train_like_the_plain_model(dropout):
    model, idx, y = _case(dropout)
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (idx,), stages=2, chunks=8, profile="a100")
    per_step, files = _counted(program, idx, y)
    if dropout:
        assert (per_step, files) == (2, ["forward.py", "program.py"])  # the seed, the loss
    else:
        assert (per_step, files) == (1, ["program.py"])
    program.zero_grad()
    torch.manual_seed(3)
    loss = program.step(idx, target=y)
    torch.manual_seed(3)
    expected = reference_step(program, plain, idx, target=y)
    assert loss == pytest.approx(expected, rel=1e-6)
    theirs = _grads(plain)
    mine = _grads(model)
    assert set(mine) == set(theirs)
    for name, grad in mine.items():
        torch.testing.assert_close(grad, theirs[name], msg=name)


def _rank_steps(rank: int, world: int, schedule: str) -> dict:
    model, idx, y = _case(0.1)
    program = fxpipe.compile(model, (idx,), stages=world, chunks=8, profile="a100",
                             schedule=schedule)
    per_step, files = _counted(program, idx, y)
    program.zero_grad()
    torch.manual_seed(5)
    loss = program.step(idx, target=y)
    own = {id(p) for p in program.parameters()}
    return {"syncs": per_step, "files": files, "loss": loss,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                      if id(p) in own and p.grad is not None}}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_rank_steps_read_only_the_verdict_and_the_seed_and_train_like_the_plain_model(schedule):
    ranks = spawn(2, __name__, "_rank_steps", schedule, timeout=120, bound=400)
    # the seed, and the verdict: read from the broadcast, or by the judge on the last stage
    assert (ranks[0]["syncs"], ranks[0]["files"]) == (2, ["distributed.py"])
    assert (ranks[1]["syncs"], ranks[1]["files"]) == (2, ["distributed.py", "loss_judge.py"])
    model, idx, y = _case(0.1)
    program = fxpipe.compile(copy.deepcopy(model), (idx,), stages=2, chunks=8,
                             profile="a100", schedule=schedule)
    torch.manual_seed(5)
    expected = reference_step(program, model, idx, target=y)
    assert [r["loss"] for r in ranks] == pytest.approx([expected] * 2, rel=1e-6)
    theirs = _grads(model)
    seen: set[str] = set()
    for rank in ranks:
        for name, grad in rank["grads"].items():
            torch.testing.assert_close(grad, theirs[name], msg=name)
        seen |= set(rank["grads"])
    assert seen == set(theirs)


class _FakeCudaEvent:
    def __init__(self, at: float, waits: list[int]) -> None:
        self.at, self.waits = at, waits

    def synchronize(self) -> None:
        self.waits.append(1)

    def elapsed_time(self, other: _FakeCudaEvent) -> float:
        return (other.at - self.at) * 1e3


def test_a_cuda_timeline_is_read_from_the_device_only_when_looked_at():
    waits: list[int] = []
    origin = _FakeCudaEvent(0.0, waits)
    pending = [("forward", 0, mb, _FakeCudaEvent(mb, waits), _FakeCudaEvent(mb + 0.5, waits), "")
               for mb in range(3)]
    events = ReadLater(origin, pending, [])
    assert waits == []
    assert [(e.microbatch, e.start, e.end) for e in events] == [(0, 0.0, 0.5), (1, 1.0, 1.5),
                                                                (2, 2.0, 2.5)]
    assert len(waits) == 3 and len(events) == 3 and len(waits) == 3  # read once
    assert isinstance(events[0], Event)


class _WritesAfterAHandOver(nn.Module):
    """Under ZB-V on 2 ranks, stages 1 and 2 share rank 1; stage 2 begins by adding into a
    slice of what stage 1 hands it, which the hand-over must copy (and only that one)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.relu(self.a(x)))
        h[:, :4] += self.bias
        out: torch.Tensor = self.d(torch.relu(self.c(torch.relu(h))))
        return out


def _hand_over_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor, fxpipe.Program]:
    torch.manual_seed(0)
    model, x = _WritesAfterAHandOver(), torch.randn(8, 8)
    # stage 1 ends at b's output, which stage 2 writes into
    program = fxpipe.compile(model, (x,), stages=4, chunks=2, profile="a100", schedule="zb-v",
                             balance=[2, 1, 9, 1])
    return model, x, torch.randint(0, 8, (8,)), program


def _hand_over_steps(rank: int, world: int) -> dict[str, torch.Tensor]:
    model, x, y, program = _hand_over_case()
    for _ in range(2):  # the second step receives into what the first left
        program.zero_grad()
        program.step(x, target=y)
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stage_writing_into_a_same_rank_hand_over_trains_like_the_model():
    model, x, y, program = _hand_over_case()
    assert [[(c.peer, c.written) for c in s.recvs] for s in program.stages] == \
        [[], [(0, False)], [(1, True)], [(2, False)]]
    ranks = spawn(2, __name__, "_hand_over_steps", timeout=120, bound=400)
    plain = copy.deepcopy(model)
    default_loss(plain(x), y).backward()
    got = {**ranks[0], **ranks[1]}
    assert set(got) == {n for n, _ in plain.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.grad, msg=name)


def test_the_generator_state_crosses_as_a_host_tensor_except_between_ranks_over_a_gpu():
    """ZB-V on 2 ranks: stages 1 and 2 share rank 1, so the state they hand over stays on the
    host even with the stages on a GPU; between ranks over NCCL it must cross in device
    memory."""
    def comm(device: str) -> DistComm:
        return DistComm(rank=1, global_ranks=[0, 1], placement=[0, 1, 1, 0], info={},
                        microbatch_size=1, device=torch.device(device),
                        transport=None)  # type: ignore[arg-type]
    gpu, cpu = comm("cuda:0"), comm("cpu")
    assert gpu.carries_host_tensors(1, 2) and not gpu.carries_host_tensors(0, 1)
    assert not gpu.carries_host_tensors(2, 3)
    assert all(cpu.carries_host_tensors(s, s + 1) for s in range(3))
    view = MicrobatchComm(gpu, 1, 0, False, torch.device("cuda:0"))
    assert view.carries_host_tensors(2) and not view.carries_host_tensors(0)
    assert MicrobatchComm(LocalComm(), 0, 0, False, torch.device("cuda:0")).carries_host_tensors(1)

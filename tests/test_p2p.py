"""Point-to-point between ranks, gloo on 127.0.0.1: boundary values of any layout, every
schedule under NCCL's rules (strict mode), and the strict transport itself.

Each test starts a small group of processes (tiny models, short timeouts) with ranks.spawn,
which runs one function of this module on every rank and returns what each rank returned. The
parent trains a plain copy of the model the same way and compares loss and every gradient.
"""
from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator

import pytest
import torch
from ranks import spawn
from torch import nn

import fxpipe
from fxpipe.losses import default_loss
from fxpipe.runtime.planning.schedule import default_stages_per_rank

pytestmark = pytest.mark.distributed

CHUNKS = 2


# -- models whose boundary value is not contiguous ----------------------------------------------


class _Consumer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.sin(h).transpose(0, 1))


class Transposed(nn.Module):
    """Sends tanh(...) of a transposed tensor: the boundary value has strides (1, 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = _Consumer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x).transpose(0, 1)))


class ChannelsLast(nn.Module):
    """Two convolutions in channels_last: the boundary value is channels_last."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.c1(x.contiguous(memory_format=torch.channels_last)))


LAYOUTS = {
    "transposed": (Transposed, (8, 8), (8, 4), ["b"]),
    "channels_last": (ChannelsLast, (4, 3, 6, 6), (4, 2, 6, 6), ["c2"]),
}


def _layout_case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, list[str]]:
    cls, x_shape, y_shape, points = LAYOUTS[name]
    torch.manual_seed(0)
    return cls(), torch.randn(x_shape), torch.randn(y_shape), points


def _plain_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict]:
    model = copy.deepcopy(model)
    loss = default_loss(model(x), y)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def _step_layouts(rank: int, world: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        model, x, y, points = _layout_case(name)
        program = fxpipe.compile(model, (x,), stages=world, chunks=CHUNKS, split_points=points,
                                 profile="a100")
        with _recording_sends() as kinds:
            loss = program.step(x, target=y)
        out[name] = (loss, {n: p.grad for n, p in model.named_parameters()
                            if p.grad is not None}, kinds)
    return out


def _two_rank_jobs(rank: int, world: int) -> dict:
    return {"layouts": _step_layouts(rank, world, list(LAYOUTS)),
            "sends_held": _sends_held(rank, world, 8),
            "kept_buffers": _kept_buffers(rank, world),
            "schedules": _step_schedules(rank, world, STRICT_CASES + ZB_CASES + LOOPED_CASES)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """The jobs of this module that run on 2 ranks in batched mode, in one group of processes."""
    return spawn(2, __name__, "_two_rank_jobs")


def test_transposed_and_channels_last_boundary_values_train_like_the_model(two_ranks):
    names = list(LAYOUTS)
    ranks = [r["layouts"] for r in two_ranks]
    for name in names:
        loss, grads = _plain_grads(*_layout_case(name)[:3])
        assert ranks[0][name][0] == pytest.approx(loss, rel=1e-5)
        got = {**ranks[0][name][1], **ranks[1][name][1]}
        assert set(got) == set(grads), name
        for key, grad in grads.items():
            torch.testing.assert_close(got[key], grad,
                                       msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
        # rank 0 sends each activation as a contiguous copy: dropped as soon as it is sent,
        # not held through the forwards until a reply (GPipe's first message back comes
        # after them all)
        sends = ranks[0][name][2]
        assert sends and set(sends) == {"thread"}, (name, sends)


# -- the strict transport alone -----------------------------------------------------------------


def _play(rank: int, world: int, order: str, schedule: str, m: int, eager_bytes: int,
          timeout_s: float) -> str:
    """Plays rank `rank`'s program (tests/test_p2p_plan.py) with 64 KiB messages."""
    from test_p2p_plan import chain_messages, one_at_a_time_programs, plan_programs

    from fxpipe.runtime.communication.strict import StrictTransport
    from fxpipe.runtime.communication.transport import Op
    from fxpipe.runtime.planning.schedule import make_schedule

    actions = make_schedule(schedule, m, world)
    messages = chain_messages(world, m)
    if order == "plan":
        programs = plan_programs(actions, messages, [(s, s + 1) for s in range(world - 1)])
    else:
        programs = one_at_a_time_programs(actions, messages)
    transport = StrictTransport(eager_bytes=eager_bytes, timeout_s=timeout_s)
    received = {}
    try:
        for kind, arg in programs[rank]:
            if kind == "post":
                ops = [Op(op, torch.full((2**14,), float(msg.microbatch)) if op == "send"
                          else torch.empty(2**14), msg.dst_rank if op == "send" else msg.src_rank,
                          label=str(msg)) for op, msg in arg]
                for (_, msg), op, handle in zip(arg, ops, transport.post(ops)):
                    received[msg] = (handle, op.tensor)
            else:
                handle, tensor = received.pop(arg)
                handle.wait()
                assert torch.equal(tensor, torch.full((2**14,), float(arg.microbatch)))
        transport.flush()
    except fxpipe.FxPipeError as e:
        return str(e)
    return "ok"


def test_strict_mode_detects_that_one_message_at_a_time_deadlocks_1f1b():
    start = time.monotonic()
    results = spawn(2, __name__, "_play", "one_at_a_time", "1f1b", 4, 0, 3.0)
    assert all("strict point-to-point" in r and "3 s" in r for r in results), results
    assert "waits for rank 1 to post and reach its receive" in results[0], results[0]
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_strict_mode_passes_one_message_at_a_time_when_every_send_fits_the_eager_buffer():
    assert spawn(2, __name__, "_play", "one_at_a_time", "1f1b", 4, 2**20, 10.0) == ["ok", "ok"]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_strict_mode_runs_the_plan_of_1f1b_without_eager_buffer(world):
    assert spawn(world, __name__, "_play", "plan", "1f1b", 5, 0, 20.0) == ["ok"] * world


# -- every schedule under NCCL's rules ----------------------------------------------------------


class Chain(nn.Module):
    """tanh(Linear) blocks: one boundary value per cut, whatever the number of stages."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _chain_case(depth: int = 4) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return Chain(depth=max(depth, 4)), torch.randn(20, 16), torch.randn(20, 16)


STRICT_CASES = [("gpipe", 1, "except_last"), ("gpipe", 4, "except_last"),
                ("1f1b", 2, "except_last"), ("1f1b", 5, "except_last")]
# a split backward with remat off and on (on: I and W both recompute the regions)
ZB_CASES = [("zb-h1", 1, "never"), ("zb-h1", 5, "never"), ("zb-h1", 5, "always")]
# two stages per rank: interleaved (stage s on rank s % world) and the V (the last stage on
# rank 0, the middle hop inside the last rank), with remat and a split backward; DualPipeV
# splits some backwards of a stage and runs others whole
LOOPED_CASES = [("interleaved-1f1b", 5, "except_last"), ("interleaved-1f1b", 4, "never"),
                ("zb-v", 1, "never"), ("zb-v", 5, "always"), ("dualpipev", 5, "except_last")]
KINDS = {"zb-h1": ("F", "I", "W"), "zb-v": ("F", "I", "W"), "dualpipev": ("B", "F", "I", "W")}


def _step_schedules(rank: int, world: int, cases: list[tuple[str, int, str]]) -> dict:
    from fxpipe.runtime.communication.dist_comm import DistComm

    held_to_the_end: list[int] = []  # sent values still held when a step finishes
    finish = DistComm.finish

    def counting_finish(self: DistComm) -> None:
        held_to_the_end.append(len(self.sent_values))
        finish(self)

    DistComm.finish = counting_finish  # this process runs these cases only
    out = {}
    for schedule, chunks, remat in cases:
        held_to_the_end.clear()
        model, x, y = _chain_case(2 * world)
        stages = world * default_stages_per_rank(schedule)
        program = fxpipe.compile(model, (x,), stages=stages, chunks=chunks, schedule=schedule,
                                 split_points=[f"blocks.{i}" for i in range(1, stages)],
                                 remat=remat, profile="a100")
        evaluated = program.evaluate(x, target=y)  # the schedule's forwards alone
        loss = program.step(x, target=y)
        out[(schedule, chunks, remat)] = (loss, {n: p.grad for n, p in model.named_parameters()
                                          if p.grad is not None},
                                   type(program._rank.executor.transport).__name__,
                                   sorted({t.action.kind for ticks in
                                           program._rank.executor.plans.values()
                                           for t in ticks if t.action is not None}),
                                   sorted({early for _, _, early in
                                           program._rank.executor.plans}),
                                   max(held_to_the_end), evaluated)
    return out


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow),
                                   pytest.param(4, marks=pytest.mark.slow)])
def test_gpipe_and_1f1b_in_strict_mode_train_like_the_model(world):
    _check_strict_cases(world, STRICT_CASES)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow),
                                   pytest.param(4, marks=pytest.mark.slow)])
def test_zb_h1_in_strict_mode_trains_like_the_model_with_and_without_remat(world):
    _check_strict_cases(world, ZB_CASES)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_interleaved_1f1b_zb_v_and_dualpipev_in_strict_mode_train_like_the_model(world):
    _check_strict_cases(world, LOOPED_CASES)


def test_every_schedule_over_gloo_posts_receives_early_and_trains_like_the_model(two_ranks):
    # NOTE [Early receives] in fxpipe/runtime/planning/plan.py: gloo matches by tag
    _check_cases([r["schedules"] for r in two_ranks], 2, STRICT_CASES + ZB_CASES + LOOPED_CASES,
                 "TorchTransport", early=True)


def _check_strict_cases(world: int, cases: list[tuple[str, int, str]]) -> None:
    """Every rank's loss and every gradient of each case, under NCCL's rules (every send waits
    for its receive: no eager buffer), equal the plain model's."""
    ranks = spawn(world, __name__, "_step_schedules", cases, env={"FXPIPE_P2P": "strict"},
                  timeout=60)
    _check_cases(ranks, world, cases, "StrictTransport", early=False)


def _check_cases(ranks: list[dict], world: int, cases: list[tuple[str, int, str]],
                 transport: str, early: bool) -> None:
    loss, grads = _plain_grads(*_chain_case(2 * world))
    for case in cases:
        assert {r[case][2] for r in ranks} == {transport}
        assert {tuple(r[case][4]) for r in ranks} == {(early,)}
        assert {tuple(r[case][3]) for r in ranks} == {KINDS.get(case[0], ("B", "F"))}
        # a value sent to another stage is let go once its gradient is back, also when both
        # stages sit on one rank (ZB-V's turn at the bottom of the V)
        assert [r[case][5] for r in ranks] == [0] * world, case
        assert [r[case][0] for r in ranks] == [ranks[0][case][0]] * world  # every rank's loss
        assert ranks[0][case][0] == pytest.approx(loss, rel=1e-5), case
        assert [r[case][6] for r in ranks] == pytest.approx([loss] * world, rel=1e-5), case
        got = {k: g for r in ranks for k, g in r[case][1].items()}
        assert set(got) == set(grads), case
        for key, grad in grads.items():
            torch.testing.assert_close(got[key], grad,
                                       msg=lambda m, k=key, c=case: f"{c} {k}: {m}")


@contextlib.contextmanager
def _recording_sends() -> Iterator[list[str]]:
    """How each send is held while inside: "parked" until its reply arrives, or "thread" (the
    reaper's), in posting order."""
    from fxpipe.runtime.communication.transport import SendReaper

    kinds: list[str] = []
    park, add = SendReaper.park, SendReaper.add

    def parked(self: SendReaper, *args: object) -> None:
        kinds.append("parked")
        park(self, *args)  # type: ignore[arg-type]

    def threaded(self: SendReaper, *args: object) -> None:
        kinds.append("thread")
        add(self, *args)  # type: ignore[arg-type]

    SendReaper.park, SendReaper.add = parked, threaded  # type: ignore[method-assign]
    try:
        yield kinds
    finally:
        SendReaper.park, SendReaper.add = park, add  # type: ignore[method-assign]


def _sends_held(rank: int, world: int, chunks: int) -> tuple[int, float, list[str], int]:
    """The most sent tensors held at once, the loss, how each send was held ("parked" until
    its reply arrives, or "thread": the reaper's) and the sends still parked after the
    step."""
    model, x, y = _chain_case()
    x, y = x[:16], y[:16]
    program = fxpipe.compile(model, (x,), stages=world, chunks=chunks, schedule="1f1b",
                             split_points=["blocks.2"], profile="a100")
    program.step(x, target=y)  # the first learns which gradients come, with headers
    with _recording_sends() as kinds:
        loss = program.step(x, target=y)
    left = len(program._rank.executor.transport.sends.parked)
    return program._rank.executor.last.sends_held, loss, kinds, left


def _kept_buffers(rank: int, world: int) -> dict:
    """Three SGD steps of 8 micro-batches per schedule: this rank's parameters after them, and
    the receive buffers each step made and reused."""
    out = {}
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        model, x, y = _chain_case()
        x, y = x[:16], y[:16]
        program = fxpipe.compile(model, (x,), stages=world, chunks=8, schedule=schedule,
                                 split_points=["blocks.2"], profile="a100")
        buffers = program._rank.executor.receive_buffers
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        counts = []
        for _ in range(3):
            optimizer.zero_grad()
            before = (buffers.allocated, buffers.reused)
            program.step(x, target=y)
            optimizer.step()
            counts.append((buffers.allocated - before[0], buffers.reused - before[1]))
        out[schedule] = ({n: p.detach().clone() for n, p in model.named_parameters()
                          if p.grad is not None}, counts)
    return out


def test_receive_buffers_are_reused_across_steps_and_training_equals_the_model(two_ranks):
    """Each rank receives 8 messages a step (activations on rank 1, their gradients on rank
    0). The first step makes a buffer only for those in use at once; later steps make none.
    Three optimizer steps, each reading what the last wrote into reused buffers, must train
    like the plain model."""
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        model, x, y = _chain_case()
        x, y = x[:16], y[:16]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(3):
            optimizer.zero_grad()
            default_loss(model(x), y).backward()
            optimizer.step()
        expected = dict(model.named_parameters())
        owned = set()
        for rank, result in enumerate(two_ranks):
            params, counts = result["kept_buffers"][schedule]
            owned |= set(params)
            for name, value in params.items():
                torch.testing.assert_close(value, expected[name].detach(),
                                           msg=lambda m, s=schedule, n=name: f"{s} {n}: {m}")
            made, reused = zip(*counts)
            # as many as the schedule holds at once: 1F1B a few micro-batches' (a receive is
            # posted a tick early), GPipe all 8 until their backwards, ZB-H1's last stage its
            # inputs until each W
            assert 1 <= made[0] <= (3 if schedule == "1f1b" else 8), (schedule, rank, counts)
            # (the first step may run the schedule twice: once to learn how the loss reduces)
            assert (made[0] + reused[0]) % 8 == 0, (schedule, rank, counts)
            assert counts[1:] == [(0, 8), (0, 8)], (schedule, rank, counts)
        assert owned == set(expected), schedule


def test_sent_tensors_are_released_as_their_sends_complete_not_at_the_end_of_the_step(two_ranks):
    held = [r["sends_held"][0] for r in two_ranks]
    # each rank sends 8 tensors a step (activations, or their gradients); a send completes
    # once its receive, posted at the same tick by the peer, has taken it
    assert max(held) < 8, held
    assert min(held) >= 1


def test_an_activation_send_is_dropped_when_its_gradient_arrives_not_by_the_thread(two_ranks):
    # rank 0 sends activations (8 a step), each answered by its gradient: the reply proves the
    # send complete, so no thread waits for it. Rank 1's gradient of micro-batch m is answered
    # by the activation rank 0 sends after using it (1F1B: F(m+2) after B(m)), but for the last
    # two: rank 0 sends nothing after B6 (NOTE [Replies] in fxpipe/runtime/planning/plan.py)
    kinds = [r["sends_held"][2] for r in two_ranks]
    assert kinds[0] == ["parked"] * 8, kinds[0]
    assert kinds[1] == ["parked"] * 6 + ["thread"] * 2, kinds[1]
    assert [r["sends_held"][3] for r in two_ranks] == [0, 0]  # every one dropped


class _Work:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self, timeout: object = None) -> None:
        self.waits += 1


def test_a_parked_send_is_waited_for_when_its_reply_arrives_or_at_the_flush():
    from fxpipe.runtime.communication.transport import SendReaper

    reaper = SendReaper(poll=False)
    work, tensor = _Work(), torch.ones(2)
    reaper.park("grad of a, mb 0", [work], [tensor], 1)
    assert reaper.count == 1 and not reaper.running and work.waits == 0
    reaper.settle("grad of a, mb 0")
    assert work.waits == 1 and reaper.count == 0 and not reaper.parked
    reaper.settle("grad of b, mb 0")  # the reply of a send not parked: nothing to drop
    never = _Work()
    reaper.park("grad of a, mb 1", [never], [tensor], 1)
    reaper.flush()  # its reply never came: the flush waits for the send itself
    assert never.waits == 1 and reaper.count == 0 and not reaper.parked and not reaper.running
    polled = SendReaper(poll=True)  # NCCL: polled as every send is
    polled.park("grad of a, mb 0", [], [tensor], 1)
    assert not polled.parked and polled.count == 0


def _mismatch(rank: int, world: int) -> str:
    from fxpipe.runtime.communication.strict import StrictTransport
    from fxpipe.runtime.communication.transport import Op

    transport = StrictTransport(timeout_s=5)
    labels = ["'a' mb 0", "'b' mb 0"]
    try:
        if rank == 0:
            transport.post([Op("send", torch.zeros(4), 1, label=lab) for lab in labels])
        else:  # posted in the other order: a FIFO transport would swap a and b silently
            handles = transport.post([Op("recv", torch.zeros(4), 0, label=lab)
                                      for lab in reversed(labels)])
            for handle in handles:
                handle.wait()
        transport.flush()
    except fxpipe.FxPipeError as e:
        return str(e)
    return "ok"


@pytest.mark.slow
def test_strict_mode_names_both_messages_when_the_ends_disagree_on_the_order():
    results = spawn(2, __name__, "_mismatch", timeout=30)
    assert "expected message #0 from rank 0 to be 'b' mb 0 (float32[4])" in results[1]
    assert "but rank 0 sent message #0: 'a' mb 0 (float32, 16 bytes)" in results[1]


# -- checks that need no peer ------------------------------------------------------------------


def _comm(dtypes=None, learn=False):
    from fxpipe import ir
    from fxpipe.runtime.communication.dist_comm import DistComm

    info = {("h", 0, 1): ir.TensorInfo((ir.BATCH, 16), torch.float32, 0, True)}
    return DistComm(rank=0, global_ranks=[0, 1], placement=[0, 1], info=info,
                    microbatch_size=4, device=torch.device("cpu"), transport=None,
                    dtypes=dtypes, learn=learn)


def test_a_sent_value_whose_shape_differs_from_the_plan_is_an_error_naming_both():
    with pytest.raises(fxpipe.FxPipeError, match=r"stage 0 sends 'h' \(micro-batch 1\) to "
                       r"stage 1 as float32\[4, 8\], but stage 1 expects float32\[4, 16\] "
                       r"\(the compiled plan\)"):
        _comm().send(torch.zeros(4, 8), "h", 0, 1, 1)


def test_a_sent_value_whose_dtype_differs_from_the_learned_one_is_an_error_naming_both():
    comm = _comm(dtypes={("h", 0, 1, 0): torch.bfloat16})
    comm.send(torch.zeros(4, 16, dtype=torch.bfloat16), "h", 0, 1, 0)
    with pytest.raises(fxpipe.FxPipeError, match=r"as float32\[4, 16\], but stage 1 expects "
                       r"bfloat16\[4, 16\] \(its shape from the compiled plan, its dtype from"):
        comm.send(torch.zeros(4, 16), "h", 0, 1, 1)


def test_the_first_step_under_autocast_learns_the_dtype_it_sends():
    comm = _comm(dtypes={}, learn=True)
    comm.send(torch.zeros(4, 16, dtype=torch.bfloat16), "h", 0, 1, 0)
    assert comm.dtypes == {("h", 0, 1, 0): torch.bfloat16}


# -- the transport over gloo --------------------------------------------------------------------


def _transport_exchange(rank: int, world: int) -> list:
    """Rank 0 sends a real and a complex tensor on a subgroup and the world, with
    torch.distributed's own isend/irecv made to fail: the transport posts to the process
    groups itself."""
    import torch.distributed as dist

    from fxpipe.runtime.communication.transport import Op, TorchTransport

    def refused(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("posted through dist.isend/irecv")

    dist.isend = dist.irecv = dist.batch_isend_irecv = refused  # type: ignore[assignment]
    got = []
    for group in (None, dist.new_group([0, 1])):
        transport = TorchTransport(group)
        real = torch.arange(6.0).reshape(2, 3) if rank == 0 else torch.empty(2, 3)
        cplx = torch.tensor([1 + 2j, 3 - 4j]) if rank == 0 else torch.empty(2, dtype=torch.cfloat)
        kind, peer = ("send", 1) if rank == 0 else ("recv", 0)
        handles = transport.post([Op(kind, real, peer, tag=7), Op(kind, cplx, peer, tag=8)])
        for handle in handles:
            if handle is not None:
                handle.wait()
        transport.flush()
        got.append((real.tolist(), cplx.tolist()))
    return got


def test_the_gloo_transport_posts_to_the_process_group_and_delivers_each_tensor():
    sent, received = spawn(2, __name__, "_transport_exchange")
    assert received == sent
    assert received[0][0] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert received[0][1] == [1 + 2j, 3 - 4j]


def _tags_per_step(rank: int, world: int) -> tuple[int, int]:
    """TagTable.tag's calls in a first step and in the two after it."""
    from fxpipe.models import gpt
    from fxpipe.runtime.communication.tags import TagTable
    model, (idx,) = gpt.build(batch=8, dropout=0.0)
    program = fxpipe.compile(model, (idx,), stages=world, chunks=4, profile="a100",
                             schedule="1f1b")
    calls: list[tuple] = []
    real = TagTable.tag

    def counted(self: TagTable, *args: object) -> int:
        calls.append(args)
        return real(self, *args)  # type: ignore[arg-type]

    TagTable.tag = counted  # type: ignore[method-assign]  # this rank's process alone
    try:
        program.step(idx, target=gpt.target((idx,)))
        first = len(calls)
        for _ in range(2):
            program.step(idx, target=gpt.target((idx,)))
    finally:
        TagTable.tag = real  # type: ignore[method-assign]
    return first, len(calls) - first


def test_a_message_is_tagged_and_described_once_not_every_step():
    for first, later in spawn(2, __name__, "_tags_per_step", timeout=60, bound=240):
        assert first >= 8 and later == 0  # 4 activations and 4 gradients at least

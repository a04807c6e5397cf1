"""Training semantics: what a pipelined step equals (NOTE [What equals what] in fxpipe.reference).

A seeded pipelined step equals the plain model run over the same micro-batches with the same
seed (fxpipe.testing.reference_step): dropout and stochastic depth draw the same masks, in one
process and under torch.distributed, with or without recomputation; BatchNorm in training
normalises per micro-batch, and deferred_batch_norm=True makes the running statistics the full
batch's; a written program's --verify compares with that reference.
"""
from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from ranks import spawn
from torch import nn

import fxpipe
from fxpipe.losses import default_loss
from fxpipe.runtime.program.torchrun import free_port
from fxpipe.testing.reference_step import reference_forward, reference_step


class DropPath(nn.Module):
    """Stochastic depth: drops the whole residual branch of some examples."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = (torch.rand(x.shape[0], 1) >= self.p).to(x.dtype)
        return x * keep / (1 - self.p)


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.3)
        self.path = DropPath(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.path(self.drop(torch.relu(self.fc(x))))


class _RandomNet(nn.Module):
    """Dropout and stochastic depth in every block, so that every stage draws."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.Sequential(*[_Block(32) for _ in range(3)])
        self.head = nn.Sequential(nn.Dropout(0.5), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def _case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return _RandomNet().train(), torch.randn(8, 8), torch.randint(0, 4, (8,))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("remat", ["never", "always"])
def test_seeded_pipelined_step_draws_the_masks_of_the_seeded_plain_step(remat):
    model, x, y = _case()
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (x,), stages=3, chunks=2, remat=remat,
                             split_points=["blocks.1", "blocks.2"])
    assert [s.graph.carries_rng for s in program.built.stages] == [True, True, True]
    torch.manual_seed(7)
    loss = program.step(x, target=y)
    torch.manual_seed(7)
    expected = reference_step(program, plain, x, target=y)
    assert loss == pytest.approx(expected, rel=1e-6)
    ours, theirs = _grads(model), _grads(plain)
    assert ours.keys() == theirs.keys()
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, msg=name)


@pytest.mark.parametrize("loss", ["mse", "cross_entropy", "default"])
def test_the_reference_step_takes_a_loss_by_name_as_step_does(loss):
    model, x, y = _case()
    target = torch.randn(8, 4) if loss == "mse" else y
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2)
    torch.manual_seed(7)
    value = program.step(x, target=target, loss_fn=loss)
    torch.manual_seed(7)
    expected = reference_step(program, plain, x, target=target, loss_fn=loss)
    assert value == pytest.approx(expected, rel=1e-6)
    ours, theirs = _grads(model), _grads(plain)
    assert ours.keys() == theirs.keys()
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, msg=name)


def test_two_seeds_draw_different_masks_and_one_seed_the_same():
    model, x, _ = _case()
    program = fxpipe.compile(model, (x,), stages=2, chunks=2)
    with torch.no_grad():
        outs = []
        for seed in (1, 2, 1):
            torch.manual_seed(seed)
            outs.append(program(x))
    torch.testing.assert_close(outs[0], outs[2])
    assert not torch.allclose(outs[0], outs[1])


def _hook_warnings(program: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[str]]:
    """The step's loss and the hook warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = program.step(x, target=y)
    return loss, [str(w.message) for w in caught if " hook" in str(w.message)]


def _distributed_step(rank: int, world: int) -> dict:
    """The seeded step's loss and this rank's gradients; then the gradient-hook warnings of
    that step, of one after a hook is put on a parameter, and of one more; last, those of two
    steps of a program with a post-accumulate-grad hook, and how often it ran."""
    model, x, y = _case()
    program = fxpipe.compile(model, (x,), stages=world, chunks=2, profile="a100",
                             split_points=["blocks.2"])
    torch.manual_seed(7)
    loss, before = _hook_warnings(program, x, y)
    own = {id(p) for p in program.parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()
             if id(p) in own and p.grad is not None}
    next(iter(program.parameters())).register_hook(lambda g: g.clamp(-1e-3, 1e-3))
    told = [before] + [_hook_warnings(program, x, y)[1] for _ in range(2)]
    model, x, y = _case()
    program = fxpipe.compile(model, (x,), stages=world, chunks=2, profile="a100",
                             split_points=["blocks.2"])
    calls = []
    next(iter(program.parameters())).register_post_accumulate_grad_hook(calls.append)
    after = [_hook_warnings(program, x, y)[1] for _ in range(2)]
    return {"loss": loss, "grads": grads, "hooks": told, "after": after, "calls": len(calls)}


@functools.cache
def _two_ranks() -> list[dict]:
    return spawn(2, __name__, "_distributed_step", timeout=120, bound=400)


@pytest.mark.distributed
def test_gradient_hooks_under_torchrun_are_warned_of_once_as_running_per_microbatch():
    for rank in _two_ranks():
        before, hooked, again = rank["hooks"]
        assert before == [] and again == [], rank["hooks"]
        assert len(hooked) == 1 and "has a gradient hook (Tensor.register_hook): under torchrun " \
            "it runs once per micro-batch" in hooked[0], hooked
        # one after the gradient accumulates: warned of too, having run per micro-batch
        hooked, again = rank["after"]
        assert again == [] and len(hooked) == 1 and "has a hook after its gradient " \
            "accumulates (register_post_accumulate_grad_hook): under torchrun it runs once per " \
            "micro-batch" in hooked[0], hooked
        assert rank["calls"] == 2 * 2  # two steps of two micro-batches


@pytest.mark.distributed
def test_seeded_step_on_two_ranks_draws_the_masks_of_the_seeded_plain_step():
    ranks = _two_ranks()
    model, x, y = _case()
    program = fxpipe.compile(copy.deepcopy(model), (x,), stages=2, chunks=2, profile="a100",
                             split_points=["blocks.2"])
    torch.manual_seed(7)
    expected = reference_step(program, model, x, target=y)
    assert [r["loss"] for r in ranks] == pytest.approx([expected] * 2, rel=1e-6)
    theirs = _grads(model)
    seen = set()
    for rank in ranks:
        for name, grad in rank["grads"].items():
            torch.testing.assert_close(grad, theirs[name], msg=name)
        seen |= set(rank["grads"])
    assert seen == set(theirs)


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).train()


def test_batchnorm_in_training_normalises_each_microbatch_as_the_reference_does():
    model, x = _bn_net(), torch.randn(8, 3, 6, 6)
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (x,), stages=2, chunks=4)
    out = program(x)
    expected = reference_forward(program, plain, x)
    torch.testing.assert_close(out, expected)
    with torch.no_grad():
        assert not torch.allclose(out, copy.deepcopy(plain)(x), atol=1e-3)  # not the full batch


def test_deferred_batchnorm_keeps_the_running_statistics_of_the_full_batch():
    """The first BatchNorm sees the same examples in both; a later one sees what the earlier
    ones made of each micro-batch, so only the first is compared with the full batch."""
    x = torch.randn(8, 3, 6, 6)
    stats = {}
    for deferred in (False, True):
        model = _bn_net()
        program = fxpipe.compile(model, (x,), stages=2, chunks=4, deferred_batch_norm=deferred)
        program(x)
        stats[deferred] = {k: v.clone() for k, v in model[1].state_dict().items()}
    full = _bn_net()
    full(x)
    for key, value in full[1].state_dict().items():
        torch.testing.assert_close(stats[True][key], value, msg=key)
    assert int(stats[False]["num_batches_tracked"]) == 4  # without deferring: per micro-batch
    assert not torch.allclose(stats[False]["running_var"], full[1].running_var)


@pytest.mark.parametrize("case", ["dropout", "batchnorm"])
def test_written_program_verifies_against_the_microbatched_reference(tmp_path, case):
    if case == "dropout":
        model, x, y = _case()
    else:
        model, x, y = _bn_net(), torch.randn(8, 3, 6, 6), torch.randint(0, 4, (8,))
    program = fxpipe.compile(model, (x,), stages=2, chunks=2)
    program.step(x, target=y)  # builds it
    program.write(str(tmp_path), target=y, reference_steps=2)
    proc = subprocess.run([sys.executable, str(tmp_path / "program.py"), "--steps", "2",
                           "--verify"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "verify: OK" in proc.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_written_program_with_dropout_verifies_under_torchrun(tmp_path):
    model, x, y = _case()
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, profile="a100",
                             split_points=["blocks.2"])
    program.step(x, target=y)  # builds it
    program.write(str(tmp_path), target=y, reference_steps=2)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--master-port", str(free_port()), str(tmp_path / "program.py"),
                           "--steps", "2", "--verify"], capture_output=True, text=True,
                          timeout=600, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "verify: OK" in proc.stdout


# -- the loss under torchrun: a mean or a sum over examples, or refused ------------------------

PAD = -100


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.embed(x))))


def _token_mean(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over the real (unpadded) tokens."""
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), t.flatten(), ignore_index=PAD)


def _token_sum(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), t.flatten(), ignore_index=PAD,
                                             reduction="sum")


def _mse_sum(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, torch.zeros_like(out), reduction="sum")


def _std(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return out.std()


def _max(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return out.max()


def _counted(out: torch.Tensor, t: torch.Tensor, count: int = 1) -> torch.Tensor:
    """The padded per-token mean made a sum over examples: the batch's real tokens counted
    first (what the refusal's hint says to do)."""
    return _token_sum(out, t) / count


def _loss_case(name: str, padded: bool | tuple[int, ...], batch: int = 4
               ) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Any]:
    torch.manual_seed(0)
    model, x = _Tokens(), torch.randint(0, 16, (4, 5))
    y = torch.randint(0, 16, (4, 5))
    if padded:  # real tokens per example (default 5, 4, 2, 1: micro-batches of 9 and 3)
        for row, real in enumerate(padded if isinstance(padded, tuple) else (5, 4, 2, 1)):
            y[row, real:] = PAD
    x, y = x[:batch], y[:batch]
    fns = {"mean": _token_mean, "sum": _token_sum, "mse_sum": _mse_sum, "std": _std,
           "max": _max, "counted": functools.partial(_counted, count=int((y != PAD).sum())),
           "default": default_loss}
    return model, x, y, fns[name]


LOSS_CASES = [("mean", False), ("sum", False), ("mse_sum", False), ("counted", True),
              ("mean", True), ("std", False), ("max", False)]
REFUSED = {("mean", True), ("std", False), ("max", False)}


def _loss_steps(rank: int, world: int, cases: list, schedules: list[str],
                stages: int = 2, chunks: int = 2, batch: int = 4) -> list[dict]:
    out = []
    for schedule in schedules:
        for name, padded in cases:
            model, x, y, fn = _loss_case(name, padded, batch)
            program = fxpipe.compile(model, (x,), stages=stages, chunks=chunks, profile="a100",
                                     split_points=["head"] if stages > 1 else None,
                                     schedule=schedule)
            try:
                loss: Any = program.step(x, target=y, loss_fn=fn)
            except fxpipe.FxPipeError as e:
                loss = f"{type(e).__name__}: {e}"
            own = {id(p) for p in program.parameters()}
            out.append({"case": (name, padded, schedule), "loss": loss,
                        "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                                  if id(p) in own and p.grad is not None}})
    return out


def _loss_outcomes(ranks: list[list[dict]], batch: int = 4,
                   saying: str = "neither a mean nor a sum") -> dict[tuple, str]:
    """Each case's outcome on every rank against the plain model: "same", "refused" (a
    LossError `saying` so on every rank, gradients untouched) or "wrong"."""
    outcomes = {}
    for results in zip(*ranks):
        name, padded, schedule = results[0]["case"]
        plain, x, y, fn = _loss_case(name, padded, batch)
        expected = fn(plain(x), y)
        expected.backward()
        grads = _grads(plain)
        if all(isinstance(r["loss"], str) for r in results):
            untouched = all(not g.any() for r in results for g in r["grads"].values())
            said = all(r["loss"].startswith("LossError") and saying in r["loss"]
                       and "hint:" in r["loss"] for r in results)
            outcome = "refused" if untouched and said else "wrong"
        else:
            same = all(not isinstance(r["loss"], str)
                       and r["loss"] == pytest.approx(float(expected.detach()), rel=1e-5)
                       and all(torch.allclose(g, grads[n], rtol=1e-4, atol=1e-6)
                               for n, g in r["grads"].items()) for r in results)
            covered = set().union(*(r["grads"] for r in results)) == set(grads)
            outcome = "same" if same and covered else "wrong"
        outcomes[(name, padded, schedule)] = outcome
    return outcomes


@pytest.mark.distributed
def test_a_sum_loss_trains_as_the_plain_model_on_two_ranks_and_a_std_is_refused():
    # the default loss is judged from its micro-batches' losses weighted by the targets it
    # counts: padded alike in both micro-batches (7 and 7 real tokens) it is a mean, unlike
    # (9 and 3) it is refused as the same loss written by the user is
    cases = [("sum", False), ("mean", True), ("std", False), ("default", True),
             ("default", (4, 3, 4, 3))]
    ranks = spawn(2, __name__, "_loss_steps", cases, ["gpipe", "1f1b"], timeout=120, bound=400)
    outcomes = _loss_outcomes(ranks)
    assert outcomes == {(*case, schedule): outcome for schedule in ("gpipe", "1f1b")
                        for case, outcome in [(("sum", False), "same"),
                                              (("mean", True), "refused"),
                                              (("std", False), "refused"),
                                              (("default", True), "refused"),
                                              (("default", (4, 3, 4, 3)), "same")]}


@pytest.mark.slow
@pytest.mark.distributed
def test_every_loss_kind_on_two_ranks_equals_the_plain_model_or_is_refused():
    """Mean, sums, a padded per-token mean (raw: refused; counted over the batch first: the
    same), std and max, under each flat schedule: no result differs silently."""
    schedules = ["gpipe", "1f1b", "zb-h1"]
    ranks = spawn(2, __name__, "_loss_steps", LOSS_CASES, schedules, timeout=120, bound=600)
    outcomes = _loss_outcomes(ranks)
    wrong = [case for case, outcome in outcomes.items() if outcome == "wrong"]
    assert wrong == []
    for (name, padded, _), outcome in outcomes.items():
        assert outcome == ("refused" if (name, padded) in REFUSED else "same"), (name, padded)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sum_loss_under_data_parallelism_sums_over_the_replicas():
    """2 replicas x 2 stages: the replicas average their losses and gradients, which a sum over
    examples must not be."""
    cases = [("sum", False), ("mean", False), ("std", False)]
    ranks = spawn(4, __name__, "_loss_steps", cases, ["gpipe", "1f1b"], timeout=120, bound=600)
    outcomes = _loss_outcomes(ranks)
    assert outcomes == {(name, False, schedule): "refused" if name == "std" else "same"
                        for name, _ in cases for schedule in ("gpipe", "1f1b")}


CLASS_WEIGHTS = torch.tensor([1.0, 5.0, 0.2, 2.0])


def _weighted_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A classifier of imbalanced classes: its micro-batches hold different mixes of them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    return model, torch.randn(8, 8), torch.tensor([0, 0, 0, 1, 2, 2, 3, 3])


def _weighted_steps(rank: int, world: int) -> list[Any]:
    model, x, y = _weighted_case()
    total = CLASS_WEIGHTS[y].sum()  # the hint's form: a sum over the whole batch's weight
    out: list[Any] = []
    for fn in (nn.CrossEntropyLoss(weight=CLASS_WEIGHTS),
               lambda o, t: nn.functional.cross_entropy(o, t, weight=CLASS_WEIGHTS,
                                                        reduction="sum") / total):
        program = fxpipe.compile(model, (x,), stages=2, chunks=2)
        model.zero_grad(set_to_none=True)
        try:
            loss: Any = program.step(x, target=y, loss_fn=fn)
        except fxpipe.FxPipeError as e:
            loss = str(e)
        own = {id(p) for p in program.parameters()}
        out.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()
                           if id(p) in own and p.grad is not None}))
    return out


@pytest.mark.distributed
def test_a_class_weighted_mean_is_refused_saying_how_to_weigh_it_and_that_form_trains():
    ranks = spawn(2, __name__, "_weighted_steps")
    plain, x, y = _weighted_case()
    expected = nn.functional.cross_entropy(plain(x), y, weight=CLASS_WEIGHTS)
    expected.backward()
    for (refused, _), (loss, grads) in ranks:
        assert "neither a mean nor a sum" in refused
        assert "CrossEntropyLoss(weight=...) with reduction='mean' divides by the weights of " \
               "its own targets" in refused
        assert loss == pytest.approx(expected.item(), rel=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, dict(plain.named_parameters())[name].grad)
    assert set().union(*(g for _, (_, g) in ranks)) == {n for n, _ in plain.named_parameters()}


ONE_MICROBATCH = [("mean", False), ("mse_sum", False), ("std", False)]


@pytest.mark.distributed
def test_one_microbatch_per_replica_tells_a_sum_from_the_halves_of_its_microbatch():
    """2 replicas x 1 stage, chunks=1: each replica's micro-batch loss is its whole loss, so a
    sum is told from a mean by the halves of the micro-batch, and summed over the replicas."""
    ranks = spawn(2, __name__, "_loss_steps", [("mse_sum", False)], ["gpipe"], 1, 1,
                  timeout=120, bound=400)
    assert _loss_outcomes(ranks) == {("mse_sum", False, "gpipe"): "same"}


@pytest.mark.slow
@pytest.mark.distributed
def test_one_microbatch_per_replica_trains_a_mean_as_the_plain_model_and_refuses_a_std():
    """2 replicas x 1 stage, chunks=1: a std's halves show it is neither a mean nor a sum."""
    ranks = spawn(2, __name__, "_loss_steps", [ONE_MICROBATCH[0], ONE_MICROBATCH[2]],
                  ["gpipe"], 1, 1, timeout=120, bound=400)
    assert _loss_outcomes(ranks) == {("mean", False, "gpipe"): "same",
                                     ("std", False, "gpipe"): "refused"}


@pytest.mark.slow
@pytest.mark.distributed
def test_one_microbatch_per_replica_of_a_two_stage_pipeline_trains_as_the_plain_model():
    """2 replicas x 2 stages, chunks=1: mean and sum as the plain model, a std refused."""
    ranks = spawn(4, __name__, "_loss_steps", ONE_MICROBATCH, ["gpipe", "1f1b"], 2, 1,
                  timeout=120, bound=600)
    assert _loss_outcomes(ranks) == {(name, False, schedule): "refused" if name == "std"
                                     else "same" for name, _ in ONE_MICROBATCH
                                     for schedule in ("gpipe", "1f1b")}


@pytest.mark.slow
@pytest.mark.distributed
def test_one_example_per_replica_refuses_a_loss_whose_kind_it_cannot_tell():
    """2 replicas x 1 stage, a global batch of 2: a mean and a sum give the same number on one
    example; the default loss is known to be a mean and trains as the plain model."""
    cases = [("mse_sum", False), ("default", False)]
    ranks = spawn(2, __name__, "_one_example_steps", cases, timeout=120, bound=400)
    outcomes = _loss_outcomes([r[:2] for r in ranks], batch=2,
                              saying="cannot be judged a mean or a sum")
    assert outcomes == {("mse_sum", False, "gpipe"): "refused",
                        ("default", False, "gpipe"): "same"}
    assert "global batch of at least 4" in ranks[0][0]["loss"]
    # judged a sum on an earlier step of 2 examples per replica, one example trains as a sum
    assert _loss_outcomes([r[2:] for r in ranks], batch=2) == {("mse_sum", False, "gpipe"):
                                                               "same"}


def _one_example_steps(rank: int, world: int, cases: list) -> list[dict]:
    """`cases` on a global batch of 2 with chunks=1, then mse_sum on 4 examples and on 2."""
    out = _loss_steps(rank, world, cases, ["gpipe"], 1, 1, 2)
    model, x, y, fn = _loss_case("mse_sum", False)
    program = fxpipe.compile(model, (x,), stages=1, chunks=1, profile="a100")
    program.step(x, target=y, loss_fn=fn)
    model.zero_grad()
    loss = program.step(x[:2], target=y[:2], loss_fn=fn)
    return [*out, {"case": ("mse_sum", False, "gpipe"), "loss": loss,
                   "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                             if p.grad is not None}}]


@pytest.mark.slow
@pytest.mark.distributed
def test_replicas_that_find_different_kinds_refuse_the_loss_on_every_rank():
    """A per-token mean whose token counts are equal within replica 0's micro-batches (a mean
    there) and differ within replica 1's (neither): both replicas refuse, naming both kinds."""
    counts = (5, 5, 2, 1)
    for chunks, schedules in ((1, ["gpipe"]), (2, ["gpipe", "1f1b"])):
        ranks = spawn(2, __name__, "_loss_steps", [("mean", counts)], schedules, 1, chunks,
                      timeout=120, bound=400)
        outcomes = _loss_outcomes(ranks, saying="replicas judge the loss _token_mean "
                                                "differently")
        assert set(outcomes.values()) == {"refused"}, (chunks, outcomes)
        for rank in ranks:
            for result in rank:
                assert "1 found a mean, 1 found neither a mean nor a sum" in result["loss"]


def _kind_changes(rank: int, world: int) -> dict[str, str]:
    """A per-token mean whose first batch has equal counts (a mean), whose second has not."""
    out = {}
    for schedule in ("gpipe", "1f1b"):
        model, x, y, _ = _loss_case("mean", False)
        _, _, padded, _ = _loss_case("mean", True)
        program = fxpipe.compile(model, (x,), stages=world, chunks=2, profile="a100",
                                 split_points=["head"], schedule=schedule)
        program.step(x, target=y, loss_fn=_token_mean)
        try:
            program.step(x, target=padded, loss_fn=_token_mean)
            out[schedule] = "no error"
        except fxpipe.FxPipeError as e:
            out[schedule] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_a_loss_that_stops_being_a_mean_is_refused_on_the_step_it_does():
    for said in spawn(2, __name__, "_kind_changes", timeout=120, bound=400):
        assert said["gpipe"].startswith("LossError") and "added nothing" in said["gpipe"]
        assert said["1f1b"].startswith("LossError")
        assert "Earlier steps found it a mean" in said["1f1b"]
        assert "optimizer.zero_grad()" in said["1f1b"] and "schedule='gpipe'" in said["1f1b"]


def test_the_judge_weighs_a_built_in_loss_by_what_each_micro_batch_counts_and_joins_nothing():
    """A loss fxpipe defines needs no second run on the joined outputs (nor the outputs kept
    for it): the batch's loss is its micro-batches' weighted by the targets cross-entropy
    counts, and it is a mean exactly where those counts are equal."""
    from types import SimpleNamespace

    from fxpipe.runtime.execution.loss_judge import LossJudge

    class Unjoinable:
        def join_outputs(self, parts):
            raise AssertionError("the outputs were joined")

        def unflatten_outputs(self, out):
            return out[0]

    judge = LossJudge(Unjoinable(), torch.device("cpu"), SimpleNamespace(replicas=1), None)
    values = {0: torch.tensor(2.0), 1: torch.tensor(4.0)}
    unequal = [torch.tensor([[1, 2, PAD]]), torch.tensor([[1, PAD, PAD]])]
    full, parts, kind, _ = judge.judge({}, values, None, unequal, default_loss, False, "mean")
    assert (full, parts, kind) == (pytest.approx(8 / 3), [2.0, 4.0], "neither")
    equal = [torch.tensor([[1, 2, PAD]]), torch.tensor([[3, PAD, 4]])]
    full, _, kind, _ = judge.judge({}, values, None, equal, default_loss, False, "mean")
    assert (full, kind) == (3.0, "mean")
    full, _, kind, _ = judge.judge({}, values, None, [None, None], default_loss, False, "mean")
    assert (full, kind) == (3.0, "mean")
    assert LossJudge.weighs_parts(default_loss, halves=False)
    assert not LossJudge.weighs_parts(default_loss, halves=True)
    assert not LossJudge.weighs_parts(_token_mean, halves=False)
    with pytest.raises(AssertionError, match="joined"):  # any other loss runs once more
        judge.judge({0: [torch.zeros(1, 3, 16)], 1: [torch.zeros(1, 3, 16)]}, values, None,
                    equal, _token_mean, False, None)


def test_counted_is_what_each_built_in_loss_averages_over():
    from fxpipe.losses import NAMED, counted
    t = torch.tensor([[1, PAD, 2]])
    assert int(counted(NAMED["default"], t)) == 2  # integer targets: cross-entropy
    assert int(counted(NAMED["cross_entropy"], t.float())) == 2
    assert counted(NAMED["default"], t.float()) is None  # float targets: mean squared error
    assert counted(NAMED["mse"], t) is None
    assert counted(NAMED["default"], None) is None
    assert counted(_token_mean, t) is None  # not fxpipe's: judged on the joined outputs


def _plain_gpt() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The bundled GPT the ranks of these tests build, with its batch and targets."""
    from fxpipe.models import gpt
    torch.manual_seed(0)
    model, (idx,) = gpt.build(dropout=0.0)
    return model, idx, gpt.target((idx,))


def _gpt_loss(model: nn.Module, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The plain GPT's loss, as the default loss computes it on its logits."""
    logits = model(idx)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# the norm each clips by, and to what
ACCUMULATE_SCHEDULES = {"1f1b": (2.0, 0.5), "zb-h1": (float("inf"), 0.05)}


def _accumulated_steps(rank: int, world: int) -> dict:
    """Each schedule's gradients after two steps without zeroing them (gradient accumulation)
    and after clipping them, on the bundled GPT, whose embedding and head share one weight
    held by both ranks."""
    from fxpipe.models import gpt
    out = {}
    for schedule, (norm_type, max_norm) in ACCUMULATE_SCHEDULES.items():
        torch.manual_seed(0)
        model, (idx,) = gpt.build(dropout=0.0)
        program = fxpipe.compile(model, (idx,), stages=world, chunks=4, schedule=schedule,
                                 profile="a100")
        losses = [program.step(idx, target=gpt.target((idx,))) for _ in range(2)]
        grads = {n: p.grad.clone() for n, p in program.named_parameters()}
        norm = program.clip_grad_norm_(max_norm, norm_type)
        out[schedule] = {"losses": losses, "grads": grads, "norm": float(norm),
                         "clipped": {n: p.grad.clone() for n, p in program.named_parameters()}}
    return out


@pytest.mark.distributed
def test_gradients_accumulate_over_steps_and_clip_by_the_models_norm_a_tied_weight_included():
    ranks = spawn(2, __name__, "_accumulated_steps", timeout=120, bound=400)
    model, idx, target = _plain_gpt()
    for _ in range(2):
        loss = _gpt_loss(model, idx, target)
        loss.backward()
    theirs = dict(model.named_parameters())
    assert "wte.weight" in ranks[0]["1f1b"]["grads"] and "wte.weight" in ranks[1]["1f1b"]["grads"]
    for schedule, (norm_type, max_norm) in ACCUMULATE_SCHEDULES.items():
        clipped = copy.deepcopy(model)  # the gradients too
        for p, q in zip(model.parameters(), clipped.parameters()):
            q.grad = p.grad.clone()
        norm = torch.nn.utils.clip_grad_norm_(clipped.parameters(), max_norm, norm_type)
        assert float(norm) > max_norm  # so that clipping scales every gradient
        for rank in ranks:
            run = rank[schedule]
            assert run["losses"] == pytest.approx([float(loss)] * 2, rel=1e-5)
            assert run["norm"] == pytest.approx(float(norm), rel=1e-5)
            for name, grad in run["grads"].items():
                torch.testing.assert_close(grad, theirs[name].grad, msg=f"{schedule}: {name}")
                torch.testing.assert_close(run["clipped"][name],
                                           dict(clipped.named_parameters())[name].grad,
                                           msg=f"{schedule}, clipped: {name}")


def test_clip_grad_norm_in_one_process_clips_as_on_the_model():
    from fxpipe.models import gpt
    torch.manual_seed(0)
    model, (idx,) = gpt.build(dropout=0.0)
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (idx,), stages=2, chunks=2, profile="a100")
    program.step(idx, target=gpt.target((idx,)))
    reference_step(program, plain, idx, target=gpt.target((idx,)))
    norm = program.clip_grad_norm_(0.1)
    assert float(norm) == pytest.approx(
        float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


EVALUATE_SCHEDULES = {"1f1b": 1, "zb-v": 2}  # stages per rank


def _evaluations(rank: int, world: int) -> dict:
    """Each schedule's evaluate() before any step and after one, the gradients it leaves, and
    the step between them, on the bundled GPT (its tied weight on both ranks)."""
    from fxpipe.models import gpt
    out = {}
    for schedule, per_rank in EVALUATE_SCHEDULES.items():
        torch.manual_seed(0)
        model, (idx,) = gpt.build(dropout=0.0)
        program = fxpipe.compile(model, (idx,), stages=world * per_rank, chunks=4,
                                 schedule=schedule, profile="a100")
        target = gpt.target((idx,))
        before = program.evaluate(idx, target=target)
        # targets left out unevenly over the micro-batches: the built-in loss weighs them, a
        # loss of the user's runs on the joined outputs
        sharp = fxpipe.compile(_sharp(gpt.build(dropout=0.0)[0]), (idx,), stages=world * per_rank,
                               chunks=4, schedule=schedule, profile="a100")
        weighed = sharp.evaluate(idx, target=_masked(target))
        joined = sharp.evaluate(idx, target=_masked(target), loss_fn=_token_mean)
        untouched = all(p.grad is None for p in program.parameters())
        step = program.step(idx, target=target)
        with torch.no_grad():
            for p in program.parameters():
                p -= 0.1 * p.grad
        out[schedule] = {"before": before, "untouched": untouched, "step": step,
                         "after": program.evaluate(idx, target=target), "weighed": weighed,
                         "joined": joined}
    return out


def _masked(target: torch.Tensor) -> torch.Tensor:
    masked = target.clone()
    masked[:2, 4:] = PAD  # most of the first micro-batch of 4
    masked[5, 30:] = PAD
    return masked


def _sharp(model: nn.Module) -> nn.Module:
    """The GPT with its tied embedding scaled up: tokens' losses then differ widely, so that
    weighing micro-batches by their counted tokens matters."""
    with torch.no_grad():
        model.wte.weight.mul_(40)
    return model


@pytest.mark.distributed
def test_evaluate_on_two_ranks_is_the_models_loss_and_trains_nothing():
    ranks = spawn(2, __name__, "_evaluations", timeout=120, bound=400)
    model, idx, target = _plain_gpt()

    def loss() -> torch.Tensor:
        return _gpt_loss(model, idx, target)
    sharp = _sharp(copy.deepcopy(model))
    masked = _token_mean(sharp(idx), _masked(target))
    by_parts = sum(_token_mean(sharp(x), t) for x, t in zip(idx.chunk(4), _masked(target).chunk(4)))
    assert float(masked) != pytest.approx(float(by_parts) / 4, rel=1e-3)  # weighing matters
    first = loss()
    first.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
        second = float(loss())
    for schedule in EVALUATE_SCHEDULES:
        for rank in ranks:
            run = rank[schedule]
            assert run["untouched"], schedule
            assert [run["before"], run["step"]] == pytest.approx([float(first)] * 2, rel=1e-5)
            assert run["after"] == pytest.approx(second, rel=1e-5), schedule
            assert [run["weighed"], run["joined"]] == pytest.approx([float(masked)] * 2,
                                                                     rel=1e-5), schedule


def test_evaluate_in_one_process_is_the_models_loss_and_changes_no_buffer():
    _, x, y = _case()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    plain = copy.deepcopy(net)
    program = fxpipe.compile(net, (x,), stages=2, chunks=2, profile="a100")
    buffers = {n: b.clone() for n, b in net.named_buffers()}
    got = program.evaluate(x, target=y)
    want = sum(default_loss(plain(half), t) for half, t in zip(x.chunk(2), y.chunk(2))) / 2
    assert got == pytest.approx(float(want), rel=1e-5)
    for name, b in net.named_buffers():
        torch.testing.assert_close(b, buffers[name], msg=name)
    assert all(p.grad is None for p in net.parameters())
    assert program.evaluate(x, target=y, loss_fn="cross_entropy") == pytest.approx(got)


def _bn_replicas_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16),
                         nn.BatchNorm1d(16), nn.Linear(16, 4))


def _bn_replicas_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=generator), torch.randint(0, 4, (16,),
                                                                  generator=generator)


def _bn_replica_statistics(rank: int, world: int) -> dict:
    """Each rank's running statistics after one step of 2 stages x 2 replicas, with the
    statistics updated per micro-batch and deferred to the batch."""
    x, y = _bn_replicas_batch()
    out = {}
    for deferred in (False, True):
        program = fxpipe.compile(_bn_replicas_net(), (x,), stages=2, chunks=2, replicas=2,
                                 deferred_batch_norm=deferred, split_points=["3"],
                                 profile="a100")
        program.step(x, target=y)
        out[deferred] = {k: v.clone() for k, v in program.state_dict().items()
                         if k.endswith(("running_mean", "running_var"))}
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_replicas_of_a_stage_hold_the_same_batch_norm_statistics():
    ranks = spawn(4, __name__, "_bn_replica_statistics", timeout=120, bound=400)
    x, _ = _bn_replicas_batch()
    # per micro-batch: each replica's statistics over its micro-batches, averaged
    replicas = []
    for share in x.chunk(2):
        net = _bn_replicas_net().train()
        for micro in share.chunk(2):
            net(micro)
        replicas.append({k: v for k, v in net.state_dict().items()
                         if k.endswith(("running_mean", "running_var"))})
    averaged = {k: (replicas[0][k] + replicas[1][k]) / 2 for k in replicas[0]}
    # deferred: the first BatchNorm's statistics are the whole batch's
    whole = _bn_replicas_net().train()
    whole(x)
    for deferred, expected in ((False, averaged), (True, whole.state_dict())):
        for stage in (0, 1):  # rank r holds stage r % 2, replica r // 2
            first, second = ranks[stage][deferred], ranks[stage + 2][deferred]
            assert first.keys() == second.keys() and first
            for key in first:
                torch.testing.assert_close(first[key], second[key], rtol=0, atol=0)
                if not deferred or key.startswith("1."):
                    torch.testing.assert_close(first[key], expected[key], msg=key)

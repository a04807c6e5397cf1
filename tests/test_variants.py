"""One program in train and eval mode and for inputs of other shapes (fxpipe.variants).

The other mode, or other lengths, is the model captured again for them and cut where the
program is cut, on the stages' own tensors: each test compares it with the plain model in the
same mode on the same inputs (outputs, losses, gradients, BatchNorm's running statistics as
training left them), in one process and on two ranks.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from gpt_batches import assert_ranks_match_plain, plain_step, tokens
from ranks import spawn
from test_training_semantics import DropPath
from torch import nn

import fxpipe
from fxpipe import ir, variants
from fxpipe.errors import ConfigError
from fxpipe.models import gpt
from fxpipe.testing.reference_step import reference_step


class _Net(nn.Module):
    """Dropout, stochastic depth and BatchNorm: each computes otherwise in eval mode."""

    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(p)
        self.path = DropPath(p)
        self.b = nn.Linear(16, 16)
        self.bn2 = nn.BatchNorm1d(16)
        self.c = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(F.relu(self.bn(self.a(x))))
        x = x + self.path(F.relu(self.bn2(self.b(x))))
        return self.c(x)


def _case(p: float = 0.3) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return _Net(p), torch.randn(16, 8), torch.randint(0, 3, (16,))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_eval_mode_computes_the_plain_model_in_eval_mode_and_train_mode_trains_as_before():
    model, x, y = _case()
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, split_points=["b"])
    params = list(program.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    for _ in range(2):  # train, eval, train again, eval again: the other mode made once
        torch.manual_seed(7)
        loss = program.step(x, target=y)
        torch.manual_seed(7)
        assert loss == pytest.approx(reference_step(program, plain, x, target=y), rel=1e-6)
        ours, theirs = _grads(model), _grads(plain)
        assert ours.keys() == theirs.keys()
        for name, grad in theirs.items():
            torch.testing.assert_close(ours[name], grad, msg=name)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for p in plain.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        program.eval()
        plain.eval()
        with torch.no_grad():
            torch.testing.assert_close(program(x), plain(x))  # no dropout, no dropped path
            assert program.evaluate(x, target=y) == \
                pytest.approx(float(F.cross_entropy(plain(x), y)), rel=1e-6)
        assert not program.built.capture_info.training
        if _ == 0:
            eval_built = program.built
        assert program.built is eval_built
        assert list(program.parameters()) == params  # the optimizer's, still
        assert model.training  # the model keeps its own mode
        program.train()
        plain.train()
    for name, buffer in plain.named_buffers():  # running statistics: the steps', shared
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer, msg=name)
    program(x)  # the mode changes at the next call
    assert program.built.capture_info.training


def test_a_lazy_program_put_in_eval_mode_is_captured_once_in_eval_mode():
    model, x, _ = _case()
    model.bn2.eval()  # a module of the user's own mode: left as it is
    plain = copy.deepcopy(model).eval()
    program = fxpipe.compile(model, stages=2, chunks=2).eval()
    with torch.no_grad():
        torch.testing.assert_close(program(x), plain(x))
    assert not program.built.capture_info.training
    assert not program._variants.made  # noqa: SLF001 (one capture, in the program's mode)
    assert model.training and not model.bn2.training


def test_inference_mode_compiles_the_eval_program_and_a_batch_made_in_it_trains_after():
    model, x, y = _case()
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, split_points=["b"]).eval()
    with torch.inference_mode():  # the eval plan is captured here, outside inference mode
        out = program(x)
        assert out.is_inference()
        torch.testing.assert_close(out, plain.eval()(x))
    lazy_model = copy.deepcopy(plain).train()
    lazy = fxpipe.compile(lazy_model, stages=2, chunks=2, split_points=["b"])
    with torch.inference_mode():  # built on a batch made in inference mode
        batch = x.clone()
        lazy(batch)
    torch.manual_seed(7)
    loss = lazy.step(x, target=y)
    lazy.rebalance()  # trains on the kept example batch, which must not be an inference tensor
    torch.manual_seed(7)
    assert loss == pytest.approx(reference_step(lazy, plain.train(), x, target=y), rel=1e-6)


@pytest.mark.parametrize("off", [torch.no_grad, torch.inference_mode])
def test_a_step_with_gradients_off_says_so(off):
    model, x, y = _case()
    program = fxpipe.compile(model, (x,), stages=2, chunks=2)
    with off(), pytest.raises(ConfigError, match=r"step\(\) trains .* with gradients off") as e:
        program.step(x, target=y)
    assert "program.evaluate" in e.value.hint
    assert all(p.grad is None for p in model.parameters())


class _ReadsAheadInEval(nn.Module):
    """In eval mode the first layer adds the last layer's bias: a tensor of another stage."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if not self.training:
            x = x + self.d.bias.sum()
        return self.d(self.c(self.b(x)))


def test_a_mode_that_needs_another_stage_s_tensor_is_refused_and_the_program_still_runs():
    torch.manual_seed(0)
    model, x = _ReadsAheadInEval(), torch.randn(8, 8)
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, split_points=["c"])
    program.eval()
    with pytest.raises(ConfigError) as err:
        program(x)
    message = str(err.value)
    assert "for eval mode stage 0 reads d.bias, which stage 1 holds" in message
    assert "compile a program for them" in message
    program.train()
    torch.testing.assert_close(program(x), plain(x))


def _modes_on_two_ranks(rank: int, world: int) -> dict:
    """Per schedule: evaluate() in eval mode, two steps in train mode with SGD, evaluate()
    after each; this rank's parameters at the end."""
    out = {}
    for schedule in ("1f1b", "zb-h1"):
        model, x, y = _case(p=0.0)
        program = fxpipe.compile(model, (x,), stages=world, chunks=4, schedule=schedule,
                                 profile="a100", split_points=["b"])
        optimizer = torch.optim.SGD(program.parameters(), lr=0.1)
        losses = [program.eval().evaluate(x, target=y)]
        for _ in range(2):
            losses.append(program.train().step(x, target=y))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(program.eval().evaluate(x, target=y))
        out[schedule] = {"losses": losses,
                         "params": {n: p.detach().clone() for n, p in program.named_parameters()}}
    return out


@pytest.mark.distributed
def test_on_two_ranks_eval_and_train_mode_alternate_as_the_plain_model_s():
    ranks = spawn(2, __name__, "_modes_on_two_ranks", timeout=120, bound=400)
    model, x, y = _case(p=0.0)
    want = []
    with torch.no_grad():
        want.append(float(F.cross_entropy(model.eval()(x), y)))
    for _ in range(2):
        model.train()  # BatchNorm over each micro-batch, as the pipeline's
        loss = sum(F.cross_entropy(model(xs), ys) for xs, ys in zip(x.chunk(4), y.chunk(4))) / 4
        loss.backward()
        want.append(float(loss))
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
            want.append(float(F.cross_entropy(model.eval()(x), y)))
    plain = dict(model.named_parameters())
    for result in ranks:
        for schedule, run in result.items():
            assert run["losses"] == pytest.approx(want, rel=1e-5), schedule
            assert run["params"]
            for name, value in run["params"].items():
                torch.testing.assert_close(value, plain[name].detach(), msg=name)


def test_write_writes_the_program_s_mode_for_its_example_whatever_the_last_call_ran(tmp_path):
    model, x, y = _case()
    fresh = fxpipe.compile(copy.deepcopy(model), (x,), stages=2, chunks=2, split_points=["b"])
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, split_points=["b"])
    with torch.no_grad():
        program.eval()(x[:8])  # the last call: eval mode, another batch size
    program.train()
    stages = [f"stage_{i}.py" for i in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as compiled: nothing to say
        program.write(str(tmp_path / "after"), target=y, loss_fn="cross_entropy",
                      reference_steps=0)
    fresh.write(str(tmp_path / "fresh"), target=y, loss_fn="cross_entropy", reference_steps=0)
    for name in stages:  # dropout, stochastic depth and BatchNorm as in train mode
        assert (tmp_path / "after" / name).read_text() == (tmp_path / "fresh" / name).read_text()
    program.eval()
    with pytest.warns(UserWarning, match="writing the program in eval mode.*program.train"):
        program.write(str(tmp_path / "eval"), target=y, loss_fn="cross_entropy",
                      reference_steps=0)
    assert (tmp_path / "eval" / stages[0]).read_text() != \
        (tmp_path / "fresh" / stages[0]).read_text()


def test_a_cut_given_as_node_counts_carries_over_to_the_other_mode_s_graph():
    model, x, _ = _case()
    plain = copy.deepcopy(model).eval()
    # the train graph's node counts, BatchNorm's batch counters included: the second stage
    # starts at bn2's counter, which the eval graph has not
    names = [n.name for n in ir.compute_nodes(fxpipe.capture(copy.deepcopy(model), (x,)).graph)]
    at = names.index("bn2_add_")
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, balance=[at, len(names) - at])
    assert program.plan.stages[1].nodes[0] == "bn2_add_"
    with torch.no_grad():
        torch.testing.assert_close(program.eval()(x), plain(x))
    assert program.plan.stages[1].nodes[0] == "bn2"  # the same place in the same module


def test_other_lengths_compile_once_each_and_train_as_the_plain_model():
    torch.manual_seed(0)
    model, (idx,) = gpt.build(batch=8, dropout=0.0)  # 32 tokens
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (idx,), stages=2, chunks=4, profile="a100")
    params = list(program.parameters())
    made = {}
    for i, (batch, length) in enumerate([(8, 16), (8, 32), (8, 16), (7, 24)]):
        x, y = tokens(batch, length, i)
        model.zero_grad()
        plain.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = program.step(x, target=y)
        new = [str(w.message) for w in caught if "compiling the program again" in str(w.message)]
        assert len(new) == (length not in made and length != 32), (length, new)
        made.setdefault(length, program.built)
        assert program.built is made[length]  # each length's plan made once
        assert loss == pytest.approx(plain_step(plain, x, y), rel=1e-6)
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=f"{batch} x {length}: {name}")
        assert list(program.parameters()) == params
    x, _ = tokens(8, 16, 9)
    with torch.no_grad():
        torch.testing.assert_close(program.eval()(x), plain.eval()(x))


def test_plans_of_many_lengths_are_kept_for_the_last_few_and_a_dropped_one_is_made_again(
        monkeypatch):
    monkeypatch.setattr(variants, "KEPT", 2)
    torch.manual_seed(0)
    model, (idx,) = gpt.build(batch=8, dropout=0.0)  # 32 tokens
    plain = copy.deepcopy(model)
    program = fxpipe.compile(model, (idx,), stages=2, chunks=4, profile="a100")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, length in enumerate([16, 24, 20, 16, 32]):
            x, y = tokens(8, length, i)
            model.zero_grad()
            plain.zero_grad()
            loss = program.step(x, target=y)
            assert len(program._variants.made) <= 2  # the installed plan besides
            assert loss == pytest.approx(plain_step(plain, x, y), rel=1e-6)
            for (name, p), q in zip(model.named_parameters(), plain.parameters()):
                torch.testing.assert_close(p.grad, q.grad, msg=f"{length}: {name}")
    texts = [str(w.message) for w in caught]
    dropped = [t for t in texts if "keeps the plans of the last ones" in t]
    assert len(dropped) == 1 and "pad_to_multiple_of" in dropped[0], texts
    # 16 came back while kept; 32, the compiled length, had been dropped: made again
    again = [t for t in texts if "compiling the program again" in t]
    assert len(again) == 4 and "(B, 32)" in again[-1], again


LENGTHS = [(8, 16), (8, 32), (7, 24), (8, 16)]


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_other_lengths_on_two_ranks_train_and_evaluate_as_the_plain_model(schedule):
    ranks = spawn(2, "gpt_batches", "steps_on_ranks", schedule, 2, LENGTHS, True, timeout=120,
                  bound=400)
    assert_ranks_match_plain(ranks, LENGTHS)

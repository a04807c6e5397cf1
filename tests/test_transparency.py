"""Transparency: the pipelined program computes the same function as the model (DESIGN.md).

These tests cover the local executor: every stage runs in this process. They compare outputs,
the loss and every parameter's gradient with an eager copy of the model in float32. They use
`torch.testing.assert_close` with its float32 defaults (rtol 1.3e-6, atol 1e-5), because
micro-batching only reorders the sums over the batch. The dropout test uses rtol=0, atol=0: two
programs that draw the same masks must agree bit for bit.

Modes: resnet is compared in eval mode, because BatchNorm in train mode normalises each
micro-batch with its own statistics. gpt is built with dropout=0.0 and compared in train mode,
because dropout draws different masks for a micro-batch than for the full batch. The other models
have neither and are compared in train mode.

The program shares the model's Parameter objects, so every comparison runs two deep copies of
the same model: one plain and one compiled.
"""
from __future__ import annotations

import copy
import functools
import importlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe.errors import NotBuiltError
from fxpipe.losses import default_loss
from fxpipe.models import MODELS
from fxpipe.models import load as load_model

REMATS = ("never", "always", "except_last")
STAGES = (1, 2, 3)
CHUNKS = 4
PROFILE = "a100"  # a preset: skips the CPU micro-benchmark (fast and deterministic)


@dataclass
class Case:
    model: torch.nn.Module
    inputs: tuple
    kwargs: dict[str, torch.Tensor]
    target: torch.Tensor


@dataclass(frozen=True)
class Reference:
    output: Any
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]


def make_case(name: str, **overrides: Any) -> Case:
    model, inputs, kwargs = load_model(name, deterministic=True, **overrides)
    target = importlib.import_module(f"fxpipe.models.{name}").target(inputs)
    return Case(model, inputs, kwargs, target)


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient, under every name (a tied weight appears under both names)."""
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


@functools.cache
def reference(name: str) -> Reference:
    """The plain model run eagerly on the full batch (a copy; tests must not modify it)."""
    case = make_case(name)
    model = copy.deepcopy(case.model)
    output = model(*case.inputs, **case.kwargs)
    loss = default_loss(output, case.target)
    loss.backward()
    grads = {n: None if g is None else g.detach().clone() for n, g in grads_of(model).items()}
    return Reference(_detach(output), loss.detach(), grads)


def _detach(output: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda t: t.detach(), output)


def assert_grads_equal(model: torch.nn.Module, expected: dict[str, torch.Tensor | None],
                       **tolerance: float) -> None:
    actual = grads_of(model)
    assert actual.keys() == expected.keys()
    missing = [n for n, g in actual.items() if g is None and expected[n] is not None]
    assert not missing, f"parameters without a gradient: {missing}"
    for name, grad in actual.items():
        torch.testing.assert_close(grad, expected[name], **tolerance,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")


def compile_case(case: Case, **options: Any) -> Any:
    options = {"chunks": CHUNKS, "profile": PROFILE, **options}
    return fxpipe.compile(case.model, case.inputs, example_kwargs=case.kwargs, **options)


# -- outputs, loss and gradients: every model x stages x remat ----------------------------------


@pytest.mark.parametrize("remat", REMATS)
@pytest.mark.parametrize("stages", STAGES, ids=lambda s: f"{s}stages")
@pytest.mark.parametrize("name", MODELS)
def test_program_matches_model_outputs_loss_and_every_gradient(name, stages, remat):
    case = make_case(name)
    expected = reference(name)
    program = compile_case(case, stages=stages, remat=remat)
    assert len(program.stages) == stages

    output = program(*case.inputs, **case.kwargs)
    loss = default_loss(output, case.target)
    loss.backward()

    torch.testing.assert_close(_detach(output), expected.output)
    torch.testing.assert_close(loss.detach(), expected.loss)
    assert_grads_equal(case.model, expected.grads)


# -- training -----------------------------------------------------------------------------------


def _train_plain(case: Case, optimizer_cls: type, steps: int, **options: Any) -> list[float]:
    optimizer = optimizer_cls(case.model.parameters(), **options)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = default_loss(case.model(*case.inputs, **case.kwargs), case.target)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def _train_program(program: Any, case: Case, optimizer_cls: type, steps: int,
                   **options: Any) -> list[float]:
    optimizer = optimizer_cls(program.parameters(), **options)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = program.step(*case.inputs, target=case.target, **case.kwargs)
        assert isinstance(loss, float)
        optimizer.step()
        losses.append(loss)
    return losses


def _assert_states_equal(actual: torch.nn.Module, expected: torch.nn.Module) -> None:
    expected_state = expected.state_dict()
    for key, value in actual.state_dict().items():
        torch.testing.assert_close(value, expected_state[key],
                                   msg=lambda m, key=key: f"{key} after training: {m}")


@pytest.mark.parametrize("name", MODELS)
def test_three_sgd_steps_on_the_program_train_the_model_like_plain_training(name):
    # 2 micro-batches (the grid above uses 4) and momentum, so later steps depend on earlier ones.
    plain = make_case(name)
    piped = make_case(name)
    piped.model = copy.deepcopy(plain.model)
    program = compile_case(piped, stages=2, chunks=2, remat="except_last")

    sgd = dict(lr=0.05, momentum=0.9)
    losses = _train_program(program, piped, torch.optim.SGD, 3, **sgd)
    expected_losses = _train_plain(plain, torch.optim.SGD, 3, **sgd)

    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses))
    assert losses[2] < losses[0]  # it really trained
    _assert_states_equal(piped.model, plain.model)


def test_gpt_tied_embedding_split_over_first_and_last_stage_trains_like_the_model():
    plain = make_case("gpt")
    piped = make_case("gpt")
    piped.model = copy.deepcopy(plain.model)
    assert piped.model.lm_head.weight is piped.model.wte.weight
    program = compile_case(piped, stages=3, remat="except_last")
    holders = [s.index for s in program.stages
               if "wte.weight" in program.module_of(s.index).named_model_tensors()]
    assert holders == [0, 2]

    adam = dict(lr=1e-3)
    losses = _train_program(program, piped, torch.optim.Adam, 3, **adam)
    expected_losses = _train_plain(plain, torch.optim.Adam, 3, **adam)

    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses))
    assert piped.model.lm_head.weight is piped.model.wte.weight  # still one Parameter
    _assert_states_equal(piped.model, plain.model)
    assert not torch.equal(piped.model.wte.weight, make_case("gpt").model.wte.weight)  # it moved


# -- dropout with remat -------------------------------------------------------------------------


def test_dropout_draws_the_same_masks_with_and_without_remat():
    # gpt in train mode with dropout=0.1: remat recomputes the forward pass in backward, which
    # must redraw the very same masks. The two programs must agree bit for bit.
    case = make_case("gpt", dropout=0.1)
    other = make_case("gpt", dropout=0.1)
    other.model = copy.deepcopy(case.model)
    recompute = compile_case(case, stages=2, remat="always")
    keep = compile_case(other, stages=2, remat="never")

    results = []
    for program, c in [(recompute, case), (keep, other)]:
        torch.manual_seed(1)
        output = program(*c.inputs)
        default_loss(output, c.target).backward()
        results.append(output.detach())

    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    assert_grads_equal(case.model, grads_of(other.model), rtol=0, atol=0)
    with torch.no_grad():  # the comparison is not vacuous: dropout is active
        torch.manual_seed(2)
        assert not torch.equal(keep(*other.inputs), results[1])


# -- building lazily, devices -------------------------------------------------------------------


def test_compile_without_example_inputs_builds_on_the_first_call():
    case = make_case("branchy")  # positional and keyword inputs: the first call supplies both
    program = fxpipe.compile(case.model, stages=2, chunks=CHUNKS, profile=PROFILE)
    assert not program.is_built
    with pytest.raises(NotBuiltError, match=r"call it once.*or pass example_inputs"):
        program.report()

    output = program(*case.inputs, **case.kwargs)
    assert program.is_built
    loss = default_loss(output, case.target)
    loss.backward()

    expected = reference("branchy")
    torch.testing.assert_close(_detach(output), expected.output)
    torch.testing.assert_close(loss.detach(), expected.loss)
    assert_grads_equal(case.model, expected.grads)
    program.report()


class _KeywordsOnly(torch.nn.Module):
    """A model that takes keywords only, as a Hugging Face model is called."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, *, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(features))) * mask


def test_compile_with_keyword_inputs_alone_builds_from_them():
    torch.manual_seed(0)
    model = _KeywordsOnly()
    plain = copy.deepcopy(model)
    kwargs = {"features": torch.randn(8, 8), "mask": (torch.rand(8, 4) > 0.3).float()}
    program = fxpipe.compile(model, example_kwargs=kwargs, stages=2, chunks=CHUNKS,
                             profile=PROFILE)
    assert program.is_built  # the example batch is given: no waiting for a first call
    assert program.report().stages[0]["params_bytes"] > 0

    output = program(**kwargs)
    expected = plain(**kwargs)
    torch.testing.assert_close(output, expected)
    output.square().mean().backward()
    expected.square().mean().backward()
    for (name, got), want in zip(model.named_parameters(), plain.parameters()):
        assert got.grad is not None, name
        torch.testing.assert_close(got.grad, want.grad)


def test_explicit_cpu_devices_with_measured_profile_are_transparent():
    # The one test that measures the CPU profile (profile=None) instead of using a preset.
    case = make_case("mlp")
    program = fxpipe.compile(case.model, case.inputs, stages=2, chunks=CHUNKS,
                             devices=["cpu", "cpu"])
    assert [{p.device.type for p in program.module_of(s.index).parameters()}
            for s in program.stages] == [{"cpu"}] * 2

    output = program(*case.inputs)
    loss = default_loss(output, case.target)
    loss.backward()

    expected = reference("mlp")
    torch.testing.assert_close(output.detach(), expected.output)
    torch.testing.assert_close(loss.detach(), expected.loss)
    assert_grads_equal(case.model, expected.grads)


# -- state in the model's names -----------------------------------------------------------------

STATE_KEYS_CASES = [
    "gpt",  # 3 stages, tied: wte.weight (stage 0) and lm_head.weight (stage 2)
    "resnet",  # BatchNorm counters no stage reads in eval mode: carried with stage 0
]


@pytest.fixture(scope="module")
def state_programs() -> dict[str, tuple[Case, Any]]:
    """gpt (3 stages, tied) and resnet (2 stages, BatchNorm buffers), shared by the tests that
    only read their state."""
    out = {}
    for name, stages in [("gpt", 3), ("resnet", 2)]:
        case = make_case(name)
        out[name] = (case, compile_case(case, stages=stages))
    return out


def test_program_parameters_are_the_models_own_parameter_objects(state_programs):
    case, program = state_programs["gpt"]
    assert {id(p) for p in program.parameters()} == {id(p) for p in case.model.parameters()}


@pytest.mark.parametrize("name", STATE_KEYS_CASES)
def test_state_dict_has_exactly_the_models_keys(state_programs, name):
    case, program = state_programs[name]
    assert sorted(program.state_dict()) == sorted(case.model.state_dict())


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_state_dict_loads_into_a_fresh_plain_model_with_the_same_outputs(state_programs, name):
    case, program = state_programs[name]
    fresh = make_case(name, seed=1).model  # other weights
    with torch.no_grad():
        expected = program(*case.inputs)
        assert not torch.equal(fresh(*case.inputs), expected)
        fresh.load_state_dict(program.state_dict())  # strict
        torch.testing.assert_close(fresh(*case.inputs), expected)


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_load_state_dict_makes_the_program_compute_the_other_models_function(name):
    case = make_case(name)
    program = compile_case(case, stages=3 if name == "gpt" else 2)
    other = make_case(name, seed=1).model
    with torch.no_grad():
        expected = other(*case.inputs)
        assert not torch.equal(program(*case.inputs), expected)
        program.load_state_dict(other.state_dict())
        torch.testing.assert_close(program(*case.inputs), expected)
    # the program's tensors are the model's own: the model now holds the other model's weights
    for key, value in other.state_dict().items():
        torch.testing.assert_close(case.model.state_dict()[key], value, rtol=0, atol=0)
    if name == "gpt":
        assert case.model.lm_head.weight is case.model.wte.weight

"""Transparency on random DAG models (fxpipe.tools.fuzz), and regressions the fuzzer found.

The hypothesis tests compile random models (30 in the fast tier, 200 in the slow one): 1-3
inputs, Linear/LayerNorm/activations/Dropout, residuals, long skips, add/mul/cat merges, tied
and reused weights, an optional keyword input, tensor/tuple/dict outputs, with random stages,
chunks and remat. Each compares outputs, loss and every gradient with the plain model
(fxpipe.testing.transparency.check_transparent: float32, default assert_close tolerances,
differences explained by float32 rounding against float64 excepted). Models with active dropout
are compared in eval mode, and in train mode between remat and no remat (same masks); the
others in the mode the generator chose. derandomize=True: CI runs the same examples every time.

Each regression test is a small explicit model reproducing one failure the fuzzer found.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

import fxpipe
from fxpipe.testing.transparency import check_transparent
from fxpipe.tools import fuzz
from fxpipe.tools.fuzz import models_and_configs, random_model, random_spec

# Features the hypothesis test leaves out while a bug they trigger is open (none now). The
# fuzzer found three, fixed and kept below as regression tests: in-place ops in the cost pass
# and at the start of remat regions ("relu_"), and inputs as wide as the batch that are not
# batched ("batch_sized_gate").
KNOWN_BUGS: tuple[str, ...] = ()


# -- the fuzzer ---------------------------------------------------------------------------------


_FUZZ = dict(deadline=None, derandomize=True, database=None,
             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=15, **_FUZZ)  # the slow tier runs 200 below
@given(models_and_configs(avoid=KNOWN_BUGS, max_layers=14))
def test_random_dag_models_compile_to_transparent_programs(example):
    example.check()


@pytest.mark.slow
@settings(max_examples=200, **_FUZZ)
@given(models_and_configs(avoid=KNOWN_BUGS, max_layers=14))
def test_every_random_dag_model_compiles_to_a_transparent_program(example):
    example.check()


def test_random_model_is_deterministic_for_a_seed():
    for seed in range(50):
        model_a, inputs_a, kwargs_a = random_model(seed)
        model_b, inputs_b, kwargs_b = random_model(seed)
        assert model_a.spec == model_b.spec
        state_b = model_b.state_dict()
        for key, value in model_a.state_dict().items():
            assert torch.equal(value, state_b[key]), key
        assert all(torch.equal(a, b) for a, b in zip(inputs_a, inputs_b))
        assert kwargs_a.keys() == kwargs_b.keys()
        assert all(torch.equal(kwargs_a[k], kwargs_b[k]) for k in kwargs_a)
        assert model_a.training == model_b.training
    assert random_spec(0) != random_spec(1)


def test_random_models_exercise_every_feature():
    specs = [random_spec(seed) for seed in range(50)]
    counts: dict[str, int] = {}
    for spec in specs:
        for feature in spec.features():
            counts[feature] = counts.get(feature, 0) + 1
    for feature in ["tied", "skip_edge", "several_inputs", "dict_output", "tuple_output",
                    "tensor_output", "keyword_input", "residual_or_merge_add", "cat", "mul",
                    "layernorm", "dropout", "dropout_active", "several_outputs", "eval_mode"]:
        assert counts.get(feature, 0) >= 1, (feature, counts)
    # the tied layer is far from the layer it ties to
    assert any(i - op.tie >= 3 for spec in specs for i, op in enumerate(spec.ops)
               if op.kind == "tied")
    for spec in specs:
        assert spec.param_count() < 20_000
        assert spec.batch in (4, 6, 8)
        assert 1 <= spec.n_inputs <= 3 and 1 <= len(spec.outputs) <= 3


def test_random_models_reach_the_rare_edge_cases():
    counts: dict[str, int] = {}
    for seed in range(300):
        for feature in random_spec(seed).features():
            counts[feature] = counts.get(feature, 0) + 1
    for feature in [*fuzz.EDGE_FEATURES, "reuse", "relu_"]:
        assert counts.get(feature, 0) >= 1, (feature, counts)


def test_tied_layers_share_one_parameter_and_dropout_models_are_in_eval_mode():
    for seed in range(200):
        model, _, _ = random_model(seed)
        for i, op in enumerate(model.spec.ops):
            if op.kind == "tied":
                assert model.layers[f"l{i}"].weight is model.layers[f"l{op.tie}"].weight
        if any(op.kind == "dropout" and op.p > 0 for op in model.spec.ops):
            assert not model.training


def test_random_models_trace_with_torch_fx():
    # forward is a Python loop over a constant plan: plain symbolic tracing unrolls it
    for seed in range(20):
        model, inputs, kwargs = random_model(seed)
        gm = torch.fx.symbolic_trace(model, concrete_args=None if kwargs else {"gate": None})
        torch.testing.assert_close(gm(*inputs, **kwargs), model(*inputs, **kwargs))


def test_avoid_leaves_features_out():
    for seed in range(100):
        spec = random_spec(seed, avoid=("tied", "reuse", "relu_", "gate", "aliased_inputs"))
        kinds = {op.kind for op in spec.ops}
        assert not kinds & {"tied", "reuse", "relu_", "gate"}
        assert spec.gate_width is None and not spec.aliased_inputs
    with pytest.raises(ValueError, match="unknown features"):
        random_spec(0, avoid=("no_such_feature",))


def test_check_transparent_catches_a_small_gradient_error(monkeypatch):
    # A "program" whose first weight gradient is 1e-4 too large must fail, even though the
    # rounding check consults float64: rounding explains 1e-7, not 1e-4.
    model, inputs, kwargs = random_model(3)
    real_compile = fxpipe.compile

    def wrong_compile(m, *args, **options):
        program = real_compile(m, *args, **options)
        for p in m.parameters():
            if p.requires_grad:
                p.register_hook(lambda g: g + 1e-4)
        return program

    check_transparent(model, inputs, kwargs, 2, 2, "always")  # the real program passes
    monkeypatch.setattr(fxpipe, "compile", wrong_compile)
    with pytest.raises(AssertionError, match=r"(?s)gradient of layers\.l\d+\.\w+ differs.*"
                       r"against float64"):
        check_transparent(model, inputs, kwargs, 2, 2, "always")


def test_fuzz_command_runs_examples_and_reports(capsys):
    assert fuzz.main(["--examples", "3", "--seed", "0", "--avoid", ",".join(KNOWN_BUGS)]) == 0
    out = capsys.readouterr().out
    assert "summary: 3 examples (seed 0), 0 failures" in out


# -- regressions found by the fuzzer ------------------------------------------------------------


class _InPlace(nn.Module):
    """Linear -> ReLU(inplace=True) -> Linear, as torchvision's ResNets and VGG write it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def test_inplace_activation_is_costed():
    # Every in-place form fails the same way: F.relu(inplace=True), x.relu_(), x.mul_(2) ...
    torch.manual_seed(0)
    model = _InPlace()
    x = torch.randn(4, 4)
    check_transparent(model, (x,), {}, stages=1, chunks=2, remat="never")


@pytest.mark.parametrize("remat", ["always", "except_last"])
def test_inplace_activation_at_the_start_of_a_remat_region(remat):
    torch.manual_seed(0)
    model = _InPlace()
    x = torch.randn(4, 4)
    # stage 1 starts at the in-place ReLU: it updates the received activation in place
    check_transparent(model, (x,), {}, stages=2, chunks=2, remat=remat, split_points=["act"])


class _Scaled(nn.Module):
    """fc(x) * scale, with scale (1, 6): one row broadcast over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc(x) * scale)


def test_broadcast_input_is_fine_when_its_width_differs_from_the_batch():
    torch.manual_seed(0)
    check_transparent(_Scaled(), (torch.randn(8, 4), torch.randn(1, 6)), {}, stages=2,
                      chunks=2, remat="always")


def test_broadcast_input_as_wide_as_the_batch():
    torch.manual_seed(0)
    check_transparent(_Scaled(), (torch.randn(6, 4), torch.randn(1, 6)), {}, stages=2,
                      chunks=2, remat="always")


class _OptionalGate(nn.Module):
    """A keyword input this model ignores (as a model may, for some configurations)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, *, gate: torch.Tensor | None = None) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x)))


def test_unused_input_as_wide_as_the_batch_lets_the_batch_size_change():
    torch.manual_seed(0)
    x, gate = torch.randn(6, 4), torch.randn(1, 6)
    # the first call (batch 6) is transparent; check_transparent's second call has batch 12
    check_transparent(_OptionalGate(), (x,), {"gate": gate}, stages=2, chunks=2, remat="never")

"""A model's own torch.autograd.Functions (fxpipe/frontend/custom_functions.py): a captured graph
keeps a Function's forward, not its backward, so one whose backward is not its forward's
derivative is refused, naming it; the two ways the refusal offers (an operator with its own
backward, a leaf module) train as the plain model, and so does a Function whose backward is
its forward's derivative."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import CaptureError
from fxpipe.testing.reference_step import reference_step


class _StraightThrough(torch.autograd.Function):
    """Rounds, and passes the gradient through as if it had not (quantization-aware training)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return grad


class _ReverseGradient(torch.autograd.Function):
    """The identity forward, the negated gradient backward (domain-adversarial training)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return -grad


class _Swish(torch.autograd.Function):
    """x * sigmoid(x) with a hand-written backward that is its derivative."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s * (1 + x * (1 - s)))


@torch.library.custom_op("fxpipe_test::straight_through", mutates_args=())
def _straight_through_op(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)


@_straight_through_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_straight_through_op.register_autograd(lambda ctx, grad: grad)


class _Quantize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _StraightThrough.apply(x)


class _Net(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.quantize = _Quantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x)) * 4
        if self.how == "functions":
            h = _ReverseGradient.apply(self.b(_StraightThrough.apply(h)))
        elif self.how == "leaf":
            h = self.b(self.quantize(h))
        elif self.how == "operator":
            h = self.b(_straight_through_op(h))
        else:  # "derivative"
            h = _Swish.apply(self.b(h))
        return self.c(h)


def _trains_as_the_plain_model(how: str, **options: object) -> None:
    torch.manual_seed(0)
    model = _Net(how)
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, **options)  # type: ignore[arg-type]
    loss = program.step(x, target=y, loss_fn="mse")
    expected = reference_step(program, plain, x, target=y, loss_fn="mse")
    assert loss == pytest.approx(expected, rel=1e-6)
    for (name, ours), theirs in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)


@pytest.mark.parametrize("capture", ["auto", "export"])
def test_functions_whose_backward_the_graph_cannot_keep_are_refused_naming_them(capture):
    torch.manual_seed(0)
    with pytest.raises(CaptureError) as err:
        fxpipe.compile(_Net("functions"), (torch.randn(8, 8),), stages=2, chunks=2,
                       capture=capture)
    message = str(err.value)
    assert "_StraightThrough" in message and "_ReverseGradient" in message
    assert "torch.library.custom_op" in message and "leaf_modules" in message


def test_the_function_in_a_leaf_module_trains_as_the_plain_model():
    _trains_as_the_plain_model("leaf", leaf_modules=[_Quantize], capture="fx")


@pytest.mark.parametrize("capture", ["auto", "export"])
def test_the_operator_with_its_own_backward_trains_as_the_plain_model(capture):
    _trains_as_the_plain_model("operator", capture=capture)


@pytest.mark.parametrize("capture", ["auto", "export"])
def test_a_function_whose_backward_is_its_derivative_trains_as_the_plain_model(capture):
    _trains_as_the_plain_model("derivative", capture=capture)


def test_a_leaf_module_with_parameters_is_held_by_its_stage():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, capture="fx",
                             leaf_modules=[nn.Linear])
    assert any(n.op == "call_module" for st in program.built.stages
               for n in st.graph_module.graph.nodes)
    loss = program.step(x, target=y, loss_fn="mse")
    expected = reference_step(program, plain, x, target=y, loss_fn="mse")
    assert loss == pytest.approx(expected, rel=1e-6)
    for (name, ours), theirs in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)

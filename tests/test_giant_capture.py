"""Compiling a model built on the meta device: no weights allocated, the same plan as with them,
an explicit check instead of the eager comparison, clear errors for what needs data."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fxpipe
from fxpipe import ir
from fxpipe.errors import CaptureError, ConfigError
from fxpipe.models import gpt

CONFIG = {"vocab_size": 512, "seq_len": 32, "d_model": 64, "n_layer": 2, "n_head": 4,
          "dropout": 0.0}


def meta_gpt(**changes: int) -> nn.Module:
    with torch.device("meta"):
        return gpt.GPT(**{**CONFIG, **changes})


def twin() -> nn.Module:
    return gpt.GPT(**{**CONFIG, "d_model": 16, "n_layer": 1, "n_head": 2})


IDX = torch.randint(512, (8, 32), generator=torch.Generator().manual_seed(0))


def _real(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_meta and not isinstance(t, FakeTensor)


class Allocations(TorchDispatchMode):
    """Bytes of every storage an operation creates on a real device (not meta, not fake)."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if _real(t)}
        for t in tree_leaves(out):
            if _real(t) and t.untyped_storage().data_ptr() not in inputs:
                self.nbytes += t.untyped_storage().nbytes()
        return out


def test_a_meta_model_without_a_check_is_an_error_naming_both_alternatives():
    with pytest.raises(CaptureError, match="meta device") as error:
        fxpipe.compile(meta_gpt(), (IDX,), stages=2, profile="a100")
    assert "check=twin" in str(error.value) and "check='shapes'" in str(error.value)


def test_a_meta_model_compiles_to_the_plan_and_code_of_the_same_model_with_weights():
    real = fxpipe.compile(gpt.GPT(**CONFIG), (IDX,), stages=2, chunks=4, profile="a100")
    allocations = Allocations()
    with allocations:
        meta = fxpipe.compile(meta_gpt(), (IDX,), stages=2, chunks=4, profile="a100",
                              check="shapes")
    assert allocations.nbytes < 4096  # the model has 540 KB of weights; none is allocated
    assert meta.plan.balance == real.plan.balance
    code = [s.source.partition("from __future__")[2] for s in meta.stages]  # after the header
    assert code == [s.source.partition("from __future__")[2] for s in real.stages]
    assert "check='shapes'" in meta.stages[0].source  # the header says how it was compiled
    real_costs = {n.name: ir.cost(n) for n in ir.compute_nodes(real.graph_module.graph)}
    meta_costs = {n.name: ir.cost(n) for n in ir.compute_nodes(meta.graph_module.graph)}
    assert meta_costs == real_costs  # the cost pass ran its fake tensors on the meta device
    info = meta.graph_module.meta[ir.CAPTURE]
    assert "shapes and dtypes" in info.checked and "not checked" in info.checked
    assert all(p.is_meta for p in meta.parameters())


def test_a_twin_checks_the_capture_on_values_and_finds_the_batch_dimension():
    program = fxpipe.compile(meta_gpt(), (IDX,), stages=2, chunks=4, profile="a100",
                             check=twin())
    info = program.graph_module.meta[ir.CAPTURE]
    assert info.checked.startswith("values on the twin GPT")
    assert info.method == "fx" and info.signature.input_batch_dims == (0,)
    assert "check=GPT(...)" in program.stages[0].source


def test_example_inputs_may_be_meta_tensors_too():
    program = fxpipe.compile(meta_gpt(), (IDX.to("meta"),), stages=2, chunks=4, profile="a100",
                             check="shapes")
    assert program.plan.microbatch_size == 2


def test_checks_that_do_not_fit_the_model_are_refused():
    with pytest.raises(ConfigError, match="for models on the meta device"):
        fxpipe.compile(gpt.GPT(**CONFIG), (IDX,), profile="a100", check="shapes")
    with pytest.raises(ConfigError, match="twin GPT is on the meta device"):
        fxpipe.compile(meta_gpt(), (IDX,), profile="a100", check=meta_gpt())
    with pytest.raises(ConfigError, match="example inputs, and they are meta"):
        fxpipe.compile(meta_gpt(), (IDX.to("meta"),), profile="a100", check=twin())
    with pytest.raises(ConfigError, match="unknown check 'values'"):
        fxpipe.compile(meta_gpt(), (IDX,), profile="a100", check="values")
    with pytest.raises(ConfigError, match="balance='time'"):
        fxpipe.compile(meta_gpt(), (IDX,), profile="a100", check="shapes", balance="time")


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y[y > 0].sum() * x  # a boolean mask: its size depends on the values


def test_an_operation_that_needs_values_is_named_with_its_source_line():
    with torch.device("meta"):
        model = Gated()
    with pytest.raises(CaptureError, match="cannot run on the meta device") as error:
        fxpipe.compile(model, (torch.randn(4, 4),), profile="a100", check="shapes")
    message = str(error.value)
    assert "nonzero" in message
    assert "test_giant_capture.py" in message and "y[y > 0]" in message


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


def test_a_meta_lstm_is_costed_on_fake_tensors_and_runs_once_initialized():
    with torch.device("meta"):
        model = Recurrent()
    x = torch.randn(4, 5, 8)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, profile="a100", check="shapes")
    program.init_weights()
    assert program(x).shape == (4, 5, 4)

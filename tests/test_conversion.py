"""Dtype and device conversions of a program: a float64 model compiles (its profile measured in
float64) and trains as the plain model; a built program refuses a conversion its stage code was
not generated for, and an unbuilt one converts the model it will be built from."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import ConfigError
from fxpipe.profile.measure import measure


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.lstm = nn.LSTM(12, 12, batch_first=True)
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.lstm(torch.relu(self.inp(x)))[0]))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def test_a_float64_profile_rates_the_classes_it_has_no_kernel_for_as_matmul():
    # in float64 on CPU an LSTM runs as matmuls and gates, no fused recurrent kernel
    profile = measure("cpu", dtype=torch.float64, link=False, overheads=False, budget=0.2)
    assert profile.rate("recurrent") == profile.rate("matmul")
    assert "recurrent at matmul's rates: no kernel of its own ran in float64" in profile.source
    assert profile.rate("elementwise") != profile.rate("matmul")


def test_a_float64_model_trains_as_the_plain_model():
    torch.manual_seed(0)
    model = _Recurrent().double()
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 5, 6, dtype=torch.float64), torch.randn(8, 5, 3, dtype=torch.float64)
    program = fxpipe.compile(model, (x,), stages=2, chunks=4, profile="h100")
    loss = program.step(x, target=y, loss_fn=nn.functional.mse_loss)
    expected = nn.functional.mse_loss(plain(x), y)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    for (name, got), want in zip(model.named_parameters(), plain.parameters()):
        assert got.grad is not None and got.grad.dtype == torch.float64, name
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("convert, into", [
    (lambda p: p.double(), "torch.float64 on cpu"),
    (lambda p: p.half(), "torch.float16 on cpu"),
    (lambda p: p.to(torch.bfloat16), "torch.bfloat16 on cpu"),
    (lambda p: p.to("meta"), "torch.float32 on meta"),
])
def test_a_built_program_refuses_a_conversion_its_stage_code_was_not_generated_for(convert,
                                                                                   into):
    model, x = _mlp(), torch.randn(8, 8)
    program = fxpipe.compile(model, (x,), stages=2, chunks=4)
    before = {k: v.clone() for k, v in program.state_dict().items()}
    with pytest.raises(ConfigError, match=f"float32 tensors on cpu into {into}") as error:
        convert(program)
    assert "compile it again" in error.value.hint and "autocast='bf16'" in error.value.hint
    for k, v in program.state_dict().items():  # nothing was converted
        assert v.dtype == torch.float32 and v.device.type == "cpu" and torch.equal(v, before[k])
    torch.testing.assert_close(program(x), model(x))


def test_conversions_that_change_nothing_leave_a_built_program_running():
    model, x = _mlp(), torch.randn(8, 8)
    program = fxpipe.compile(model, (x,), stages=2, chunks=4)
    assert program.float().to("cpu").to(torch.float32).cpu() is program
    torch.testing.assert_close(program(x), model(x))


def test_an_unbuilt_program_converts_the_model_it_is_built_from():
    model = _mlp()
    plain = copy.deepcopy(model).double()
    program = fxpipe.compile(model, stages=2, chunks=4, profile="h100").double()
    assert next(model.parameters()).dtype == torch.float64
    x = torch.randn(8, 8, dtype=torch.float64)
    out = program(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, plain(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("call", ["forward", "step", "evaluate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # as compiled, as converted
def test_a_model_converted_after_compiling_is_named_when_a_call_fails(call, dtype):
    model, x = _mlp(), torch.randn(8, 8)
    program = fxpipe.compile(model, (x,), stages=2, chunks=4)
    model[2].to(torch.bfloat16)  # converts the tensors the stages share with the model
    run = {"forward": lambda: program(x.to(dtype)),
           "step": lambda: program.step(x.to(dtype), target=torch.randn(8, 4, dtype=dtype)),
           "evaluate": lambda: program.evaluate(x.to(dtype), target=torch.randn(8, 4))}[call]
    with pytest.raises(ConfigError, match=r"the model was converted after compiling: 2\.weight "
                                          r"is torch\.bfloat16 on cpu \(and 1 more\), and its "
                                          r"stage's code was generated for torch\.float32 on "
                                          r"cpu") as error:
        run()
    assert "compile it again" in error.value.hint
    model[2].to(torch.float32)  # converted back: the program runs as compiled
    torch.testing.assert_close(program(x), model(x))

"""Training memory as it is held: each stage's weights, gradients and optimizer state, predicted
by the partition's memory model (fxpipe.optimizers), against what a real step allocates."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import ConfigError
from fxpipe.models import mlp
from fxpipe.optimizers import ADAM, OptimizerMemory, optimizer_memory

Make = Callable[[Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Make] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
}


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _held(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes a stage holds after a step: weights and buffers, gradients, optimizer state (its
    0-dim step counters aside: a few bytes per tensor, not per element)."""
    total = sum(_bytes(t) for t in [*module.parameters(), *module.buffers()])
    for p in module.parameters():
        total += _bytes(p.grad) if p.grad is not None else 0
        total += sum(_bytes(v) for v in optimizer.state.get(p, {}).values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16-weights"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_predicted_weights_gradients_and_state_per_stage_are_what_a_step_holds(
        name: str, precision: str) -> None:
    model, (x,) = mlp.build(depth=4)
    y = mlp.target((x,))
    if precision == "bf16-weights":
        model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    make = OPTIMIZERS[name]
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, remat="never", profile="a100",
                             optimizer=name, autocast="bf16" if precision == "bf16-autocast"
                             else None)
    optimizer = make(program.parameters())
    program.step(x, target=y)
    optimizer.step()
    plans = program.plan.stages
    for stage, plan in zip(program.stages, plans):
        module = program.module_of(stage.index)
        assert module is not None
        measured = _held(module, optimizer)
        assert plan.held_bytes == pytest.approx(measured, rel=1e-6), (stage.index, name)
        assert plan.memory is not None and plan.memory >= plan.held_bytes
    # the optimizer enters the memory each stage is charged: Adam holds more than SGD
    if name != "sgd":
        sgd = fxpipe.compile(model, (x,), stages=2, chunks=2, remat="never", profile="a100",
                             optimizer="sgd")
        assert all(s.held_bytes < p.held_bytes for s, p in zip(sgd.plan.stages, plans))


def test_optimizer_memory_per_element() -> None:
    # fp32 weights: Adam's gradient and two moments are 12 bytes per element
    assert ADAM.held_bytes(4.0 * 10, 10) == 120
    # bf16 weights, mixed precision: bf16 gradient, fp32 master copy and two fp32 moments
    mixed = optimizer_memory("adam", master_weights=True)
    assert mixed.held_bytes(2.0 * 10, 10) == (2 + 4 + 2 * 4) * 10
    assert mixed.held_bytes(4.0 * 10, 10) == (4 + 2 * 4) * 10  # fp32 weights need no copy
    assert optimizer_memory("sgd").held_bytes(40, 10) == 40
    assert optimizer_memory(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1,
                                            momentum=0.9)).states == 1
    assert optimizer_memory(torch.optim.AdamW).states == 2
    assert optimizer_memory(torch.optim.Adam([nn.Parameter(torch.ones(1))],
                                             amsgrad=True)).states == 3
    assert optimizer_memory(6.0).held_bytes(40, 10) == 60
    assert isinstance(optimizer_memory(ADAM), OptimizerMemory)


def test_an_unknown_optimizer_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="(?s)unknown optimizer 'adamm'.*'adamw'"):
        optimizer_memory("adamm")
    with pytest.raises(ConfigError, match="LBFGS is not known"):
        optimizer_memory(torch.optim.LBFGS)
    with pytest.raises(ConfigError, match="a name, a torch.optim class"):
        optimizer_memory(lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ConfigError, match=">= 0"):
        optimizer_memory(-1.0)


def test_a_memory_limit_counts_the_optimizer_state() -> None:
    """A limit that fits the weights with SGD's gradients but not with Adam's moments."""
    model, (x,) = mlp.build(depth=4)
    sgd = fxpipe.compile(model, (x,), stages=2, chunks=2, remat="never", profile="a100",
                         optimizer="sgd")
    adam = fxpipe.compile(model, (x,), stages=2, chunks=2, remat="never", profile="a100")
    limit = max(s.memory or 0.0 for s in sgd.plan.stages) * 1.05
    assert limit < max(s.memory or 0.0 for s in adam.plan.stages)
    fxpipe.compile(model, (x,), stages=2, chunks=2, remat="never", profile="a100",
                   optimizer="sgd", memory_limit=limit)
    with pytest.raises(fxpipe.errors.PartitionError):
        fxpipe.compile(model, (x,), stages=2, chunks=2, remat="never", profile="a100",
                       memory_limit=limit)

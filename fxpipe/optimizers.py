"""What a training run holds for its optimizer, per parameter element: the memory model's input.

A parameter costs its own bytes, its gradient's (in the parameter's dtype, as autograd makes
it), the optimizer's state tensors, and under mixed precision with master weights a float32
copy of every parameter stored below float32. Adam keeps two moments, SGD with momentum one,
plain SGD none. Torch's optimizers keep their state in the parameter's dtype; mixed-precision
setups with master weights keep it in float32. The partition, remat="auto", schedule="auto",
the report and the planner all charge a stage `held_bytes` for its trainable parameters.

Sharded across R data-parallel replicas (compile(shard="optimizer"): ZeRO-1), each replica of a
stage holds 1/R of the states and of the master copy; its gradients stay whole. Under
shard="full" (FSDP2) it holds 1/R of the parameters and their gradients too between steps, but
a step gathers the stage's whole parameters and gradients beside the shards (one FSDP unit per
stage, gathered through the micro-batches): the memory the partition respects is that peak, so
"full" lowers no step's peak below "optimizer"; it frees memory between steps.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from fxpipe.errors import ConfigError

__all__ = ["OptimizerMemory", "OPTIMIZERS", "ADAM", "optimizer_memory"]

# name -> state tensors of the parameter's shape (Adafactor's factored moments are a row and a
# column per matrix: about nothing per element)
OPTIMIZERS: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2, "adamax": 2,
                              "nadam": 2, "radam": 2, "adagrad": 1, "rmsprop": 1,
                              "adafactor": 0}
_MASTER_BYTES = 4  # float32


@dataclass(frozen=True)
class OptimizerMemory:
    """The optimizer's per-element memory: `states` tensors of each parameter's shape, each
    `state_bytes` per element (0: the parameter's own dtype), and with `master_weights` a
    float32 copy of the parameters stored below float32. `extra_bytes`, when given instead,
    is the bytes per parameter element beyond the weight itself (gradient included)."""

    name: str = "adam"
    states: int = 2
    state_bytes: int = 0
    master_weights: bool = False
    extra_bytes: float | None = None
    shard: str = "none"  # what the replicas split (fxpipe.choices.SHARD_MODES)
    replicas: int = 1  # data-parallel replicas of each stage
    resting: bool = False  # what stays between steps, not what a step holds at its peak

    @property
    def share(self) -> float:
        """The part of the optimizer's state (and master copy) one replica holds."""
        return 1.0 / self.replicas if self.shard != "none" else 1.0

    def sharded(self, shard: str, replicas: int) -> OptimizerMemory:
        """This memory with its state split over `replicas` data-parallel replicas under
        `shard` ("none" keeps it whole)."""
        return replace(self, shard=shard, replicas=max(int(replicas), 1))

    def between_steps(self) -> OptimizerMemory:
        """This memory as it stays between steps (it differs under shard="full" only)."""
        return replace(self, resting=True)

    @property
    def weight_share(self) -> float:
        """The part of the parameters (and of their gradients) one replica holds. Under
        shard="full" a replica keeps its 1/R shard, and FSDP2 gathers its stage whole for the
        step (one unit per stage, kept gathered from the first forward to the last backward):
        1 + 1/R at the step's peak, 1/R between steps."""
        if self.shard != "full" or self.replicas == 1:
            return 1.0
        return self.share if self.resting else 1.0 + self.share

    def weight_bytes(self, param_bytes: float) -> float:
        """What one replica holds of parameters taking `param_bytes` in all."""
        return param_bytes * self.weight_share

    def held_bytes(self, grad_bytes: float, elements: float) -> float:
        """Bytes held beyond the weights for `elements` trainable parameter elements whose
        gradients take `grad_bytes`: the gradients, the states and the master copy."""
        if self.extra_bytes is not None:  # the gradient, then the rest (sharded)
            extra = self.extra_bytes * elements
            return min(extra, grad_bytes) * self.weight_share + \
                max(extra - grad_bytes, 0.0) * self.share
        own = grad_bytes  # the state in the parameter's dtype takes what its gradient takes
        state = self.states * (self.state_bytes * elements if self.state_bytes else own)
        low = grad_bytes < _MASTER_BYTES * elements  # stored below float32
        master = _MASTER_BYTES * elements if self.master_weights and low else 0.0
        return grad_bytes * self.weight_share + (state + master) * self.share

    def describe(self) -> str:
        what = " (the parameters and gradients too, between steps)" \
            if self.shard == "full" else ""
        sharded = f", sharded over {self.replicas} replica" \
            f"{'s' if self.replicas > 1 else ''}{what}" if self.shard != "none" else ""
        if self.extra_bytes is not None:
            return f"{self.extra_bytes:g} bytes per parameter beyond the weight{sharded}"
        dtype = f"float{8 * self.state_bytes}" if self.state_bytes else "the parameters' dtype"
        states = f"{self.states} state tensor{'s' if self.states != 1 else ''}" \
            if self.states else "no state"
        master = ", float32 master weights" if self.master_weights else ""
        return f"{self.name}: {states} in {dtype}{master}{sharded}"


ADAM = OptimizerMemory()
"""The default: torch's Adam, two moments in the parameters' dtype."""


def optimizer_memory(optimizer: Any = "adam", master_weights: bool = False) -> OptimizerMemory:
    """The memory of `optimizer`: a name of OPTIMIZERS, a torch.optim.Optimizer class or
    instance (an instance's momentum, betas and flags are read), an OptimizerMemory, or a number
    of bytes per parameter element beyond the weight. With `master_weights`, parameters stored
    below float32 also have a float32 copy, and the states are float32."""
    if isinstance(optimizer, OptimizerMemory):
        return optimizer
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        if not optimizer >= 0:
            raise ConfigError(f"optimizer bytes per parameter must be >= 0 (got {optimizer!r})",
                              hint="e.g. optimizer=12.0 for fp32 gradients and Adam's moments")
        return OptimizerMemory("custom", 0, 0, master_weights, float(optimizer))
    name, states = _known(optimizer)
    return OptimizerMemory(name, states, _MASTER_BYTES if master_weights else 0, master_weights)


def _known(optimizer: Any) -> tuple[str, int]:
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {optimizer!r}",
                              hint=f"use one of {sorted(OPTIMIZERS)}, a torch.optim class or "
                                   "instance, or bytes per parameter element")
        return key, OPTIMIZERS[key]
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if not issubclass(cls, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a name, a torch.optim class or instance, or bytes "
                          f"per parameter element (got {optimizer!r})",
                          hint=f"e.g. optimizer='adamw'; the names: {sorted(OPTIMIZERS)}")
    key = cls.__name__.lower()
    defaults: dict[str, Any] = getattr(optimizer, "defaults", {}) \
        if not isinstance(optimizer, type) else {}
    if key == "sgd":
        return ("momentum", 1) if defaults.get("momentum", 0) else ("sgd", 0)
    if key == "rmsprop":
        return key, 1 + bool(defaults.get("momentum", 0)) + bool(defaults.get("centered"))
    if key in ("adam", "adamw") and defaults.get("amsgrad"):
        return key, 3
    if key in OPTIMIZERS:
        return key, OPTIMIZERS[key]
    raise ConfigError(f"the memory of optimizer {cls.__name__} is not known",
                      hint="pass its state tensors per parameter as a name of "
                           f"{sorted(OPTIMIZERS)} or bytes per parameter element")

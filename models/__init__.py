"""Reference models for tests, examples and benchmarks; each module exposes build(**config)."""
from __future__ import annotations

import importlib
from typing import Any

MODELS = ("mlp", "gpt", "resnet", "unet", "branchy", "recurrent")


# What makes a model compute the same on any split of its batch, as exact comparisons with the
# plain model need: no dropout draws, and BatchNorm normalising with its running statistics
# (eval mode) instead of each micro-batch's own.
_DETERMINISTIC_CONFIG: dict[str, dict[str, Any]] = {"gpt": {"dropout": 0.0}}
_DETERMINISTIC_EVAL = {"resnet"}


def load(name: str, *, deterministic: bool = False, **config: Any) -> tuple[Any, tuple, dict]:
    """(model, example_inputs, example_kwargs) of the reference model `name`; `deterministic`
    sets the model up so that a pipeline of it must match it exactly (config still overrides)."""
    module = importlib.import_module(f"fxpipe.models.{name}")
    if deterministic:
        config = {**_DETERMINISTIC_CONFIG.get(name, {}), **config}
    model, inputs = module.build(**config)
    if deterministic and name in _DETERMINISTIC_EVAL:
        model.eval()
    kwargs = module.example_kwargs(inputs, **config) if hasattr(module, "example_kwargs") else {}
    return model, inputs, kwargs

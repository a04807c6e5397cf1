"""Reference models for tests, examples and benchmarks; each module exposes build(**config)."""
from __future__ import annotations

import importlib
from typing import Any

MODELS = ("mlp", "gpt", "resnet", "unet", "branchy", "recurrent")


def load(name: str, **config: Any) -> tuple[Any, tuple, dict]:
    """(model, example_inputs, example_kwargs) of the reference model `name`."""
    module = importlib.import_module(f"fxpipe.models.{name}")
    model, inputs = module.build(**config)
    kwargs = module.example_kwargs(inputs, **config) if hasattr(module, "example_kwargs") else {}
    return model, inputs, kwargs

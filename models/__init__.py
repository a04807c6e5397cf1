"""Reference models for tests, examples and benchmarks; each module exposes build(**config)."""
from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from typing import Any

import torch
from torch import nn

from fxpipe.choices import MODELS
from fxpipe.errors import ConfigError

__all__ = ["MODELS", "load", "load_factory"]



# What makes a model compute the same on any split of its batch, as exact comparisons with the
# plain model need: no dropout draws, and BatchNorm normalising with its running statistics
# (eval mode) instead of each micro-batch's own.
_DETERMINISTIC_CONFIG: dict[str, dict[str, Any]] = {"gpt": {"dropout": 0.0}}
_DETERMINISTIC_EVAL = {"resnet"}


def load(name: str, *, deterministic: bool = False,
         **config: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """(model, example_inputs, example_kwargs) of the reference model `name`; `deterministic`
    sets the model up so that a pipeline of it must match it exactly (config still overrides)."""
    module = importlib.import_module(f"fxpipe.models.{name}")
    if deterministic:
        config = {**_DETERMINISTIC_CONFIG.get(name, {}), **config}
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    model, inputs = module.build(**config)
    if deterministic and name in _DETERMINISTIC_EVAL:
        model.eval()
    kwargs = module.example_kwargs(inputs, **config) if hasattr(module, "example_kwargs") else {}
    return model, inputs, kwargs


def load_factory(spec: str, settings: list[str] | None = None
                 ) -> tuple[Any, tuple[Any, ...], dict[str, Any], Any]:
    """MODULE:FACTORY -> (model, example_inputs, example_kwargs, target)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"expected MODULE:FACTORY, got {spec!r}",
                          hint="e.g. fxpipe.models.gpt:build (any importable callable returning "
                               "(model, example_inputs))")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the user's module beside them, as `python -m` finds it
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"cannot import module {module_name!r}: {e}",
                          hint="check the spelling and that it is on PYTHONPATH") from e
    factory: Any = module  # any attribute the user's spec names
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            names = sorted(n for n in dir(module) if not n.startswith("_"))[:10]
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r}",
                              hint=f"names it has: {names}")
    config = _settings(settings or [])
    _check_keywords(spec, factory, config)
    result = factory(**config)
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise ConfigError(f"{spec} returned {type(result).__name__}, not (model, example_inputs)",
                          hint="return (model, example_inputs) or (model, inputs, kwargs)")
    model, inputs = result[0], result[1]
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    kwargs = dict(result[2]) if len(result) == 3 else {}
    if not kwargs and hasattr(module, "example_kwargs"):
        kwargs = module.example_kwargs(inputs, **config)
    target = module.target(inputs, **config) if hasattr(module, "target") else None
    return model, inputs, kwargs, target


def _check_keywords(spec: str, factory: Any, config: dict[str, Any]) -> None:
    """Refuses --set keys the factory does not take, naming those it does."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [key for key in config if key not in accepted]
    if unknown:
        raise ConfigError(f"{spec} takes no keyword {', '.join(map(repr, unknown))} "
                          f"(it accepts {', '.join(accepted) or 'none'})",
                          hint=f"--set one of: {', '.join(accepted)}" if accepted else
                          "drop --set: this factory takes no keywords")


def _settings(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"--set expects KEY=VALUE, got {pair!r}", hint="e.g. --set n_layer=8")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out

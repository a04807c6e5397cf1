"""The batches a written program trains on: the example batch it was written with (batch.pt),
every step, or the user's own from `program.py --data MODULE:FN`.

FN() returns an iterable of (inputs, target) pairs, each a global batch (every rank reads the
same ones and takes its replica's share): inputs one tensor, a tuple of the model's positional
inputs, or a dict of its keyword inputs, as the model is called; target a tensor, a tuple, list
or dict of tensors (fxpipe.targets), or None. The module is found as the program finds the
user's other modules (the current folder first, then the folders the model's code came from).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fxpipe.errors import ConfigError, RuntimeInputError
from fxpipe.runtime.program.imports import ProgramCode, import_folders, import_user_module
from fxpipe.signature import Signature
from fxpipe.targets import Target, target_tensors

__all__ = ["Batch", "user_batches"]

Batch = tuple[list[torch.Tensor], Target]
"""The flat input tensors of a global batch and its target."""


def user_batches(spec: str, signature: Signature, code: ProgramCode,
                 folder: Path) -> Iterator[Batch]:
    """The batches FN of `spec` ("MODULE:FN") yields, flattened as the program's inputs are."""
    module_name, _, function = spec.partition(":")
    if not module_name or not function:
        raise ConfigError(f"program.py --data {spec!r} names no function",
                          hint="pass --data MODULE:FUNCTION, e.g. --data mydata:batches")
    module = import_user_module(module_name, f"the module of --data {spec}",
                                import_folders(code, folder))
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ConfigError(f"program.py --data {spec}: {module_name} has no function {function}",
                          hint="define FUNCTION at module level; it returns an iterable of "
                               "(inputs, target) pairs")
    return (_flat(item, signature, spec, number) for number, item in enumerate(fn()))


def _flat(item: Any, signature: Signature, spec: str, number: int) -> Batch:
    if not (isinstance(item, tuple | list) and len(item) == 2):
        raise RuntimeInputError(f"--data {spec} gave {type(item).__name__} as batch {number}, "
                                "not an (inputs, target) pair",
                                hint="yield (inputs, target); target None for a loss of the "
                                     "outputs alone")
    inputs, target = item
    if isinstance(inputs, torch.Tensor):
        args: tuple[Any, ...] = (inputs,)
        kwargs: dict[str, Any] = {}
    elif isinstance(inputs, dict):
        args, kwargs = (), dict(inputs)
    else:
        args, kwargs = tuple(inputs), {}
    if target is not None and not target_tensors(target):
        raise RuntimeInputError(f"--data {spec} gave a {type(target).__name__} with no tensor "
                                f"as the target of batch {number}",
                                hint="yield a tensor target, a tuple, list or dict of tensors, "
                                     "or None")
    return signature.flatten_call(args, kwargs), target

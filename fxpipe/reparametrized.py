"""torch's hook-based reparametrizations: `torch.nn.utils.weight_norm`, `torch.nn.utils.prune`
and the old `torch.nn.utils.spectral_norm`. Each registers a forward pre-hook that derives a
weight from parameters (and a mask, or power-iteration vectors) and sets it as a plain attribute
of the module before every forward (`module.weight = g * v / ||v||`, `weight_orig *
weight_mask`). A capture runs the hook, so the graph derives the weight from the parameters in
every call as the plain model does: the attribute is not state a forward stores for the training
loop (fxpipe.frontend.mutation.stored_error), the hook does nothing a call would miss
(fxpipe.frontend.module_hooks), and the tensor the attribute holds is replaced by
every run of the plain model, not a setting (fxpipe.module_settings). (The newer
`torch.nn.utils.parametrizations` need none of this: their weight is a property computed by
modules the capture traces.) A derived weight is a tensor with a history, which
`copy.deepcopy` refuses; `derived_memo` hands a copy of the model a detached one, which its next
forward's hook replaces. Spectral norm in training also updates its vectors in place, once
per call: that is refused as any other buffer a forward updates (fxpipe.frontend.mutation)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

__all__ = ["derived_attributes", "is_reparametrization", "derived_memo"]


def _derived_name(hook: object) -> str | None:
    """The attribute a reparametrization hook sets, or None for any other hook."""
    if isinstance(hook, (WeightNorm, SpectralNorm)):
        return hook.name
    if isinstance(hook, prune.BasePruningMethod):
        name = getattr(hook, "_tensor_name", None)
        return name if isinstance(name, str) else None
    return None


def is_reparametrization(hook: object) -> bool:
    """Whether `hook` is one of torch's reparametrization pre-hooks."""
    return _derived_name(hook) is not None


def derived_attributes(model: nn.Module) -> dict[str, str]:
    """Qualified names of the attributes torch's reparametrization hooks set on `model`'s
    modules -> the hook's class name."""
    found: dict[str, str] = {}
    for prefix, module in model.named_modules():
        for hook in module._forward_pre_hooks.values():
            name = _derived_name(hook)
            if name is not None:
                found[f"{prefix}.{name}" if prefix else name] = type(hook).__name__
    return found


def derived_memo(model: nn.Module) -> dict[int, Any]:
    """A `copy.deepcopy` memo that copies each derived weight of `model` as a detached tensor:
    torch refuses to deep-copy a tensor with a history, and the copy's hook derives it anew."""
    memo: dict[int, Any] = {}
    for name in derived_attributes(model):
        path, _, attribute = name.rpartition(".")
        value = getattr(model.get_submodule(path), attribute, None)
        if isinstance(value, torch.Tensor) and not value.is_leaf:
            memo[id(value)] = value.detach().clone()
    return memo

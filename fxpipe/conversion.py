"""Converting a program (`to()`, `double()`, `half()`, `cuda()` ...): a built program's stage code
was generated for its tensors' dtypes and devices, so a conversion that changes them is refused
with the way to get what was meant; an unbuilt one converts the model it will be built from.

The model itself can still be converted after compiling (`model.to(torch.bfloat16)`), which
converts the tensors its stages share with it in place. Nothing is checked on the way in (every
step would pay for it); a call that then fails says so (`converted_after_compiling`)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch.fx import GraphModule

from fxpipe import ir
from fxpipe.errors import ConfigError

__all__ = ["refuse_changing", "converted_after_compiling"]


def refuse_changing(fn: Callable[[torch.Tensor], torch.Tensor],
                    tensors: Iterable[torch.Tensor]) -> None:
    """Raises ConfigError when `fn` (what nn.Module._apply maps over tensors) would change the
    dtype or device of any of `tensors`; tried on an empty tensor of each kind, not on them."""
    kinds = {(t.dtype, t.device) for t in tensors}
    for dtype, device in sorted(kinds, key=str):
        probe = torch.empty(0, dtype=dtype, device=device)
        after = fn(probe)
        if not isinstance(after, torch.Tensor) or (after.dtype, after.device) == (dtype, device):
            continue
        raise ConfigError(
            f"converting the compiled program would turn its {dtype} tensors on {device} into "
            f"{after.dtype} on {after.device}; its stage code was generated for {dtype} on "
            f"{device}",
            hint="convert the model and compile it again, e.g. fxpipe.compile(model.to(...), "
                 "...); devices=[...] places the stages, autocast='bf16' runs them in mixed "
                 "precision")


def converted_after_compiling(captured: GraphModule, tensors: Mapping[str, torch.Tensor],
                              devices: Mapping[str, torch.device]) -> ConfigError | None:
    """The error to raise when the stages' `tensors` (qualified name -> tensor, each one's
    stage on `devices`) no longer have the dtype the model was captured with or their stage's
    device, or None when they all do."""
    compiled = {ir.qualname(captured, str(n.target)): info.dtype for n in captured.graph.nodes
                if n.op == "get_attr" and isinstance(info := n.meta.get(ir.TENSOR), ir.TensorInfo)}
    changed = [(name, t, compiled.get(name, t.dtype), devices.get(name, t.device))
               for name, t in tensors.items()
               if t.dtype != compiled.get(name, t.dtype)
               or not t.is_meta and not _same_device(t.device, devices.get(name, t.device))]
    if not changed:
        return None
    name, tensor, dtype, device = changed[0]
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    return ConfigError(
        f"the model was converted after compiling: {name} is {tensor.dtype} on "
        f"{tensor.device}{more}, and its stage's code was generated for {dtype} on {device}",
        hint="convert the model first and compile it again, e.g. fxpipe.compile(model.to(...), "
             "...), or convert it back; autocast='bf16' runs the stages in mixed precision")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)

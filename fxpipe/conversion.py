"""Converting a program (`to()`, `double()`, `half()`, `cuda()` ...): a built program's stage code
was generated for its tensors' dtypes and devices, so a conversion that changes them is refused
with the way to get what was meant; an unbuilt one converts the model it will be built from."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from fxpipe.errors import ConfigError

__all__ = ["refuse_changing"]


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

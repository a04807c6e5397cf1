"""Forward hooks on a model's modules. A capture runs them: what a hook returns (or writes into
its output in place) is in the graph, so a hook that scales an output runs in every call. What
else it does (keep an activation, log a statistic, count calls) happens only in the compile's
trial runs: a program runs its graph, not the model's modules. The capture warns of such hooks,
naming the modules, and a program warns once of each hook added after compiling, which no call
runs (`HookWatch`)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from torch import nn
from torch.nn.modules import module as module_globals
from torch.utils.hooks import RemovableHandle

__all__ = ["hooked_modules", "warn_hooks_run_while_compiling", "HookWatch"]


def _hook_ids(module: nn.Module) -> list[int]:
    return [*module._forward_hooks, *module._forward_pre_hooks]


def _global_hook_ids() -> list[int]:
    return [*module_globals._global_forward_hooks, *module_globals._global_forward_pre_hooks]


def hooked_modules(model: nn.Module) -> list[str]:
    """The names of `model`'s modules with forward hooks or pre-hooks ("(the model)" for the
    model itself, "(every module)" for a global one)."""
    names = ["(every module)"] if _global_hook_ids() else []
    return names + [name or "(the model)" for name, module in model.named_modules()
                    if module._forward_hooks or module._forward_pre_hooks]


def _listed(names: list[str]) -> str:
    more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
    return ", ".join(n if n.startswith("(") else repr(n) for n in names[:3]) + more


def warn_hooks_run_while_compiling(model: nn.Module, stacklevel: int) -> None:
    """Warns when `model` has forward hooks: their side effects do not happen in a call."""
    names = hooked_modules(model)
    if names:
        warnings.warn(
            f"forward hooks on {_listed(names)} ran while compiling: what a hook returns is in "
            f"the captured graph and runs in every call, but what else it does (keep an "
            f"activation, log a value) happens only in the compile's trial runs, not when the "
            f"program runs; return what you need as one more output of forward instead",
            UserWarning, stacklevel=stacklevel + 1)


@dataclass
class HookWatch:
    """The modules of a compiled model, and the newest forward hook id seen: a call warns of
    hooks added after it, once each. Every hook handle torch makes takes the next of one
    counter (RemovableHandle.next_id), so while it stands still nothing was added anywhere
    and the modules need no look."""

    names: list[str] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)
    seen: int = -1
    counted: int = -1  # RemovableHandle.next_id at the last look

    @staticmethod
    def of(model: nn.Module) -> HookWatch:
        names, modules = zip(*model.named_modules())
        ids = [k for m in modules for k in _hook_ids(m)] + _global_hook_ids()
        return HookWatch(list(names), list(modules), max(ids, default=-1),
                         RemovableHandle.next_id)

    def warn_added(self, stacklevel: int) -> None:
        """Warns of forward hooks added since the last look (a comparison per module, when
        any hook handle was made since)."""
        if RemovableHandle.next_id == self.counted:
            return
        self.counted = RemovableHandle.next_id
        hooked = [m for m in self.modules if m._forward_hooks or m._forward_pre_hooks]
        added = [(self.names[self.modules.index(m)] or "(the model)", k) for m in hooked
                 for k in _hook_ids(m) if k > self.seen]
        added += [("(every module)", k) for k in _global_hook_ids() if k > self.seen]
        if not added:
            return
        self.seen = max(k for _, k in added)
        names = list(dict.fromkeys(name for name, _ in added))
        warnings.warn(
            f"a forward hook added to {_listed(names)} after compiling does not run: the "
            f"program runs its captured graph, not the model's modules; register it before "
            f"fxpipe.compile (what it returns is then captured, what else it does happens "
            f"only while compiling), or compute what it needs from the program's outputs",
            UserWarning, stacklevel=stacklevel + 1)

"""Hooks on a model's modules. A capture runs the forward ones: what a hook returns (or writes
into its output in place) is in the graph, so a hook that scales an output runs in every call.
What else it does (keep an activation, log a statistic, count calls) happens only in the
compile's trial runs: a program runs its graph, not the model's modules. The capture warns of
such hooks, naming the modules, and a program warns once of each hook added after compiling,
which no call runs (`HookWatch`). Backward hooks (`register_full_backward_hook` and the like)
never run in a program, whose backward is its graph's, and may change the gradients they are
given: the capture refuses them, and a call one added after compiling."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from torch import nn
from torch.nn.modules import module as module_globals
from torch.utils.hooks import RemovableHandle

from fxpipe.errors import CaptureError, ConfigError
from fxpipe.reparametrized import is_reparametrization

__all__ = ["hooked_modules", "refuse_backward_hooks", "warn_hooks_run_while_compiling",
           "HookWatch"]

_FORWARD = ("_forward_hooks", "_forward_pre_hooks")
_BACKWARD = ("_backward_hooks", "_backward_pre_hooks")


def _hook_ids(module: nn.Module, tables: tuple[str, str] = _FORWARD) -> list[int]:
    """The ids of the module's hooks in `tables`, but torch's reparametrizations (weight_norm,
    prune), whose pre-hook's weight is in the graph and which do nothing else."""
    return [k for table in tables for k, hook in getattr(module, table).items()
            if not is_reparametrization(hook)]


def _global_hook_ids(tables: tuple[str, str] = _FORWARD) -> list[int]:
    return [k for table in tables for k in getattr(module_globals, "_global" + table)]


def hooked_modules(model: nn.Module, tables: tuple[str, str] = _FORWARD) -> list[str]:
    """The names of `model`'s modules with hooks in `tables` (forward hooks and pre-hooks by
    default; "(the model)" for the model itself, "(every module)" for a global one)."""
    names = ["(every module)"] if _global_hook_ids(tables) else []
    return names + [name or "(the model)" for name, module in model.named_modules()
                    if _hook_ids(module, tables)]


def _backward_refusal(names: list[str], when: str) -> tuple[str, str]:
    return (f"backward hooks on {_listed(names)}{when} cannot run in a program: its backward "
            f"is its graph's, and such a hook may change the gradients it is given, so the "
            f"program would train otherwise than the model without saying so",
            "remove them (handle.remove()) before compiling or calling; a hook on a parameter "
            "(p.register_hook(...)) runs, on that parameter's gradient")


def refuse_backward_hooks(model: nn.Module) -> None:
    """Raises CaptureError when a module of `model` has backward hooks or pre-hooks."""
    names = hooked_modules(model, _BACKWARD)
    if names:
        message, hint = _backward_refusal(names, "")
        raise CaptureError(message, hint=hint)


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
    """The modules of a compiled model, and the newest hook id seen: a call warns once of
    each forward hook added after it and refuses a backward one. Every hook handle torch
    makes takes the next of one counter (RemovableHandle.next_id), so while it stands still
    nothing was added anywhere and the modules need no look."""

    names: list[str] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)
    seen: int = -1
    counted: int = -1  # RemovableHandle.next_id at the last look

    @staticmethod
    def of(model: nn.Module) -> HookWatch:
        names, modules = zip(*model.named_modules())
        ids = [k for m in modules for tables in (_FORWARD, _BACKWARD)
               for k in _hook_ids(m, tables)] + _global_hook_ids() + _global_hook_ids(_BACKWARD)
        return HookWatch(list(names), list(modules), max(ids, default=-1),
                         RemovableHandle.next_id)

    def _added(self, tables: tuple[str, str]) -> list[tuple[str, int]]:
        """(module name, hook id) of each hook in `tables` newer than the last look."""
        added = [(name or "(the model)", k) for name, m in zip(self.names, self.modules)
                 if getattr(m, tables[0]) or getattr(m, tables[1])
                 for k in _hook_ids(m, tables) if k > self.seen]
        return added + [("(every module)", k) for k in _global_hook_ids(tables) if k > self.seen]

    def check_added(self, stacklevel: int) -> None:
        """Warns of forward hooks added since the last look, and refuses backward ones (a
        comparison per module, when any hook handle was made since)."""
        if RemovableHandle.next_id == self.counted:
            return
        backward = list(dict.fromkeys(name for name, _ in self._added(_BACKWARD)))
        if backward:  # refused on every call until removed
            message, hint = _backward_refusal(backward, " added after compiling")
            raise ConfigError(message, hint=hint)
        self.counted = RemovableHandle.next_id
        added = self._added(_FORWARD)
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

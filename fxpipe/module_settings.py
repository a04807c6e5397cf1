"""Plain settings on a model's modules (dropout's `p`, a norm's `eps`, a model's own
`self.use_gate`, a tensor kept as a plain attribute such as a mask), changed after compiling. A
capture reads them as constants: the graph holds `dropout(x, 0.5, True)`, not `self.p`, and the
tensor the attribute held then, so a program keeps running those while the plain model would
run the new ones. Each call compares every module's public attributes of plain types (bool, int,
float, str, None, tensors by identity, tuples of them) with those seen last, one C-level lookup
and tuple comparison per module, and warns once of each one changed from its compiled value,
naming it with both values. (A tensor changed in place needs nothing: the stages hold it.) An
attribute that forward does not read (a counter a training loop keeps on the model) changes
nothing a program runs; a leading underscore in its name keeps it out of this check, as it keeps
train/eval out (fxpipe.model_modes has those), and so does a weight that torch's weight_norm or
prune derives before every forward (fxpipe.reparametrized)."""
from __future__ import annotations

import contextlib
import copy
import operator
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fxpipe.reparametrized import derived_attributes

__all__ = ["SettingWatch"]

_PLAIN = (bool, int, float, str, type(None))
_MISSING = object()


def _plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, (*_PLAIN, torch.Tensor))


def _same(a: Any, b: Any) -> bool:
    """Equal settings: tensors the same object, the rest equal values."""
    if a is b:
        return True
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return bool(a == b)


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "deleted"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return "(" + ", ".join(_shown(v) for v in value) + ")"
    return repr(value)


def _settings(module: nn.Module) -> tuple[str, ...]:
    return tuple(k for k, v in vars(module).items()
                 if not k.startswith("_") and k != "training" and _plain(v))


def _getter(keys: tuple[str, ...]) -> Callable[[dict[str, Any]], Any]:
    """keys' values of a module's __dict__ in one C call (a tuple for several keys)."""
    return operator.itemgetter(*keys)


def _by_key(keys: tuple[str, ...], values: Any) -> dict[str, Any]:
    """A getter's result as {key: value}."""
    return dict(zip(keys, values if len(keys) > 1 else (values,)))


@dataclass
class SettingWatch:
    """Each watched module's name, the module and the names of its settings, their values
    (as its getter returns them) when the program was compiled and when it last looked."""

    names: list[str] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)
    keys: list[tuple[str, ...]] = field(default_factory=list)
    compiled: list[Any] = field(default_factory=list)
    seen: list[Any] = field(default_factory=list)
    warned: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._pairs = [(_getter(k), vars(m)) for k, m in zip(self.keys, self.modules)]

    @staticmethod
    def of(model: nn.Module) -> SettingWatch:
        """The settings of `model`'s modules as they are now (after the capture's runs)."""
        derived = derived_attributes(model)  # a weight_norm's weight: made by every call
        watched = [(name, module, found) for name, module in model.named_modules()
                   if (found := tuple(k for k in _settings(module)
                                      if (f"{name}.{k}" if name else k) not in derived))]
        names = [name for name, _, _ in watched]
        modules = [module for _, module, _ in watched]
        keys = [k for _, _, k in watched]
        watch = SettingWatch(names, modules, keys)
        watch.compiled = watch._now()
        watch.seen = list(watch.compiled)
        return watch

    def _now(self) -> list[Any]:
        out = []
        for get, table in self._pairs:
            try:
                out.append(get(table))
            except KeyError:  # deleted: the slow path names it
                out.append(_MISSING)
        return out

    def check(self, stacklevel: int) -> None:
        """Warns once of each setting that differs from its compiled value since last looked."""
        try:
            if [get(table) for get, table in self._pairs] == self.seen:
                return
        except Exception:  # noqa: BLE001 - a key deleted, or tensors compared by value
            pass
        now = self._now()
        for i, (values, seen) in enumerate(zip(now, self.seen)):
            if _same(values, seen):
                continue
            table = vars(self.modules[i])
            for key, was in _by_key(self.keys[i], self.compiled[i]).items():
                value = table.get(key, _MISSING)
                name = f"{self.names[i]}.{key}" if self.names[i] else key
                if _same(value, was) or name in self.warned:
                    continue
                self.warned.add(name)
                warnings.warn(
                    f"the model's {name} changed after compiling ({_shown(was)} -> "
                    f"{_shown(value)}): a program runs the graph captured with "
                    f"{'that tensor' if isinstance(was, torch.Tensor) else repr(was)}, so if "
                    f"forward reads it, "
                    f"the program no longer computes what the model does; compile again "
                    f"(fxpipe.compile(model, ...)) to run the new value, or set it back (an "
                    f"attribute forward does not read, such as a counter, changes nothing; a "
                    f"name beginning with '_' is not watched)", UserWarning,
                    stacklevel=stacklevel + 1)
        self.seen = now

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Around a capture of the model by the program (the first, or a variant): an
        attribute its runs of forward write is the model's own state, not a setting, and is not
        watched from then on."""
        before = [{k: vars(m).get(k, _MISSING) for k in keys}
                  for m, keys in zip(self.modules, self.keys)]
        yield
        rows = []
        for name, module, keys, compiled, was in zip(self.names, self.modules, self.keys,
                                                     self.compiled, before):
            table = vars(module)
            kept = tuple(k for k in keys if _same(table.get(k, _MISSING), was[k]))
            if kept:
                values = _by_key(keys, compiled)
                rows.append((name, module, kept, _getter(kept)(values)))
        self.names = [r[0] for r in rows]
        self.modules = [r[1] for r in rows]
        self.keys = [r[2] for r in rows]
        self.compiled = [r[3] for r in rows]
        self._pairs = [(_getter(k), vars(m)) for k, m in zip(self.keys, self.modules)]
        self.seen = self._now()

    def __deepcopy__(self, memo: dict[int, Any]) -> SettingWatch:
        """The watch of a copied model: its modules the copies (memo), their own __dicts__."""
        clone = SettingWatch(list(self.names), copy.deepcopy(self.modules, memo),
                             list(self.keys), copy.deepcopy(self.compiled, memo),
                             warned=set(self.warned))
        clone.seen = copy.deepcopy(self.seen, memo)
        return clone

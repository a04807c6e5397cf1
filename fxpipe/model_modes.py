"""The model's train/eval mode, changed after compiling. A training loop written for the plain
model calls `model.eval()` before validating and `model.train()` after; a program over that
model follows (its own `program.eval()` and `program.train()` do the same). Each call compares
every module's flag with what the program saw last (a comparison per module, no function call).
The whole model put in one mode switches the program to that mode (fxpipe.variants); a module
put in another mode alone (`model.backbone.bn.eval()`) is refused, naming it, unless the modes
are again those the program was compiled in: a program runs the modes its graphs captured."""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from fxpipe.errors import ConfigError

__all__ = ["ModeWatch"]


@dataclass
class ModeWatch:
    """The model's modules, their flags when the program's first plan was captured (in mode
    `compiled_training`), and their flags when the program last looked."""

    names: list[str] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)
    compiled: list[bool] = field(default_factory=list)
    compiled_training: bool = True
    seen: list[bool] = field(default_factory=list)

    @staticmethod
    def of(model: nn.Module, compiled_training: bool, uniform: bool) -> ModeWatch:
        """`uniform`: the capture set every module to `compiled_training` (the model was in
        the other mode), else it ran with the model's own flags, as they are now."""
        names, modules = zip(*model.named_modules())
        now = [m.training for m in modules]
        compiled = [compiled_training] * len(modules) if uniform else now
        return ModeWatch(list(names), list(modules), compiled, compiled_training, now)

    def look(self) -> None:
        """Takes the flags as they are now as seen (the program set its mode itself)."""
        self.seen = [m.training for m in self.modules]

    def followed(self) -> bool | None:
        """The mode the whole model was put in since the last look (for the program to take),
        or None when no flag changed. Raises ConfigError for modes the program has no graph
        for: one module's alone, or the compiled mode without the compiled modules' modes."""
        now = [m.training for m in self.modules]
        if now == self.seen:
            return None
        if now == self.compiled:
            self.seen = now
            return self.compiled_training
        if all(now) or not any(now):
            if now[0] != self.compiled_training:  # its variant is captured in this mode
                self.seen = now
                return now[0]
            against = self.compiled
        else:
            against = self.seen
        differ = [(name or "(the model)", flag) for name, flag, was
                  in zip(self.names, now, against) if flag != was]
        names = ", ".join(f"{n!r} ({'train' if f else 'eval'})" for n, f in differ[:3])
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        raise ConfigError(
            f"modules of the model were put in another mode after compiling: {names}{more}; "
            f"the program runs the modes its graph was captured in, and has none for this mix",
            hint="put the whole model in one mode (model.eval(), model.train(), or "
                 "program.eval() and program.train()), or set these modes before "
                 "fxpipe.compile, or put them back")

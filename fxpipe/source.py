"""Text from the user's model made safe for generated code: where a node came from (a one-line
comment) and names derived from the model's (identifiers)."""
from __future__ import annotations

import builtins
import functools
import keyword
import os
import re
import sys
import traceback
from dataclasses import dataclass
from types import TracebackType

import torch
from torch import nn

__all__ = ["SourceLine", "from_stack_trace", "from_traceback", "from_exception", "display_path",
           "safe_comment", "safe_docstring", "identifier"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_FXPIPE_DIR = os.path.dirname(os.path.abspath(__file__))
_FRAME = re.compile(
    r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n(?P<code>[^\n]*)')


@dataclass(frozen=True)
class SourceLine:
    file: str  # display path, deterministic (never absolute)
    line: int
    func: str
    code: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.func}: {self.code}"


@functools.lru_cache(maxsize=4096)
def _is_library(path: str) -> bool:
    path = os.path.abspath(path)
    if path.startswith(_TORCH_DIR + os.sep):
        return True
    # fxpipe's own machinery is library code; its bundled reference models are user code.
    if path.startswith(_FXPIPE_DIR + os.sep):
        return not path.startswith(os.path.join(_FXPIPE_DIR, "models") + os.sep)
    return "<" in path  # <string>, <eval_with_key>, <frozen ...>


def display_path(path: str) -> str:
    """A path that does not depend on where things are installed: module path if importable.

    A file imported under two names (the bundled models are `fxpipe.models.gpt`, and `models.gpt`
    where the repository root is on sys.path) takes its most qualified one, whichever was
    imported first; the answer is cached per state of sys.modules, so an import between two
    calls is seen."""
    return _display_path(os.path.abspath(path), len(sys.modules))


@functools.lru_cache(maxsize=4096)
def _display_path(absolute: str, _modules: int) -> str:
    names = [name for name, module in list(sys.modules.items())
             if not name.startswith("__") and (file := getattr(module, "__file__", None))
             and os.path.abspath(file) == absolute]
    if names:
        name = max(names, key=lambda n: (n.count("."), n))
        stem = "__init__.py" if absolute.endswith("__init__.py") else None
        return "/".join(name.split(".")) + ("/" + stem if stem else ".py")
    try:
        rel = os.path.relpath(absolute)
        if not rel.startswith(".."):
            return rel.replace(os.sep, "/")
    except ValueError:
        pass
    return os.path.basename(absolute)


def from_stack_trace(stack_trace: str | None) -> SourceLine | None:
    """The innermost user frame of an fx `stack_trace` string (outermost frame first)."""
    return _from_stack_trace(stack_trace, len(sys.modules))


@functools.lru_cache(maxsize=65536)
def _from_stack_trace(stack_trace: str | None, _modules: int) -> SourceLine | None:
    if not stack_trace:
        return None
    frames = [m.groupdict() for m in _FRAME.finditer(stack_trace)]
    for frame in reversed(frames):
        if not _is_library(frame["file"]):
            return SourceLine(display_path(frame["file"]), int(frame["line"]), frame["func"],
                              frame["code"].strip())
    return None


def from_traceback(tb: TracebackType | None) -> SourceLine | None:
    """The innermost user frame of an exception's traceback."""
    for frame in reversed(traceback.extract_tb(tb)):
        if not _is_library(frame.filename):
            return SourceLine(display_path(frame.filename), frame.lineno or 0, frame.name,
                              (frame.line or "").strip())
    return None


def from_exception(error: BaseException) -> SourceLine | None:
    """The innermost user frame of an exception or of the exceptions it was raised from."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found = from_traceback(current.__traceback__)
        if found is not None:
            return found
        current = current.__cause__ or current.__context__
    return None


def safe_comment(text: str, limit: int = 160) -> str:
    """Text that cannot end a Python comment line: control characters are escaped."""
    out = []
    for ch in text:
        if ch == " " or ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    joined = "".join(out)
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."


def safe_docstring(text: str, limit: int = 160) -> str:
    """Text that reads as itself inside a triple-quoted docstring: control characters,
    backslashes and double quotes are escaped, so nothing in it can end the string."""
    return safe_comment(text, limit).replace("\\", "\\\\").replace('"', '\\"')


def identifier(text: str, taken: set[str], *, reserved: frozenset[str] | set[str] = frozenset(),
               attribute: bool = False) -> str:
    """A valid Python identifier derived from `text` (which is never executed), not in `taken`,
    `reserved`, the keywords or the builtins (nor nn.Module's attributes when `attribute`);
    it is added to `taken`."""
    name = re.sub(r"\W", "_", text.encode("ascii", "backslashreplace").decode()).strip("_")
    name = re.sub(r"_+", "_", name) or "v"
    if name[0].isdigit():
        name = "v" + name
    clash = keyword.iskeyword(name) or name in reserved or hasattr(builtins, name)
    if attribute:
        clash = clash or hasattr(nn.Module, name) or name.startswith("_")
    if clash:
        name += "_"
    base, i = name, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name

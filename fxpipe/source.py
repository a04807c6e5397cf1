"""Where a node came from in the user's code: the frame to show, as a safe one-line comment."""
from __future__ import annotations

import functools
import os
import re
import sys
import traceback
from dataclasses import dataclass
from types import TracebackType

import torch

__all__ = ["SourceLine", "from_stack_trace", "from_traceback", "from_exception", "display_path", "safe_comment"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_FXPIPE_DIR = os.path.dirname(os.path.abspath(__file__))
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n(?P<code>[^\n]*)')


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


@functools.lru_cache(maxsize=4096)
def display_path(path: str) -> str:
    """A path that does not depend on where things are installed: module path if importable."""
    absolute = os.path.abspath(path)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and os.path.abspath(file) == absolute and not name.startswith("__"):
            parts = name.split(".")
            stem = "__init__.py" if absolute.endswith("__init__.py") else None
            return "/".join(parts) + ("/" + stem if stem else ".py")
    try:
        rel = os.path.relpath(absolute)
        if not rel.startswith(".."):
            return rel.replace(os.sep, "/")
    except ValueError:
        pass
    return os.path.basename(absolute)


@functools.lru_cache(maxsize=65536)
def from_stack_trace(stack_trace: str | None) -> SourceLine | None:
    """The innermost user frame of an fx `stack_trace` string (outermost frame first)."""
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

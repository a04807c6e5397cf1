"""The code a written program imports besides fxpipe and torch: its loss, the modules of its
outputs' types, and the folders the user's modules were imported from.

program.json is data, and naming code in it would make data executable: these references are
written into program.py (a `CODE = {...}` literal, read here with ast, never run), and
program.json may name a loss only from fxpipe's own (fxpipe.losses.NAMED) or the one CODE
records. The user's modules are found as `python -m` finds them, from the current folder, and
from the folders they were imported from when the program was written (recorded relative to the
program's folder, so the two can move together).
"""
from __future__ import annotations

import ast
import importlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxpipe.errors import ProgramFolderError
from fxpipe.losses import NAMED, LossFn, resolve_loss

__all__ = ["ProgramCode", "code_of_launcher", "source_folders", "import_folders",
           "import_user_module", "allowed_loss", "program_loss"]


@dataclass(frozen=True)
class ProgramCode:
    """What program.py allows the program to import (its `CODE` literal)."""

    loss: str  # a name in fxpipe.losses.NAMED, or MODULE:FUNCTION
    modules: tuple[str, ...] = ()  # modules registering the outputs' container types
    folders: tuple[str, ...] = ()  # where the user's modules came from (relative: to the program)

    def literal(self) -> str:
        """The `CODE = {...}` line of program.py (deterministic, valid Python)."""
        return (f"CODE = {{'loss': {self.loss!r}, 'modules': {list(self.modules)!r}, "
                f"'folders': {list(self.folders)!r}}}")


def code_of_launcher(folder: Path) -> ProgramCode:
    """The CODE literal of `folder`/program.py, read without running the file."""
    path = folder / "program.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (OSError, SyntaxError, UnicodeDecodeError) as e:
        raise ProgramFolderError(f"{path} cannot be read as Python ({type(e).__name__}: {e})",
                                 hint="write the program again") from None
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] \
                == ["CODE"]:
            try:
                value = ast.literal_eval(node.value)
                return ProgramCode(str(value["loss"]), tuple(map(str, value["modules"])),
                                   tuple(map(str, value["folders"])))
            except (ValueError, TypeError, KeyError):
                break
    raise ProgramFolderError(f"{path} records no CODE {{'loss': ..., 'modules': [...], "
                             "'folders': [...]}} literal (written by an older fxpipe, or edited)",
                             hint="write the program again with this fxpipe version")


def _library_folders() -> set[str]:
    paths = sysconfig.get_paths()
    return {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")
            if k in paths}


def source_folders(modules: list[str], program_folder: str) -> tuple[str, ...]:
    """The folders `modules` were imported from (the sys.path entries holding their top-level
    packages), relative to `program_folder` where possible; installed libraries and fxpipe
    itself are left out, as every environment that runs the program has them."""
    library = _library_folders()
    found: list[str] = []
    for name in modules:
        module = sys.modules.get(name.partition(".")[0])
        file = getattr(module, "__file__", None)
        if not file or name.startswith("fxpipe"):
            continue
        root = os.path.dirname(os.path.realpath(file))
        if os.path.basename(file) == "__init__.py":
            root = os.path.dirname(root)
        if root in library:
            continue
        try:
            entry = os.path.relpath(root, os.path.realpath(program_folder)).replace(os.sep, "/")
        except ValueError:  # another drive
            entry = root
        if entry not in found:
            found.append(entry)
    return tuple(found)


def import_folders(code: ProgramCode, folder: Path) -> list[str]:
    """Where the program looks for the user's modules: the current folder, then those recorded."""
    recorded = [os.path.normpath(os.path.join(folder, f)) for f in code.folders]
    return list(dict.fromkeys([os.getcwd(), *recorded]))


def import_user_module(name: str, what: str, folders: list[str]) -> Any:
    """Imports `name` with `folders` at the end of sys.path (after what is installed);
    `what` says why the program needs it, for the error when it cannot be found."""
    for entry in folders:
        if entry not in sys.path:
            sys.path.append(entry)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
            raise  # the module itself was found, and fails on an import of its own
        raise ProgramFolderError(
            f"cannot import {name}, {what} (looked in the installed packages and in "
            f"{', '.join(folders)})",
            hint=f"run from the folder that holds {name.partition('.')[0]}, or put it on "
                 "PYTHONPATH") from None


def allowed_loss(name: str, code: ProgramCode) -> None:
    """Raises unless `name` is one of fxpipe's losses or the one program.py records."""
    if name not in NAMED and name != code.loss:
        allowed = ", ".join([*sorted(NAMED), *([code.loss] if code.loss not in NAMED else [])])
        raise ProgramFolderError(f"program.json names the loss {name!r}, which program.py does "
                                 f"not record (allowed: {allowed})",
                                 hint="write the program again with the loss you want "
                                      "(program.write(dir, loss_fn=...))")


def program_loss(name: str, code: ProgramCode, folder: Path) -> LossFn:
    """The loss program.json names (see allowed_loss), imported from the user's folders."""
    allowed_loss(name, code)
    if name not in NAMED:
        import_user_module(name.partition(":")[0], f"the module of the loss {name}",
                           import_folders(code, folder))
    try:
        loss: LossFn = resolve_loss(name)
    except AttributeError as e:
        raise ProgramFolderError(f"the loss {name} cannot be found ({e})",
                                 hint="define the function at module level under that name, "
                                      "or write the program again") from None
    return loss

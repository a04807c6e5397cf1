"""Which files of a program's folder are the user's: those its program.json does not list.

Rewriting a program replaces fxpipe's files only: a checkpoint saved into the folder, a
timeline, notes, or a file that happens to share a name fxpipe could write (model.pt,
stage_7.py) are the user's unless the previous program.json lists them, and are carried over.
"""
from __future__ import annotations

import json
import os

__all__ = ["carry_user_files", "user_files", "written_by_fxpipe"]

# What the writer put in a folder before program.json listed its files: used only for a folder
# whose program.json lists none (or is gone, as in a swap killed while removing the old folder,
# by which time the user's files were carried).
_UNLISTED_NAMES = frozenset({"program.py", "report.txt", "report.json", "weights.pt",
                             "weights.json", "state.pt", "model.pt", "batch.pt"})


def _listed(folder: str, dir_fd: int | None = None) -> set[str] | None:
    """The files `folder`/program.json lists, None when it lists none or cannot be read; with
    `dir_fd`, the program.json of that open folder."""
    try:
        if dir_fd is None:
            fd = os.open(os.path.join(folder, "program.json"), os.O_RDONLY)
        else:
            fd = os.open("program.json", os.O_RDONLY, dir_fd=dir_fd)
        with open(fd, encoding="utf-8") as f:
            files = json.load(f).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return set(files) if isinstance(files, dict) else None


def _is_fxpipes(name: str, listed: set[str] | None) -> bool:
    if name in ("program.json", "__pycache__"):
        return True
    if listed is not None:
        return name in listed
    return name in _UNLISTED_NAMES or (name.startswith("stage_") and name.endswith(".py"))


def written_by_fxpipe(folder: str, name: str) -> bool:
    """Whether `name` in `folder` is a file of the program there (or its __pycache__)."""
    return _is_fxpipes(name, _listed(folder))


def user_files(folder: str) -> set[str]:
    """The user's files in `folder`, its listing and its program.json read from one open
    folder: another writer swapping its program in meanwhile (this folder renamed away, a new
    one renamed in) cannot pair one program's files with the other's program.json."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return set()
    try:
        present, listed = os.listdir(fd), _listed(folder, dir_fd=fd)
    finally:
        os.close(fd)
    return {name for name in present if not _is_fxpipes(name, listed)}


def carry_user_files(old: str, new: str) -> None:
    """Moves the user's files from the old program's folder into the new one (a name the new
    program uses stays in the old folder, which the caller keeps or removes)."""
    for name in sorted(os.listdir(old)):
        if not written_by_fxpipe(old, name) and not os.path.lexists(os.path.join(new, name)):
            os.rename(os.path.join(old, name), os.path.join(new, name))

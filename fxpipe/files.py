"""Atomic files: a file is either its old content or its new content, never a half-written one.

Each write goes to a temporary file in the target's folder, is flushed to disk, and is then
renamed over the target (a rename within one file system is atomic). A folder is replaced the
same way as a whole (replace_folder): built beside the target, then renamed into its place.

Files get the modes an ordinary write gives (0666 less the umask): the temporary file is created
by open() inside a private temporary folder, never by mkstemp, whose files are 0600.
"""
from __future__ import annotations

import errno
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["atomic_write", "atomic_save", "fsync_folder", "replace_folder", "TEMP_PREFIX"]

TEMP_PREFIX = ".fxpipe-"


@contextmanager
def _temporary_beside(path: str) -> Iterator[str]:
    """A temporary path in `path`'s folder, renamed onto `path` on success, removed on failure.

    The temporary file gets `path`'s own name inside a temporary folder: torch.save embeds the
    file's name in the archive, so the bytes are the same as a direct write to `path` would give,
    and two writes of the same tensors are byte-identical.
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp_folder = tempfile.mkdtemp(dir=folder, prefix=TEMP_PREFIX, suffix=".tmp")
    tmp = os.path.join(tmp_folder, os.path.basename(path))
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp_folder, ignore_errors=True)


def atomic_write(path: str, text: str) -> None:
    """Writes `text` (UTF-8, LF line ends) to `path` atomically."""
    with _temporary_beside(path) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)


def atomic_save(obj: Any, path: str) -> None:
    """torch.save(obj) to `path` atomically; the same `obj` always gives the same bytes."""
    with _temporary_beside(path) as tmp:
        torch.save(obj, tmp)


def fsync_folder(folder: str) -> None:
    """Makes the renames and removals inside `folder` durable (a no-op where folders cannot be
    opened, as on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sibling(target: str, kind: str) -> str:
    """A new, empty folder beside `target` (os.mkdir, so its mode follows the umask)."""
    parent, name = os.path.split(os.path.abspath(target))
    while True:
        path = os.path.join(parent, f"{TEMP_PREFIX}{name}-{kind}-{secrets.token_hex(6)}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def replace_folder(target: str, fill: Callable[[str], None],
                   check_replaceable: Callable[[str], None],
                   carry: Callable[[str, str], None] | None = None) -> None:
    """Builds a folder with `fill(folder)` beside `target`, then puts it in `target`'s place.

    Readers and concurrent writers see the old folder or a complete new one, never a mix: the
    new folder is renamed in once complete; an existing `target` (`check_replaceable` raises if
    it must not be replaced) is renamed away just before and removed after. Of two writers, the
    last to rename wins. `carry(old, new)` moves what must outlive the old folder into the new
    one before the old one is removed.
    """
    target = os.path.abspath(target)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staged = _sibling(target, "new")
    olds: list[str] = []
    try:
        fill(staged)
        fsync_folder(staged)
        while True:
            try:
                os.rename(staged, target)  # succeeds onto an absent or empty folder
                break
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
            check_replaceable(target)
            old = _sibling(target, "old")
            os.rmdir(old)  # only its unique name is needed
            try:
                os.rename(target, old)
                olds.append(old)
            except FileNotFoundError:  # another writer moved it away first
                pass
        if carry is not None:
            for old in olds:
                carry(old, target)
        fsync_folder(os.path.dirname(target))
    finally:
        for folder in [staged, *olds]:
            shutil.rmtree(folder, ignore_errors=True)

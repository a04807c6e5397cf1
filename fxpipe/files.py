"""Atomic files: a file is either its old content or its new content, never a half-written one.

Each write goes to a temporary file in the target's folder, is flushed to disk, and is then
renamed over the target (a rename within one file system is atomic).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["atomic_write", "atomic_save", "fsync_folder", "TEMP_PREFIX"]

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

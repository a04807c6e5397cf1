"""Atomic files: a file is either its old content or its new content, never a half-written one.

Each write goes to a temporary file in the target's folder, is flushed to disk, and is then
renamed over the target (a rename within one file system is atomic).
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["atomic_write", "atomic_save", "TEMP_PREFIX"]

TEMP_PREFIX = ".fxpipe-"


@contextmanager
def _temporary_beside(path: str) -> Iterator[str]:
    """A temporary path in `path`'s folder, renamed onto `path` on success, removed on failure."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=TEMP_PREFIX, suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write(path: str, text: str) -> None:
    """Writes `text` (UTF-8, LF line ends) to `path` atomically."""
    with _temporary_beside(path) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)


def atomic_save(obj: Any, path: str) -> None:
    """torch.save(obj) to `path` atomically."""
    with _temporary_beside(path) as tmp:
        torch.save(obj, tmp)

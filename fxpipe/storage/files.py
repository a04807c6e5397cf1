"""Atomic files: a file is either its old content or its new content, never a half-written one.

Each write goes to a temporary file in the target's folder, is flushed to disk, and is then
renamed over the target (a rename within one file system is atomic). A folder is replaced the
same way as a whole (replace_folder): built beside the target, then renamed into its place.

Files get the modes an ordinary write gives (0666 less the umask): the temporary file is created
by open() inside a private temporary folder, never by mkstemp, whose files are 0600.

A write that fails (a full disk, a file size limit) raises StorageError naming the file, and
leaves the target as it was.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fxpipe.errors import StorageError

__all__ = ["atomic_write", "atomic_save", "fsync_folder", "replace_folder", "recover_folder",
           "nearest_existing", "write_failed", "TEMP_PREFIX", "TORCH_WRITE_FAILURES"]

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
    except (OSError, RuntimeError) as e:
        if isinstance(e, StorageError) or not (isinstance(e, OSError) or _torch_write_failed(e)):
            raise
        raise write_failed(path, e) from e
    finally:
        shutil.rmtree(tmp_folder, ignore_errors=True)


# How torch.save reports a write the file system refused (a full disk, a file size limit).
TORCH_WRITE_FAILURES = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")


def _torch_write_failed(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and any(m in str(error) for m in TORCH_WRITE_FAILURES)


def nearest_existing(path: str) -> str:
    """`path`'s nearest ancestor that exists, spelled as `path` is (the root or "" at most)."""
    parent = os.path.dirname(path)
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    return parent


def write_failed(path: str, error: BaseException) -> StorageError:
    """The error for a write of `path` that failed: the cause, and how much room its disk has
    (torch.save's own message, "unexpected pos", says neither); a write refused for want of
    permission says that instead."""
    cause = str(error).splitlines()[0] if str(error) else type(error).__name__
    if getattr(error, "errno", None) in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StorageError(f"writing {path} failed ({type(error).__name__}: {cause}): this "
                            "process may not write there, or its file system is read-only",
                            hint="write to a folder this user can write to (or give it that "
                            "permission); the files there before are unchanged")
    try:  # the disk of the nearest path there is (a folder, or a file where one should be)
        free = f"{shutil.disk_usage(nearest_existing(os.path.abspath(path))).free} bytes free"
    except OSError:
        free = "free space unknown"
    return StorageError(f"writing {path} failed ({type(error).__name__}: {cause}; {free} on its "
                        "disk): the disk is full, a file size limit was reached, or the file "
                        "cannot be written", hint="free space on the disk (or raise the limit) and "
                        "write again; the files there before are unchanged")


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


# -- replacing a folder as a whole -------------------------------------------------------------
#
# A swap renames the target away to a sibling .fxpipe-NAME-old-*, then its complete replacement
# .fxpipe-NAME-new-* into its place, then carries the user's files over and removes the old one.
# Each writer holds an exclusive flock on the folders it stages and moves away, so anyone can
# tell a live writer's siblings (locked) from a killed writer's (not locked): recover_folder
# finishes or rolls back what a killed writer left, and every replace_folder calls it first.


def _leftover_pattern(target: str) -> re.Pattern[str]:
    name = re.escape(f"{TEMP_PREFIX}{os.path.basename(target)}-")
    return re.compile(name + r"(new|old)-[0-9a-f]{12}")


def _locked(path: str, *, wait: bool) -> int | None:
    """An fd of the folder `path` holding its exclusive flock, or None when another process
    holds it (and not `wait`), or when `path` is gone or is no longer the folder locked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        if os.path.samestat(os.fstat(fd), os.stat(path)):
            return fd
    except (BlockingIOError, FileNotFoundError):
        pass
    os.close(fd)
    return None


def _sibling_name(target: str, kind: str) -> str:
    parent, name = os.path.split(target)
    return os.path.join(parent, f"{TEMP_PREFIX}{name}-{kind}-{secrets.token_hex(6)}")


def _sibling(target: str, kind: str) -> tuple[str, int]:
    """A new, empty folder beside `target` (os.mkdir, so its mode follows the umask), locked."""
    while True:
        path = _sibling_name(target, kind)
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        fd = _locked(path, wait=True)
        if fd is not None:  # else a recover_folder removed it before it was locked
            return path, fd


def recover_folder(target: str, carry: Callable[[str, str], None] | None = None) -> list[str]:
    """Finishes or rolls back the swaps of `target` that killed writers left (returns what it
    did): a staged new folder is removed; an old folder is renamed back when `target` is
    missing (the kill fell between the two renames), and otherwise has the user's files carried
    into `target` (`carry(old, target)`) before it is removed. Siblings a live writer holds
    are left alone."""
    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return []
    pattern, done = _leftover_pattern(target), []
    for entry in entries:
        match = pattern.fullmatch(entry)
        path = os.path.join(parent, entry)
        fd = _locked(path, wait=False) if match else None
        if match is None or fd is None:
            continue
        try:
            if match.group(1) == "old":
                if _rename_back(path, target):
                    done.append(f"restored {target} from {entry}")
                    continue
                if not os.path.isdir(target):
                    continue  # it cannot go back now: kept as it is, for a later recovery
                if carry is not None:
                    carry(path, target)
            shutil.rmtree(path)
            done.append(f"removed {entry}")
        finally:
            os.close(fd)
    if done:
        fsync_folder(parent)
    return done


def _rename_back(old: str, target: str) -> bool:
    """Whether `old` could be renamed back to `target` (False: `target` is there, or the
    rename failed; the old folder then stays for a later recovery)."""
    try:
        os.rename(old, target)
        return True
    except OSError:
        return False


def replace_folder(target: str, fill: Callable[[str], None],
                   check_replaceable: Callable[[str], None],
                   carry: Callable[[str, str], None] | None = None) -> None:
    """Builds a folder with `fill(folder)` beside `target`, then puts it in `target`'s place.

    Readers and concurrent writers see the old folder or a complete new one, never a mix: the
    new folder is renamed in once complete; an existing `target` (`check_replaceable` raises if
    it must not be replaced) is renamed away just before and removed after. Of two writers, the
    last to rename wins. `carry(old, new)` moves what must outlive the old folder into the new
    one before the old one is removed. A writer killed at any point leaves siblings that the
    next replace_folder or recover_folder of `target` finishes or rolls back (each
    replace_folder recovers before it starts and after it is done).
    """
    target = os.path.abspath(target)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    recover_folder(target, carry)
    staged, staged_fd = _sibling(target, "new")
    held, olds, done = [staged_fd], [], False
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
            fd = _locked(target, wait=True)  # another writer moving it away: wait for it
            if fd is None:
                continue
            held.append(fd)  # the lock moves with the folder: a recovery leaves it alone
            old = _sibling_name(target, "old")
            try:
                os.rename(target, old)
                olds.append(old)
            except FileNotFoundError:  # another writer moved it away first
                pass
        if carry is not None:
            for old in olds:
                carry(old, target)
        fsync_folder(os.path.dirname(target))
        done = True
    finally:
        shutil.rmtree(staged, ignore_errors=True)
        for old in olds:  # removed once carried; else back in place, or left for a recovery
            if done:
                shutil.rmtree(old, ignore_errors=True)
            else:
                _rename_back(old, target)
        for fd in held:
            os.close(fd)
    recover_folder(target, carry)  # what a writer killed meanwhile left (an old folder it moved)

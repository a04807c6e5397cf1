"""One saver at a time per checkpoint folder: DIR/checkpoint.lock, held with fcntl.flock.

The kernel releases a flock when its holder exits, however it exits, so a killed saver never
leaves a stale lock; the file stays, and records its last holder (pid, host) for the error a
second saver gets. A second saver is refused rather than made to wait: two jobs saving into one
folder is a mistake to report (each would publish over the other's steps), not to serialize.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket

from fxpipe.errors import CheckpointError

__all__ = ["LOCK", "hold_save_lock"]

LOCK = "checkpoint.lock"


def hold_save_lock(directory: str) -> int:
    """Takes `directory`'s save lock (an open fd; closing it releases the lock), or raises
    CheckpointError naming the process that holds it."""
    path = os.path.join(directory, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise CheckpointError(f"{directory} is being saved into by {holder} (it holds {path}): "
                              "one saver at a time per checkpoint folder",
                              hint="save each job into a folder of its own, or wait for that "
                                   "save to finish") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n")
              .encode(), 0)
    return fd


def _holder(fd: int) -> str:
    """Who holds the lock, as its file records (written just after it was taken)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"process {int(data['pid'])} on {data['host']}"
    except (OSError, ValueError, TypeError, KeyError):
        return "another process (it has not recorded its pid yet)"

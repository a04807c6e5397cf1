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
import time

from fxpipe.errors import CheckpointError

__all__ = ["LOCK", "hold_save_lock"]

LOCK = "checkpoint.lock"
_RECORD = 512  # bytes: the holder's record, padded


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
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
    try:  # who holds it, for the error of the next saver (best effort: a full disk is no reason
        # not to save, and the save itself then says the disk is full). One write of a fixed
        # size, so a reader sees the previous record or this one, never a mix or nothing.
        os.pwrite(fd, record.ljust(_RECORD - 1).encode()[:_RECORD - 1] + b"\n", 0)
    except OSError:
        pass
    return fd


def _holder(fd: int) -> str:
    """Who holds the lock, as its file records (written just after it was taken: a holder
    that has not written it yet is waited for, briefly)."""
    for _ in range(20):
        try:
            data = json.loads(os.pread(fd, _RECORD, 0))
            return f"process {int(data['pid'])} on {data['host']}"
        except (OSError, ValueError, TypeError, KeyError):
            time.sleep(0.01)
    return "another process (it has not recorded its pid)"

"""Python's full garbage collections deferred while the compiler runs.

A full collection walks every object the process holds. Python starts one each time the objects
that survived the younger collections grow by a quarter of the old ones, and a compile makes
millions that all survive (fx nodes, their metadata, stage graphs): at 1663 layers, 2.4M objects,
7 full collections, 2.8 of the compile's 20 CPU seconds, and one more in write() (0.7 of 2.9 s).
Deferring them changed neither what the compile adds to memory nor its peak: young cycles are
still collected by the younger generations, which run as before. The deferred full collection
runs when Python next decides to, after the compile, whose objects then are the user's to keep
or drop.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["full_collections_deferred"]

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] = ()
_NEVER = 2**31 - 1  # younger collections between full ones: never reached while deferred


@contextlib.contextmanager
def full_collections_deferred() -> Iterator[None]:
    """Within it (a decorator too; nested and concurrent uses share one deferral), Python runs
    no full collection of its own; gc.collect() still runs one. The thresholds found on
    entering the outermost use are put back when the last one leaves."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = gc.get_threshold()
            first, second, *_ = _saved
            gc.set_threshold(first, second, _NEVER)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.set_threshold(*_saved)

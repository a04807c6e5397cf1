"""Quantities as the reports, stage headers and tools print them, and byte sizes as users
write them ("16GB", "8GiB")."""
from __future__ import annotations

import re

from fxpipe.errors import ConfigError

__all__ = ["human_bytes", "human_flops", "human_time", "byte_size", "BYTE_UNITS"]

BYTE_UNITS = {"b": 1, "kb": 10**3, "kib": 2**10, "mb": 10**6, "mib": 2**20, "gb": 10**9,
              "gib": 2**30, "tb": 10**12, "tib": 2**40}


def byte_size(value: object, what: str = "size") -> float:
    """Bytes from a number or a string with a unit: 8GiB, 1.5GB, 512MiB (KB = 1000, KiB = 1024);
    other values are returned as they are, for the option's own check."""
    if not isinstance(value, str):
        return value  # type: ignore[return-value]  # a number, or what the caller refuses
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", value.lower())
    if match is None or match.group(2) not in ("", *BYTE_UNITS):
        raise ConfigError(f"{what} must be a number of bytes or a size like 8GiB, 1.5GB or "
                          f"500000000 (got {value!r})",
                          hint="units: B, KB, KiB, MB, MiB, GB, GiB, TB, TiB (KB = 1000 bytes, "
                               "KiB = 1024)")
    return float(match.group(1)) * BYTE_UNITS.get(match.group(2), 1)


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def human_flops(n: float) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} FLOP"


def human_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"

"""JSON text for the files a program folder holds: one item per line to a given depth, compact
below it.

`json.dumps(indent=...)` runs the pure-Python encoder (only an unindented dump runs the C one)
and spreads every number of a nested record over lines of its own: a program of 512 stages
wrote a 13 MB program.json in 2.4 s, most of it its predicted timeline of 32k events, ten lines
each. Here each event is one line, encoded in C.
"""
from __future__ import annotations

import json
from typing import Any

__all__ = ["json_text"]


def json_text(value: Any, *, depth: int = 2, sort_keys: bool = True,
              default: Any = None) -> str:
    """`value` as JSON: dicts and lists down to `depth` levels one item per line (indented by
    two spaces a level), what is deeper on the line of its item. json.loads reads it back."""
    compact = json.JSONEncoder(sort_keys=sort_keys, default=default, separators=(", ", ": "))

    def text(v: Any, level: int) -> str:
        if level >= depth or not isinstance(v, (dict, list, tuple)) or not v:
            return compact.encode(v)
        pad, inner = "  " * level, "  " * (level + 1)
        if isinstance(v, dict):
            items = [f"{inner}{compact.encode(_key(k))}: {text(v[k], level + 1)}"
                     for k in (sorted(v) if sort_keys else v)]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}"
        items = [inner + text(x, level + 1) for x in v]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"

    return text(value, 0)


def _key(key: Any) -> str:
    """A dict key as json writes it: strings as they are, 1 as "1", True as "true"."""
    return key if isinstance(key, str) else json.dumps(key)


"""The cost table: per node (or per module) FLOPs, bytes and estimated time at a micro-batch
size, as `fxpipe costs` and `program.cost_table()` print it."""
from __future__ import annotations

from dataclasses import dataclass

from tabulate import tabulate
from torch.fx import GraphModule

from fxpipe import ir
from fxpipe.errors import ConfigError
from fxpipe.passes.estimate import estimate_time
from fxpipe.profile import DeviceProfile
from fxpipe.units import human_bytes, human_flops, human_time

__all__ = ["cost_table", "SORT_KEYS"]


def _at(expr: ir.Expr, b: int) -> float:
    return float(ir.evaluate(expr, b))


# the figures of a row, by the name `sort` takes ("measured": where balancing measured times)
SORT_KEYS = ("time", "fwd_flops", "bwd_flops", "params", "output", "saved", "measured")


def cost_table(gm: GraphModule, *, b: int, profile: DeviceProfile, sort: str | None = None,
               by_module: bool = False, top: int | None = None, fmt: str = "simple") -> str:
    """Per-node (or per-module) costs at micro-batch size b, optionally sorted (largest first)
    by one of SORT_KEYS."""
    if sort is not None and sort not in SORT_KEYS:
        raise ConfigError(f"cost_table cannot sort by {sort!r}",
                          hint=f"sort by one of {SORT_KEYS} (largest first), or None for the "
                               "graph's order")
    rows: list[_CostRow] = []
    for node in ir.compute_nodes(gm.graph):
        if ir.COST not in node.meta:
            continue
        c = ir.cost(node)
        fwd, bwd = estimate_time(c, profile, b)
        row = _CostRow(node.name, ir.module_path(node) or "(top)", {
            "fwd_flops": _at(c.fwd_flops, b), "bwd_flops": _at(c.bwd_flops, b),
            "params": _at(c.param_bytes, b), "output": _at(c.output_bytes, b),
            "saved": _at(c.saved_bytes, b), "time": fwd + bwd})
        if ir.TIME in node.meta:
            t = ir.measured_time(node)
            row.values["measured"] = (t.fwd + t.bwd) * b / t.b
        rows.append(row)
    if by_module:
        grouped: dict[str, _CostRow] = {}
        for r in rows:
            g = grouped.setdefault(r.module, _CostRow("", r.module, {}))
            for key, value in r.values.items():
                g.values[key] = g.values.get(key, 0.0) + value
            g.count += 1
            g.node = f"{g.count} ops"
        rows = list(grouped.values())
    if sort:
        rows.sort(key=lambda r: -r.values.get(sort, 0.0))
    if top:
        rows = rows[:top]
    headers = ["node", "module", "fwd FLOPs", "bwd FLOPs", "params", "output", "saved", "est time"]
    has_measured = any("measured" in r.values for r in rows)
    if has_measured:
        headers.append("measured")
    table = []
    for r in rows:
        v = r.values
        line = [r.node, r.module, human_flops(v["fwd_flops"]), human_flops(v["bwd_flops"]),
                human_bytes(v["params"]), human_bytes(v["output"]), human_bytes(v["saved"]),
                human_time(v["time"])]
        if has_measured:
            line.append(human_time(v["measured"]) if "measured" in v else "")
        table.append(line)
    text: str = tabulate(table, headers=headers, tablefmt=fmt)
    return text


@dataclass
class _CostRow:
    """A row of the cost table: a node (or a module's nodes) and its figures."""

    node: str
    module: str
    values: dict[str, float]
    count: int = 0

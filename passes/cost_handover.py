"""The costs of a stamped graph's middle blocks, handed over from block 2 (fxpipe.passes.cost).

A graph stamped from one block (fxpipe.frontend.stamp) is costed by running its first four
blocks, its last and what follows; blocks 4..N-2 are not run and take block 2's costs, which are
theirs: the same nodes on the same shapes, read by a copy of themselves. Block 3 is run, so that
block 2's outputs are kept as a middle block's are, but is costed as block 2. The storage
accounting of the cost pass only ever looks one block ahead, so the names of the producers a
cost keeps are all that changes: a copy's cost names its own block's nodes, and a node after
the skipped blocks names block N-2's where the run had block 3.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import sympy  # type: ignore[import-untyped]  # sympy ships no type annotations
from torch.fx import Graph, GraphModule, Node

from fxpipe import ir
from fxpipe.frontend.stamp import BLOCKS, StampedBlocks

__all__ = ["Handover"]


class Handover:
    """Which nodes of a stamped graph take their costs from block 2's (see the module
    docstring): in each stamped list, blocks 3..N-2 (block 3 is run, so that block 2's outputs
    are kept as a middle block's are, but costed as block 2), of which 4..N-2 are not run."""

    def __init__(self, graph: Graph, lists: Sequence[tuple[tuple[Node, ...], ...]]) -> None:
        self.alias: dict[Node, Node] = {}
        self.source: dict[Node, tuple[Node, dict[str, str]]] = {}
        # per list: the nodes after its skipped blocks, and the names of blocks 1..3 there
        self.renamed_after: list[tuple[set[Node], dict[str, str]]] = []
        order = {node: i for i, node in enumerate(graph.nodes)}
        for blocks in lists:
            self._add(blocks, order)

    def _add(self, blocks: tuple[tuple[Node, ...], ...], order: dict[Node, int]) -> None:
        n = len(blocks) + 1  # blocks[k - 1] is block k; block 0 may differ

        def names(k: int) -> list[str]:
            return [node.name for node in blocks[k - 1]]

        self.alias.update({node: blocks[2][i] for k in range(4, n - 1)
                           for i, node in enumerate(blocks[k - 1])})
        for k in range(3, n - 1):
            renamed = {**dict(zip(names(2), names(k))), **dict(zip(names(1), names(k - 1)))}
            for i, node in enumerate(blocks[k - 1]):
                self.source[node] = (blocks[1][i], renamed)
        shift = n - 5  # block 3 stood for block N-2 in what the last block and later read
        end = max(order[node] for node in blocks[n - 3])  # block N-2's last node
        self.renamed_after.append((
            {node for node, i in order.items() if i > end},
            {a: b for k in (1, 2, 3) for a, b in zip(names(k), names(k + shift))}))

    @classmethod
    def of(cls, gm: GraphModule) -> Handover | None:
        """The hand-over for `gm`'s stamped lists of six blocks or more (fewer leave nothing to
        skip); None when there are none, or a pass since capture changed a block so that it
        no longer matches block 2."""
        stamped = [s for s in gm.meta.get(BLOCKS, ())
                   if isinstance(s, StampedBlocks) and len(s.blocks) + 1 >= 6]
        if not stamped:
            return None
        alive = set(gm.graph.nodes)
        for lists in stamped:
            template = lists.blocks[1]
            for block in lists.blocks:
                if len(block) != len(template) or any(
                        n not in alive or n.op != t.op or
                        (n.op != "get_attr" and n.target != t.target)
                        for n, t in zip(block, template)):
                    return None
        return cls(gm.graph, [s.blocks for s in stamped])

    def saves(self, node: Node, saves: dict[str, sympy.Expr]) -> dict[str, sympy.Expr]:
        """A run node's kept producers, those of a block 3 that stood for a skipped block
        named as that block's."""
        for after, renamed in self.renamed_after:
            if node in after:
                saves = {renamed.get(name, name): nbytes for name, nbytes in saves.items()}
        return saves

    def cost(self, node: Node) -> ir.Cost:
        """Block 2's cost of the node's twin, with the producers it keeps named as the node's."""
        source, renamed = self.source[node]
        cost: ir.Cost = source.meta[ir.COST]
        if not cost.saves:  # most nodes: the twin's own (frozen) cost, not a copy per block
            return cost
        return replace(cost, saves=tuple(sorted((renamed.get(name, name), nbytes)
                                                for name, nbytes in cost.saves)))

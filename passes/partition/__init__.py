"""The partition pass as a small package: the pass on the graph, the problem, and its solver.

    atoms.py     atoms of the fx graph (operations with their glue) and their costs
    graph.py     the plan of the stages, STAGE written on every node (the pass)
    problem.py   the partition problem as one frozen value: validation, exact stage costs (pure)
    solver.py    the exact search for the cuts that minimise the slowest stage (pure)
    chunks.py    the number of micro-batches whose plan predicts the fastest step
    correct.py   node times corrected by measured stage times (balancing by measurement)
"""
from fxpipe.passes.partition.atoms import atoms_of
from fxpipe.passes.partition.chunks import choose_chunks
from fxpipe.passes.partition.correct import (
    LOSS,
    TOLERANCE,
    BalanceRound,
    best_round,
    corrected,
    kept_reason,
    next_cut,
    spread,
)
from fxpipe.passes.partition.graph import (
    BALANCE_MODES,
    PartitionPlan,
    StagePlan,
    partition,
)

__all__ = ["partition", "choose_chunks", "PartitionPlan", "StagePlan", "atoms_of",
           "BALANCE_MODES", "BalanceRound", "LOSS", "TOLERANCE", "best_round", "corrected",
           "spread", "next_cut", "kept_reason"]

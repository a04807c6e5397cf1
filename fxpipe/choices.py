"""The names fxpipe.compile's options and the command line accept, and the bundled models.

Kept free of torch, so that the command line's parser (`fxpipe --help`, `fxpipe compile
--help`) lists them without importing it; the modules that interpret each name import it from
here.
"""
from __future__ import annotations

__all__ = ["REMAT_MODES", "BALANCE_MODES", "SHARD_MODES", "MODELS"]

REMAT_MODES = ("never", "always", "except_last", "auto")
"""What recomputes in backward: no micro-batch, every one, all but the last, or the regions
passes.remat chose under a memory limit (every micro-batch)."""

BALANCE_MODES = ("cost", "time", "params", "dynamic")
"""How the partition weighs nodes: the cost model, measured per-node times, parameter bytes, or
the cost model corrected by measuring each stage (fxpipe.rebalance)."""

SHARD_MODES = ("none", "optimizer", "full")
"""What data-parallel replicas of a stage split among themselves: nothing (each holds all of
it), the optimizer's state (ZeRO-1, torch's ZeroRedundancyOptimizer), or also the gradients
and parameters (FSDP2's fully_shard, see fxpipe.runtime.execution.fsdp)."""

MODELS = ("mlp", "gpt", "resnet", "unet", "branchy", "recurrent")
"""The reference models of fxpipe.models, by name."""

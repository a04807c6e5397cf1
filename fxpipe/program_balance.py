"""Balancing by measurement: a Program's stages timed in a few training steps and the cut moved
until they are even, when compiled with balance="dynamic" (the cut remembered for this model and
machine, else measured) and on program.rebalance() between steps of a running program.
fxpipe.rebalance holds the algorithm and the moving of state; this is the Program's side."""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.built import Built
from fxpipe.config import CompileConfig
from fxpipe.errors import ConfigError, FxPipeError
from fxpipe.frontend.meta import is_meta_model
from fxpipe.losses import LossFn, default_loss
from fxpipe.passes.partition import BalanceRound
from fxpipe.pipeline import broadcast_plan, rebuild
from fxpipe.program_state import ProgramState
from fxpipe.rebalance import (
    balance_by_measurement,
    balance_key,
    cut_of,
    forget_balance,
    load_balance,
    measure_local,
    measure_ranks,
    move_optimizer_state,
    move_state,
    save_balance,
)
from fxpipe.runtime.execution.amp import compiled_autocast
from fxpipe.runtime.execution.local import LocalExecutor
from fxpipe.sharding import is_sharded
from fxpipe.storage.state import graph_tensors
from fxpipe.targets import Target
from fxpipe.untouched import untouched

__all__ = ["Batch", "ProgramBalance", "fixed_cut"]


Batch = tuple[list[torch.Tensor], Target, LossFn]
"""A step's flat inputs, target and loss."""


class ProgramBalance(ProgramState):
    """The balancing half of a Program: its attributes are set by Program.__init__ and its
    build."""

    measured: dict[str, Any]
    _example: list[torch.Tensor]  # the example batch, flat
    _last_batches: tuple[Batch, ...]  # the last steps', last first

    def _install(self, built: Built, device: torch.device | None,
                 held: Mapping[str, torch.Tensor] | None = None) -> None:
        """Builds the stage modules and executor of a plan (Program's)."""
        raise NotImplementedError

    def _variant(self, built: Built, args: tuple[Any, ...], kwargs: dict[str, Any],
                 caller: int) -> tuple[Built, list[torch.Tensor]]:
        """The plan for a call in the program's mode, installed, and its flat inputs
        (Program's)."""
        raise NotImplementedError

    def _local_executor(self, what: str) -> LocalExecutor:
        """The executor of every stage in this process (Program's)."""
        raise NotImplementedError

    @property
    def devices(self) -> list[torch.device]:
        """The devices this process's stages run on (Program's)."""
        raise NotImplementedError

    def _balance_at_build(self, device: torch.device | None) -> None:
        """balance="dynamic": the cut remembered for this model and machine, else measured."""
        built = self._require_built("plan")
        distributed = device is not None
        key = balance_key(built, dist.get_world_size() if distributed else 1)
        cached = fixed_cut(self.config) is None and (not distributed or dist.get_rank() == 0)
        box: list[Any] = [load_balance(key) if cached else None]
        if distributed:
            dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            starts, corrections, rounds = box[0]
            try:  # every rank alike: the same entry fails the same way
                agreed = rebuild(built, corrections,
                                 agree=broadcast_plan if distributed else None, starts=starts)
            except FxPipeError as e:
                if not distributed or dist.get_rank() == 0:
                    forget_balance(key, str(e).splitlines()[0])
            else:
                agreed.rounds = rounds
                self._install(agreed, device)
                self.measured["balance"] = \
                    "dynamic, the cut measured before on this machine (cache)"
                return
        self._run_balance(self._example, None, default_loss, steps=2, rounds=4, verbose=False,
                          caller="balance='dynamic'")
        fixed = fixed_cut(self.config)
        self.measured["balance"] = "dynamic, measured while compiling" + \
            (f"; the cut {fixed} fixes kept" if fixed else "")

    def rebalance(self, *args: Any, target: Target = None,
                  loss_fn: LossFn | None = None, optimizer: torch.optim.Optimizer | None = None,
                  steps: int = 2, rounds: int = 4, verbose: bool = False,
                  **kwargs: Any) -> list[BalanceRound]:
        """Measures each stage's compute time in a few training steps and moves the cut until
        the stages are balanced (as balance="dynamic" does when compiling), between steps of a
        running program. Parameters keep their values; under torchrun the ones that change rank
        move there with their optimizer state (pass `optimizer`, built on every rank over
        program.parameters(); it then holds this rank's new parameters).

        Without a batch it measures on the last step's batch, target and loss (the one before
        after an epoch's short last batch; else the example batch).
        The measuring steps change nothing: gradients, buffers and RNG state are restored. Every
        rank calls it. Returns the rounds (cut, predicted and measured time per
        stage), also in the report. A cut the user gave (balance=[...], split_points=[...]) is
        measured once and kept, with a warning that says so.
        """
        built = self._require_built("plan to rebalance")
        rank = self._rank
        if self.config.shard == "full" and rank is not None and rank.mesh.replicas > 1:
            raise ConfigError("program.rebalance() cannot move stages whose parameters FSDP2 "
                              "shards over the replicas (shard='full')",
                              hint="save a checkpoint, compile the new cut, and load it into "
                                   "the new program and a new program.optimizer(...)")
        if optimizer is not None and is_sharded(optimizer):
            raise ConfigError("program.rebalance() cannot move the state of an optimizer "
                              "sharded over the replicas (shard='optimizer')",
                              hint="save a checkpoint, compile the new cut, and load it into "
                                   "a new program.optimizer(...)")
        if not (args or kwargs):
            flat, target, loss_fn = self._full_last_batch() or (self._example, target, loss_fn)
            args, kwargs = built.signature.unflatten_inputs(flat)
        # the plan that trains on this batch: in train mode after an eval-mode call, say
        before, flat = self._variant(built, args, kwargs, caller=3)
        after = self._run_balance(flat, target, loss_fn or default_loss, steps=steps,
                                  rounds=rounds, verbose=verbose, caller="program.rebalance()")
        if self._rank is not None and cut_of(after) != cut_of(before):
            move_state(before, after, self._rank.mesh, graph_tensors(after.captured), optimizer)
        elif optimizer is not None:
            move_optimizer_state(optimizer)
        return after.rounds

    def _full_last_batch(self) -> Batch | None:
        """The latest of the last steps' batches that ran in the plan's micro-batches: an
        epoch's short last batch would time the stages on smaller ones."""
        built = self._require_built("plan")
        replicas = self._rank.mesh.replicas if self._rank is not None else 1
        for batch in self._last_batches:
            if built.signature.batch_size(batch[0]) % (built.spec.chunks * replicas) == 0:
                return batch
        return None

    def _run_balance(self, flat: list[torch.Tensor], target: Target,
                     loss_fn: LossFn, *, steps: int, rounds: int, verbose: bool,
                     caller: str) -> Built:
        built = self._require_built("plan to balance")
        fixed = fixed_cut(self.config)
        if is_meta_model(self.model):
            raise ConfigError(
                f"{type(self.model).__name__} was built on the meta device, and balancing by "
                "measurement runs training steps of the whole program in this process",
                hint="balance with balance='cost' (the cost model and the device profile), or "
                     "compile a smaller instance of the model with balance='dynamic' to find "
                     "the cut")
        device = self._rank.executor.device if self._rank is not None else None

        def measure(current: Built) -> list[float]:
            # under the program's autocast, as its steps run (and as its costs were counted)
            model = self.model
            with untouched(model.parameters(), model.buffers()), \
                    compiled_autocast(self.config.autocast, self.devices):
                if self._rank is not None:
                    return measure_ranks(self._rank, flat, target, loss_fn, steps)
                executor = self._local_executor("balancing")
                return measure_local(executor, current.signature, current.spec.chunks,
                                     current.spec.remat, flat, target, loss_fn, steps)

        show = verbose and (device is None or dist.get_rank() == 0)
        after = balance_by_measurement(
            built, measure=measure, install=lambda b: self._install(b, device),
            agree=broadcast_plan if device is not None else None, rounds=rounds,
            progress=(lambda line: print(f"[fxpipe] {line}", flush=True)) if show else None,
            move=fixed is None)
        if fixed is not None:
            measured = " / ".join(f"{t * 1e3:.2f}" for t in after.rounds[0].measured)
            warnings.warn(f"{caller} measured the stages at {measured} ms per micro-batch "
                          f"({after.rounds[0].spread:.1%} apart) and kept the cut: {fixed} "
                          f"fixes it\nhint: compile without {fixed.partition('=')[0]} "
                          "(balance='cost', or balance='dynamic' to balance while compiling) "
                          "to let fxpipe move the cut", UserWarning, stacklevel=3)
            return after
        if device is None or dist.get_rank() == 0:
            save_balance(balance_key(after, dist.get_world_size() if device else 1), after)
        return after


def fixed_cut(config: CompileConfig) -> str | None:
    """The argument by which the user fixed the cut (balancing then only measures), or None."""
    if config.split_points is not None:
        return f"split_points={list(config.split_points)}"
    if isinstance(config.balance, tuple):
        return f"balance={list(config.balance)}"
    return None

"""A process's random generators in a checkpoint: resuming from it draws what the run that
saved it would have drawn next (dropout's masks, the step's stream seeds), as an uninterrupted
run does. Each rank saves its own (torch's CPU generator and, where CUDA is in use, each
visible device's); a resume by as many processes restores each rank's, and one by another
number cannot match the streams to the ranks and says so."""
from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["random_state", "restore_random_state"]


def random_state() -> dict[str, Any]:
    """This process's generator states: {"cpu": ..., "cuda": [one per visible device]}."""
    # the ignore: torch leaves torch.cuda.is_initialized unannotated
    used = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda = torch.cuda.get_rng_state_all() if used else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def restore_random_state(saved: list[dict[str, Any] | None], rank: int, world: int,
                         where: str) -> bool:
    """Restores rank `rank`'s generators from `saved` (one state per rank of the run that
    saved, None where it saved none); False, with a warning, when `world` differs from the
    ranks that saved or the state is missing. `where`: the checkpoint, for the warning."""
    state = saved[rank] if len(saved) == world and rank < len(saved) else None
    if state is None:
        if any(s is not None for s in saved):
            warnings.warn(f"the random state in {where} was saved by {len(saved)} process(es) "
                          f"and is loaded by {world}: not restored, so random draws (dropout) "
                          "after the resume differ from the run that saved it", UserWarning,
                          stacklevel=3)
        return False
    torch.set_rng_state(state["cpu"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        for index, device_state in enumerate(cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, index)
    return True

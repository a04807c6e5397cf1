"""What a rank of a multi-process pipeline pays beyond the work one process does, measured.

On a rank, each forward and backward of a stage and micro-batch goes through the distributed
executor (the tick's messages posted, the received values waited for, the values backward needs
kept), and each message costs both its ends a post and a completion: under gloo over loopback,
socket writes and the wake-ups of both processes' threads. None of it shows in one process.

Two processes here run compiled two-stage programs over gloo, as `fxpipe run` does: a chain whose
boundary carries one value and one whose boundary carries six, each at 1 and 8 micro-batches
(GPipe, no remat), their steps interleaved and the fastest kept. From 1 to 8 micro-batches a
step grows by what the profile's other figures predict plus, per micro-batch, the critical
path's actions times `action_overhead` and its messages times `message_overhead`; the two chains
tell the two apart (fit_rank_overheads). Both are 0 where the processes cannot be started.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fxpipe.profile.device import DeviceProfile

__all__ = ["fit_rank_overheads", "measure_rank_overheads"]

VALUES = (1, 6)  # values crossing the boundary of each probe
CHUNKS = (1, 8)
_ROUNDS, _STEPS = 16, 3  # interleaved rounds, steps of each program per round


class _Boundary(nn.Module):
    """Stage 0 makes `values` values of the input; stage 1 (from `out`) combines them."""

    def __init__(self, values: int, width: int = 8) -> None:
        super().__init__()
        self.inputs = nn.ModuleList(nn.Linear(width, width) for _ in range(values))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = [layer(x) for layer in self.inputs]
        y: torch.Tensor = self.out(hidden[0])
        for h in hidden[1:]:
            y = y + self.out(h)
        return y


Key = tuple[int, int]  # (values crossing, chunks)


def fit_rank_overheads(measured: Mapping[Key, float],
                       predicted: Mapping[tuple[float, float], Mapping[Key, float]]
                       ) -> tuple[float, float]:
    """(action_overhead, message_overhead) that make the predicted growth of a step from 1 to 8
    micro-batches equal the measured one, for both probes.

    measured: the fastest step of each probe and chunks; predicted: the predicted step of each
    at (action, message) overheads of (0, 0), (1, 0) and (0, 1) (the prediction is linear in
    them). Negative solutions (a machine faster than its other figures say) are 0."""
    def growth(steps: Mapping[Key, float], values: int) -> float:
        return steps[(values, CHUNKS[1])] - steps[(values, CHUNKS[0])]

    base = predicted[(0.0, 0.0)]
    rows = []
    for values in VALUES:
        excess = growth(measured, values) - growth(base, values)
        per_action = growth(predicted[(1.0, 0.0)], values) - growth(base, values)
        per_message = growth(predicted[(0.0, 1.0)], values) - growth(base, values)
        rows.append((per_action, per_message, excess))
    (a1, m1, e1), (a2, m2, e2) = rows
    det = a1 * m2 - a2 * m1
    if abs(det) < 1e-12:
        return max(e1 / a1, 0.0) if a1 else 0.0, 0.0
    action = (e1 * m2 - e2 * m1) / det
    message = (a1 * e2 - a2 * e1) / det
    if action < 0:  # all of it per message
        action, message = 0.0, max(e2 / m2 if m2 else 0.0, 0.0)
    elif message < 0:
        action, message = max(e1 / a1, 0.0), 0.0
    return action, message


def _programs(profile: DeviceProfile) -> dict[Key, tuple[Any, torch.Tensor]]:
    """Each probe at each chunks, compiled with `profile`, and its batch."""
    import fxpipe

    programs = {}
    for values in VALUES:
        torch.manual_seed(0)
        model, x = _Boundary(values), torch.randn(16, 8)
        for chunks in CHUNKS:
            programs[(values, chunks)] = (fxpipe.compile(
                model, (x,), stages=2, chunks=chunks, remat="never", schedule="gpipe",
                split_points=["out"], profile=profile), x)
    return programs


def _rank_main(profile_path: str, rendezvous: str, rank: int) -> None:
    """One rank: steps each probe, interleaved; rank 0 prints the fastest step of each as one
    line of JSON."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    with open(profile_path, encoding="utf-8") as f:
        profile = DeviceProfile.from_json(json.load(f))
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=2)
    programs = _programs(profile)
    for program, x in programs.values():
        program.step(x)
    fastest = {key: float("inf") for key in programs}
    for _ in range(_ROUNDS):
        for key, (program, x) in programs.items():
            dist.barrier()
            for _ in range(_STEPS):
                start = time.perf_counter()
                program.step(x)
                fastest[key] = min(fastest[key], time.perf_counter() - start)
    if rank == 0:
        print(json.dumps({f"{v},{c}": t for (v, c), t in fastest.items()}), flush=True)
    dist.barrier()  # neither rank tears its group down while the other still uses it
    dist.destroy_process_group()


def _pair(key: str) -> tuple[int, int]:
    first, second = key.split(",")
    return int(first), int(second)


def _predicted(profile: DeviceProfile) -> dict[tuple[float, float], dict[Key, float]]:
    """The predicted step of each probe at (action, message) overheads of (0, 0), (1, 0) and
    (0, 1), in this process."""
    predicted = {}
    for overheads in ((0.0, 0.0), (1.0, 0.0), (0.0, 1.0)):
        variant = dataclasses.replace(profile, action_overhead=overheads[0],
                                      message_overhead=overheads[1])
        predicted[overheads] = {key: program.plan.predicted_step_time
                                for key, (program, _) in _programs(variant).items()}
    return predicted


def measure_rank_overheads(profile: DeviceProfile, *, timeout: float = 180.0
                           ) -> tuple[float, float]:
    """(action_overhead, message_overhead) of this machine's CPU ranks over gloo, measured
    with two processes and the rest of `profile`; (0, 0) with a warning where they fail."""
    predicted = _predicted(profile)
    with tempfile.TemporaryDirectory(prefix="fxpipe-ranks-") as folder:
        path = os.path.join(folder, "profile.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(profile.to_json(), f)
        command = [sys.executable, "-m", "fxpipe.profile.ranks", path,
                   os.path.join(folder, "rendezvous")]
        # the processes import this fxpipe, wherever it was imported from
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(paths)}
        ranks: list[subprocess.Popen[str]] = []
        outputs: list[tuple[str, str]] = []
        why = f"no result within {timeout:.0f} s"
        try:
            for r in (0, 1):
                ranks.append(subprocess.Popen([*command, str(r)], env=env, text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            outputs = [rank.communicate(timeout=timeout) for rank in ranks]
        except OSError as e:
            why = f"{type(e).__name__}: {e}"
        except subprocess.TimeoutExpired:
            pass
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
                    rank.wait()
    failed = [r for r, rank in enumerate(ranks) if rank.returncode]
    if failed and len(outputs) == 2:
        why = (outputs[failed[0]][1].strip().splitlines() or ["no output"])[-1]
    if len(outputs) < 2 or failed or not outputs[0][0].strip():
        warnings.warn(f"could not measure what a pipeline rank pays per action and message "
                      f"({why}); predicted multi-process steps leave it out", stacklevel=2)
        return 0.0, 0.0
    measured = {_pair(k): float(v)
                for k, v in json.loads(outputs[0][0].strip().splitlines()[-1]).items()}
    return fit_rank_overheads(measured, predicted)


def _main(argv: Sequence[str]) -> int:
    _rank_main(argv[0], argv[1], int(argv[2]))
    return 0


if __name__ == "__main__":
    code = _main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # A probe rank ends here, its figures printed and its group destroyed. The interpreter's
    # teardown, which frees the last process-group objects, aborted one probe run in a few
    # dozen under load ("terminate called without an active exception"), so it is skipped.
    os._exit(code)

"""`fxpipe run`: a written program checked, with its arguments, before any rank starts; then run
under torchrun with each rank's errors in a log file, and a failure told in one line.

A bad folder or command (an altered file, a process count that is no multiple of the stages, a
misspelt option, a loss whose module cannot be imported, a busy port) is a ProgramFolderError or
ConfigError before launching (exit 2). A rank that fails is reported as `rank R (stage S)
failed: CAUSE (full log: PATH)` (exit 1); debug=True shows every process's output instead.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fxpipe.errors import ConfigError
from fxpipe.runtime.arguments import parse_program_args
from fxpipe.runtime.folder import check_program
from fxpipe.runtime.imports import program_loss
from fxpipe.runtime.launch import load_spec, rank_stages
from fxpipe.runtime.written import check_names
from fxpipe.state import StateNames

__all__ = ["RunPlan", "plan_run", "run_program", "free_port", "rank_failure"]


@dataclass(frozen=True)
class RunPlan:
    """A checked `fxpipe run` command."""

    folder: Path
    nproc: int
    placement: tuple[int, ...]  # the pipeline rank of each stage
    port: int
    program_args: tuple[str, ...]


def free_port() -> int:
    """A TCP port no process listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port


def _check_port(port: int) -> None:
    if not 0 < port < 65536:
        raise ConfigError(f"--port {port} is not a TCP port (1..65535)",
                          hint="omit --port to use a free one")
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise ConfigError(f"port {port} is in use on this machine (another run, or another "
                              "program, listens on it)",
                              hint="omit --port to use a free one, or pick another") from None


def plan_run(folder: str | os.PathLike[str], nproc: int, port: int | None,
             program_args: list[str]) -> RunPlan:
    """Checks the program, the process count, program.py's arguments, the loss's module and
    the port, all before any process starts."""
    checked = check_program(folder)
    spec = load_spec(Path(folder))  # imports the outputs' types, from the user's folders
    ranks = spec.ranks
    if nproc < 1 or nproc % ranks:
        what = f"{ranks} stages" if ranks == checked.stages else \
            f"{ranks} pipeline ranks ({checked.stages} stages, {spec.stages_per_rank} per rank)"
        raise ConfigError(f"--nproc {nproc} is not a multiple of the program's {what}",
                          hint=f"run {ranks} processes per replica: --nproc {ranks} (or "
                               f"{2 * ranks}, {3 * ranks}, ... for data-parallel replicas)")
    check_names(Path(folder), StateNames.from_json(spec.aliases), spec.structure)
    parse_program_args(program_args, spec)
    program_loss(spec.loss, checked.code, Path(folder))
    if port is None:
        port = free_port()
    else:
        _check_port(port)
    return RunPlan(Path(folder), nproc, tuple(spec.placement), port, tuple(program_args))


def run_program(plan: RunPlan, *, debug: bool = False) -> int:
    """Runs the planned command; returns 0, or 1 after printing the first rank's failure."""
    program = str(plan.folder / "program.py")
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.nproc)))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                str(plan.nproc), "--master-addr", "127.0.0.1", "--master-port", str(plan.port)]
    if debug:
        command = [*torchrun, program] if plan.nproc > 1 else [sys.executable, program]
        return subprocess.call([*command, *plan.program_args], env=env)
    logs = tempfile.mkdtemp(prefix="fxpipe-run-")
    if plan.nproc > 1:
        command = [*torchrun, "--log-dir", logs, "--redirects", "2", program]
        with open(os.path.join(logs, "torchrun.log"), "w") as own:
            code = subprocess.call([*command, *plan.program_args], env=env, stderr=own)
    else:
        os.makedirs(os.path.join(logs, "0"))
        with open(os.path.join(logs, "0", "stderr.log"), "w") as err:
            code = subprocess.call([sys.executable, program, *plan.program_args], env=env,
                                   stderr=err)
    if code == 0:
        shutil.rmtree(logs, ignore_errors=True)
        return 0
    print(f"fxpipe: error: {rank_failure(Path(logs), plan.placement)}", file=sys.stderr)
    return 1


_ERROR = re.compile(r"^rank \d+(?: \(stages? [^)]*\))?: error: (?P<cause>.*)$")
_STOPPED = "stopping, another rank failed or exited"


def _rank_logs(logs: Path) -> dict[int, Path]:
    """Each rank's stderr log: torchrun's LOGS/<run>/attempt_0/<rank>/stderr.log, or ours."""
    found: dict[int, Path] = {}
    for path in sorted(logs.rglob("stderr.log")):
        if path.parent.name.isdigit():
            found.setdefault(int(path.parent.name), path)
    return dict(sorted(found.items()))


def _cause(text: str) -> str | None:
    """What a rank's stderr says went wrong: its error line (and the error's hint), else a
    traceback's last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        match = _ERROR.match(line)
        if match:
            hint = next((h for h in lines[i + 1:] if h.startswith("hint: ")), None)
            return match["cause"] + (f"; {hint}" if hint else "")
    if any(line.startswith("Traceback") for line in lines):
        return lines[-1]
    return None


def rank_failure(logs: Path, placement: int | Sequence[int]) -> str:
    """One line on a failed run: the first rank that failed of its own accord, its stage, its
    cause, and where its whole log is. placement: the pipeline rank of each stage (a number of
    stages: one per rank)."""
    stage_ranks = list(range(placement)) if isinstance(placement, int) else list(placement)

    followers = []
    for rank, path in _rank_logs(logs).items():
        text = path.read_text(encoding="utf-8", errors="replace")
        cause = _cause(text)
        who = f"rank {rank} ({rank_stages(stage_ranks, rank)})"
        if cause is not None:
            return f"{who} failed: {cause} (full log: {path})"
        if _STOPPED in text:
            followers.append(f"{who} stopped: another rank failed or exited (full log: {path})")
    if followers:
        return followers[0]
    own = logs / "torchrun.log"
    text = own.read_text(encoding="utf-8", errors="replace") if own.exists() else ""
    last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")
    return f"the run failed before a rank reported why{': ' + last if last else ''} " \
           f"(full log: {own if own.exists() else logs})"

"""`fxpipe run`: a written program checked, with its arguments, before any rank starts; then run
under torchrun with each rank's errors in a log file, and a failure told in one line.

A bad folder or command (an altered file, a process count that is no multiple of the stages, a
misspelt option, a loss whose module cannot be imported, a busy port) is a ProgramFolderError or
ConfigError before launching (exit 2). A rank that fails is reported as `rank R (stage S)
failed: CAUSE (full log: PATH)` (exit 1); debug=True shows every process's output instead.
"""
from __future__ import annotations

import errno
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from fxpipe.errors import ConfigError
from fxpipe.runtime.launch import load_spec, rank_stages
from fxpipe.runtime.program.arguments import parse_program_args
from fxpipe.runtime.program.folder import check_program
from fxpipe.runtime.program.imports import program_loss

__all__ = ["RunPlan", "plan_run", "run_program", "free_port", "rank_failure"]


@dataclass(frozen=True)
class RunPlan:
    """A checked `fxpipe run` command."""

    folder: Path
    nproc: int
    placement: tuple[int, ...]  # the pipeline rank of each stage
    port: int
    program_args: tuple[str, ...]
    timeout: float = 60.0  # program.py's --timeout: how long a rank may wait for another


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


def plan_run(folder: str | os.PathLike[str], nproc: int | None, port: int | None,
             program_args: list[str]) -> RunPlan:
    """Checks the program, the process count (None: one replica), program.py's arguments, the
    loss's module and the port, all before any process starts."""
    checked = check_program(folder)
    spec = load_spec(Path(folder))  # imports the outputs' types, from the user's folders
    ranks = spec.ranks
    if nproc is None:
        nproc = ranks
    if nproc < 1 or nproc % ranks:
        what = f"{ranks} stages" if ranks == checked.stages else \
            f"{ranks} pipeline ranks ({checked.stages} stages, {spec.stages_per_rank} per rank)"
        raise ConfigError(f"--nproc {nproc} is not a multiple of the program's {what}",
                          hint=f"run {ranks} processes per replica: --nproc {ranks} (or "
                               f"{2 * ranks}, {3 * ranks}, ... for data-parallel replicas)")
    args = parse_program_args(program_args, spec)
    program_loss(spec.loss, checked.code, Path(folder))
    if port is None:
        port = free_port()
    else:
        _check_port(port)
    return RunPlan(Path(folder), nproc, tuple(spec.placement), port, tuple(program_args),
                   args.timeout)


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
            code, stopped = _supervise([*command, *plan.program_args], env, own, Path(logs),
                                       plan.timeout)
        if stopped is not None:
            print(f"fxpipe: error: rank {stopped} ({rank_stages(plan.placement, stopped)}) was "
                  f"stopped (SIGSTOP or a debugger) for longer than --timeout {plan.timeout:g} s; "
                  f"every rank was killed (logs: {logs})", file=sys.stderr)
            return 1
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


SHUTDOWN_S = 3.0
"""Seconds the other ranks get to exit once one has failed, before they are killed."""


def _supervise(command: list[str], env: dict[str, str], log: IO[str], logs: Path,
               timeout: float) -> tuple[int, int | None]:
    """Runs torchrun; returns its exit status and the rank that was stopped, if one was. Kills
    torchrun and its ranks SHUTDOWN_S after a rank failed if the run has not ended by then
    (torchrun waits 30 s for the ranks to exit on its SIGTERM, and a stopped rank never does),
    or when a rank has been stopped for longer than `timeout`."""
    proc = subprocess.Popen(command, env=env, stderr=log)
    failed_at: float | None = None
    stopped_since: dict[int, float] = {}
    try:
        while True:
            try:
                return proc.wait(timeout=0.5), None
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if failed_at is None and _failed(logs):
                failed_at = now
            if failed_at is not None and now - failed_at > SHUTDOWN_S:
                _kill_tree(proc.pid)
                return proc.wait(), None
            stopped = _stopped_ranks(proc.pid)
            stopped_since = {r: stopped_since.get(r, now) for r in stopped}
            late = [r for r, since in stopped_since.items() if now - since > timeout]
            if late:
                _kill_tree(proc.pid)
                proc.wait()
                return 1, min(late)
    except BaseException:  # Ctrl-C reached torchrun too, which stops the ranks
        try:
            proc.wait(timeout=SHUTDOWN_S)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
        raise


def _tree(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc (elsewhere: `pid` alone)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = [pid], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        tree += below
        todo += below
    return tree


def _kill_tree(pid: int) -> None:
    """Kills `pid` and every process below it: torchrun starts each rank in a session of its
    own, which no signal to torchrun's group reaches."""
    for each in _tree(pid):
        try:
            os.kill(each, signal.SIGKILL)
        except OSError:
            pass


def _stopped_ranks(pid: int) -> list[int]:
    """The ranks below torchrun `pid` that are stopped (state T: SIGSTOP, or a debugger)."""
    ranks = []
    for each in _tree(pid)[1:]:
        try:
            state = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state in ("T", "t"):
                environ = Path(f"/proc/{each}/environ").read_bytes().split(b"\0")
                rank = next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)
                if rank is not None:
                    ranks.append(rank)
        except (OSError, ValueError, IndexError):
            continue
    return ranks


def _tail(path: Path) -> str:
    """The last 64 KiB of a log."""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 65536))
        return f.read().decode("utf-8", errors="replace")


def _failed(logs: Path) -> bool:
    """Whether a rank has failed: it said so (an fxpipe error, or that it stops because another
    failed, both printed just before it exits), or torchrun began stopping the others."""
    texts = [_tail(path) for path in _rank_logs(logs).values()]
    own = logs / "torchrun.log"
    return any(_STOPPED in text or _ERROR.search(_PREFIX.sub("", text)) for text in texts) \
        or (own.exists() and "closing signal" in _tail(own))


_ERROR = re.compile(r"^rank \d+(?: \(stages? [^)]*\))?: error: (?P<cause>.*)$", re.MULTILINE)
_STOPPED = "stopping, another rank failed or exited"
_OTHER = re.compile(r"^(?:[EWIF]\d{4} |\[[EWIF]|Traceback|rank \d+)")  # a log line, not a message's
_MESSAGE_LINES = 8
_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:", re.MULTILINE)  # torch's on a rank's stderr
_FAILURE = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+).*\n\s*exitcode\s*:\s*(?P<code>-?\d+)",
                      re.MULTILINE)


def _rank_logs(logs: Path) -> dict[int, Path]:
    """Each rank's stderr log: torchrun's LOGS/<run>/attempt_0/<rank>/stderr.log, or ours."""
    found: dict[int, Path] = {}
    for path in sorted(logs.rglob("stderr.log")):
        if path.parent.name.isdigit():
            found.setdefault(int(path.parent.name), path)
    return dict(sorted(found.items()))


def _cause(text: str) -> str | None:
    """What a rank's stderr says went wrong: its error line (and the error's hint), else a
    traceback's last line. torch prefixes the lines of a rank's traceback with `[rankN]:`."""
    lines = [line.strip() for line in _PREFIX.sub("", text).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        match = _ERROR.match(line)
        if match:
            hint = next((h for h in lines[i + 1:] if h.startswith("hint: ")), None)
            # the message's own lines (a list of problems) up to its hint or the next log line
            more = list(itertools.takewhile(
                lambda rest: not rest.startswith("hint: ") and not _OTHER.match(rest),
                lines[i + 1:]))
            told = " ".join([match["cause"], *more[:_MESSAGE_LINES]])
            return told + (" ..." if len(more) > _MESSAGE_LINES else "") + \
                (f"; {hint}" if hint else "")
    if any(line.startswith("Traceback") for line in lines):
        return lines[-1]
    return None


def _exits(torchrun_log: str) -> tuple[dict[int, int], int | None]:
    """torchrun's failure table: each failed rank's exit code (-N: killed by signal N), and the
    rank torchrun saw fail first (its "Root Cause"), if any."""
    failed = {int(m["rank"]): int(m["code"]) for m in _FAILURE.finditer(torchrun_log)}
    _, root_marker, root_part = torchrun_log.partition("Root Cause")
    root = _FAILURE.search(root_part) if root_marker else None
    return failed, int(root["rank"]) if root else None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def rank_failure(logs: Path, placement: int | Sequence[int]) -> str:
    """One line on a failed run: the rank that failed of its own accord, its stage, its cause
    (an error, a traceback's last line, the signal that killed it, or that it hung), and where
    its whole log is. placement: the pipeline rank of each stage (a number of stages: one per
    rank)."""
    stage_ranks = list(range(placement)) if isinstance(placement, int) else list(placement)
    own = logs / "torchrun.log"
    torchrun_text = own.read_text(encoding="utf-8", errors="replace") if own.exists() else ""
    failed, root = _exits(torchrun_text)
    rank_logs = _rank_logs(logs)
    texts = {rank: path.read_text(encoding="utf-8", errors="replace")
             for rank, path in rank_logs.items()}

    def who(rank: int) -> str:
        return f"rank {rank} ({rank_stages(stage_ranks, rank)})"

    def where(rank: int) -> str:
        return f"(full log: {rank_logs.get(rank, own)})"

    for rank, text in texts.items():  # an fxpipe error: the rank says what was wrong
        if any(_ERROR.match(line.strip()) for line in _PREFIX.sub("", text).splitlines()):
            return f"{who(rank)} failed: {_cause(text)} {where(rank)}"
    # killed by a signal: torchrun's own SIGTERM to the others after a failure does not count
    killed = [r for r, code in failed.items()
              if code < 0 and (r == root or -code != signal.SIGTERM)]
    for rank in sorted(killed, key=lambda r: r != root):
        return f"{who(rank)} was killed by {_signal_name(-failed[rank])} {where(rank)}"
    order = sorted(texts, key=lambda r: r != root)  # torchrun's first failure first
    for rank in order:
        cause = _cause(texts[rank])
        if cause is not None:
            return f"{who(rank)} failed: {cause} {where(rank)}"
    followers = [r for r in order if _STOPPED in texts[r]]
    silent = [r for r in texts if r not in followers and r not in failed]
    if followers and silent:  # the others gave up waiting for it: it hung, or was stopped
        return (f"{who(silent[0])} hung or was stopped: it neither finished nor reported an "
                f"error, and {who(followers[0])} stopped waiting for it after --timeout "
                f"{where(silent[0])}")
    if followers:
        return f"{who(followers[0])} stopped: another rank failed or exited {where(followers[0])}"
    last = next((line.strip() for line in reversed(torchrun_text.splitlines())
                 if line.strip() and not set(line.strip()) <= set("=-")), "")
    return f"the run failed before a rank reported why{': ' + last if last else ''} " \
           f"(full log: {own if own.exists() else logs})"

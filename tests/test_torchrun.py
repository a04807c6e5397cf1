"""fxpipe.runtime.program.torchrun: a failed run told in one line, from the ranks' log files."""
from __future__ import annotations

from pathlib import Path

from fxpipe.runtime.program.torchrun import rank_failure


def _log(logs: Path, rank: int, text: str) -> Path:
    path = logs / "run_x" / "attempt_0" / str(rank) / "stderr.log"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def test_the_rank_that_failed_of_its_own_accord_is_told_not_the_ones_that_stopped(tmp_path):
    _log(tmp_path, 0, "rank 0 (stage 0): stopping, another rank failed or exited (recv)\n")
    log = _log(tmp_path, 1, 'Traceback (most recent call last):\n  File "stage_1.py", line 9\n'
                            "RuntimeError: mat1 and mat2 shapes cannot be multiplied\n")
    assert rank_failure(tmp_path, 2) == ("rank 1 (stage 1) failed: RuntimeError: mat1 and mat2 "
                                         f"shapes cannot be multiplied (full log: {log})")


def test_an_fxpipe_error_is_told_with_its_hint_and_the_stage_of_a_replica(tmp_path):
    log = _log(tmp_path, 3, "W1202 some warning\nrank 3 (stage 1): error: no weights\n"
                            "hint: run with --init\n")
    assert rank_failure(tmp_path, 2) == \
        f"rank 3 (stage 1) failed: no weights; hint: run with --init (full log: {log})"


def test_without_a_rank_that_says_why_the_last_line_of_torchrun_is_told(tmp_path):
    log = _log(tmp_path, 0, "rank 0 (stage 0): stopping, another rank failed or exited (x)\n")
    assert rank_failure(tmp_path, 2) == ("rank 0 (stage 0) stopped: another rank failed or "
                                         f"exited (full log: {log})")
    (tmp_path / "torchrun.log").write_text("Traceback ...\nChildFailedError: signal 9\n\n")
    log.unlink()
    assert rank_failure(tmp_path, 2) == ("the run failed before a rank reported why: "
                                         "ChildFailedError: signal 9 (full log: "
                                         f"{tmp_path / 'torchrun.log'})")


def _torchrun_log(logs: Path, *, root: tuple[int, int], other: tuple[int, int]) -> None:
    """torchrun's failure table: (rank, exit code) of the first failure and of another."""
    def entry(rank: int, code: int) -> str:
        cause = f"Signal {-code} received by PID 9" if code < 0 else "To enable traceback see: ..."
        return (f"  time      : 2026-12-03_10:43:43\n  host      : localhost\n"
                f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: 9)\n"
                f"  error_file: <N/A>\n  traceback : {cause}\n")
    (logs / "torchrun.log").write_text(
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n" + "=" * 60
        + "\nprog/program.py FAILED\n" + "-" * 60 + "\nFailures:\n[1]:\n" + entry(*other)
        + "-" * 60 + "\nRoot Cause (first observed failure):\n[0]:\n" + entry(*root)
        + "=" * 60 + "\n")


def test_a_traceback_that_torch_prefixes_with_the_rank_is_told(tmp_path):
    log = _log(tmp_path, 0, "[rank0]: Traceback (most recent call last):\n"
                            '[rank0]:   File "launch.py", line 9, in _run\n'
                            "[rank0]: ValueError: Invalid learning rate: -1.0\n")
    _log(tmp_path, 1, "[rank1]: Traceback (most recent call last):\n"
                      "[rank1]: RuntimeError: Connection closed by peer\n")
    _torchrun_log(tmp_path, root=(0, 1), other=(1, -15))  # torchrun stopped rank 1
    assert rank_failure(tmp_path, 2) == ("rank 0 (stage 0) failed: ValueError: Invalid learning "
                                         f"rate: -1.0 (full log: {log})")


def test_a_rank_killed_by_a_signal_is_named_with_it_not_the_survivor(tmp_path):
    _log(tmp_path, 0, "rank 0 (stage 0): stopping, another rank failed or exited (recv)\n")
    log = _log(tmp_path, 1, "")
    _torchrun_log(tmp_path, root=(1, -9), other=(0, 1))
    assert rank_failure(tmp_path, 2) == f"rank 1 (stage 1) was killed by SIGKILL (full log: {log})"


def test_a_rank_that_neither_finished_nor_reported_is_told_as_hung(tmp_path):
    _log(tmp_path, 0, "rank 0 (stage 0): stopping, another rank failed or exited (timed out)\n")
    log = _log(tmp_path, 1, "")
    assert rank_failure(tmp_path, 2) == (
        "rank 1 (stage 1) hung or was stopped: it neither finished nor reported an error, and "
        f"rank 0 (stage 0) stopped waiting for it after --timeout (full log: {log})")


def test_an_fxpipe_error_of_several_lines_is_told_whole_before_its_hint(tmp_path):
    log = _log(tmp_path, 1, "rank 1 (stage 1): error: the checkpoint is of another model "
                            "(2 problems):\n  - model class Other, not Net\n"
                            "  - missing keys: head.weight\nhint: resume from this model's\n"
                            "W1202 00:00:00 a later log line\n")
    assert rank_failure(tmp_path, 2) == (
        "rank 1 (stage 1) failed: the checkpoint is of another model (2 problems): - model "
        "class Other, not Net - missing keys: head.weight; hint: resume from this model's "
        f"(full log: {log})")

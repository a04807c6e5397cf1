"""fxpipe.runtime.torchrun: a failed run told in one line, from the ranks' log files."""
from __future__ import annotations

from pathlib import Path

from fxpipe.runtime.torchrun import rank_failure


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

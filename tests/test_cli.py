"""The command line, end to end on small models."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fxpipe.cli import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fxpipe", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env=env)


def test_help_works_both_ways():
    for command in (["fxpipe", "--help"], [sys.executable, "-m", "fxpipe", "--help"]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0
        assert "compile" in result.stdout and "bench-partition" in result.stdout


def test_compile_prints_the_report_and_writes_the_program(tmp_path, capsys):
    code = main(["compile", "fxpipe.models.mlp:build", "--stages", "2", "--chunks", "4",
                 "--profile", "a100", "--out", str(tmp_path / "prog")])
    out = capsys.readouterr().out
    assert code == 0
    assert "fxpipe partition of MLP: 2 stages x 4 micro-batches" in out
    assert "bubble (K-1)/(M+K-1): 20.0%" in out
    for name in ("stage_0.py", "stage_1.py", "program.py", "program.json", "weights.pt",
                 "batch.pt", "report.txt", "report.json"):
        assert (tmp_path / "prog" / name).exists(), name
    header = (tmp_path / "prog" / "stage_0.py").read_text()
    assert "fxpipe compile fxpipe.models.mlp:build --stages 2 --chunks 4" in header


def test_a_bad_factory_is_one_clear_error_with_exit_status_2(capsys):
    assert main(["compile", "fxpipe.models.nothing:build"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxpipe: error: cannot import module 'fxpipe.models.nothing'")
    assert "Traceback" not in err
    assert main(["compile", "fxpipe.models.mlp:nothing"]) == 2
    assert "has no attribute 'nothing'" in capsys.readouterr().err
    assert main(["compile", "no-colon"]) == 2
    assert "expected MODULE:FACTORY" in capsys.readouterr().err


def test_bad_options_are_reported_with_their_values(capsys):
    assert main(["compile", "fxpipe.models.mlp:build", "--stages", "0"]) == 2
    assert "stages must be an integer >= 1 (got 0)" in capsys.readouterr().err
    assert main(["compile", "fxpipe.models.mlp:build", "--chunks", "3", "--profile", "a100"]) == 2
    assert "batch size 8 cannot be split into 3 equal micro-batches" in capsys.readouterr().err


def test_costs_prints_a_sorted_table(capsys):
    assert main(["costs", "fxpipe.models.mlp:build", "--sort", "fwd_flops", "--top", "3",
                 "--profile", "a100"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:2] == ["node", "module"]
    assert len(lines) == 2 + 3


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli") / "prog"
    code = main(["compile", "fxpipe.models.gpt:build", "--set", "dropout=0.0", "--stages", "2",
                 "--chunks", "4", "--profile", "a100", "--out", str(folder)])
    assert code == 0
    return folder


def test_report_reads_a_written_program(written, capsys):
    assert main(["report", str(written)]) == 0
    assert "fxpipe partition of GPT" in capsys.readouterr().out
    assert main(["report", str(written), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["stages"] == 2


def test_run_trains_a_written_program_on_two_processes_and_writes_a_chrome_trace(written):
    trace = written / "trace.json"
    result = _run("run", str(written), "--nproc", "2", "--port", str(_free_port()), "--steps", "2",
                  "--verify", "--timeline", str(trace))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verify: OK" in result.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert tracks == {"stage 0", "stage 1"}
    kinds = {(e["tid"], e["cat"]) for e in events if e.get("ph") == "X"}
    assert {(0, "forward"), (0, "backward"), (1, "forward"), (1, "backward"), (0, "send"),
            (1, "recv")} <= kinds
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events if e.get("ph") == "X")
    processes = {e["args"]["name"]: e["pid"] for e in events if e.get("name") == "process_name"}
    assert set(processes) == {"measured", "predicted"}  # the prediction, to compare with
    predicted = [e for e in events if e.get("ph") == "X" and e["pid"] == processes["predicted"]]
    assert len([e for e in predicted if e["cat"] == "forward"]) == 2 * 4  # 2 stages x 4 chunks


def test_run_of_a_folder_without_a_program_is_a_clear_error(tmp_path, capsys):
    assert main(["run", str(tmp_path), "--nproc", "2"]) == 2
    assert "has no program.py" in capsys.readouterr().err


def test_demo_runs_the_main_job(tmp_path):
    result = _run("demo", "--out", "demo", "--steps", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fxpipe partition of GPT" in result.stdout
    assert "verify: OK" in result.stdout
    assert (tmp_path / "demo" / "stage_1.py").exists()
    assert (tmp_path / "demo" / "timeline.json").exists()

"""The command line, end to end on small models."""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import io
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe import cli
from fxpipe.cli import main
from fxpipe.errors import ConfigError, PipelineRuntimeError, ProgramFolderError
from fxpipe.runtime import launch
from fxpipe.runtime.planning.timeline import Event, chrome_trace
from fxpipe.runtime.program.spec import ProgramSpec
from fxpipe.runtime.program.torchrun import free_port, rank_failure


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fxpipe", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env=env)


def test_help_works_both_ways():
    for command in (["fxpipe", "--help"], [sys.executable, "-m", "fxpipe", "--help"]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0
        assert "compile" in result.stdout and "bench-partition" in result.stdout


@pytest.mark.parametrize("command", [[], ["compile"], ["run"], ["bench"], ["profile"]])
def test_help_imports_no_torch(command):
    """Each command imports what it runs: the parser alone answers --help, without torch."""
    script = ("import sys\nfrom fxpipe.cli import main\ntry:\n    main(sys.argv[1:])\n"
              "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script, *command, "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: fxpipe" in result.stdout
    assert result.stdout.splitlines()[-1] == "False"


def test_the_same_compile_on_two_machines_writes_the_same_stage_files(tmp_path, monkeypatch,
                                                                    capsys):
    """`fxpipe compile ... --out DIR` with the profile measured on each machine: two cache
    folders hold one device's profile measured at different speeds (as two machines would)."""
    from fxpipe.profile import cache, preset, profile_key

    def refuse(*args, **kwargs):
        raise AssertionError("the cached profile should have been read, not measured again")

    monkeypatch.setattr(cache, "measure", refuse)
    key = profile_key("cpu", torch.float32)
    for machine, factor in (("one", 1.0), ("two", 2.5)):
        slower = preset("a100").scaled(factor)  # and its link too: the same cut, slower
        measured = dataclasses.replace(slower, key=key, link=slower.link.scaled(factor),
                                       link_latency=slower.link_latency * factor,
                                       name=f"measured cpu of machine {machine}",
                                       source=f"measured on cpu of machine {machine}")
        monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path / machine / "cache"))
        cache.clear_memory()
        path = cache.profile_path(key)
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(measured.to_json()))
        assert main(["compile", "fxpipe.models.mlp:build", "--stages", "2", "--chunks", "4",
                     "--out", str(tmp_path / machine / "prog")]) == 0
        assert f"device profile: measured cpu of machine {machine}" in capsys.readouterr().out
    cache.clear_memory()
    one, two = tmp_path / "one" / "prog", tmp_path / "two" / "prog"
    assert (one / "report.txt").read_text() != (two / "report.txt").read_text()
    for name in ("stage_0.py", "stage_1.py", "program.py"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name


def test_compile_prints_the_report_and_writes_the_program(tmp_path, capsys):
    code = main(["compile", "fxpipe.models.mlp:build", "--stages", "2", "--chunks", "4",
                 "--profile", "a100", "--out", str(tmp_path / "prog")])
    out = capsys.readouterr().out
    assert code == 0
    assert "fxpipe partition of MLP: 2 stages x 4 micro-batches" in out
    assert "bubble (idle share of the ranks): " in out  # one bubble: the simulated one
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
    trace = written / "trace.json"  # --nproc left out: the program's 2 ranks
    result = _run("run", str(written), "--port", str(free_port()), "--steps", "2", "--verify",
                  "--timeline", str(trace))
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


def _clipped_losses(folder: Path, max_norm: float, steps: int) -> list[float]:
    """The plain model trained as the written program trains (SGD with momentum 0.9 at the
    program's lr, on its example batch), clipping its gradients to `max_norm` every step."""
    from fxpipe.losses import default_loss
    from fxpipe.models import gpt
    from fxpipe.runtime.launch import load_spec
    model, _ = gpt.build(dropout=0.0)
    batch = torch.load(folder / "batch.pt", weights_only=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=load_spec(folder).lr, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = default_loss(model(*batch["inputs"]), batch["target"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def test_the_written_program_clips_by_the_whole_models_norm(written, capsys):
    expected = _clipped_losses(written, 0.05, 3)
    unclipped = launch.load_spec(written).reference_losses
    assert abs(expected[2] - unclipped[2]) > 1e-3  # clipping changes the third step's loss
    result = _run("run", str(written), "--port", str(free_port()), "--steps", "3",
                  "--clip-grad-norm", "0.05")
    assert result.returncode == 0, result.stdout + result.stderr
    assert launch.main(written, ["--steps", "3", "--clip-grad-norm", "0.05"]) == 0
    for out in (result.stdout, capsys.readouterr().out):  # 2 processes, then one
        losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", out)]
        assert losses == pytest.approx(expected, rel=1e-5), out


def test_run_of_a_folder_without_a_program_is_a_clear_error(tmp_path, capsys):
    assert main(["run", str(tmp_path), "--nproc", "2"]) == 2
    assert "has no program.json, so it is no program fxpipe wrote" in capsys.readouterr().err


def _altered(written: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "altered"
    shutil.copytree(written, folder)
    with open(folder / "weights.pt", "ab") as f:
        f.write(b"\0")
    return folder


def test_report_checks_the_program_and_says_what_it_imports(written, tmp_path, capsys):
    assert main(["report", str(written)]) == 0
    assert capsys.readouterr().out.endswith("\nprogram: 2 stages, loss default (fxpipe's own)\n")
    assert main(["report", str(_altered(written, tmp_path))]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("fxpipe: error: ") and "weights.pt is not the file the program was " \
        "written with" in err[0]
    assert err[1].startswith("hint: write the program again") and len(err) == 2


@pytest.mark.parametrize("args,expected", [
    (["--nproc", "3"], "--nproc 3 is not a multiple of the program's 2 stages"),
    (["--nproc", "2", "--stpes", "3"],
     "program.py does not take '--stpes' (did you mean --steps?)"),
    (["--steps", "x"], "program.py argument --steps: invalid int value: 'x'"),
    (["--nproc", "2", "--lr", "nan", "--verify"],
     "program.py --lr nan is not a learning rate (allowed: a finite number >= 0)"),
    (["--nproc", "2", "--lr", "-1"],
     "program.py --lr -1.0 is not a learning rate (allowed: a finite number >= 0)"),
    (["--nproc", "2", "--steps", "-1"], "program.py --steps -1 is negative (allowed: 0 or more)"),
    (["--nproc", "2", "--steps", "0", "--verify"],
     "program.py --verify with --steps 0 would check no loss"),
    (["--nproc", "2", "--timeout", "0"],
     "program.py --timeout 0.0 is not a number of seconds (allowed: a finite number > 0)"),
    (["--nproc", "2", "--timeline", "/nonexistent/t.json"],
     "program.py --timeline /nonexistent/t.json is in /nonexistent, which is no folder"),
    (["--nproc", "2", "--clip-grad-norm", "0"],
     "program.py --clip-grad-norm 0.0 is not a norm (allowed: a finite number > 0)"),
    (["--nproc", "2", "--clip-grad-norm", "1", "--verify"],
     "program.py --verify compares with losses recorded without clipping, and "
     "--clip-grad-norm 1.0 changes every later step"),
])
def test_run_checks_its_arguments_before_starting_a_process(written, capsys, args, expected):
    assert main(["run", str(written), *args]) == 2
    assert capsys.readouterr().err.splitlines()[0] == f"fxpipe: error: {expected}"


@pytest.mark.parametrize("args", [["--lr", "nan", "--steps", "3", "--verify"],
                                  ["--steps", "0", "--verify"], ["--steps", "-1", "--verify"]])
def test_a_written_program_refuses_arguments_that_would_verify_nothing(written, capsys, args):
    assert launch.main(written, args) == 2
    out = capsys.readouterr()
    assert "verify: OK" not in out.out and "rank 0 (stage 0): error: program.py" in out.err


def test_verify_fails_on_a_loss_that_is_not_finite_and_when_nothing_was_checked(written, capsys):
    spec = launch.load_spec(written)
    reference = list(spec.reference_losses)
    assert launch._verify(spec, reference, spec.lr) == 0
    assert launch._verify(spec, [reference[0], math.nan, math.nan], spec.lr) == 1
    assert "rank 0 (stage 0): error: verify: MISMATCH: step 1 loss nan against the plain " \
        "model's" in capsys.readouterr().err
    assert launch._verify(spec, [math.inf], spec.lr) == 1
    assert launch._verify(spec, reference, math.nan) == 1
    assert launch._verify(spec, [], spec.lr) == 1
    assert "no step ran, so no loss was checked" in capsys.readouterr().err
    broken = dataclasses.replace(spec, reference_losses=(math.nan, *reference[1:]))
    assert launch._verify(broken, reference, spec.lr) == 1
    assert "verify: OK" not in capsys.readouterr().out


def test_a_verify_that_fails_is_the_headline_of_fxpipe_run_and_says_why(written, capsys):
    spec = launch.load_spec(written)
    assert launch._verify(spec, [x * 1.5 for x in spec.reference_losses], spec.lr) == 1
    assert launch._verify(dataclasses.replace(spec, reference_losses=()), [1.0], spec.lr) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("rank 0 (stage 0): error: verify: MISMATCH: steps 0..")
    assert "from a model on the meta device, which has no weights" in err[1]  # no larger steps
    logs = written.parent / "logs-of-a-failed-verify"
    (logs / "0").mkdir(parents=True, exist_ok=True)
    (logs / "0" / "stderr.log").write_text(err[0] + "\n")
    assert rank_failure(logs, spec.placement).startswith(
        "rank 0 (stage 0) failed: verify: MISMATCH: steps 0..")


def test_run_refuses_an_altered_program_and_a_busy_port_before_starting(written, tmp_path, capsys):
    assert main(["run", str(_altered(written, tmp_path)), "--nproc", "2"]) == 2
    assert "weights.pt is not the file the program was written with" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["run", str(written), "--nproc", "2", "--port", str(port)]) == 2
    assert capsys.readouterr().err.splitlines()[0] == \
        f"fxpipe: error: port {port} is in use on this machine (another run, or another " \
        "program, listens on it)"


def _edited(written: Path, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "edited"
    shutil.copytree(written, folder)
    data = json.loads((folder / "program.json").read_text())
    edit(data)
    (folder / "program.json").write_text(json.dumps(data))
    return folder


def _swap_aliases(data):
    """Two tensors of one shape saved under each other's names (each names itself unless
    listed)."""
    a, b = "blocks.0.attn.c_attn.weight", "blocks.1.attn.c_attn.weight"
    data["aliases"].update({a: [b], b: [a]})


@pytest.mark.parametrize("edit,expected", [
    (lambda d: d["stages"][0].update(inputs=[5]),
     "stages[0].inputs is [5] (allowed: distinct indexes of the program's 1 inputs, 0..0)"),
    (lambda d: d["signature"].update(out_spec="garbage"), "signature.out_spec is 'garbage'"),
    (lambda d: d["stages"][1].update(file="stage_0.py"),
     "stages[1].file is 'stage_0.py', as stages[0]'s (allowed: a file of its own)"),
    (lambda d: d["stages"][1]["recvs"][0].update(value={"kind": "tensor"}),
     "stages[1].recvs['blocks_0_add_1'].value is {'kind': 'tensor'}"),
    (lambda d: d["signature"]["leaves"][0].update(dtype="float99"), "signature.leaves[0] is"),
    (lambda d: d["stages"][0].update(random="no"), "stages[0].random is 'no'"),
    (lambda d: d.update(aliases=[]), "aliases is [] (allowed: tensor name -> its state_dict keys)"),
    (lambda d: d.update(schedule=["gpipe"]), "schedule is ['gpipe'] (allowed: gpipe,"),
])
def test_report_refuses_every_program_json_field_fxpipe_would_not_write(written, tmp_path, capsys,
                                                                       edit, expected):
    folder = _edited(written, tmp_path, edit)
    assert main(["report", str(folder)]) == 2
    err = capsys.readouterr().err
    assert expected in err and "hint: write the program again" in err, err
    data = json.loads((folder / "program.json").read_text())
    with pytest.raises(ProgramFolderError, match="was it edited by hand") as info:
        ProgramSpec.from_json(data)
    assert expected in str(info.value)


def test_swapped_aliases_are_refused_before_a_save_could_swap_the_weights(written, tmp_path,
                                                                          capsys):
    folder = _edited(written, tmp_path, _swap_aliases)
    assert launch.main(folder, ["--steps", "1", "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "the field aliases does not agree with weights.json" in err
    assert "aliases['blocks.0.attn.c_attn.weight'] is ['blocks.1.attn.c_attn.weight'], without " \
        "'blocks.0.attn.c_attn.weight'" in err
    assert not (tmp_path / "ckpt").exists()
    assert main(["run", str(folder), "--nproc", "2"]) == 2
    assert "the field aliases does not agree" in capsys.readouterr().err.splitlines()[0]


@pytest.mark.parametrize("edit,expected", [
    (lambda d: d.update(shared={}), "the field shared is {}, but the stage files bind the "
                                    "parameters 'wte.weight' (stages [0, 1]) in several stages"),
    (lambda d: d["stages"][0].update(class_name="Stage9"),
     "program.json's stages[0].class_name is 'Stage9', which stage_0.py does not define"),
    (lambda d: d["signature"].update(out_batch_dims=[5]),
     "output 0 is a tensor of shape (2, 32, 512), but the program's signature says its batch "
     "dimension is 5"),
    (lambda d: d["aliases"].update({"ln_x.weight": ["ln_f.weight"]}),
     "aliases names 'ln_x.weight', which no stage binds"),
    (lambda d: d["aliases"].update({"ln_f.weight": ["ln_f.bias"]}),
     "aliases['ln_f.weight'] is ['ln_f.bias'], without 'ln_f.weight'"),
])
def test_a_program_json_the_stage_files_contradict_is_refused_before_it_trains(
        written, tmp_path, capsys, edit, expected):
    folder = _edited(written, tmp_path, edit)
    assert launch.main(folder, ["--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "write the program again" in err, err


def _tamperings(data: dict) -> list[tuple[str, object]]:
    """Every field of program.json, of its first stage and of its signature set to values of
    the wrong type or range, and edits that keep the types: swapped or missing names."""
    def setter(path: tuple, value: object):
        def edit(d: dict) -> None:
            for key in path[:-1]:
                d = d[key]
            d[path[-1]] = value
        return edit

    bad = (None, "x", -1, 1.5, [], [5], {}, {"x": [9]})
    fields = [(k,) for k in sorted(data) if k != "files"]
    fields += [("stages", 0, k) for k in sorted(data["stages"][0])]
    fields += [("signature", k) for k in sorted(data["signature"])]
    edits = [(f"{'.'.join(map(str, f))}={b!r}", setter(f, b)) for f in fields for b in bad]
    edits += [("aliases swapped", _swap_aliases),
              ("the tied weight's alias dropped", lambda d: d["aliases"].pop("wte.weight")),
              ("stages[1].file=stage_0.py", setter(("stages", 1, "file"), "stage_0.py")),
              ("stages swapped", lambda d: d["stages"].reverse())]
    return edits


# Values a program may hold (an older program's, a stage that receives nothing) or that only
# name things: the program runs, and --verify checks the losses.
_VALID = {"autocast=None", "structure=None", "predicted_events=[]", "stages.0.recvs=[]",
          "signature.out_spec=None", "signature.pytree_modules=[]", "fxpipe='x'", "model='x'"}


def _outcome(call) -> str:
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = call()
    except Exception as e:  # noqa: BLE001 - what is counted here
        return f"raw {type(e).__name__}: {e}"
    if code == 0 and "verify: OK" not in out.getvalue():
        return "silent"
    return {0: "verified", 1: "noticed", 2: "refused"}.get(code, f"exit {code}")


@pytest.mark.slow
def test_tampered_program_json_and_bad_arguments_never_run_silently_or_raise_raw(written,
                                                                                 tmp_path):
    data = json.loads((written / "program.json").read_text())
    outcomes: dict[str, str] = {}
    for name, edit in _tamperings(data):
        folder = _edited(written, tmp_path / str(len(outcomes)), edit)
        report = _outcome(lambda f=folder: main(["report", str(f)]))
        run = _outcome(lambda f=folder: launch.main(f, ["--steps", "2", "--verify"]))
        outcomes[name] = report if report.startswith("raw") else run  # report computes nothing
        if name in _VALID:
            assert run == "verified", (name, run)
    for argv in (["--lr", "nan"], ["--lr", "inf"], ["--lr", "-1"], ["--steps", "-1"],
                 ["--steps", "0"], ["--steps", "x"], ["--timeout", "0"], ["--timeout", "nan"],
                 ["--dp-bucket-mb", "-1"], ["--timeline", str(tmp_path / "no" / "t.json")],
                 ["--timeline", str(tmp_path)], ["--weights", str(tmp_path / "none.pt")]):
        outcomes[" ".join(argv)] = _outcome(lambda a=argv: launch.main(written, [*a, "--verify"]))
        run = _outcome(lambda a=argv: main(["run", str(written), "--nproc", "2", *a, "--verify"]))
        assert run in ("refused", "noticed"), (argv, run)
    counts = collections.Counter(o.split(":")[0] for o in outcomes.values())
    raw = {k: v for k, v in outcomes.items() if v.startswith("raw")}
    silent = [k for k, v in outcomes.items() if v == "silent"]
    print(f"{len(outcomes)} trials: {dict(counts)}")
    assert not raw and not silent, (raw, silent)


def test_run_tells_a_failing_rank_in_one_line_with_its_log(written):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    result = subprocess.run([sys.executable, "-m", "fxpipe", "run", str(written), "--nproc", "2",
                             "--steps", "1", "--weights", str(written / "missing.pt")],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fxpipe: error: rank 0 (stage 0) failed: ")
    assert "missing.pt" in lines[0]
    log = lines[0].rpartition("(full log: ")[2].removesuffix(")")
    assert "rank 0 (stage 0): error:" in Path(log).read_text()
    torchrun = Path(log).parents[3] / "torchrun.log"  # kept, as the ranks' logs, after a failure
    assert "OMP_NUM_THREADS" not in torchrun.read_text()  # set for the ranks: no banner


def test_demo_runs_the_main_job(tmp_path):
    result = _run("demo", "--out", "demo", "--steps", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fxpipe partition of GPT" in result.stdout
    assert "verify: OK" in result.stdout
    assert (tmp_path / "demo" / "stage_1.py").exists()
    assert (tmp_path / "demo" / "timeline.json").exists()


_FACTORY = '''
import torch
from torch import nn


def build(width=4):
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    return model, (torch.randn(8, width),)
'''


def test_a_factory_beside_the_user_imports_from_the_current_folder(tmp_path, monkeypatch, capsys):
    (tmp_path / "mymodel_here.py").write_text(_FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert main(["costs", "mymodel_here:build", "--profile", "a100"]) == 0
    assert "node" in capsys.readouterr().out


def test_an_unknown_factory_keyword_is_one_line_naming_the_accepted_ones(capsys):
    assert main(["compile", "fxpipe.models.mlp:build", "--set", "n_layerz=6"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "fxpipe.models.mlp:build takes no keyword 'n_layerz' (it accepts " in err
    assert "hint: --set one of: " in err


def test_debug_is_accepted_after_the_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compile", "fxpipe.models.mlp:build", "--debug", "--help"])
    assert exit_.value.code == 0
    assert main(["compile", "fxpipe.models.mlp:nothing", "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_a_misspelt_option_gets_a_suggestion_and_exit_status_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compile", "fxpipe.models.mlp:build", "--stags", "2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: fxpipe compile" in err
    assert "unrecognized arguments: --stags 2 (did you mean --stages?)" in err


@pytest.mark.parametrize("option", [["--remat", "sometimes"], ["--schedule", "zb"],
                                    ["--balance", "evenly"], ["--chunks", "many"],
                                    ["--memory-limit", "1GBytes"]])
def test_choices_are_checked_before_compiling(option, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compile", "fxpipe.models.nothing:build", *option])  # no import: refused before
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option[0]}: " in err and "cannot import" not in err


@pytest.mark.parametrize(("size", "nbytes"), [
    ("1GB", 10**9), ("1.5 GiB", 1.5 * 2**30), ("512MiB", 512 * 2**20), ("64kb", 64_000),
    ("2KiB", 2048), ("1TB", 10**12), ("100B", 100), ("2048", 2048), ("1e9", 10**9)])
def test_memory_limit_takes_a_unit_and_plain_numbers_stay_bytes(size, nbytes, monkeypatch,
                                                                 capsys):
    seen = {}

    def compile_program(model, inputs, **options):
        seen.update(options)
        raise ConfigError("stopped before compiling", hint="none")

    monkeypatch.setattr("fxpipe.api.compile", compile_program)  # the command imports it
    assert main(["compile", "fxpipe.models.mlp:build", "--memory-limit", size]) == 2
    assert seen["memory_limit"] == nbytes
    entry = " ".join(_help(capsys, "compile").split("--memory-limit SIZE ")[-1]
                     .split("\n  -")[0].split())
    assert entry.startswith("memory per rank") and "like 8GiB" in entry


def test_version_prints_fxpipe_and_torch(capsys):
    import torch

    import fxpipe
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    expected = f"fxpipe {fxpipe.__version__} (torch {torch.__version__})"
    assert capsys.readouterr().out.strip() == expected


def test_without_torch_the_version_says_so_and_a_command_says_how_to_install_it():
    """A broken install (no torch) answers --version and --help, and a command that needs
    torch says what is missing and how to install it, not a traceback."""
    script = ("import importlib.metadata, sys\n"
              "sys.modules['torch'] = None  # import torch: ModuleNotFoundError\n"
              "def version(name):\n"
              "    raise importlib.metadata.PackageNotFoundError(name)\n"
              "importlib.metadata.version = version\n"
              "from fxpipe.cli import main\n"
              "try:\n    sys.exit(main(sys.argv[1:]))\nexcept SystemExit as e:\n"
              "    print('exit', e.code)\n")

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True,
                              text=True, timeout=120)

    version = run("--version")
    assert version.stdout.splitlines() == [f"fxpipe {fxpipe.__version__} (torch not installed)",
                                           "exit 0"], version.stderr
    compiled = run("compile", "fxpipe.models.mlp:build", "--stages", "2")
    assert compiled.stdout.strip() == "exit 1"
    assert compiled.stderr.startswith("fxpipe: error: compile needs PyTorch, and torch is not "
                                      "installed in "), compiled.stderr
    assert "Traceback" not in compiled.stderr and "hint: pip install 'torch>=2.4'" in \
        compiled.stderr


def _help(capsys, *command: str) -> str:
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    return capsys.readouterr().out


def test_help_lists_commands_once_and_describes_every_option_with_its_default(capsys):
    top = _help(capsys)
    assert "argparse" not in top
    assert top.count("bench-partition") == 1 and top.count(" costs ") == 1
    for command in ("compile", "costs", "report", "run", "demo", "bench", "bench-compile",
                    "bench-partition", "profile", "selfcheck"):
        text = _help(capsys, command)
        options = text.split("options:")[1].split("\n\n")[0]
        entries = re.split(r"\n  (?=-)", options.strip())
        undescribed = [e.split()[0] for e in entries if len(re.split(r"\s{2,}", e.strip())) < 2]
        assert undescribed == [], (command, undescribed)
        if command != "run":
            assert "examples:" in text, command
    compile_help = _help(capsys, "compile")
    assert "--stages STAGES       pipeline stages (processes, except under a looped" in compile_help
    assert "--stages-per-rank STAGES_PER_RANK" in compile_help
    assert "1000,10000,100000" in _help(capsys, "bench-partition")
    assert "(default: gpt)" in _help(capsys, "bench")


def test_compile_help_documents_every_factory_form(capsys):
    text = _help(capsys, "compile")
    assert "(model, example_inputs)" in text
    assert "(model, example_inputs, example_kwargs)" in text
    assert "target(inputs" in text and "example_kwargs(inputs" in text


def _microseconds(row: str) -> float:
    value, unit = row.split()[-2:]
    return float(value) * {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[unit]


def test_costs_top_without_sort_shows_the_costliest_nodes(capsys):
    assert main(["costs", "fxpipe.models.mlp:build", "--profile", "a100"]) == 0
    every = capsys.readouterr().out.strip().splitlines()[2:]
    assert main(["costs", "fxpipe.models.mlp:build", "--top", "3", "--profile", "a100"]) == 0
    captured = capsys.readouterr()
    assert "capturing MLP and costing every node ..." in captured.err  # it takes seconds
    top = captured.out.strip().splitlines()[2:]
    assert len(top) == 3
    costliest = sorted((_microseconds(r) for r in every), reverse=True)[:3]
    assert [_microseconds(r) for r in top] == costliest
    assert top != every[:3]  # the first three nodes are not the costliest in this model


def test_a_step_event_in_the_chrome_trace_says_what_it_is():
    events = chrome_trace([Event("forward", 0, 2, 0.0, 1.0), Event("reduce", 0, -1, 1.0, 2.0)])
    names = [e["name"] for e in events if e.get("ph") == "X"]
    assert names == ["F2", "gradient all-reduce (tied weights across stages, data-parallel "
                           "replicas)"]


def test_a_pipeline_that_fails_while_running_exits_1_and_bad_input_2(monkeypatch, capsys):
    def fails(args):
        raise PipelineRuntimeError("stage 1 failed in F0: ValueError: boom", hint="see stage 1")

    monkeypatch.setattr(cli, "cmd_compile", fails)
    assert main(["compile", "fxpipe.models.mlp:build"]) == 1
    assert "fxpipe: error: stage 1 failed in F0" in capsys.readouterr().err


def test_the_readme_lists_every_command_once_and_the_factory_forms():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("### The command line")[1].split("## Training at scale")[0]
    for command in ("demo", "compile", "costs", "report", "run", "selfcheck", "bench",
                    "profile", "bench-partition", "bench-compile", "--version"):
        assert len(re.findall(rf"\| `fxpipe {re.escape(command)}[ `]", table)) == 1, command
    assert "`(model, example_inputs, example_kwargs)`" in table and "target(inputs" in table


def test_the_readme_test_command_shows_each_file_and_is_the_one_ci_runs():
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    command = readme.split("Install and run the tests:")[1].split("```bash\n")[1].split("\n")[0]
    pytest_command = command.split(" && ")[-1]
    assert pytest_command == 'python -m pytest -m "not slow"'  # -q would print only dots
    ci = (root / ".ci" / "run").read_text()
    assert f"&& {pytest_command}\n" in ci


def test_the_readme_points_above_or_below_to_where_a_section_is():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    headings = {m.group(1).lower(): m.start() for m in re.finditer(r"^#+ (.+)$", readme, re.M)}
    pointers = list(re.finditer(r'see "([^"]+)" (above|below)', readme))
    assert pointers
    for pointer in pointers:
        title, direction = pointer.group(1).lower(), pointer.group(2)
        where = [at for heading, at in headings.items() if title in heading]
        assert where, f"no section is titled {title!r}"
        assert (where[0] < pointer.start()) == (direction == "above"), pointer.group(0)


def _written_mlp(tmp_path: Path) -> tuple[Path, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The bundled MLP's program written to tmp_path/program (an mse loss, no reference
    losses), with a copy of the plain model, its example input and a float target."""
    from fxpipe.models import mlp
    torch.manual_seed(0)
    model, (x,) = mlp.build()
    plain = copy.deepcopy(model)
    target = torch.randn(model(x).shape)
    folder = tmp_path / "program"
    fxpipe.compile(model, (x,), stages=2, chunks=2).write(str(folder), target=target,
                                                           loss_fn="mse", reference_steps=0)
    return folder, plain, x, target


def test_a_written_program_trains_on_the_users_data_as_the_plain_model_does(tmp_path):
    folder, plain, x, target = _written_mlp(tmp_path)
    (tmp_path / "mydata.py").write_text(
        "import torch\n\n\ndef batches():\n    g = torch.Generator().manual_seed(7)\n"
        f"    for _ in range(3):\n        yield torch.randn({tuple(x.shape)}, generator=g), "
        f"torch.randn({tuple(target.shape)}, generator=g)\n")
    result = subprocess.run([sys.executable, str(folder / "program.py"), "--data",
                             "mydata:batches", "--steps", "5", "--save", str(tmp_path / "ckpt")],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(m) for m in re.findall(r"step \d+ loss ([\d.]+)", result.stdout)]
    assert "--data mydata:batches ended after 3 steps" in result.stdout
    assert f"saved the model and optimizer after step 2 to {tmp_path / 'ckpt'}" in result.stdout
    sys.path.insert(0, str(tmp_path))
    try:
        import mydata
        expected = []
        optimizer = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
        for xb, yb in mydata.batches():
            loss = torch.nn.functional.mse_loss(plain(xb), yb)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            expected.append(float(loss.detach()))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("mydata", None)
    assert losses == pytest.approx(expected, rel=1e-4)


def test_a_written_program_trains_with_adamw_and_warmup_as_the_plain_model_does(tmp_path,
                                                                                  capsys):
    folder, plain, x, target = _written_mlp(tmp_path)
    options = ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1",
               "--warmup-steps", "3"]

    def losses(*argv: str) -> list[str]:
        assert launch.main(folder, [*options, *argv]) == 0
        out = capsys.readouterr().out
        return [line.split(" (")[0] for line in out.splitlines() if line.startswith("step ")]

    whole = losses("--steps", "5")
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.01, weight_decay=0.1)
    expected = []
    for i in range(5):
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * min(1.0, (i + 1) / 3)
        loss = torch.nn.functional.mse_loss(plain(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(float(loss.detach()))
    assert [float(line.split(" loss ")[1]) for line in whole] == pytest.approx(expected, rel=1e-4)
    ckpt = str(tmp_path / "ckpt")  # a resume mid-ramp goes on with the ramp and AdamW's moments
    assert losses("--steps", "2", "--save", ckpt) + losses("--steps", "3", "--resume", ckpt) \
        == whole
    # resuming AdamW's state with SGD names the option that resumes it
    assert launch.main(folder, ["--steps", "1", "--resume", ckpt]) == 2
    assert f"{ckpt} holds the state of AdamW, and this run trains with SGD (--optimizer sgd)" \
        "\nhint: resume with --optimizer adamw" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--optimizer", "adamw"], ["--weight-decay", "0.1"],
                                    ["--warmup-steps", "2"]])
def test_verify_with_another_optimizer_or_schedule_is_refused(written, capsys, option):
    assert launch.main(written, ["--verify", *option]) == 2
    assert f"{option[0]} {option[1]} trains otherwise" in capsys.readouterr().err


class _Masked(torch.nn.Module):
    """A model called with keyword inputs, as a transformers model is (input_ids=...,
    attention_mask=...)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = torch.relu(self.a(tokens))
        return self.b(hidden * mask.unsqueeze(-1) if mask is not None else hidden)


_MASKED_DATA = """import torch


def by_keyword():
    generator = torch.Generator().manual_seed(5)
    for _ in range(2):
        tokens = torch.randn(4, 8, generator=generator)
        yield ({"mask": torch.ones(4), "tokens": tokens},
               torch.randn(4, 4, generator=generator))


def by_position():
    for inputs, target in by_keyword():
        yield (inputs["tokens"], inputs["mask"]), target
"""


def test_a_program_compiled_with_keyword_inputs_trains_on_data_by_keyword_or_position(
        tmp_path, monkeypatch, capsys):
    torch.manual_seed(0)
    model = _Masked()
    plain = copy.deepcopy(model)
    tokens, mask = torch.randn(4, 8), torch.ones(4)
    folder = tmp_path / "program"
    fxpipe.compile(model, (), example_kwargs={"tokens": tokens, "mask": mask}, stages=2,
                   chunks=2).write(str(folder), target=torch.randn(4, 4), loss_fn="mse",
                                   reference_steps=0)
    (tmp_path / "fxpipe_masked_data.py").write_text(_MASKED_DATA)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fxpipe_masked_data", raising=False)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    expected = []
    import fxpipe_masked_data
    for inputs, target in fxpipe_masked_data.by_keyword():
        loss = torch.nn.functional.mse_loss(plain(**inputs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(float(loss.detach()))
    for function in ("by_keyword", "by_position"):
        assert launch.main(folder, ["--data", f"fxpipe_masked_data:{function}", "--steps",
                                    "2"]) == 0
        losses = re.findall(r"step \d+ loss ([\d.]+)", capsys.readouterr().out)
        assert [float(v) for v in losses] == pytest.approx(expected, rel=1e-4), function


def test_data_with_verify_is_refused_before_anything_runs(written, capsys):
    assert launch.main(written, ["--data", "x:y", "--verify"]) == 2
    assert "--verify compares with losses recorded on the example batch" in capsys.readouterr().err


def test_program_parameters_are_named_as_the_model_names_them():
    from fxpipe.models import gpt
    model, inputs = gpt.build(dropout=0.0)
    program = fxpipe.compile(model, inputs, stages=2, chunks=2)
    names = [name for name, _ in program.named_parameters()]
    assert names and set(names) <= set(program.state_dict())
    assert set(names) == {n for n, _ in model.named_parameters()}


def test_program_buffers_are_named_as_the_model_names_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8),
                          nn.BatchNorm1d(8), nn.Linear(8, 2))
    program = fxpipe.compile(model, (torch.randn(8, 6),), stages=2, chunks=2)
    buffers = dict(program.named_buffers())
    assert set(buffers) == {n for n, _ in model.named_buffers()}
    assert all(buffers[n] is b for n, b in model.named_buffers())  # the stages hold them
    assert [n for n, _ in program.named_buffers(prefix="p")] == [f"p.{n}" for n in buffers]


def test_run_help_lists_the_options_of_program_py(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for option in ("--data MODULE:FN", "--save DIR", "--resume DIR", "--weights PATH", "--init",
                   "--setup-timeout"):
        assert option in out, option


def test_the_readme_shows_the_stage_the_demo_writes(tmp_path):
    """The abridged stage under "What you get" is the demo's stage_1.py: each line it shows
    is a line of that file, in the file's order ("..." marks what is left out)."""
    from fxpipe.models import gpt
    from fxpipe.tools import demo

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    shown = readme.split("## What you get")[1].split("```python\n")[1].split("```")[0]
    model, inputs = gpt.build(dropout=0.0)
    fxpipe.compile(model, inputs, stages=2, chunks=4, command=demo.COMMAND,
                   profile="a100").write(str(tmp_path / "demo"))  # not this machine's cut
    written = (tmp_path / "demo" / "stage_1.py").read_text().splitlines()
    at = 0
    for line in shown.splitlines():
        if line.strip() in ("", "..."):
            continue
        assert line in written[at:], f"README shows a line stage_1.py does not have: {line!r}"
        at = written.index(line, at) + 1

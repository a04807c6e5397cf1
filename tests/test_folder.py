"""fxpipe.runtime.program.folder, spec and imports: a written program's folder checked before
anything in it runs; an edited, mixed or incomplete folder is refused with what is wrong."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.utils._pytree as pytree

import fxpipe
from fxpipe.cli import main
from fxpipe.errors import ProgramFolderError
from fxpipe.models import mlp
from fxpipe.runtime.program.folder import check_program, is_program
from fxpipe.runtime.program.imports import (
    ProgramCode,
    code_of_launcher,
    import_folders,
    program_loss,
)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("folder") / "prog"
    model, inputs = mlp.build(depth=2)
    program = fxpipe.compile(model, inputs, stages=2, chunks=2, profile="a100")
    program.write(str(folder), target=mlp.target(inputs), reference_steps=0)
    return folder


def _copy(written: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "copy"
    shutil.copytree(written, folder)
    return folder


def _edit_spec(folder: Path, edit) -> None:
    path = folder / "program.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_a_written_program_passes_and_records_every_file_but_the_spec(written):
    checked = check_program(written)
    assert checked.stages == 2
    files = set(checked.data["files"])
    assert files == set(os.listdir(written)) - {"program.json"}
    assert {"stage_0.py", "stage_1.py", "program.py", "weights.pt", "batch.pt"} <= files
    assert is_program(written) and not is_program(written.parent)


def _claim_three_stages(data):
    data["stages"].append({**data["stages"][1], "index": 2, "file": "stage_2.py"})


@pytest.mark.parametrize("edit,expected", [
    (lambda d: d.update(remat="bogus"),
     "remat is 'bogus' (allowed: never, always, except_last, auto)"),
    (lambda d: d.update(chunks=0), "chunks is 0 (allowed: an integer >= 1)"),
    (lambda d: d.update(schedule="zigzag"),
     "schedule is 'zigzag' (allowed: gpipe, 1f1b, zb-h1, interleaved-1f1b, zb-v, dualpipev)"),
    (lambda d: d.update(stages_per_rank=2),
     "stages_per_rank is 2 with 2 stages under gpipe (allowed: use schedule='interleaved-1f1b'"),
    (lambda d: d.update(schedule="zb-v"),
     "stages_per_rank is 1 with 2 stages under zb-v (allowed: pass stages_per_rank=2"),
    (lambda d: d.update(lr=float("nan")), "lr is nan (allowed: a finite number > 0)"),
    (lambda d: d.update(extra=1), "unknown field 'extra' (allowed: aliases, autocast"),
    (lambda d: d["stages"][0].update(file="/etc/passwd.py"),
     "stages[0].file is '/etc/passwd.py' (allowed: a .py file inside the program's folder"),
    (lambda d: d["stages"][0].update(file="../stage_0.py"), "stages[0].file is '../stage_0.py'"),
    (lambda d: d["stages"][1]["recvs"][0].update(peer=2),
     "stages[1].recvs has peer 2 (allowed: another stage, 0..1)"),
    (_claim_three_stages, "stages send and receive different messages"),
    (lambda d: d["signature"].update(in_spec='[1, {"type": null}]'),
     "signature.in_spec is '[1, {\"type\": null}]' (allowed: a tree spec of (args, kwargs)"),
    (lambda d: d["signature"].update(in_spec=pytree.treespec_dumps(  # three inputs, not one
        pytree.tree_flatten(((1, 2, 3), {}))[1])),
     "with a leaf for each of signature.leaves"),
    (lambda d: d["signature"].update(forward=[["x", "SOMETIMES"]]),
     "signature.forward is [['x', 'SOMETIMES']] (allowed: a list of [name, kind]"),
    (lambda d: d.update(loss="os:system"),
     "names the loss 'os:system', which program.py does not record (allowed: cross_entropy, "
     "default, mse)"),
])
def test_an_edited_spec_is_refused_naming_the_field_its_value_and_what_is_allowed(
        written, tmp_path, edit, expected):
    folder = _copy(written, tmp_path)
    _edit_spec(folder, edit)
    with pytest.raises(ProgramFolderError) as info:
        check_program(folder)
    assert expected in str(info.value)
    assert "hint: write the program again" in str(info.value)


def test_a_program_written_before_the_input_structure_was_kept_takes_its_inputs_flat(
        written, tmp_path):
    from fxpipe.runtime.program.spec import ProgramSpec
    folder = _copy(written, tmp_path)
    _edit_spec(folder, lambda d: [d["signature"].pop(k) for k in ("in_spec", "forward")])
    signature = ProgramSpec.from_json(check_program(folder).data).signature
    x = mlp.build(depth=2)[1][0]
    assert signature.forward is None and len(signature.flatten_call((x,), {})) == 1


def test_a_stage_file_that_links_out_of_the_folder_is_refused(written, tmp_path):
    folder = _copy(written, tmp_path)
    outside = tmp_path / "elsewhere.py"
    shutil.copy(folder / "stage_0.py", outside)
    (folder / "stage_0.py").unlink()
    (folder / "stage_0.py").symlink_to(outside)
    with pytest.raises(ProgramFolderError, match="leads out of the program's folder"):
        check_program(folder)


def test_a_changed_or_missing_file_is_refused(written, tmp_path):
    folder = _copy(written, tmp_path)
    with open(folder / "weights.pt", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ProgramFolderError, match=r"weights.pt is not the file the program was "
                                                 r"written with \(sha256 "):
        check_program(folder)
    check_program(folder, contents=False)  # present: the launcher's quick check passes
    (folder / "batch.pt").unlink()
    with pytest.raises(ProgramFolderError, match="has no batch.pt, which the program needs"):
        check_program(folder, contents=False)


def test_a_stage_file_of_another_program_is_refused(written, tmp_path):
    folder = _copy(written, tmp_path)
    (folder / "stage_1.py").write_text((folder / "stage_0.py").read_text())
    with pytest.raises(ProgramFolderError, match="stage_1.py is not the file"):
        check_program(folder)


def test_the_launcher_records_what_it_imports_and_program_json_cannot_add_to_it(written):
    code = code_of_launcher(written)
    assert code == ProgramCode("default", (), ())
    assert program_loss("mse", code, written) is not None  # fxpipe's own are always allowed
    with pytest.raises(ProgramFolderError, match="allowed: cross_entropy, default, mse"):
        program_loss("builtins:print", code, written)
    recorded = ProgramCode("mymodel:loss", (), ("..",))
    assert import_folders(recorded, written) == [os.getcwd(), str(written.parent)]


def test_running_an_edited_program_is_one_line_and_exit_status_2(written, tmp_path):
    folder = _copy(written, tmp_path)
    _edit_spec(folder, lambda d: d.update(remat="bogus"))
    result = subprocess.run([sys.executable, str(folder / "program.py"), "--steps", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith("rank 0: error: ")
    assert "remat is 'bogus'" in result.stderr and "Traceback" not in result.stderr


def test_a_users_loss_module_is_found_from_the_recorded_folder_or_named_with_the_folders_tried(
        tmp_path, monkeypatch, capsys):
    source = tmp_path / "project"
    source.mkdir()
    (source / "mylosses.py").write_text(
        "from fxpipe.losses import default_loss\n\n\n"
        "def my_loss(output, target):\n    return default_loss(output, target)\n")
    sys.path.insert(0, str(source))
    try:
        import mylosses

        model, inputs = mlp.build(depth=2)
        program = fxpipe.compile(model, inputs, stages=2, chunks=2, profile="a100")
        folder = source / "out"
        program.write(str(folder), target=mlp.target(inputs), loss_fn=mylosses.my_loss,
                      reference_steps=0)
    finally:
        sys.path.remove(str(source))
        sys.modules.pop("mylosses", None)
    assert code_of_launcher(folder) == ProgramCode("mylosses:my_loss", (), ("..",))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ran = subprocess.run([sys.executable, str(folder / "program.py"), "--steps", "1"],
                         cwd=elsewhere, capture_output=True, text=True, timeout=300, env=env)
    assert ran.returncode == 0, ran.stderr
    assert "step 0 loss" in ran.stdout
    (source / "mylosses.py").rename(tmp_path / "mylosses.py")
    failed = subprocess.run([sys.executable, str(folder / "program.py"), "--steps", "1"],
                            cwd=elsewhere, capture_output=True, text=True, timeout=300, env=env)
    assert failed.returncode == 2
    first = failed.stderr.splitlines()[0]
    assert first == (f"rank 0 (stage 0): error: cannot import mylosses, the module of the loss "
                     f"mylosses:my_loss (looked in the installed packages and in {elsewhere}, "
                     f"{source})")
    monkeypatch.chdir(elsewhere)  # fxpipe run says the same before starting any rank
    assert main(["run", str(folder), "--nproc", "2"]) == 2
    assert capsys.readouterr().err.splitlines()[0] == \
        "fxpipe: error: " + first.removeprefix("rank 0 (stage 0): error: ")

"""fxpipe.writer and fxpipe.storage.files.replace_folder: a written folder holds one whole program,
never files of an earlier one, and never replaces what is not a program."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import fxpipe
from fxpipe.errors import ProgramFolderError
from fxpipe.models import mlp
from fxpipe.runtime.program.folder import check_program
from fxpipe.storage.files import TEMP_PREFIX, replace_folder


def _program(stages: int):
    model, inputs = mlp.build(depth=3)
    return fxpipe.compile(model, inputs, stages=stages, chunks=2, profile="a100"), inputs


def test_writing_two_stages_over_three_leaves_no_stage_file_of_the_old_program(tmp_path):
    folder = tmp_path / "prog"
    three, inputs = _program(3)
    three.write(str(folder), target=mlp.target(inputs), reference_steps=0)
    assert (folder / "stage_2.py").exists()
    two, _ = _program(2)
    two.write(str(folder), target=mlp.target(inputs), reference_steps=0)
    assert not (folder / "stage_2.py").exists()
    assert check_program(folder).stages == 2
    assert os.listdir(tmp_path) == ["prog"]  # no temporary folder left beside it


def test_rewriting_a_program_keeps_what_the_user_kept_in_its_folder(tmp_path):
    folder = tmp_path / "prog"
    three, inputs = _program(3)
    three.write(str(folder), target=mlp.target(inputs), reference_steps=0)
    (folder / "ckpt").mkdir()  # e.g. program.py --save prog/ckpt
    (folder / "ckpt" / "checkpoint.json").write_text("{}")
    (folder / "timeline.json").write_text("[]")
    two, _ = _program(2)
    two.write(str(folder), target=mlp.target(inputs), reference_steps=0)
    assert (folder / "ckpt" / "checkpoint.json").read_text() == "{}"
    assert (folder / "timeline.json").read_text() == "[]"
    assert not (folder / "stage_2.py").exists()
    assert check_program(folder).stages == 2
    assert sorted(os.listdir(tmp_path)) == ["prog"]


def test_a_folder_that_holds_no_program_is_never_replaced(tmp_path):
    program, inputs = _program(2)
    (tmp_path / "notes.txt").write_text("my thesis")
    with pytest.raises(ProgramFolderError, match=r"is a folder that holds no fxpipe program"):
        program.write(str(tmp_path), reference_steps=0)
    assert os.listdir(tmp_path) == ["notes.txt"]
    (tmp_path / "file").write_text("data")
    with pytest.raises(ProgramFolderError, match=r"is a file that holds no fxpipe program"):
        program.write(str(tmp_path / "file"), reference_steps=0)
    assert (tmp_path / "file").read_text() == "data"
    (tmp_path / "empty").mkdir()
    program.write(str(tmp_path / "empty"), reference_steps=0)  # an empty folder is fine
    assert check_program(tmp_path / "empty").stages == 2


def test_a_folder_under_a_file_is_refused_naming_the_file(tmp_path):
    program, _ = _program(2)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ProgramFolderError, match=r"notes\.txt is a file, so the folder .*prog"):
        program.write(str(tmp_path / "notes.txt" / "sub" / "prog"), reference_steps=0)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_writer_that_finishes_last_wins_whole(tmp_path):
    """Two writers interleaved by hand: B swaps its folder in while A is still filling its own."""
    target = str(tmp_path / "out")

    def fill_b(folder: str) -> None:
        Path(folder, "b.txt").write_text("b")

    def fill_a(folder: str) -> None:
        Path(folder, "a.txt").write_text("a")
        replace_folder(target, fill_b, lambda _: None)  # B, start to end, meanwhile

    replace_folder(target, fill_a, lambda _: None)
    assert os.listdir(target) == ["a.txt"]
    assert os.listdir(tmp_path) == ["out"]


def test_written_files_and_folder_have_ordinary_modes_under_the_umask(tmp_path):
    program, inputs = _program(2)
    old = os.umask(0o027)
    try:
        program.write(str(tmp_path / "prog"), target=mlp.target(inputs), reference_steps=0)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "prog").st_mode) == 0o750
    modes = {name: stat.S_IMODE(os.stat(tmp_path / "prog" / name).st_mode)
             for name in os.listdir(tmp_path / "prog")}
    assert modes == dict.fromkeys(modes, 0o640)


_WRITER = textwrap.dedent("""
    import sys, time
    import fxpipe
    from fxpipe.models import gpt, mlp
    name, folder, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
    module = {"mlp": mlp, "gpt": gpt}[name]
    model, inputs = module.build(**({"dropout": 0.0} if name == "gpt" else {}))
    program = fxpipe.compile(model, inputs, stages=3 if name == "mlp" else 2, chunks=2,
                             profile="a100")
    while time.time() < start:
        time.sleep(0.01)
    for _ in range(4):
        program.write(folder, reference_steps=0)
""")


@pytest.mark.slow
def test_two_processes_writing_one_folder_at_once_leave_one_whole_program(tmp_path):
    folder = tmp_path / "prog"
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    for _ in range(3):
        start = str(time.time() + 25)  # both compiled by then, on a busy machine too
        procs = [subprocess.Popen([sys.executable, str(script), name, str(folder), start],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
                 for name in ("mlp", "gpt")]
        assert [p.wait(timeout=300) for p in procs] == [0, 0]
        checked = check_program(folder)  # every file is the one its program.json records
        assert set(checked.data["files"]) | {"program.json"} == set(os.listdir(folder))
        assert (checked.data["model"], checked.stages) in {("MLP", 3), ("GPT", 2)}
        assert not [n for n in os.listdir(tmp_path) if n.startswith(TEMP_PREFIX)]


@pytest.mark.parametrize("removing", [False, True], ids=["moved", "moved_and_removing"])
def test_the_replace_check_passes_a_folder_another_writer_moves_away(tmp_path, monkeypatch,
                                                                     removing):
    """Two writers of one folder: the other one renames the program's folder away between this
    one's opening it and listing it, and may be removing it file by file, so that this check
    finds it without its program.json. The check answers for the folder it opened, and a folder
    no longer at the path is not refused (that writer checked it); a non-program folder still
    at the path is."""
    from fxpipe.errors import ProgramFolderError
    from fxpipe.writer import _check_replaceable

    program, _ = _program(2)
    target = tmp_path / "prog"
    program.write(str(target), reference_steps=0)
    listdir = os.listdir

    def moved_away_then_listed(path):
        monkeypatch.setattr(os, "listdir", listdir)
        os.rename(target, tmp_path / "old")
        if removing:
            os.remove(tmp_path / "old" / "program.json")
        return listdir(path)

    monkeypatch.setattr(os, "listdir", moved_away_then_listed)
    _check_replaceable(str(target))  # no FileNotFoundError, no "holds no fxpipe program"
    assert not target.exists()
    if removing:
        os.rename(tmp_path / "old", target)  # the same folder, left at the path: refused
        with pytest.raises(ProgramFolderError, match="holds no fxpipe program"):
            _check_replaceable(str(target))


def test_a_program_swapped_in_meanwhile_does_not_make_the_old_ones_files_the_users(
        tmp_path, monkeypatch):
    """The clash check lists one folder and reads its program.json; a concurrent writer may
    rename another program in between. Both reads come from the one folder opened first."""
    import json

    from fxpipe.storage.userfiles import user_files

    def program(folder, stages):
        folder.mkdir()
        names = [f"stage_{i}.py" for i in range(stages)]
        for name in names:
            (folder / name).write_text("")
        (folder / "notes.txt").write_text("mine")
        (folder / "program.json").write_text(json.dumps({"files": {n: "" for n in names}}))

    target, other = tmp_path / "prog", tmp_path / "other"
    program(target, 3)
    program(other, 2)
    listdir = os.listdir

    def listdir_then_swap(path):
        names = listdir(path)
        os.rename(target, tmp_path / "old")  # another writer swaps its program in
        os.rename(other, target)
        monkeypatch.setattr(os, "listdir", listdir)
        return names

    monkeypatch.setattr(os, "listdir", listdir_then_swap)
    assert user_files(str(target)) == {"notes.txt"}  # not stage_2.py, which the old one lists


def test_program_json_names_each_state_dict_key_once(tmp_path):
    """The model's keys live in program.json's structure; aliases lists only the tensors not
    named by their own key alone (the tied weight), and weights.json no copy of the keys. What
    they give back is the map the program saves and resumes by."""
    import json

    from fxpipe.models import gpt
    from fxpipe.runtime.launch import load_spec
    from fxpipe.storage.state import StateNames

    model, inputs = gpt.build()
    program = fxpipe.compile(model, inputs, stages=2, chunks=2, profile="a100")
    program.write(str(tmp_path / "prog"), reference_steps=0)
    data = json.loads((tmp_path / "prog" / "program.json").read_text())
    assert data["aliases"] == {"wte.weight": ["wte.weight", "lm_head.weight"]}
    assert set(data["structure"]["tensors"]) == set(model.state_dict())
    assert "state_keys" not in json.loads((tmp_path / "prog" / "weights.json").read_text())
    names = load_spec(tmp_path / "prog").state_names()
    bound = {q for module in program.stage_modules for q in module.named_model_tensors()}
    full = StateNames.of_model(model, program.graph_module).keys  # what it was written from
    assert {q: names.keys[q] for q in bound if q in names.keys} == dict(full)


def _closure_loss():
    def inner(out, y):
        return ((out - y) ** 2).mean()
    return inner


def test_a_loss_the_written_program_cannot_import_is_refused_saying_why(tmp_path):
    from fxpipe.errors import ConfigError

    model, inputs = mlp.build()
    program = fxpipe.compile(model, inputs, stages=2, chunks=2)
    y = torch.randn_like(program(*inputs))
    for loss_fn, why in [(lambda out, t: ((out - t) ** 2).mean(), "it is a lambda"),
                         (_closure_loss(), "it is defined inside _closure_loss()")]:
        with pytest.raises(ConfigError, match=f"cannot be imported by the written program: "
                                              f"{why}") as error:
            program.write(str(tmp_path / "prog"), loss_fn=loss_fn, target=y)
        assert "a module beside your script (e.g. losses.py)" in error.value.hint
    script = tmp_path / "train.py"  # a loss defined in the script being run
    script.write_text(textwrap.dedent(f"""
        import torch, fxpipe
        from fxpipe.models import mlp
        def my_loss(out, y):
            return ((out - y) ** 2).mean()
        model, inputs = mlp.build()
        program = fxpipe.compile(model, inputs, stages=2, chunks=2)
        program.write({str(tmp_path / "prog")!r}, loss_fn=my_loss,
                      target=torch.zeros_like(program(*inputs)))
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert "loss_fn my_loss cannot be imported by the written program: it is defined in the " \
           "script being run (train.py), which the program would run again" in result.stderr

"""Nothing lost, nothing silently wrong on disk: saves and writes killed at any step, savers that
race, a full disk, damaged weight files, and program folders with planted modules.

Every failure must be an FxPipeError naming the file; every kill must leave a whole checkpoint
and a whole program, with every file the user kept in them."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import fxpipe
from fxpipe.cli import main
from fxpipe.errors import CheckpointError, FxPipeError, ProgramFolderError, StorageError
from fxpipe.files import TEMP_PREFIX
from fxpipe.models import mlp
from fxpipe.runtime.folder import check_program
from fxpipe.savelock import hold_save_lock
from fxpipe.weights import open_weights

# -- helpers -----------------------------------------------------------------------------------


def _program(stages: int = 2, depth: int = 2):
    model, inputs = mlp.build(depth=depth)
    return fxpipe.compile(model, inputs, stages=stages, chunks=2, profile="a100"), inputs


def _killed_at(step: int, action: Callable[[], None], *, removals: bool = False) -> bool:
    """Runs `action` in a forked child that SIGKILLs itself just before its step-th call of
    os.rename (and of shutil.rmtree, with `removals`): the steps of a swap or a save; True when
    it was killed, False when it finished first."""
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        calls = [0]

        def hooked(real: Callable[..., object]) -> Callable[..., object]:
            def call(*args: object, **kwargs: object) -> object:
                if calls[0] == step:
                    os.kill(os.getpid(), signal.SIGKILL)
                calls[0] += 1
                return real(*args, **kwargs)
            return call

        os.rename = hooked(os.rename)  # type: ignore[assignment]
        if removals:
            shutil.rmtree = hooked(shutil.rmtree)  # type: ignore[assignment]
        code = 0
        try:
            action()
        except BaseException:  # noqa: BLE001 - the exit status says it
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status)


def _user_files(folder: Path) -> None:
    """What a user keeps in a program's folder: a checkpoint, notes."""
    (folder / "ckpt").mkdir()
    (folder / "ckpt" / "checkpoint.json").write_text("{}")
    (folder / "notes.txt").write_text("my notes")


def _has_user_files(folder: Path) -> bool:
    return (folder / "ckpt" / "checkpoint.json").is_file() and \
        (folder / "notes.txt").read_text() == "my notes"


def _hidden(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(TEMP_PREFIX))


# -- write(): the swap -------------------------------------------------------------------------


def test_a_write_killed_between_the_swaps_two_renames_is_rolled_back_on_the_next_load(tmp_path):
    folder = tmp_path / "prog"
    three, inputs = _program(3, depth=3)
    three.write(str(folder), reference_steps=0)
    _user_files(folder)
    two, _ = _program(2, depth=3)
    # renames: the staged folder onto the program (refused: not empty), the program away, then
    # the staged folder in: killed just before that one
    assert _killed_at(2, lambda: two.write(str(folder), reference_steps=0))
    assert check_program(folder).stages == 3  # the old program is back, and checks
    assert _has_user_files(folder)
    assert _hidden(tmp_path) == []  # the killed writer's staged folder is gone too


def test_a_write_killed_before_carrying_the_users_files_carries_them_next_time(tmp_path):
    folder = tmp_path / "prog"
    three, inputs = _program(3, depth=3)
    three.write(str(folder), reference_steps=0)
    _user_files(folder)
    two, _ = _program(2, depth=3)
    assert _killed_at(3, lambda: two.write(str(folder), reference_steps=0))  # swapped, not carried
    assert not _has_user_files(folder)
    two.write(str(folder), reference_steps=0)  # the next write finishes what the killed one began
    assert check_program(folder).stages == 2
    assert _has_user_files(folder)
    assert _hidden(tmp_path) == []


def test_leftovers_of_killed_writes_are_removed_by_the_next_write(tmp_path):
    folder = tmp_path / "prog"
    program, _ = _program()
    program.write(str(folder), reference_steps=0)
    (tmp_path / f"{TEMP_PREFIX}prog-new-0123456789ab").mkdir()  # a half-staged program
    (tmp_path / f"{TEMP_PREFIX}prog-new-0123456789ab" / "stage_0.py").write_text("")
    old = tmp_path / f"{TEMP_PREFIX}prog-old-ba9876543210"  # swapped out, its files not carried
    shutil.copytree(folder, old)
    (old / "notes.txt").write_text("my notes")
    (old / "ckpt").mkdir()
    (old / "ckpt" / "checkpoint.json").write_text("{}")
    (tmp_path / "elsewhere").mkdir()  # another folder's entries are not touched
    program.write(str(folder), reference_steps=0)
    assert _hidden(tmp_path) == []
    assert _has_user_files(folder)
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "prog"]


def test_rewriting_a_program_keeps_user_files_with_names_fxpipe_could_write(tmp_path):
    folder = tmp_path / "prog"
    three, _ = _program(3, depth=3)
    three.write(str(folder), reference_steps=0)
    (folder / "model.pt").write_bytes(b"the user's model")
    (folder / "stage_7.py").write_text("# the user's stage\n")
    two, _ = _program(2, depth=3)
    two.write(str(folder), reference_steps=0)
    assert (folder / "model.pt").read_bytes() == b"the user's model"
    assert (folder / "stage_7.py").read_text() == "# the user's stage\n"
    assert not (folder / "stage_2.py").exists()  # the old program's own stage file is gone
    assert check_program(folder).stages == 2


def test_a_user_file_the_new_program_would_overwrite_refuses_the_write(tmp_path):
    folder = tmp_path / "prog"
    program, _ = _program()
    program.write(str(folder), reference_steps=0)
    data = (folder / "program.json").read_text()
    (folder / "program.json").write_text(data.replace('"batch.pt"', '"batch-renamed.pt"'))
    with pytest.raises(ProgramFolderError, match=r"holds batch.pt, which the program there"):
        program.write(str(folder), reference_steps=0)
    assert (folder / "batch.pt").exists() and _hidden(tmp_path) == []


@pytest.mark.parametrize("planted", ["torch.py", "fxpipe.py", "pathlib.pyc", "numpy/__init__.py"])
def test_a_module_planted_in_a_program_folder_is_refused(tmp_path, planted):
    folder = tmp_path / "prog"
    program, _ = _program()
    program.write(str(folder), reference_steps=0)
    (folder / planted).parent.mkdir(exist_ok=True)
    (folder / planted).write_text("raise SystemExit('planted code ran')\n")
    name = planted.split("/")[0]
    with pytest.raises(ProgramFolderError, match=rf"{name} is a Python module"):
        check_program(folder)
    assert main(["report", str(folder)]) == 2


def test_user_files_that_import_nothing_pass_the_folder_check(tmp_path):
    folder = tmp_path / "prog"
    program, _ = _program()
    program.write(str(folder), reference_steps=0)
    (folder / "stage_7.py").write_text("")  # stage files are loaded by path, never imported
    (folder / "notes.txt").write_text("")
    (folder / "my notes.py").write_text("")  # no module can have this name
    (folder / "data").mkdir()  # a folder without __init__.py shadows no installed package
    assert check_program(folder).stages == 2


def test_a_full_disk_during_write_is_a_storage_error_naming_the_file(tmp_path, monkeypatch):
    folder = tmp_path / "prog"
    program, _ = _program()
    program.write(str(folder), reference_steps=0)
    before = {n: (folder / n).read_bytes() for n in os.listdir(folder)}

    def full(obj, path, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(StorageError, match=r"writing .*\.pt failed .*bytes free") as info:
        program.write(str(folder), reference_steps=0)
    assert isinstance(info.value, FxPipeError) and info.value.hint
    assert {n: (folder / n).read_bytes() for n in os.listdir(folder)} == before
    assert _hidden(tmp_path) == []


# -- save(): one saver, checkpoint folders only, loads during a save ---------------------------


def _tiny_program():
    program, inputs = _program()
    return program, torch.optim.SGD(program.parameters(), lr=0.1)


def test_a_second_saver_is_refused_naming_the_first(tmp_path):
    program, _ = _tiny_program()
    target = tmp_path / "ckpt"
    program.save(str(target), step=1)
    first = hold_save_lock(str(target))  # a save in progress, in this process or another
    try:
        with pytest.raises(CheckpointError, match=rf"being saved into by process {os.getpid()} "
                                                  rf"on {socket.gethostname()}"):
            program.save(str(target), step=2)
    finally:
        os.close(first)
    assert fxpipe.load_checkpoint(str(target))["step"] == 1  # untouched
    program.save(str(target), step=2)  # the lock went with its holder
    assert fxpipe.load_checkpoint(str(target))["step"] == 2


@pytest.mark.parametrize("entry", ["save-000123/", "shard-00000.pt", ".fxpipe-mine", "notes.txt"])
def test_a_save_into_a_folder_that_holds_no_checkpoint_is_refused(tmp_path, entry):
    program, _ = _tiny_program()
    path = tmp_path / "mine" / entry.rstrip("/")
    path.parent.mkdir()
    if entry.endswith("/"):
        path.mkdir()
        (path / "data.bin").write_bytes(b"mine")
    else:
        path.write_bytes(b"mine")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'mine'} holds {entry.rstrip('/')} "
                                              "but no checkpoint.json"):
        program.save(str(tmp_path / "mine"))
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    (tmp_path / "file").write_text("mine")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder"):
        program.save(str(tmp_path / "file"))


def test_a_first_save_that_was_killed_does_not_block_the_next(tmp_path):
    program, _ = _tiny_program()
    target = tmp_path / "ckpt"
    assert _killed_at(0, lambda: program.save(str(target), step=1))  # before its publishing
    assert "checkpoint.lock" in os.listdir(target)
    program.save(str(target), step=2)
    assert sorted(os.listdir(target)) == ["checkpoint.json", "checkpoint.lock", "save-000001"]


def test_a_load_during_a_save_reads_the_checkpoint_it_opened(tmp_path, monkeypatch):
    """A save that publishes while a load reads removes the folder being read: the load must
    still give one whole checkpoint, never report a damaged shard."""
    program, optimizer = _tiny_program()
    target = str(tmp_path / "ckpt")
    program.save(target, optimizer=optimizer, step=1)
    real_load, saved = torch.load, []

    def load_while_a_save_publishes(*args, **kwargs):
        if not saved:
            saved.append(True)
            program.save(target, optimizer=optimizer, step=2)  # removes save-000001
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load_while_a_save_publishes)
    assert fxpipe.load_checkpoint(target)["step"] in (1, 2)
    assert saved


def test_a_full_disk_during_save_is_a_storage_error_and_keeps_the_checkpoint(tmp_path,
                                                                            monkeypatch):
    program, _ = _tiny_program()
    target = tmp_path / "ckpt"
    program.save(str(target), step=1)
    before = sorted(os.listdir(target))

    def full(obj, path, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(StorageError, match=rf"writing {target}/.*shard-00000.pt failed .*bytes "
                                           "free .*the disk is full"):
        program.save(str(target), step=2)
    monkeypatch.undo()
    assert sorted(os.listdir(target)) == before
    assert fxpipe.load_checkpoint(str(target))["step"] == 1


# -- damaged weight files ----------------------------------------------------------------------


def _safetensors_bytes(header: dict, data: bytes, length: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


_F32 = {"dtype": "F32", "shape": [2]}
_DAMAGED = {
    "offsets out of range": _safetensors_bytes({"w": {**_F32, "data_offsets": [0, 800]}},
                                               bytes(8)),
    "dtype over the wrong span": _safetensors_bytes(
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(8)),
    "two tensors on one span": _safetensors_bytes(
        {"a": {**_F32, "data_offsets": [0, 8]}, "b": {**_F32, "data_offsets": [0, 8]}}, bytes(8)),
    "truncated": _safetensors_bytes({"w": {**_F32, "data_offsets": [0, 8]}}, bytes(8))[:-3],
    "2^40 header length": _safetensors_bytes({"w": {**_F32, "data_offsets": [0, 8]}}, bytes(8),
                                             length=2**40),
    "empty": b"",
    "not safetensors": b"PK\x03\x04 a zip, say" * 8,
}


def _read_all(path) -> None:
    source = open_weights(path)
    for key in source.keys():
        source.read(key, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("damage", sorted(_DAMAGED))
def test_a_damaged_safetensors_file_is_a_checkpoint_error_naming_it(tmp_path, damage):
    path = tmp_path / "model.safetensors"
    path.write_bytes(_DAMAGED[damage])
    with pytest.raises(CheckpointError, match=re.escape(str(path))) as info:
        _read_all(path)
    assert info.value.hint


def test_a_link_to_a_device_is_refused_not_read(tmp_path):
    (tmp_path / "model.safetensors").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"model.safetensors is not a regular file \(a "
                                              r"link to /dev/zero\)"):
        _read_all(tmp_path / "model.safetensors")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "model.safetensors").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="not a regular file"):
        _read_all(tmp_path / "folder")


_INDEX = "model.safetensors.index.json"


@pytest.mark.parametrize("text, says", [
    ("{", r"cannot be read as JSON \(JSONDecodeError"),
    ("[]", r"has no weight_map .* a JSON list"),
    ('{"weight_map": {"w": 5}}', r"weight_map entries name no file: 'w': 5"),
    ('{"weight_map": []}', r"has no weight_map"),
    ('{"weight_map": {"w": "../outside.safetensors"}}', r"names files outside its folder"),
    ('{"weight_map": {"w": "OUTSIDE"}}', r"names files outside its folder"),
    ('{"weight_map": {"w": "absent.safetensors"}}', r"absent.safetensors does not exist, and "
                                                    r".*index.json names it"),
])
def test_a_malformed_or_escaping_index_is_a_checkpoint_error_naming_it(tmp_path, text, says):
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(_safetensors_bytes({"w": {**_F32, "data_offsets": [0, 8]}}, bytes(8)))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / _INDEX).write_text(text.replace("OUTSIDE", str(outside)))
    with pytest.raises(CheckpointError, match=says):
        _read_all(tmp_path / "ckpt")

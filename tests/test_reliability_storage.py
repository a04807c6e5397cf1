"""Nothing lost, nothing silently wrong on disk: saves and writes killed at any step, savers that
race, a full disk, damaged weight files, and program folders with planted modules.

Every failure must be an FxPipeError naming the file; every kill must leave a whole checkpoint
and a whole program, with every file the user kept in them."""
from __future__ import annotations

import errno
import json
import os
import re
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch

import fxpipe
from fxpipe.cli import main
from fxpipe.errors import CheckpointError, FxPipeError, ProgramFolderError, StorageError
from fxpipe.models import mlp
from fxpipe.runtime.program.folder import check_program
from fxpipe.storage.files import TEMP_PREFIX
from fxpipe.storage.savelock import hold_save_lock
from fxpipe.storage.weights import open_weights

# -- helpers -----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _one_thread():
    """Forked children compute too: one thread, so no thread pool is forked mid-use."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _program(stages: int = 2, depth: int = 2):
    model, inputs = mlp.build(depth=depth)
    return fxpipe.compile(model, inputs, stages=stages, chunks=2, profile="a100"), inputs


def _killed_at(step: int, action: Callable[[], None], *, removals: bool = False) -> bool:
    """Runs `action` in a forked child that SIGKILLs itself just before its step-th call of
    os.rename (and of os.replace and shutil.rmtree, with `removals`): the steps of a swap or a
    save; True when it was killed, False when it finished first."""
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        torch.set_num_threads(1)  # no thread pool survives a fork
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
            os.replace = hooked(os.replace)  # type: ignore[assignment]
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


@pytest.mark.parametrize("planted", ["torch.py", "fxpipe.py", "pathlib.py"])
def test_program_py_run_directly_never_imports_a_module_planted_beside_it(tmp_path, planted):
    folder = tmp_path / "prog"
    program, _ = _program()
    program.write(str(folder), reference_steps=0)
    (folder / planted).write_text("raise SystemExit('planted code ran')\n")
    result = subprocess.run([sys.executable, str(folder / "program.py"), "--steps", "1"],
                            capture_output=True, text=True, timeout=300, cwd=folder)
    out = result.stdout + result.stderr
    assert "planted code ran" not in out
    assert result.returncode != 0 and f"{planted} is a Python module" in out


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


def test_a_write_refused_for_permission_says_so_and_not_that_the_disk_is_full(tmp_path):
    import errno

    from fxpipe.storage.files import write_failed

    path = str(tmp_path / "prog" / "weights.pt")
    refused = write_failed(path, PermissionError(errno.EACCES, "Permission denied", path))
    assert "may not write there" in refused.message and "disk is full" not in refused.message
    assert "permission" in refused.hint
    read_only = write_failed(path, OSError(errno.EROFS, "Read-only file system", path))
    assert "read-only" in read_only.message
    full = write_failed(path, OSError(errno.ENOSPC, "No space left on device", path))
    assert "bytes free" in full.message and "the disk is full" in full.message


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


# -- the trials, replayed (slow tier) ----------------------------------------------------------


def _outcome(action: Callable[[], object], path: str) -> str:
    """"ok", "named" (an FxPipeError naming `path`), or what else happened."""
    try:
        action()
    except FxPipeError as e:
        return "named" if path in str(e) else f"unnamed {type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - counted, and the test fails on it
        return f"raw {type(e).__name__}: {e}"
    return "ok"


def _in_child(action: Callable[[], str]) -> str:
    """`action()`'s string, computed in a forked child (for limits and races of its own)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)  # no thread pool survives a fork
        os.close(read)
        text = "child died"
        try:
            text = action()
        finally:
            os.write(write, text.encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return text


@pytest.mark.slow
def test_writes_killed_at_every_step_lose_nothing_and_leave_nothing(tmp_path):
    folder = tmp_path / "prog"
    three, _ = _program(3, depth=3)
    two, _ = _program(2, depth=3)
    three.write(str(folder), reference_steps=0)
    _user_files(folder)
    figures = {"kills": 0, "lost": 0, "no_program": 0, "leftovers": 0}
    step = 0
    while True:
        writer = [two, three][step % 2]
        if not _killed_at(step, partial(writer.write, str(folder), reference_steps=0),
                          removals=True):
            break  # the write finished before its step-th step: every step was hit
        figures["kills"] += 1
        try:
            check_program(folder)  # a load: rolls back or finishes the killed swap
        except ProgramFolderError:
            figures["no_program"] += 1
        figures["lost"] += not _has_user_files(folder)
        [three, two][step % 2].write(str(folder), reference_steps=0)
        figures["leftovers"] += bool(_hidden(tmp_path))
        figures["lost"] += not _has_user_files(folder)
        step += 1
    print("write kill trials:", figures)
    assert figures["kills"] > 20, figures
    assert figures["lost"] == figures["no_program"] == figures["leftovers"] == 0, figures


@pytest.mark.slow
def test_saves_killed_at_every_step_leave_the_previous_or_the_new_checkpoint(tmp_path):
    program, optimizer = _tiny_program()
    target = str(tmp_path / "ckpt")
    program.save(target, optimizer=optimizer, step=0)
    figures = {"kills": 0, "torn": 0, "refused": 0, "leftovers": 0}
    last, step = 0, 0
    while _killed_at(step, partial(program.save, target, optimizer=optimizer, step=last + 1),
                     removals=True):
        figures["kills"] += 1
        try:
            loaded = fxpipe.load_checkpoint(target)["step"]
            figures["torn"] += loaded not in (last, last + 1)
        except FxPipeError:
            figures["refused"] += 1
        last += 1
        program.save(target, optimizer=optimizer, step=last)
        meta = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())
        figures["leftovers"] += sorted(os.listdir(target)) != sorted(
            ["checkpoint.json", "checkpoint.lock", meta["folder"]])
        step += 1
    print("save kill trials:", figures)
    assert figures["kills"] >= 4, figures  # the steps after its shards are written
    assert figures["torn"] == figures["refused"] == figures["leftovers"] == 0, figures


def _save_rounds(program, optimizer, target: str, first_step: int, rounds: int) -> str:
    outcomes = []
    for i in range(rounds):
        step = first_step + 2 * i
        try:
            program.save(target, optimizer=optimizer, step=step)
            outcome = "ok"
        except CheckpointError as e:
            told = "is being saved into by " in str(e) and target in str(e)
            outcome = "refused" if told else f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - counted, and the test fails on it
            outcome = f"raw {type(e).__name__}: {e}"
        outcomes.append([step, outcome, time.monotonic()])
    return json.dumps(outcomes)


@pytest.mark.slow
def test_concurrent_savers_lose_no_save_and_the_loser_is_told_who_holds_the_folder(tmp_path):
    target = str(tmp_path / "ckpt")
    program, optimizer = _tiny_program()
    figures = {"saves": 0, "refused": 0, "raw": 0, "lost": 0}
    examples: list[str] = []
    for round_ in range(6):
        start = time.time() + 3
        results: list[list[list]] = []
        pids = []
        for first in (1, 2):  # one saver saves odd steps, the other even ones
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                torch.set_num_threads(1)  # no thread pool survives a fork
                os.close(read)
                text = "[]"
                try:
                    while time.time() < start:
                        time.sleep(0.005)
                    text = _save_rounds(program, optimizer, target, 100 * round_ + first, 10)
                finally:
                    os.write(write, text.encode())
                    os._exit(0)
            os.close(write)
            pids.append((pid, read))
        for pid, read in pids:
            with os.fdopen(read) as f:
                results.append(json.loads(f.read()))
            os.waitpid(pid, 0)
        done = sorted((t, step) for saver in results for step, outcome, t in saver
                      if outcome == "ok")
        others = [o for saver in results for _, o, _ in saver if o != "ok"]
        figures["saves"] += len(done)
        figures["refused"] += others.count("refused")
        raw = [o for o in others if o != "refused"]
        figures["raw"] += len(raw)
        examples.extend(raw[:1])
        figures["lost"] += fxpipe.load_checkpoint(target)["step"] != done[-1][1]
    print("concurrent saver trials:", figures)
    assert figures["raw"] == figures["lost"] == 0, (figures, "\n".join(examples))
    assert figures["saves"] > 0 and figures["refused"] > 0, figures


@pytest.mark.slow
def test_loads_during_saves_never_report_damage(tmp_path):
    program, optimizer = _tiny_program()
    target = str(tmp_path / "ckpt")
    program.save(target, optimizer=optimizer, step=0)
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)  # no thread pool survives a fork
        try:
            for step in range(1, 10**6):
                program.save(target, optimizer=optimizer, step=step)
        finally:
            os._exit(0)
    figures = {"loads": 0, "errors": 0, "steps": set()}
    try:
        for _ in range(150):
            try:
                figures["steps"].add(fxpipe.load_checkpoint(target)["step"])
            except FxPipeError as e:
                figures["errors"] += 1
                print(e)
            figures["loads"] += 1
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    print("loads during saves:", figures["loads"], "errors:", figures["errors"],
          "steps seen:", len(figures["steps"]))
    assert figures["errors"] == 0 and len(figures["steps"]) > 1, figures


def _limited(limit: int, action: Callable[[], object], path: str) -> str:
    """`action`'s outcome with files limited to `limit` bytes (RLIMIT_FSIZE), as on a full disk."""
    def run() -> str:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        return _outcome(action, path)
    return _in_child(run)


@pytest.mark.slow
def test_a_full_disk_in_save_and_write_is_named_and_keeps_what_was_there(tmp_path):
    program, optimizer = _tiny_program()
    target, folder = tmp_path / "ckpt", tmp_path / "prog"
    program.save(str(target), optimizer=optimizer, step=1)
    program.write(str(folder), reference_steps=0)
    ckpt_before = sorted(os.listdir(target))
    prog_before = {n: (folder / n).read_bytes() for n in os.listdir(folder)}
    outcomes = []
    for limit in (0, 64, 600, 4000):
        outcomes.append(_limited(limit, lambda: program.save(str(target), optimizer=optimizer,
                                                             step=2), str(target)))
        outcomes.append(_limited(limit, lambda: program.write(str(folder), reference_steps=0),
                                 str(folder)))
    print("full disk outcomes:", outcomes)
    assert outcomes == ["named"] * len(outcomes)
    assert sorted(os.listdir(target)) == ckpt_before
    assert fxpipe.load_checkpoint(str(target))["step"] == 1
    assert {n: (folder / n).read_bytes() for n in os.listdir(folder)} == prog_before
    assert _hidden(tmp_path) == []


@pytest.mark.slow
def test_every_damaged_weights_file_and_index_is_an_error_naming_it(tmp_path):
    figures: dict[str, int] = {}
    good = _safetensors_bytes({"w": {**_F32, "data_offsets": [0, 8]}}, bytes(8))
    cases = {f"safetensors, {k}": (v, None) for k, v in _DAMAGED.items()}
    cases.update({f"safetensors, cut at {n}": (good[:n], None) for n in range(0, len(good), 7)})
    cases.update({f"index {t!r}": (good, t) for t in [
        "{", "[]", "null", '"x"', '{"weight_map": 5}', '{"weight_map": {"w": 5}}',
        '{"weight_map": {"w": null}}', '{"weight_map": {"w": "../x.safetensors"}}',
        '{"weight_map": {"w": "/etc/passwd"}}', '{"weight_map": {"w": ""}}',
        '{"weight_map": {"w": "sub/../../x.safetensors"}}', '{"weight_map": {"w": "absent"}}']})
    for i, (name, (data, index)) in enumerate(sorted(cases.items())):
        root = tmp_path / str(i)
        root.mkdir()
        (root / "model.safetensors").write_bytes(data)
        path = root / "model.safetensors"
        if index is not None:
            (root / _INDEX).write_text(index)
            path = root / _INDEX
        outcome = _outcome(partial(_read_all, root if index is not None else path), str(path))
        key = outcome if outcome in ("ok", "named") else f"{name}: {outcome}"
        figures[key] = figures.get(key, 0) + 1
    print("damaged weights trials:", figures)
    assert set(figures) == {"named"}, figures


def test_a_disk_too_full_for_a_new_folder_is_a_storage_error(tmp_path, monkeypatch):
    program, _ = _tiny_program()
    program.save(str(tmp_path / "ckpt"), step=1)
    program.write(str(tmp_path / "prog"), reference_steps=0)

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(os, "mkdir", full)
    with pytest.raises(StorageError, match=rf"writing {tmp_path / 'ckpt'}/.*No space left"):
        program.save(str(tmp_path / "ckpt"), step=2)
    with pytest.raises(StorageError, match=rf"writing the program to {tmp_path / 'prog'} "
                                           "failed: .*No space left"):
        program.write(str(tmp_path / "prog"), reference_steps=0)
    monkeypatch.undo()
    assert fxpipe.load_checkpoint(str(tmp_path / "ckpt"))["step"] == 1
    assert check_program(tmp_path / "prog").stages == 2

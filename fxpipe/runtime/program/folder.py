"""A written program's folder, checked before anything in it runs: program.json as fxpipe writes
it, the code program.py allows, stage files inside the folder, every file present with the
contents it was written with (program.json records each one's sha256), and no other Python
module that an import of program.py would find first. A write killed mid-swap is finished or
rolled back first (fxpipe.storage.files.recover_folder).

The digests catch a folder mixed from two programs, a stale or truncated file, or a file copied
in from elsewhere; they are no defence against someone who edits program.json to match (the
allow-lists of fxpipe.runtime.program.spec_check and fxpipe.runtime.program.imports are).
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from fxpipe.errors import ProgramFolderError
from fxpipe.runtime.program.imports import ProgramCode, allowed_loss, code_of_launcher
from fxpipe.runtime.program.spec_check import spec_problems
from fxpipe.runtime.program.spec_json import ProgramJSON
from fxpipe.storage.files import recover_folder
from fxpipe.storage.userfiles import carry_user_files

__all__ = ["CheckedProgram", "check_program", "file_digest", "is_program", "program_report"]

_STAGE = re.compile(r"stage_\d+")
_HINT = "write the program again (program.write(dir) or fxpipe compile ... --out DIR)"


def file_digest(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_program(folder: str | os.PathLike[str], dir_fd: int | None = None) -> bool:
    """Whether `folder` holds a program fxpipe wrote (program.py and its program.json); with
    `dir_fd`, `folder` is relative to that open folder, wherever another writer has moved it."""
    try:
        fd = os.open(os.path.join(folder, "program.json"), os.O_RDONLY, dir_fd=dir_fd)
        with open(fd, encoding="utf-8") as f:
            data = json.load(f)
        launcher = os.stat(os.path.join(folder, "program.py"), dir_fd=dir_fd)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "fxpipe" in data and stat.S_ISREG(launcher.st_mode)


@dataclass(frozen=True)
class CheckedProgram:
    """A folder that passed check_program, with what it holds."""

    folder: Path
    data: ProgramJSON
    code: ProgramCode

    @property
    def stages(self) -> int:
        return len(self.data["stages"])


def _read(folder: Path) -> object:
    if not folder.is_dir():
        raise ProgramFolderError(f"{folder} is not a folder" if folder.exists() else
                                 f"{folder} does not exist", hint=_HINT)
    try:
        with open(folder / "program.json", encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ProgramFolderError(f"{folder} has no program.json, so it is no program fxpipe "
                                 "wrote", hint=_HINT) from None
    except (OSError, ValueError) as e:
        raise ProgramFolderError(f"{folder}/program.json cannot be read ({e})",
                                 hint=_HINT) from None


def check_program(folder: str | os.PathLike[str], *, contents: bool = True) -> CheckedProgram:
    """The program in `folder`, checked; raises ProgramFolderError naming the first thing wrong.

    contents: compare every file's sha256 with the one recorded (reads the weights once);
    without, only that every file is present.
    """
    folder = Path(folder)
    try:  # a write killed mid-swap: finish it, or put the old program back
        recover_folder(str(folder), carry_user_files)
    except OSError:
        pass  # a folder this process may not change: checked as it is
    data = _read(folder)
    problems = spec_problems(data)
    if problems:
        raise ProgramFolderError(f"{folder}/program.json is not as fxpipe writes it: "
                                 + "; ".join(problems), hint=_HINT)
    spec: ProgramJSON = data  # type: ignore[assignment]  # checked field by field above
    code = code_of_launcher(folder)
    allowed_loss(spec["loss"], code)
    outside = set(spec["signature"].get("pytree_modules", [])) - set(code.modules)
    if outside:
        raise ProgramFolderError(f"program.json names output types from {sorted(outside)}, which "
                                 f"program.py does not record (allowed: {list(code.modules)})",
                                 hint=_HINT)
    if "files" not in spec:
        raise ProgramFolderError(f"{folder}/program.json lists no files (written by an older "
                                 "fxpipe)", hint=_HINT)
    files = spec["files"]
    for stage in spec["stages"]:
        if stage["file"] not in files:
            raise ProgramFolderError(f"program.json names the stage file {stage['file']!r}, "
                                     f"which it does not list among the program's files "
                                     f"({', '.join(sorted(files))})", hint=_HINT)
    root = folder.resolve()
    for name, digest in sorted(files.items()):
        path = folder / name
        if not path.resolve().is_relative_to(root):
            raise ProgramFolderError(f"{path} leads out of the program's folder (a link to "
                                     f"{path.resolve()})", hint=_HINT)
        if not path.is_file():
            raise ProgramFolderError(f"{folder} has no {name}, which the program needs",
                                     hint=_HINT)
        if contents and file_digest(path) != digest:
            raise ProgramFolderError(f"{path} is not the file the program was written with "
                                     f"(sha256 {file_digest(path)[:12]}..., recorded "
                                     f"{digest[:12]}...): the folder was altered or mixed with "
                                     "another program", hint=_HINT)
    _check_no_shadowing(folder, set(files), code)
    return CheckedProgram(folder, spec, code)


def _module_name(path: Path) -> str | None:
    """The top-level module name `import` would find at `path`, if any."""
    if path.is_dir():
        inits = [path / f"__init__{suffix}" for suffix in importlib.machinery.all_suffixes()]
        return path.name if path.name.isidentifier() and any(p.exists() for p in inits) else None
    for suffix in importlib.machinery.all_suffixes():
        stem = path.name.removesuffix(suffix)
        if path.name.endswith(suffix) and stem.isidentifier():
            return stem
    return None


def _check_no_shadowing(folder: Path, listed: set[str], code: ProgramCode) -> None:
    """Refuses a Python module in the folder that program.json does not list: Python puts the
    folder of `python program.py` first on sys.path, so a torch.py or fxpipe.py there would be
    imported instead of the real one. Stage files are loaded by path, never by module name; the
    user's own modules may sit there when the program was written to look for them there."""
    own = {name.partition(".")[0] for name in [code.loss.partition(":")[0], *code.modules]} \
        if "." in code.folders else set()
    for entry in sorted(os.listdir(folder)):
        module = None if entry in listed else _module_name(folder / entry)
        if module is not None and module not in own and not _STAGE.fullmatch(module):
            raise ProgramFolderError(
                f"{folder / entry} is a Python module ({module!r}) that program.json does not "
                f"list: program.py, run from {folder}, would import it instead of any installed "
                f"{module!r}", hint="move it out of the program's folder (or delete it if you did "
                "not put it there), then run again")


def program_report(folder: str | os.PathLike[str], *, as_json: bool = False) -> str:
    """The report of the checked program in `folder` (report.txt, or report.json), with what it
    imports besides fxpipe: the loss, and where the user's modules are looked for."""
    checked = check_program(folder)
    code = checked.code
    if as_json:
        with open(checked.folder / "report.json", encoding="utf-8") as f:
            data = json.load(f)
        data["program"] = {"stages": checked.stages, "loss": checked.data["loss"],
                           "modules": list(code.modules), "folders": list(code.folders)}
        return json.dumps(data, indent=2) + "\n"
    text = (checked.folder / "report.txt").read_text(encoding="utf-8")
    loss = checked.data["loss"]
    where = f" (its module is looked for in the current folder and {', '.join(code.folders)})" \
        if code.folders else ""
    line = f"program: {checked.stages} stages, loss {loss}" + (
        where if ":" in loss else " (fxpipe's own)")
    if code.modules:
        line += f"; output types from {', '.join(code.modules)}"
    return text.rstrip("\n") + "\n\n" + line + "\n"

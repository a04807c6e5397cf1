"""fxpipe.source: where a node came from, the same whatever was imported before."""
from __future__ import annotations

import importlib
import sys

from fxpipe import source


def test_the_bundled_models_show_their_package_path():
    """`fxpipe.models.gpt` is also `models.gpt` where the repository root is on sys.path (as in
    the tests): stage comments, and the golden files, show the package's name."""
    alias = importlib.import_module("models.gpt")
    bundled = importlib.import_module("fxpipe.models.gpt")
    assert alias.__file__ == bundled.__file__
    assert source.display_path(alias.__file__) == "fxpipe/models/gpt.py"
    line = source.from_stack_trace(f'File "{alias.__file__}", line 95, in forward\n    T = 1\n')
    assert line is not None and line.file == "fxpipe/models/gpt.py"


def test_a_file_imported_under_two_names_shows_the_qualified_one_whatever_came_first(
        tmp_path, monkeypatch):
    """Imported first under its short name (and displayed then), later under its package's:
    the answer is the package's, not the first import's nor the first call's cached one."""
    package = tmp_path / "probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("", encoding="utf-8")
    path = package / "probe_mod.py"
    path.write_text("X = 1\n", encoding="utf-8")
    trace = f'File "{path}", line 1, in forward\n    X = 1\n'
    assert source.display_path(str(path)) == "probe_mod.py"  # not imported: its file name
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(package))
    try:
        importlib.import_module("probe_mod")
        assert source.display_path(str(path)) == "probe_mod.py"
        assert source.from_stack_trace(trace).file == "probe_mod.py"
        importlib.import_module("probe_pkg.probe_mod")
        assert source.display_path(str(path)) == "probe_pkg/probe_mod.py"
        assert source.from_stack_trace(trace).file == "probe_pkg/probe_mod.py"
    finally:
        for name in ("probe_mod", "probe_pkg.probe_mod", "probe_pkg"):
            sys.modules.pop(name, None)

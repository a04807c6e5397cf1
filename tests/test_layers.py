"""The package's import structure (DESIGN.md, "Layout"): each layer imports only layers below it,
no module imports a private name of another, no import cycle exists (function-local imports
included), and the tools and test helpers beside the compiler are never imported by it.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"fxpipe": ROOT / "fxpipe", "fxpipe.passes": ROOT / "passes",
            "fxpipe.models": ROOT / "models"}

# Lowest first. A module belongs to the layer of the longest prefix that names it.
LAYERS: list[tuple[str, ...]] = [
    ("fxpipe.errors", "fxpipe.version", "fxpipe.source", "fxpipe.figures", "fxpipe.units",
     "fxpipe.choices", "fxpipe.full_gc",
     "fxpipe.storage", "fxpipe.storage.files", "fxpipe.storage.savelock",
     "fxpipe.storage.userfiles", "fxpipe.storage.random_state",
     "fxpipe.storage.loss_scale"),  # foundation
    ("fxpipe.ir", "fxpipe.signature", "fxpipe.profile", "fxpipe.losses", "fxpipe.untouched",
     "fxpipe.storage.state", "fxpipe.storage.structure", "fxpipe.storage.checkpoint",
     "fxpipe.storage.resume", "fxpipe.storage.weights",
     "fxpipe.optimizers", "fxpipe.sharding", "fxpipe.models",
     "fxpipe.remat_policy", "fxpipe.conversion", "fxpipe.replaced", "fxpipe.model_modes",
     "fxpipe.module_settings", "fxpipe.reparametrized",
     "fxpipe.targets"),  # contracts: metadata, names, formats, policies
    ("fxpipe.runtime",),  # schedules, communication, executors, rank setup, launcher
    ("fxpipe.frontend", "fxpipe.passes", "fxpipe.codegen",
     "fxpipe.callable_names"),  # the compiler's passes
    ("fxpipe.config", "fxpipe.built"),  # the options and what a compile produces
    ("fxpipe.stage_facts", "fxpipe.stage_header", "fxpipe.report"),
    ("fxpipe.costs",),
    ("fxpipe.pipeline",),  # build(): the passes in order
    # take the built plan
    ("fxpipe.reference", "fxpipe.writer", "fxpipe.held", "fxpipe.rebalance", "fxpipe.variants",
     "fxpipe.program", "fxpipe.program_state", "fxpipe.program_balance"),
    ("fxpipe.api", "fxpipe.cli", "fxpipe.__main__", "fxpipe"),  # what users call
]
BESIDE = ("fxpipe.tools", "fxpipe.testing")  # import anything; imported only by fxpipe.cli


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            if package == "fxpipe" and parts and parts[0] in ("passes", "models"):
                continue
            modules[".".join([package, *parts])] = path
    return modules


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, list[str]]]:
    """(imported fxpipe module, names imported from it) for every import in `name`."""
    path = MODULES[name]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full, []) if full in MODULES else (base, [alias.name]))
    out = []
    for target, names in found:
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.append((target, names))
    return out


def _layer(name: str) -> int | None:
    best, layer = "", None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
                best, layer = prefix, index
    return layer


def _beside(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in BESIDE)


def _is_container(importer: str, imported: str) -> bool:
    """A package's __init__ re-exporting its own modules, or a module importing its package."""
    return importer.startswith(imported + ".") or imported.startswith(importer + ".")


def test_every_module_has_a_layer():
    assert [m for m in MODULES if _layer(m) is None and not _beside(m)] == []


def test_imports_only_point_down():
    upward = []
    for name in MODULES:
        mine = _layer(name)
        for target, _ in _imports(name):
            if _is_container(name, target) or _beside(name):
                continue
            if _beside(target):
                if name != "fxpipe.cli":
                    upward.append(f"{name} imports the tool/test helper {target}")
                continue
            theirs = _layer(target)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{name} (layer {mine}) imports {target} (layer {theirs})")
    assert upward == []


def test_no_module_imports_a_private_name_of_another():
    private = [f"{name} imports {target}.{n}" for name in MODULES
               for target, names in _imports(name) for n in names
               if n.startswith("_") and not n.startswith("__")]
    assert private == []


def test_the_import_graph_has_no_cycle():
    edges = {name: {t for t, _ in _imports(name) if not _is_container(name, t)}
             for name in MODULES}
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_the_remat_names_are_the_policies() -> None:
    """The command line lists remat modes from fxpipe.choices (no torch); each is a policy."""
    from fxpipe.choices import REMAT_MODES
    from fxpipe.remat_policy import RematPolicy

    assert REMAT_MODES == tuple(p.value for p in RematPolicy)


def _readme_tree() -> set[str]:
    """The folders README.md's tree names ("How it works": `name/` lines, two spaces a level)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("The tree, one line per folder", 1)[1].split("```", 2)[1]
    folders, path = set(), []
    for line in block.splitlines():
        name = line.strip().split(" ", 1)[0]
        if not name.endswith("/"):
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        path = path[:depth] + [name.rstrip("/")]
        folders.add("/".join(path))
    return folders


def test_the_readme_tree_names_every_package_and_nothing_else():
    packages = {str(p.parent.relative_to(ROOT)) for folder in PACKAGES.values()
                for p in folder.rglob("__init__.py")
                if not (p.parent.relative_to(ROOT).parts[:1] == ("fxpipe",)
                        and p.parent.relative_to(ROOT).parts[1:2] in (("passes",), ("models",)))}
    assert _readme_tree() == packages


def _dataclasses(path: Path) -> list[str]:
    """The names of the classes decorated with @dataclass in the file at `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            and any("dataclass" in ast.unparse(d) for d in node.decorator_list)]


def test_a_stage_is_one_of_four_records() -> None:
    """A stage passes the compiler/runtime wall as four records (README, "How it works"), each
    named for what it is, beside the partition's prediction for it; another is a field copy
    to review, not a type to add."""
    found = {(name, module) for module, path in MODULES.items() if not _beside(module)
             for name in _dataclasses(path) if "Stage" in name}
    assert found == {
        ("StageGraph", "fxpipe.passes.split"),  # the cut graph with its messages
        ("BuiltStage", "fxpipe.built"),  # + its remat regions and code
        ("StageSpec", "fxpipe.runtime.execution.stagespec"),  # what the runtime reads
        ("HeldStage", "fxpipe.runtime.execution.stagespec"),  # its module on its device
        ("HeldStages", "fxpipe.runtime.execution.hold"),  # a process's list of them, executors
        ("StagePlan", "fxpipe.passes.partition.plan"),  # predicted: its nodes, times, bytes
    }

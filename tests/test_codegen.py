"""fxpipe.codegen: readable, deterministic, valid and safe stage code."""
from __future__ import annotations

import ast
import dataclasses
import os
import re
import shlex
from pathlib import Path

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.models import MODELS
from fxpipe.models import load as load_model
from fxpipe.profile import preset
from fxpipe.runtime.launch import build_stage

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("FXPIPE_UPDATE_GOLDEN") == "1"


def _compile(name: str, stages: int, remat: str, **config):
    model, inputs, kwargs = load_model(name, **config)
    return fxpipe.compile(model, inputs, example_kwargs=kwargs, stages=stages, chunks=4,
                          remat=remat, profile="a100")


# One shape of stage each: remat for all but the last micro-batch (mlp), a whole stage in one
# region and a tied weight (gpt), no remat at all (gpt, never), values sent to several later
# stages (unet's and branchy's skip connections), buffers updated in forward (resnet's BatchNorm
# in train mode).
GOLDEN_CASES = [("mlp_3stages", "mlp", 3, "except_last", {}),
                ("gpt_2stages", "gpt", 2, "always", {"dropout": 0.0}),
                ("gpt_2stages_never", "gpt", 2, "never", {"dropout": 0.0}),
                ("unet_3stages", "unet", 3, "except_last", {}),
                ("branchy_3stages", "branchy", 3, "always", {}),
                ("resnet_2stages", "resnet", 2, "never", {})]


@pytest.mark.parametrize("folder,name,stages,remat,config", GOLDEN_CASES,
                         ids=[c[0] for c in GOLDEN_CASES])
def test_generated_code_matches_the_golden_files(folder, name, stages, remat, config):
    program = _compile(name, stages, remat, **config)
    folder = GOLDEN / folder
    for stage in program.stages:
        path = folder / f"stage_{stage.index}.py"
        if UPDATE:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(stage.source, encoding="utf-8")
        assert path.exists(), f"missing golden file {path}; regenerate with FXPIPE_UPDATE_GOLDEN=1"
        assert stage.source == path.read_text(encoding="utf-8"), (
            f"stage {stage.index} of {name} changed; review the diff and regenerate with "
            "FXPIPE_UPDATE_GOLDEN=1")


def test_golden_files_are_valid_python():
    files = sorted(GOLDEN.glob("*/stage_*.py"))
    assert files
    for path in files:
        compile(path.read_text(encoding="utf-8"), str(path), "exec")


def test_every_parameter_of_a_generated_method_is_annotated():
    """forward and the remat regions: comm is the MicrobatchComm the executors pass, a tensor
    says its shape, as the statements do."""
    from fxpipe.runtime.comm import MicrobatchComm

    files = sorted(GOLDEN.glob("*/stage_*.py"))
    remat = 0
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert "from fxpipe.runtime.comm import MicrobatchComm" in ast.unparse(tree)
        for method in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            remat += method.name.startswith("remat_")
            params = method.args.args[1:]
            assert all(p.annotation is not None for p in params), f"{path}: {method.name}"
            assert method.name != "forward" or params[0].arg == "comm"
            assert all(ast.unparse(p.annotation) == "MicrobatchComm" for p in params
                       if p.arg == "comm")
    assert remat >= 5 and MicrobatchComm.__module__ == "fxpipe.runtime.comm"


def test_generated_code_is_deterministic():
    first = [s.source for s in _compile("gpt", 2, "except_last", dropout=0.0).stages]
    second = [s.source for s in _compile("gpt", 2, "except_last", dropout=0.0).stages]
    assert first == second
    for text in first:
        assert "/work/" not in text and "/tmp/" not in text  # no absolute paths


@pytest.mark.parametrize("name", MODELS)
def test_every_generated_stage_compiles(name):
    program = _compile(name, 3, "always")
    for stage in program.stages:
        compile(stage.source, f"stage_{stage.index}.py", "exec")
        for method in (n for n in ast.walk(ast.parse(stage.source))
                       if isinstance(n, ast.FunctionDef)):
            bare = [p.arg for p in method.args.args[1:] if p.annotation is None]
            assert bare == [], f"stage {stage.index} of {name}: {method.name}"


def test_stage_code_reads_like_the_model():
    source = _compile("gpt", 2, "except_last", dropout=0.0).stages[1].source
    assert "comm.recv(" in source.split("def forward")[1].split("\n")[1]  # receives come first
    assert "# fxpipe/models/gpt.py:" in source  # the user's source lines
    assert 'blocks_1_attn_c_attn: "f32[b, 32, 192]"' in source  # module names, symbolic shapes
    assert re.search(r"= checkpoint\(self\.remat_0, \w+, enabled=comm\.remat\)\n", source)
    assert "def remat_0(self" in source
    assert "use_reentrant" not in source  # the helper passes use_reentrant=False


class _Weird(nn.Module):
    """Names and constants a code generator must not trust."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module('lin"\nprint("pwned")\n#', nn.Linear(4, 4))
        self.add_module("class", nn.Linear(4, 4))
        self.add_module("print", nn.Linear(4, 4))
        self.add_module("ünïcode\u2028", nn.Linear(4, 4))
        self.register_buffer("self", torch.ones(4))

    def forward(self, x):
        for child in self.children():
            x = child(x)
        x = x + self.get_buffer("self")
        x = torch.where(x > 1e30, float("nan"), x)  # float constants that need care
        return x.clamp(float("-inf"), 1e30) * 0.5


def test_hostile_names_produce_valid_equivalent_code_that_runs_no_model_text(capfd):
    model = _Weird()
    x = torch.randn(4, 4)
    program = fxpipe.compile(model, (x,), stages=2, chunks=2, profile="a100")
    for stage in program.stages:
        compile(stage.source, "stage.py", "exec")
        for line in stage.source.splitlines():  # model text only inside comments or literals
            assert not line.lstrip().startswith('print("pwned")'), line
    torch.testing.assert_close(program(x), model(x))
    assert "pwned" not in capfd.readouterr().out


@pytest.mark.parametrize("name", MODELS)
def test_generated_lines_stay_within_100_characters(name):
    for stages, remat in ((2, "never"), (3, "always")):
        for stage in _compile(name, stages, remat).stages:
            long = [line for line in stage.source.splitlines() if len(line) > 100]
            assert long == [], f"stage {stage.index} of {name}"


def test_names_carry_no_fx_counters_where_a_better_name_exists():
    source = "".join(s.source for s in _compile("gpt", 2, "never", dropout=0.0).stages)
    assert "getattr_" not in source and "getitem" not in source
    assert "idx_device = idx.device" in source  # named after what it reads
    assert "blocks_0_attn_split_1" in source and "blocks_0_attn_size_0" in source


def test_the_header_is_built_from_facts():
    program = _compile("gpt", 2, "always", dropout=0.0)
    header = program.stages[0].source.split("from __future__")[0]
    assert f"fxpipe {fxpipe.__version__}" in header
    assert "Compiled with:" in header  # the Python API gives no command to run again
    assert "fxpipe.compile(GPT(...), stages=2, chunks=4, remat='always'" in header
    # nothing predicted or measured: that depends on the machine (the report says it)
    assert "#   profile" not in header and "A100" not in header and " us " not in header
    assert "predicted" not in header and "of all stages' time" not in header
    assert "wte.weight is also held by stage 1; its gradient is summed over stages 0, 1" in header
    passes = "capture > annotate_costs > partition > split_stages > mark_remat > codegen"
    assert passes in header.replace("\n#           ", " ")
    model, inputs, _ = load_model("resnet")
    deferred = fxpipe.compile(model, inputs, stages=2, profile="a100", deferred_batch_norm=True)
    assert "capture > defer_batch_norm > annotate_costs" in deferred.stages[0].source


def test_the_written_stage_files_are_the_same_whatever_the_device_profile_predicts(tmp_path):
    """The same compile on two machines: one device, measured three times slower on the
    second. The cut is the same, the predictions differ, and only the report (and program.json,
    which lists the report's digest and the predicted timeline `--timeline` draws) says so."""
    fast = preset("a100")
    slow = dataclasses.replace(fast.scaled(3.0), link=fast.link.scaled(3.0),
                               link_latency=fast.link_latency * 3.0)  # the same name and cut
    model, inputs, _ = load_model("mlp")
    written = {}
    for name, profile in (("fast", fast), ("slow", slow)):
        program = fxpipe.compile(model, inputs, stages=3, chunks=4, remat="except_last",
                                 profile=profile)
        program.write(str(tmp_path / name), reference_steps=2)
        written[name] = program
    plans = [written[name].plan for name in ("fast", "slow")]
    assert [s.nodes for s in plans[0].stages] == [s.nodes for s in plans[1].stages]
    assert plans[1].predicted_step_time > 2 * plans[0].predicted_step_time
    files = sorted(p.name for p in (tmp_path / "fast").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "slow").iterdir())
    differ = [f for f in files if (tmp_path / "fast" / f).read_bytes()
              != (tmp_path / "slow" / f).read_bytes()]
    assert differ == ["program.json", "report.json", "report.txt"]
    assert {"stage_0.py", "stage_1.py", "stage_2.py", "program.py"} <= set(files)


def test_the_command_line_header_is_a_command_that_regenerates_the_program(tmp_path):
    from fxpipe.cli import main

    assert main(["compile", "fxpipe.models.mlp:build", "--stages", "2", "--chunks", "2",
                 "--profile", "a100", "--out", str(tmp_path / "a")]) == 0
    header = (tmp_path / "a" / "stage_0.py").read_text().splitlines()
    assert header[0].endswith("Regenerate with:")
    lines = header[1:header.index("#")]  # continued with a backslash, as in a shell
    command = shlex.split(" ".join(line.removeprefix("#").rstrip("\\") for line in lines))
    assert command[:2] == ["fxpipe", "compile"]
    assert main([*command[1:], "--out", str(tmp_path / "b")]) == 0
    for name in ("stage_0.py", "stage_1.py"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()


def test_hostile_class_and_parameter_names_give_a_launcher_and_stages_that_compile(tmp_path):
    name = 'Model"""\\N{\n'
    cls = type(name, (nn.Module,), {"forward": lambda self, x: self.get_submodule('b"""\\N')(
        self.get_submodule("a\\x00'''")(x))})
    model = cls()
    model.add_module("a\\x00'''", nn.Linear(4, 4))
    model.add_module('b"""\\N', nn.Linear(4, 4))
    program = fxpipe.compile(model, (torch.randn(4, 4),), stages=2, chunks=2, profile="a100")
    program.write(str(tmp_path / "prog"), reference_steps=0)
    for path in sorted((tmp_path / "prog").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))  # a SyntaxError before
        if path.name == "program.py":
            assert f"for {name.strip()}\\n." in ast.get_docstring(tree)  # reads as the name
    stage = build_stage(tmp_path / "prog", 0)
    assert list(stage.PARAMETERS.values()) == ["a\\x00'''.weight", "a\\x00'''.bias"]



def test_a_stage_error_shows_the_stage_line_though_its_lines_are_read_only_when_asked():
    """Stage modules register their source with linecache lazily (a deep model's stages would
    otherwise keep every line twice); a traceback through a stage still shows its code."""
    import linecache
    import traceback

    model, inputs = load_model("mlp", deterministic=True)[:2]
    program = fxpipe.compile(model, inputs, stages=2, chunks=2, profile=preset("a100"))
    filename = "<fxpipe stage 1>.py"
    assert len(linecache.cache[filename]) == 1  # a loader, no lines yet

    class Failing:
        def recv(self, *args, **kwargs):
            raise RuntimeError("no message")

    with pytest.raises(RuntimeError) as failed:
        program.stage_modules[1](Failing())
    text = "".join(traceback.format_exception(failed.value))
    (line,) = [line for line in program.built.stages[1].source.splitlines() if "comm.recv(" in line]
    assert f'File "{filename}"' in text and line.strip() in text

"""fxpipe.codegen: readable, deterministic, valid and safe stage code."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.models import MODELS
from fxpipe.models import load as load_model

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("FXPIPE_UPDATE_GOLDEN") == "1"


def _compile(name: str, stages: int, remat: str, **config):
    model, inputs, kwargs = load_model(name, **config)
    return fxpipe.compile(model, inputs, example_kwargs=kwargs, stages=stages, chunks=4,
                          remat=remat, profile="a100")


GOLDEN_CASES = [("mlp", 3, "except_last", {}), ("gpt", 2, "always", {"dropout": 0.0})]


@pytest.mark.parametrize("name,stages,remat,config", GOLDEN_CASES,
                         ids=[f"{c[0]}_{c[1]}stages" for c in GOLDEN_CASES])
def test_generated_code_matches_the_golden_files(name, stages, remat, config):
    program = _compile(name, stages, remat, **config)
    folder = GOLDEN / f"{name}_{stages}stages"
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


def test_stage_code_reads_like_the_model():
    source = _compile("gpt", 2, "except_last", dropout=0.0).stages[1].source
    assert "comm.recv(" in source.split("def forward")[1].split("\n")[1]  # receives come first
    assert "# fxpipe/models/gpt.py:" in source  # the user's source lines
    assert 'blocks_1_attn_c_attn: "f32[b, 32, 192]"' in source  # module names, symbolic shapes
    assert "checkpoint(self.remat_0, comm.remat" in source
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

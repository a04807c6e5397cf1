"""A billion-parameter model compiles on the meta device in a process that allocates far less
than the model's size (fxpipe.tools.giant; the 8B and 70B figures come from the same tool)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")


@pytest.mark.slow
def test_a_one_billion_parameter_llama_compiles_in_a_fraction_of_its_size():
    result = subprocess.run([sys.executable, "-m", "fxpipe.tools.giant", "--preset", "1b",
                             "--stages", "4", "--json"], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    model = figures["model_bytes"]
    assert figures["parameters"] > 1e9 and model > 1.9e9  # bf16
    # every weight is in one stage (besides it, only the rotary frequencies: 1 KiB)
    assert 0 <= sum(figures["stage_params_bytes"]) - model < 2**20
    assert max(figures["stage_params_bytes"]) < model / 2
    # compiling adds a small fraction of the model's size to the process; the whole process
    # (python, torch and transformers alone take 0.5-1 GiB, by machine) stays below the model
    assert figures["compile_peak_growth_bytes"] < model / 10
    assert figures["process_peak_bytes"] < model
    # the bubble is the ranks' idle share of the simulated step: GPipe's (S-1)/(M+S-1) at equal
    # stage times, plus what the imbalance and the messages leave idle
    stages, chunks = figures["stages"], figures["chunks"]
    assert (stages - 1) / (chunks + stages - 1) <= figures["bubble"] < 0.3
    assert figures["predicted_step_time_s"] > 0

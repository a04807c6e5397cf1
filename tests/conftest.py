"""Shared fixtures: every test starts from the same RNG state, and property tests draw the same
examples on every run (a failure in CI is a failure on every machine)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import settings

settings.register_profile("fxpipe", derandomize=True, database=None)
settings.load_profile("fxpipe")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)

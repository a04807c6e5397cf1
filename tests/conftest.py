"""Shared fixtures: every test starts from the same RNG state."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)

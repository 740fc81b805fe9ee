"""Generators for tests that need the same draws twice (two models built alike, one input fed to two
paths) and fresh draws on every run."""
from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive salts over the seed space


def generator(salt: int = 0) -> torch.Generator:
    """A CPU generator seeded from this test's fresh seed (torch.initial_seed(), set per test by
    tests/conftest.py, so MOE_OPS_SEED reproduces it) and `salt`: equal salts give equal draws within
    a test, and every run draws anew."""
    return torch.Generator().manual_seed((torch.initial_seed() + salt * _GOLDEN) % (1 << 63))

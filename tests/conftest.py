"""Shared pytest setup: skip `gpu` tests without CUDA, and a fresh, recorded random seed per test."""
from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def rng(request) -> torch.Generator:
    """Autouse: seeds torch with a fresh seed from os.urandom (tests draw new inputs on every run) and records
    it: it is printed (pytest shows it with a failure) and attached to the report as user property `seed`.
    Reproduce a failure with MOE_OPS_SEED=<seed>."""
    env = os.environ.get("MOE_OPS_SEED")
    seed = int(env) if env else int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed} (rerun with MOE_OPS_SEED={seed})")
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


"""Tests run on the CPU with 8 virtual devices; this must be set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1].parent / "shared" / "assets"


@pytest.fixture(scope="session")
def assets() -> Path:
    """../shared/assets (real tokenizer and data); see its README."""
    if not ASSETS.is_dir():
        pytest.fail(f"{ASSETS} is missing: the tests need the shared assets beside the checkout")
    return ASSETS

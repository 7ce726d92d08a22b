"""Tests run on the CPU with 8 virtual devices; this must be set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# The shared assets live beside the checkout (../shared/assets); JAXRLHF_ASSETS points elsewhere.
ASSETS = Path(os.environ.get("JAXRLHF_ASSETS", Path(__file__).resolve().parents[2] / "shared" / "assets"))


@pytest.fixture(scope="session")
def assets() -> Path:
    """../shared/assets (real tokenizer and data); see its README."""
    if not ASSETS.is_dir():
        pytest.fail(f"{ASSETS} is missing: the tests need ../shared/assets beside the checkout (or set JAXRLHF_ASSETS)")
    return ASSETS


@pytest.fixture(scope="module", autouse=True)
def _fresh_jit_caches():
    """Drop JAX's compiled programs after each test file, so that one process does not hold the whole suite's
    thousands. With all of them kept, XLA's CPU compiler crashed with a segmentation fault (in
    backend_compile_and_load, compiling test_train.py's reward-model evaluation after ~280 tests) in three runs of
    the whole suite once tests/test_llama.py traced one more generation; each file alone passed."""
    yield
    import jax

    jax.clear_caches()

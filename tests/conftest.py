"""Tests run on the CPU with 8 virtual devices; this must be set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The entry points keep compiled programs in ~/.cache/jaxrlhf/xla (jaxrlhf.compile_cache): never from the tests, which
# (and the processes they start) run without it unless a test gives its own folder.
os.environ["JAXRLHF_COMPILE_CACHE"] = "off"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# Real files (OPT's tokenizer, HH-RLHF and GSM8K rows, the stories260K model) in one folder: ../shared/assets beside
# the checkout (as CI has it), or JAXRLHF_ASSETS=DIR. Without it, the tests that need them are skipped.
ASSETS = Path(os.environ.get("JAXRLHF_ASSETS", Path(__file__).resolve().parents[2] / "shared" / "assets"))


@pytest.fixture(scope="session")
def assets() -> Path:
    """The real assets' folder (see its README); skips the test where it is absent."""
    return need_assets()


#: where a user finds the real files: their public sources, and the path each goes to
ASSET_SOURCES = "docs/usage.md#real-assets-for-tests-and-demos"


def need_assets() -> Path:
    """ASSETS, or a skip whose one sentence says what is missing and where to get it."""
    if not ASSETS.is_dir():
        pytest.skip(
            f"needs the real assets (OPT's tokenizer, HH-RLHF, GSM8K, stories260K): {ASSETS} is missing; get them "
            f"from their public sources ({ASSET_SOURCES}) and put them there or set JAXRLHF_ASSETS=DIR"
        )
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


# Under pytest-xdist (`-n 2 --dist loadgroup --no-loadscope-reorder`, pyproject's addopts) each test file is one
# unit of work, so its module fixtures are built once, in one worker; the three long learning tests, which share no
# fixture with the rest of their file, are units of their own. The workers take the units in collection order:
# the longest first (seconds measured on a 2-core CPU), so that the two finish close together.
ALONE = (
    "tests/test_readme.py::test_readme_commands_run",
    "tests/test_llama_stories.py::test_stories_preset_raises_the_gold_reward_over_the_step1_model",
    "tests/test_ppo.py::test_the_builtin_pipeline_aligns",
    "tests/test_train.py::test_reward_model_learns_the_builtin_preferences",
)
LONGEST_FIRST = ALONE + (
    "tests/test_train.py",
    "tests/test_multiprocess.py",
    "tests/test_engine.py",
    "tests/test_plan.py",
    "tests/test_ppo.py",
    "tests/test_eval.py",
    "tests/test_lora.py",
    "tests/test_llama.py",
)


def _group(item) -> str:
    nodeid = item.nodeid.split("@")[0]
    return nodeid if nodeid in ALONE else nodeid.split("::")[0]


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))


class _LongestFirst:
    @pytest.hookimpl(trylast=True)  # after pytest's own ordering
    def pytest_collection_modifyitems(self, items):
        rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(_group(item), len(rank)))  # stable: the rest keep their order


def pytest_configure(config):
    config.pluginmanager.register(_LongestFirst(), "jaxrlhf-longest-first")


# Tests write under tmp_path, never into the checkout: the entry points' default output folders are relative
# (runs/sft, runs/ppo), so a test that leaves output_dir out, or a refused run that leaves its folder behind, would
# fill the checkout's runs/. The session (xdist's controller, or a plain run) fails if runs/ gained files.
RUNS = Path(__file__).resolve().parents[1] / "runs"
_RUNS_KEY = pytest.StashKey[set]()


def _runs_files() -> set[Path]:
    return {p for p in RUNS.rglob("*") if not p.is_dir()} if RUNS.is_dir() else set()


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):
        session.config.stash[_RUNS_KEY] = _runs_files()


def pytest_sessionfinish(session, exitstatus):
    before = session.config.stash.get(_RUNS_KEY, None)
    if before is None or hasattr(session.config, "workerinput"):
        return
    if new := sorted(str(p.relative_to(RUNS.parent)) for p in _runs_files() - before):
        print(f"\nthe tests wrote into the checkout (give them an output_dir under tmp_path): {', '.join(new)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

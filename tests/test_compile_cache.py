"""JAX's persistent compilation cache (jaxrlhf.compile_cache): where it is, how it is turned off, and that a second run
of an entry point in a new output folder takes every compiled program from it."""

from pathlib import Path

import jax
import pytest

from jaxrlhf import compile_cache
from jaxrlhf.sft import main as sft_main
from jaxrlhf.train import builtin_model


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"XDG_CACHE_HOME": "/xdg"}, Path("/xdg/jaxrlhf/xla")),
        ({}, Path.home() / ".cache" / "jaxrlhf" / "xla"),
        ({"JAXRLHF_COMPILE_CACHE": "/moved", "XDG_CACHE_HOME": "/xdg"}, Path("/moved")),
        ({"JAX_COMPILATION_CACHE_DIR": "/jax"}, Path("/jax")),  # JAX's own setting, where ours is not given
        ({"JAXRLHF_COMPILE_CACHE": "~/c", "JAX_COMPILATION_CACHE_DIR": "/jax"}, Path.home() / "c"),
        ({"JAXRLHF_COMPILE_CACHE": "off"}, None),
        ({"JAXRLHF_COMPILE_CACHE": ""}, None),
        ({"JAXRLHF_COMPILE_CACHE": "OFF", "JAX_COMPILATION_CACHE_DIR": "/jax"}, None),
    ],
)
def test_the_folder_is_in_the_users_cache_and_can_be_moved_or_turned_off(environ, expected):
    assert compile_cache.folder(environ) == expected


@pytest.fixture
def cache_events():
    """How many compiles asked the persistent cache, and how many it answered, since the test began."""
    counts = {"/jax/compilation_cache/compile_requests_use_cache": 0, "/jax/compilation_cache/cache_hits": 0}

    def listener(event, **_):
        if event in counts:
            counts[event] += 1

    jax.monitoring.register_event_listener(listener)
    yield counts
    jax.monitoring.unregister_event_listener(listener)
    compile_cache.enable({"JAXRLHF_COMPILE_CACHE": "off"})  # the rest of the session runs without it, as before


def entries(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*-cache")} if folder.is_dir() else set()


def test_a_second_run_in_a_new_folder_compiles_nothing(tmp_path, monkeypatch, cache_events):
    """`python -m jaxrlhf.sft` twice, into two new output folders with one cache folder: the first run writes every
    program it compiles (the small ones too: JAX's default keeps only those of a second or more), the second reads
    them all back and writes nothing. jax.clear_caches() between the runs leaves the second with what a new process
    has in memory: nothing compiled."""
    cache = tmp_path / "xla"
    monkeypatch.setenv("JAXRLHF_COMPILE_CACHE", str(cache))
    model = builtin_model(tmp_path / "model", seed=0)
    args = ["max_steps=2", "log_every=1", "batch_size=8", "sample_prompts=1", "sample_tokens=4"]
    args += ["data.data_path=[synthetic:200]", "data.max_seq_len=32", f"data.cache_dir={tmp_path / 'data'}"]
    for run in ("first", "second"):
        jax.clear_caches()
        before = (entries(cache), dict(cache_events))
        sft_main([f"model={model}", f"output_dir={tmp_path / run}", *args])
        asked, hits = (cache_events[k] - before[1][k] for k in before[1])
        if run == "first":
            assert asked > 0 and hits == 0 and len(entries(cache)) == asked, (asked, hits, len(entries(cache)))
    assert entries(cache) == before[0]  # the second run wrote nothing new
    assert asked == hits > 0, (asked, hits)  # and found every program it asked for


def test_enable_takes_effect_after_something_compiled(tmp_path, cache_events):
    """JAX decides whether it uses the cache, and where, at its first compile: a notebook that compiled before it
    calls an entry point's main (or moves the folder) still gets the folder it names from then on."""
    compile_cache.enable({"JAXRLHF_COMPILE_CACHE": "off"})
    jax.jit(lambda x: x * 3.0)(1.0)
    for name in ("a", "b"):
        compile_cache.enable({"JAXRLHF_COMPILE_CACHE": str(tmp_path / name)})
        jax.jit(lambda x, k=float(ord(name)): x * k)(2.0)  # another program each time
        assert [p.name.split("-")[0] for p in (tmp_path / name).glob("*-cache")] == ["jit__lambda"]

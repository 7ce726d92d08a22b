"""JAX's persistent compilation cache, on for every entry point: a second start reuses the compiled programs.

Every entry point (config.parse_cli) calls `enable` before anything compiles. The compiled programs (XLA executables,
keyed by JAX on the program, the devices, the compile options and the versions) go to

    JAXRLHF_COMPILE_CACHE=DIR    if set ("off" or "" turns the cache off), else
    JAX_COMPILATION_CACHE_DIR    if set (JAX's own setting), else
    $XDG_CACHE_HOME/jaxrlhf/xla  (~/.cache/jaxrlhf/xla without XDG_CACHE_HOME).

The folder only ever holds what JAX wrote there: deleting it is safe (the next start compiles again). Every program is
kept, however small or quick to compile (JAX's defaults keep only those that took a second or more): on two CPU cores
the built-in task's many small programs are most of its start.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

ENV = "JAXRLHF_COMPILE_CACHE"
OFF = ("", "off", "none", "false", "0")
# JAX's thresholds, each set unless its own environment variable is: keep every program (see the module docstring).
THRESHOLDS = {"jax_persistent_cache_min_compile_time_secs": 0.0, "jax_persistent_cache_min_entry_size_bytes": -1}


def folder(environ=os.environ) -> Path | None:
    """The cache folder that `environ` names (see the module docstring), or None where it turns the cache off."""
    value = environ.get(ENV, environ.get("JAX_COMPILATION_CACHE_DIR"))
    if value is None:
        return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxrlhf" / "xla"
    return None if value.strip().lower() in OFF else Path(value).expanduser()


def enable(environ=os.environ) -> Path | None:
    """Turn JAX's persistent compilation cache on in `folder(environ)` (or off); returns the folder. Called after
    something compiled already (a notebook), it still takes effect for what compiles next."""
    path = folder(environ)
    jax.config.update("jax_enable_compilation_cache", path is not None)
    if path is not None:
        jax.config.update("jax_compilation_cache_dir", str(path))
        for name, value in THRESHOLDS.items():
            if name.upper() not in environ:
                jax.config.update(name, value)
    compilation_cache.reset_cache()  # JAX decides whether the cache is used once, at the first compile: decide again
    return path

"""A hook around the package's compiled programs: how a caller sees each one start, without patching anything.

    @hooks.program                       # on a jitted function that runs at the top level (never inside a trace)
    @functools.partial(jax.jit, ...)
    def step(...): ...

    with hooks.watching(callback):       # callback(fn, args, kwargs) before each program starts, in this context
        engine.train_rlhf(...)

jaxrlhf.plan.measure watches Step 3's programs (generation, the generation copy's layers, scoring, the steps) to add
each one's own temporaries (`fn.lower(*args, **kwargs).compile().memory_analysis()`) to the arrays alive when it
starts: the CPU reports no memory figures of its own. Outside `watching` a program costs one context-variable read.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from typing import Any

Callback = Callable[[Any, tuple, dict], None]  # (the jitted function, its args, its kwargs)
_callback: contextvars.ContextVar[Callback | None] = contextvars.ContextVar("jaxrlhf_program_callback", default=None)


class Program:
    """A jitted function that reports each call to the `watching` callback, if any, before it runs. Everything else
    (lower, trace, eval_shape, ...) is the jitted function's own."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if (callback := _callback.get()) is not None:
            callback(self.fn, args, kwargs)
        return self.fn(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fn, name)


def program(fn) -> Program:
    """`fn` (a jitted function) as a Program: seen by `watching`."""
    return Program(fn)


@contextlib.contextmanager
def watching(callback: Callback):
    """Call `callback(fn, args, kwargs)` before each `program` starts inside this context."""
    token = _callback.set(callback)
    try:
        yield
    finally:
        _callback.reset(token)

"""The readers of user input under fuzzing (tools/fuzz.py holds the mutations and the oracle): every mutated data
file, config file and checkpoint folder either loads, and passes the oracle's checks, or raises our InputError with
one line naming it. A raw traceback, a multi-line message or an invalid input accepted fails. `python tools/fuzz.py`
runs thousands."""

import pytest

from jaxrlhf.config import ConfigError
from tools import fuzz

CASES = 400  # of each kind, seeded: the same cases every run


@pytest.mark.parametrize("kind", ["data", "config", "checkpoint"])
@pytest.mark.slow
def test_mutated_inputs_load_or_raise_our_one_line_error(kind, assets):
    tally = fuzz.run([kind], CASES, seed=0, assets=assets)[kind]
    shown = "\n\n".join(f"{case}\n{detail}" for case, detail in tally.failures[:3])
    assert not tally.failures, f"{kind}: {tally}\n{shown}"
    assert tally.cases == CASES
    # The mutations reach both outcomes, so the oracle sees inputs that load as well as inputs that must not.
    assert tally.loaded >= CASES // 20 and tally.refused >= CASES // 3, str(tally)


def test_the_oracle_refuses_tracebacks_vague_messages_and_accepted_invalid_inputs():
    tally = fuzz.Tally()

    def raising(e):
        def load():
            raise e

        return load

    fuzz.judge(tally, "raw", ["x.yaml"], raising(KeyError("k")), lambda r: None)
    fuzz.judge(tally, "two lines", ["x.yaml"], raising(ConfigError("x.yaml: bad\nvalue")), lambda r: None)
    fuzz.judge(tally, "unnamed", ["x.yaml"], raising(ConfigError("bad value")), lambda r: None)
    fuzz.judge(tally, "invalid", ["x.yaml"], lambda: float("nan"), lambda r: "nan accepted")
    fuzz.judge(tally, "refused", ["x.yaml"], raising(ConfigError("x.yaml:3: bad value")), lambda r: None)
    fuzz.judge(tally, "loaded", ["x.yaml"], lambda: 1.0, lambda r: None)
    assert (tally.loaded, tally.refused) == (1, 1)
    assert [case for case, _ in tally.failures] == ["raw", "two lines", "unnamed", "invalid"]
    assert "KeyError: 'k'" in tally.failures[0][1] and tally.failures[3][1] == "accepted an invalid input: nan accepted"


def test_mutations_are_seeded():
    import numpy as np

    a, b = (fuzz.mutate_bytes(np.random.default_rng([0, k]), b"model: x\nbatch_size: 16\n") for k in (5, 5))
    assert a == b
    tree = {"a": [1, {"b": "c"}], "d": 2.0}
    assert fuzz.mutate_tree(np.random.default_rng(3), tree) == fuzz.mutate_tree(np.random.default_rng(3), tree)
    assert tree == {"a": [1, {"b": "c"}], "d": 2.0}  # the seed input is not changed

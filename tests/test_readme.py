"""Every command of README.md and every usage line of configs/*.yaml runs; docs/usage.md's commands parse.

The README's ```bash blocks run in order, in one scratch folder (a later example reads an earlier one's outputs),
on CPU JAX. Two kinds of change are made to a command before it runs:
- STAND_INS: a path that stands for something a CPU test does not have (`/data/opt-1.3b`, a Hugging Face folder of
  a real model) becomes a tiny one that an earlier example wrote (the built-in run's Step 1 model);
- SHRINK: overrides appended to a long command, only ones that make it smaller (steps, batch, lengths, prompts).
The ```python block runs as a script on 8 virtual devices. The ```sh block (GPU benchmarks) and the install lines are
checked as text: each tool and flag exists, each pip extra is in pyproject.toml.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import ASSET_SOURCES, ASSETS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# What a CPU test puts in place of a real model folder: the built-in run's outputs (written by the README's
# first command, `python -m jaxrlhf.train`, into the scratch folder's runs/train).
STAND_INS = {
    "/data/opt-1.3b": "runs/train/actor-models/model",
    "/data/opt-350m": "runs/train/reward-models/model",
    "PATH/TO/opt-1.3b": "runs/train/actor-models/model",
    "PATH/TO/opt-350m": "runs/train/reward-models/model",
    "OUT/": "runs/train/",
    "../shared/assets": str(ASSETS),
}
# The built-in task at the built-in models' 64 positions, for commands whose config names hub datasets.
TINY_DATA = ["data.data_path=[synthetic:6000]", "data.max_seq_len=32", "data.max_prompt_len=24"]
STEP = ["max_steps=2", "batch_size=8", "eval_batches=1"]
SHRINK = {
    "jaxrlhf.train": [
        "sft.max_steps=40",
        "reward.max_steps=20",
        "ppo.max_steps=2",
        "eval_prompts=16",
        "eval_samples=1",
    ],
    "jaxrlhf.train --actor-model": TINY_DATA
    + [
        "sft.max_steps=2",
        "sft.batch_size=8",
        "reward.max_steps=2",
        "reward.batch_size=8",
        "ppo.max_steps=1",
        "ppo.batch_size=8",
        "ppo.max_answer_len=8",
        "eval_prompts=8",
        "eval_samples=1",
    ],
    "jaxrlhf.train configs/train.yaml": TINY_DATA
    + [
        "sft.max_steps=2",
        "sft.batch_size=8",
        "reward.max_steps=2",
        "reward.batch_size=8",
        "ppo.max_steps=1",
        "ppo.batch_size=8",
        "ppo.max_answer_len=8",
        "eval_prompts=8",
        "eval_samples=1",
        "output_dir=runs/train-config",
    ],
    "jaxrlhf.train configs/stories.yaml": [
        "sft.max_steps=5",
        "reward.max_steps=5",
        "ppo.max_steps=1",
        "eval_prompts=8",
        "eval_samples=1",
    ],
    "jaxrlhf.sft": TINY_DATA + STEP,
    "jaxrlhf.reward": TINY_DATA + STEP,
    # jaxrlhf.dpo runs as written (a minute): the test checks that it learns
    "jaxrlhf.ppo": TINY_DATA + ["max_steps=1", "batch_size=8", "max_answer_len=8"],
    "jaxrlhf.eval": ["num_prompts=16", "ppl_rows=16", "rm_pairs=16"],
    "jaxrlhf.eval configs/eval.yaml": TINY_DATA
    + ["max_answer_len=8", "num_prompts=16", "ppl_rows=16", "rm_pairs=16", "output_dir=runs/eval-config"],
}
STORIES = {"jaxrlhf.convert", "jaxrlhf.stories", "jaxrlhf.data.stories"}  # the stories260K example: needs the assets
STDIN = {"jaxrlhf.chat": "Sort these letters: c a b\nclear\nquit\n"}


def fenced(text: str, lang: str) -> list[str]:
    """The bodies of the ```LANG blocks of a Markdown text."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def commands(block: str) -> list[list[str]]:
    """Shell words of each command in a block: continuation lines joined, comments and blank lines dropped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(words)
    return out


def usage_lines(config: Path) -> list[list[str]]:
    """The commands in a config's header comment (`# python -m ...`, continued with a trailing backslash)."""
    header = []
    for line in config.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    text = "\n".join(header).replace("\\\n", " ")
    return [shlex.split(line.split("[key=value")[0]) for line in text.splitlines() if line.startswith("python -m ")]


def prepare(words: list[str]) -> tuple[list[str], str | None]:
    """A README command as this test runs it: stand-ins put in, shrinking overrides appended, its stdin."""
    words = [_stand_in(w) for w in words]
    assert words[:2] == ["python", "-m"], f"not a `python -m` command: {shlex.join(words)}"
    module, rest = words[2], words[3:]
    yaml = [w for w in rest if w.endswith(".yaml")]
    keys = ([f"{module} {yaml[0]}"] if yaml else []) + ([f"{module} {rest[0]}"] if rest else []) + [module]
    extra = next((SHRINK[k] for k in keys if k in SHRINK), [])
    given = {w.split("=", 1)[0] for w in rest if "=" in w and not w.startswith("-")}
    extra = [e for e in extra if e.split("=", 1)[0] not in given]  # the command's own value stays
    return [sys.executable, "-m", module, *rest, *extra], STDIN.get(module)


def _stand_in(word: str) -> str:
    for old, new in STAND_INS.items():
        word = word.replace(old, new)
    return word


def run(argv: list[str], cwd: Path, stdin: str | None = None, env: dict | None = None, timeout: int = 1500):
    # as a user runs it: CPU JAX with its one device (not the 8 that tests/conftest.py gives this process)
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu", **(env or {})}
    done = subprocess.run(argv, cwd=cwd, input=stdin, capture_output=True, text=True, env=env, timeout=timeout)
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-30:])
    assert done.returncode == 0, f"`{shlex.join(argv[1:])}` (in {cwd}) exited {done.returncode}:\n{tail}"
    return done


def readme_commands() -> list[list[str]]:
    return [c for block in fenced(README.read_text(), "bash") for c in commands(block)]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A folder to run in: configs/ linked in, runs/ written there."""
    folder = tmp_path_factory.mktemp("readme")
    (folder / "configs").symlink_to(ROOT / "configs")
    return folder


def test_install_lines_name_extras_that_exist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    text = README.read_text()
    named = re.findall(r"pip install -e '\.\[([a-z,]+)\]'", text)
    assert "cuda" in {n for group in named for n in group.split(",")}, "the README documents no GPU install"
    for group in named:
        for name in group.split(","):
            assert name in extras, f"README installs the extra {name!r}; pyproject.toml has {sorted(extras)}"
    assert "python3.12 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python -m jaxrlhf.train" in text


def test_gpu_commands_name_tools_and_flags_that_exist():
    """The benchmark commands (```sh in the README and docs/benchmarks.md) run on the GPU machine only: each tool
    exists and takes each flag."""
    checked = 0
    pages = (README, ROOT / "docs" / "benchmarks.md")
    for block in (b for page in pages for b in fenced(page.read_text(), "sh")):
        for words in commands(block):
            tools = [w for w in words if w.startswith("tools/") and w.endswith(".py")]
            if not tools:
                continue
            source = (ROOT / tools[0]).read_text()
            for flag in (w for w in words if w.startswith("--")):
                assert f'"{flag}"' in source, f"{tools[0]} takes no {flag} (README: {shlex.join(words)})"
            checked += 1
    assert checked >= 20


def config_commands() -> list[list[str]]:
    """The configs' usage lines that are not already README commands."""
    readme = {shlex.join(c) for c in readme_commands()}
    lines = [w for config in sorted((ROOT / "configs").glob("*.yaml")) for w in usage_lines(config)]
    return [w for w in lines if shlex.join(w) not in readme]


def test_every_config_has_a_usage_line():
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        lines = usage_lines(config)
        assert lines, f"{config.name}: no usage line (`# python -m jaxrlhf.... {config.relative_to(ROOT)} ...`)"
        assert any(f"configs/{config.name}" in w for w in lines), (config.name, [shlex.join(w) for w in lines])


@pytest.mark.slow
def test_readme_commands_run(scratch):
    """Every ```bash command of the README in order, then the configs' own usage lines, in one scratch folder."""
    ran = []
    for words in readme_commands() + config_commands():
        if words[:2] != ["python", "-m"]:
            continue  # the install lines: test_install_lines_name_extras_that_exist
        if not ASSETS.is_dir() and (words[2] in STORIES or "configs/stories.yaml" in words):
            continue  # the stories260K example needs the shared assets (checked below)
        argv, stdin = prepare(words)
        run(argv, scratch, stdin)
        ran.append(words[2])
    assert (scratch / "runs/train/step3-models/actor/config.json").is_file()
    assert "win rate" in (scratch / "runs/eval/report.md").read_text()
    # The DPO example learns after the quick start: its implicit reward ranks held-out pairs (0.5 at the start).
    dpo = [json.loads(line) for line in (scratch / "runs/dpo/metrics.jsonl").read_text().splitlines()]
    assert [r for r in dpo if r["split"] == "eval"][-1]["accuracy"] > 0.8
    report = json.loads((scratch / "runs/eval-dpo/report.json").read_text())
    assert report["reward"]["weights"] == {"jaxrlhf.rewards:synthetic": 1.0} and report["reward_model"]["path"] is None
    assert {
        "jaxrlhf.train",
        "jaxrlhf.sft",
        "jaxrlhf.reward",
        "jaxrlhf.ppo",
        "jaxrlhf.eval",
        "jaxrlhf.chat",
        "jaxrlhf.plan",
        "jaxrlhf.inspect",
        "jaxrlhf.data",
    } <= set(ran)
    if not ASSETS.is_dir():
        pytest.skip(f"the stories260K example did not run: {ASSETS} is missing (its sources: {ASSET_SOURCES})")
    assert "jaxrlhf.convert" in ran and STORIES & set(ran) - {"jaxrlhf.convert"}


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 8])
def test_readme_python_example_runs(scratch, devices):
    """As a user runs it on one CPU device (no tensor parallelism), and on 8 (the generation layout split over 2)."""
    (block,) = fenced(README.read_text(), "python")
    script = scratch / "readme_example.py"
    script.write_text(block)
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"} if devices > 1 else {}
    done = run([sys.executable, str(script)], scratch, env=env)
    assert "(4, 4, 50272) (4, 8)" in done.stdout
    q_proj = next(line for line in done.stdout.splitlines() if line.startswith("decoder/layers/self_attn/q_proj/"))
    assert ("'model'" in q_proj) == (devices > 1), q_proj  # the generation layout: q's columns over "model"


NOTEBOOK = ROOT / "docs" / "sharding.ipynb"


def test_sharding_notebook_is_committed_executed():
    cells = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    assert cells and all(c["outputs"] and c["execution_count"] for c in cells), "docs/sharding.ipynb: run it and save"
    assert not [o for c in cells for o in c["outputs"] if o["output_type"] == "error"]


@pytest.mark.slow
def test_sharding_notebook_runs():
    """docs/sharding.ipynb runs top to bottom and still shows what its text says. To re-execute it in place:

    import nbformat, nbclient
    nb = nbformat.read("docs/sharding.ipynb", 4)
    nbclient.NotebookClient(nb, resources={"metadata": {"path": "docs"}}).execute()
    nbformat.write(nb, "docs/sharding.ipynb")
    """
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "fsdp -> tp: {'all-gather': 20, 'all-to-all': 0, 'collective-permute': 0, 'all-reduce': 0}" in text
    assert "tp -> fsdp: {'all-gather': 0, 'all-to-all': 0, 'collective-permute': 0, 'all-reduce': 0}" in text
    assert "round trip exact: True" in text
    assert "(8, 16, 64) float32 P(('data', 'model'),)" in text


def test_links_in_the_docs_point_to_files_that_exist():
    """Every relative link of README.md, bench/README.md and docs/*.md names a file of the repository."""
    pages = [README, ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+://", target) and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, "\n".join(missing)


def test_a_test_without_the_assets_says_where_to_get_them(monkeypatch, tmp_path):
    """A test that needs the real files skips with one sentence naming the folder and the docs section that gives
    every file's public source; that section names every file of the assets folder (where it is here)."""
    import conftest

    monkeypatch.setattr(conftest, "ASSETS", tmp_path / "missing")
    with pytest.raises(pytest.skip.Exception) as skipped:
        conftest.need_assets()
    message = str(skipped.value)
    assert f"{tmp_path / 'missing'} is missing" in message and ASSET_SOURCES in message and message.count(". ") == 0
    page, anchor = ASSET_SOURCES.split("#")
    sections = re.split(r"^## ", (ROOT / page).read_text(), flags=re.M)
    slug = lambda title: re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")  # noqa: E731 (GitHub's anchors)
    (section,) = [s for s in sections if slug(s.splitlines()[0]) == anchor]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) == 5 and all("https://" in row for row in rows if "computed from" not in row)
    files = [p for p in ASSETS.rglob("*") if p.is_file() and p.suffix != ".md"] if ASSETS.is_dir() else []
    assert all(f"{p.name}`" in section for p in files), [p.name for p in files if f"{p.name}`" not in section]


# The entry points whose settings a docs command gives (convert and stories take paths only: the README runs them).
PARSED = ["sft", "reward", "dpo", "ppo", "eval", "chat", "inspect", "train", "data.__main__", "plan"]


def docs_commands() -> list[list[str]]:
    """docs/usage.md's `python -m jaxrlhf.X ...` commands (a `PYTHONPATH=.` or `srun ...` prefix dropped), but not
    those with a placeholder (`...`, CONFIG) or another machine's flags (--coordinator-address)."""
    out = []
    for block in fenced((ROOT / "docs" / "usage.md").read_text(), "bash"):
        for words in commands(block):
            if "-m" not in words or not words[words.index("-m") + 1].startswith("jaxrlhf"):
                continue
            words = ["python", *words[words.index("-m") :]]
            if not {"...", "CONFIG", "--coordinator-address"} & set(words):
                out.append(words)
    return out


def test_docs_commands_give_settings_that_exist(monkeypatch, capsys, tmp_path):
    """Every docs/usage.md command's settings and flags parse as its entry point reads them (the names exist, the
    values convert and pass the config's checks): what a renamed or removed setting breaks. The commands are not run
    (their models are /data/... folders); `jaxrlhf.plan` is (it reads no weights)."""
    import importlib

    from jaxrlhf import config

    def parse_only(cls, doc, prog, fn, argv=None, **options):
        try:
            return config.parse_cli(cls, doc.split("\n\n")[0], argv, prog=prog, **options)[0]
        except ValueError as e:
            raise AssertionError(f"docs/usage.md: `{prog} {shlex.join(argv)}`: {e}") from None

    for block in fenced((ROOT / "docs" / "usage.md").read_text(), "python"):  # the user's files (`# my_rewards.py`)
        if name := re.match(r"# (\w+\.py)\n", block):
            (tmp_path / name[1]).write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in PARSED:
        if name != "plan":
            monkeypatch.setattr(importlib.import_module(f"jaxrlhf.{name}"), "run_cli", parse_only)
    parsed = set()
    for words in docs_commands():
        module = words[2].removeprefix("jaxrlhf.")
        module = "data.__main__" if module == "data" else module
        if module not in PARSED:
            continue
        try:
            importlib.import_module(f"jaxrlhf.{module}").main(words[3:])
        except SystemExit:  # plan: a bad setting is one line and exit 2
            raise AssertionError(f"docs/usage.md: `{shlex.join(words)}`: {capsys.readouterr().err}") from None
        parsed.add(module)
    assert set(PARSED) - {"dpo"} <= parsed, parsed

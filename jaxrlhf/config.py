"""Run configuration: frozen dataclasses, filled from a YAML file and then `dotted.key=value` overrides.

    python -m jaxrlhf.<entry> [CONFIG.yaml] [section.field=value ...] [--flags ...]   (in any order)

Unknown keys are errors that name the file and line; values are checked against the field types
before anything is compiled. Each field's help text is the comment `#: ...` on the line above it:
`--help` prints the main settings with it, `--help-all` every setting with its default.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import inspect
import json
import math
import os
import re
import shutil
import sys
import textwrap
import types
import typing
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from jaxrlhf import compile_cache, distributed


class InputError(ValueError):
    """Input that jaxrlhf cannot use (a config, data or checkpoint file): one line that names the file (and line,
    field or tensor), what was expected and what to do. The base of ConfigError, DataError and CheckpointError."""


def one_line(error: object, limit: int = 200) -> str:
    """A library's error message (or any value) as one line of at most `limit` characters, to quote inside ours."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ConfigError(InputError):
    """A configuration that cannot work; the message says where, what was expected and what to do."""


def decode_utf8(data: bytes, path, error=InputError) -> str:
    """`data` read from `path` as strict UTF-8; otherwise `error` naming the file, line and byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise error(f"{path}:{line}: not UTF-8 (byte {data[e.start]:#04x}); save the file as UTF-8") from None


def parse_json(text: str, path, first_line: int = 1, error: type[InputError] = InputError):
    """`text` parsed as JSON; it starts at line `first_line` of `path`, which errors (an `error`) name."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}:{first_line + e.lineno - 1}: invalid JSON ({e.msg})") from None
    except RecursionError:
        raise error(f"{path}:{first_line}: invalid JSON (nested too deeply)") from None


# ---------------------------------------------------------------------------------------------- values

SEED_LIMIT = 2**32  # numpy's and JAX's seeds: a seed outside [0, 2**32) fails (or wraps) only once a run starts


def _holds(value, rule: str) -> bool:
    if rule[0] == ">":
        op, bound = rule.split()
        return value >= float(bound) if op == ">=" else value > float(bound)
    lo, hi = (float(b) for b in rule[1:-1].split(","))
    return (value >= lo if rule[0] == "[" else value > lo) and (value <= hi if rule[-1] == "]" else value < hi)


def check_fields(obj, **rules: str):
    """Validate a config dataclass (call it from `__post_init__`): every float, alone or in a tuple, is finite;
    a field named `seed` lies in [0, 2**32); and each `field=rule` holds, a rule being ">= 1", "> 0", "[0, 1)",
    "(0, 1]" ... (None, an unset optional field, passes). Raises ConfigError naming the field."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        items = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            raise ConfigError(f"{f.name}: expected a finite number, got {value!r}")
        if f.name == "seed" and isinstance(value, int) and not 0 <= value < SEED_LIMIT:
            raise ConfigError(f"seed: expected an integer in [0, 2**32), got {value}")
    for name, rule in rules.items():
        value = getattr(obj, name)
        if value is not None and not all(_holds(v, rule) for v in (value if isinstance(value, tuple) else (value,))):
            raise ConfigError(f"{name}: expected {rule}, got {value!r}")


def field_help(cls) -> dict[str, str]:
    """Help text per field: the `#: ...` comment lines directly above its definition."""
    out, pending = {}, []
    # Base classes first, so a subclass's own comment wins and inherited fields keep theirs.
    lines = [x for c in reversed(cls.__mro__) if dataclasses.is_dataclass(c) for x in inspect.getsource(c).splitlines()]
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        m = re.match(r"(\w+)\s*:", stripped)
        if m and pending:
            out[m.group(1)] = " ".join(pending)
        pending = []
    return out


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Check (and lightly coerce: int or "1e-5" -> float) `value` against the annotation `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        for arg in [a for a in typing.get_args(tp) if a is not type(None)]:
            try:
                return _convert(value, arg, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: expected {tp}, got {value!r}")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: expected one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return tuple(_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is Any:
        return value
    if tp is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:  # YAML 1.1 reads 1e-5 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if (tp in (int, float) and isinstance(value, bool)) or not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def build(cls, values: dict, where: dict[str, str] | None = None, prefix: str = "", default=None):
    """An instance of the (possibly nested) frozen dataclass `cls` from a plain dict.

    `where` maps dotted keys to "file:line" for error messages. A nested section starts from the
    field's own default (e.g. a critic optimizer's learning rate), not from its class's defaults.
    """
    where = where or {}
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        dotted = prefix + key
        loc = where.get(dotted, "<config>")
        if key not in fields:
            close = [f for f in fields if f.startswith(key[:3])]
            hint = f" (did you mean {', '.join(close)}?)" if close else f"; known keys: {', '.join(fields)}"
            raise ConfigError(f"{loc}: unknown key '{dotted}'{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{loc}: '{dotted}' is a section; expected a mapping, got {value!r}")
            base = getattr(default, key) if default is not None else fields[key].default
            kwargs[key] = build(tp, value, where, dotted + ".", None if base is dataclasses.MISSING else base)
        else:
            kwargs[key] = _convert(value, tp, f"{loc}: '{dotted}'")
    try:
        return cls(**kwargs) if default is None else dataclasses.replace(default, **kwargs)
    except (TypeError, ValueError) as e:  # a check across fields failed: point at where this section was set
        loc = where.get(prefix.rstrip(".")) or next((v for k, v in where.items() if k.startswith(prefix)), "<defaults>")
        raise ConfigError(f"{loc}: {prefix.rstrip('.') or cls.__name__}: {e}") from None


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing what would silently change a setting: a key given twice (YAML keeps the
    last), a key that is not a string (`1:`, `on:`, `null:`); a value its constructor cannot build (the date
    2001-13-45) is a YAML error at its line, not a raw ValueError."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key, _ in node.value:
            line, problem = key.start_mark.line + 1, None
            if key.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`
                continue
            if not (isinstance(key, yaml.ScalarNode) and key.tag == "tag:yaml.org,2002:str"):
                problem = f"a key that is not a string ({one_line(key.value, 40)!r}); quote it"
            elif key.value in seen:
                problem = f"'{key.value}' is set twice (lines {seen[key.value]} and {line}); keep one"
            if problem:
                raise yaml.constructor.ConstructorError(None, None, problem, key.start_mark)
            seen[key.value] = line
        return super().construct_mapping(node, deep)

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, OverflowError) as e:
            raise yaml.constructor.ConstructorError(None, None, one_line(e), node.start_mark) from None


def parse_yaml(text: str, source: str, lines: bool = True):
    """(the YAML document in `text`, its node tree); errors are ConfigErrors naming `source` (and, with `lines`,
    the line)."""
    try:
        loader = _StrictLoader(text)  # reads the whole text: refuses control characters here
        try:
            node = loader.get_single_node()
            return (None if node is None else loader.construct_document(node)), node
        finally:
            loader.dispose()
    except yaml.reader.ReaderError as e:
        at = f":{text.count('\n', 0, e.position) + 1}" if lines else ""
        raise ConfigError(
            f"{source}{at}: not valid YAML (character #x{e.character:04x} is not allowed); remove it"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = f":{mark.line + 1}" if mark and lines else ""
        raise ConfigError(f"{source}{line}: not valid YAML ({one_line(getattr(e, 'problem', None) or e)})") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML (nested too deeply)") from None


def _yaml_with_lines(path: Path) -> tuple[dict, dict[str, str]]:
    """The YAML mapping in `path` and, for every dotted key, the "file:line" where it is set."""
    values, node = parse_yaml(decode_utf8(path.read_bytes(), path, ConfigError), str(path))
    if node is None:
        return {}, {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}:1: expected a mapping of config keys at the top level")
    lines: dict[str, str] = {}

    def walk(n, prefix):
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                if isinstance(k, yaml.ScalarNode):
                    lines[prefix + k.value] = f"{path}:{k.start_mark.line + 1}"
                    walk(v, prefix + k.value + ".")

    walk(node, "")
    return values, lines


def set_dotted(tree: dict, dotted: str, value: Any):
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"command line: '{dotted}': '{p}' is not a section")
    tree[leaf] = value


def load(cls, config_file: str | None = None, overrides: list[str] = (), default=None):
    """`cls` filled from its defaults (or the instance `default`), then `config_file` (YAML), then `key=value`
    overrides (YAML values)."""
    values, where = {}, {}
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        values, where = _yaml_with_lines(path)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"command line: '{item}': expected key=value, e.g. mesh.tp=2")
        key, raw = item.split("=", 1)
        value = parse_yaml(raw, f"command line: '{key.strip()}'", lines=False)[0] if raw.strip() else ""
        set_dotted(values, key.strip(), value)
        where[key.strip()] = "command line"
    return build(cls, values, where, default=default)


# ---------------------------------------------------------------------------------------------- command line

# The settings a newcomer sets first: `--help` shows these (where a key recurs, at its shallowest depth) and names the
# sections; `--help-all` shows every setting with its default and help, section by section.
MAIN = (
    "model",
    "path",
    "models",
    "tokenizer",
    "actor_model",
    "reward_model",
    "deployment_type",
    "steps",
    "data_path",
    "prompt",
    "output_dir",
    "batch_size",
    "max_steps",
    "optim.learning_rate",
    "max_new_tokens",
    "beta",
    "loss_type",
    "algorithm",
    "num_samples_per_prompt",
)


def _settings(obj, prefix=""):
    """(section, dotted key, default, help) of every setting of the config `obj`, section by section."""
    doc, nested = field_help(type(obj)), []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            nested.append((value, prefix + f.name + "."))
        else:
            yield prefix[:-1], prefix + f.name, value, doc.get(f.name, "")
    for value, sub in nested:
        yield from _settings(value, sub)


def settings_help(cls, full: bool = False, hidden: tuple[str, ...] = ()) -> str:
    """The settings of `cls` by section: the main ones with one line of help, or (`full`) all with their help; none
    under a key of `hidden` (settings the entry point refuses)."""
    rows, root = list(_settings(cls())), cls.__name__.removesuffix("Config").lower()
    rows = [r for r in rows if not any(r[1] == h or r[1].startswith(h + ".") for h in hidden)]
    main = lambda key: next((m for m in MAIN if key == m or key.endswith("." + m)), None)
    depth = {}
    for _, key, _, _ in rows:
        depth[main(key)] = min(depth.get(main(key), 99), key.count("."))
    shown = rows if full else [r for r in rows if main(r[1]) and r[1].count(".") == depth[main(r[1])]]
    scope = ", by section:" if full else "; the main ones:"
    # argparse's width (the terminal's, or COLUMNS, less 2); lines are broken (--help-all) or shortened (--help, one
    # line a setting) between words only
    width = max(shutil.get_terminal_size().columns - 2, 40)
    whole = dict(break_long_words=False, break_on_hyphens=False)
    wrap = partial(textwrap.fill, width=width, **whole)
    out = [wrap(f"settings (in CONFIG.yaml or as key=value; values are YAML){scope}")]
    for i, (section, key, default, doc) in enumerate(shown):
        if i == 0 or section != shown[i - 1][0]:
            out.append(f" {section or root}:")
        line = f"  {key} = {default!r}"
        if full:
            out.append(line + ("\n" + wrap(doc, initial_indent=" " * 6, subsequent_indent=" " * 6) if doc else ""))
        else:
            short = textwrap.shorten(doc, max(width - max(len(line), 34) - 1, 20), placeholder=" ...", **whole)
            out.append(f"{line:34} {short}" if doc else line)
    if not full:
        count = collections.Counter(section or root for section, *_ in rows)
        more = "every setting (--help-all): " + ", ".join(f"{s} ({n})" for s, n in count.items())
        out.append(wrap(more, subsequent_indent="  "))
    return "\n".join(out)


def parse_cli(
    cls,
    description: str,
    argv: list[str] | None = None,
    prog: str | None = None,
    flags=None,
    preset=None,
    processes: bool = True,
    hidden: tuple[str, ...] = (),
):
    """Parse `[CONFIG.yaml] [key=value ...]` and the options that `flags(parser)` adds, in any order, for the entry
    point whose settings are `cls`: (settings, the parsed options), or a ConfigError. An option whose `dest` is a
    settings key (`dest="data.data_path"`) sets it, before the key=value overrides. `preset(settings)` may give
    defaults to load again on top of (the deployment presets). With `processes`, the multi-process flags
    (`jaxrlhf.distributed`) are read too, and the process joins the others. `hidden`: settings left out of the help
    (the entry point refuses them)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=settings_help(cls, hidden=hidden),
        usage="%(prog)s [options] [CONFIG.yaml] [key=value ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--help-all", action="store_true", help="show every setting, with its default and help")
    parser.add_argument("args", nargs="*", metavar="CONFIG.yaml, key=value", help="settings (the main ones below)")
    if flags:
        flags(parser)
    if processes:
        distributed.add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help-all" in argv:
        parser.epilog, argv = settings_help(cls, full=True, hidden=hidden), ["--help"]
    ns = parser.parse_intermixed_args(argv)
    keys = {key for _, key, _, _ in _settings(cls())}
    setting = lambda a: isinstance(a, str) and ("=" in a or a.endswith((".yaml", ".yml"))) and not Path(a).is_dir()
    for dest, value in vars(ns).items():  # "--models A B key=value": a list-valued option took the overrides
        if isinstance(value, list) and dest != "args":
            stray = [a for a in value if setting(a)]
            setattr(ns, dest, [a for a in value if a not in stray])
            ns.args += stray
    files = [a for a in ns.args if "=" not in a]
    overrides = [f"{k}={json.dumps(v)}" for k, v in vars(ns).items() if k in keys and v is not None]
    overrides += [a for a in ns.args if "=" in a]
    if len(files) > 1:
        raise ConfigError(f"command line: one CONFIG.yaml at most, got {' and '.join(files)}")
    cfg = load(cls, files[0] if files else None, overrides)
    base = preset(cfg) if preset else None
    if base is not None:  # the preset first, then the file and the command line again on top of it
        cfg = load(cls, files[0] if files else None, overrides, default=base)
    compile_cache.enable()  # before anything compiles: a second start reuses the compiled programs
    if processes:
        distributed.initialize(ns.coordinator_address, ns.num_processes, ns.process_id)
    return cfg, ns


# XLA flags the entry points add unless the user already set them (they act only before JAX starts): cuBLAS for every
# GEMM trained OPT-1.3B faster than XLA's Triton GEMMs on the H200.
DEFAULT_XLA_FLAGS = ("--xla_gpu_enable_triton_gemm=false",)


def default_xla_flags():
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in DEFAULT_XLA_FLAGS if f.split("=")[0] not in flags]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()


def remove_unused(folder: Path):
    """Remove `folder` if a refused run left nothing in it but run settings and empty folders (loop.start_run's
    run_config.json, Orbax's state/): a run refused before its first step leaves no output folder behind."""
    files = [f for f in folder.rglob("*") if not f.is_dir()]
    if folder.is_dir() and all(f.name == "run_config.json" for f in files):
        shutil.rmtree(folder, ignore_errors=True)


def run_cli(cls, doc: str, prog: str, fn, argv: list[str] | None = None, **options):
    """An entry point: parse the settings (`options`: parse_cli's flags, preset, processes), run `fn(settings)`, and
    turn a bad input into one line and exit 2."""
    default_xla_flags()
    made = None  # the output folder this run creates, if it is absent now
    try:
        cfg = parse_cli(cls, doc.split("\n\n")[0], argv, prog=prog, **options)[0]
        out = Path(getattr(cfg, "output_dir", None) or ".").absolute()
        made = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)  # the top one to create
        return fn(cfg)
    except ValueError as e:  # ConfigError, DataError, CheckpointError and LayoutError are ValueErrors
        if made is not None:
            remove_unused(made)
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt as e:  # loop.Interrupted has said where the state is (its code: 130 or 143)
        if not hasattr(e, "code"):  # Ctrl-C outside the training loop (loading, compiling, exporting)
            print("interrupted (SIGINT): the same command starts again from the last saved state", file=sys.stderr)
        raise SystemExit(getattr(e, "code", 130)) from None

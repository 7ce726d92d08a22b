"""Hugging Face checkpoint folders in and out, losslessly.

    HF folder                                   jaxrlhf
    config.json (model_type "opt")      <->     OPTConfig     (models/opt.py)
    config.json (model_type "llama")    <->     LlamaConfig   (models/llama.py)
    config.json ("qwen2", "qwen3")      <->     QwenConfig    (models/qwen.py)
    model.safetensors | sharded index   <->     params (the tree drawn in the family's model file)
    | pytorch_model.bin (read only)
    value_head.safetensors              <->     params["value_head"]  (reward model / critic only)
    tokenizer files                     <->     a transformers tokenizer

The family is chosen by config.json's `model_type`. Each family's weights map through its own declarative
table (`HF.modules` in models/opt.py, models/llama.py, models/qwen.py): HF module name -> our path and kind.
Linear weights are transposed ([out, in] -> [in, out]); per-layer tensors are stacked on a leading [L] axis. Every
tensor's shape is checked, and a missing or unused tensor is an error that names it.

The value head is stored outside model.safetensors, in `value_head.safetensors` under the key
`v_head.weight` with shape [1, E] (DeepSpeed-Chat's name and PyTorch's Linear layout), so that
`transformers.AutoModelForCausalLM.from_pretrained` loads a saved reward model or critic as a plain
OPT language model without warnings, and jaxrlhf loads it back with its head.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import jax
import numpy as np

from jaxrlhf.config import ConfigError, InputError, build, decode_utf8, one_line, parse_json
from jaxrlhf.models import CONFIGS, HF_NAMES, Backend, LlamaConfig, OPTConfig, QwenConfig, param_shapes

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_HEAD_KEY = "v_head.weight"

_FORMATS = HF_NAMES
_TENSORS = {  # kind -> [(HF tensor suffix, our leaf name, transpose)]
    "embed": [("weight", "embedding", False)],
    "linear": [("weight", "kernel", True), ("bias", "bias", False)],
    "norm": [("weight", "scale", False), ("bias", "bias", False)],
}
# config.json settings that each family's model implements in one way only: written so, and refused otherwise.
_FIXED = {
    "llama": {"hidden_act": "silu"},
    **{qwen: {"hidden_act": "silu", "use_sliding_window": False} for qwen in ("qwen2", "qwen3")},
    "opt": {"activation_function": "relu", "layer_norm_elementwise_affine": True, "tie_word_embeddings": True},
}


class CheckpointError(InputError):
    """A checkpoint folder that jaxrlhf cannot use; the message names the file and the problem."""


# ----------------------------------------------------------------------------------------------- config


def config_from_hf(hf: dict, source: str = "config.json", **overrides):
    """Our config (OPTConfig, LlamaConfig or QwenConfig, by `model_type`) from an HF config dict; refuses other model
    types and options we do not implement; every value is checked against the config's field types."""
    if not isinstance(hf, dict):
        raise CheckpointError(
            f"{source}: expected a JSON object of settings, got {type(hf).__name__}; "
            "restore the config.json the model was saved with"
        )
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in _FORMATS:
        raise CheckpointError(
            f"{source}: model_type is {model_type!r}; jaxrlhf supports {' and '.join(map(repr, _FORMATS))} checkpoints"
        )
    fmt = _FORMATS[model_type]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{source}: rope_parameters / rope_scaling is {one_line(rope, 60)}; expected an object")
    unsupported = {key: (hf.get(key, want), want) for key, want in _FIXED[model_type].items()}
    if model_type != "opt":  # no RoPE scaling (yet)
        unsupported["rope type"] = (rope.get("rope_type", rope.get("type", "default")), "default")
    if any(kind != "full_attention" for kind in hf.get("layer_types") or ()):  # Qwen2's sliding-window layers
        unsupported["layer_types"] = (sorted(set(hf["layer_types"])), ["full_attention"])
    for key, (got, want) in unsupported.items():
        if got != want:
            raise CheckpointError(f"{source}: {key} is {got!r}; jaxrlhf's {model_type} supports only {want!r}")
    fields = {ours: hf[theirs] for theirs, ours in fmt.config_keys.items() if hf.get(theirs) is not None}
    if isinstance(fields.get("pad_token_id"), int) and fields["pad_token_id"] < 0:
        del fields["pad_token_id"]  # older Llama conversions wrote -1 for "no padding token"
    if isinstance(fields.get("eos_token_id"), list):  # Llama 3 lists several; we keep the first
        if not fields["eos_token_id"]:
            raise CheckpointError(f"{source}: eos_token_id is an empty list; expected a token id (or a list of them)")
        fields["eos_token_id"] = fields["eos_token_id"][0]
    vocab = fields.get("vocab_size", CONFIGS[model_type].vocab_size)
    for key in ("pad_token_id", "bos_token_id"):  # null or absent, the family's default outside a smaller vocabulary
        if (
            key not in fields
            and isinstance(fields.get("eos_token_id"), int)
            and getattr(CONFIGS[model_type], key) >= vocab
        ):
            fields[key] = fields["eos_token_id"]  # the EOS, as transformers pads with it (a small Qwen made by a user)
    if model_type == "opt":
        fields.setdefault("word_embed_proj_dim", fields.get("hidden_size", OPTConfig.hidden_size))
    else:
        theta = rope.get("rope_theta", hf.get("rope_theta"))
        if theta is not None:
            fields["rope_theta"] = theta
    try:  # types as the config's fields declare them (a string hidden_size, a boolean layer count are refused)
        return build(CONFIGS[model_type], {**fields, **overrides}, dict.fromkeys(fields, source))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def config_to_hf(config, torch_dtype: str) -> dict:
    """The config.json that transformers needs to rebuild `config` as an OPTForCausalLM, LlamaForCausalLM,
    Qwen2ForCausalLM or Qwen3ForCausalLM."""
    fmt = _FORMATS[config.model_type]
    hf = {theirs: getattr(config, ours) for theirs, ours in fmt.config_keys.items()}
    hf.update(model_type=config.model_type, architectures=[fmt.architecture], use_cache=True, dtype=torch_dtype)
    hf.update(_FIXED[config.model_type])
    if config.model_type == "opt":
        hf.update(init_std=0.02, layerdrop=0.0)
    else:
        if config.rope_interleaved:
            raise ValueError(
                "save_hf: Hugging Face's Llama pairs rotary dims (i, i + K/2); these parameters use the "
                "interleaved layout (rope_interleaved=True): permute q/k (see convert.py) first"
            )
        hf.update(
            initializer_range=0.02,
            **({"pretraining_tp": 1} if config.model_type == "llama" else {}),
            rope_theta=config.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        )
    return hf


def resolve(path: str | os.PathLike) -> Path:
    """The folder that `path` names: itself if it is one, never asking the network; a Hugging Face Hub name (`org/name`,
    not a folder here) downloaded into the Hub cache by huggingface_hub, or a CheckpointError saying why not."""
    path = Path(path)
    if path.is_dir() or path.is_absolute() or len(path.parts) != 2 or str(path).startswith("."):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError

    name = path.as_posix()
    files = ["*.json", "*.txt", "tokenizer*"]  # configs and tokenizer files, then the weights
    try:
        folder = Path(snapshot_download(name, allow_patterns=files + ["*.safetensors"]))
        if not any(folder.glob("*.safetensors")):  # PyTorch's .bin only where there are no safetensors
            folder = Path(snapshot_download(name, allow_patterns=files + ["pytorch_model*.bin"]))
        return folder
    except RepositoryNotFoundError:
        raise CheckpointError(f"{name}: no such folder, nor a model on the Hugging Face Hub") from None
    except Exception as e:  # offline (LocalEntryNotFoundError, HF_HUB_OFFLINE=1), unreachable, interrupted
        raise CheckpointError(
            f"{name}: no such folder, and the Hugging Face Hub is unreachable ({one_line(e, 100)}); "
            f"download it where it is reachable (hf download {name} --local-dir DIR) and pass DIR instead"
        ) from None


def read_config(path: str | os.PathLike, **overrides):
    """Our config from `path/config.json` (a folder or a Hub name), with run options (dtype, remat ...) as overrides."""
    path = resolve(path)
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder; expected a Hugging Face checkpoint folder with {CONFIG_FILE}")
    if not file.is_file():
        raise CheckpointError(f"{file}: missing; a Hugging Face checkpoint folder needs its {CONFIG_FILE}")
    return config_from_hf(_read_json(file), str(file), **overrides)


def _read_json(file: Path):
    return parse_json(decode_utf8(file.read_bytes(), file, CheckpointError), file, error=CheckpointError)


# ---------------------------------------------------------------------------------------------- tensors


def _read_safetensors(file: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return load_file(str(file))
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise CheckpointError(
            f"{file}: cannot read safetensors ({one_line(e)}); the file is truncated or corrupt: "
            "download or save it again"
        ) from None


def _read_torch(file: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise CheckpointError(
            f"{file}: reading pytorch_model.bin needs torch (pip install torch), or convert the "
            "folder to safetensors first"
        ) from None
    try:  # weights_only: a pickle that would run code is refused, not run
        state = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - corrupt zip, unpickling, a truncated stream: torch raises all kinds
        raise CheckpointError(
            f"{file}: cannot read a PyTorch state dict ({type(e).__name__}: {one_line(e)}); the file is "
            "truncated or corrupt: download or save it again"
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in state.items()
    ):
        raise CheckpointError(f"{file}: expected a state dict (tensor names to tensors), got {type(state).__name__}")
    out = {}
    for name, t in state.items():
        t = t.detach().contiguous()
        # numpy has no bfloat16: go through its raw bits, reinterpreted by ml_dtypes.
        out[name] = t.view(torch.int16).numpy().view(jax.numpy.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
    return out


def read_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every weight tensor of an HF folder by name: model.safetensors, a sharded index, or pytorch_model.bin."""
    path = Path(path)
    for index, reader in ((path / SAFETENSORS_INDEX, _read_safetensors), (path / TORCH_INDEX, _read_torch)):
        if index.is_file():
            return {name: t for shard in _shard_names(index) for name, t in reader(path / shard).items()}
    for file, reader in ((path / SAFETENSORS_FILE, _read_safetensors), (path / TORCH_FILE, _read_torch)):
        if file.is_file():
            return reader(file)
    raise CheckpointError(
        f"{path}: no weights found; expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX}, {TORCH_FILE} or {TORCH_INDEX}"
    )


def _shard_names(index: Path) -> list[str]:
    """The shard files that a weight index lists: plain file names of files beside it."""
    weight_map = _read_json(index)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f'{index}: not a weight index; expected an object whose "weight_map" maps tensor names to shard files'
        )
    for name, shard in weight_map.items():
        if (
            not isinstance(shard, str)
            or Path(shard).name != shard
            or shard in ("", ".", "..")
            or not shard.isprintable()
        ):
            raise CheckpointError(
                f"{index}: weight_map[{one_line(name, 60)!r}] is {one_line(repr(shard), 60)}; "
                "expected the file name of a shard in the same folder"
            )
        if not (index.parent / shard).is_file():
            raise CheckpointError(f"{index}: lists shard {shard}, which is missing from {index.parent}")
    return sorted(set(weight_map.values()))


# Tracing the model for its shapes takes ~0.1 s; a run loads one config several times (actor, reference, critic,
# reward model), and each load asks twice.
_param_shapes = functools.lru_cache(maxsize=8)(param_shapes)


def _leaf_names(config, with_value_head: bool):
    """Yield (HF tensor name without prefix, our path, layer index or None, transpose) for every leaf."""
    shapes = _param_shapes(config, value_head=False)
    for module, (ours, kind) in _FORMATS[config.model_type].modules.items():
        node = shapes
        for part in ours.split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:  # this variant has no such module (e.g. no project_in in pre-LN models)
            continue
        for suffix, leaf, transpose in _TENSORS[kind]:
            if leaf in node:
                for i in range(config.num_hidden_layers) if "{i}" in module else [None]:
                    yield module.replace("{i}", str(i)) + "." + suffix, f"{ours}/{leaf}", i, transpose
    if with_value_head:
        yield VALUE_HEAD_KEY, "value_head/kernel", None, True


def _set(tree: dict, path: str, value):
    *parents, leaf = path.split("/")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def params_from_tensors(config, tensors: dict[str, np.ndarray], source: str, dtype=None) -> dict:
    """Our parameter tree from HF tensors (names with or without prefix); every tensor is used exactly once."""
    fmt = _FORMATS[config.model_type]
    prefix = next((p for p in fmt.prefixes if f"{p}{fmt.root}" in tensors), None)
    if prefix is None:
        raise CheckpointError(
            f"{source}: missing tensor {fmt.save_prefix}{fmt.root}; is this an {fmt.architecture} checkpoint?"
        )
    tensors = {k.removeprefix(prefix): v for k, v in tensors.items()}
    if config.tie_word_embeddings:
        # A tied LM head may be stored too; it must equal the embedding.
        lm_head = tensors.pop("lm_head.weight", None)
        if lm_head is not None and not np.array_equal(lm_head, tensors[fmt.root]):
            raise CheckpointError(f"{source}: lm_head.weight differs from the embedding, but the config ties them")
    with_value_head = VALUE_HEAD_KEY in tensors
    expected = _param_shapes(config, value_head=with_value_head)
    stacked, params = {}, {}
    for name, path, layer, transpose in _leaf_names(config, with_value_head):
        if name not in tensors:
            raise CheckpointError(f"{source}: missing tensor {name} (needed for {path})")
        value = tensors.pop(name)
        want = _get(expected, path).shape[1 if layer is not None else 0 :]
        want = want[::-1] if transpose else want  # as stored: PyTorch's Linear is [out, in]
        if value.shape != want:
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(value.shape)}, expected {tuple(want)}")
        value = _checked(value.T if transpose else value, name, source, dtype)
        if layer is None:
            _set(params, path, value)
        else:
            stacked.setdefault(path, []).append(value)
    for path, values in stacked.items():
        _set(params, path, np.stack(values))
    if tensors:
        names = ", ".join(sorted(tensors)[:5]) + (" ..." if len(tensors) > 5 else "")
        raise CheckpointError(
            f"{source}: unused tensor(s) {names}; they do not belong to this {fmt.architecture} config"
        )
    return params


def _checked(value: np.ndarray, name: str, source: str, dtype=None) -> np.ndarray:
    """`value` in `dtype` (as stored if None), refused unless it is floating point and finite: integer or boolean
    tensors are not weights, and one NaN or inf makes every logit NaN."""
    if not jax.numpy.issubdtype(value.dtype, jax.numpy.floating):
        raise CheckpointError(
            f"{source}: tensor {name} has dtype {value.dtype}; expected floating-point weights "
            "(float32, float16 or bfloat16): the file is corrupt or not a plain checkpoint"
        )
    with np.errstate(over="ignore"):
        cast = np.ascontiguousarray(value if dtype is None else value.astype(dtype))
        # float64 weights are computed in float32 (or narrower): a value beyond its range is inf there.
        computed = cast if cast.dtype.itemsize <= 4 else cast.astype(np.float32)
    bad = computed.size - np.count_nonzero(np.isfinite(computed))
    if bad:
        cause = f" once cast to {computed.dtype}" if np.isfinite(value).all() else ""
        raise CheckpointError(
            f"{source}: tensor {name} holds {bad} non-finite value(s) (NaN or inf){cause}; the "
            "checkpoint is corrupt or comes from a diverged run: load an earlier one"
        )
    return cast


def _get(tree, path: str):
    for part in path.split("/"):
        tree = tree[part]
    return tree


def params_to_tensors(config, params: dict) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(model tensors with their HF names, value-head tensors) from our parameter tree."""
    prefix = _FORMATS[config.model_type].save_prefix
    params = jax.device_get(params)
    model, head = {}, {}
    for name, path, layer, transpose in _leaf_names(config, "value_head" in params):
        value = np.asarray(_get(params, path))
        value = value[layer] if layer is not None else value
        value = np.ascontiguousarray(value.T if transpose else value)
        if name == VALUE_HEAD_KEY:
            head[name] = value
        else:
            model[prefix + name] = value
    return model, head


# ------------------------------------------------------------------------------------------ load / save


def load_hf(
    path: str | os.PathLike, dtype=None, **config_overrides
) -> tuple[OPTConfig | LlamaConfig | QwenConfig, dict]:
    """Read an HF OPT, Llama, Qwen2 or Qwen3 folder: (config, params as host NumPy arrays in `dtype`, or as stored
    if None).

    The compute dtype of the returned config follows `dtype` (float32 when None). The value head is
    included when the folder has `value_head.safetensors` (a reward model or critic saved by jaxrlhf)
    or a DeepSpeed-Chat `v_head.weight` tensor. `config_overrides` set run options such as `remat=True`; the model
    runs with this machine's backend (models.Backend.detect) unless one is given.
    """
    path = resolve(path)
    config_overrides = {"backend": dataclasses.asdict(Backend.detect()), **config_overrides}
    if dtype is not None:
        config_overrides = {"dtype": np.dtype(dtype).name, **config_overrides}
    config = read_config(path, **config_overrides)
    tensors = read_tensors(path)
    if (path / VALUE_HEAD_FILE).is_file():
        head = _read_safetensors(path / VALUE_HEAD_FILE)
        if set(head) != {VALUE_HEAD_KEY}:
            raise CheckpointError(
                f"{path / VALUE_HEAD_FILE}: expected exactly one tensor {VALUE_HEAD_KEY}, got {sorted(head)}"
            )
        tensors.update(head)
    return config, params_from_tensors(config, tensors, str(path), dtype)


def _shard(tensors: dict[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    shards, current, size = [], {}, 0
    for name, value in tensors.items():
        if current and size + value.nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = value
        size += value.nbytes
    return shards + [current]


# Written last into every folder save_hf makes: it marks the folder as ours (only such folders are ever replaced) and
# complete (the folder is renamed into place with it), and carries what the writer adds (a run's settings).
EXPORT_MANIFEST = "jaxrlhf-export.json"


def export_manifest(path: str | os.PathLike) -> dict | None:
    """The manifest of a folder that save_hf wrote, or None (no such folder, or not one of ours)."""
    try:
        manifest = json.loads((Path(path) / EXPORT_MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def check_replaceable(path: str | os.PathLike):
    """Refuse to write over `path` unless absent, an empty folder (tempfile.mkdtemp's) or a folder that save_hf
    wrote: a user's files are never deleted."""
    path = Path(path)
    empty = path.is_dir() and not any(path.iterdir())
    if path.exists() and not empty and export_manifest(path) is None:
        what = "a file" if not path.is_dir() else f"a folder without {EXPORT_MANIFEST}"
        raise CheckpointError(
            f"{path}: exists and is {what}, so jaxrlhf did not write it and will not replace it; "
            "move it away or choose another output folder"
        )


def save_hf(
    path: str | os.PathLike,
    config: OPTConfig | LlamaConfig | QwenConfig,
    params: dict,
    tokenizer=None,
    *,
    max_shard_bytes: int = 5 * 2**30,
    manifest: dict | None = None,
) -> Path:
    """Write an HF folder that `transformers.AutoModelForCausalLM.from_pretrained(path)` loads.

    Tensors keep the parameters' dtype bit for bit; a tensor with a NaN or inf is refused by name. Models above
    `max_shard_bytes` are written as sharded safetensors with an index. The folder is written beside `path` and
    renamed into place at the end, with EXPORT_MANIFEST (plus `manifest`) as its last file, so a save killed at
    any moment leaves the old folder or the new one, whole. An existing `path` is replaced only if save_hf wrote
    it (check_replaceable).
    """
    from safetensors.numpy import save_file

    path = Path(path)
    model, head = params_to_tensors(config, params)
    dtypes = {np.dtype(x.dtype).name for x in jax.tree.leaves(params)}
    if len(dtypes) != 1:
        raise ValueError(f"save_hf: parameters mix dtypes {sorted(dtypes)}; cast them to one dtype first")
    for name, x in {**model, **head}.items():
        if not np.issubdtype(x.dtype, np.integer) and not np.isfinite(x).all():
            raise CheckpointError(
                f"{path}: tensor {name} holds NaN or inf values; refusing to export it (training "
                "diverged: lower the learning rate or check the data, and train again)"
            )
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in [*path.parent.glob(f".{path.name}.tmp-*"), *path.parent.glob(f".{path.name}.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)  # what a killed save of this folder left behind
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(config_to_hf(config, dtypes.pop()), indent=2) + "\n")
        shards = _shard(model, max_shard_bytes)
        files = {f"model-{n:05d}-of-{len(shards):05d}.safetensors": shard for n, shard in enumerate(shards, 1)}
        if len(shards) > 1:
            weight_map = {tensor: name for name, shard in files.items() for tensor in shard}
            index = {"metadata": {"total_size": sum(v.nbytes for v in model.values())}, "weight_map": weight_map}
            (tmp / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        files = files if len(shards) > 1 else {SAFETENSORS_FILE: model}
        for name, tensors in ((files | {VALUE_HEAD_FILE: head}) if head else files).items():
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        ours = {"written_by": "jaxrlhf", "id": uuid.uuid4().hex, **(manifest or {})}  # id: which save this was
        (tmp / EXPORT_MANIFEST).write_text(json.dumps(ours, indent=2) + "\n")
        # An old `path` (checked again: it may have appeared meanwhile) is removed only once the new one is in place.
        check_replaceable(path)
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        if path.exists():
            os.replace(path, old / path.name)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path

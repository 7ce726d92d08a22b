"""Hugging Face folders in and out: lossless round trips and one-line errors for bad folders."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers import POST_LN_PROJ, PRE_LN, hf_logits, left_padded_batch, make_hf_opt
from jaxrlhf import CheckpointError, load_hf, logits, save_hf
from jaxrlhf.checkpoint import VALUE_HEAD_FILE, read_tensors


@pytest.fixture(params=[PRE_LN, POST_LN_PROJ], ids=["pre_ln", "post_ln_proj"])
def hf_folder(request, tmp_path):
    return make_hf_opt(tmp_path / "hf", **request.param)


@pytest.mark.slow
def test_round_trip_is_bit_identical_and_transformers_loads_it(hf_folder, tmp_path):
    config, params = load_hf(hf_folder)
    out = save_hf(tmp_path / "ours", config, params)
    original, saved = load_file(hf_folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(original) == sorted(saved)
    for name in original:
        assert original[name].dtype == saved[name].dtype
        assert original[name].tobytes() == saved[name].tobytes(), name
    ids, mask = left_padded_batch(config.vocab_size, [7, 2], T=7)
    real = mask.astype(bool)
    np.testing.assert_allclose(hf_logits(out, ids, mask)[real], hf_logits(hf_folder, ids, mask)[real], atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(logits(config, params, ids, mask))[real], hf_logits(out, ids, mask)[real], atol=1e-4
    )
    # And once more through ourselves: load what we saved, save again, same bytes.
    config2, params2 = load_hf(out)
    assert config2 == config
    again = save_hf(tmp_path / "again", config2, params2)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_bfloat16_round_trip(hf_folder, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    config, params = load_hf(hf_folder, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(jnp.bfloat16)}
    out = save_hf(tmp_path / "bf16", config, params)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(hf_folder).to(torch.bfloat16).state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(t, hf[name]), name
    _, params2 = load_hf(out)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_sharded_safetensors_and_pytorch_bin(hf_folder, tmp_path):
    import torch

    config, params = load_hf(hf_folder)
    sharded = save_hf(tmp_path / "sharded", config, params, max_shard_bytes=20_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids, mask = left_padded_batch(config.vocab_size, [5], T=5)
    np.testing.assert_allclose(hf_logits(sharded, ids, mask), hf_logits(hf_folder, ids, mask), atol=1e-6)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(load_hf(sharded)[1])):
        np.testing.assert_array_equal(a, b)

    as_bin = tmp_path / "bin"
    as_bin.mkdir()
    shutil.copy(hf_folder / "config.json", as_bin)
    torch.save(
        {k: torch.from_numpy(v) for k, v in load_file(hf_folder / "model.safetensors").items()},
        as_bin / "pytorch_model.bin",
    )
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(load_hf(as_bin)[1])):
        np.testing.assert_array_equal(a, b)


def test_value_head_round_trip_and_plain_transformers_load(hf_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    config, params = load_hf(hf_folder)
    head = np.arange(config.word_embed_proj_dim, dtype=np.float32)[:, None] / 10
    out = save_hf(tmp_path / "rm", config, {**params, "value_head": {"kernel": head}})
    stored = load_file(out / VALUE_HEAD_FILE)
    np.testing.assert_array_equal(stored["v_head.weight"], head.T)  # PyTorch Linear layout [1, E]
    assert "v_head.weight" not in load_file(out / "model.safetensors")
    AutoModelForCausalLM.from_pretrained(out)  # the LM part loads as a plain OPT
    _, back = load_hf(out)
    np.testing.assert_array_equal(back["value_head"]["kernel"], head)


def test_deepspeed_chat_reward_checkpoint(hf_folder, tmp_path):
    """DeepSpeed-Chat's Step 2 writes OPTModel weights under 'rwtranrsformer.' plus an unprefixed v_head."""
    import torch

    config, params = load_hf(hf_folder)
    ds = tmp_path / "ds"
    ds.mkdir()
    shutil.copy(hf_folder / "config.json", ds)
    state = {
        k.replace("model.", "rwtranrsformer.", 1): torch.from_numpy(v)
        for k, v in load_file(hf_folder / "model.safetensors").items()
    }
    state["v_head.weight"] = torch.ones(1, config.word_embed_proj_dim)
    torch.save(state, ds / "pytorch_model.bin")
    _, loaded = load_hf(ds)
    np.testing.assert_array_equal(loaded["value_head"]["kernel"], 1.0)
    np.testing.assert_array_equal(
        loaded["decoder"]["embed_tokens"]["embedding"], params["decoder"]["embed_tokens"]["embedding"]
    )


def _edit_tensors(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _one_line_error(folder, match):
    with pytest.raises(CheckpointError, match=match) as e:
        load_hf(folder)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_missing_extra_and_misshaped_tensors_are_named(tmp_path):
    folder = make_hf_opt(tmp_path / "hf", **PRE_LN)
    _edit_tensors(folder, lambda t: t.pop("model.decoder.layers.1.fc2.bias"))
    _one_line_error(folder, r"missing tensor decoder\.layers\.1\.fc2\.bias")

    folder = make_hf_opt(tmp_path / "hf2", **PRE_LN)
    _edit_tensors(folder, lambda t: t.update({"model.decoder.layers.0.extra.weight": np.zeros(3, np.float32)}))
    _one_line_error(folder, r"unused tensor\(s\) decoder\.layers\.0\.extra\.weight")

    folder = make_hf_opt(tmp_path / "hf3", **PRE_LN)
    _edit_tensors(folder, lambda t: t.update({"model.decoder.layers.2.fc1.weight": np.zeros((65, 32), np.float32)}))
    msg = _one_line_error(folder, r"decoder\.layers\.2\.fc1\.weight has shape \(65, 32\), expected \(64, 32\)")
    assert str(folder) in msg


def test_bad_configs_are_refused(tmp_path):
    folder = make_hf_opt(tmp_path / "hf", **PRE_LN)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "bloom"}))
    _one_line_error(folder, r"config\.json: model_type is 'bloom'; jaxrlhf supports 'opt' and 'llama'")
    (folder / "config.json").write_text(json.dumps({**cfg, "activation_function": "gelu"}))
    _one_line_error(folder, "activation_function is 'gelu'")
    (folder / "config.json").write_text('{\n  "model_type": "opt",\n  oops\n}')
    _one_line_error(folder, r"config\.json:3: invalid JSON")
    (folder / "config.json").unlink()
    _one_line_error(folder, r"config\.json: missing")
    _one_line_error(tmp_path / "nowhere", "not a folder")


def test_missing_weights_are_refused(tmp_path):
    folder = make_hf_opt(tmp_path / "hf", **PRE_LN)
    (folder / "model.safetensors").unlink()
    _one_line_error(folder, "no weights found")


def test_interrupted_save_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    import safetensors.numpy

    folder = make_hf_opt(tmp_path / "hf", **PRE_LN)
    config, params = load_hf(folder)
    out = save_hf(tmp_path / "ckpt", config, params)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_hf(out, config, jax.tree.map(lambda x: x * 2, params))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]  # no temporary folders left behind


def test_read_tensors_reports_missing_shards(tmp_path):
    folder = make_hf_opt(tmp_path / "hf", **PRE_LN)
    config, params = load_hf(folder)
    out = save_hf(tmp_path / "sharded", config, params, max_shard_bytes=20_000)
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lists shard {shard.name}, which is missing"):
        read_tensors(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny valid folders by name: opt, opt_head (value head), opt_sharded, llama, opt_torch (pytorch_model.bin)."""
    from tools.fuzz import checkpoint_seeds

    return {p.name: p for p in checkpoint_seeds(tmp_path_factory.mktemp("tiny"))}


def _copy(tiny, name, tmp_path):
    return shutil.copytree(tiny[name], tmp_path / name)


def _edit_config(folder, edit):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(cfg)))


@pytest.mark.parametrize(
    "name, edit, message",
    [
        ("opt", lambda c: [c], r"config\.json: expected a JSON object of settings, got list"),  # was AttributeError
        ("opt", lambda c: {**c, "model_type": ["opt"]}, r"config\.json: model_type is \['opt'\]; jaxrlhf supports"),
        ("opt", lambda c: {**c, "hidden_size": "16"}, r"config\.json: 'hidden_size': expected int, got '16'"),
        (
            "opt",
            lambda c: {**c, "num_hidden_layers": True},
            r"config\.json: 'num_hidden_layers': expected int, got True",
        ),
        (
            "opt",
            lambda c: {**c, "num_attention_heads": 0},  # was a ZeroDivisionError
            r"config\.json: OPTConfig: num_attention_heads: expected \[1, 2147483648\), got 0",
        ),
        (
            "opt",
            lambda c: {**c, "word_embed_proj_dim": 2**63},  # was a TypeError deep in JAX's shape arithmetic
            r"config\.json: OPTConfig: word_embed_proj_dim: expected \[1, 2147483648\), got 9223372036854775808",
        ),
        (
            "opt",
            lambda c: {**c, "eos_token_id": 64},
            r"config\.json: OPTConfig: eos_token_id: expected \[0, 64\), got 64",
        ),
        (
            "llama",
            lambda c: {**c, "eos_token_id": []},
            r"config\.json: eos_token_id is an empty list",
        ),  # was IndexError
        (
            "llama",
            lambda c: {**c, "rope_parameters": None, "rope_scaling": "linear"},
            r"config\.json: rope_parameters / rope_scaling is linear; expected an object",
        ),
        (
            "llama",
            lambda c: {**c, "rope_parameters": None, "rope_theta": "big"},
            r"'rope_theta': expected float, got 'big'",
        ),
        (
            "llama",
            lambda c: {**c, "rms_norm_eps": float("nan")},
            r"LlamaConfig: rms_norm_eps: expected a finite number",
        ),
    ],
)
def test_malformed_config_values_are_refused(tiny, tmp_path, name, edit, message):
    folder = _copy(tiny, name, tmp_path)
    _edit_config(folder, edit)
    _one_line_error(folder, message)


def test_config_json_encoding_and_old_llama_padding(tiny, tmp_path):
    folder = _copy(tiny, "llama", tmp_path)
    (folder / "config.json").write_bytes(b'{"model_type": "llama",\n "name": "caf\xe9"}')
    _one_line_error(folder, r"config\.json:2: not UTF-8 \(byte 0xe9\)")
    shutil.copy(tiny["llama"] / "config.json", folder / "config.json")
    _edit_config(folder, lambda c: {**c, "pad_token_id": -1, "eos_token_id": [2, 5]})  # as early conversions wrote
    config, _ = load_hf(folder)
    assert (config.pad_token_id, config.eos_token_id) == (0, 2)


def test_token_ids_left_null_in_a_small_vocabulary_become_the_eos():
    """transformers writes `"bos_token_id": null` for a Qwen2Config made without one: the family's default (151643)
    is outside a smaller vocabulary, so a null BOS or padding id is the EOS (transformers pads with it); a model of
    the full vocabulary keeps the family's defaults."""
    from jaxrlhf.checkpoint import config_from_hf

    small = dict(model_type="qwen2", vocab_size=300, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    config = config_from_hf({**small, "bos_token_id": None, "eos_token_id": 299})
    assert (config.bos_token_id, config.pad_token_id, config.eos_token_id) == (299, 299, 299)
    config = config_from_hf({**small, "vocab_size": 151936, "bos_token_id": None, "eos_token_id": 151645})
    assert (config.bos_token_id, config.pad_token_id, config.eos_token_id) == (151643, 151643, 151645)
    with pytest.raises(CheckpointError, match=r"bos_token_id: expected \[0, 300\), got 400"):  # a wrong id stays one
        config_from_hf({**small, "bos_token_id": 400, "eos_token_id": 299})


@pytest.mark.parametrize(
    "index, message",
    [
        ("[1]", r"index\.json: not a weight index; expected an object whose \"weight_map\""),
        ('{"weight_map": []}', r"index\.json: not a weight index"),  # was AttributeError
        (
            '{"weight_map": {"a.weight": 3}}',  # was TypeError
            r"index\.json: weight_map\['a\.weight'\] is 3; expected the file name of a shard in the same folder",
        ),
        (
            '{"weight_map": {"a.weight": "../model.safetensors"}}',
            r"weight_map\['a\.weight'\] is '\.\./model\.safetensors'",
        ),
        ('{"weight_map": {"a.weight": "x\\ny.safetensors"}}', r"weight_map\['a\.weight'\] is 'x\\ny\.safetensors'"),
    ],
)
def test_malformed_weight_index_is_refused(tiny, tmp_path, index, message):
    folder = _copy(tiny, "opt_sharded", tmp_path)
    (folder / "model.safetensors.index.json").write_text(index)
    _one_line_error(folder, message)


def test_corrupt_weight_files_are_refused(tiny, tmp_path):
    folder = _copy(tiny, "opt_torch", tmp_path)
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2])  # was a raw RuntimeError / UnpicklingError
    _one_line_error(
        folder, r"pytorch_model\.bin: cannot read a PyTorch state dict \(.*\); the file is truncated or corrupt"
    )
    folder = _copy(tiny, "opt", tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-100])
    _one_line_error(folder, r"model\.safetensors: cannot read safetensors \(.*\); the file is truncated or corrupt")


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.uint8])
def test_integer_and_boolean_tensors_are_not_weights(tiny, tmp_path, dtype):
    folder = _copy(tiny, "opt", tmp_path)
    _edit_tensors(
        folder,
        lambda t: t.update({"model.decoder.layers.1.fc1.weight": t["model.decoder.layers.1.fc1.weight"].astype(dtype)}),
    )
    _one_line_error(
        folder, rf"tensor decoder\.layers\.1\.fc1\.weight has dtype {np.dtype(dtype).name}; expected floating-point"
    )


def test_non_finite_tensors_are_named(tiny, tmp_path):
    def poison(t, name, value):
        t[name] = t[name].copy()
        t[name].flat[3] = value

    folder = _copy(tiny, "opt", tmp_path)
    _edit_tensors(folder, lambda t: poison(t, "model.decoder.layers.0.self_attn.k_proj.bias", np.nan))  # was NaN logits
    _one_line_error(
        folder,
        r"tensor decoder\.layers\.0\.self_attn\.k_proj\.bias holds 1 non-finite value\(s\) \(NaN or inf\); "
        "the checkpoint is corrupt or comes from a diverged run",
    )
    folder = _copy(tiny, "llama", tmp_path)
    _edit_tensors(folder, lambda t: poison(t, "model.norm.weight", 1e6))
    load_hf(folder)  # finite in float32
    with pytest.raises(
        CheckpointError,
        match=r"tensor model\.norm\.weight holds 1 non-finite value\(s\) \(NaN or inf\) once cast to float16",
    ):
        load_hf(folder, dtype=np.float16)
    _edit_tensors(folder, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.float64) * 1e300}))
    with pytest.raises(
        CheckpointError,
        match=r"tensor model\.norm\.weight holds 16 non-finite value\(s\) \(NaN or inf\) once cast to float32",
    ):
        load_hf(folder)  # kept as stored (float64), but the model computes in float32
    folder = _copy(tiny, "opt_head", tmp_path)
    head = load_file(folder / VALUE_HEAD_FILE)
    head["v_head.weight"][0, 0] = -np.inf
    save_file(head, str(folder / VALUE_HEAD_FILE))
    _one_line_error(folder, r"tensor v_head\.weight holds 1 non-finite value")


# ---------------------------------------------------------------------------------------------- Hub names


def _with_tokenizer(tiny, tmp_path):
    from jaxrlhf.train import builtin_tokenizer

    folder = _copy(tiny, "opt", tmp_path)
    builtin_tokenizer().save_pretrained(folder)
    return folder


def test_a_local_folder_never_asks_the_network(tiny, tmp_path, monkeypatch):
    import socket

    import huggingface_hub

    from jaxrlhf.tokenizer import load_tokenizer
    from jaxrlhf.train import builtin_tokenizer

    folder, asked, want = _with_tokenizer(tiny, tmp_path), [], builtin_tokenizer()("a b c")["input_ids"]

    def refuse(*args, **kwargs):  # an OSError, as a blocked network gives (transformers swallows some)
        asked.append(args[:2])
        raise OSError("network blocked by the test")

    for owner, name in [
        (socket, "getaddrinfo"),
        (socket, "create_connection"),
        (socket.socket, "connect"),
        (huggingface_hub, "snapshot_download"),
        (huggingface_hub, "hf_hub_download"),
    ]:
        monkeypatch.setattr(owner, name, refuse)
    config, _ = load_hf(folder)
    assert load_tokenizer(folder)("a b c")["input_ids"] == want
    assert config == load_hf(str(folder))[0] and asked == []


def test_a_hub_name_offline_says_so_at_once(monkeypatch):
    import time

    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from jaxrlhf.tokenizer import load_tokenizer

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder; the Hub is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    start = time.perf_counter()
    for load in (load_hf, load_tokenizer):
        with pytest.raises(
            CheckpointError,
            match=r"^facebook/opt-1\.3b: no such folder, and the Hugging Face Hub is "
            r"unreachable \(.*\); download it where it is reachable \(hf download facebook/opt-1\.3b "
            r"--local-dir DIR\) and pass DIR instead$",
        ):
            load("facebook/opt-1.3b")
    assert time.perf_counter() - start < 1.0
    with pytest.raises(CheckpointError, match="/no/such/folder: not a folder"):  # a path is never a Hub name
        load_hf("/no/such/folder")


def test_a_hub_name_downloads_through_huggingface_hub(tiny, tmp_path, monkeypatch):
    import huggingface_hub

    from jaxrlhf.tokenizer import load_tokenizer

    folder, calls = _with_tokenizer(tiny, tmp_path), []

    def snapshot_download(repo_id, allow_patterns=None, **kwargs):  # the Hub cache's snapshot folder
        calls.append((repo_id, allow_patterns))
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)  # no folder facebook/opt-tiny here
    config, params = load_hf("facebook/opt-tiny")
    want_config, want = load_hf(folder)
    assert config == want_config
    jax.tree.map(np.testing.assert_array_equal, params, want)
    assert load_tokenizer("facebook/opt-tiny")("a b")["input_ids"] == load_tokenizer(folder)("a b")["input_ids"]
    assert calls[0] == ("facebook/opt-tiny", ["*.json", "*.txt", "tokenizer*", "*.safetensors"])


def test_save_hf_into_an_empty_folder(tmp_path):
    """tempfile.mkdtemp() then save_hf: an empty folder holds nothing to lose, so it is written into; a folder with a
    file of the user's is still refused."""
    import tempfile

    from jaxrlhf import OPTConfig, init_params

    config = OPTConfig(**{k: v for k, v in PRE_LN.items() if k != "do_layer_norm_before"})
    params = jax.device_get(init_params(config, jax.random.key(0)))
    folder = save_hf(tempfile.mkdtemp(dir=tmp_path), config, params)
    assert load_hf(folder)[0] == config and (folder / "model.safetensors").is_file()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my own notes")
    with pytest.raises(CheckpointError, match="exists and is a folder without"):
        save_hf(mine, config, params)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]

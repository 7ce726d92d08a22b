"""llama2.c's stories260K (a real pretrained tiny Llama) converted to an HF folder, then run by jaxrlhf."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import CheckpointError, load_hf, load_tokenizer, make_mesh, reshard
from jaxrlhf.convert import main, read_llama2c, read_llama2c_tokenizer
from jaxrlhf.generate import generate

STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


@pytest.fixture(scope="module")
def stories(assets, tmp_path_factory):
    src = assets / "models" / "stories260K"
    out = tmp_path_factory.mktemp("convert") / "stories260K"
    assert main(["llama2c", str(src / "stories260K.bin"), str(src / "tok512.bin"), str(out)]) == 0
    return src, out, *load_hf(out), load_tokenizer(out)


def _greedy_from_bos(config, params, n, mesh=None):
    bos = np.full((2, 1), config.bos_token_id, np.int32)  # two rows: the batch splits over "data" too
    out = generate(
        config, params, bos, np.ones_like(bos), jax.random.key(0), max_new_tokens=n, temperature=0.0, mesh=mesh
    )
    return np.asarray(out.tokens)


@pytest.mark.slow
def test_greedy_story_from_bos(stories):
    _, _, config, params, tok = stories
    assert (config.num_attention_heads, config.num_key_value_heads, config.tie_word_embeddings) == (8, 4, True)
    tokens = _greedy_from_bos(config, params, 40)
    assert (tokens[0] == tokens[1]).all()
    text = tok.decode(tokens[0].tolist(), skip_special_tokens=True)
    print(text)
    assert text.startswith(STORY)


@pytest.mark.slow
def test_transformers_runs_the_converted_folder_to_the_same_tokens(stories):
    import torch
    from transformers import AutoModelForCausalLM

    _, out, config, params, _ = stories
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    want = hf.generate(torch.tensor([[1]]), max_new_tokens=40, do_sample=False)[0, 1:].tolist()
    assert _greedy_from_bos(config, params, 40)[0].tolist() == want


@pytest.mark.slow
def test_tensor_parallel_2_on_8_devices_gives_the_same_tokens(stories):
    _, _, config, params, _ = stories
    mesh = make_mesh(tp=2)
    assert mesh.shape == {"data": 4, "model": 2}
    tp = reshard(jax.tree.map(jnp.asarray, params), "tp", mesh)
    np.testing.assert_array_equal(_greedy_from_bos(config, tp, 40, mesh), _greedy_from_bos(config, params, 40))


def _llama2c_encode(text, pieces, scores):
    """llama2.c's encoder (run.c), for comparison: chars (or bytes) first, then best-score merges, BOS first."""
    vocab = {p: i for i, p in enumerate(pieces)}
    ids = []
    for ch in "\u2581" + text.replace(" ", "\u2581"):
        ids += [vocab[ch]] if ch in vocab else [vocab[f"<0x{b:02X}>"] for b in ch.encode()]
    while True:
        pairs = [
            (scores[vocab[pieces[a] + pieces[b]]], -i)
            for i, (a, b) in enumerate(itertools.pairwise(ids))
            if pieces[a] + pieces[b] in vocab
        ]
        if not pairs:
            return [1] + ids
        i = -max(pairs)[1]
        ids[i : i + 2] = [vocab[pieces[ids[i]] + pieces[ids[i + 1]]]]


@pytest.mark.parametrize("text", [STORY, 'The cat sat. It said: "hi!"\nThen 42 dogs ran', "Ünïcode ☃ and tabs\t"])
def test_tokenizer_encodes_like_llama2c_and_decodes_back(stories, text):
    src, _, _, _, tok = stories
    pieces, scores = read_llama2c_tokenizer(src / "tok512.bin")
    ids = tok(text)["input_ids"]
    assert ids == _llama2c_encode(text, pieces, scores)
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_bad_files_are_refused_with_their_name(stories, tmp_path):
    src = stories[0]
    cut = tmp_path / "cut.bin"
    cut.write_bytes((src / "stories260K.bin").read_bytes()[:-4])
    with pytest.raises(CheckpointError, match=r"cut\.bin: holds \d+ floats after the header; the header's shapes need"):
        read_llama2c(cut)
    assert main(["llama2c", str(cut), str(src / "tok512.bin"), str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists()

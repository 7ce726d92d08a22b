"""`python -m jaxrlhf.convert llama2c MODEL.bin TOKENIZER.bin OUT_DIR`: real pretrained weights, offline.

Reads a llama2.c checkpoint (Karpathy's `run.c` format, e.g. the stories15M/42M/110M/260K models) and its
tokenizer, and writes a Hugging Face `LlamaForCausalLM` folder (config.json, model.safetensors and a fast
tokenizer) that jaxrlhf and transformers both load.

    llama2.c .bin                               HF folder
    header: 7 int32 (dim, hidden, layers,       config.json (tie_word_embeddings: vocab_size > 0 in the header)
            heads, kv heads, vocab, seq len)
    float32 arrays, nn.Linear [out, in]   ->    model.layers.{i}.self_attn.q_proj.weight ... (via the Llama
                                                family's name table, llama.HF); q and k rows permuted from
                                                interleaved rotary pairs (2i, 2i+1) to HF's halves (i, i + K/2)
    tokenizer .bin (score, bytes per piece) ->  tokenizer.json (SentencePiece BPE with byte fallback)
"""

from __future__ import annotations

import argparse
import math
import os
import struct
import sys
from pathlib import Path

import numpy as np

from jaxrlhf.checkpoint import CheckpointError, params_from_tensors, save_hf
from jaxrlhf.models import LlamaConfig
from jaxrlhf.tokenizer import sentencepiece_bpe

_HEADER = struct.Struct("<7i")
_SPECIAL = {0: "<unk>", 1: "<s>", 2: "</s>"}  # llama2.c stores them as "<unk>", "\n<s>\n", "\n</s>\n"


def interleaved_to_halves(w, n_heads: int):
    """Permute the output rows of a q or k projection w [heads * K, in] from rotary pairs (2i, 2i + 1) to
    (i, i + K/2), per head, so that HF's rotate-half rotary embedding computes what Meta's interleaved one did."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def read_llama2c(path: str | os.PathLike) -> tuple[LlamaConfig, dict]:
    """(LlamaConfig, our params as float32 NumPy arrays, HF rotary layout) from a llama2.c model file."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < _HEADER.size:
        raise CheckpointError(f"{path}: too short for a llama2.c header ({len(data)} bytes)")
    dim, hidden, L, H, Hkv, vocab, seq_len = _HEADER.unpack_from(data)
    shared, vocab = vocab > 0, abs(vocab)
    if min(dim, hidden, L, H, Hkv, vocab, seq_len) <= 0 or dim % H or H % Hkv:
        raise CheckpointError(
            f"{path}: not a llama2.c model header: dim {dim}, hidden {hidden}, layers {L}, "
            f"heads {H}, kv heads {Hkv}, vocab {vocab}, seq len {seq_len}"
        )
    K = dim // H
    kv = Hkv * K
    floats = np.frombuffer(data, "<f4", offset=_HEADER.size)
    shapes = {  # the file's arrays in order; the rotary table ("rope") is not used
        "embed": (vocab, dim),
        "rms_att": (L, dim),
        "wq": (L, dim, dim),
        "wk": (L, kv, dim),
        "wv": (L, kv, dim),
        "wo": (L, dim, dim),
        "rms_ffn": (L, dim),
        "w1": (L, hidden, dim),
        "w2": (L, dim, hidden),
        "w3": (L, hidden, dim),
        "rms_final": (dim,),
        "rope": (seq_len, K),
    } | ({} if shared else {"wcls": (vocab, dim)})
    need = sum(math.prod(shape) for shape in shapes.values())
    if floats.size != need:
        raise CheckpointError(f"{path}: holds {floats.size} floats after the header; the header's shapes need {need}")
    arrays, at = {}, 0
    for name, shape in shapes.items():
        arrays[name], at = floats[at : at + math.prod(shape)].reshape(shape), at + math.prod(shape)
    tensors = {"model.embed_tokens.weight": arrays["embed"], "model.norm.weight": arrays["rms_final"]}
    if not shared:
        tensors["lm_head.weight"] = arrays["wcls"]
    per_layer = {
        "input_layernorm": arrays["rms_att"],
        "post_attention_layernorm": arrays["rms_ffn"],
        "self_attn.q_proj": [interleaved_to_halves(w, H) for w in arrays["wq"]],
        "self_attn.k_proj": [interleaved_to_halves(w, Hkv) for w in arrays["wk"]],
        "self_attn.v_proj": arrays["wv"],
        "self_attn.o_proj": arrays["wo"],
        "mlp.gate_proj": arrays["w1"],
        "mlp.down_proj": arrays["w2"],
        "mlp.up_proj": arrays["w3"],
    }
    for module, stack in per_layer.items():
        for i in range(L):
            tensors[f"model.layers.{i}.{module}.weight"] = np.asarray(stack[i])
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=hidden,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=Hkv,
        max_position_embeddings=seq_len,
        rms_norm_eps=1e-5,
        tie_word_embeddings=shared,
    )  # rope_theta 10000 and token ids 0, 1, 2 (_SPECIAL): llama2.c's, LlamaConfig's defaults
    return config, params_from_tensors(config, tensors, str(path))


def read_llama2c_tokenizer(path: str | os.PathLike) -> tuple[list[str], list[float]]:
    """(pieces, scores) from a llama2.c tokenizer file, pieces spelled as SentencePiece does ('▁' for a space)."""
    path = Path(path)
    data = path.read_bytes()
    pieces, scores, at = [], [], 4  # after max_token_length
    try:
        while at < len(data):
            score, n = struct.unpack_from("<fi", data, at)
            text = data[at + 8 : at + 8 + n]
            if len(text) != n:
                raise struct.error("truncated piece")
            at += 8 + n
            i = len(pieces)
            pieces.append(_SPECIAL.get(i) or text.decode("utf-8").replace(" ", "\u2581"))
            scores.append(score)
    except (struct.error, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a llama2.c tokenizer file (piece {len(pieces)}: {e})") from None
    return pieces, scores


def llama2c_to_hf(model: str | os.PathLike, tokenizer: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Convert a llama2.c model and tokenizer into an HF LlamaForCausalLM folder at `out`."""
    config, params = read_llama2c(model)
    pieces, scores = read_llama2c_tokenizer(tokenizer)
    if len(pieces) != config.vocab_size:
        raise CheckpointError(f"{tokenizer}: has {len(pieces)} pieces; the model {model} has vocab {config.vocab_size}")
    return save_hf(out, config, params, tokenizer=sentencepiece_bpe(pieces, scores))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m jaxrlhf.convert", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="format", required=True)
    l2c = sub.add_parser("llama2c", help="a llama2.c model .bin and tokenizer .bin -> an HF Llama folder")
    l2c.add_argument("model")
    l2c.add_argument("tokenizer")
    l2c.add_argument("out")
    args = ap.parse_args(argv)
    try:
        out = llama2c_to_hf(args.model, args.tokenizer, args.out)
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

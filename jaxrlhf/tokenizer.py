"""Tokenizers: any Hugging Face tokenizer folder, OPT's from its raw `vocab.json` + `merges.txt`, or a
SentencePiece BPE vocabulary (pieces and scores, as in llama2.c's tokenizer files) as a fast HF tokenizer.

OPT's tokenizer is GPT-2's byte-level BPE with fairseq ids (`<s>`=0, `<pad>`=1, `</s>`=2, `<unk>`=3) and
one quirk: it prepends `</s>` (id 2) as the beginning-of-sequence token, and uses `</s>` as EOS too.
Llama's (SentencePiece BPE with byte fallback): `<unk>`=0, `<s>`=1 (prepended), `</s>`=2; a space is
the piece character '▁' and the text gets one in front (add_dummy_prefix).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from jaxrlhf.checkpoint import CheckpointError, resolve
from jaxrlhf.data.messages import ChatFormat

_BPE_FILES = ("vocab.json", "merges.txt")


def opt_tokenizer(path: str | os.PathLike):
    """OPT's tokenizer from a folder holding `vocab.json` and `merges.txt` (GPT-2 BPE, fairseq ids)."""
    from transformers import GPT2Tokenizer

    path = Path(path)
    missing = [f for f in _BPE_FILES if not (path / f).is_file()]
    if missing:
        raise CheckpointError(
            f"{path}: missing {' and '.join(missing)}; OPT's tokenizer needs vocab.json and merges.txt"
        )
    return GPT2Tokenizer.from_pretrained(
        str(path),
        bos_token="</s>",
        eos_token="</s>",
        unk_token="</s>",
        pad_token="<pad>",
        add_bos_token=True,
        local_files_only=True,
    )


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in `path` (an HF folder or Hub name), or OPT's built from `vocab.json` + `merges.txt` there.
    A local folder is read with local_files_only: transformers asks the Hub nothing."""
    path = resolve(path)
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if all((path / f).is_file() for f in _BPE_FILES):
        return opt_tokenizer(path)
    raise CheckpointError(
        f"{path}: no tokenizer found; expected tokenizer.json / tokenizer_config.json, or vocab.json + merges.txt "
        "(pass --tokenizer DIR to use another folder's)"
    )


def sentencepiece_bpe(pieces: list[str], scores: list[float]):
    """A transformers fast tokenizer equal to SentencePiece BPE over `pieces` (id = index) and `scores`.

    Ids 0, 1, 2 are <unk>, <s>, </s>; pieces "<0x00>".."<0xFF>" are byte fallbacks; a space is '▁'.
    SentencePiece merges, again and again, the adjacent pair whose concatenation is the piece with the
    highest score; that is BPE whose merge list holds every split (a, b) of every piece, ranked by the
    piece's score. Encoding prepends <s>; decoding drops the dummy-prefix space.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {p: i for i, p in enumerate(pieces)}
    if len(vocab) != len(pieces):
        raise ValueError("sentencepiece_bpe: the vocabulary repeats a piece")
    ranked = sorted(
        (-scores[i], i, piece[:j], piece[j:])
        for i, piece in enumerate(pieces)
        if i >= 3 and not (piece.startswith("<0x") and len(piece) == 6)  # special tokens and byte fallbacks
        for j in range(1, len(piece))
        if piece[:j] in vocab and piece[j:] in vocab
    )
    merges = [(a, b) for *_, a, b in ranked]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def stop_id(tokenizer, chat_template: str = "auto") -> int:
    """The token answers are trained to end with (and `force_length` forces): the chat template's end-of-turn token
    (e.g. Qwen's <|im_end|>) when `chat_template` (data.chat_template) uses it, else the tokenizer's EOS. Generation
    stops at any of `stop_ids`, this one first."""
    return ChatFormat(tokenizer, chat_template).stop_id


def stop_ids(tokenizer, chat_template: str = "auto", model_dir: str | os.PathLike | None = None) -> tuple[int, ...]:
    """The tokens generation stops at: `stop_id` first, then the tokenizer's EOS, then the model folder's
    generation_config.json `eos_token_id` (an int or a list: Qwen2.5 / Qwen3 instruct end on <|im_end|> or
    <|endoftext|>, Llama 3 instruct on any of three), each once. A model that ends a turn with another of them than
    its template writes still stops there instead of running to its length limit."""
    ids = [stop_id(tokenizer, chat_template), tokenizer.eos_token_id, *generation_eos_ids(model_dir)]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def generation_eos_ids(model_dir: str | os.PathLike | None) -> list[int]:
    """generation_config.json's `eos_token_id` in `model_dir` as a list (none: no folder, no file, or no field)."""
    if model_dir is None or str(model_dir).startswith("random:"):
        return []
    path = resolve(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a JSON object ({e}); fix or delete the file") from None
    eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(eos, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in eos):
        raise CheckpointError(f"{path}: eos_token_id must be an integer or a list of integers, got {eos!r}")
    return eos


def decode_rows(tokenizer, ids, mask, skip_first: bool = False, stops=()) -> list[str]:
    """The text of each row's real tokens: a last token that ends an answer (EOS, the chat template's end-of-turn
    token, or one of `stops`: generation's stop_ids) dropped, and with `skip_first` a leading BOS (a prompt's; a chat
    template that writes none leaves the prompt whole)."""
    ends = {tokenizer.eos_token_id, ChatFormat(tokenizer).stop_id, *stops}
    bos = tokenizer.bos_token_id
    out = []
    for row, m in zip(np.asarray(ids), np.asarray(mask)):
        row = [int(t) for t in row[m.astype(bool)]]
        row = row[1:] if skip_first and row[:1] == [bos] else row
        out.append(tokenizer.decode(row[:-1] if row[-1:] and row[-1] in ends else row))
    return out

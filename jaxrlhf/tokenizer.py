"""Tokenizers: any Hugging Face tokenizer folder, or OPT's from its raw `vocab.json` + `merges.txt`.

OPT's tokenizer is GPT-2's byte-level BPE with fairseq ids (`<s>`=0, `<pad>`=1, `</s>`=2, `<unk>`=3) and
one quirk: it prepends `</s>` (id 2) as the beginning-of-sequence token, and uses `</s>` as EOS too.
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxrlhf.checkpoint import CheckpointError

_HF_FILES = ("tokenizer.json", "tokenizer_config.json")
_BPE_FILES = ("vocab.json", "merges.txt")


def opt_tokenizer(path: str | os.PathLike):
    """OPT's tokenizer from a folder holding `vocab.json` and `merges.txt` (GPT-2 BPE, fairseq ids)."""
    from transformers import GPT2Tokenizer

    path = Path(path)
    missing = [f for f in _BPE_FILES if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"{path}: missing {' and '.join(missing)}; OPT's tokenizer needs vocab.json and merges.txt")
    return GPT2Tokenizer.from_pretrained(
        str(path), bos_token="</s>", eos_token="</s>", unk_token="</s>", pad_token="<pad>", add_bos_token=True
    )


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in `path` (an HF folder), or OPT's built from `vocab.json` + `merges.txt` there."""
    path = Path(path)
    if any((path / f).is_file() for f in _HF_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    if all((path / f).is_file() for f in _BPE_FILES):
        return opt_tokenizer(path)
    raise CheckpointError(
        f"{path}: no tokenizer found; expected tokenizer.json / tokenizer_config.json, or vocab.json + merges.txt "
        "(pass --tokenizer DIR to use another folder's)"
    )

"""Byte-level BPE tokenizers (HF ``tokenizers``): train one on a corpus, or load a ``tokenizer.json``.

Byte-level BPE maps any UTF-8 text to ids and back without loss (``decode(encode(t)) == t``), so
a prepared corpus can be checked by decoding it. Every tokenizer here has the document separator
``EOS_TOKEN`` that ``prepare-data`` appends to each document.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EOS_TOKEN = "<|endoftext|>"
MIN_VOCAB = 257  # 256 byte symbols + EOS
# The document separator of a tokenizer: the first of these it defines (moefold's own BPE and Qwen:
# <|endoftext|>; Mistral/Mixtral/Llama-2: </s>; DeepSeek-V3; Llama-3; Gemma), so a model's shipped
# tokenizer.json works as it is with ``prepare-data --tokenizer``.
SEPARATOR_TOKENS = (EOS_TOKEN, "</s>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<|end_of_text|>", "<eos>")


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` ids (EOS is id 0) on ``texts``.

    A small corpus may yield fewer ids than asked for: the trainer stops when no pair repeats.
    """
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs at least {MIN_VOCAB} "
                         "(256 byte symbols + EOS)")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a ``tokenizer.json``; it must define ``EOS_TOKEN`` (or fail naming the file)."""
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer {path}: no such file (expected a HF tokenizers tokenizer.json)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ValueError(f"{path}: not a HF tokenizers tokenizer.json ({exc})") from exc
    if not any(tok.token_to_id(t) is not None for t in SEPARATOR_TOKENS):
        raise ValueError(f"{path}: tokenizer has no document separator token (one of {list(SEPARATOR_TOKENS)}), "
                         "which prepare-data appends to every document")
    return tok


def eos_id(tok: Tokenizer) -> int:
    """The id of the tokenizer's document separator (the first of ``SEPARATOR_TOKENS`` it defines)."""
    for token in SEPARATOR_TOKENS:
        eid = tok.token_to_id(token)
        if eid is not None:
            return int(eid)
    raise ValueError(f"tokenizer has no document separator token (one of {list(SEPARATOR_TOKENS)})")


def tokenizer_path(prefix: str | os.PathLike) -> Path:
    """Where ``prepare-data`` stores the tokenizer of ``PREFIX.bin``: ``PREFIX.tokenizer.json``.

    One file per prefix (not one ``tokenizer.json`` per directory) so that several corpora can share a
    directory without overwriting each other's tokenizer.
    """
    return Path(f"{os.fspath(prefix)}.tokenizer.json")

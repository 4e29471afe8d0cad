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
    if tok.token_to_id(EOS_TOKEN) is None:
        raise ValueError(f"{path}: tokenizer has no {EOS_TOKEN!r} token, which prepare-data appends to every "
                         "document as the separator")
    return tok


def eos_id(tok: Tokenizer) -> int:
    eid = tok.token_to_id(EOS_TOKEN)
    if eid is None:
        raise ValueError(f"tokenizer has no {EOS_TOKEN!r} token")
    return int(eid)


def tokenizer_path(prefix: str | os.PathLike) -> Path:
    """Where ``prepare-data`` stores the tokenizer of ``PREFIX.bin``: ``PREFIX.tokenizer.json``.

    One file per prefix (not one ``tokenizer.json`` per directory) so that several corpora can share a
    directory without overwriting each other's tokenizer.
    """
    return Path(f"{os.fspath(prefix)}.tokenizer.json")

"""Megatron-LM's tokenizer flags, through HF ``tokenizers`` (nothing is downloaded):

    --tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH     # a directory with tokenizer.json, or the file
    --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt

GPT-2's byte-level BPE (Megatron's ``GPT2BPETokenizer``, its ``gpt2_tokenization.GPT2Tokenizer``) is HF
``tokenizers``' BPE with the byte-level pre-tokenizer and decoder, no prefix space; its end-of-document token is
``<|endoftext|>``. Megatron pads the vocabulary the model is built with to a multiple of
``--make-vocab-size-divisible-by x tensor-parallel size`` (``padded_vocab_size``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer")


def megatron_tokenizer(tokenizer_type: str, tokenizer_model: str | os.PathLike | None = None,
                       vocab_file: str | os.PathLike | None = None,
                       merge_file: str | os.PathLike | None = None) -> Tokenizer:
    """The HF ``tokenizers.Tokenizer`` Megatron's flags name; ValueError naming the flag for a missing file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH (a directory holding "
                             "tokenizer.json, or the file; nothing is downloaded)")
        path = Path(tokenizer_model)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"--tokenizer-model {tokenizer_model}: no tokenizer.json there (a local HF tokenizer "
                             "directory or file; hub names are not downloaded)")
        return Tokenizer.from_file(str(file))
    if tokenizer_type == "GPT2BPETokenizer":
        for flag, value in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if value is None or not Path(value).is_file():
                raise ValueError(f"--tokenizer-type GPT2BPETokenizer needs {flag} (GPT-2's vocab.json / merges.txt); "
                                 f"got {value}")
        tok = Tokenizer(models.BPE.from_file(str(vocab_file), str(merge_file)))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; valid: {', '.join(TOKENIZER_TYPES)}")


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: the next multiple of ``divisible_by * tp``."""
    if divisible_by < 1 or tp < 1:
        raise ValueError(f"--make-vocab-size-divisible-by={divisible_by} and tp={tp} must be >= 1")
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)

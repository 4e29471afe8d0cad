"""Training data: corpus preparation (``moefold prepare-data``), the indexed token format, tokenizers, the
built-in corpus, fixed-length datasets, blending, the train/validation split and resumable loading.

Holds: prepare, indexed, megatron_indexed (Megatron's MMIDIDX format), corpus (either format by its magic),
tokenizer, megatron_tokenizer (Megatron's tokenizer flags), builtin, gpt_dataset, megatron_order (Megatron-Core's
sample order), blend, validation, sampler.
May import: torch, numpy, tokenizers; nothing else of moefold (the data layer knows no model).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# functions named like their modules, bound now: importing the submodule later would otherwise leave the module under
# the name (both are torch-free)
from moefold.training.data.megatron_tokenizer import megatron_tokenizer
from moefold.training.data.prepare import prepare

if TYPE_CHECKING:
    from moefold.training.data.blend import BlendedDataset, blend_indices, build_blended, parse_data_path
    from moefold.training.data.builtin import builtin_corpus, stdlib_files
    from moefold.training.data.corpus import max_token_id, open_indexed
    from moefold.training.data.gpt_dataset import GPTDataset, build_epoch
    from moefold.training.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
    from moefold.training.data.megatron_indexed import MegatronIndexedDataset, MegatronIndexedDatasetWriter
    from moefold.training.data.megatron_order import MegatronBlend, build_megatron_datasets
    from moefold.training.data.megatron_tokenizer import padded_vocab_size
    from moefold.training.data.prepare import PrepareStats, expand_inputs, iter_documents
    from moefold.training.data.sampler import MicroBatchLoader, MicroBatchSampler, Samples
    from moefold.training.data.tokenizer import EOS_TOKEN, eos_id, load_tokenizer, tokenizer_path, train_bpe
    from moefold.training.data.validation import parse_split, split_cache_dir, split_corpora

# name -> the module that defines it: loaded on first use, so that reading a config or parsing flags imports
# no more than it needs (torch only where a module computes)
_LAZY = {
    **dict.fromkeys(["BlendedDataset", "blend_indices", "build_blended", "parse_data_path"],
                    "moefold.training.data.blend"),
    **dict.fromkeys(["builtin_corpus", "stdlib_files"], "moefold.training.data.builtin"),
    **dict.fromkeys(["max_token_id", "open_indexed"], "moefold.training.data.corpus"),
    **dict.fromkeys(["GPTDataset", "build_epoch"], "moefold.training.data.gpt_dataset"),
    **dict.fromkeys(["IndexedDataset", "IndexedDatasetWriter", "token_dtype"], "moefold.training.data.indexed"),
    **dict.fromkeys(["MegatronIndexedDataset", "MegatronIndexedDatasetWriter"],
                    "moefold.training.data.megatron_indexed"),
    **dict.fromkeys(["MegatronBlend", "build_megatron_datasets"], "moefold.training.data.megatron_order"),
    "padded_vocab_size": "moefold.training.data.megatron_tokenizer",
    **dict.fromkeys(["PrepareStats", "expand_inputs", "iter_documents"], "moefold.training.data.prepare"),
    **dict.fromkeys(["MicroBatchLoader", "MicroBatchSampler", "Samples"], "moefold.training.data.sampler"),
    **dict.fromkeys(["EOS_TOKEN", "eos_id", "load_tokenizer", "tokenizer_path", "train_bpe"],
                    "moefold.training.data.tokenizer"),
    **dict.fromkeys(["parse_split", "split_cache_dir", "split_corpora"], "moefold.training.data.validation"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "IndexedDataset", "IndexedDatasetWriter", "token_dtype", "open_indexed", "max_token_id",
    "MegatronIndexedDataset", "MegatronIndexedDatasetWriter", "MegatronBlend", "build_megatron_datasets",
    "megatron_tokenizer", "padded_vocab_size",
    "prepare", "PrepareStats", "expand_inputs", "iter_documents",
    "EOS_TOKEN", "eos_id", "load_tokenizer", "tokenizer_path", "train_bpe",
    "GPTDataset", "build_epoch",
    "BlendedDataset", "blend_indices", "build_blended", "parse_data_path",
    "MicroBatchSampler", "MicroBatchLoader", "Samples",
    "builtin_corpus", "stdlib_files",
    "parse_split", "split_corpora", "split_cache_dir",
]

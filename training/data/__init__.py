"""Corpus preparation, the indexed token format, fixed-length datasets, blending and resumable loading."""

from training.data.blend import BlendedDataset, blend_indices, build_blended, parse_data_path
from training.data.builtin import builtin_corpus, stdlib_files
from training.data.gpt_dataset import GPTDataset, build_indices
from training.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from training.data.prepare import PrepareStats, expand_inputs, iter_documents, prepare
from training.data.sampler import MicroBatchLoader, MicroBatchSampler, Samples
from training.data.tokenizer import EOS_TOKEN, eos_id, load_tokenizer, tokenizer_path, train_bpe

__all__ = [
    "IndexedDataset", "IndexedDatasetWriter", "token_dtype",
    "prepare", "PrepareStats", "expand_inputs", "iter_documents",
    "EOS_TOKEN", "eos_id", "load_tokenizer", "tokenizer_path", "train_bpe",
    "GPTDataset", "build_indices",
    "BlendedDataset", "blend_indices", "build_blended", "parse_data_path",
    "MicroBatchSampler", "MicroBatchLoader", "Samples",
    "builtin_corpus", "stdlib_files",
]

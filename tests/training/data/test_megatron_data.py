"""Megatron's indexed format and sample order, against Megatron-Core 0.16.1's own code (the test extra).

- a corpus written by Megatron's ``IndexedDatasetBuilder`` (every dtype it defines) reads back token for token
  in moefold, and one written by moefold's Megatron writer (``prepare-data --format megatron``) reads back in
  Megatron's ``IndexedDataset``;
- ``--data-order megatron`` gives Megatron's ``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` samples for a
  weighted blend of two corpora with a train/valid/test split, for an unweighted blend, for one corpus and for
  per-split corpora, including multi-epoch datasets (the separate final epoch).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moefold.training.data.corpus import max_token_id, open_indexed
from moefold.training.data.megatron_indexed import (
    DTYPE_CODES,
    MegatronIndexedDataset,
    MegatronIndexedDatasetWriter,
    scan_max_token_id,
)
from moefold.training.data.megatron_order import (
    MegatronBlend,
    blending_indices,
    build_megatron_datasets,
    num_samples_per_split,
)
from tests.megatron_compat import StandInTokenizer, patch_for_cpu, require_megatron

VOCAB = 300


@pytest.fixture(autouse=True)
def _megatron():
    require_megatron()
    patch_for_cpu()


def _documents(seed: int, n: int, vocab: int = VOCAB) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, vocab, size=int(rng.integers(1, 40))) for _ in range(n)]
    docs[3] = np.zeros(0, dtype=np.int64)   # an empty sequence: Megatron's builders must skip it alike
    return docs


def _megatron_corpus(prefix: str, docs: list[np.ndarray], dtype=np.uint16) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for d in docs:
        builder.add_item(torch.from_numpy(np.asarray(d, dtype=np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("dtype", list(DTYPE_CODES.values()), ids=lambda d: d.__name__)
def test_megatron_builder_corpus_reads_back_in_moefold(tmp_path, dtype):
    docs = _documents(0, 12, vocab=100)   # ids < 128 fit int8
    prefix = str(tmp_path / "c")
    _megatron_corpus(prefix, docs, dtype)
    data = open_indexed(prefix)
    assert isinstance(data, MegatronIndexedDataset) and data.dtype is dtype
    assert data.num_docs == len(docs) and data.num_tokens == sum(len(d) for d in docs)
    for d, doc in enumerate(docs):
        np.testing.assert_array_equal(np.asarray(data.document(d), dtype=np.int64), doc)
    assert max_token_id(data) == max(int(d.max()) for d in docs if len(d))
    assert data.vocab_size == max_token_id(data) + 1


def test_moefold_writer_reads_back_in_megatron(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed

    for vocab, expect in ((VOCAB, np.uint16), (70000, np.int32)):
        docs = _documents(1, 9, vocab=vocab)
        prefix = str(tmp_path / f"m{vocab}")
        with MegatronIndexedDatasetWriter(prefix, vocab) as w:
            for d in docs:
                w.add_document(d)
        theirs = MegatronIndexed(prefix)
        assert theirs.index.dtype is expect
        assert len(theirs) == len(docs)
        for d, doc in enumerate(docs):
            np.testing.assert_array_equal(theirs[d].astype(np.int64), doc)
        # byte for byte what Megatron's own builder writes for the same documents
        _megatron_corpus(str(tmp_path / "ref"), docs, expect)
        for ext in (".bin", ".idx"):
            assert (tmp_path / f"m{vocab}{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()


def test_truncated_megatron_bin_is_named(tmp_path):
    prefix = str(tmp_path / "c")
    _megatron_corpus(prefix, _documents(0, 5))
    with open(f"{prefix}.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match=r"c\.bin: 10 bytes"):
        open_indexed(prefix)


def test_max_token_id_scan_is_chunked():
    tokens = np.arange(1000, dtype=np.uint16)[::-1].copy()
    assert scan_max_token_id(tokens, chunk=7) == 999
    assert scan_max_token_id(np.zeros(0, dtype=np.int32)) == -1


def _megatron_datasets(blend, blend_per_split, split, sizes, seq_len, seed):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_len, blend=blend, blend_per_split=blend_per_split,
                              split=split, tokenizer=StandInTokenizer(VOCAB), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def _assert_same_samples(ours, theirs, what: str) -> None:
    assert (ours is None) == (theirs is None), what
    if ours is None:
        return
    assert len(ours) == len(theirs), what
    for i in range(len(theirs)):
        sample = theirs[i]
        text = torch.cat([sample["tokens"], sample["labels"][-1:]]).numpy()
        np.testing.assert_array_equal(ours[i], text, err_msg=f"{what} sample {i}")


def _corpora(tmp_path, n=2):
    prefixes = []
    for c in range(n):
        prefix = str(tmp_path / f"corpus{c}")
        _megatron_corpus(prefix, _documents(10 + c, 60 + 25 * c))
        prefixes.append(prefix)
    return prefixes


def test_megatron_order_weighted_blend_with_split(tmp_path):
    a, b = _corpora(tmp_path)
    # a train run of 40 steps x 8 samples with 2 evaluations of 3 batches: both corpora need several epochs,
    # the last one short (Megatron shuffles it separately)
    sizes = num_samples_per_split(train_iters=40, global_batch_size=8, eval_iters=3, eval_interval=20)
    theirs = _megatron_datasets(([a, b], [0.3, 0.7]), None, "90,7,3", sizes, seq_len=16, seed=1234)
    ours = build_megatron_datasets(MegatronBlend(blend=((a, b), (0.3, 0.7)), split="90,7,3"), sizes, seq_length=16,
                                   seed=1234, cache_dir=tmp_path / "cache")
    assert all(len(d.document_index) >= 2 * len(d.indices) for d in ours[0].datasets)   # 2+ epochs
    for part, o, t in zip(("train", "valid", "test"), ours, theirs):
        _assert_same_samples(o, t, part)
        np.testing.assert_array_equal(o.dataset_index, t.dataset_index)
        for od, td in zip(o.datasets, t.datasets):   # the three index arrays themselves
            np.testing.assert_array_equal(od.document_index, td.document_index)
            np.testing.assert_array_equal(od.sample_index, td.sample_index)
            np.testing.assert_array_equal(od.shuffle_index, td.shuffle_index)
    # cached: a second build reads the same arrays back
    again = build_megatron_datasets(MegatronBlend(blend=((a, b), (0.3, 0.7)), split="90,7,3"), sizes,
                                    seq_length=16, seed=1234, cache_dir=tmp_path / "cache")
    _assert_same_samples(again[0], theirs[0], "cached train")


def test_megatron_order_other_blends(tmp_path):
    a, b = _corpora(tmp_path)
    sizes = [200, 24, 8]
    cases = {
        "unweighted blend": (([a, b], None), None, "80,20,0"),
        "one corpus": (([b], None), None, "90,10,0"),
        "one weighted corpus": (([a], [1.0]), None, "85,15,0"),
        "per split": (None, [([a, b], [2.0, 1.0]), ([b], None), None], None),
    }
    for what, (blend, per_split, split) in cases.items():
        theirs = _megatron_datasets(blend, per_split, split, sizes, seq_len=8, seed=7)
        mb = MegatronBlend(
            blend=(tuple(blend[0]), tuple(blend[1]) if blend[1] else None) if blend else None,
            blend_per_split=tuple(None if p is None else (tuple(p[0]), tuple(p[1]) if p[1] else None)
                                  for p in per_split) if per_split else None, split=split)
        ours = build_megatron_datasets(mb, sizes, seq_length=8, seed=7, cache_dir=None)
        for part, o, t in zip(("train", "valid", "test"), ours, theirs):
            _assert_same_samples(o, t, f"{what}: {part}")


def test_blending_indices_equal_megatron_helper():
    from megatron.core.datasets import helpers

    for weights in ([0.3, 0.7], [0.5, 0.25, 0.125, 0.125], [1 / 3] * 3, [0.999, 0.001]):
        w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
        di, dsi = np.zeros(5000, dtype=np.int16), np.zeros(5000, dtype=np.int64)
        helpers.build_blending_indices(di, dsi, w, len(w), 5000, False)
        ours = blending_indices(w.tolist(), 5000)
        np.testing.assert_array_equal(ours[0], di)
        np.testing.assert_array_equal(ours[1], dsi)


def test_train_data_order_megatron_is_megatrons(tmp_path):
    """``moefold train --data-order megatron`` (run.build_dataset) hands out Megatron's train and valid samples."""
    from moefold.models.recipes import get_recipe
    from moefold.parallel.dims import ParallelDims
    from moefold.training.cli import build_parser
    from moefold.training.cli.train import config_from_args
    from moefold.training.run import build_dataset

    a, b = _corpora(tmp_path)
    flags = ["train", "--recipe", "qwen3_moe_tiny", "--vocab-size", str(VOCAB), "--data-order", "megatron",
             "--data-path", "0.4", a, "0.6", b, "--split", "90,10,0", "--seq-length", "16", "--train-iters", "6",
             "--global-batch-size", "8", "--micro-batch-size", "4", "--eval-iters", "2", "--eval-interval", "3",
             "--seed", "5", "--no-save", "--run-dir", str(tmp_path / "run")]
    config = config_from_args(build_parser("train").parse_args(flags))
    assert config.model.vocab_size == get_recipe("qwen3_moe_tiny").with_(vocab_size=VOCAB).vocab_size
    dims = ParallelDims.single()
    sizes = num_samples_per_split(6, 8, 2, 3)
    theirs = _megatron_datasets(([a, b], [0.4, 0.6]), None, "90,10,0", sizes, seq_len=16, seed=5)
    _assert_same_samples(build_dataset(config, dims), theirs[0], "train")
    _assert_same_samples(build_dataset(config, dims, part="valid"), theirs[1], "valid")


def test_prepare_data_megatron_format_and_gpt2_tokenizer(tmp_path):
    """``prepare-data --format megatron --tokenizer-type GPT2BPETokenizer --vocab-file --merge-file`` tokenises as
    transformers' GPT2Tokenizer (Megatron's GPT-2 BPE) does, and Megatron's IndexedDataset reads the result."""
    import json

    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed
    from transformers import GPT2Tokenizer

    from moefold.training.cli import main as cli_main
    from moefold.training.data.tokenizer import train_bpe

    texts = ["def main():\n    return 42\n", "hello world, hello moefold", "x = [i * i for i in range(10)]"] * 5
    bpe = json.loads(train_bpe(texts, 300).to_str())["model"]
    (tmp_path / "vocab.json").write_text(json.dumps(bpe["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:3]))
    rc = cli_main(["prepare-data", "--input", str(docs), "--output-prefix", str(tmp_path / "c"), "--format",
                   "megatron", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "vocab.json"),
                   "--merge-file", str(tmp_path / "merges.txt"), "--workers", "1", "--no-progress"])
    assert rc == 0
    ref = GPT2Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    eod = ref.convert_tokens_to_ids("<|endoftext|>")
    theirs = MegatronIndexed(str(tmp_path / "c"))
    assert len(theirs) == 3
    for d, text in enumerate(texts[:3]):
        assert theirs[d].tolist() == [*ref.encode(text), eod]


def test_huggingface_tokenizer_flags_and_vocab_padding(tmp_path):
    """``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` is that directory's tokenizer.json, in
    prepare-data and in train, whose model vocabulary is padded as Megatron pads it (128 x tp)."""
    from tokenizers import Tokenizer

    from moefold.training.cli import build_parser
    from moefold.training.cli import main as cli_main
    from moefold.training.cli.train import config_from_args
    from moefold.training.data.megatron_tokenizer import megatron_tokenizer, padded_vocab_size
    from moefold.training.data.tokenizer import train_bpe

    texts = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota"] * 4
    (tmp_path / "tok").mkdir()
    train_bpe(texts, 300).save(str(tmp_path / "tok" / "tokenizer.json"))
    tok = megatron_tokenizer("HuggingFaceTokenizer", tmp_path / "tok")
    ref = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert tok.encode(texts[2]).ids == ref.encode(texts[2]).ids
    docs = tmp_path / "d.jsonl"
    docs.write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
    assert cli_main(["prepare-data", "--input", str(docs), "--output-prefix", str(tmp_path / "c"),
                     "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tok"),
                     "--workers", "1", "--no-progress"]) == 0
    assert open_indexed(str(tmp_path / "c")).vocab_size == ref.get_vocab_size()
    assert padded_vocab_size(300, 128, 2) == 512 and padded_vocab_size(256, 128, 1) == 256
    args = build_parser("train").parse_args(["train", "--recipe", "qwen3_moe_tiny", "--tokenizer-type",
                                             "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tok"),
                                             "--tensor-model-parallel-size", "2", "--no-save"])
    assert config_from_args(args).model.vocab_size == padded_vocab_size(ref.get_vocab_size(), 128, 2)
    with pytest.raises(ValueError, match=r"--tokenizer-model .*no tokenizer\.json"):
        megatron_tokenizer("HuggingFaceTokenizer", tmp_path / "missing")

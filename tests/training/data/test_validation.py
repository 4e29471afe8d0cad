"""--split (Megatron's document split) and --valid-data-path: disjoint train/validation documents, Megatron's
split arithmetic, and the errors that name the flag. Validation across layouts: tests/training/test_train_from_hf.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moefold.parallel.dims import ParallelDims
from moefold.training.config import TrainConfig
from moefold.training.data.indexed import IndexedDatasetWriter
from moefold.training.data.validation import DocumentRange, parse_split, split_corpora, split_ranges
from moefold.training.run import build_dataset
from tests.training.trainer_common import tiny_config


def _corpus(path, docs: int = 50) -> None:
    """Document d holds only token d + 1 (10 to 30 of them): a sample's tokens name its documents."""
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(path, 256) as writer:
        for d in range(docs):
            writer.add_document(np.full(int(rng.integers(10, 30)), d + 1))


def test_split_arithmetic_is_megatrons():
    assert split_ranges(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(50, "90,10") == [(0, 45), (45, 50), (50, 50)]
    assert split_ranges(7, "1,1,1") == [(0, 3), (3, 5), (5, 7)]   # rounding shortfall: every boundary shifts
    assert parse_split("0.9,0.1") == pytest.approx((0.9, 0.1, 0.0))
    for bad in ("a,b", "-1,2", "0,0,0", "1,2,3,4"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)


def test_train_and_validation_documents_are_disjoint(tmp_path):
    _corpus(tmp_path / "c")
    config = tiny_config(steps=4)
    config = dataclasses.replace(config, train=dataclasses.replace(
        config.train, data_path=(str(tmp_path / "c"),), split="80,20,0", eval_iters=3, seq_length=16))
    dims = ParallelDims.single()
    train, valid = build_dataset(config, dims), build_dataset(config, dims, part="valid")
    assert len(train) == 16 and len(valid) == 12
    train_docs = {int(t) - 1 for i in range(len(train)) for t in train[i]}
    valid_docs = {int(t) - 1 for i in range(len(valid)) for t in valid[i]}
    assert train_docs <= set(range(40)) and valid_docs <= set(range(40, 50)) and len(valid_docs) > 3
    # a range reads like a corpus
    view = split_corpora([str(tmp_path / "c")], "80,20,0", "valid")[0]
    assert isinstance(view, DocumentRange) and view.num_docs == 10
    assert int(view.document(0)[0]) == 41 and view.num_tokens == int(view.doc_lengths().sum())


def test_split_errors(tmp_path):
    _corpus(tmp_path / "c", docs=10)
    with pytest.raises(ValueError, match=r"--split 98,2 leaves no valid documents in .*c \(10 documents\)"):
        split_corpora([str(tmp_path / "c")], "98,2", "valid")
    with pytest.raises(ValueError, match=r"either --split .* or --valid-data-path"):
        TrainConfig(split="98,2", valid_data_path=("x",))
    with pytest.raises(ValueError, match="--eval-interval=0"):
        TrainConfig(eval_interval=0, split="9,1")
    with pytest.raises(ValueError, match="--eval-interval=5 needs validation data"):
        TrainConfig(eval_interval=5)
    with pytest.raises(ValueError, match="--split"):
        TrainConfig(split="x")

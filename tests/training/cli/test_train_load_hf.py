"""``moefold train --load-hf``: the architecture comes from the directory, only training-side flags may change it,
and data that does not match the model (vocabulary, tokenizer) is refused before any rank starts. A shipped
tokenizer (no <|endoftext|>) prepares data as it is. End to end: tests/training/test_train_from_hf.py."""

from __future__ import annotations

import numpy as np
import pytest

from moefold.training.cli import build_parser
from moefold.training.cli import main as cli
from moefold.training.cli.train import config_from_args
from moefold.training.data import IndexedDataset, prepare
from moefold.training.data.indexed import IndexedDatasetWriter
from tests.models.hf_tiny import VOCAB, save_hf, save_tokenizer

pytest.importorskip("transformers")


@pytest.fixture
def hf_dir(tmp_path):
    save_hf("mixtral", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf", separator="</s>")
    return tmp_path / "hf"


def _data(path, vocab: int) -> str:
    with IndexedDatasetWriter(path, vocab) as writer:
        writer.add_document(np.arange(1, 60) % vocab)
    return str(path)


def _train(tmp_path, monkeypatch, *flags: str) -> int:
    monkeypatch.setattr("moefold.training.cli.train.run_ranks", lambda *_a, **_k: pytest.fail("a rank was started"))
    return cli(["train", "--run-dir", str(tmp_path / "run"), "--no-save", "--seq-length", "16", *flags])


def test_training_side_flags_only(hf_dir, tmp_path, monkeypatch, capsys):
    data = _data(tmp_path / "d", VOCAB)
    parse = lambda *f: config_from_args(build_parser("train").parse_args(["train", "--load-hf", str(hf_dir), *f]))
    c = parse("--data-path", data, "--moe-aux-loss-coeff", "0.5", "--moe-z-loss-coeff", "1e-3",
              "--recompute-granularity", "full", "--moe-expert-capacity-factor", "1.25")
    assert (c.model.num_experts, c.model.hidden_size, c.model.sliding_window) == (4, 32, 8)   # config.json's
    assert (c.model.moe_aux_loss_coeff, c.model.moe_z_loss_coeff, c.model.moe_expert_capacity_factor) == \
        (0.5, 1e-3, 1.25)
    assert c.options.recompute == "full" and c.train.load_hf == str(hf_dir) and c.recipe is None
    for flags, message in [(["--hidden-size", "64"], "--hidden-size cannot be combined with --load-hf"),
                           (["--num-experts", "8"], "--num-experts cannot be combined with --load-hf"),
                           (["--moe-router-score-function", "sigmoid"], "--moe-router-score-function cannot be"),
                           (["--vocab-size", "512"], "--vocab-size cannot be combined"),
                           (["--recipe", "mixtral_tiny"], "give one (the model comes from --load-hf"),
                           (["--moe-use-upcycling"], "needs --num-experts"),
                           ([], "--load-hf needs --data-path")]:
        extra = [] if "--data-path" in message else ["--data-path", data]
        assert _train(tmp_path, monkeypatch, "--load-hf", str(hf_dir), *extra, *flags) == 2
        assert message in capsys.readouterr().err, message
    assert _train(tmp_path, monkeypatch, "--recipe", "mixtral_tiny", "--moe-use-upcycling") == 2
    assert "--moe-use-upcycling needs --load-hf" in capsys.readouterr().err


def test_data_must_match_the_model(hf_dir, tmp_path, monkeypatch, capsys):
    big = _data(tmp_path / "big", 200)
    assert _train(tmp_path, monkeypatch, "--load-hf", str(hf_dir), "--data-path", big) == 2
    err = capsys.readouterr().err
    assert "was tokenised with a vocabulary of 200 ids" in err and "but the model has vocab_size=96" in err
    assert f"--tokenizer {hf_dir / 'tokenizer.json'}" in err
    # the same vocabulary size, another tokenizer
    (tmp_path / "a.txt").write_text("w1 w2 w3 " * 20)
    save_tokenizer(tmp_path, separator="<|endoftext|>")
    prepare([tmp_path / "a.txt"], tmp_path / "other", tokenizer=tmp_path / "tokenizer.json", progress=False)
    assert _train(tmp_path, monkeypatch, "--load-hf", str(hf_dir), "--data-path", str(tmp_path / "other")) == 2
    assert "not with the model's" in capsys.readouterr().err
    # --valid-data-path is checked too; a missing corpus is named
    ok = _data(tmp_path / "ok", VOCAB)
    assert _train(tmp_path, monkeypatch, "--load-hf", str(hf_dir), "--data-path", ok, "--valid-data-path", big) == 2
    assert "--valid-data-path" in capsys.readouterr().err
    assert _train(tmp_path, monkeypatch, "--load-hf", str(hf_dir), "--data-path", str(tmp_path / "none")) == 2
    err = capsys.readouterr().err
    assert f"--data-path {tmp_path / 'none'}" in err and "no such file" in err


def test_prepare_data_with_a_shipped_tokenizer(hf_dir, tmp_path, monkeypatch, capsys):
    """A model's own tokenizer.json (separator </s>, as Mistral's) prepares data that trains that model."""
    (tmp_path / "docs.jsonl").write_text('{"text": "w1 w2 w3"}\n{"text": "w4 w5"}\n')
    assert cli(["prepare-data", "--input", str(tmp_path / "docs.jsonl"), "--output-prefix", str(tmp_path / "c"),
                "--tokenizer", str(hf_dir / "tokenizer.json"), "--workers", "1", "--no-progress"]) == 0
    data = IndexedDataset(tmp_path / "c")
    assert data.tokens.tolist() == [1, 2, 3, 0, 4, 5, 0] and data.vocab_size == VOCAB   # </s> is id 0 here
    capsys.readouterr()
    monkeypatch.setattr("moefold.training.cli.train.run_ranks", lambda *_a, **_k: None)
    assert cli(["train", "--load-hf", str(hf_dir), "--data-path", str(tmp_path / "c"), "--seq-length", "4",
                "--run-dir", str(tmp_path / "run"), "--no-save"]) == 0

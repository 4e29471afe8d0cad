"""``prepare-data --hf-dataset PATH`` (issue 27, item 7): datasets written by HF ``datasets``' own code
(``save_to_disk``, ``to_parquet``, ``to_json``), built here from a few documents, tokenise to the same corpus as the
same documents given as JSONL; splits, the text field, and every bad input are one line, exit 2."""

from __future__ import annotations

import io
import json
import sys

import pytest

from moefold.training.cli import main as cli_main
from moefold.training.data import prepare
from tests.training.data.test_prepare import DOCS, _decode_docs

datasets = pytest.importorskip("datasets")

TEXTS = [DOCS[0], "", DOCS[1], None, DOCS[2], DOCS[3]]   # an empty and a null text are skipped, like empty lines
KEPT = [t for t in TEXTS if t]


def _table(texts=TEXTS):
    return datasets.Dataset.from_dict({"content": texts, "id": list(range(len(texts)))})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same documents as JSONL, through --input: the corpus every dataset format must reproduce."""
    tmp = tmp_path_factory.mktemp("jsonl")
    (tmp / "docs.jsonl").write_text("\n".join(json.dumps({"content": t}) for t in KEPT) + "\n")
    prefix = tmp / "ref"
    assert cli_main(["prepare-data", "--input", str(tmp / "docs.jsonl"), "--text-key", "content", "--vocab-size",
                     "300", "--output-prefix", str(prefix), "--workers", "1", "--no-progress"]) == 0
    return prefix


def _bytes(prefix) -> tuple[bytes, bytes, str]:
    return (prefix.with_suffix(".bin").read_bytes(), prefix.with_suffix(".idx").read_bytes(),
            prefix.with_name(prefix.name + ".tokenizer.json").read_text())


def _prepare(path, prefix, *flags) -> int:
    return cli_main(["prepare-data", "--hf-dataset", str(path), "--text-key", "content", "--vocab-size", "300",
                     "--output-prefix", str(prefix), "--workers", "1", "--no-progress", *flags])


@pytest.mark.parametrize("kind", ["save_to_disk", "parquet", "json", "parquet_dir"])
def test_every_local_format_gives_the_jsonl_corpus(tmp_path, reference, kind):
    table = _table()
    if kind == "save_to_disk":
        path = tmp_path / "saved"
        table.save_to_disk(str(path))
    elif kind == "parquet":
        path = tmp_path / "docs.parquet"
        table.to_parquet(str(path))
    elif kind == "json":
        path = tmp_path / "docs.jsonl"
        table.to_json(str(path))   # JSON Lines, datasets' default
    else:   # a directory of shards, read in sorted order
        path = tmp_path / "shards"
        path.mkdir()
        _table(TEXTS[:3]).to_parquet(str(path / "part-0.parquet"))
        _table(TEXTS[3:]).to_parquet(str(path / "part-1.parquet"))
    prefix = tmp_path / "out"
    assert _prepare(path, prefix) == 0
    assert _decode_docs(prefix) == KEPT
    assert _bytes(prefix) == _bytes(reference)   # the same BPE and tokens as the JSONL input


def test_dataset_dict_split_and_text_key(tmp_path, capsys):
    path = tmp_path / "dict"
    datasets.DatasetDict({"train": _table(), "valid": _table(["only this one"])}).save_to_disk(str(path))
    assert _prepare(path, tmp_path / "valid", "--hf-split", "valid") == 0
    assert _decode_docs(tmp_path / "valid") == ["only this one"]
    assert _prepare(path, tmp_path / "train") == 0   # the default split: train
    assert _decode_docs(tmp_path / "train") == KEPT
    capsys.readouterr()
    for flags, message in ((["--hf-split", "test"], "no split 'test' (splits: train, valid); choose one with "
                                                    "--hf-split"),
                           (["--text-key", "body"], "no 'body' field (fields: content, id); choose it with "
                                                    "--text-key")):
        assert _prepare(path, tmp_path / "bad", *flags) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err


def test_bad_paths_are_one_line_and_nothing_is_downloaded(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    cases = {"HuggingFaceFW/fineweb": "no such file or directory (a local dataset",
             str(tmp_path / "notes"): "neither a dataset saved with save_to_disk"}
    for path, message in cases.items():
        assert _prepare(path, tmp_path / "bad") == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("moefold prepare-data: error: --hf-dataset") and message in err and "\n" not in err


def test_without_the_datasets_package_one_line_names_it(tmp_path, monkeypatch, capsys):
    _table().to_parquet(str(tmp_path / "docs.parquet"))
    capsys.readouterr()   # datasets' own progress bar
    monkeypatch.setitem(sys.modules, "datasets", None)   # import datasets -> ImportError
    assert _prepare(tmp_path / "docs.parquet", tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert "--hf-dataset needs the datasets package: pip install 'moefold[datasets]'" in err and "\n" not in err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_counts_the_rows_on_a_terminal(tmp_path, monkeypatch):
    from moefold.training.data.hf_dataset import HFDocuments

    _table().save_to_disk(str(tmp_path / "saved"))
    docs = HFDocuments(tmp_path / "saved", text_key="content")
    assert docs.total == len(TEXTS)   # known before reading: the bar has its total
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    prepare([], tmp_path / "out", vocab_size=300, documents=docs)
    shown = terminal.getvalue()
    assert "training the BPE: 100%" in shown and "tokenising -> out: 100%" in shown
    assert f"{len(KEPT)}/{len(KEPT)}" in shown

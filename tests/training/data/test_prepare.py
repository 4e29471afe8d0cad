"""prepare-data round trip, the indexed format, and every malformed-input case."""

import json
import struct

import numpy as np
import pytest

from moefold.training.cli import main as cli_main
from moefold.training.data import (
    EOS_TOKEN,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetWriter,
    load_tokenizer,
    prepare,
    token_dtype,
    tokenizer_path,
)
from moefold.training.data.indexed import HEADER_BYTES, idx_path

DOCS = [
    "def f(x):\n    return x * 2\n",
    "ünïcödé 日本語 🎉 and  double  spaces\n\ttabs\r\nCRLF",
    "  leading spaces and trailing ones   ",
    "The quick brown fox jumps over the lazy dog. " * 20,
]


def _decode_docs(prefix):
    tok = load_tokenizer(tokenizer_path(prefix))
    eos = tok.token_to_id(EOS_TOKEN)
    ds = IndexedDataset(prefix)
    out = []
    for d in range(ds.num_docs):
        ids = np.asarray(ds.document(d)).tolist()
        assert ids[-1] == eos and eos not in ids[:-1]
        out.append(tok.decode(ids[:-1]))
    return out


def test_round_trip_jsonl_and_text_with_workers(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(DOCS)) + "\n\n")
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(DOCS):
        (tmp_path / "txt" / f"{i}.txt").write_text(d, encoding="utf-8")
    (tmp_path / "txt" / "ignored.bin").write_bytes(b"\xff")
    prefix = tmp_path / "out" / "corpus"
    stats = prepare([jsonl, tmp_path / "txt"], prefix, vocab_size=300, json_key="body", workers=2, progress=False)
    assert stats.num_docs == 2 * len(DOCS)
    assert _decode_docs(prefix) == DOCS + DOCS
    ds = IndexedDataset(prefix)
    assert ds.dtype is np.uint16 and ds.num_tokens == stats.num_tokens and ds.vocab_size == stats.vocab_size

    # Re-using the saved tokenizer through the CLI gives the same tokens.
    prefix2 = tmp_path / "again"
    rc = cli_main(["prepare-data", "--input", str(jsonl), "--json-key", "body", "--output-prefix", str(prefix2),
                   "--tokenizer", str(tokenizer_path(prefix)), "--workers", "1", "--no-progress"])
    assert rc == 0
    np.testing.assert_array_equal(IndexedDataset(prefix2).tokens, ds.tokens[:IndexedDataset(prefix2).num_tokens])


def test_a_vocabulary_smaller_than_asked_says_what_to_train_with(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("\n".join(DOCS), encoding="utf-8")
    prefix = tmp_path / "o"
    assert cli_main(["prepare-data", "--input", str(tmp_path / "a.txt"), "--output-prefix", str(prefix),
                     "--vocab-size", "32000", "--workers", "1", "--no-progress"]) == 0
    got = IndexedDataset(prefix).vocab_size
    assert got < 32000 and (f"note: the corpus gave {got:,} tokens of the --vocab-size 32,000 asked for; train with "
                            f"--vocab-size {got} (--vocab-size 32000 would build") in capsys.readouterr().out


def test_token_dtype_and_uint32_round_trip(tmp_path):
    assert token_dtype(65535) is np.uint16 and token_dtype(65536) is np.uint32
    docs = [np.array([0, 70000, 5]), np.array([65535, 1])]
    with IndexedDatasetWriter(tmp_path / "big", vocab_size=70001) as w:
        for d in docs:
            w.add_document(d)
    ds = IndexedDataset(tmp_path / "big")
    assert ds.dtype is np.uint32
    assert [ds.document(i).tolist() for i in range(2)] == [d.tolist() for d in docs]
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 10\)"), \
            IndexedDatasetWriter(tmp_path / "bad", vocab_size=10) as w:
        w.add_document([3, 10])
    assert not (tmp_path / "bad.idx").exists() and not list(tmp_path.glob("bad.bin*"))


@pytest.fixture
def small_corpus(tmp_path):
    prefix = tmp_path / "c"
    with IndexedDatasetWriter(prefix, vocab_size=100) as w:
        for n in (5, 7, 3):
            w.add_document(np.arange(n) % 100)
    return prefix


def test_truncated_bin(small_corpus):
    b = small_corpus.with_suffix(".bin")
    b.write_bytes(b.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"c\.bin: 28 bytes, but c\.idx says 15 tokens x 2 bytes = 30"):
        IndexedDataset(small_corpus)


def test_idx_of_other_version_or_magic(small_corpus):
    i = idx_path(small_corpus)
    raw = bytearray(i.read_bytes())
    raw[8:16] = struct.pack("<Q", 7)
    i.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"c\.idx: index format version 7 is not supported .*versions 1 and 2"):
        IndexedDataset(small_corpus)
    raw[0:8] = b"MMIDIDX\0"
    i.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"c\.idx: not a moefold index file \(magic b'MMIDIDX"):
        IndexedDataset(small_corpus)
    i.write_bytes(bytes(raw[:47]))
    with pytest.raises(ValueError, match="shorter than the 48-byte header"):
        IndexedDataset(small_corpus)
    raw[0:16] = b"MOEFIDX\0" + struct.pack("<Q", 2)   # version 2 cut inside its largest-id field
    i.write_bytes(bytes(raw[:HEADER_BYTES - 1]))
    with pytest.raises(ValueError, match=f"shorter than the {HEADER_BYTES}-byte header"):
        IndexedDataset(small_corpus)


def test_truncated_idx_and_missing_files(small_corpus):
    i = idx_path(small_corpus)
    i.write_bytes(i.read_bytes()[:-8])
    with pytest.raises(ValueError, match=r"c\.idx: .* needs .* bytes \(truncated or corrupt\)"):
        IndexedDataset(small_corpus)
    with pytest.raises(FileNotFoundError, match=r"nope\.idx: no such file"):
        IndexedDataset(small_corpus.parent / "nope")


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n" + json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match=r"empty corpus: the 2 input file\(s\) .* hold no non-empty document"):
        prepare([tmp_path / "empty.txt", tmp_path / "blank.jsonl"], tmp_path / "o", vocab_size=300, progress=False)
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="empty corpus: no input files found"):
        prepare([tmp_path / "d"], tmp_path / "o", vocab_size=300, progress=False)
    with IndexedDatasetWriter(tmp_path / "zero", vocab_size=10):
        pass
    with pytest.raises(ValueError, match=r"zero\.bin: empty corpus"):
        GPTDataset(tmp_path / "zero", seq_len=4)


def test_sequence_longer_than_data(small_corpus):
    GPTDataset(small_corpus, seq_len=14)  # 15 tokens: exactly one sample fits
    with pytest.raises(ValueError,
                       match=r"seq_len=15 is longer than the data: .* 16 tokens but .*c\.bin holds only 15"):
        GPTDataset(small_corpus, seq_len=15)


def test_jsonl_errors_name_file_and_line(tmp_path, capsys):
    f = tmp_path / "x.jsonl"
    f.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"content": "no text"}) + "\n")
    with pytest.raises(ValueError, match=r"x\.jsonl:2: no 'text' field \(fields present: \['content'\]\).*--text-key"):
        prepare([f], tmp_path / "o", vocab_size=300, progress=False)
    f.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"x\.jsonl:2: invalid JSON"):
        prepare([f], tmp_path / "o", vocab_size=300, progress=False)
    f.write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:1: field 'text' is a int, expected a string"):
        prepare([f], tmp_path / "o", vocab_size=300, progress=False)
    (tmp_path / "latin.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin\.txt: not UTF-8 text"):
        prepare([tmp_path / "latin.txt"], tmp_path / "o", vocab_size=300, progress=False)
    with pytest.raises(FileNotFoundError, match=r"input .*missing\.txt: no such file"):
        prepare([tmp_path / "missing.txt"], tmp_path / "o", vocab_size=300, progress=False)
    # The CLI turns these into one error line on stderr and exit status 2.
    rc = cli_main(["prepare-data", "--input", str(tmp_path / "missing.txt"), "--output-prefix", str(tmp_path / "o"),
                   "--vocab-size", "300", "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("moefold prepare-data: error: input ") and "missing.txt: no such file" in err


def test_bad_tokenizer_and_vocab(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        prepare([tmp_path / "a.txt"], tmp_path / "o", vocab_size=100, progress=False)
    with pytest.raises(FileNotFoundError, match=r"--tokenizer .*nope\.json: no such file"):
        prepare([tmp_path / "a.txt"], tmp_path / "o", tokenizer=tmp_path / "nope.json", progress=False)

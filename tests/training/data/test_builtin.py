"""The built-in standard-library corpus: prepared once, cached, round-trips, deterministic."""

import sysconfig

import numpy as np

from moefold.training.data import IndexedDataset, builtin_corpus, load_tokenizer, stdlib_files, tokenizer_path


def test_builtin_corpus_small_cap(tmp_path):
    cap = 64 * 1024
    files = stdlib_files(cap)
    assert files == stdlib_files(cap) and len(files) >= 2
    assert all("site-packages" not in f.parts for f in files)
    assert sum(f.stat().st_size for f in files[:-1]) < cap <= sum(f.stat().st_size for f in files)

    prefix = builtin_corpus(vocab_size=512, cache_dir=tmp_path / "b", max_bytes=cap)
    ds = IndexedDataset(prefix)
    assert ds.num_docs == len(files) and ds.vocab_size <= 512
    tok = load_tokenizer(tokenizer_path(prefix))
    assert tok.decode(np.asarray(ds.document(1)).tolist()[:-1]) == files[1].read_text(encoding="utf-8")
    mtime = (tmp_path / "b" / "stdlib.idx").stat().st_mtime_ns
    assert builtin_corpus(vocab_size=512, cache_dir=tmp_path / "b", max_bytes=cap) == prefix
    assert (tmp_path / "b" / "stdlib.idx").stat().st_mtime_ns == mtime  # cached, not rebuilt


def test_default_cache_dir_name(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    prefix = builtin_corpus(vocab_size=300, max_bytes=8 * 1024)
    assert prefix.startswith(str(tmp_path / "moefold" / "stdlib-"))
    assert "-v300-" in prefix and sysconfig.get_paths()["stdlib"]

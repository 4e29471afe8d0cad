"""A corrupt ``.idx`` never trains (issue 47, row 6): every document offset is checked on open, vectorised and in
chunks (a bad offset at a chunk's edge is found too), for moefold's index and Megatron's; ``moefold train`` refuses
it, and a blend weight of 0 or below, in one line, exit 2, before any rank starts (row 7)."""

from __future__ import annotations

import numpy as np
import pytest

from moefold.training.cli import main as cli_main
from moefold.training.data.indexed import HEADER_BYTES, IndexedDataset, IndexedDatasetWriter, check_offsets
from moefold.training.data.megatron_indexed import (
    HEADER_BYTES as MEGATRON_HEADER_BYTES,
)
from moefold.training.data.megatron_indexed import (
    MegatronIndexedDataset,
    MegatronIndexedDatasetWriter,
)
from tests.training.launch.cli_runs import TINY, corpus

LENGTHS = [40, 3, 17, 25, 9, 33]   # 127 tokens


def _write(prefix, writer=IndexedDatasetWriter) -> None:
    rng = np.random.default_rng(0)
    with writer(prefix, vocab_size=256) as w:
        for n in LENGTHS:
            w.add_document(rng.integers(0, 256, n))


def _poke(path, offset: int, value: int) -> None:
    """Overwrite the little-endian int64 at byte ``offset`` of ``path``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.int64(value).tobytes())


@pytest.mark.parametrize("doc,value,named", [
    (3, 2**40, "document offset 3 is 1099511627776 (the one before: 43;"),
    (3, 20, "document offset 3 is 20 (the one before: 43;"),   # decreasing
    (2, -5, "document offset 2 is -5 (the one before: 40;"),
])
def test_an_inconsistent_document_offset_is_refused_on_open(tmp_path, doc, value, named):
    prefix = tmp_path / "c"
    _write(prefix)
    IndexedDataset(prefix)   # intact: opens
    _poke(f"{prefix}.idx", HEADER_BYTES + 8 * doc, value)
    with pytest.raises(ValueError, match=rf"c\.idx: {named.replace('(', '[(]')}.*corrupt index"):
        IndexedDataset(prefix)


def test_the_check_is_chunked_and_finds_a_bad_offset_at_a_chunks_edge():
    good = np.array([0, 2, 2, 5, 9, 9, 12, 15], dtype=np.int64)
    for chunk in (1, 2, 3, 8):
        check_offsets(good, 15, "x: document", chunk=chunk)
        for i in range(1, len(good) - 1):
            bad = good.copy()
            bad[i] = bad[i - 1] - 1
            with pytest.raises(ValueError, match=f"x: document offset {i} is "):
                check_offsets(bad, 15, "x: document", chunk=chunk)


def test_a_corrupt_megatron_index_is_refused_on_open(tmp_path):
    prefix = tmp_path / "m"
    _write(prefix, MegatronIndexedDatasetWriter)
    MegatronIndexedDataset(prefix)
    n = len(LENGTHS)
    docs_at = MEGATRON_HEADER_BYTES + 12 * n
    _poke(f"{prefix}.idx", docs_at + 8 * 3, 1)   # document 3 starts before document 2
    with pytest.raises(ValueError, match=r"m\.idx: document index offset 3 is 1 \(the one before: 2;"):
        MegatronIndexedDataset(prefix)


def _train(capsys, *args: str) -> tuple[int, str]:
    code = cli_main(["train", *TINY, "--no-save", "--train-iters", "2", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_train_refuses_a_corrupt_index_and_a_non_positive_blend_weight_in_one_line(tmp_path, capsys,
                                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    prefix = str(corpus(tmp_path / "tiny"))
    for weight in ("0", "-1", "inf"):
        code, out = _train(capsys, "--data-path", weight, prefix, "1", prefix)
        assert code == 2, out
        (line,) = out.strip().splitlines()
        assert line.startswith(f"moefold train: error: --data-path: the weight {float(weight):g} of {prefix} must be "
                               "a positive finite number"), line
    _poke(f"{prefix}.idx", HEADER_BYTES + 8, 2**40)
    code, out = _train(capsys, "--data-path", prefix)
    assert code == 2, out
    (line,) = out.strip().splitlines()
    assert line.startswith(f"moefold train: error: --data-path {prefix}: {prefix}.idx: document offset 1 is "
                           "1099511627776"), line

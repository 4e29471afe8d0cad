"""Fixed-length samples, deterministic shuffling, index caching, blending and exact resume."""

import numpy as np
import pytest

from moefold.training.data import (
    BlendedDataset,
    GPTDataset,
    IndexedDatasetWriter,
    MicroBatchLoader,
    MicroBatchSampler,
    blend_indices,
    build_blended,
    parse_data_path,
)


def _corpus(path, lengths, start=0, vocab=1000):
    """Documents of consecutive ids (doc d holds start + its stream positions) so samples are checkable."""
    with IndexedDatasetWriter(path, vocab_size=vocab) as w:
        pos = start
        for n in lengths:
            w.add_document(np.arange(pos, pos + n) % vocab)
            pos += n
    return path


def test_samples_cover_stream_without_shuffle(tmp_path):
    prefix = _corpus(tmp_path / "c", [5, 1, 9, 3, 7])  # 25 tokens: 0..24
    ds = GPTDataset(prefix, seq_len=4, shuffle=False, cache_dir=tmp_path / "cache")
    assert len(ds) == 6  # (25 - 1) // 4
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds[i], np.arange(4 * i, 4 * i + 5))
    # More samples than one epoch: the next epoch starts the stream again (the 25th token closes no sample).
    ds = GPTDataset(prefix, seq_len=4, num_samples=10, shuffle=False, cache_dir=tmp_path / "cache")
    for i in range(10):
        np.testing.assert_array_equal(ds[i], np.arange(4 * (i % 6), 4 * (i % 6) + 5))


def test_shuffle_is_deterministic_and_cached(tmp_path):
    prefix = _corpus(tmp_path / "c", list(range(1, 40)))
    a = GPTDataset(prefix, seq_len=8, num_samples=150, seed=3)   # 780 tokens: 97 samples per epoch, 2 epochs
    assert not a.cache_hit and len(list((tmp_path / "c.cache").glob("*.npy"))) == 2 * 2
    b = GPTDataset(prefix, seq_len=8, num_samples=150, seed=3)
    assert b.cache_hit
    c = GPTDataset(prefix, seq_len=8, num_samples=150, seed=4)
    assert not c.cache_hit
    sa, sb, sc = (np.stack([d[i] for i in range(150)]) for d in (a, b, c))
    np.testing.assert_array_equal(sa, sb)
    assert not np.array_equal(sa, sc)
    # Shuffled, but still a permutation of the same fixed-length windows of a document-shuffled stream.
    assert not np.array_equal(sa, np.stack([GPTDataset(prefix, 8, 150, shuffle=False)[i] for i in range(150)]))
    assert sorted(map(tuple, sa)) == sorted(map(tuple, sb))
    with pytest.raises(IndexError, match=r"sample 150 out of range \[0, 150\)"):
        a[150]


def test_data_order_does_not_depend_on_the_run_length(tmp_path):
    """Sample i is the same for every num_samples (a longer run continues a shorter one); each epoch is a
    different shuffle; the order depends on the seed and seq_len."""
    prefix = _corpus(tmp_path / "c", [13, 29, 7, 51, 3, 17] * 5)   # 600 tokens: 74 samples of 8 per epoch
    short = GPTDataset(prefix, seq_len=8, num_samples=40, seed=3)
    long = GPTDataset(prefix, seq_len=8, num_samples=400, seed=3)
    samples = np.stack([long[i] for i in range(400)])
    np.testing.assert_array_equal(np.stack([short[i] for i in range(40)]), samples[:40])
    assert len(short.epochs) == 1 and len(long.epochs) == 6
    epoch0, epoch1 = samples[:74], samples[74:148]
    assert not np.array_equal(epoch0, epoch1)            # reshuffled: documents and samples
    assert sorted(map(tuple, epoch0)) != sorted(map(tuple, epoch1))
    assert not np.array_equal(GPTDataset(prefix, 8, 40, seed=4)[0], short[0])
    # a cached epoch is reused by a run of another length
    assert GPTDataset(prefix, seq_len=8, num_samples=100, seed=3).cache_hit

    a, b = _corpus(tmp_path / "a", [50] * 10, start=0), _corpus(tmp_path / "b", [50] * 10, start=500)
    blended = [build_blended([a, b], [0.3, 0.7], seq_len=9, num_samples=n, seed=1) for n in (30, 300)]
    np.testing.assert_array_equal(np.stack([blended[0][i] for i in range(30)]),
                                  np.stack([blended[1][i] for i in range(30)]))
    rng = np.random.default_rng(0)
    for _ in range(50):   # blend order: a longer blend begins with a shorter one, for any weights
        w = rng.random(rng.integers(2, 12)) ** 3 + 1e-3
        full = blend_indices(w, 3000)
        for n in rng.integers(1, 3000, size=5):
            np.testing.assert_array_equal(blend_indices(w, int(n))[0], full[0][:n])
            np.testing.assert_array_equal(blend_indices(w, int(n))[1], full[1][:n])


def test_token_outside_the_vocabulary_names_the_file(tmp_path):
    prefix = _corpus(tmp_path / "c", [40], vocab=1000)
    idx = tmp_path / "c.idx"
    raw = bytearray(idx.read_bytes())
    raw[40:48] = (16).to_bytes(8, "little")   # the header now says vocab 16, the tokens run to 39
    idx.write_bytes(bytes(raw))
    ds = GPTDataset(prefix, seq_len=4, shuffle=False)
    np.testing.assert_array_equal(ds[0], np.arange(5))
    with pytest.raises(ValueError, match=r"c\.bin: token id 2\d in sample 5 is outside the vocabulary of 16"):
        ds[5]


def test_blend_proportions_exact(tmp_path):
    for weights in ([0.3, 0.7], [1, 2, 3], [0.05, 0.9, 0.05], [5]):
        w = np.asarray(weights, float) / np.sum(weights)
        for n in (1, 7, 100, 1001):
            di, dsi = blend_indices(weights, n)
            assert len(di) == n
            for prefix in (n, max(1, n // 3)):
                counts = np.bincount(di[:prefix], minlength=len(w))
                assert np.all(np.abs(counts - w * prefix) <= 1.0), (weights, n, prefix, counts)
            for d in range(len(w)):  # each dataset's samples are taken in order 0, 1, 2, ...
                np.testing.assert_array_equal(dsi[di == d], np.arange((di == d).sum()))
    np.testing.assert_array_equal(blend_indices([1, 3], 50)[0], blend_indices([1, 3], 50)[0])
    with pytest.raises(ValueError, match="must all be positive"):
        blend_indices([1, -1], 5)

    a = _corpus(tmp_path / "a", [50] * 10, start=0)     # ids 0..499
    b = _corpus(tmp_path / "b", [50] * 10, start=500)   # ids 500..999
    blended = build_blended([a, b], [0.25, 0.75], seq_len=9, num_samples=200, seed=1)
    assert isinstance(blended, BlendedDataset) and len(blended) == 200
    from_a = sum(int(blended[i][0] < 500) for i in range(200))
    assert from_a == 50
    assert parse_data_path(["0.3", "x", "0.7", "y"]) == (["x", "y"], [0.3, 0.7])
    assert parse_data_path(["x"]) == (["x"], [1.0])
    with pytest.raises(ValueError, match="pairs of WEIGHT PREFIX"):
        parse_data_path(["a", "b"])
    with pytest.raises(ValueError, match=r"takes 50 samples from .*a but that dataset was built with 10"):
        BlendedDataset([GPTDataset(a, 9, 10), GPTDataset(b, 9, 150)], [0.25, 0.75], 200)


def test_exact_resume_and_dp_layouts(tmp_path):
    ds = GPTDataset(_corpus(tmp_path / "c", [13, 29, 7, 51, 3] * 8), seq_len=6, num_samples=96, seed=5)
    mbs = 2
    full = [b.clone() for b in MicroBatchLoader(ds, mbs)]
    assert len(full) == 48 and tuple(full[0].shape) == (2, 7)

    # Interrupt after 7 micro-batches, save, resume in a fresh loader: the rest is identical.
    first = MicroBatchLoader(ds, mbs)
    it = iter(first)
    head = [next(it) for _ in range(7)]
    state = first.state_dict()
    assert state == {"consumed_samples": 14}
    resumed = MicroBatchLoader(ds, mbs)
    resumed.load_state_dict(state)
    got = head + list(resumed)
    assert len(got) == len(full)
    for x, y in zip(got, full):
        assert np.array_equal(x.numpy(), y.numpy())

    # dp=4 ranks resumed at consumed_samples=16: together they yield the same samples in the same order.
    dp = 4
    per_rank = [list(MicroBatchLoader(ds, mbs, r, dp, consumed_samples=16, as_numpy=True)) for r in range(dp)]
    merged = np.concatenate([np.concatenate([per_rank[r][k] for r in range(dp)]) for k in range(len(per_rank[0]))])
    np.testing.assert_array_equal(merged, np.concatenate([b.numpy() for b in full])[16:])

    s = MicroBatchSampler(10, 2, 1, 2, consumed_samples=4)
    assert list(s) == [[6, 7]] and s.state_dict() == {"consumed_samples": 8}
    with pytest.raises(ValueError, match=r"dp_rank=2 must lie in \[0, dp_size=2\)"):
        MicroBatchSampler(10, 2, 2, 2)
    with pytest.raises(ValueError, match=r"consumed_samples=11 lies outside"):
        MicroBatchSampler(10, 2, consumed_samples=11)

"""tests/tolerance.py: another summation order of the same terms passes, a defect of the kinds layouts have fails.

The quantity is a norm weight's gradient in miniature: per column, a sum over many tokens of products that mostly
cancel, so its rounding error is large against its own size (the case a bound relative to the largest element
alone got wrong on one CPU kind)."""

from __future__ import annotations

import pytest
import torch

from tests.tolerance import assert_within_fp32_noise


def _terms() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    terms = torch.randn(4096, 16, generator=g, dtype=torch.float64)
    return terms - terms.mean(0)   # columns that cancel to ~0 in exact arithmetic


def test_another_summation_order_passes_and_defects_fail():
    terms = _terms()
    exact = {"w": terms.sum(0) + 1e-3}
    ref32 = {"w": terms.float().sum(0) + 1e-3}
    chunks = terms.float().reshape(4, 1024, 16)   # "tp4": four partial sums, then their sum
    reordered = {"w": chunks.sum(1).flip(0).sum(0) + 1e-3}
    assert_within_fp32_noise(reordered, ref32, exact, "reordered")
    missing = {"w": chunks[1:].sum(1).sum(0) + 1e-3}    # one rank's partial sum not reduced
    with pytest.raises(AssertionError, match="fp32's own error"):
        assert_within_fp32_noise(missing, ref32, exact, "missing")
    doubled = {"w": ref32["w"] * 2}   # a wrong scale: a dp average that divides by one rank too few
    with pytest.raises(AssertionError, match="fp32's own error"):
        assert_within_fp32_noise(doubled, ref32, exact, "scaled")

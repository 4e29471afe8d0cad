"""Softmax attention's time (``planner.gemm_efficiency.softmax_attention_seconds``): its tensor cores' part and its
exponentials' reproduce the FlashAttention-3 rates the model was built on (H100, head dim 128), land near the paper's
head-dim-64 figures, count the backward as FlashAttention does (2.5 x the forward's FLOPs), and give Blackwell Ultra's
doubled exponentials (GB300) a faster attention than GB200's at the same tensor-core peak."""

from __future__ import annotations

import pytest

from moefold.planner.cluster import load_cluster
from moefold.planner.gemm_efficiency import ATTENTION_BACKWARD_FLOPS, ATTENTION_SHARE, softmax_attention_seconds

FLOPS = 1e15   # a forward's scores and values


def rate(cluster: str, head_dim: int, backward: bool) -> float:
    """TFLOP/s in FlashAttention's count (the backward's FLOPs are 2.5 x the forward's)."""
    seconds = softmax_attention_seconds(load_cluster(cluster), FLOPS, 2 * head_dim, backward)
    return FLOPS * (ATTENTION_BACKWARD_FLOPS if backward else 1.0) / seconds / 1e12


def test_h100_head_dim_128_is_flashattention_3s_rate() -> None:
    peak = load_cluster("h100").bf16_tflops
    assert rate("h100", 128, False) == pytest.approx(ATTENTION_SHARE[0] * peak, rel=0.01)
    assert rate("h100", 128, True) == pytest.approx(ATTENTION_SHARE[1] * peak, rel=0.01)


def test_h100_head_dim_64_near_the_papers_figures() -> None:
    """FlashAttention-3 paper, H100 bf16 seq 4k, head dim 64: 476 forward, 453 backward (cuDNN 408 / 417)."""
    assert 408 <= rate("h100", 64, False) <= 476
    assert 417 <= rate("h100", 64, True) <= 453


def test_backward_takes_flashattentions_count() -> None:
    """At the same rate the backward would take 2.5 x the forward; it is slower per FLOP, so more than 2.5 x."""
    h100 = load_cluster("h100")
    fwd = softmax_attention_seconds(h100, FLOPS, 256, False)
    assert softmax_attention_seconds(h100, FLOPS, 256, True) > 2.5 * fwd   # FlashAttention-2: five GEMMs to two


def test_gb300_exponentials_speed_attention_up_over_gb200() -> None:
    gb200, gb300 = load_cluster("gb200"), load_cluster("gb300")
    assert gb300.bf16_tflops == gb200.bf16_tflops and gb300.exp_tops == pytest.approx(2 * gb200.exp_tops)
    assert rate("gb300", 128, False) > 1.2 * rate("gb200", 128, False)
    # a narrow head pays the same exponentials for half the tensor-core work: a lower rate on every GPU
    for cluster in ("h100", "b200", "gb200", "gb300"):
        assert rate(cluster, 64, False) < rate(cluster, 128, False)


def test_cluster_file_takes_exp_tops(tmp_path) -> None:
    path = tmp_path / "x.toml"
    path.write_text('memory = "80GB"\nbf16_tflops = 989\nnvlink_gbps = 450\ninternode_gbps = 50\nexp_tops = 8.0\n')
    assert load_cluster(str(path)).exp_tops == 8.0
    path.write_text('memory = "80GB"\nbf16_tflops = 989\nnvlink_gbps = 450\ninternode_gbps = 50\nexp_tops = 0\n')
    with pytest.raises(ValueError, match="exp_tops=0 must be a positive number"):
        load_cluster(str(path))

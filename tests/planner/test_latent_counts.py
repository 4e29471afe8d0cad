"""The planner counts latent experts (``--moe-latent-size``): the experts' FLOPs run at width L plus the two
projections (here); the dispatch's L-wide rows are checked against the collectives a built block makes in
tests/planner/test_comm.py (its ``latent`` layouts)."""

from __future__ import annotations

from moefold.models.recipes import get_recipe
from moefold.training.observe.flops import ffn_macs


def test_flops_count_the_latent_width_and_the_projections() -> None:
    c = get_recipe("qwen3_moe_tiny")
    H, L, F, K, E = c.hidden_size, 16, c.moe_ffn_hidden_size, c.moe_topk, c.num_experts
    lat = c.with_(moe_latent_size=L)
    assert ffn_macs(c, True) == H * E + K * 3 * H * F
    assert ffn_macs(lat, True) == H * E + K * 3 * L * F + 2 * H * L

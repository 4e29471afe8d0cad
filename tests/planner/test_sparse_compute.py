"""``moefold plan``'s core-attention work of DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): the top-k keys each
query reads, the lightning indexer over every causal key and its loss (``training.observe.flops.dsa_macs``, what MFU
counts), not dense MLA's ``(S + 1) / 2`` keys."""

from __future__ import annotations

import pytest

from moefold.models.recipes import get_recipe
from moefold.planner.step_time import _score_macs
from moefold.training.observe.flops import dsa_macs


@pytest.mark.parametrize("recipe", ["deepseek_v32", "glm5"])
def test_dsa_score_macs_are_the_sparse_ones(recipe: str) -> None:
    m = get_recipe(recipe)
    seq = 131072
    assert _score_macs(m, seq, 3) == dsa_macs(m, seq)
    dense = m.num_attention_heads * (2 * m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim + m.mla.v_head_dim) * \
        (seq + 1) / 2
    assert _score_macs(m, seq, 3) < dense / 4   # 2048 of 65K keys on average, the indexer's n x d per key

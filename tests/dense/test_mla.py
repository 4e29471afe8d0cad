"""MLA (DeepSeek-V3 multi-latent attention): HF parity at world 1, every layout equals world 1."""

from dataclasses import replace

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds

from moefold.dense.attention_config import MLAConfig
from moefold.dense.mla import MLAttention
from moefold.dense.rope import YarnConfig
from moefold.parallel.sharding import is_sequence_parallel, shards_of
from tests.dense.attention_layouts import (
    STANDARD_LAYOUTS,
    Layout,
    attention_maker,
    check_layouts,
    init_all,
)
from tests.distributed import run_distributed

YARN = dict(factor=4.0, original_max_position_embeddings=8, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
# q low-rank, interleaved rope, YaRN softmax mscale, bias (HF attention_bias)
MLA_Q_LORA = MLAConfig(hidden_size=32, num_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True, bias=True, rope_theta=1000.0,
                       yarn=YarnConfig(**YARN))
# full q_proj, plain (non-interleaved) rope, no YaRN
MLA_PLAIN = MLAConfig(hidden_size=32, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                      v_head_dim=8, rope_interleave=False, rope_theta=1000.0)


def _layouts_rank():
    cache: dict = {}
    layouts = tuple(lay for lay in STANDARD_LAYOUTS if lay.recompute != "full")
    done = check_layouts(attention_maker(MLAttention, MLA_Q_LORA), layouts,
                         seq=16, batch=2, hidden=32, seed=4, dims_cache=cache)
    plain = (Layout(tp=4, sp=True), Layout(tp=2), Layout(tp=2, cp=2, sp=True, cp_comm="all_gather"),
             Layout(cp=4, cp_comm="p2p", recompute="selective"))
    done += check_layouts(attention_maker(MLAttention, MLA_PLAIN), plain,
                          seq=16, batch=2, hidden=32, seed=5, dims_cache=cache)
    # replicated down-projections are flagged under SP only; up-projections are split by heads
    sp = MLAttention(MLA_Q_LORA, cache[(4, 1)].tp_group, sequence_parallel=True)
    assert all(is_sequence_parallel(p) for n, p in sp.named_parameters() if "_a_" in n)
    assert shards_of(sp.kv_b_proj.weight)[0].num == 4 and sp.kv_b_proj.weight.shape == (4 * 14 // 4, 16)
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by tp=4"):
        MLAttention(replace(MLA_PLAIN, num_heads=6), cache[(4, 1)].tp_group)
    return done


def test_mla_layouts_equal_world1():
    done = run_distributed(_layouts_rank, 4)[0]
    assert len(done) == 16


def test_bad_configs():
    with pytest.raises(ValueError, match=r"MLAConfig\.qk_rope_head_dim=3 must be even"):
        replace(MLA_PLAIN, qk_rope_head_dim=3)
    with pytest.raises(ValueError, match=r"MLAConfig\.kv_lora_rank=0"):
        replace(MLA_PLAIN, kv_lora_rank=0)
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by tp=8"):
        MLA_PLAIN.check_parallel(8)
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 2\*cp=4"):
        replace(MLA_PLAIN, seq_length=10).check_parallel(1, 2)


@pytest.mark.parametrize("cfg", [MLA_Q_LORA, MLA_PLAIN], ids=["q_lora_yarn_interleave", "plain"])
def test_matches_hf(cfg):
    """World-1 output equals HF DeepseekV3Attention with the same weights (names map 1:1)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.yarn is not None:
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, **YARN}
    hf_cfg = DeepseekV3Config(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
                              num_key_value_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
                              kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                              qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                              rope_interleave=cfg.rope_interleave, attention_bias=cfg.bias, rope_parameters=rope,
                              max_position_embeddings=64, vocab_size=64, num_hidden_layers=1)
    hf_cfg._attn_implementation = "sdpa"
    hf_attn, rotary = hf_ds.DeepseekV3Attention(hf_cfg, 0), hf_ds.DeepseekV3RotaryEmbedding(hf_cfg)
    ours = MLAttention(cfg)
    init_all(ours, 6)
    result = hf_attn.load_state_dict(ours.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randn(12, 2, 32, generator=torch.Generator().manual_seed(0))
    cos, sin = rotary(x.transpose(0, 1), torch.arange(12)[None])
    expected, _ = hf_attn(x.transpose(0, 1), (cos, sin), None)
    torch.testing.assert_close(ours(x, torch.arange(12)).transpose(0, 1), expected, atol=1e-5, rtol=0)

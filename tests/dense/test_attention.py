"""GQA attention: HF parity at world 1, every TP/SP/CP/recompute layout equals world 1, bad configs."""

from dataclasses import replace

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral import modeling_mixtral as hf_mixtral
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen3

from moefold.dense.attention import GQAAttention
from moefold.dense.attention_config import AttentionConfig
from moefold.parallel.dims import ParallelConfig, ParallelDims
from tests.dense.attention_layouts import (
    STANDARD_LAYOUTS,
    Layout,
    attention_maker,
    check_layouts,
    init_all,
)
from tests.distributed import run_distributed

# Qwen3-style: 8 heads over 2 kv heads (split at tp 2, replicated at tp 4), qk-norm, bias
QWEN = AttentionConfig(hidden_size=32, num_heads=8, num_query_groups=2, head_dim=8, qk_norm=True, bias=True,
                       norm_eps=1e-6, rope_theta=1000.0)
# Mixtral-style: sliding window smaller than the sequence, kv heads = tp 4
MIXTRAL = AttentionConfig(hidden_size=32, num_heads=4, num_query_groups=4, sliding_window=5, rope_theta=1000.0)
# issue 33's attention features together: GPT-OSS sinks with a window; OLMoE / MiniMax-M2 qk-norm over the whole
# projections (kv heads split at tp 2, replicated at tp 4); GLM-4.5 / MiniMax-M2 partial RoPE; q/k/v bias, none on o
FAMILIES = AttentionConfig(hidden_size=32, num_heads=8, num_query_groups=2, head_dim=8, qk_norm=True,
                           qk_norm_scope="projection", sinks=True, sliding_window=6, rotary_dim=4, bias=True,
                           out_bias=False, rope_theta=1000.0)
# and Qwen3-Next's output gate and zero-centred q/k norms on top (the projection norm split over tp, and over all kv
# heads where they are replicated at tp 4)
GATED = replace(FAMILIES, output_gate=True, zero_centered_gamma=True)


def _layouts_rank():
    cache: dict = {}
    attention_layouts = tuple(lay for lay in STANDARD_LAYOUTS if lay.recompute != "full")
    done = check_layouts(attention_maker(GQAAttention, QWEN), attention_layouts,
                         seq=16, batch=2, hidden=32, seed=1, dims_cache=cache)
    window = (Layout(tp=4, sp=True), Layout(cp=4, cp_comm="p2p"), Layout(cp=4, cp_comm="all_gather"),
              Layout(tp=2, cp=2, sp=True, cp_comm="p2p", recompute="selective"))
    done += check_layouts(attention_maker(GQAAttention, MIXTRAL), window,
                          seq=16, batch=2, hidden=32, seed=2, dims_cache=cache)
    done += check_layouts(attention_maker(GQAAttention, FAMILIES), STANDARD_LAYOUTS, seq=16, batch=2, hidden=32,
                          seed=3, dims_cache=cache)
    gated = (Layout(tp=2, sp=True), Layout(tp=4, sp=True), Layout(cp=2, cp_comm="p2p"),
             Layout(tp=2, cp=2, sp=True, cp_comm="all_gather", recompute="selective"))
    done += check_layouts(attention_maker(GQAAttention, GATED), gated, seq=16, batch=2, hidden=32, seed=4,
                          dims_cache=cache)
    # a layout the config cannot take fails at construction, naming the numbers
    dims = cache[(4, 1)]
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by tp=4"):
        GQAAttention(AttentionConfig(hidden_size=24, num_heads=6, num_query_groups=3), dims.tp_group)
    with pytest.raises(ValueError, match=r"num_query_groups=3 .* tp=4"):
        GQAAttention(AttentionConfig(hidden_size=48, num_heads=12, num_query_groups=3), dims.tp_group)
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2\*cp=8"):
        GQAAttention(replace(QWEN, seq_length=12), None, cache[(1, 4)].cp_group)
    return done


def test_gqa_layouts_equal_world1():
    done = run_distributed(_layouts_rank, 4)[0]
    assert len(done) == 20 + len(STANDARD_LAYOUTS)


def test_bad_configs():
    with pytest.raises(ValueError, match=r"num_query_groups=3 .* does not divide num_heads=8"):
        AttentionConfig(hidden_size=32, num_heads=8, num_query_groups=3)
    with pytest.raises(ValueError, match="num_heads=8 is not divisible by tp=3"):
        QWEN.check_parallel(3)
    with pytest.raises(ValueError, match="sliding_window=0"):
        replace(MIXTRAL, sliding_window=0)
    with pytest.raises(ValueError, match="cp_comm='ring'"):
        replace(QWEN, cp_comm="ring")
    with pytest.raises(ValueError, match="recompute='some'"):
        replace(QWEN, recompute="some")
    with pytest.raises(ValueError, match=r"sequence length 20 is not divisible by 2\*cp=8"):
        replace(QWEN, seq_length=20).check_parallel(1, 4)
    assert ParallelDims.build(ParallelConfig()).tp == 1


def _hf_out(hf_attn, rotary, x_BSH, dense_out):
    pos = torch.arange(x_BSH.shape[1])[None]
    cos, sin = rotary(x_BSH, pos)
    out, _ = hf_attn(x_BSH, (cos, sin), None)
    torch.testing.assert_close(dense_out.transpose(0, 1), out, atol=1e-5, rtol=0)


def _copy_weights(ours, hf_attn):
    state = {k: v for k, v in ours.state_dict().items()}
    missing = hf_attn.load_state_dict(state, strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_matches_hf(kind):
    """World-1 output equals HF's attention with the same weights (names map 1:1)."""
    if kind == "qwen3_moe":
        cfg = QWEN
        hf_cfg = Qwen3MoeConfig(hidden_size=32, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                attention_bias=True, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default",
                                                                                         "rope_theta": 1000.0})
        hf_attn, rotary = hf_qwen3.Qwen3MoeAttention(hf_cfg, 0), hf_qwen3.Qwen3MoeRotaryEmbedding(hf_cfg)
    else:
        cfg = replace(MIXTRAL, sliding_window=None)  # HF applies the window through the model's mask
        hf_cfg = MixtralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                               rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
        hf_attn, rotary = hf_mixtral.MixtralAttention(hf_cfg, 0), hf_mixtral.MixtralRotaryEmbedding(hf_cfg)
    hf_cfg._attn_implementation = "sdpa"
    ours = GQAAttention(cfg)
    init_all(ours, 3)
    _copy_weights(ours, hf_attn)
    x = torch.randn(10, 2, 32, generator=torch.Generator().manual_seed(0))
    _hf_out(hf_attn, rotary, x.transpose(0, 1), ours(x, torch.arange(10)))

"""RMSNorm and RoPE/YaRN equal HF transformers' implementations (tiny configs, no download); RMSNorm in bf16
rounds once, as Megatron-Core's norms do."""

import pytest
import torch
from transformers import DeepseekV3Config, Qwen3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds
from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3

from moefold.dense.norm import RMSNorm
from moefold.dense.rope import RotaryEmbedding, YarnConfig, apply_rotary, yarn_softmax_mscale
from moefold.parallel.sharding import is_sequence_parallel

YARN_CASES = [
    dict(factor=40.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    dict(factor=4.0, original_max_position_embeddings=32, beta_fast=16, beta_slow=2, mscale=0.707, mscale_all_dim=0.5),
    dict(factor=8.0, original_max_position_embeddings=64),  # no mscale terms: attention factor from factor alone
    dict(factor=4.0, original_max_position_embeddings=64, truncate=False, attention_factor=1.3),
]


def _ds_config(rope_dim: int, yarn: dict | None, theta: float) -> DeepseekV3Config:
    rope = {"rope_type": "default", "rope_theta": theta}
    if yarn is not None:
        rope = {"rope_type": "yarn", "rope_theta": theta, **yarn}
    return DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=rope_dim, qk_nope_head_dim=16,
                            v_head_dim=16, kv_lora_rank=32, q_lora_rank=None, max_position_embeddings=4096,
                            vocab_size=64, num_hidden_layers=1, rope_parameters=rope)


@pytest.mark.parametrize("hidden", [32, 96, 1000])
def test_rmsnorm_matches_hf_in_fp32(hidden):
    """Values and both gradients bit for bit HF's (autograd through the fp32 ops), rows of several widths (the
    backward's per-row ``2 * (ds / H)`` against autograd's per-element ``(ds / H) * 2x``)."""
    torch.manual_seed(0)
    ours, ref = RMSNorm(hidden, eps=1e-5), hf_qwen3.Qwen3RMSNorm(hidden, eps=1e-5)
    w = torch.randn(hidden)
    ours.weight.data.copy_(w)
    ref.weight.data.copy_(w)
    x = (torch.randn(5, 3, hidden) * 3).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = ours(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=0, atol=0)


def test_rmsnorm_bf16_rounds_once_like_megatron():
    """bf16: statistics, normalisation and weight in fp32, one rounding: bit for bit torch.rms_norm (the norm of
    Megatron-Core's local spec; TE's kernel computes the same), closer to fp64 than HF's (which rounds twice)."""
    torch.manual_seed(0)
    w = (1 + 0.2 * torch.randn(64)).bfloat16()
    x = (torch.randn(512, 64) * 3).bfloat16()
    ours, ref = RMSNorm(64, eps=1e-6, dtype=torch.bfloat16), hf_qwen3.Qwen3RMSNorm(64, eps=1e-6).bfloat16()
    ours.weight.data.copy_(w)
    ref.weight.data.copy_(w)
    y = ours(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, torch.rms_norm(x, (64,), w, 1e-6), rtol=0, atol=0)
    x64 = x.double()
    exact = w.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    ours_err, hf_err = (y.double() - exact).abs().mean(), (ref(x).double() - exact).abs().mean()
    assert ours_err < 0.8 * hf_err, (ours_err, hf_err)
    # gradients: the fp32 graph's, as accurate as HF's or better
    xg = x.clone().requires_grad_()
    g = torch.randn(512, 64).bfloat16()
    ours(xg).backward(g)
    x64g = x64.clone().requires_grad_()
    w64 = w.double().requires_grad_()
    (w64 * x64g * torch.rsqrt(x64g.pow(2).mean(-1, keepdim=True) + 1e-6)).backward(g.double())
    xh = x.clone().requires_grad_()
    ref(xh).backward(g)
    assert (xg.grad.double() - x64g.grad).abs().mean() <= (xh.grad.double() - x64g.grad).abs().mean()
    assert (ours.weight.grad.double() - w64.grad).abs().mean() <= (ref.weight.grad.double() - w64.grad).abs().mean()


def test_rmsnorm_flags_and_errors():
    assert is_sequence_parallel(RMSNorm(8, sequence_parallel=True).weight)
    assert not is_sequence_parallel(RMSNorm(8).weight)
    with pytest.raises(ValueError, match="hidden=0"):
        RMSNorm(0)
    with pytest.raises(ValueError, match="eps"):
        RMSNorm(8, eps=0.0)
    with pytest.raises(ValueError, match="hidden=8"):
        RMSNorm(8)(torch.zeros(2, 4))


def _hf_qk(q_sbhd: torch.Tensor) -> torch.Tensor:
    return q_sbhd.permute(1, 2, 0, 3)  # [S, B, heads, D] -> HF [B, heads, S, D]


def test_rope_default_matches_qwen3():
    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64,
                      num_hidden_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    ref = hf_qwen3.Qwen3RotaryEmbedding(cfg)
    ours = RotaryEmbedding(16, theta=1_000_000.0)
    pos = torch.arange(37)
    x = torch.randn(37, 2, 4, 16)
    cos_ref, sin_ref = ref(x, pos[None])
    cos, sin = ours(pos)
    torch.testing.assert_close(cos, cos_ref[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, sin_ref[0], rtol=0, atol=0)
    q_ref, _ = hf_qwen3.apply_rotary_pos_emb(_hf_qk(x), _hf_qk(x), cos_ref, sin_ref)
    torch.testing.assert_close(_hf_qk(apply_rotary(x, cos, sin)), q_ref, rtol=0, atol=0)


@pytest.mark.parametrize("yarn", [None, *YARN_CASES])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_and_yarn_match_deepseek_v3(yarn, interleaved):
    theta = 10000.0
    cfg = _ds_config(16, yarn, theta)
    ref = hf_ds.DeepseekV3RotaryEmbedding(cfg)
    ours = RotaryEmbedding(16, theta=theta, yarn=None if yarn is None else YarnConfig(**yarn))
    torch.testing.assert_close(ours.inv_freq, ref.inv_freq, rtol=0, atol=0)
    assert ours.attention_scaling == pytest.approx(ref.attention_scaling, rel=1e-12)
    pos = torch.arange(300)
    x = torch.randn(300, 2, 3, 16)
    cos_ref, sin_ref = ref(x, pos[None])
    cos, sin = ours(pos)
    torch.testing.assert_close(cos, cos_ref[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, sin_ref[0], rtol=0, atol=0)
    apply_ref = hf_ds.apply_rotary_pos_emb_interleave if interleaved else hf_ds.apply_rotary_pos_emb
    q_ref, _ = apply_ref(_hf_qk(x), _hf_qk(x), cos_ref, sin_ref)
    torch.testing.assert_close(_hf_qk(apply_rotary(x, cos, sin, interleaved=interleaved)), q_ref,
                               rtol=1e-6, atol=1e-6)
    # the MLA softmax scale adjustment (HF computes it in DeepseekV3Attention.__init__)
    attn = hf_ds.DeepseekV3Attention(cfg, layer_idx=0)
    assert cfg.qk_head_dim ** -0.5 * yarn_softmax_mscale(ours.yarn) == pytest.approx(attn.scaling, rel=1e-12)


def test_rope_non_contiguous_positions():
    """Context parallelism holds chunks r and 2cp-1-r: explicit positions give the matching rows."""
    rope = RotaryEmbedding(8, yarn=YarnConfig(**YARN_CASES[1]))
    cos_all, sin_all = rope(torch.arange(16))
    pos = torch.cat([torch.arange(2, 4), torch.arange(12, 14)])
    cos, sin = rope(pos)
    torch.testing.assert_close(cos, cos_all[pos], rtol=0, atol=0)
    torch.testing.assert_close(sin, sin_all[pos], rtol=0, atol=0)


def test_rope_bad_configs():
    with pytest.raises(ValueError, match="dim=7"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match="theta"):
        RotaryEmbedding(8, theta=0.5)
    with pytest.raises(ValueError, match="factor=0"):
        YarnConfig(factor=0, original_max_position_embeddings=64)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        YarnConfig(factor=4.0, original_max_position_embeddings=0)
    rope = RotaryEmbedding(8)
    cos, sin = rope(torch.arange(4))
    with pytest.raises(ValueError, match=r"x \[S, B, heads, dim\]"):
        apply_rotary(torch.zeros(4, 2, 8), cos, sin)

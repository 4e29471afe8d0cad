"""DeepSeek-V4's attention (dense.compressed_attention, dense.kv_compression) against transformers.

- ``CompressedAttention`` equals ``DeepseekV4Attention`` (fp32, 1e-5; the mask from transformers' own sliding-window
  builder) for the three layer kinds over random weights and inputs, sequence lengths around the window and the
  compression rates (no closed window, some, a ragged tail), index top-k below and above the entry count, with and
  without YaRN on the compressed layers' rope, in one block of queries and in blocks of 3 (the sparse path: the
  window's band and each query's entries gathered per block), and its input and parameter gradients equal
  transformers';
- the indexer's picks are its scores' top-k over closed entries only; refusals name the value.
"""

from __future__ import annotations

import pytest
import torch

from moefold.dense.compressed_attention import CompressedAttention, V4AttentionConfig, V4AttentionKind
from moefold.dense.kv_compression import closed_entries
from moefold.dense.rope import YarnConfig

H, HEADS, D, R = 16, 4, 8, 12
KINDS = [kind.value for kind in V4AttentionKind]
CASES = [  # (seq_len, window, csa rate, hca rate, index_topk, o_groups)
    (3, 4, 4, 8, 2, 2),     # no window closed yet
    (9, 4, 2, 4, 2, 1),     # ragged tail, top-k below the entries
    (16, 3, 4, 8, 8, 4),    # top-k above the entries
]


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}


def _hf(kind: str, window: int, csa: int, hca: int, topk: int, groups: int, seed: int, yarn: bool = False):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding

    cfg = DeepseekV4Config(vocab_size=16, hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS, head_dim=D,
                           q_lora_rank=R, o_groups=groups, o_lora_rank=6, index_n_heads=3, index_head_dim=4,
                           index_topk=topk, sliding_window=window, partial_rotary_factor=0.5, rope_theta=100.0,
                           compress_rope_theta=1000.0, rms_norm_eps=1e-5, layer_types=[kind],
                           compress_rates={"compressed_sparse_attention": csa, "heavily_compressed_attention": hca},
                           mlp_layer_types=["moe"], rope_parameters=dict(YARN) if yarn else None)
    cfg._attn_implementation = "eager"
    attn = DeepseekV4Attention(cfg, layer_idx=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return cfg, attn, DeepseekV4RotaryEmbedding(cfg)


def _ours(cfg, kind: str, query_chunk: int = 512) -> CompressedAttention:
    rate = cfg.compress_rates.get(kind, 1)
    compress = cfg.rope_parameters["compress"]
    yarn = None
    if compress["rope_type"] == "yarn":   # transformers' V4 reading: the compressed layers' YaRN, factor 1 on cos/sin
        yarn = YarnConfig(factor=compress["factor"], beta_fast=32.0, beta_slow=1.0,
                          original_max_position_embeddings=compress["original_max_position_embeddings"],
                          attention_factor=compress["attention_factor"])
    return CompressedAttention(V4AttentionConfig(
        hidden=H, heads=HEADS, head_dim=D, q_lora_rank=R, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        rope_dim=cfg.qk_rope_head_dim, window=cfg.sliding_window, kind=kind, rate=rate, rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta, compress_yarn=yarn, index_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, norm_eps=cfg.rms_norm_eps,
        query_chunk=query_chunk))


# query_chunk 3: blocks that start inside a window and an entry, the band and the picks read per block
@pytest.mark.parametrize("kind,case,yarn,chunk", [(k, c, False, 512) for k in KINDS for c in CASES] +
                         [(k, CASES[1], True, 512) for k in KINDS] + [(k, c, False, 3) for k in KINDS
                                                                      for c in CASES[1:]])
def test_attention_equals_transformers(kind, case, yarn, chunk):
    from transformers.masking_utils import create_sliding_window_causal_mask

    s, window, csa, hca, topk, groups = case
    cfg, hf, rotary = _hf(kind, window, csa, hca, topk, groups, seed=s, yarn=yarn)
    ours = _ours(cfg, kind, chunk)
    ours.load_state_dict(hf.state_dict())
    b = 2
    x = torch.randn(b, s, H, generator=torch.Generator().manual_seed(5), requires_grad=True)
    pos = torch.arange(s).unsqueeze(0)
    mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None, cache=None,
                                             position_ids=pos)
    rope = {t: rotary(x, position_ids=pos, layer_type=t) for t in ("main", "compress")}
    want, _ = hf(x, position_embeddings=rope, position_ids=pos, attention_mask=mask)
    x_ours = x.detach().transpose(0, 1).clone().requires_grad_()
    got = ours(x_ours, torch.arange(s))
    torch.testing.assert_close(got.transpose(0, 1), want, atol=1e-5, rtol=1e-5)
    gy = torch.randn(b, s, H, generator=torch.Generator().manual_seed(6))
    (want * gy).sum().backward()
    (got * gy.transpose(0, 1)).sum().backward()
    torch.testing.assert_close(x_ours.grad.transpose(0, 1), x.grad, atol=1e-5, rtol=1e-5)
    hf_grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        ref = hf_grads[name].grad
        ref = torch.zeros_like(p) if ref is None else ref
        torch.testing.assert_close(p.grad if p.grad is not None else torch.zeros_like(p), ref, atol=1e-4, rtol=1e-5,
                                   msg=name)


def test_the_indexer_picks_only_closed_entries():
    cfg, hf, _ = _hf("compressed_sparse_attention", 4, 2, 8, 3, 2, seed=1)
    ours = _ours(cfg, "compressed_sparse_attention")
    ours.load_state_dict(hf.state_dict())
    s = 11
    x = torch.randn(2, s, H, generator=torch.Generator().manual_seed(2))
    picks = ours.compressor.indexer.select(x, ours.q_a_norm(ours.q_a_proj(x)))
    closed = closed_entries(s, 2, x.device).view(1, s, 1)
    assert picks.shape == (2, s, 3)
    assert ((picks < closed) | (picks == -1)).all()
    assert ((picks >= 0).sum(-1) == closed.view(1, s).clamp(max=3)).all()   # as many as are closed, up to k


def test_refusals_name_the_value():
    base = dict(hidden=H, heads=HEADS, head_dim=D, q_lora_rank=R, o_groups=2, o_lora_rank=4, rope_dim=4, window=4)
    with pytest.raises(ValueError, match="o_groups=3"):
        V4AttentionConfig(**{**base, "o_groups": 3})
    with pytest.raises(ValueError, match="rotary dims 3"):
        V4AttentionConfig(**{**base, "rope_dim": 3})
    with pytest.raises(ValueError, match="'dense_attention' is not a valid V4AttentionKind"):
        V4AttentionConfig(**base, kind="dense_attention")
    attn = CompressedAttention(V4AttentionConfig(**base))
    with pytest.raises(ValueError, match=r"position_ids \(1, 3\) must be \[3\]"):
        attn(torch.zeros(3, 1, H), torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="query_chunk=0"):
        V4AttentionConfig(**base, query_chunk=0)


def test_init_parameters_draws_every_projection():
    from moefold.parallel.sharding import init_parameters

    cfg, _, _ = _hf("compressed_sparse_attention", 4, 2, 8, 3, 2, seed=1)
    a, b = _ours(cfg, "compressed_sparse_attention"), _ours(cfg, "compressed_sparse_attention")
    init_parameters(a, seed=3)
    init_parameters(b, seed=3)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name
        if name.endswith("proj.weight"):
            assert 0.01 < float(p.detach().std()) < 0.03, name   # normal(0, 0.02), not nn.Linear's default

"""One DeepSeek-V4 decoder layer from moefold's pieces equals transformers' ``DeepseekV4DecoderLayer`` (fp32, 1e-5).

The block (``dense.block.TransformerBlock`` with ``hyper``: mHC streams) around ``dense.compressed_attention``
(sliding, compressed sparse or heavily compressed) and the MoE layer (hash-routed, fed the token ids through the
block's FFN arguments, or top-k with the correction bias; clamped SwiGLU, shared expert): outputs and input
gradients, over the three attention kinds and both MLP kinds, on random weights. The whole model (its config
section, HF import, recipes) is not built yet: this checks that the pieces compose as transformers composes them.
"""

from __future__ import annotations

import pytest
import torch

from moefold.dense.block import TransformerBlock
from moefold.dense.compressed_attention import CompressedAttention, V4AttentionConfig
from moefold.dense.hyper_connections import HyperConfig
from tests.moe.hf_v4 import v4_moe_layer

H, HEADS, D, R, E, FFN, V, N_HC, S, B = 16, 4, 8, 12, 8, 8, 40, 3, 10, 2
LIMIT, TOPK, SCALE = 1.0, 2, 1.5


def _hf_layer(attn: str, mlp: str):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4RotaryEmbedding

    cfg = DeepseekV4Config(vocab_size=V, hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS, head_dim=D,
                           q_lora_rank=R, o_groups=2, o_lora_rank=6, index_n_heads=3, index_head_dim=4, index_topk=2,
                           sliding_window=4, partial_rotary_factor=0.5, rope_theta=100.0, compress_rope_theta=1000.0,
                           rms_norm_eps=1e-5, layer_types=[attn], mlp_layer_types=[mlp], hc_mult=N_HC,
                           hc_sinkhorn_iters=5, n_routed_experts=E, num_experts_per_tok=TOPK, moe_intermediate_size=FFN,
                           routed_scaling_factor=SCALE, swiglu_limit=LIMIT,
                           compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4})
    cfg._attn_implementation = "eager"
    layer = DeepseekV4DecoderLayer(cfg, layer_idx=0)
    g = torch.Generator().manual_seed(len(attn) + len(mlp))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
        if mlp == "hash_moe":
            layer.mlp.gate.tid2eid.copy_(torch.rand(V, E, generator=g).argsort(dim=-1)[:, :TOPK])
        else:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.3)
    return cfg, layer, DeepseekV4RotaryEmbedding(cfg)


def _ours(cfg, attn: str, hf) -> TransformerBlock:
    """The block holding ``hf``'s weights."""
    attention = CompressedAttention(V4AttentionConfig(
        hidden=H, heads=HEADS, head_dim=D, q_lora_rank=R, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        rope_dim=cfg.qk_rope_head_dim, window=cfg.sliding_window, kind=attn, rate=cfg.compress_rates.get(attn, 1),
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta, index_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, norm_eps=cfg.rms_norm_eps))
    moe = v4_moe_layer(hf.mlp, H, V, LIMIT, SCALE)
    block = TransformerBlock(H, attention, moe, cfg.rms_norm_eps,
                             hyper=HyperConfig(n_hc=N_HC, sinkhorn_iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps))
    state = hf.state_dict()   # the same names but the MoE layer's (copied by v4_moe_layer)
    with torch.no_grad():
        for name, t in block.named_parameters():
            if not name.startswith("mlp."):
                t.copy_(state[name])
    return block


@pytest.mark.parametrize("attn", ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"])
@pytest.mark.parametrize("mlp", ["hash_moe", "moe"])
def test_decoder_layer_equals_transformers(attn, mlp):
    from transformers.masking_utils import create_sliding_window_causal_mask

    cfg, hf, rotary = _hf_layer(attn, mlp)
    block = _ours(cfg, attn, hf)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(B, S, N_HC, H, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (B, S), generator=g)
    pos = torch.arange(S).unsqueeze(0)
    mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=x[:, :, 0], attention_mask=None, cache=None,
                                             position_ids=pos)
    rope = {t: rotary(x, position_ids=pos, layer_type=t) for t in ("main", "compress")}
    want = hf(x, input_ids=ids, position_embeddings=rope, position_ids=pos, attention_mask=mask)
    x_ours = x.detach().transpose(0, 1).clone().requires_grad_()
    got, info = block(x_ours, torch.arange(S), token_ids_BS=ids if mlp == "hash_moe" else None)
    torch.testing.assert_close(got.transpose(0, 1), want, atol=1e-5, rtol=1e-5)
    gy = torch.randn(B, S, N_HC, H, generator=g)
    (want * gy).sum().backward()
    (got * gy.transpose(0, 1)).sum().backward()
    torch.testing.assert_close(x_ours.grad.transpose(0, 1), x.grad, atol=1e-5, rtol=1e-5)
    assert info is not None and info.load_E.sum() == B * S * TOPK


def test_a_stack_of_the_pieces_gives_transformers_logits():
    """Embedding -> N streams -> layers of every kind -> ``HyperHead`` -> norm -> head equals
    ``DeepseekV4ForCausalLM``'s logits: what the model (not built yet) will compose."""
    from transformers import DeepseekV4ForCausalLM

    from moefold.dense.hyper_connections import HyperHead, expand_streams
    from moefold.dense.norm import RMSNorm

    kinds = [("heavily_compressed_attention", "hash_moe"), ("compressed_sparse_attention", "hash_moe"),
             ("sliding_attention", "moe")]
    cfg, _, _ = _hf_layer(*kinds[0])
    cfg.num_hidden_layers = len(kinds)
    cfg.layer_types, cfg.mlp_layer_types = [a for a, _ in kinds], [m for _, m in kinds]
    hf = DeepseekV4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
        for layer, (_, mlp) in zip(hf.model.layers, kinds, strict=True):
            if mlp == "hash_moe":
                layer.mlp.gate.tid2eid.copy_(torch.rand(V, E, generator=g).argsort(dim=-1)[:, :TOPK])
    blocks = [_ours(cfg, attn, layer) for layer, (attn, _) in zip(hf.model.layers, kinds, strict=True)]
    head = HyperHead(H, N_HC, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    head.load_state_dict(hf.model.hc_head.state_dict())
    norm = RMSNorm(H, cfg.rms_norm_eps)
    norm.load_state_dict(hf.model.norm.state_dict())
    ids = torch.randint(0, V, (B, S), generator=g)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        x = expand_streams(hf.model.embed_tokens(ids).transpose(0, 1), N_HC)
        for block, (_, mlp) in zip(blocks, kinds, strict=True):
            x, _ = block(x, torch.arange(S), token_ids_BS=ids if mlp == "hash_moe" else None)
        got = hf.lm_head(norm(head(x))).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

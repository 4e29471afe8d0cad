"""Model FLOPs per trained token from a ``ModelConfig`` (for TFLOP/s and MFU).

Counts matrix multiplies only (2 FLOPs per multiply-add), forward + backward = 3 x forward (no
recompute: MFU counts model FLOPs, not hardware FLOPs). Included: attention projections (GQA or
MLA), the causal score and value products at the average context length (``seq_len / 2``, or the
sliding window; DeepSeek sparse attention: the ``index_topk`` selected keys, in its absorbed form, plus its
lightning indexer over the whole causal context), Gated DeltaNet layers (projections, short convolution, the delta
rule), Mamba-2 layers (projections, short convolution, the state-space scan), dense SwiGLU (or squared-ReLU: two
projections, not three) MLPs, routers, only the ``topk`` active routed experts per token, shared experts, the output
head and the multi-token-prediction modules; DeepSeek-V4's layers as ``training.observe.flops_v4`` counts them.
"""

from __future__ import annotations

from functools import lru_cache

from moefold.models.config import ModelConfig
from moefold.training.observe.flops_v4 import v4_attention_macs, v4_head_macs


def attention_macs(c: ModelConfig, seq_len: int, index: int | None = None) -> float:
    """Multiply-adds of one attention layer (layer ``index``: its sliding window; None: ``c.sliding_window``)
    for one token."""
    if c.v4 is not None:   # DeepSeek-V4: compressed attentions and the block's mHC (training.observe.flops_v4)
        return v4_attention_macs(c, seq_len, 0 if index is None else index)
    H, nh = c.hidden_size, c.num_attention_heads
    if c.attention == "mla":
        m = c.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = H * m.q_lora_rank + m.q_lora_rank * nh * qk if m.q_lora_rank else H * nh * qk
        kv = H * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim)
        proj = q + kv + nh * m.v_head_dim * H
        dqk, dv = qk, m.v_head_dim
    else:
        d = c.attention_head_dim
        q = H * nh * d * (2 if c.attention_output_gate else 1)   # gated attention: q_proj also yields the gate
        proj = q + 2 * H * c.kv_heads * d + nh * d * H
        dqk = dv = d
    if c.dsa is not None:
        return proj + dsa_macs(c, seq_len)
    context = (seq_len + 1) / 2
    window = c.sliding_window if index is None else c.layer_sliding_window(index)
    if window is not None:
        context = min(context, float(window))
    return proj + nh * (dqk + dv) * context


def dsa_macs(c: ModelConfig, seq_len: int) -> float:
    """DeepSeek sparse attention's multiply-adds for one token beyond MLA's projections (``dense.dsa``): each head
    scores ``r + rope`` wide latent keys and sums ``r`` wide latent values over the selected keys (on average
    ``min(position + 1, index_topk)``; ``kv_b_proj`` applied to queries and outputs instead of keys costs what MLA's
    per-key up-projection costs, counted in the projections), and the lightning indexer: its projections, ``n x d``
    per key of the whole causal context (``seq_len / 2`` on average: the indexer stays quadratic) plus the head
    weights, and its loss's scores at the selected keys."""
    m, d, H, nh = c.mla, c.dsa, c.hidden_size, c.num_attention_heads
    K = min(d.index_topk, seq_len)
    selected = (K * (K + 1) / 2 + (seq_len - K) * K) / seq_len   # mean of min(p + 1, K) over positions 0..S-1
    attend = nh * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * selected
    n, dh = d.index_n_heads, d.index_head_dim
    indexer = m.q_lora_rank * n * dh + H * dh + H * n + n * (dh + 1) * (seq_len + 1) / 2
    loss = n * (dh + 1) * selected if d.loss_coeff > 0 else 0.0
    return attend + indexer + loss


def linear_attention_macs(c: ModelConfig) -> float:
    """Multiply-adds of one Gated DeltaNet layer for one token: its projections, the depthwise convolution and
    the delta rule counted in its recurrent form (per value head three ``dk x dv`` products: read ``S^T k``, write
    ``k delta^T``, read ``S^T q``; the chunked form trades some of them for the intra-chunk products)."""
    la, H = c.linear_attention, c.hidden_size
    keys, values = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
    proj = H * (2 * keys + 2 * values + 2 * la.num_value_heads) + values * H
    return proj + (2 * keys + values) * la.conv_kernel_size + 3 * la.num_value_heads * la.key_head_dim * \
        la.value_head_dim


def mamba_macs(c: ModelConfig) -> float:
    """Multiply-adds of one Mamba-2 layer for one token: ``in_proj`` (z, x, B, C, dt), the depthwise convolution
    over x, B and C, ``out_proj`` and the scan counted in its recurrent form (per head two ``head_dim x state``
    products: the state update ``dt x B^T`` and the read-out ``H C``; the chunked form trades some of them for the
    intra-chunk products)."""
    m, H = c.mamba, c.hidden_size
    proj = H * (m.inner_size + m.conv_channels + m.num_heads) + m.inner_size * H
    return proj + m.conv_channels * m.conv_kernel + 2 * m.num_heads * m.head_dim * m.state_size


def mixer_macs(c: ModelConfig, seq_len: int, index: int) -> float:
    """The token mixer of layer ``index`` (0 for an FFN-only layer of a one-sublayer stack, Nemotron-H's)."""
    kind = c.layer_type(index)
    if not c.has_mixer(index):
        return 0.0
    if kind == "linear_attention":
        return linear_attention_macs(c)
    return mamba_macs(c) if kind == "mamba" else attention_macs(c, seq_len, index)


def ffn_macs(c: ModelConfig, moe: bool) -> float:
    """Multiply-adds of one dense MLP (``moe`` False) or MoE layer (router, top-k routed and shared experts)
    for one token."""
    H = c.hidden_size
    mats = 2 if c.ffn_activation == "relu2" else 3   # ungated squared ReLU: up and down only
    if not moe:
        return mats * H * c.ffn_hidden_size
    W = c.moe_latent_size or H   # latent experts: at width W, with the projections H -> W -> H (moe.latent)
    macs = H * c.num_experts + c.moe_topk * mats * W * c.moe_ffn_hidden_size + (2 * H * W if W != H else 0)
    if c.moe_shared_expert_ffn_size:
        macs += mats * H * c.moe_shared_expert_ffn_size + (H if c.moe_shared_expert_gate else 0)
    return macs


@lru_cache(maxsize=64)   # a frozen config: the planner asks for it per layout it times
def forward_flops_per_token(c: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of one token through the whole model (all layers, head, MTP)."""
    macs = 0.0
    for i in range(c.num_layers):
        macs += mixer_macs(c, seq_len, i) + (ffn_macs(c, c.is_moe_layer(i)) if c.has_ffn(i) else 0.0)
    head = c.hidden_size * c.vocab_size
    macs += head + (v4_head_macs(c) if c.v4 is not None else 0.0)
    for k in range(c.mtp_num_layers):
        macs += 2 * c.hidden_size * c.hidden_size + attention_macs(c, seq_len, c.num_layers + k) + \
            ffn_macs(c, c.num_experts > 0)
        macs += head
    return 2.0 * macs


def train_flops_per_token(c: ModelConfig, seq_len: int) -> float:
    """Forward + backward model FLOPs per trained token (3 x forward)."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    return 3.0 * forward_flops_per_token(c, seq_len)

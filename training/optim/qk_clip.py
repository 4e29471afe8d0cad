"""QK-clip (MuonClip, Kimi K2): after each optimizer step, shrink the query and key projections of the attention
heads whose largest logit passed a threshold (``--qk-clip``, ``--qk-clip-threshold``, ``--qk-clip-alpha``).

Megatron-Core's GQA form (``SelfAttention.clip_qk``): the attention layers record each head's largest logit
``scale * q . k`` of the step's training forwards (``dense.attention.GQAAttention.max_logits``, ``--qk-clip`` turns
it on through ``ModelOptions.max_attention_logit``); here, per layer, the maximum over a kv group's query heads
``m_g`` gives ``eta_g = min(1, threshold / m_g)``, the rows of ``q_proj`` of every head of the group take
``eta_g ** alpha`` and the rows of ``k_proj`` of the kv head ``eta_g ** (1 - alpha)``, so the group's largest logit
becomes at most ``threshold`` (RoPE rotates q and k and leaves the product's scale alone; biases are not scaled, as
Megatron's). The values then reset.

What crosses ranks: one all-reduce (max) of every layer's per-head maxima over tp x cp x dp of the pipeline stage, so
that every replica scales the same rows by the same factors. The scaling is applied to the parameters on every rank
and to the fp32 master of a bf16 matrix on its Muon owner (``DistributedMuon.scale_rows``); momentum is kept.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moefold.dense.attention import GQAAttention
from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import group_rank, group_size


def _head_maxima(layers: list[GQAAttention], dims: ParallelDims) -> Tensor:
    """[layers, heads] fp32: each head's largest logit over the stage's replicas (-inf: none recorded)."""
    heads = layers[0].config.num_heads
    out = torch.full((len(layers), heads), float("-inf"), device=layers[0].q_proj.weight.device)
    for i, a in enumerate(layers):
        if a.config.num_heads != heads:
            raise ValueError(f"QK-clip: attention layers with {heads} and {a.config.num_heads} heads")
        if a.max_logits is not None:
            r = group_rank(a.tp_group)
            out[i, r * a.local_heads:(r + 1) * a.local_heads] = a.max_logits
    if group_size(dims.tp_cp_dp_group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=dims.tp_cp_dp_group)
    return out


def _row_factors(a: GQAAttention, eta_g: Tensor, alpha: float) -> tuple[Tensor, Tensor]:
    """(factor per local row of ``q_proj``, per row of ``k_proj``) from the kv groups' ``eta_g [kv]``."""
    d, per_group = a.head_dim, a.config.num_heads // a.config.kv_heads
    first = group_rank(a.tp_group) * a.local_heads
    q_eta = eta_g[torch.arange(first, first + a.local_heads, device=eta_g.device) // per_group] ** alpha   # [h/tp]
    q_parts = [q_eta[:, None].expand(-1, d)]
    if a.config.output_gate:   # per head [q_h, gate_h]: the gate rows stay
        q_parts.append(torch.ones_like(q_parts[0]))
    q_rows = torch.cat(q_parts, dim=1).reshape(-1)
    if a.kv_replicated:   # every rank holds all kv heads
        k_eta = eta_g
    else:
        k_eta = eta_g[group_rank(a.tp_group) * a.local_kv_heads:(group_rank(a.tp_group) + 1) * a.local_kv_heads]
    return q_rows, (k_eta ** (1 - alpha))[:, None].expand(-1, d).reshape(-1)


@torch.no_grad()
def clip_qk(model: nn.Module, dims: ParallelDims, optimizer, threshold: float, alpha: float) -> Tensor:
    """Clip every recording attention layer of ``model`` (module docstring); returns the stage's largest logit
    (fp32 0-d, -inf when nothing was recorded). ``optimizer``: the ``DistributedMuon`` whose masters follow.
    Collective over tp x cp x dp (wait for the optimizer's parameter gathers first)."""
    layers = [m for m in model.modules() if isinstance(m, GQAAttention) and m.config.max_logit]
    if not layers:
        return torch.tensor(float("-inf"))
    maxima = _head_maxima(layers, dims)
    for a, heads in zip(layers, maxima):
        kv = a.config.kv_heads
        group_max = heads.view(kv, -1).amax(dim=1)
        eta_g = torch.where(group_max > threshold, threshold / group_max, torch.ones_like(group_max))
        q_rows, k_rows = _row_factors(a, eta_g, alpha)
        optimizer.scale_rows(a.q_proj.weight, q_rows)
        optimizer.scale_rows(a.k_proj.weight, k_rows)
        a.max_logits = None
    return maxima.max()

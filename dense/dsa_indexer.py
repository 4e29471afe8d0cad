"""The lightning indexer of DeepSeek Sparse Attention (DSA; DeepSeek-V3.2, GLM-5): which past tokens each query reads.

For query ``t`` and key ``s`` the indexer's score is (HF ``DeepseekV32Indexer``, DeepSeek-V3.2 section 2.1)::

    I[t, s] = sum_j w[t, j] * relu(q[t, j] . k[s] * d^-0.5),      w = weights_proj(x) * n^-0.5

with ``n = index_n_heads`` query heads of ``d = index_head_dim`` (``q = wq_b(q_resid)``, from MLA's normalised query
latent), one key head ``k = LayerNorm(wk(x))`` shared by every query head, and RoPE (half-split, not interleaved;
GLM-5: interleaved pairs) on the first ``qk_rope_head_dim`` dims of each. Each query then attends to the
``index_topk`` keys of highest score among its causal past (all of them while it has fewer).

Training (DeepSeek-V3.2 section 2.1, Megatron-Core's ``compute_dsa_indexer_loss``): the indexer reads detached
inputs, so the language-model loss never reaches it, and it learns from its own loss, the KL divergence from the
main attention's distribution over the selected keys (summed over heads and L1-normalised) to ``softmax(I)`` over
the same keys, averaged over query tokens: ``indexer_kl_loss``. The dense warm-up stage of the paper is the same loss
with ``index_topk`` at least the sequence length (every causal key selected).

Shapes: ``S`` this rank's queries, ``T`` every key of the sequence (all-gathered over cp by the caller, in global
order), ``B`` batch, ``K = min(index_topk, T)``. Nothing here crosses ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moefold.dense.linear import ColumnParallelLinear
from moefold.dense.rope import apply_rotary


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"DSAConfig.{name}={value!r} must be a positive integer")


@dataclass(frozen=True)
class DSAConfig:
    """The indexer's sizes (HF ``index_n_heads``, ``index_head_dim``, ``index_topk``) and its training loss.

    ``relu``: scores through a ReLU before the head weights (DeepSeek-V3.2 and transformers' GLM-5; Megatron-Core's
    GLM-5 path has none). ``rope_interleave``: the indexer's RoPE on pairs (2i, 2i+1) (GLM-5), else half-split.
    ``loss_coeff``: weight of ``indexer_kl_loss`` (0: the indexer is not trained). ``query_chunk``: queries scored
    and attended per block, which bounds the transient ``[B, chunk, T]`` scores and ``[B, chunk, K, ...]`` gathers.
    """

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    relu: bool = True
    rope_interleave: bool = False
    loss_coeff: float = 0.0
    query_chunk: int = 512

    def __post_init__(self) -> None:
        for name in ("index_n_heads", "index_head_dim", "index_topk", "query_chunk"):
            _positive_int(name, getattr(self, name))
        if not self.loss_coeff >= 0:
            raise ValueError(f"DSAConfig.loss_coeff={self.loss_coeff!r} must be >= 0")


class LightningIndexer(nn.Module):
    """Parameters (HF names under ``self_attn.indexer``): ``wq_b [n*d, q_lora_rank]``, ``wk [d, H]``,
    ``k_norm`` (LayerNorm over d, eps 1e-6, weight and bias), ``weights_proj [n, H]``. Replicated over tp: every rank
    scores the same queries against the same keys, so every rank selects the same tokens as world 1.
    """

    def __init__(self, config: DSAConfig, hidden_size: int, q_lora_rank: int, rope_dim: int, *,
                 init_std: float = 0.02, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if rope_dim > config.index_head_dim or rope_dim % 2:
            raise ValueError(f"LightningIndexer: qk_rope_head_dim={rope_dim} must be even and at most "
                             f"index_head_dim={config.index_head_dim}")
        self.config, self.rope_dim = config, rope_dim
        n, d = config.index_n_heads, config.index_head_dim
        kw = {"init_std": init_std, "dtype": dtype, "device": device}
        self.wq_b = ColumnParallelLinear(q_lora_rank, n * d, None, **kw)
        self.wk = ColumnParallelLinear(hidden_size, d, None, **kw)
        self.k_norm = nn.LayerNorm(d, eps=1e-6, dtype=dtype, device=device)
        self.weights_proj = ColumnParallelLinear(hidden_size, n, None, **kw)

    def queries(self, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x ``[S, B, H]``, q_resid ``[S, B, q_lora_rank]``, cos/sin ``[S, rope]`` -> (q ``[B, S, n, d]``,
        head weights ``[B, S, n]`` fp32)."""
        S, B = x.shape[:2]
        n, d = self.config.index_n_heads, self.config.index_head_dim
        q = self._rope(self.wq_b(q_resid).view(S, B, n, d), cos, sin)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * n ** -0.5
        return q.transpose(0, 1), w.transpose(0, 1)

    def keys(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x ``[S, B, H]`` -> k ``[S, B, d]`` (one key head)."""
        k = self.k_norm(self.wk(x)).unsqueeze(2)
        return self._rope(k, cos, sin).squeeze(2)

    def _rope(self, t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # rope on the first rope_dim dims: DeepSeek-V3.2's indexer half-split (unlike its MLA), GLM-5's interleaved
        rot, rest = t.split([self.rope_dim, t.shape[-1] - self.rope_dim], dim=-1)
        return torch.cat([apply_rotary(rot, cos, sin, interleaved=self.config.rope_interleave), rest], dim=-1)

    def scores(self, q: Tensor, w: Tensor, k_BdT: Tensor) -> Tensor:
        """Index scores ``[B, S, T]`` fp32 of q ``[B, S, n, d]``, w ``[B, S, n]`` against keys ``[B, 1, d, T]``: HF's
        two products, the first as one GEMM of all the rows' heads (HF's broadcast copies the keys for every query)."""
        B, S, n, d = q.shape
        s = torch.matmul(q.float().reshape(B, S * n, d), k_BdT.float().squeeze(1)).view(B, S, n, -1) * d ** -0.5
        if self.config.relu:
            s = torch.relu(s)
        return torch.matmul(w.unsqueeze(-2), s).squeeze(-2)

    @torch.no_grad()
    def select(self, q: Tensor, w: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """Each query's keys: (indices ``[B, S, K]`` int64 into ``k``'s T, valid ``[B, S, K]`` bool: causal).

        q ``[B, S, n, d]``, w ``[B, S, n]``, k ``[T, B, d]``, q_pos ``[S]``, k_pos ``[T]`` global positions. Scored
        ``query_chunk`` queries at a time (transient ``[B, chunk, n, T]``)."""
        T = k.shape[0]
        K = min(self.config.index_topk, T)
        k_BdT = k.permute(1, 2, 0).unsqueeze(1)
        out = []
        for s0 in range(0, q.shape[1], self.config.query_chunk):
            sl = slice(s0, s0 + self.config.query_chunk)
            s = self.scores(q[:, sl], w[:, sl], k_BdT)
            future = k_pos[None, :] > q_pos[sl, None]
            out.append(s.masked_fill(future, float("-inf")).topk(K, dim=-1).indices)
        idx = torch.cat(out, dim=1)
        return idx, k_pos[idx] <= q_pos[None, :, None]

    def selected_scores(self, q: Tensor, w: Tensor, k: Tensor, idx: Tensor) -> Tensor:
        """Differentiable index scores at the selected keys ``[B, S, K]`` (for the loss): q ``[B, S, n, d]``, w
        ``[B, S, n]``, k ``[T, B, d]``, idx ``[B, S, K]``. Gathers ``[B, S, K, d]`` keys."""
        B, S, K = idx.shape
        n, d = self.config.index_n_heads, self.config.index_head_dim
        flat = (idx + torch.arange(B, device=idx.device).view(B, 1, 1) * k.shape[0]).reshape(-1)
        k_sel = k.transpose(0, 1).reshape(-1, d).index_select(0, flat).view(B * S, K, d)
        s = torch.bmm(q.reshape(B * S, n, d).float(), k_sel.float().transpose(1, 2)) * d ** -0.5   # [B*S, n, K]
        if self.config.relu:
            s = torch.relu(s)
        return torch.bmm(w.reshape(B * S, 1, n), s).view(B, S, K)

    def extra_repr(self) -> str:
        c = self.config
        return (f"heads={c.index_n_heads}, head_dim={c.index_head_dim}, topk={c.index_topk}, relu={c.relu}, "
                f"rope_interleave={c.rope_interleave}")


def indexer_kl_loss(index_scores: Tensor, target: Tensor, valid: Tensor, rows: int) -> Tensor:
    """``sum_t KL(p_t || softmax(I_t)) / rows`` over the selected keys: index_scores ``[B, S, K]`` (on the graph),
    target ``[B, S, K]`` the main attention's probabilities summed over every head (detached, not yet normalised),
    valid ``[B, S, K]``; ``rows`` the query tokens of the whole sequence and batch (a cp rank's share then sums to the
    mean). Megatron-Core's ``compute_dsa_indexer_loss`` with ``sparse_loss=True``."""
    p = target.masked_fill(~valid, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    log_q = torch.log_softmax(index_scores.float().masked_fill(~valid, float("-inf")), dim=-1).masked_fill(~valid, 0.0)
    # p = 0 terms are exactly 0 (p log p -> 0), never 0 * log 0
    kl = p * (torch.log(p.clamp_min(torch.finfo(p.dtype).tiny)) - log_q)
    return kl.sum() / rows

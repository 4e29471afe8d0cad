"""The gated delta rule (Gated DeltaNet's token mixer): chunked and step by step in plain torch, and the
``fla`` (flash-linear-attention) Triton kernel on CUDA.

Per value head, with a state ``S [dk, dv]``, token by token (Yang, Kautz & Hatamizadeh 2024)::

    S_t = exp(g_t) * S_{t-1}                              # gated decay, g_t <= 0 (log space)
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T        # delta rule: write the correction
    o_t = S_t^T q_t

with q and k L2-normalised (``x * rsqrt(sum(x^2) + 1e-6)``) and q scaled by ``dk^-0.5``: the semantics of
HF ``torch_recurrent_gated_delta_rule`` / fla ``use_qk_l2norm_in_kernel=True``. The state, the products and
the outputs are fp32 (cast back to v's dtype at the end), as transformers' reference computes them.

The chunked form (``chunk_gated_delta_rule``) is the WY / UT-transform algorithm of the paper (what fla's
kernel and transformers' ``torch_chunk_gated_delta_rule`` compute): inside a chunk of ``C`` tokens the ``C``
delta-rule updates are condensed into one unit-lower-triangular solve, and only the state crosses chunks,
so the Python loop runs ``S / C`` times instead of ``S``. Autograd differentiates it (``solve_triangular``
has a backward); the recurrent form is the reference it is tested against, values and gradients.

Shapes (fla's and HF's): q, k ``[B, S, hk, dk]``, v ``[B, S, hv, dv]``, g and beta ``[B, S, hv]``, with
``hv % hk == 0`` (grouped value heads: key head i serves value heads ``i*r .. i*r + r - 1``, ``r = hv/hk``);
the state ``[B, hv, dk, dv]`` fp32. Nothing here crosses ranks.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from moefold.dense.choices import GATED_DELTA_RULE_BACKENDS, DeltaRuleBackend

FLA_PACKAGE = "flash-linear-attention"

# (q, k, v, g, beta, initial_state, output_final_state) -> (o [B, S, hv, dv], final state | None)
DeltaRule = Callable[..., "tuple[Tensor, Tensor | None]"]


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's and HF's definition)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None) -> None:
    B, S, hk, dk = k.shape
    hv, dv = v.shape[2:]
    if q.shape != k.shape or v.shape[:2] != (B, S) or g.shape != (B, S, hv) or beta.shape != (B, S, hv):
        raise ValueError(f"gated delta rule: q {tuple(q.shape)}, k {tuple(k.shape)} must be [B, S, hk, dk], v "
                         f"{tuple(v.shape)} [B, S, hv, dv], g {tuple(g.shape)} and beta {tuple(beta.shape)} [B, S, hv]")
    if hv % hk:
        raise ValueError(f"gated delta rule: {hv} value heads are not a multiple of {hk} key heads")
    if initial_state is not None and initial_state.shape != (B, hv, dk, dv):
        raise ValueError(f"gated delta rule: initial_state {tuple(initial_state.shape)} must be {[B, hv, dk, dv]}")


def _heads_first(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """fp32, ``[B, hv, S, ...]``, q/k repeated to the value heads, normalised and q scaled."""
    r = v.shape[2] // k.shape[2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k), v, g, beta


def _zero_state(v: Tensor, dk: int, initial_state: Tensor | None) -> Tensor:
    if initial_state is not None:
        return initial_state.float()
    B, hv, _, dv = v.shape
    return v.new_zeros(B, hv, dk, dv)


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                               initial_state: Tensor | None = None, output_final_state: bool = False,
                               ) -> tuple[Tensor, Tensor | None]:
    """The recurrence token by token (the reference; also the cheapest form for one decoding step)."""
    _check(q, k, v, g, beta, initial_state)
    dtype, S = v.dtype, v.shape[1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    state = _zero_state(v, k.shape[-1], initial_state)
    outs = []
    for t in range(S):
        state = state * g[:, :, t, None, None].exp()
        k_t = k[:, :, t, :, None]                                  # [B, h, dk, 1]
        delta = (v[:, :, t] - (state * k_t).sum(-2)) * beta[:, :, t, None]
        state = state + k_t * delta[:, :, None, :]
        outs.append((state * q[:, :, t, :, None]).sum(-2))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o.transpose(1, 2).contiguous().to(dtype), state if output_final_state else None


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, chunk_size: int = 64,
                           initial_state: Tensor | None = None, output_final_state: bool = False,
                           ) -> tuple[Tensor, Tensor | None]:
    """The chunked form: the same outputs and final state as ``recurrent_gated_delta_rule``.

    Inside a chunk, with ``G_i`` the cumulative log decay from the chunk's start to token i and
    ``D_ij = exp(G_i - G_j)`` for ``j <= i`` (0 above the diagonal), the chunk's updates of a state ``S0`` are::

        T = I + strict_lower((beta k) k^T * D)           # the UT system
        u = T^-1 (beta v),  w = T^-1 (beta k exp(G))      # pseudo-values and the keys that read S0
        v_new = u - w S0                                  # what each token writes, given S0
        o = (q exp(G)) S0 + ((q k^T) * D) v_new           # inter-chunk + intra-chunk
        S1 = exp(G_C) S0 + (k exp(G_C - G))^T v_new
    """
    _check(q, k, v, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be positive")
    dtype, S = v.dtype, v.shape[1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    B, h, _, dk = k.shape
    C = chunk_size
    pad = (-S) % C
    if pad:   # padded tokens have beta 0 and g 0: they write nothing and decay nothing
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    N = (S + pad) // C
    q, k, v = (t.reshape(B, h, N, C, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(B, h, N, C), beta.reshape(B, h, N, C)
    G = g.cumsum(dim=-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    T = (k_beta @ k.transpose(-1, -2)) * D                        # diagonal ignored: unitriangular
    u = torch.linalg.solve_triangular(T, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(T, k_beta * G.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * D
    q_decayed = q * G.exp()[..., None]
    k_decayed = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()[..., None, None]
    state = _zero_state(v[:, :, 0], dk, initial_state)
    outs = []
    for n in range(N):
        v_new = u[:, :, n] - w[:, :, n] @ state
        outs.append(q_decayed[:, :, n] @ state + intra[:, :, n] @ v_new)
        state = state * chunk_decay[:, :, n] + k_decayed[:, :, n].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(B, h, N * C, -1)[:, :, :S]
    return o.transpose(1, 2).contiguous().to(dtype), state if output_final_state else None


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def require_fla() -> None:
    """Raise (one line) unless the fla package can be imported."""
    if not fla_available():
        raise ValueError(f"the 'fla' Gated DeltaNet backend needs the {FLA_PACKAGE} package (pip install "
                         f"{FLA_PACKAGE}; CUDA only), which is not installed; use backend 'torch' or 'auto'")


def fla_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                         initial_state: Tensor | None = None, output_final_state: bool = False,
                         ) -> tuple[Tensor, Tensor | None]:
    """fla's chunked Triton kernel (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``), CUDA tensors only.

    q/k are repeated to the value heads first: fla releases before grouped-value-attention support take only
    ``H == HV``, and the repeat is what transformers' reference does too. fla normalises q/k in the kernel
    (``use_qk_l2norm_in_kernel``), takes the natural-log decay ``g`` in fp32 and keeps the state in fp32.
    """
    _check(q, k, v, g, beta, initial_state)
    if not q.is_cuda:
        raise ValueError(f"the 'fla' Gated DeltaNet backend runs on CUDA tensors only, got {q.device}")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    r = v.shape[2] // k.shape[2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    o, state = fla_chunk(q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
                         beta.to(v.dtype).contiguous(), scale=q.shape[-1] ** -0.5,
                         initial_state=None if initial_state is None else initial_state.float(),
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)
    return o, state


def gated_delta_rule_impl(backend: str, device_type: str, chunk_size: int = 64) -> DeltaRule:
    """The delta-rule function for ``backend`` on ``device_type``: "fla" (fla installed, CUDA), "torch"
    (``chunk_gated_delta_rule``), or "auto" = fla on CUDA when it is installed, else torch."""
    if backend not in GATED_DELTA_RULE_BACKENDS:
        raise ValueError(f"gated delta rule backend {backend!r} is not one of {GATED_DELTA_RULE_BACKENDS}")
    backend = DeltaRuleBackend(backend)
    if backend is DeltaRuleBackend.FLA or (backend is DeltaRuleBackend.AUTO and device_type == "cuda"
                                           and fla_available()):
        require_fla()
        return fla_gated_delta_rule

    def torch_chunked(q, k, v, g, beta, *, initial_state=None, output_final_state=False):
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                                      output_final_state=output_final_state)

    return torch_chunked

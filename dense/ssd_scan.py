"""Mamba-2's state-space scan (SSD) in plain torch: the chunked form and the token-by-token recurrence.

The recurrence of one head ``h`` (``p`` channels, state size ``n``), per token ``t``, with the discretisation
already applied by the caller's mixer (``dt = clamp(softplus(dt_raw + dt_bias))``, ``A = -exp(A_log)``)::

    H_t = exp(dt_t A_h) H_{t-1} + dt_t x_t B_t^T          (H_t [p, n]; B_t, C_t [n] of the head's group)
    y_t = H_t C_t + D_h x_t

The chunked form (Mamba-2's SSD) computes the same thing in blocks of ``chunk_size`` tokens: inside a block, a
masked attention-like product with decays ``exp(cumA_l - cumA_s)``; between blocks, the state carried from
block to block (one step per block, in order). Everything runs in fp32 (float64 inputs stay float64);
``initial_state`` continues an earlier sequence and the final state is returned, so a sequence split in two
pieces scanned one after the other gives the scan of the whole (what decoding, context parallelism and a
reset at document starts build on). Value heads share ``B`` and ``C`` within a group (``heads / groups``
consecutive heads per group), as in transformers' ``NemotronHMamba2Mixer`` and ``mamba_ssm``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None) -> int:
    """Shapes: x [b, s, h, p], dt [b, s, h], A [h], B / C [b, s, g, n] with h divisible by g, D [h]; the group
    size h / g."""
    b, s, h, _ = x.shape
    if dt.shape != (b, s, h) or A.shape != (h,) or B.shape[:2] != (b, s) or C.shape != B.shape:
        raise ValueError(f"ssd scan: shapes x {list(x.shape)}, dt {list(dt.shape)}, A {list(A.shape)}, "
                         f"B {list(B.shape)}, C {list(C.shape)} do not fit x [b, s, h, p], dt [b, s, h], A [h], "
                         "B = C [b, s, g, n]")
    g = B.shape[2]
    if h % g:
        raise ValueError(f"ssd scan: {h} heads do not split into {g} groups of B and C")
    if D is not None and D.shape != (h,):
        raise ValueError(f"ssd scan: D has shape {list(D.shape)}, expected [{h}]")
    return h // g


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def ssd_recurrent(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                  initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token by token: (y [b, s, h, p] in x's dtype, final state [b, h, p, n] in the compute dtype)."""
    per_group = _check(x, dt, A, B, C, D)
    f = _compute_dtype(x)
    b, s, h, p = x.shape
    Bh = B.to(f).repeat_interleave(per_group, dim=2)
    Ch = C.to(f).repeat_interleave(per_group, dim=2)
    state = (torch.zeros(b, h, p, B.shape[-1], dtype=f, device=x.device) if initial_state is None
             else initial_state.to(f))
    xs, dts, a = x.to(f), dt.to(f), A.to(f)
    ys = []
    for t in range(s):
        decay = torch.exp(dts[:, t] * a)                                     # [b, h]
        state = state * decay[..., None, None] + (dts[:, t, :, None] * xs[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1) if ys else xs.new_zeros(b, 0, h, p)
    if D is not None:
        y = y + D.to(f)[:, None] * xs
    return y.to(x.dtype), state


def ssd_chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
                   D: Tensor | None = None, initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The chunked scan: (y [b, s, h, p] in x's dtype, final state [b, h, p, n] in the compute dtype).

    The last block is zero-padded (``dt = 0`` there: no decay and no input, so the final state is the last real
    token's)."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"ssd scan: chunk_size={chunk_size!r} must be a positive integer")
    per_group = _check(x, dt, A, B, C, D)
    f = _compute_dtype(x)
    b, s, h, p = x.shape
    n = B.shape[-1]
    pad = (-s) % chunk_size
    k = (s + pad) // chunk_size

    def blocks(t: Tensor) -> Tensor:   # [b, s, ...] -> [b, k, chunk, ...], zero-padded
        t = torch.nn.functional.pad(t.to(f), (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(b, k, chunk_size, *t.shape[2:])

    xb, dtb = blocks(x), blocks(dt)                                          # [b,k,l,h,p], [b,k,l,h]
    Bb = blocks(B).repeat_interleave(per_group, dim=3)                       # [b,k,l,h,n]
    Cb = blocks(C).repeat_interleave(per_group, dim=3)
    cum = torch.cumsum(dtb * A.to(f), dim=2)                                 # log decay up to each token
    u = dtb[..., None] * xb                                                  # the input dt x
    # inside each block: y_l += sum_{s <= l} exp(cum_l - cum_s) (C_l . B_s) u_s  (masked before exp: no overflow)
    diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]                     # [b,k,l,s,h]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(diff.masked_fill(~causal[:, :, None], float("-inf")))
    scores = torch.einsum("bklhn,bkshn->bklsh", Cb, Bb) * decay
    y = torch.einsum("bklsh,bkshp->bklhp", scores, u)
    # each block's own contribution to the state at its end, then the states carried block to block
    to_end = torch.exp(cum[:, :, -1:, :] - cum)                              # [b,k,l,h]
    block_states = torch.einsum("bklhn,bklhp->bkhpn", Bb * to_end[..., None], u)
    state = torch.zeros(b, h, p, n, dtype=f, device=x.device) if initial_state is None else initial_state.to(f)
    entering = []
    for c in range(k):
        entering.append(state)
        state = state * torch.exp(cum[:, c, -1])[..., None, None] + block_states[:, c]
    if k:
        starts = torch.stack(entering, dim=1)                                # [b,k,h,p,n]
        y = y + torch.einsum("bklhn,bkhpn->bklhp", Cb, starts) * torch.exp(cum)[..., None]
    y = y.reshape(b, k * chunk_size, h, p)[:, :s]
    if D is not None:
        y = y + D.to(f)[:, None] * x.to(f)
    return y.to(x.dtype), state

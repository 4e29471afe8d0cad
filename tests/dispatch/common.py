"""Shared pieces of the dispatcher tests: routing cases, a tiny etp-splittable expert, the reference."""

from __future__ import annotations

import torch
from torch import Tensor

from moefold.dispatch.routing import Routing

H, F = 8, 4  # hidden size; expert FFN size (split over etp)


def expert_weights(num_experts: int, seed: int = 7, hidden: int = H) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_experts, F, hidden, generator=g) * 0.5,
            torch.randn(num_experts, hidden, F, generator=g) * 0.5)


def run_experts(tokens_NH: Tensor, per_expert: list[int], offset: int, w1: Tensor, w2: Tensor,
                etp: int = 1, etp_rank: int = 0, probs_N: Tensor | None = None) -> Tensor:
    """Expert g: (tanh(x W1_g^T) * p) W2_g^T, each row weighted by its prob ``probs_N`` (``Dispatched.probs_N``)
    inside, as the MoE experts weight it (the combine only sums); unweighted without probs. With etp > 1 only
    this rank's F slice (a partial sum)."""
    f = F // etp
    fs = slice(etp_rank * f, (etp_rank + 1) * f)
    outs = []
    probs = [None] * len(per_expert) if probs_N is None else probs_N.split(per_expert)
    for j, (rows, p) in enumerate(zip(tokens_NH.split(per_expert), probs)):
        g = offset + j
        act = torch.tanh(rows @ w1[g, fs].t())
        if p is not None:
            act = (act * p.unsqueeze(1)).to(act.dtype)
        outs.append(act @ w2[g][:, fs].t())
    return torch.cat(outs) if outs else tokens_NH.new_zeros(0, w2.shape[1])


def combine_and_compare(d, out, w1: Tensor, w2: Tensor, etp: int, etp_rank: int, g: Tensor, x: Tensor,
                        probs: Tensor, want: dict[str, Tensor], tag: str, failures: list[str]) -> None:
    """Run this rank's experts on what dispatcher ``d`` delivered (``out``), combine, backpropagate ``g`` into the
    leaves ``x`` and ``probs``; append to ``failures`` each of ``want`` ("y", "grad x", "grad probs": this rank's
    rows of the reference) that the round trip misses by more than 1e-5."""
    expert_out = run_experts(out.tokens_NH, out.tokens_per_expert_e.tolist(), d.local_expert_offset, w1, w2, etp,
                             etp_rank, probs_N=out.probs_N)
    y = d.combine(expert_out, out.handle)
    (y * g).sum().backward()
    for name, got in (("y", y), ("grad x", x.grad), ("grad probs", probs.grad)):
        if got is None or got.shape != want[name].shape or not torch.allclose(got, want[name], atol=1e-5, rtol=0):
            err = None if got is None or got.shape != want[name].shape else (got - want[name]).abs().max()
            failures.append(f"{tag}: {name} differs (max err {err})")


def reference(x: Tensor, probs: Tensor, ids: Tensor, keep: Tensor | None, w1: Tensor, w2: Tensor) -> Tensor:
    """y[t] = sum_k keep * p_tk * expert_{ids_tk}(x_t), one token at a time."""
    y = x.new_zeros(x.shape)
    rows = []
    for t in range(x.shape[0]):
        acc = x.new_zeros(x.shape[1])
        for k in range(ids.shape[1]):
            if keep is None or keep[t, k]:
                g = int(ids[t, k])
                acc = acc + probs[t, k] * (torch.tanh(w1[g] @ x[t]) @ w2[g].t())
        rows.append(acc)
    return torch.stack(rows) if rows else y


def make_case(case: str, tokens_per_rank: list[int], num_experts: int, seed: int = 0, hidden: int = H):
    """Global x [Ttot, H], ids [Ttot, K], probs [Ttot, K] for the named routing case."""
    g = torch.Generator().manual_seed(seed)
    total = sum(tokens_per_rank)
    x = torch.randn(total, hidden, generator=g)
    E = num_experts
    if case == "random":  # top-2 among experts 0..E-2: expert E-1 gets no tokens
        ids = torch.rand(total, E - 1, generator=g).argsort(1)[:, :2]
    elif case == "one_expert":
        ids = torch.full((total, 1), 3, dtype=torch.long)
    elif case == "topk_all":
        ids = torch.rand(total, E, generator=g).argsort(1)
    else:
        raise ValueError(case)
    probs = torch.softmax(torch.randn(total, ids.shape[1], generator=g), 1)
    return x, ids, probs


def capacity_keep(ids_TK: Tensor, num_experts: int, capacity: int) -> Tensor:
    """Keep the first ``capacity`` copies per expert in slot order (what a capacity router does)."""
    seen = [0] * num_experts
    keep = torch.zeros(ids_TK.shape, dtype=torch.bool)
    for t in range(ids_TK.shape[0]):
        for k in range(ids_TK.shape[1]):
            g = int(ids_TK[t, k])
            if seen[g] < capacity:
                keep[t, k] = True
                seen[g] += 1
    return keep


def make_routing(probs: Tensor, ids: Tensor, num_experts: int, mode: str, capacity: int) -> Routing:
    """mode: dropless | drop (keep mask) | padded (keep mask + pad_to_capacity)."""
    if mode == "dropless":
        keep = None
        kept_ids = ids.reshape(-1)
    else:
        keep = capacity_keep(ids, num_experts, capacity)
        kept_ids = ids[keep]
    counts = torch.bincount(kept_ids, minlength=num_experts)
    return Routing(probs, ids, counts, keep, None if mode == "dropless" else capacity, mode == "padded")

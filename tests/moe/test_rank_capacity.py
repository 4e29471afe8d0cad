"""Megatron's per-rank capacity (``--moe-expert-rank-capacity-factor C``, ``moe.capacity.rank_capacity_keep_mask``).

On 4 gloo ranks forming one dispatch group with ep = 2 and ep = 4, each rank routing its own tokens with a forced
skew (every token's first copy to expert 0, the rest round robin): a destination rank keeps everything while its
load is within ``floor(C x share)`` (share: the group's copies / ep), and only above it drops; it then keeps
exactly ``floor(sent x budget / load)`` of each source's copies, each source's best by the drop policy
(``probs``: the highest probabilities; ``position``: the earliest tokens); every destination ends within its
budget; the routing's dropped copies are the ones the trainer counts (``RouterStats.dropped_fraction``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from moefold.moe.capacity import rank_capacity_keep_mask
from tests.distributed import run_distributed

E, K = 8, 2


def skewed_ids(tokens: int, offset: int = 0) -> torch.Tensor:
    """[T, K]: copy 0 of every token to expert 0, the others round robin over experts 1..E-1."""
    t = torch.arange(offset, offset + tokens).unsqueeze(1)
    j = torch.arange(K - 1).unsqueeze(0)
    return torch.cat([torch.zeros(tokens, 1, dtype=torch.long), 1 + (t * (K - 1) + j) % (E - 1)], dim=1)


CASES = [(ep, factor, policy) for ep in (2, 4) for factor in (1.0, 1.3, 4.0) for policy in ("probs", "position")]


def _masks() -> dict:
    rank = dist.get_rank()
    tokens = 40 + 8 * rank                  # unequal token counts per source
    ids = skewed_ids(tokens, offset=rank)
    probs = torch.rand(tokens, K, generator=torch.Generator().manual_seed(rank))
    sent = torch.zeros(E, dtype=torch.long).scatter_add_(0, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.long))
    return {case: {"ids": ids, "probs": probs,
                   "keep": rank_capacity_keep_mask(probs, ids, sent, E, case[0], case[1], case[2], dist.group.WORLD)}
            for case in CASES}


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_distributed(_masks, 4, timeout=120)


@pytest.mark.parametrize(("ep", "factor", "policy"), CASES)
def test_drops_only_above_the_budget(world, ep: int, factor: float, policy: str) -> None:
    ranks = [r[(ep, factor, policy)] for r in world]
    local = E // ep
    sent_sd = torch.stack([torch.stack([((r["ids"] // local) == d).sum() for d in range(ep)]) for r in ranks])
    load_d = sent_sd.sum(0)
    budget = math.floor(sent_sd.sum().item() * factor / ep)
    for s, r in enumerate(ranks):
        dest = r["ids"] // local
        for d in range(ep):
            mine = dest == d
            kept = (r["keep"] & mine).sum().item()
            sent = sent_sd[s, d].item()
            expected = sent if load_d[d] <= budget else sent * budget // load_d[d].item()
            assert kept == expected, (s, d, kept, expected)
            if kept < mine.sum():   # the kept ones are the source's best by the policy
                order = r["probs"][mine] if policy == "probs" else -torch.nonzero(mine)[:, 0].double()
                kept_score, dropped_score = order[r["keep"][mine]], order[~r["keep"][mine]]
                assert kept_score.min() >= dropped_score.max()
    kept_d = [sum(((r["ids"] // local == d) & r["keep"]).sum().item() for r in ranks) for d in range(ep)]
    assert all(k <= max(budget, load) if load <= budget else k <= budget for k, load in zip(kept_d, load_d.tolist()))
    dropped = sum((~r["keep"]).sum().item() for r in ranks)
    over = any(load > budget for load in load_d.tolist())
    assert (dropped > 0) == over   # drops exactly when some rank's load exceeds C x its share
    if factor == 4.0:
        assert dropped == 0


def test_refuses_a_non_positive_factor() -> None:
    ids = skewed_ids(4)
    with pytest.raises(ValueError, match="--moe-expert-rank-capacity-factor=0"):
        rank_capacity_keep_mask(torch.rand(4, K), ids, torch.ones(E, dtype=torch.long), E, 2, 0.0, "probs", None)

"""Quantile balancing and the sqrtsoftplus score function equal Megatron-Core's code on the same inputs, balance a
skewed router, and equal world 1 under tp / cp / dp layouts (one spawned world of 4 gloo ranks).

megatron-core 0.16.1 (the test extra) predates both (0.18: sqrtsoftplus, 0.19: quantile balancing), so the
references below are Megatron-LM's functions transcribed line for line from its sources (moe_utils.py
``qb_dual_update`` and ``topk_routing_with_score_function`` with ``precomputed_indices``,
finalize_model_grads.py ``_update_router_qb_beta``), on random configs over every field that changes them.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from moefold.moe.quantile_balancing import update_quantile_biases
from moefold.moe.router import Router, RouterGroups
from moefold.moe.router_config import RouterConfig
from moefold.moe.scoring import route_scores, scores_for_aux_loss
from moefold.parallel.dims import ParallelConfig, ParallelDims
from tests.distributed import run_distributed

H = 16


# ----------------------------------------------------------------------------- Megatron-LM, transcribed
def mcore_qb_dual_update(scores, k, beta, update_beta=True):
    num_tokens, num_experts = scores.shape
    topk_result = (scores - beta).topk(k + 1, dim=1)
    indices = topk_result.indices[:, :-1]
    if not update_beta:
        return indices, beta
    col_target = num_tokens * k // num_experts
    alpha = topk_result.values[:, -1:]
    beta_local = (scores - alpha).topk(col_target + 1, dim=0).values[-1].contiguous()
    return indices, beta_local


def mcore_probs(logits, topk, score_function, pre_softmax, scaling, indices=None, expert_bias=None):
    """topk_routing_with_score_function(dense_output=True) without groups: (probs [T, K], indices [T, K])."""
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            probs = scores.gather(1, indices) if indices is not None else None
            if indices is None:
                probs, indices = scores.topk(topk, dim=1)
        else:
            if indices is None:
                scores, indices = logits.topk(topk, dim=1)
            else:
                scores = logits.gather(1, indices)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float()) if score_function == "sigmoid" \
            else torch.nn.functional.softplus(logits.float()).sqrt()
        if indices is not None:
            scores = scores.gather(1, indices)
        elif expert_bias is not None:
            _, indices = (scores + expert_bias.float()).topk(topk, dim=1)
            scores = scores.gather(1, indices)
        else:
            scores, indices = scores.topk(topk, dim=1)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    if scaling:
        probs = probs * scaling
    return probs.type_as(logits), indices


def mcore_update(beta, accum, count, ema):
    new = ema * beta + (1.0 - ema) * accum / max(count, 1)
    return new - new.mean(dim=-1, keepdim=True)


# ----------------------------------------------------------------------------- helpers
def random_config(rng: random.Random) -> dict:
    E = rng.choice([4, 8])
    score = rng.choice(["softmax", "sigmoid", "sqrtsoftplus"])
    return dict(num_experts=E, topk=rng.choice([1, 2, 3]), score_function=score,
                pre_softmax=score == "softmax" and rng.random() < 0.5,
                topk_scaling_factor=rng.choice([None, 2.5]), quantile_balancing_ema=rng.choice([0.0, 0.5, 0.9]),
                load_balancing_type="quantile_balancing", aux_loss_coeff=0.0)


def make_router(cfg: dict, seed: int, groups: RouterGroups | None = None) -> Router:
    r = Router(RouterConfig(**cfg), H, groups or RouterGroups())
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        r.weight.copy_(torch.randn(r.weight.shape, generator=g) * 0.4)
        r.weight[0, :4] += 1.0   # expert 0 favoured: the bias has something to do
    return r


@pytest.mark.parametrize("seed", range(12))
def test_quantile_balancing_equals_megatron(seed: int) -> None:
    """Three steps of two micro-batches: ids exact, probs to fp32 rounding, the bias after every step."""
    rng = random.Random(seed)
    cfg = random_config(rng)
    E, K = cfg["num_experts"], cfg["topk"]
    router = make_router(cfg, seed)
    beta = torch.zeros(E)
    for step in range(3):
        accum, count = torch.zeros(E), 0
        for micro in range(2):
            x = torch.randn(E * 6, H, generator=torch.Generator().manual_seed(100 * seed + 10 * step + micro))
            out = router(x)
            logits = x @ router.weight.detach().t()
            ids, local = mcore_qb_dual_update(logits, K, beta)
            probs, _ = mcore_probs(logits, K, cfg["score_function"], cfg["pre_softmax"], cfg["topk_scaling_factor"],
                                   indices=ids)
            accum, count = accum + local, count + 1
            assert torch.equal(out.routing.expert_ids_TK, ids), (cfg, step, micro)
            # the combine weights: a few fp32 ops apart (softmax over E then renormalised vs over the k)
            torch.testing.assert_close(out.routing.probs_TK, probs, rtol=1e-6 * 8, atol=1e-7)
        update_quantile_biases([router], None)
        beta = mcore_update(beta, accum, count, cfg["quantile_balancing_ema"])
        torch.testing.assert_close(router.qb_beta, beta, rtol=0, atol=1e-6)
        assert int(router.qb_beta_count) == 0 and not router.qb_beta_accum.any()
    router.eval()   # evaluation selects against the bias and accumulates nothing
    x = torch.randn(E * 6, H)
    ids, _ = mcore_qb_dual_update(x @ router.weight.detach().t(), K, beta, update_beta=False)
    assert torch.equal(router(x).routing.expert_ids_TK, ids)
    assert int(router.qb_beta_count) == 0


@pytest.mark.parametrize("seed", range(6))
def test_sqrtsoftplus_equals_megatron(seed: int) -> None:
    """Selection (with and without expert bias) and combine weights; the balance losses' scores sum to 1."""
    rng = random.Random(seed)
    E, K = rng.choice([4, 8]), rng.choice([1, 2, 3])
    scaling = rng.choice([None, 2.5])
    logits = torch.randn(24, E, generator=torch.Generator().manual_seed(seed)) * 3
    bias = torch.randn(E, generator=torch.Generator().manual_seed(seed + 1)) if seed % 2 else None
    config = RouterConfig(num_experts=E, topk=K, score_function="sqrtsoftplus", topk_scaling_factor=scaling,
                          enable_expert_bias=bias is not None)
    scores, ids, probs = route_scores(logits, config, bias)
    ref_probs, ref_ids = mcore_probs(logits, K, "sqrtsoftplus", False, scaling, expert_bias=bias)
    assert torch.equal(ids.sort(dim=1).values, ref_ids.sort(dim=1).values)
    order = ids.argsort(dim=1), ref_ids.argsort(dim=1)
    torch.testing.assert_close(probs.gather(1, order[0]), ref_probs.gather(1, order[1]), rtol=1e-6, atol=1e-7)
    aux = scores_for_aux_loss(scores, "sqrtsoftplus")
    torch.testing.assert_close(aux.sum(-1), torch.ones(24))
    assert (scores > 0).all()


def test_quantile_balancing_balances_a_skewed_router() -> None:
    cfg = dict(num_experts=8, topk=2, score_function="sigmoid", load_balancing_type="quantile_balancing",
               aux_loss_coeff=0.0)
    router = make_router(cfg, 0)
    with torch.no_grad():
        router.weight[1, :4] += 1.0   # two favoured experts
    x = torch.randn(256, H, generator=torch.Generator().manual_seed(1))
    x[:, :4] += 1.0   # every token leans towards experts 0 and 1
    ratios = []
    for _ in range(6):
        load = router(x).load_E.float()
        ratios.append(float(load.max() / load.mean()))
        update_quantile_biases([router], None)
    assert ratios[0] > 2.0
    # the quantile of the same tokens is the bias that splits them evenly (up to ties at the quantile)
    assert ratios[-1] < 1.1, ratios
    print("quantile balancing, max/mean load per step:", " ".join(f"{r:.2f}" for r in ratios))


def test_refusals_and_state() -> None:
    base = dict(num_experts=8, topk=2, load_balancing_type="quantile_balancing")
    for bad, match in ((dict(load_balancing_type=("quantile_balancing", "aux_loss")), "cannot be combined"),
                       (dict(num_groups=4, group_topk=2), "num_groups=4 cannot"),
                       (dict(enable_expert_bias=True), "enable_expert_bias=True cannot"),
                       (dict(quantile_balancing_ema=1.0), r"quantile_balancing_ema=1.0 must be in \[0, 1\)")):
        with pytest.raises(ValueError, match=match):
            RouterConfig(**{**base, **bad})
    router = Router(RouterConfig(**base), H)
    with pytest.raises(ValueError, match="7 tokens x top-2 = 14 routed copies are not a multiple of num_experts=8"):
        router(torch.randn(7, H))
    state = router.state_dict()
    assert "qb_beta" in state and "qb_beta_accum" not in state and "qb_beta_count" not in state
    assert RouterConfig(**{**base, "score_function": "sqrtsoftplus"}).resolved_norm_topk_prob


# ----------------------------------------------------------------------------- layouts
E, K, B, S, M = 8, 2, 4, 8, 2   # experts, top-k, sequences per micro-batch, sequence length, micro-batches
LAYOUTS = (dict(tp=2, dp=2), dict(cp=2, dp=2), dict(tp=2, cp=2))
QB = dict(num_experts=E, topk=K, score_function="sigmoid", load_balancing_type="quantile_balancing",
          aux_loss_coeff=0.0, quantile_balancing_ema=0.5)


def step_data(step: int) -> torch.Tensor:
    return torch.randn(M, B, S, H, generator=torch.Generator().manual_seed(50 + step))


def run_steps(router: Router, shard) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """3 steps: per micro-batch (ids, probs) of the shard ``shard(x, m)`` gives, then the bias update."""
    out = []
    for step in range(3):
        x = step_data(step)
        for key, xs in shard(x):
            routed = router(xs.reshape(-1, H))
            out.append(((step, key), routed.routing.expert_ids_TK.view(*xs.shape[:2], K),
                        routed.routing.probs_TK.detach().view(*xs.shape[:2], K)))
        update_quantile_biases([router], router.groups.tp_cp_dp)
        out.append(("beta", router.qb_beta.clone(), None))
    return out


def layouts_body() -> dict:
    results = {}
    for layout in LAYOUTS:
        dims = ParallelDims.build(ParallelConfig(**layout))
        tpcp = dims.tp * dims.cp
        r_seq = dims.cp_rank * dims.tp + dims.tp_rank
        bl, sl = B // dims.dp, S // tpcp

        def shard(x, dims=dims, bl=bl, sl=sl, r_seq=r_seq):
            return [((m, dims.dp_rank, r_seq), x[m, dims.dp_rank * bl:(dims.dp_rank + 1) * bl,
                                                 r_seq * sl:(r_seq + 1) * sl]) for m in range(M)]
        results[str(layout)] = run_steps(make_router(QB, 3, RouterGroups.from_dims(dims)), shard)
        dist.barrier()
    return results


def test_quantile_balancing_layouts_equal_world1() -> None:
    """A dp rank's micro-batch is world 1's micro-batch of those sequences (the quantile is per micro-batch, the
    bias averaged over the step's micro-batches and dp): world 1 routes the dp shards as separate micro-batches."""
    ranks = run_distributed(layouts_body, 4, timeout=240)
    for layout in LAYOUTS:
        dp = layout.get("dp", 1)
        tpcp = 4 // dp
        bl, sl = B // dp, S // tpcp

        def world1_shard(x, bl=bl, dp=dp):
            return [((m, d), x[m, d * bl:(d + 1) * bl]) for m in range(M) for d in range(dp)]
        ref = run_steps(make_router(QB, 3), world1_shard)
        ref_micro = {m: (ids, probs) for m, ids, probs in ref if m != "beta"}
        ref_betas = [b for m, b, _ in ref if m == "beta"]
        for rank, res in enumerate(ranks):
            got = res[str(layout)]
            betas = [b for m, b, _ in got if m == "beta"]
            for b, rb in zip(betas, ref_betas):   # dp ranks' quantiles summed: fp32 rounding of a mean
                torch.testing.assert_close(b, rb, rtol=0, atol=1e-6, msg=lambda s: f"{layout} rank {rank}: {s}")
            for (step, (m, d, r_seq)), ids, probs in (g for g in got if g[0] != "beta"):
                rids, rprobs = ref_micro[(step, (m, d))]
                part = slice(r_seq * sl, (r_seq + 1) * sl)
                assert torch.equal(ids, rids[:, part]), (layout, rank, step, m)
                torch.testing.assert_close(probs, rprobs[:, part])
        assert ref_betas[-1].abs().max() > 1e-3   # the bias moved

"""Router scores, top-k, group limits, scaling, forcing, capacity: worked examples and properties."""

import math

import pytest
import torch

from moefold.moe.capacity import capacity_keep_mask, expert_capacity
from moefold.moe.router import Router
from moefold.moe.router_config import RouterConfig
from moefold.moe.scoring import group_limited_mask, route_scores


def logit(p):
    p = torch.tensor(p, dtype=torch.float64)
    return torch.log(p / (1 - p))


def sorted_by_id(ids, probs):
    order = ids.argsort(dim=-1)
    return ids.gather(-1, order), probs.gather(-1, order)


def cfg(**kw):
    kw.setdefault("num_experts", 4)
    return RouterConfig(**kw)


# softmax over [1, 2, 3, 4] / 10 -> p = [.1, .2, .3, .4]; top-2 = experts 3 and 2
SOFTMAX_LOGITS = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]], dtype=torch.float64))


def test_softmax_post_topk_renormalises():
    _, ids, probs = route_scores(SOFTMAX_LOGITS, cfg(topk=2))
    ids, probs = sorted_by_id(ids, probs)
    assert ids.tolist() == [[2, 3], [0, 1]]
    torch.testing.assert_close(probs, torch.tensor([[3 / 7, 4 / 7], [4 / 7, 3 / 7]], dtype=torch.float64))


def test_softmax_pre_softmax_keeps_full_distribution_probs():
    _, ids, probs = route_scores(SOFTMAX_LOGITS, cfg(topk=2, pre_softmax=True))
    ids, probs = sorted_by_id(ids, probs)
    assert ids.tolist() == [[2, 3], [0, 1]]
    torch.testing.assert_close(probs, torch.tensor([[0.3, 0.4], [0.4, 0.3]], dtype=torch.float64))
    _, _, normed = route_scores(SOFTMAX_LOGITS, cfg(topk=2, pre_softmax=True, norm_topk_prob=True))
    torch.testing.assert_close(normed.sort(-1).values, torch.tensor([[3 / 7, 4 / 7]] * 2, dtype=torch.float64))


def test_sigmoid_bias_selects_but_does_not_weight_and_scaling():
    # sigmoid scores [.2, .5, .6, .9]; bias [.5, 0, 0, -.5] -> selection scores [.7, .5, .6, .4]
    logits = logit([[0.2, 0.5, 0.6, 0.9]])
    bias = torch.tensor([0.5, 0.0, 0.0, -0.5], dtype=torch.float64)
    _, ids, probs = route_scores(logits, cfg(topk=2, score_function="sigmoid", topk_scaling_factor=2.5), bias)
    ids, probs = sorted_by_id(ids, probs)
    assert ids.tolist() == [[0, 2]]
    # unbiased .2 and .6, normalised over the k -> .25, .75, times 2.5
    torch.testing.assert_close(probs, torch.tensor([[0.625, 1.875]], dtype=torch.float64))
    _, ids_nb, probs_nb = route_scores(logits, cfg(topk=2, score_function="sigmoid", norm_topk_prob=False))
    ids_nb, probs_nb = sorted_by_id(ids_nb, probs_nb)
    assert ids_nb.tolist() == [[2, 3]]
    torch.testing.assert_close(probs_nb, torch.tensor([[0.6, 0.9]], dtype=torch.float64))


def test_expert_bias_also_steers_softmax_selection():
    bias = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    _, ids, probs = route_scores(SOFTMAX_LOGITS[:1], cfg(topk=2), bias)
    ids, probs = sorted_by_id(ids, probs)
    assert ids.tolist() == [[0, 3]]  # selection .1+1 and .4 ; weights from unbiased .1, .4
    torch.testing.assert_close(probs, torch.tensor([[0.2, 0.8]], dtype=torch.float64))


def test_group_limited_worked_example():
    # 8 experts in 4 groups of 2; group score = sum of top 2 (= topk 4 // group_topk 2)
    # groups: {.95,.01}=.96  {.8,.7}=1.5  {.9,.5}=1.4  {.3,.2}=.5 -> keep groups 1, 2
    scores = [[0.95, 0.01, 0.8, 0.7, 0.9, 0.5, 0.3, 0.2]]
    c = RouterConfig(num_experts=8, topk=4, score_function="sigmoid", num_groups=4, group_topk=2)
    _, ids, probs = route_scores(logit(scores), c)
    ids, probs = sorted_by_id(ids, probs)
    assert ids.tolist() == [[2, 3, 4, 5]]  # expert 0 (the best) lies in a dropped group
    torch.testing.assert_close(probs, torch.tensor([[0.8, 0.7, 0.9, 0.5]], dtype=torch.float64) / 2.9)
    # without groups, the plain top-4 takes expert 0
    _, ids_free, _ = route_scores(logit(scores), RouterConfig(num_experts=8, topk=4, score_function="sigmoid"))
    assert sorted(ids_free[0].tolist()) == [0, 2, 3, 4]
    # group score of the top-1 only (group_score_topk=1): {.95, .8, .9, .3} -> groups 0, 2
    c1 = RouterConfig(num_experts=8, topk=4, score_function="sigmoid", num_groups=4, group_topk=2,
                      group_score_topk=1)
    _, ids1, _ = route_scores(logit(scores), c1)
    assert sorted(ids1[0].tolist()) == [0, 1, 4, 5]


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_group_limited_never_leaves_chosen_groups(score_function):
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        E, G = 16, [2, 4, 8][trial % 3]
        gk = 1 + trial % G
        per = E // G
        k = min(1 + trial % 5, gk * per)
        gst = 1 + trial % per
        c = RouterConfig(num_experts=E, topk=k, score_function=score_function, num_groups=G, group_topk=gk,
                         group_score_topk=gst)
        logits = torch.randn(64, E, generator=gen, dtype=torch.float64) * 3
        bias = torch.randn(E, generator=gen, dtype=torch.float64) * 0.1
        scores, ids, _ = route_scores(logits, c, bias)
        sel = scores + bias
        # the kept groups, recomputed directly: top group_topk groups by the sum of their top gst scores
        group_score = sel.view(64, G, per).sort(-1, descending=True).values[..., :gst].sum(-1)
        kept = group_score.topk(gk, dim=-1).indices
        expert_group = ids // per
        assert (expert_group.unsqueeze(-1) == kept.unsqueeze(1)).any(-1).all(), (trial, c)
        assert torch.equal(group_limited_mask(sel, G, gk, gst).gather(1, ids), torch.ones_like(ids, dtype=torch.bool))
        assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct experts


def test_forced_uniform_routing_round_robin():
    c = RouterConfig(num_experts=4, topk=2, force_load_balancing=True)
    _, ids, probs = route_scores(torch.randn(6, 4, dtype=torch.float64), c)
    assert ids.tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1], [2, 3]]
    torch.testing.assert_close(probs.sum(-1), torch.ones(6, dtype=torch.float64))


def test_router_end_to_end_identity_gate_and_dtypes():
    # weight = identity, so logits = x; bf16 input still gates in fp32 / fp64
    for dtype_name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
        r = Router(RouterConfig(num_experts=4, topk=2, router_dtype=dtype_name), hidden_size=4)
        with torch.no_grad():
            r.weight.copy_(torch.eye(4))
        out = r(SOFTMAX_LOGITS.to(torch.bfloat16))
        assert out.logits_TE.dtype == dtype and out.routing.probs_TK.dtype == torch.float32
        ids, probs = sorted_by_id(out.routing.expert_ids_TK, out.routing.probs_TK)
        assert ids.tolist() == [[2, 3], [0, 1]]
        expected = torch.tensor([[3 / 7, 4 / 7], [4 / 7, 3 / 7]])
        torch.testing.assert_close(probs, expected, atol=1e-2, rtol=0)  # bf16 input rounds the logits
        assert out.routing.tokens_per_expert_E.tolist() == [1, 1, 1, 1]
        assert out.routing.keep_TK is None and out.routing.capacity is None


def test_input_jitter_training_only_and_seeded():
    c = RouterConfig(num_experts=8, topk=2, input_jitter_eps=0.1)
    r = Router(c, hidden_size=16)
    x = torch.randn(32, 16)
    a = r(x, generator=torch.Generator().manual_seed(1)).logits_TE
    b = r(x, generator=torch.Generator().manual_seed(1)).logits_TE
    d = r(x, generator=torch.Generator().manual_seed(2)).logits_TE
    assert torch.equal(a, b) and not torch.equal(a, d)
    r.eval()
    clean = torch.nn.functional.linear(x, r.weight)
    torch.testing.assert_close(r(x).logits_TE, clean)
    # the documented noise: x * U(1 - eps, 1 + eps) drawn from the given generator, router input only
    noise = torch.empty_like(x).uniform_(0.9, 1.1, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(a, torch.nn.functional.linear(x * noise, r.weight))


# ---------------------------------------------------------------------------------------- capacity
def test_capacity_formula():
    assert expert_capacity(10, 2, 4, 1.0) == 5
    assert expert_capacity(10, 2, 4, 1.1) == math.ceil(5.5)
    assert expert_capacity(7, 1, 4, 1.0) == 2


def test_capacity_worked_example_probs_and_position():
    # 4 tokens, k=1, all choose expert 0; capacity ceil(4*1/2*1.0) = 2
    probs = torch.tensor([[0.6], [0.9], [0.7], [0.8]])
    ids = torch.zeros(4, 1, dtype=torch.int64)
    cap = expert_capacity(4, 1, 2, 1.0)
    assert cap == 2
    assert capacity_keep_mask(probs, ids, 2, cap, "probs").view(-1).tolist() == [False, True, False, True]
    assert capacity_keep_mask(probs, ids, 2, cap, "position").view(-1).tolist() == [True, True, False, False]


def test_capacity_properties_random():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        T, K, E = 40, 1 + trial % 3, 8
        factor = [0.5, 1.0, 1.5][trial % 3]
        logits = torch.randn(T, E, generator=gen) * (1 + trial % 4)
        c = RouterConfig(num_experts=E, topk=K, expert_capacity_factor=factor,
                         token_drop_policy=["probs", "position"][trial % 2])
        _, ids, probs = route_scores(logits, c)
        cap = expert_capacity(T, K, E, factor)
        keep = capacity_keep_mask(probs, ids, E, cap, c.token_drop_policy)
        for e in range(E):
            sel = ids == e
            kept, dropped = keep & sel, ~keep & sel
            assert kept.sum() <= cap
            assert kept.sum() == min(cap, int(sel.sum()))
            if dropped.any():
                if c.token_drop_policy == "probs":
                    assert probs[kept].min() >= probs[dropped].max()
                else:  # earliest tokens kept: every kept token precedes every dropped one
                    t_kept = kept.any(-1).nonzero().max()
                    t_drop = dropped.any(-1).nonzero().min()
                    assert t_kept <= t_drop


def test_router_capacity_zeroes_dropped_probs_and_counts_kept():
    c = RouterConfig(num_experts=4, topk=2, expert_capacity_factor=0.5, pad_expert_input_to_capacity=True)
    r = Router(c, hidden_size=8)
    out = r(torch.randn(16, 8))
    ro = out.routing
    assert ro.capacity == expert_capacity(16, 2, 4, 0.5) and ro.pad_to_capacity
    assert (ro.probs_TK[~ro.keep_TK] == 0).all()
    kept = torch.bincount(ro.expert_ids_TK[ro.keep_TK], minlength=4)
    assert torch.equal(kept, ro.tokens_per_expert_E) and (kept <= ro.capacity).all()
    assert torch.equal(out.load_E, torch.bincount(ro.expert_ids_TK.view(-1), minlength=4))
    expected_drop = 1 - kept.sum() / 32
    torch.testing.assert_close(out.stats.dropped_fraction, expected_drop.float())


# -------------------------------------------------------------------------------------- bad config
@pytest.mark.parametrize("kw, words", [
    (dict(num_experts=4, topk=5), ["topk=5", "num_experts=4"]),
    (dict(num_experts=8, topk=2, num_groups=3, group_topk=1), ["num_groups=3", "num_experts=8", "valid: 1, 2, 4, 8"]),
    (dict(num_experts=8, topk=2, num_groups=4, group_topk=5), ["group_topk=5", "num_groups=4"]),
    (dict(num_experts=8, topk=2, num_groups=4), ["group_topk=None"]),
    (dict(num_experts=8, topk=2, score_function="relu"), ["score_function='relu'", "softmax, sigmoid"]),
    (dict(num_experts=8, enable_expert_bias=True, bias_update_rate=-0.1), ["bias_update_rate=-0.1"]),
    (dict(num_experts=8, load_balancing_type="sinkhorn"), ["sinkhorn"]),
    (dict(num_experts=8, load_balancing_type=("aux_loss", "z"), aux_loss_coeff=(1.0, 2.0)), ["'z'"]),
    (dict(num_experts=8, load_balancing_type=("aux_loss", "seq_aux_loss"), aux_loss_coeff=(1.0, 2.0, 3.0)),
     ["3 values"]),
    (dict(num_experts=8, token_drop_policy="random"), ["token_drop_policy='random'"]),
    (dict(num_experts=8, pad_expert_input_to_capacity=True), ["expert_capacity_factor"]),
    (dict(num_experts=8, router_dtype="bf16"), ["router_dtype='bf16'"]),
    (dict(num_experts=8, score_function="sigmoid", pre_softmax=True), ["pre_softmax"]),
    (dict(num_experts=8, norm_topk_prob=False), ["norm_topk_prob=False"]),
    (dict(num_experts=0), ["num_experts=0"]),
])
def test_bad_config_fails_clearly(kw, words):
    with pytest.raises(ValueError) as info:
        RouterConfig(**kw)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_config_normalises_types_and_coeffs():
    c = RouterConfig(num_experts=8, load_balancing_type=("aux_loss", "seq_aux_loss"), aux_loss_coeff=0.01)
    assert c.load_balancing_type == ("aux_loss", "seq_aux_loss") and c.aux_loss_coeff == (0.01, 0.01)
    assert c.loss_coeffs() == {"aux_loss": 0.01, "seq_aux_loss": 0.01}
    with pytest.raises(ValueError, match="hidden_size"):
        Router(RouterConfig(num_experts=4), hidden_size=0)

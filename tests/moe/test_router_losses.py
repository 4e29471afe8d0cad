"""Balance losses and z-loss against the paper formulas, written out directly here (world 1)."""

import pytest
import torch

from moefold.moe.balance_losses import batch_first_seq_ids
from moefold.moe.router import Router
from moefold.moe.router_config import RouterConfig

E, K, H = 8, 2, 16


def direct_route(weight, x, score_function):
    """Per-token distribution over experts as the papers define it, from scratch."""
    logits = x.double() @ weight.double().T
    if score_function == "softmax":
        p = logits.exp() / logits.exp().sum(-1, keepdim=True)
    else:
        s = 1 / (1 + (-logits).exp())
        p = s / s.sum(-1, keepdim=True)  # DeepSeek-V3 s'_{i,t}
    return logits, p


def switch_formula(p, ids):
    # Switch Transformer: loss = N * sum_i f_i P_i, f_i = fraction of routed copies to expert i
    T = p.shape[0]
    loss = 0.0
    for i in range(E):
        f_i = (ids == i).sum() / (T * K)
        P_i = p[:, i].mean()
        loss = loss + E * f_i * P_i
    return loss


def seq_formula(p, ids, seq_ids, num_seqs):
    # DeepSeek-V3 eqs. 17-20, per sequence, averaged over sequences
    total = 0.0
    for s in range(num_seqs):
        rows = seq_ids == s
        L = rows.sum()
        for i in range(E):
            f_i = E / (K * L) * (ids[rows] == i).sum()
            P_i = p[rows, i].sum() / L
            total = total + f_i * P_i
    return total / num_seqs


def z_formula(logits):
    # ST-MoE eq. 5: (1/B) sum_t (log sum_j exp x_tj)^2
    return (logits.exp().sum(-1).log() ** 2).mean()


@pytest.mark.parametrize("counts", ["topk", "dispatched"])
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_losses_match_paper_formulas_values_and_grads(score_function, counts):
    """The indicator is the papers' (and Megatron-Core's) plain top-k of the scores; with ``dispatched`` counts,
    the selection the tokens are dispatched with (group limit and expert bias included)."""
    torch.manual_seed(0)
    kw = dict(score_function=score_function, aux_loss_counts=counts)
    if score_function == "sigmoid":
        kw.update(num_groups=4, group_topk=2, enable_expert_bias=True, topk_scaling_factor=2.5)
    c = RouterConfig(num_experts=E, topk=K, load_balancing_type=("aux_loss", "seq_aux_loss"),
                     aux_loss_coeff=(0.3, 0.7), z_loss_coeff=0.05, **kw)
    r = Router(c, H)
    torch.nn.init.normal_(r.weight, std=0.5)
    if r.expert_bias is not None:
        r.expert_bias.copy_(torch.randn(E) * 0.2)
    x = torch.randn(24, H)
    seq_ids = torch.tensor([0, 1, 2] * 8)  # interleaved (sequence-first) layout, 3 sequences of 8
    out = r(x, seq_ids_T=seq_ids, num_seqs=3)
    ids = out.routing.expert_ids_TK

    w = r.weight.detach().clone().double().requires_grad_(True)
    logits, p = direct_route(w, x, score_function)
    if counts == "topk":
        ids = p.detach().topk(K, dim=-1).indices
        if score_function == "sigmoid":   # bias and group limit make the two selections differ here
            assert not torch.equal(ids.sort(-1).values, out.routing.expert_ids_TK.sort(-1).values)
    aux, seq, z = switch_formula(p, ids), seq_formula(p, ids, seq_ids, 3), z_formula(logits)
    torch.testing.assert_close(out.losses["aux_loss"].double(), aux, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.losses["seq_aux_loss"].double(), seq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.losses["z_loss"].double(), z, rtol=1e-5, atol=1e-6)
    total = 0.3 * aux + 0.7 * seq + 0.05 * z
    torch.testing.assert_close(out.aux_loss.double(), total, rtol=1e-5, atol=1e-6)
    out.aux_loss.backward()
    total.backward()
    torch.testing.assert_close(r.weight.grad.double(), w.grad, rtol=1e-5, atol=2e-7)
    # the balance losses' f uses the dispatched selection, here group-limited and biased
    assert out.load_E.sum() == 24 * K


def test_seq_aux_batch_first_default_layout():
    c = RouterConfig(num_experts=E, topk=K, load_balancing_type="seq_aux_loss", aux_loss_coeff=1.0)
    r = Router(c, H)
    x = torch.randn(12, H)
    a = r(x, num_seqs=3).losses["seq_aux_loss"]
    b = r(x, seq_ids_T=batch_first_seq_ids(3, 4), num_seqs=3).losses["seq_aux_loss"]
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="num_seqs"):
        r(x)
    with pytest.raises(ValueError, match="not divisible by num_seqs=5"):
        r(x, num_seqs=5)


def test_global_aux_loss_running_mean_over_micro_batches():
    # Qwen global-batch balance at world 1: f from the mean counts of micro-batches 1..m
    torch.manual_seed(0)
    c = RouterConfig(num_experts=E, topk=K, load_balancing_type="global_aux_loss", aux_loss_coeff=1.0)
    r = Router(c, H)
    torch.nn.init.normal_(r.weight, std=0.5)
    xs = [torch.randn(10, H) for _ in range(4)]
    state, counts = None, torch.zeros(E, dtype=torch.float64)
    for m, x in enumerate(xs, start=1):
        r.zero_grad()
        out = r(x, global_state=state)
        state = out.global_state
        counts += torch.bincount(out.routing.expert_ids_TK.view(-1), minlength=E)
        assert state.num_micro_batches == m and torch.equal(state.counts_E, counts)
        w = r.weight.detach().clone().double().requires_grad_(True)
        _, p = direct_route(w, x, "softmax")
        f = counts / m / (10 * K)  # the counts are constants: only P_e = mean_t p_te carries gradient
        expected = E * (f * p.mean(0)).sum()
        torch.testing.assert_close(out.losses["global_aux_loss"].double(), expected, rtol=1e-5, atol=1e-6)
        out.aux_loss.backward()
        expected.backward()
        assert w.grad.abs().max() > 1e-3  # the loss does train the router
        torch.testing.assert_close(r.weight.grad.double(), w.grad, rtol=1e-5, atol=2e-7)
    # micro-batch 1 alone equals the plain aux loss
    c1 = RouterConfig(num_experts=E, topk=K, load_balancing_type="aux_loss", aux_loss_coeff=1.0)
    r1 = Router(c1, H)
    r1.load_state_dict(r.state_dict())
    torch.testing.assert_close(r1(xs[0]).losses["aux_loss"], r(xs[0]).losses["global_aux_loss"])


def test_no_losses_gives_zero_and_stats():
    r = Router(RouterConfig(num_experts=E, topk=K, load_balancing_type="none"), H)
    out = r(torch.randn(16, H))
    assert out.losses == {} and float(out.aux_loss.detach()) == 0.0
    s = out.stats
    load = torch.bincount(out.routing.expert_ids_TK.view(-1), minlength=E).float()
    torch.testing.assert_close(s.tokens_per_expert_E, load)
    torch.testing.assert_close(s.max_over_mean, load.max() / load.mean())
    torch.testing.assert_close(s.cv, load.std(unbiased=False) / load.mean())
    assert int(s.num_empty_experts) == int((load == 0).sum())
    assert float(s.dropped_fraction) == 0.0
    p = torch.softmax(out.logits_TE, -1)
    torch.testing.assert_close(s.entropy, -(p * p.log()).sum(-1).mean())
    assert set(s.as_dict()) >= {"max_over_mean", "cv", "entropy", "bias_min", "bias_max"}


def test_empty_input_gives_zero_losses_not_nan():
    c = RouterConfig(num_experts=E, topk=K, load_balancing_type=("aux_loss", "seq_aux_loss", "global_aux_loss"),
                     aux_loss_coeff=1.0, z_loss_coeff=1e-3, expert_capacity_factor=1.0)
    r = Router(c, H)
    out = r(torch.randn(0, H), num_seqs=1)
    assert out.routing.probs_TK.shape == (0, K) and out.routing.capacity == 0
    assert float(out.aux_loss.detach()) == 0.0 and all(float(v) == 0.0 for v in out.losses.values())
    assert all(v == v for v in out.stats.as_dict().values()) and float(out.stats.dropped_fraction) == 0.0
    out.aux_loss.backward()
    assert torch.equal(r.weight.grad, torch.zeros_like(r.weight))

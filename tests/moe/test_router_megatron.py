"""The router's balancing losses equal Megatron-Core 0.16.1's ``TopKRouter`` for the same weight, expert bias
and input, with sigmoid group-limited biased routing (DeepSeek-V3's), where the counts of a plain top-k and
of the dispatched selection differ: Megatron counts the plain top-k (``compute_routing_scores_for_aux_loss``),
and so does moefold by default; ``aux_loss_counts="dispatched"`` (moefold's earlier convention) does not."""

from __future__ import annotations

import pytest
import torch

from moefold.moe.router import Router
from moefold.moe.router_config import RouterConfig
from tests.distributed import run_distributed
from tests.megatron_compat import init_megatron, require_megatron

E, K, H, S, B = 8, 2, 16, 6, 3


def _megatron_losses(kind: str, weight, bias, x_SBH) -> tuple[float, torch.Tensor]:
    """(Megatron's unweighted loss value, its routing map) for ``kind`` on [S, B, H] input."""
    init_megatron()
    from megatron.core.transformer.moe import router as mrouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    captured = {}
    mrouter.save_to_aux_losses_tracker = lambda name, loss, *a, **k: captured.__setitem__(name, loss.detach())
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=E,
                               moe_router_topk=K, moe_router_score_function="sigmoid", moe_router_num_groups=4,
                               moe_router_group_topk=2, moe_router_enable_expert_bias=True,
                               moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type=kind,
                               moe_aux_loss_coeff=0.01, moe_router_dtype="fp32", use_cpu_initialization=True,
                               add_bias_linear=False)
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    router = mrouter.TopKRouter(config, pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    with torch.no_grad():
        router.weight.copy_(weight)
        router.expert_bias.copy_(bias)
    router.train()
    _, routing_map = router(x_SBH.clone().requires_grad_(True))
    name = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}[kind]
    return float(captured[name]), routing_map


def _compare(kind: str) -> dict:
    torch.manual_seed(0)
    weight, bias, x = torch.randn(E, H) * 0.5, torch.randn(E) * 0.3, torch.randn(S, B, H)
    theirs, routing_map = _megatron_losses(kind, weight, bias, x)
    out = {"megatron": theirs}
    for counts in ("topk", "dispatched"):
        r = Router(RouterConfig(num_experts=E, topk=K, score_function="sigmoid", num_groups=4, group_topk=2,
                                enable_expert_bias=True, topk_scaling_factor=2.5, load_balancing_type=kind,
                                aux_loss_coeff=0.01, aux_loss_counts=counts), H)
        with torch.no_grad():
            r.weight.copy_(weight)
            r.expert_bias.copy_(bias)
        # tokens are [S, B] sequence-first, as Megatron's router sees them: token t belongs to sequence t % B
        res = r(x.reshape(S * B, H), seq_ids_T=torch.arange(S * B) % B, num_seqs=B)
        out[counts] = float(res.losses[kind])
        dispatched = torch.zeros(S * B, E, dtype=torch.bool).scatter_(1, res.routing.expert_ids_TK, True)
        out["same_routing"] = bool(torch.equal(dispatched, routing_map))
    return out


@pytest.mark.parametrize("kind", ["seq_aux_loss", "aux_loss"])
def test_balancing_loss_equals_megatron(kind):
    require_megatron()
    res = run_distributed(_compare, 1, kind)[0]
    assert res["same_routing"]   # the dispatched routing (bias, group limit) is Megatron's too
    assert res["topk"] == pytest.approx(res["megatron"], rel=1e-6)
    assert res["dispatched"] != pytest.approx(res["megatron"], rel=1e-3)   # the counts differ here

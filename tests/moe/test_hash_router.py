"""Hash-routed MoE layers (moe.hash_router: DeepSeek-V4's ``hash_moe``, a frozen token-id -> expert table).

- The layer with a hash router equals transformers' ``DeepseekV4HashRouter`` + ``DeepseekV4Experts`` (fp32, 1e-5)
  over random tables, inputs and router options (score function, top-k, scaling, clamped SwiGLU), and the whole
  ``DeepseekV4SparseMoeBlock`` (hash or top-k with the correction bias, shared expert with its clamp);
- the selection is the table's whatever the gate weight, and the gate weight still learns (its gradient is that
  of the combine weights at the table's ids);
- a fresh table gives each token distinct experts and each expert an equal share of the vocabulary;
- refusals name the value: ids missing or given to a top-k layer, a wrong shape, selection options;
- one 4-rank world: ep2, ep4, etp2, ep2 x etp2 (alltoall, allgather), tp2 with and without SP and flex (DeepEP
  V2's stand-in), with V4's clamped SwiGLU, equal world 1 (outputs, input and parameter gradients): the ids
  are global expert ids.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from moefold.dispatch.config import DispatchConfig, DispatcherKind, FlexOptions
from moefold.dispatch.flex_backend import FlexBackend
from moefold.moe.activation import GatedActivation
from moefold.moe.build import build_moe_layer
from moefold.moe.config import ExpertsConfig, MoEConfig, SharedExpertsConfig
from moefold.moe.hash_router import HashRouter, balanced_table
from moefold.moe.layer import MoELayer
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import init_parameters
from tests.dispatch import deepep_elastic_standin
from tests.distributed import run_distributed
from tests.moe.hf_v4 import v4_moe_layer
from tests.moe.layout_check import LAYOUTS, layer_failures

E, H, FFN, S, B, V = 8, 16, 8, 4, 4, 50


def _config(dispatcher: str = "local", *, shared: bool = True, clamp: float | None = None, **router) -> MoEConfig:
    rc = RouterConfig(num_experts=E, init_std=0.3, **{"topk": 2, "aux_loss_coeff": 0.01, **router})
    experts = ExpertsConfig(FFN, init_std=0.4, glu=GatedActivation(clamp=clamp))
    return MoEConfig(num_experts=E, router=rc, experts=experts, dispatch=DispatchConfig(dispatcher),
                     shared=SharedExpertsConfig(FFN, init_std=0.4, clamp=clamp) if shared else None)


def _build(cfg: MoEConfig, dims: ParallelDims | None = None, sp: bool = False, seed: int = 11,
           dtype: torch.dtype = torch.float32) -> MoELayer:
    layer = build_moe_layer(cfg, H, dims or ParallelDims.single(), sequence_parallel=sp, dtype=dtype,
                            hash_vocab_size=V)
    init_parameters(layer, seed=seed)
    g = torch.Generator().manual_seed(3)   # a random table (not the balanced default): any ids must route
    layer.router.tid2eid.copy_(torch.rand(V, E, generator=g).argsort(dim=-1)[:, :cfg.router.topk])
    return layer


# ------------------------------------------------------------------------------------------------- HF parity
HF_CASES = [  # (scoring_func, top-k, routed_scaling_factor, swiglu_limit)
    ("sqrtsoftplus", 2, 1.5, 1.0),
    ("sqrtsoftplus", 3, 2.5, 0.5),
    ("sigmoid", 2, 1.0, 1.0),
    ("sqrtsoftplus", 1, 1.0, 10.0),   # HF scores by an activation (ACT2FN): no softmax
]


def _hf_modules(scoring: str, topk: int, scale: float, limit: float):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    cfg = DeepseekV4Config(vocab_size=V, hidden_size=H, moe_intermediate_size=FFN, num_hidden_layers=1,
                           n_routed_experts=E, num_experts_per_tok=topk, scoring_func=scoring,
                           routed_scaling_factor=scale, swiglu_limit=limit, mlp_layer_types=["hash_moe"])
    block = DeepseekV4SparseMoeBlock(cfg, layer_idx=0)
    g = torch.Generator().manual_seed(topk)
    with torch.no_grad():
        for p in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        block.gate.tid2eid.copy_(torch.rand(V, E, generator=g).argsort(dim=-1)[:, :topk])
    return block


@pytest.mark.parametrize("scoring,topk,scale,limit", HF_CASES)
def test_hash_layer_equals_transformers(scoring, topk, scale, limit):
    hf = _hf_modules(scoring, topk, scale, limit)
    cfg = _config(shared=False, clamp=limit, topk=topk, score_function=scoring,
                  topk_scaling_factor=None if scale == 1.0 else scale,
                  norm_topk_prob=True)
    layer = _build(cfg)
    with torch.no_grad():
        layer.router.weight.copy_(hf.gate.weight)
        layer.router.tid2eid.copy_(hf.gate.tid2eid)
        layer.experts.w13.copy_(hf.experts.gate_up_proj.view(E, 2, FFN, H))
        layer.experts.w2.copy_(hf.experts.down_proj)
    g = torch.Generator().manual_seed(7)
    for _ in range(3):   # several draws of inputs and ids
        x_BSH = torch.randn(B, S, H, generator=g) * 2.0
        ids_BS = torch.randint(0, V, (B, S), generator=g)
        with torch.no_grad():
            _, weights, indices = hf.gate(x_BSH, ids_BS)
            want = hf.experts(x_BSH.reshape(-1, H), indices, weights).view(B, S, H)
            got, _ = layer(x_BSH.transpose(0, 1), token_ids_BS=ids_BS)
        torch.testing.assert_close(got.transpose(0, 1), want, atol=1e-5, rtol=1e-5)
    gate_up = torch.einsum("th,efh->tef", x_BSH.reshape(-1, H), hf.experts.gate_up_proj)
    if limit < 10.0:
        assert (gate_up.abs() > limit).any(), "the inputs must reach the SwiGLU clamp"


@pytest.mark.parametrize("kind", ["hash_moe", "moe"])
def test_the_v4_moe_block_equals_transformers(kind):
    """The whole ``DeepseekV4SparseMoeBlock``: routed experts (hash table or top-k with the correction bias) plus
    the shared expert, both with the SwiGLU clamp (``SharedExpertsConfig.clamp``)."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    limit, topk, scale = 0.8, 2, 1.5
    hf_cfg = DeepseekV4Config(vocab_size=V, hidden_size=H, moe_intermediate_size=FFN, num_hidden_layers=1,
                              n_routed_experts=E, num_experts_per_tok=topk, routed_scaling_factor=scale,
                              swiglu_limit=limit, mlp_layer_types=[kind])
    hf = DeepseekV4SparseMoeBlock(hf_cfg, layer_idx=0)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        if kind == "hash_moe":
            hf.gate.tid2eid.copy_(torch.rand(V, E, generator=g).argsort(dim=-1)[:, :topk])
        else:
            hf.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g))
    hashed = kind == "hash_moe"
    layer = v4_moe_layer(hf, H, V, limit, scale)
    x_BSH = torch.randn(B, S, H, generator=g) * 2.0
    ids_BS = torch.randint(0, V, (B, S), generator=g)
    with torch.no_grad():
        want = hf(x_BSH, input_ids=ids_BS)
        got, _ = layer(x_BSH.transpose(0, 1), token_ids_BS=ids_BS if hashed else None)
    torch.testing.assert_close(got.transpose(0, 1), want, atol=1e-5, rtol=1e-5)
    shared_in = x_BSH @ hf.shared_experts.up_proj.weight.T
    assert (shared_in.abs() > limit).any(), "the shared expert's clamp must act"


def test_the_table_selects_and_the_gate_still_learns():
    layer = _build(_config(shared=False, topk=2, score_function="sigmoid"))
    g = torch.Generator().manual_seed(1)
    x_TH, ids_T = torch.randn(S * B, H, generator=g), torch.randint(0, V, (S * B,), generator=g)
    out = layer.router(x_TH, token_ids_T=ids_T)
    assert torch.equal(out.routing.expert_ids_TK, layer.router.tid2eid[ids_T])
    with torch.no_grad():   # other weights: the same experts, other probs
        layer.router.weight.mul_(-3.0)
    again = layer.router(x_TH, token_ids_T=ids_T)
    assert torch.equal(again.routing.expert_ids_TK, out.routing.expert_ids_TK)
    assert not torch.allclose(again.routing.probs_TK, out.routing.probs_TK)
    weight = layer.router.weight.detach().clone().requires_grad_()
    scores = torch.sigmoid(x_TH @ weight.T).gather(1, layer.router.tid2eid[ids_T])
    (scores / scores.sum(-1, keepdim=True)).pow(2).sum().backward()
    layer.router.weight.grad = None
    layer.router(x_TH, token_ids_T=ids_T).routing.probs_TK.pow(2).sum().backward()
    torch.testing.assert_close(layer.router.weight.grad, weight.grad)


@pytest.mark.parametrize("vocab,topk,experts", [(50, 2, 8), (129, 6, 16), (7, 3, 3)])
def test_a_fresh_table_is_balanced_and_distinct(vocab, topk, experts):
    table = balanced_table(vocab, topk, experts)
    assert table.shape == (vocab, topk) and table.dtype == torch.int64
    assert all(len(set(row.tolist())) == topk for row in table)
    loads = torch.bincount(table.reshape(-1), minlength=experts)
    assert int(loads.max() - loads.min()) <= 1
    assert torch.equal(table, balanced_table(vocab, topk, experts))   # the same on every rank


def test_refusals_name_the_value():
    layer = _build(_config())
    x = torch.randn(S, B, H)
    with pytest.raises(ValueError, match="pass token_ids_BS"):
        layer(x)
    with pytest.raises(ValueError, match=r"token_ids_BS has shape \(4, 3\).*\[4, 4\]"):
        layer(x, token_ids_BS=torch.zeros(B, S - 1, dtype=torch.int64))
    topk_layer = build_moe_layer(_config(), H, ParallelDims.single())
    with pytest.raises(ValueError, match="router is a top-k router"):
        topk_layer(x, token_ids_BS=torch.zeros(B, S, dtype=torch.int64))
    with pytest.raises(ValueError, match="enable_expert_bias, num_groups would change"):
        HashRouter(RouterConfig(num_experts=E, enable_expert_bias=True, num_groups=4, group_topk=2), H, V)
    with pytest.raises(ValueError, match="clamp=0 must be > 0"):
        SharedExpertsConfig(FFN, clamp=0)
    with pytest.raises(ValueError, match="vocab_size=0"):
        HashRouter(RouterConfig(num_experts=E), H, 0)
    with pytest.raises(ValueError, match=r"int32/int64, got torch\.float32"):
        layer.router.expert_ids(torch.zeros(3))


# ------------------------------------------------------------------------------------------- layouts, one world
DP = 4
CLAMP = 0.5   # V4's SwiGLU clamp on the routed and the shared experts (acts at these weights: |pre-act| ~ 1.6)


def _batch(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(S, DP, H, generator=g).to(dtype), torch.randn(S, DP, H, generator=g).to(dtype),
            torch.randint(0, V, (DP, S), generator=g))


def _run(layer: MoELayer, x, gy, ids_BS) -> dict:
    x = x.clone().requires_grad_()
    y, info = layer(x, token_ids_BS=ids_BS)
    ((y * gy).sum() + info.aux_loss).backward()
    return {"y": y.detach(), "dx": x.grad, "params": dict(layer.named_parameters())}


def _world1(cfg: MoEConfig, dp: int, dtype=torch.float32) -> list[dict]:
    """The world-1 layer run on each dp share (a share's aux loss counts its own tokens, as on a dp rank)."""
    x, gy, ids = _batch(dtype)
    per = DP // dp
    return [_run(_build(cfg, dtype=dtype), x[:, d * per:(d + 1) * per], gy[:, d * per:(d + 1) * per],
                 ids[d * per:(d + 1) * per]) for d in range(dp)]


def _check(label, dims, cfg, sp, refs, failures, dtype=torch.float32, tol=1e-5):
    per = DP // dims.dp
    x, gy, ids = _batch(dtype)
    rows = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)
    x, gy, ids = x[:, rows], gy[:, rows], ids[rows]
    want = refs[dims.dp_rank]
    want_y, want_dx = want["y"], want["dx"]
    if sp:   # the SP shard of the activations; the ids stay the tp group's
        x, gy, want_y, want_dx = (t.chunk(dims.tp, dim=0)[dims.tp_rank] for t in (x, gy, want_y, want_dx))
    layer = _build(cfg, dims, sp=sp, dtype=dtype)
    got = _run(layer, x, gy, ids)
    ref_grads = {name: sum(r["params"][name].grad for r in refs) for name in refs[0]["params"]}
    failures += layer_failures(label, layer, dims, [("output", got["y"], want_y), ("input grad", got["dx"], want_dx)],
                               ref_grads, tol)


def _world() -> list[str]:
    failures: list[str] = []
    refs: dict = {}   # by dp size
    for label, pc, dispatcher, sp in LAYOUTS:
        dims = ParallelDims.build(pc)
        if dims.dp not in refs:
            refs[dims.dp] = _world1(_config(clamp=CLAMP), dims.dp)
        _check(label, dims, _config(dispatcher, clamp=CLAMP), sp, refs[dims.dp], failures)
    sys.modules["deep_ep"] = deepep_elastic_standin.module()
    from moefold.dispatch.deepep_elastic import ELASTIC_BUFFERS

    flex = dataclasses.replace(_config(clamp=CLAMP), dispatch=DispatchConfig("flex", flex=FlexOptions(
        FlexBackend.DEEPEP, max_tokens_per_rank=S * DP)))
    local = dataclasses.replace(flex, dispatch=dataclasses.replace(flex.dispatch, kind=DispatcherKind.LOCAL))
    dims = ParallelDims.build(ParallelConfig(ep=2))
    _check("flex ep2", dims, flex, False, _world1(local, dims.dp, torch.bfloat16), failures, torch.bfloat16,
           tol=3e-2)
    ELASTIC_BUFFERS.destroy()
    return failures


def test_layouts_equal_world1():
    results = run_distributed(_world, 4, timeout=300)
    failures = sorted({f for per_rank in results for f in per_rank})
    assert not failures, "\n".join(failures[:40])

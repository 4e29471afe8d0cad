"""The MoE layer at every layout equals the world-1 layer: outputs and every parameter gradient.

One 8-rank world checks dispatcher {allgather, alltoall} x ep {1, 2, 4} x etp {1, 2} for several
routing scenarios (random, all tokens to one expert, experts and whole ep ranks with no tokens,
top-k = E, a rank with no tokens) in dropless, capacity and padded-capacity modes, plus attention tp 2 with SP. One
4-rank world checks folding (attention tp2 with experts etp1/ep4 and etp2/ep1) with and without SP.

Reference: each dp rank's micro-batch [S, b, H] through the layer at world 1 (capacity is per
rank, so capacity cases use tp = 1 where a rank's tokens are exactly one reference call);
loss = sum(y * g) + aux_loss; gradients summed over micro-batches. Parallel gradients are
reduced the way the trainer does (expert params over edp, others over dp, sequence-parallel
ones also over tp) and gathered to full shape.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from moefold.dispatch.config import DispatchConfig
from moefold.moe.build import build_moe_layer
from moefold.moe.config import ExpertsConfig, MoEConfig, SharedExpertsConfig
from moefold.moe.experts import is_expert
from moefold.moe.layer import MoELayer
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import init_parameters, is_sequence_parallel, local_slice, shards_of
from tests.distributed import own_groups, run_distributed

H, FFN, SHARED, S, B = 16, 8, 8, 4, 8   # B = dp * b: every dp rank gets B / dp sequences
SCENARIOS = {  # name: (num_experts, topk, router weight edit)
    "random": (8, 2, None),
    "one_expert": (8, 1, ("on", [5])),            # every token to expert 5 only
    "half_off": (8, 2, ("off", [4, 5, 6, 7])),    # experts (and ep ranks) with no tokens
    "topk_all": (4, 4, None),
    "empty_rank": (8, 2, None),                   # dp rank 1 sends no tokens at all (tp = 1 only)
}
EMPTY_DP_RANK = 1
LATENT = 8   # --moe-latent-size below H
MODES = {"dropless": {}, "capacity": {"expert_capacity_factor": 1.0},
         "padded": {"expert_capacity_factor": 1.0, "pad_expert_input_to_capacity": True}}


def _config(scenario: str, mode: str, dispatcher: str, probs_on_input: bool = False,
            latent: int | None = None) -> MoEConfig:
    E, k, _ = SCENARIOS[scenario]
    # Large init so that outputs are O(1) and atol 1e-5 is tight.
    # (the router's losses divide by the token count, so the empty-rank case runs without them)
    losses = {"load_balancing_type": "none"} if scenario == "empty_rank" else {"aux_loss_coeff": 0.01,
                                                                             "z_loss_coeff": 1e-3}
    # probs on input: softmax over all E before the top-1 (else a top-1 prob is always 1)
    router = RouterConfig(num_experts=E, topk=k, init_std=0.3, pre_softmax=probs_on_input, **losses, **MODES[mode])
    return MoEConfig(num_experts=E, router=router, experts=ExpertsConfig(FFN, init_std=0.4),
                     dispatch=DispatchConfig(dispatcher), shared=SharedExpertsConfig(SHARED, gate=True, init_std=0.4),
                     apply_probs_on_input=probs_on_input, latent_size=latent)


def _build(cfg: MoEConfig, scenario: str, dims: ParallelDims, sp: bool) -> MoELayer:
    layer = build_moe_layer(cfg, H, dims, sequence_parallel=sp)
    init_parameters(layer, seed=11)
    edit = SCENARIOS[scenario][2]
    if edit is not None:  # every input has x[..., 0] = 3, so this shifts these experts' logits by +-12
        with torch.no_grad():
            layer.router.weight[edit[1], 0] += 4.0 if edit[0] == "on" else -4.0
    return layer


def _micro_batch(scenario: str, dp: int, dp_rank: int):
    """(x, grad of y) of one dp rank: [S, B / dp, H] (empty for EMPTY_DP_RANK in 'empty_rank')."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(S, B, H, generator=g)
    x[..., 0] = 3.0
    x, gy = x.chunk(dp, dim=1)[dp_rank], torch.randn(S, B, H, generator=g).chunk(dp, dim=1)[dp_rank]
    if scenario == "empty_rank" and dp_rank == EMPTY_DP_RANK:
        x, gy = x[:0], gy[:0]
    return x.clone(), gy


def _reference(cfg, scenario, dp):
    """World-1 outputs per dp micro-batch and the summed gradients."""
    layer = _build(cfg, scenario, ParallelDims.single(), sp=False)
    outs = []
    for d in range(dp):
        xd, gd = _micro_batch(scenario, dp, d)
        xd.requires_grad_()
        y, info = layer(xd)
        ((y * gd).sum() + info.aux_loss).backward()
        outs.append((y.detach(), xd.grad))
    return outs, {n: p.grad for n, p in layer.named_parameters()}


def _check_layout(cfg, scenario, dims, sp, refs, label):
    ref_out, ref_grads = refs[(cfg, scenario, dims.dp)]
    xd, gd = _micro_batch(scenario, dims.dp, dims.dp_rank)
    expect, expect_dx = ref_out[dims.dp_rank]
    if sp and dims.tp > 1:  # this rank's sequence shard
        xd, gd, expect, expect_dx = (t.chunk(dims.tp, dim=0)[dims.tp_rank] for t in (xd, gd, expect, expect_dx))
    layer = _build(cfg, scenario, dims, sp)
    xd.requires_grad_()
    y, info = layer(xd)
    torch.testing.assert_close(y.detach(), expect, atol=1e-5, rtol=1e-5, msg=lambda m: f"{label} output: {m}")
    # Without SP, y and the loss are replicated over tp, as in the dense stack (no rescaling).
    ((y * gd).sum() + info.aux_loss).backward()
    torch.testing.assert_close(xd.grad, expect_dx, atol=1e-5, rtol=1e-5, msg=lambda m: f"{label} input grad: {m}")
    # Reduced the way the trainer does (expert params over edp, others over dp, sequence-parallel ones also over tp,
    # each tp rank having seen its own tokens), one flat all-reduce per group: per-parameter collectives of 8 ranks on
    # 2 cores took most of the world's time. Each rank compares its own shard (every shard is some rank's).
    params = dict(layer.named_parameters())
    grads = {name: p.grad.clone() for name, p in params.items()}
    _all_reduce_flat([grads[n] for n, p in params.items() if is_expert(p)], dims.edp_group)
    _all_reduce_flat([grads[n] for n, p in params.items() if not is_expert(p)], dims.dp_group)
    _all_reduce_flat([grads[n] for n, p in params.items() if not is_expert(p) and is_sequence_parallel(p)],
                     dims.tp_group)
    for name, p in params.items():
        want = local_slice(ref_grads[name], shards_of(p))
        # A gradient summed over dp micro-batches whose terms are much larger than the sum (router
        # weights in capacity mode: terms of +-20 summing to 0.13) carries fp32 rounding of the terms'
        # size whatever the summation order, so the absolute tolerance scales with the largest entry.
        atol = max(1e-5, 2e-6 * ref_grads[name].abs().max().item())
        torch.testing.assert_close(grads[name], want, atol=atol, rtol=1e-5,
                                   msg=lambda m: f"{label} grad {name}: {m}")


def _all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` in place over ``group`` with one all-reduce."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


def _cases8():
    """(layout, config, scenario, sp, label) of the 8-rank world, in the order every rank checks them."""
    for ep, etp in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)):
        pc = ParallelConfig(ep=ep, etp=etp)
        for dispatcher in ("allgather", "alltoall"):
            cases = [(s, "dropless") for s in SCENARIOS] + [
                ("random", "capacity"), ("one_expert", "capacity"), ("random", "padded"), ("empty_rank", "capacity")]
            if dispatcher == "allgather":
                # an empty rank has capacity 0 while the others do not; the all-to-all's static padded
                # shapes need equal capacities over etp x ep (see dispatch/alltoall.py)
                cases.append(("empty_rank", "padded"))
            for scenario, mode in cases:
                yield (pc, _config(scenario, mode, dispatcher), scenario, True,
                       f"{dispatcher} ep{ep} etp{etp} {scenario} {mode}")
            if (ep, etp) in ((4, 1), (2, 2)):  # latent experts (--moe-latent-size): exchange and experts at 8 < H
                for scenario, mode in (("random", "dropless"), ("random", "capacity")):
                    yield (pc, _config(scenario, mode, dispatcher, latent=LATENT), scenario, True,
                           f"{dispatcher} ep{ep} etp{etp} latent {mode}")
            if (ep, etp) in ((4, 1), (2, 2)):  # Megatron's --moe-apply-probs-on-input (top-1)
                yield (pc, _config("one_expert", "dropless", dispatcher, probs_on_input=True), "one_expert", True,
                       f"{dispatcher} ep{ep} etp{etp} probs on input")
    # attention tp2 (SP) with experts folded over the same 8 ranks
    for ep, etp in ((4, 1), (2, 2)):
        pc = ParallelConfig(tp=2, ep=ep, etp=etp)
        for scenario in ("random", "half_off"):
            yield pc, _config(scenario, "dropless", "alltoall"), scenario, True, f"tp2 sp ep{ep} etp{etp} {scenario}"


def _cases4_folding():
    """Folding over 4 ranks: attention tp2 with experts etp1/ep4 and etp2/ep1, with and without SP."""
    for ep, etp in ((4, 1), (1, 2)):
        pc = ParallelConfig(tp=2, ep=ep, etp=etp)
        for sp in (True, False):
            for dispatcher in ("allgather", "alltoall"):
                yield (pc, _config("random", "dropless", dispatcher), "random", sp,
                       f"fold tp2 sp={sp} ep{ep} etp{etp} {dispatcher}")
            # latent projections replicated over tp, each rank projecting its own tokens (SP shard or slice)
            yield (pc, _config("random", "dropless", "alltoall", latent=LATENT), "random", sp,
                   f"fold tp2 sp={sp} ep{ep} etp{etp} latent")


def _references(cases: list, world: int) -> dict:
    """The world-1 references of ``cases``, computed once here rather than again on every rank (they are the
    same on all of them; on 2 cores, 8 ranks each recomputing them took most of the world's time)."""
    refs: dict = {}
    for pc, cfg, scenario, _, _ in cases:
        key = (cfg, scenario, pc.resolve(world).dp)
        if key not in refs:
            refs[key] = _reference(*key)
    return refs


def _check_cases(cases: list, refs: dict) -> int:
    """Every case on this rank, a layout's process groups built once, in the same order on every rank."""
    torch.manual_seed(0)
    for pc, same_layout in itertools.groupby(cases, key=lambda case: case[0]):
        with own_groups():
            dims = ParallelDims.build(pc)
            for _, cfg, scenario, sp, label in same_layout:
                _check_layout(cfg, scenario, dims, sp, refs, label)
    return len(cases)


@pytest.mark.parametrize("world, cases", [(8, _cases8), (4, _cases4_folding)], ids=["world8", "world4_folding"])
def test_layouts_equal_world1(world, cases):
    cases = list(cases())
    checked = run_distributed(_check_cases, world, cases, _references(cases, world), timeout=400)
    assert checked == [len(cases)] * world


def test_world1_shapes_and_info():
    cfg = _config("random", "dropless", "alltoall")
    layer = _build(cfg, "random", ParallelDims.single(), sp=False)
    x, _ = _micro_batch("random", 1, 0)
    y, info = layer(x)
    assert y.shape == x.shape and info.aux_loss.requires_grad and info.aux_loss.dim() == 0
    assert set(info.losses) == {"aux_loss", "z_loss"} and info.load_E.sum() == S * B * 2


def test_probs_on_input_scales_the_token_before_its_expert():
    """apply_probs_on_input (top-1): y = shared(x) + FFN_g(p * x), not p * FFN_g(x); the default is the latter."""
    x, _ = _micro_batch("one_expert", 1, 0)
    x_TH = x.reshape(-1, H)
    ys = {}
    for on_input in (False, True):
        layer = _build(_config("one_expert", "dropless", "alltoall", probs_on_input=on_input), "one_expert",
                       ParallelDims.single(), sp=False)
        y, _ = layer(x)
        r = layer.router(x_TH).routing
        assert (r.expert_ids_TK == 5).all()
        w13, w2 = layer.experts.w13[5], layer.experts.w2[5]

        def ffn(t, w13=w13, w2=w2):
            return (torch.nn.functional.silu(t @ w13[0].T) * (t @ w13[1].T)) @ w2.T

        p = r.probs_TK
        routed = ffn(p * x_TH) if on_input else p * ffn(x_TH)
        want = routed + layer.shared_experts(x).reshape(-1, H)
        torch.testing.assert_close(y.reshape(-1, H), want, atol=1e-5, rtol=1e-5)
        ys[on_input] = y
    assert not torch.allclose(ys[False], ys[True], atol=1e-3)  # the option changes the function
    with pytest.raises(ValueError, match=r"apply_probs_on_input.*topk=1, got topk=2"):
        _config("random", "dropless", "alltoall", probs_on_input=True)


def test_config_errors_name_numbers():
    router = RouterConfig(num_experts=6, topk=2)
    cfg = MoEConfig(num_experts=6, router=router, experts=ExpertsConfig(FFN))
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by ep=4"):
        cfg.check_layout(tp=1, ep=4, etp=1)
    with pytest.raises(ValueError, match="moe_ffn_hidden_size=8 is not divisible by etp=3"):
        cfg.check_layout(tp=1, ep=1, etp=3)
    with pytest.raises(ValueError, match=r"router\.num_experts=6"):
        MoEConfig(num_experts=8, router=router, experts=ExpertsConfig(FFN))
    with pytest.raises(ValueError, match="dispatcher='nccl'"):
        MoEConfig(num_experts=6, router=router, experts=ExpertsConfig(FFN), dispatch=DispatchConfig("nccl"))
    with pytest.raises(ValueError, match="shared_expert_gate"):
        MoEConfig(num_experts=6, router=router, experts=ExpertsConfig(FFN), shared=SharedExpertsConfig(0, gate=True))

"""Routing replay in one MoE layer (moe.routing_replay, the layer's ``routing`` region, the router's replayed ids).

- Replaying a recording equals the recorded forward bit for bit (outputs, aux loss, loads, input and every
  parameter gradient), for softmax top-k, sigmoid with expert bias, group limit and scaling, and capacity dropping.
- With changed router weights the replayed ids stay (not what the new router would choose), the probs are the new
  scores at them (the formula written out here), capacity drops by the same rule, and the router's gradient is the
  derivative of the loss with the ids held fixed (a central difference).
- A checkpointed layer (recompute in backward) takes its forward's ids, in 1F1B order too.
- One 4-rank world: the layer at ep2, ep4, etp2, ep2 x etp2 (alltoall and allgather), attention tp2 with and
  without SP, and flex (DeepEP V2's CPU stand-in) at ep2, replaying a world-1 recording made with other weights,
  equals the world-1 layer replaying it; each layout's recording (gathered over tp) is the world-1 recording.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from moefold.dense.recompute import checkpointed
from moefold.dispatch.config import DispatchConfig, DispatcherKind, FlexOptions
from moefold.dispatch.flex_backend import FlexBackend
from moefold.moe.build import build_moe_layer
from moefold.moe.capacity import capacity_keep_mask, expert_capacity
from moefold.moe.config import ExpertsConfig, MoEConfig, SharedExpertsConfig
from moefold.moe.layer import MoELayer
from moefold.moe.router_config import RouterConfig
from moefold.moe.routing_replay import LIVE_ROUTING, RoutingRecorder, RoutingReplayer
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import init_parameters
from tests.dispatch import deepep_elastic_standin
from tests.distributed import run_distributed
from tests.moe.layout_check import LAYOUTS, layer_failures

E, H, FFN, S, B = 8, 16, 8, 4, 4
ROUTERS = {
    "softmax": dict(topk=2, aux_loss_coeff=0.01, z_loss_coeff=1e-3),
    "sigmoid_bias_groups": dict(topk=2, score_function="sigmoid", enable_expert_bias=True, num_groups=4, group_topk=2,
                                topk_scaling_factor=2.5, load_balancing_type="seq_aux_loss", aux_loss_coeff=0.01),
    "capacity": dict(topk=2, aux_loss_coeff=0.01, expert_capacity_factor=0.5),
}


def _config(router: str, dispatcher: str = "local", **extra) -> MoEConfig:
    rc = RouterConfig(num_experts=E, init_std=0.3, **ROUTERS[router])
    return MoEConfig(num_experts=E, router=rc, experts=ExpertsConfig(FFN, init_std=0.4),
                     dispatch=DispatchConfig(dispatcher, **extra), shared=SharedExpertsConfig(FFN, init_std=0.4))


def _build(cfg: MoEConfig, dims: ParallelDims | None = None, seed: int = 11, sp: bool = False,
           dtype: torch.dtype = torch.float32) -> MoELayer:
    layer = build_moe_layer(cfg, H, dims or ParallelDims.single(), sequence_parallel=sp, dtype=dtype)
    init_parameters(layer, seed=seed)
    if layer.router.expert_bias is not None:   # a bias that changes the selection (aux-loss-free balancing)
        layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, E))
    return layer


def _inputs(n: int = 2, b: int = B):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(S, b, H, generator=g), torch.randn(S, b, H, generator=g)) for _ in range(n)]


def _run(layer: MoELayer, batches, tap=LIVE_ROUTING) -> dict:
    """Each micro-batch forward + backward (loss sum(y * g) + aux); outputs, infos and gradients."""
    layer.configure(routing=tap)
    outs = []
    for x, gy in batches:
        x = x.clone().requires_grad_()
        y, info = layer(x)
        ((y * gy).sum() + info.aux_loss).backward()
        outs.append((y.detach(), x.grad, info.aux_loss.detach(), info.load_E))
    return {"outs": outs, "grads": {n: p.grad.clone() for n, p in layer.named_parameters()}}


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_replay_equals_the_recorded_forward_bit_for_bit(router):
    cfg, batches = _config(router), _inputs()
    recorder = RoutingRecorder()
    recorded = _run(_build(cfg), batches, recorder)
    assert [tuple(c.shape) for c in recorder.calls] == [(B, S, 2)] * 2
    replayer = RoutingReplayer(recorder.calls)
    replayed = _run(_build(cfg), batches, replayer)
    assert replayer.used == 2
    for (a, b) in zip(recorded["outs"], replayed["outs"], strict=True):
        for u, v in zip(a, b, strict=True):
            assert torch.equal(u, v)
    for name, grad in recorded["grads"].items():
        assert torch.equal(grad, replayed["grads"][name]), name
    if router == "capacity":   # the recording is the selection before the drop; the replay drops the same copies
        assert int(sum(o[3].sum() for o in recorded["outs"])) == 2 * S * B * 2
        layer = _build(cfg)
        x_TH = batches[0][0].reshape(-1, H)
        kept = layer.router(x_TH).routing.tokens_per_expert_E.sum()
        assert int(kept) < S * B * 2


def _changed(layer: MoELayer) -> MoELayer:
    with torch.no_grad():
        layer.router.weight.add_(torch.randn(layer.router.weight.shape, generator=torch.Generator().manual_seed(3)))
    return layer


@pytest.mark.parametrize("router", ["softmax", "sigmoid_bias_groups", "capacity"])
def test_replay_with_changed_weights_keeps_the_ids_and_moves_the_probs(router):
    cfg = _config(router)
    (x, gy), = _inputs(1)
    recorder = RoutingRecorder()
    _run(_build(cfg), [(x, gy)], recorder)
    ids_TK = recorder.calls[0].transpose(0, 1).reshape(-1, 2)   # [B, S, K] -> the layer's sequence-first tokens
    layer = _changed(_build(cfg))
    x_TH = x.reshape(-1, H)
    seqs = {"seq_ids_T": torch.arange(S * B) % B, "num_seqs": B}   # the layer's sequence-first tokens
    live = layer.router(x_TH, **seqs)
    assert not torch.equal(live.routing.expert_ids_TK, ids_TK), "the changed router must choose otherwise here"
    replayed = layer.router(x_TH, replayed_ids_TK=ids_TK, **seqs)
    routing = replayed.routing
    assert torch.equal(routing.expert_ids_TK, ids_TK)
    # the balancing losses count a plain top-k of the current scores, as Megatron-Core's (not the replayed ids)
    assert replayed.losses.keys() == live.losses.keys() and replayed.losses
    assert all(torch.equal(replayed.losses[k], live.losses[k]) for k in live.losses)
    logits = x_TH @ layer.router.weight.detach().T
    rc = cfg.router
    if rc.score_function == "softmax":   # post-top-k softmax: softmax over the k logits at the ids
        want = torch.softmax(logits.gather(1, ids_TK), dim=-1)
    else:                                # sigmoid at the ids, renormalised, scaled
        sel = torch.sigmoid(logits).gather(1, ids_TK)
        want = sel / (sel.sum(-1, keepdim=True) + 1e-20) * rc.topk_scaling_factor
    if rc.expert_capacity_factor is not None:   # the same rule on the new probs
        keep = capacity_keep_mask(want, ids_TK, E, expert_capacity(S * B, 2, E, rc.expert_capacity_factor), "probs")
        assert torch.equal(routing.keep_TK, keep) and not keep.all()
        want = want * keep
    torch.testing.assert_close(routing.probs_TK, want, rtol=1e-6, atol=1e-7)

    if rc.expert_capacity_factor is not None:   # which copies a capacity keeps jumps with the weights: no derivative
        return

    # the router learns through the replayed probs: its gradient is d sum(y * g) / d W with the ids fixed (the aux
    # losses count a fresh top-k, a step function of W: left out)
    def loss(weight_delta: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            layer.router.weight.add_(weight_delta)
            y, _ = layer(x)
            layer.router.weight.sub_(weight_delta)
        return (y.double() * gy.double()).sum()

    layer.configure(routing=RoutingReplayer([recorder.calls[0]] * 3))
    y, _ = layer(x)
    (y * gy).sum().backward()
    grad = layer.router.weight.grad.clone()
    assert grad.abs().max() > 0
    direction = torch.randn(grad.shape, generator=torch.Generator().manual_seed(5))
    eps = 1e-2
    numeric = (loss(eps * direction) - loss(-eps * direction)) / (2 * eps)
    analytic = (grad.double() * direction.double()).sum()
    assert abs(float(numeric - analytic)) <= 2e-2 * max(1.0, abs(float(analytic))), (float(numeric), float(analytic))


@pytest.mark.parametrize("order", ["1f1b", "all_forward_first"])
def test_a_recomputed_layer_replays_its_forward_ids(order):
    cfg = _config("softmax")
    batches = _inputs(2)
    recorder = RoutingRecorder()
    _run(_build(cfg, seed=5), batches, recorder)           # other weights: the replayed ids are not the live ones
    want = _run(_build(cfg), batches, RoutingReplayer(recorder.calls))
    layer = _build(cfg)
    replayer = RoutingReplayer(recorder.calls)
    layer.configure(routing=replayer)
    pending = []

    def forward(x, gy):
        x = x.clone().requires_grad_()
        y, info = checkpointed(layer, x)
        pending.append(((y * gy).sum() + info.aux_loss, x))

    outs = []
    for step in ([0, "b", 1, "b"] if order == "1f1b" else [0, 1, "b", "b"]):
        if step == "b":
            loss, x = pending.pop(0)
            loss.backward()
            outs.append(x.grad)
        else:
            forward(*batches[step])
    for got, (_, dx, _, _) in zip(outs, want["outs"], strict=True):
        assert torch.equal(got, dx)
    for name, p in layer.named_parameters():
        assert torch.equal(p.grad, want["grads"][name]), name


def test_replay_errors_name_the_numbers():
    cfg = _config("softmax")
    (x, _), = _inputs(1)
    layer = _build(cfg)
    layer.configure(routing=RoutingReplayer([torch.zeros(B, S + 1, 2, dtype=torch.int64)], layer=3))
    with pytest.raises(ValueError, match=r"shape \(4, 5, 2\).*\[4, 4, 2\]"):
        layer(x)
    layer.configure(routing=RoutingReplayer([], layer=3))
    with pytest.raises(RuntimeError, match=r"layer 3.*forward call 1.*0 micro-batches"):
        layer(x)
    with pytest.raises(ValueError, match="int64"):
        RoutingReplayer([torch.zeros(B, S, 2, dtype=torch.int32)])
    with pytest.raises(ValueError, match="not a RoutingTap"):
        layer.configure(routing=object())


# ------------------------------------------------------------------------------------------- layouts, one world
DP = 4   # every layout's dp ranks split the batch of DP * b samples: the reference replays each rank's share


def _layout_batches(dp: int, dp_rank: int, dtype=torch.float32):
    """This dp rank's share of the batch [S, DP, H] and its slice of the world-1 references."""
    g = torch.Generator().manual_seed(1)
    x, gy = torch.randn(S, DP, H, generator=g), torch.randn(S, DP, H, generator=g)
    per = DP // dp
    return x[:, dp_rank * per:(dp_rank + 1) * per].to(dtype), gy[:, dp_rank * per:(dp_rank + 1) * per].to(dtype)


def _world1(cfg: MoEConfig, dp: int, dtype=torch.float32):
    """The recording (weights seed 5) of the whole batch, the world-1 layer's own (seed 11), and that layer replaying
    the first one dp share by dp share (a share's aux loss counts its own tokens, as on a dp rank)."""
    x, gy = _layout_batches(1, 0, dtype)
    recorder, own = RoutingRecorder(), RoutingRecorder()
    with torch.no_grad():
        for tap, seed in ((recorder, 5), (own, 11)):
            layer = _build(cfg, seed=seed, dtype=dtype)
            layer.configure(routing=tap)
            layer(x)
    assert not torch.equal(recorder.calls[0], own.calls[0]), "the replayed ids must not be the live ones"
    per = DP // dp
    shares = [(x[:, d * per:(d + 1) * per], gy[:, d * per:(d + 1) * per]) for d in range(dp)]
    replayed = _run(_build(cfg, dtype=dtype), shares,
                    RoutingReplayer([recorder.calls[0][d * per:(d + 1) * per] for d in range(dp)]))
    return recorder.calls[0], own.calls[0], replayed


def _check(label, dims, cfg, sp, ref, failures, dtype=torch.float32, tol=1e-5):
    source_BSK, own_BSK, want = ref
    per = DP // dims.dp
    rows = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)
    x, gy = _layout_batches(dims.dp, dims.dp_rank, dtype)
    want_y, want_dx = want["outs"][dims.dp_rank][0], want["outs"][dims.dp_rank][1]
    if sp:
        x, gy, want_y, want_dx = (t.chunk(dims.tp, dim=0)[dims.tp_rank] for t in (x, gy, want_y, want_dx))
    recorder = RoutingRecorder()
    with torch.no_grad():
        layer = _build(cfg, dims, sp=sp, dtype=dtype)
        layer.configure(routing=recorder)
        layer(x)
    if not torch.equal(recorder.calls[0], own_BSK[rows]):
        failures.append(f"{label}: the recording differs from world 1's")
    layer = _build(cfg, dims, sp=sp, dtype=dtype)
    got = _run(layer, [(x, gy)], RoutingReplayer([source_BSK[rows]]))
    y, dx = got["outs"][0][0], got["outs"][0][1]
    failures += layer_failures(label, layer, dims, [("output", y, want_y), ("input grad", dx, want_dx)],
                               want["grads"], tol)


def _world() -> list[str]:
    failures: list[str] = []
    refs: dict = {}   # by dp size
    for label, pc, dispatcher, sp in LAYOUTS:
        dims = ParallelDims.build(pc)
        local = _config("softmax")
        if dims.dp not in refs:
            refs[dims.dp] = _world1(local, dims.dp)
        _check(label, dims, _config("softmax", dispatcher), sp, refs[dims.dp], failures)
    # flex on DeepEP V2's stand-in (bf16, as DeepEP moves it): against the world-1 local layer in bf16
    sys.modules["deep_ep"] = deepep_elastic_standin.module()
    from moefold.dispatch.deepep_elastic import ELASTIC_BUFFERS

    flex = _config("softmax", "flex", flex=FlexOptions(FlexBackend.DEEPEP, max_tokens_per_rank=S * DP))
    local = dataclasses.replace(flex, dispatch=dataclasses.replace(flex.dispatch, kind=DispatcherKind.LOCAL))
    dims = ParallelDims.build(ParallelConfig(ep=2))
    _check("flex ep2", dims, flex, False, _world1(local, dims.dp, torch.bfloat16), failures, torch.bfloat16, tol=3e-2)
    ELASTIC_BUFFERS.destroy()
    return failures


def test_layouts_replay_as_world1():
    results = run_distributed(_world, 4, timeout=300)
    failures = sorted({f for per_rank in results for f in per_rank})
    assert not failures, "\n".join(failures[:40])

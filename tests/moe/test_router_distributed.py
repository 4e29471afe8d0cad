"""Router losses and expert bias across ranks equal world 1 (one spawned world of 4 gloo ranks).

Layouts tp2*dp2 (sequence parallel), cp2*dp2 and tp2*cp2, each over 4 micro-batches. A rank
holds dp shard d of the sequences and tp*cp shard r of every sequence. The distributed value is
the sum of the shares over tp*cp, averaged over dp and micro-batches (the loss convention of
moe.balance_losses); the gradient likewise (summed over tp*cp, averaged over dp and micro-batches).
World-1 references: per-micro-batch losses (aux, seq_aux, z) over the dp*M micro-batches of one dp
shard each; the global-batch loss over the M micro-batches holding every dp shard.
"""

import torch
import torch.distributed as dist

from moefold.moe.expert_bias import update_expert_bias
from moefold.moe.router import Router, RouterGroups
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import init_parameters
from tests.distributed import run_distributed

E, K, H = 8, 2, 16
B, S, M = 4, 8, 4  # sequences per micro-batch (all dp ranks), sequence length, micro-batches
LAYOUTS = (dict(tp=2, dp=2), dict(cp=2, dp=2), dict(tp=2, cp=2))

CONFIGS = {
    "softmax": dict(load_balancing_type=("aux_loss", "seq_aux_loss"), aux_loss_coeff=(0.3, 0.7), z_loss_coeff=0.05),
    "sigmoid_groups_bias": dict(score_function="sigmoid", num_groups=4, group_topk=2, enable_expert_bias=True,
                                topk_scaling_factor=2.5, load_balancing_type=("aux_loss", "seq_aux_loss"),
                                aux_loss_coeff=(0.3, 0.7), z_loss_coeff=0.05),
    "global_softmax": dict(load_balancing_type="global_aux_loss", aux_loss_coeff=0.5),
    "global_sigmoid_bias": dict(score_function="sigmoid", enable_expert_bias=True, pre_softmax=False,
                                load_balancing_type=("global_aux_loss", "aux_loss"), aux_loss_coeff=(0.5, 0.0)),
}


def data():
    return torch.randn(M, B, S, H, generator=torch.Generator().manual_seed(123))


def make_router(name, groups=None):
    r = Router(RouterConfig(num_experts=E, topk=K, **CONFIGS[name]), H, groups or RouterGroups())
    init_parameters(r, seed=7)
    with torch.no_grad():
        r.weight.mul_(20.0)  # std 0.4: decisive routing, so the selection is not a tie-break lottery
        if r.expert_bias is not None:
            r.expert_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(5)) * 0.1)
    return r


def run_micro_batches(router, batches):
    """Mean over micro-batches of the loss shares (and their gradient); each batch: [b, s, H]."""
    router.zero_grad()
    state, values = None, {}
    for x_bsh in batches:
        b, s, _ = x_bsh.shape
        out = router(x_bsh.reshape(b * s, H), num_seqs=b, global_state=state)
        state = out.global_state
        (out.aux_loss / len(batches)).backward()
        for name, v in {"total": out.aux_loss.detach(), **out.losses}.items():
            values[name] = values.get(name, 0.0) + v / len(batches)
    return values, router.weight.grad.clone()


def reference(name, dp):
    x = data()
    if name.startswith("global"):
        batches = [x[m] for m in range(M)]
    else:  # per-micro-batch statistics are per dp rank: the dp shards become separate micro-batches
        batches = [x[m, d * (B // dp):(d + 1) * (B // dp)] for m in range(M) for d in range(dp)]
    return run_micro_batches(make_router(name), batches)


def distributed_body():
    results = {}
    for layout in LAYOUTS:
        dims = ParallelDims.build(ParallelConfig(**layout))
        tpcp = dims.tp * dims.cp
        r_seq = dims.cp_rank * dims.tp + dims.tp_rank  # this rank's chunk of each sequence
        x = data()
        bl, sl = B // dims.dp, S // tpcp
        for name in CONFIGS:
            router = make_router(name, RouterGroups.from_dims(dims))
            batches = [x[m, dims.dp_rank * bl:(dims.dp_rank + 1) * bl, r_seq * sl:(r_seq + 1) * sl] for m in range(M)]
            values, grad = run_micro_batches(router, batches)
            packed = torch.cat([torch.stack([values[k] for k in sorted(values)]), grad.reshape(-1)])
            dist.all_reduce(packed, group=dims.tp_cp_group)  # shares and partial grads sum over tp*cp
            dist.all_reduce(packed, group=dims.dp_group)
            packed /= dims.dp
            n = len(values)
            results[(str(layout), name)] = ({k: packed[i] for i, k in enumerate(sorted(values))},
                                            packed[n:].view(E, H))
            if name in ("softmax", "global_softmax"):  # statistics reduced over the balancing group
                b = batches[0]
                st = router(b.reshape(-1, H), num_seqs=b.shape[0], reduce_stats=True).stats
                results[(str(layout), name, "stats")] = (st.tokens_per_expert_E, st.entropy, st.max_over_mean)
    results["bias"] = expert_bias_convergence()
    return results


def bias_tokens(rank: int) -> torch.Tensor:
    """Rank ``rank``'s 256 tokens for the expert-bias run (every rank sees different tokens)."""
    x = torch.randn(256, H, generator=torch.Generator().manual_seed(100 + rank))
    x[:, 0] += 2.0
    return x


def bias_trajectory(chunks: list[torch.Tensor], groups: RouterGroups) -> tuple[list[float], torch.Tensor]:
    """Skewed fixed router: 160 sign updates of the bias from loads summed over ``chunks`` (routed one
    by one, like micro-batches) and over tp*cp*dp; returns the max/mean load after each update and
    the final bias."""
    c = RouterConfig(num_experts=E, topk=K, score_function="sigmoid", enable_expert_bias=True,
                     bias_update_rate=0.002, load_balancing_type="none")
    router = Router(c, H, groups)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=gen) * 0.3)
        router.weight[0, 0], router.weight[1, 0] = 2.0, 1.8  # experts 0 and 1 favoured by every token
    trajectory = []
    for _ in range(160):
        local_load = sum(router(x).load_E for x in chunks)
        load = update_expert_bias(router, local_load, groups.tp_cp_dp)
        trajectory.append(float(load.max() / load.mean()))
    return trajectory, router.expert_bias.clone()


def expert_bias_convergence():
    """The bias run on 4 ranks (tp2*dp2), each with its own tokens."""
    dims = ParallelDims.build(ParallelConfig(tp=2, dp=2))
    return bias_trajectory([bias_tokens(dims.rank)], RouterGroups.from_dims(dims))


def test_router_losses_equal_world1_and_bias_converges():
    ranks = run_distributed(distributed_body, 4, timeout=240)
    for layout in LAYOUTS:
        for name in CONFIGS:
            ref_values, ref_grad = reference(name, layout.get("dp", 1))
            values, grad = ranks[0][(str(layout), name)]
            assert set(values) == set(ref_values)
            for k in ref_values:
                torch.testing.assert_close(values[k], ref_values[k], atol=1e-6, rtol=1e-6,
                                           msg=lambda m: f"{layout} {name} {k}: {m}")
            # gradients span 4e-3..6e-2 here: atol 1e-6 keeps the check meaningful for the small ones
            torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{layout} {name}: {m}")
            assert ref_grad.abs().max() > 1e-4  # the losses do train the router
            if name in ("softmax", "global_softmax"):
                # tp*cp statistics describe this dp rank's micro-batch (rank 0: dp shard 0); the
                # global ones (tp*cp*dp) the whole micro-batch
                dp = layout.get("dp", 1)
                x0 = data()[0] if name == "global_softmax" else data()[0, : B // dp]
                ref = make_router(name)(x0.reshape(-1, H), num_seqs=x0.shape[0]).stats
                got = ranks[0][(str(layout), name, "stats")]
                torch.testing.assert_close(got[0], ref.tokens_per_expert_E)
                torch.testing.assert_close(got[1], ref.entropy)
                torch.testing.assert_close(got[2], ref.max_over_mean)
        for r in ranks[1:]:  # every rank agrees after the reductions
            torch.testing.assert_close(r[(str(layout), "softmax")][1], ranks[0][(str(layout), "softmax")][1])

    trajectory, bias0 = ranks[0]["bias"]
    print("expert-bias max/mean load trajectory:", " ".join(f"{v:.2f}" for v in trajectory[::8]),
          f"... final {trajectory[-1]:.2f}")
    assert trajectory[0] > 3.0
    assert max(trajectory[-20:]) < 1.3
    for r in ranks[1:]:
        assert torch.equal(r["bias"][1], bias0)
        assert r["bias"][0] == trajectory
    # the loads are integer counts summed over tp*dp: exactly world 1 routing all four ranks' tokens
    # (chunk by chunk, so that every logit is computed as on its rank, bit for bit)
    ref_trajectory, ref_bias = bias_trajectory([bias_tokens(r) for r in range(4)], RouterGroups())
    assert trajectory == ref_trajectory
    assert torch.equal(bias0, ref_bias)

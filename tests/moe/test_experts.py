"""GroupedExperts: loop reference, init independent of layout, etp/ep shards equal world 1."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moefold.moe.experts import GroupedExperts
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import gather_full, init_parameters, shards_of
from tests.distributed import run_distributed

E, H, FFN = 4, 16, 24
COUNTS = [3, 0, 6, 1]  # an expert with no tokens


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    n = sum(COUNTS)
    return (torch.randn(n, H, generator=gen).to(dtype), torch.rand(n, generator=gen),
            torch.randn(n, H, generator=gen).to(dtype))


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_matches_per_expert_mlp(activation, backend):
    experts = GroupedExperts(E, H, FFN, activation=activation, gemm_backend=backend)
    init_parameters(experts, seed=3)
    x, probs, _ = _inputs()
    out = experts(x, probs, torch.tensor(COUNTS))
    rows, start = [], 0
    for i, c in enumerate(COUNTS):
        xi = x[start:start + c]
        if activation == "swiglu":
            h = F.silu(xi @ experts.w13[i, 0].T) * (xi @ experts.w13[i, 1].T)
        else:
            h = F.gelu(xi @ experts.w13[i, 0].T)
        rows.append((h @ experts.w2[i].T) * probs[start:start + c, None])
        start += c
    torch.testing.assert_close(out, torch.cat(rows), atol=1e-6, rtol=1e-5)


def test_bad_sizes_name_numbers():
    with pytest.raises(ValueError, match="activation='relu'"):
        GroupedExperts(E, H, FFN, activation="relu")
    with pytest.raises(ValueError, match="gemm_backend='x'"):
        GroupedExperts(E, H, FFN, gemm_backend="x")


def _sharded_vs_world1():
    torch.manual_seed(0)
    x, probs, grad = _inputs()
    starts = [sum(COUNTS[:i]) for i in range(E)]
    ref = GroupedExperts(E, H, FFN)
    init_parameters(ref, seed=5)
    ref_out = ref(x, probs, torch.tensor(COUNTS))
    ref_out.backward(grad)
    for cfg in (ParallelConfig(ep=2, etp=2), ParallelConfig(ep=4), ParallelConfig(etp=4), ParallelConfig(ep=1)):
        dims = ParallelDims.build(cfg)
        mod = GroupedExperts(E, H, FFN, ep_group=dims.ep_group, etp_group=dims.etp_group)
        init_parameters(mod, seed=5)
        lo = dims.ep_rank * mod.num_local_experts
        local = range(lo, lo + mod.num_local_experts)
        rows = torch.cat([torch.arange(starts[i], starts[i] + COUNTS[i]) for i in local])
        out = mod(x[rows], probs[rows], torch.tensor([COUNTS[i] for i in local]))
        out.backward(grad[rows])
        total = out.detach().clone()
        dist.all_reduce(total, group=dims.etp_group)  # partial sums over etp
        torch.testing.assert_close(total, ref_out.detach()[rows], atol=1e-5, rtol=1e-5)
        for name, p in mod.named_parameters():
            full_w = gather_full(p.detach(), shards_of(p))
            full_g = gather_full(p.grad, shards_of(p))
            torch.testing.assert_close(full_w, getattr(ref, name).detach(), atol=0, rtol=0)
            torch.testing.assert_close(full_g, getattr(ref, name).grad, atol=1e-5, rtol=1e-5)
    return True


def test_etp_ep_shards_equal_world1():
    assert all(run_distributed(_sharded_vs_world1, 4))

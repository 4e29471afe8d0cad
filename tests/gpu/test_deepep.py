"""The flex (DeepEP) dispatcher equals the alltoall dispatcher on GPUs (values and gradients, bf16).

Needs >= 2 CUDA GPUs with NVLink and ``deep_ep`` installed; skipped otherwise.
"""

import pytest
import torch

from tests.dispatch.common import H, expert_weights, make_case, make_routing, run_experts
from tests.distributed import run_distributed

deep_ep = pytest.importorskip("deep_ep", reason="the flex dispatcher needs DeepEP (pip install deep-ep)")
EP = 2
E = 8


def _compare(mode: str):
    import torch.distributed as dist

    from moefold.dispatch import AllToAllDispatcher
    from moefold.dispatch.deepep import FlexDispatcher

    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    group = dist.new_group(list(range(EP)), backend="nccl")
    tokens = [64, 48]
    x_all, ids_all, probs_all = make_case("random", tokens, E, seed=1)
    off = sum(tokens[:rank])
    sl = slice(off, off + tokens[rank])
    w1, w2 = (w.to(dev) for w in expert_weights(E))
    base = make_routing(probs_all[sl], ids_all[sl], E, mode, capacity=8)
    results = {}
    for name, d in (("alltoall", AllToAllDispatcher(E, group)), ("flex", FlexDispatcher(E, group))):
        x = x_all[sl].to(dev, torch.bfloat16).requires_grad_()
        p = base.probs_TK.to(dev).requires_grad_()
        routing = type(base)(p, base.expert_ids_TK.to(dev), base.tokens_per_expert_E.to(dev),
                             None if base.keep_TK is None else base.keep_TK.to(dev), base.capacity,
                             base.pad_to_capacity)
        out = d.dispatch(x, routing)
        per = out.tokens_per_expert_e.tolist()
        y = d.combine(run_experts(out.tokens_NH.float(), out.probs_N, per, d.local_expert_offset, w1, w2)
                      .to(torch.bfloat16), out.handle)
        y.float().square().sum().backward()
        results[name] = (y.float().cpu(), x.grad.float().cpu(), p.grad.cpu())
    errors = []
    for i, what in enumerate(("y", "grad x", "grad probs")):
        a, b = results["alltoall"][i], results["flex"][i]
        if not torch.allclose(a, b, atol=3e-2, rtol=3e-2):
            errors.append(f"{mode} {what}: max err {(a - b).abs().max()}")
    return errors


@pytest.mark.skipif(torch.cuda.device_count() < EP, reason=f"needs {EP} GPUs")
@pytest.mark.parametrize("mode", ["dropless", "drop", "padded"])
def test_flex_matches_alltoall(mode):
    assert H % 8 == 0
    errors = [e for per_rank in run_distributed(_compare, EP, mode, timeout=300) for e in per_rank]
    assert not errors, "\n".join(errors)

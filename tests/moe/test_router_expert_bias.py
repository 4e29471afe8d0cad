"""Expert-bias update rule (aux-loss-free balancing) at world 1; the multi-rank run is in
test_router_distributed.py."""

import pytest
import torch

from moefold.moe.expert_bias import bias_update, update_expert_bias
from moefold.moe.router import Router
from moefold.moe.router_config import RouterConfig


def test_bias_update_worked_example():
    load = torch.tensor([4.0, 0.0, 2.0, 2.0])  # mean 2
    torch.testing.assert_close(bias_update(load, 0.1), torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    load = torch.tensor([5.0, 0.0, 1.0])  # mean 2: signs -1, +1, +1 -> mean 1/3 * 0.1 removed
    torch.testing.assert_close(bias_update(load, 0.1, center=True),
                               torch.tensor([-0.1, 0.1, 0.1]) - 0.1 / 3)


def test_update_expert_bias_in_place_fp32_and_defaults():
    r = Router(RouterConfig(num_experts=4, topk=1, enable_expert_bias=True, bias_update_rate=0.5), 8)
    assert "expert_bias" in r.state_dict()  # checkpointed model state
    load = update_expert_bias(r, torch.tensor([3, 1, 0, 0]), group=None)
    torch.testing.assert_close(load, torch.tensor([3.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(r.expert_bias, torch.tensor([-0.5, 0.0, 0.5, 0.5]))  # mean load 1
    r.to(torch.bfloat16)  # a model-wide cast must not leave the bias in bf16 after an update
    update_expert_bias(r, torch.tensor([3, 1, 0, 0]), group=None, rate=0.001)
    assert r.expert_bias.dtype == torch.float32
    torch.testing.assert_close(r.expert_bias, torch.tensor([-0.501, 0.0, 0.501, 0.501]), atol=1e-6, rtol=0)
    out = r(torch.randn(4, 8))
    torch.testing.assert_close(out.stats.bias_min, torch.tensor(-0.501), atol=1e-6, rtol=0)


def test_update_expert_bias_errors():
    r = Router(RouterConfig(num_experts=4, topk=1), 8)
    with pytest.raises(ValueError, match="enable_expert_bias"):
        update_expert_bias(r, torch.zeros(4), group=None)
    rb = Router(RouterConfig(num_experts=4, topk=1, enable_expert_bias=True), 8)
    with pytest.raises(ValueError, match="rate=-1"):
        update_expert_bias(rb, torch.zeros(4), group=None, rate=-1)
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        update_expert_bias(rb, torch.zeros(3), group=None)


def _skewed_bias_trajectory(steps: int, **config) -> list[float]:
    """max/mean load after each of ``steps`` bias updates of a fixed router that sends most tokens
    to experts 0 and 1 (every token leans along the input dim those experts' weights favour)."""
    gen = torch.Generator().manual_seed(0)
    r = Router(RouterConfig(num_experts=8, topk=2, enable_expert_bias=True, load_balancing_type="none", **config), 16)
    with torch.no_grad():
        r.weight.copy_(torch.randn(8, 16, generator=gen) * 0.3)
        r.weight[0, 0], r.weight[1, 0] = 2.0, 1.8
    x = torch.randn(1024, 16, generator=gen)
    x[:, 0] += 2.0
    with torch.no_grad():  # selection only: no graph to build
        return [float((ld := update_expert_bias(r, r(x).load_E, None)).max() / ld.mean()) for _ in range(steps)]


def test_bias_balances_world1_sigmoid():
    traj = _skewed_bias_trajectory(160, score_function="sigmoid", bias_update_rate=0.002)
    print("world-1 sigmoid max/mean:", " ".join(f"{v:.2f}" for v in traj[::10]))
    assert traj[0] > 3.0 and max(traj[-20:]) < 1.3


def test_bias_balances_world1_softmax_mean_centred():
    # softmax scores: the bias steers selection the same way. The sign rule's limit cycle scales with
    # the rate (0.002 cycles between 1.2 and 1.55 here), hence the smaller rate and more steps.
    traj = _skewed_bias_trajectory(500, score_function="softmax", bias_update_rate=0.001, bias_update_center=True)
    print("world-1 softmax max/mean:", " ".join(f"{v:.2f}" for v in traj[::25]))
    assert traj[0] > 3.0 and max(traj[-20:]) < 1.3

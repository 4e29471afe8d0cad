"""World-1 runs on one CUDA GPU equal the same runs on CPU: nothing in the MoE layer (router, dispatcher,
experts, shared experts), the trainer (gradient buffers, ZeRO optimizer, expert-bias update) or the
checkpoint path assumes a device or mixes a CPU generator with CUDA tensors.

Skipped without CUDA (tests/gpu/conftest.py). fp32 with PyTorch's default of no TF32 matmuls, so the
devices differ only by summation order; the expert GEMM uses the loop backend on both (the grouped
backends are compared with it in test_gemm_backends.py). In a rehearsal (tests/gpu/rehearsal.py) the
"GPU" run is a second CPU run: the same calls, compared the same way.
"""

from __future__ import annotations

import pytest
import torch

from moefold.moe.build import build_moe_layer
from moefold.moe.config import ExpertsConfig, MoEConfig, SharedExpertsConfig
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import init_parameters
from moefold.training.trainer import Trainer
from tests.training.trainer_common import fit_results, tiny_config, tiny_data

H = 32


def _layer_run(device: str, capacity: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    router = RouterConfig(num_experts=8, topk=2, init_std=0.3, aux_loss_coeff=0.01, z_loss_coeff=1e-3,
                          **({"expert_capacity_factor": 1.0} if capacity else {}))
    cfg = MoEConfig(num_experts=8, router=router, experts=ExpertsConfig(16, gemm_backend="loop", init_std=0.4),
                    shared=SharedExpertsConfig(16, gate=True, init_std=0.4))
    layer = build_moe_layer(cfg, H, ParallelDims.single(torch.device(device).type), sequence_parallel=False,
                            device=device)
    init_parameters(layer, seed=11)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, H, generator=gen).to(device).requires_grad_()
    gy = torch.randn(8, 4, H, generator=gen).to(device)
    y, info = layer(x)
    assert y.device == x.device and info.aux_loss.device == x.device
    ((y * gy).sum() + info.aux_loss).backward()
    return y.detach().cpu(), x.grad.cpu(), {n: p.grad.cpu() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("capacity", [False, True], ids=["dropless", "capacity"])
def test_moe_layer_on_cuda_equals_cpu(capacity, device):
    want, got = _layer_run("cpu", capacity), _layer_run(device, capacity)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-4, msg="output")
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-4, msg="input grad")
    assert got[2].keys() == want[2].keys()
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, atol=1e-5, rtol=1e-4, msg=name)


def _train(device: str, save: str | None = None, load: str | None = None,
            stop_at: int | None = None) -> tuple[list[float], Trainer]:
    config = tiny_config(steps=3, save=save)
    dims = ParallelDims.single(torch.device(device).type)
    trainer = Trainer(config, dims, device=device, log=lambda _msg: None)
    if load is not None:
        assert trainer.load(load)
    results = fit_results(trainer, tiny_data(), stop_at=stop_at)
    return [r.loss_lm for r in results], trainer


def test_trainer_on_cuda_matches_cpu_and_resumes(tmp_path, device):
    cpu, _ = _train("cpu")
    cuda, trainer = _train(device)
    assert all(p.device.type == device for p in trainer.model.parameters())
    state = trainer.optimizer.slices
    assert state and all(t.device.type == device for s in state for t in (s.master, s.exp_avg, s.exp_avg_sq))
    assert cuda == pytest.approx(cpu, rel=1e-3, abs=1e-3)
    save = str(tmp_path / "ckpt")
    _train(device, save=save, stop_at=2)
    resumed, _ = _train(device, load=save)
    # same device, but CUDA's atomics make runs differ by summation order, as layouts do on CPU
    assert len(resumed) == 1 and resumed[0] == pytest.approx(cuda[2], rel=2e-4, abs=2e-4)

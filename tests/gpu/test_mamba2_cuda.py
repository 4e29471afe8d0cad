"""Mamba-2 on CUDA: the torch chunked scan in bf16 against the fp32 recurrence, the ``mamba_ssm`` backend
(``mamba_chunk_scan_combined`` + ``causal_conv1d_fn``, when both packages are installed) against the torch form
in values and gradients, and the tiny Nemotron-H model training a step.

Skipped without CUDA (tests/gpu/conftest.py). In a rehearsal the torch parts run on the CPU; the kernels are
CUDA-only.
"""

import pytest
import torch

from moefold.dense.mamba2 import Mamba2Config, Mamba2Mixer
from moefold.dense.mamba2_kernels import mamba_ssm_available
from moefold.dense.ssd_scan import ssd_chunk_scan, ssd_recurrent
from tests.gpu.rehearsal import cuda_only


def _scan_inputs(device: str, dtype: torch.dtype, b=2, s=200, h=8, p=16, g=2, n=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, h, p, generator=gen)
    dt = torch.rand(b, s, h, generator=gen) * 0.2
    A = -torch.rand(h, generator=gen) * 2
    B, C = (torch.randn(b, s, g, n, generator=gen) * 0.3 for _ in range(2))
    return [t.to(device, dtype if t.dim() == 4 else torch.float32) for t in (x, dt, A, B, C)]


def test_torch_chunked_bf16_against_fp32_recurrence(device):
    ref, _ = ssd_recurrent(*_scan_inputs(device, torch.float32))
    got, _ = ssd_chunk_scan(*_scan_inputs(device, torch.bfloat16), chunk_size=64)
    torch.testing.assert_close(got.float(), ref, atol=5e-2, rtol=5e-2)


def test_mamba_ssm_backend_against_torch(device):
    cuda_only("mamba_ssm's Triton scan and causal_conv1d's CUDA kernels")
    if not mamba_ssm_available():
        pytest.skip("mamba-ssm and causal-conv1d are not installed")
    sizes = dict(hidden_size=256, num_heads=8, head_dim=32, state_size=64, num_groups=2, chunk_size=64,
                 time_step_limit=(0.0, float("inf")))
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 3e-2)):
        torch.manual_seed(0)
        ref = Mamba2Mixer(Mamba2Config(**sizes), dtype=dtype, device=device)
        kernel = Mamba2Mixer(Mamba2Config(**sizes, backend="mamba_ssm"), dtype=dtype, device=device)
        kernel.load_state_dict(ref.state_dict())
        x = torch.randn(300, 2, 256, device=device, dtype=dtype)
        outs, grads = [], []
        for m in (ref, kernel):
            xi = x.clone().requires_grad_()
            y = m(xi)
            y.float().square().mean().backward()
            outs.append(y.detach().float())
            grads.append([xi.grad.float()] + [q.grad.float() for q in m.parameters()])
        torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol, msg=lambda m, d=dtype: f"{d}: {m}")
        for a, b in zip(grads[1], grads[0]):
            assert (a - b).abs().max().item() <= tol * max(b.abs().max().item(), 1e-3), dtype


def test_tiny_nemotron_h_trains_a_step(device):
    from moefold.models.decoder import MoEDecoder
    from moefold.models.options import ModelOptions
    from moefold.models.recipes import get_recipe

    backend = "mamba_ssm" if device == "cuda" and mamba_ssm_available() else "torch"
    options = ModelOptions(dtype="bf16" if device == "cuda" else "fp32", mamba_backend=backend)
    with torch.device(device):
        model = MoEDecoder(get_recipe("nemotron_h_tiny"), options=options)
    model.init_weights(0)
    ids = torch.randint(0, 512, (2, 128), device=device, generator=torch.Generator(device).manual_seed(0))
    out = model(ids, ids.roll(-1, dims=1))
    out.loss.backward()
    assert torch.isfinite(out.loss) and 5.0 < out.lm_loss.item() < 8.0   # ~ln(512) at init
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)

"""The ``mamba_ssm`` Mamba-2 backend (dense/mamba2_kernels.py) through stand-ins of ``mamba_ssm`` and
``causal_conv1d`` written to their real APIs and refusals (the scan's shape asserts, the convolution's widths 2-4
and activations): the mixer with the backend equals the torch form in values and gradients (the stand-ins compute
what the kernels compute: the discretisation inside the scan, the SiLU inside the convolution), and what the real
kernels refuse is refused before a kernel runs, in one line. The CUDA run against the real kernels:
tests/gpu/test_mamba2_cuda.py."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from moefold.dense import mamba2_kernels
from moefold.dense.mamba2 import Mamba2Config, Mamba2Mixer
from moefold.dense.ssd_scan import ssd_chunk_scan

REAL_DEVICE_CHECK = mamba2_kernels.check_kernel_device


def _scan_stand_in(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                   cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
                   return_varlen_states=False, state_dtype=None):
    """mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined: its asserts, then its arithmetic."""
    batch, seqlen, nheads, headdim = x.shape
    _, _, ngroups, dstate = B.shape
    assert nheads % ngroups == 0
    assert B.shape == (batch, seqlen, ngroups, dstate) and C.shape == B.shape
    assert dt.shape == (batch, seqlen, nheads) and A.shape == (nheads,)
    assert D is None or D.shape in ((nheads, headdim), (nheads,))
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(*dt_limit)
    return ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=D, initial_state=initial_states)[0]


def _conv_stand_in(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                   final_states_out=None, activation=None):
    """causal_conv1d.causal_conv1d_fn: x [b, c, s], weight [c, k] (k in 2..4), activation None / silu / swish."""
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError("activation must be None, silu, or swish")
    assert weight.dim() == 2 and weight.shape[1] in (2, 3, 4) and x.shape[1] == weight.shape[0]
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[1] - 1, groups=weight.shape[0])
    out = out[..., : x.shape[-1]]
    return out if activation is None else F.silu(out)


@pytest.fixture
def stand_ins(monkeypatch):
    """The two packages as stand-ins, the device check lifted (the stand-ins run on the CPU)."""
    ssd = types.ModuleType("mamba_ssm.ops.triton.ssd_combined")
    ssd.mamba_chunk_scan_combined = _scan_stand_in
    conv = types.ModuleType("causal_conv1d")
    conv.causal_conv1d_fn = _conv_stand_in
    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.ssd_combined", ssd)
    monkeypatch.setitem(sys.modules, "causal_conv1d", conv)
    monkeypatch.setattr(mamba2_kernels, "mamba_ssm_available", lambda: True)
    monkeypatch.setattr(mamba2_kernels, "check_kernel_device", lambda *a: None)


def _mixers(conv_kernel=4, limit=(0.01, 0.5)):
    c = dict(hidden_size=32, num_heads=4, head_dim=8, state_size=8, num_groups=2, chunk_size=8,
             time_step_limit=limit, conv_kernel=conv_kernel)
    torch.manual_seed(0)
    ref = Mamba2Mixer(Mamba2Config(**c))
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    kernel = Mamba2Mixer(Mamba2Config(**c, backend="mamba_ssm"))
    kernel.load_state_dict(ref.state_dict())
    return ref, kernel


@pytest.mark.parametrize("limit", [(0.01, 0.5), (0.0, float("inf"))])
def test_kernel_backend_equals_torch(stand_ins, limit):
    ref, kernel = _mixers(limit=limit)
    x = torch.randn(19, 2, 32)
    outs, grads = [], []
    for m in (ref, kernel):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-5)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_refusals_before_a_kernel_runs(stand_ins, monkeypatch):
    _, kernel = _mixers(conv_kernel=5)
    with pytest.raises(ValueError, match=r"causal_conv1d: conv_kernel=5 is not supported"):
        kernel(torch.randn(8, 1, 32))
    monkeypatch.setattr(mamba2_kernels, "check_kernel_device", REAL_DEVICE_CHECK)
    _, kernel = _mixers()
    with pytest.raises(ValueError, match=r"runs on CUDA tensors only, got x on cpu"):
        kernel(torch.randn(8, 1, 32))


def test_missing_packages_refused_in_one_line():
    if mamba2_kernels.mamba_ssm_available():
        pytest.skip("mamba-ssm and causal-conv1d are installed")
    with pytest.raises(ValueError, match=r"needs the mamba-ssm and causal-conv1d packages"):
        Mamba2Config(hidden_size=8, num_heads=2, head_dim=2, state_size=4, backend="mamba_ssm")

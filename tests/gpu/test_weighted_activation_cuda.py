"""The experts' weighted activations on CUDA: ``(act(h) * p).to(h.dtype)`` (Megatron-Core's
``activation_func_with_probs``) bit for bit autograd's, forward and both gradients.

On CUDA ``moe.prob_rows`` runs the probs' products as one kernel each (no CPU row blocks), and ``swiglu_rows`` takes
its buffers from the caching allocator: the same aten kernels as autograd's formula in the same order, so the same
bits. Skipped without CUDA; in a rehearsal it runs on the CPU (the row blocks).
"""

import pytest
import torch
import torch.nn.functional as F

from moefold.moe.activation import GatedActivation, Weighted, swiglu, weighted_product
from moefold.moe.swiglu import swiglu_rows

GPT_OSS = GatedActivation(alpha=1.702, clamp=7.0, linear_offset=1.0)
WAYS = {"swiglu_rows": (swiglu_rows, swiglu), "swiglu": (Weighted(swiglu), swiglu),
        "gpt_oss": (Weighted(GPT_OSS), GPT_OSS), "gelu": (Weighted(F.gelu), F.gelu)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(WAYS))
def test_weighted_activation_is_the_product_formula_cuda(name, dtype, device):
    fn, act = WAYS[name]
    gen = torch.Generator().manual_seed(6)
    F_ = 384
    h = (3 * torch.randn(1025, 2 * F_ if act in (swiglu, GPT_OSS) else F_, generator=gen)).to(dtype).to(device)
    p = torch.rand(1025, generator=gen).to(device)
    g = torch.randn(1025, F_, generator=gen).to(dtype).to(device)
    hr, pr = h.clone().requires_grad_(), p.clone().requires_grad_()
    ref = weighted_product(act, hr, pr.unsqueeze(1))
    ref_grads = torch.autograd.grad(ref, (hr, pr), g)
    hw, pw = h.clone().requires_grad_(), p.clone().requires_grad_()
    out = fn(hw, pw)
    grads = torch.autograd.grad(out, (hw, pw), g)
    assert out.dtype == dtype and torch.equal(out, ref)
    assert torch.equal(grads[0], ref_grads[0]), "d_h"
    assert torch.equal(grads[1], ref_grads[1]), "d_p"

"""The experts' weighted activations on CUDA: ``(act(h) * p).to(h.dtype)`` (Megatron-Core's
``activation_func_with_probs``) bit for bit autograd's, forward and both gradients.

On CUDA ``moe.prob_rows`` runs the probs' products as one kernel each (no CPU row blocks), and ``swiglu_rows`` takes
its buffers from the caching allocator: the same aten kernels as autograd's formula in the same order, so the same
bits. Skipped without CUDA; in a rehearsal it runs on the CPU (the row blocks).
"""

import pytest
import torch

from moefold.moe.activation import GatedActivation, swiglu
from tests.moe.test_probs_in_experts import ACTIVATIONS, assert_weighted_is_the_formula


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_weighted_activation_is_the_product_formula_cuda(name, dtype, device):
    fn, act = ACTIVATIONS[name]
    gen = torch.Generator().manual_seed(6)
    gated = act is swiglu or isinstance(act, GatedActivation)
    h = (3 * torch.randn(1025, 768 if gated else 384, generator=gen)).to(dtype).to(device)
    p = torch.rand(1025, generator=gen).to(device)
    g = torch.randn(1025, 384, generator=gen).to(dtype).to(device)
    assert_weighted_is_the_formula(fn, act, h, p, g)

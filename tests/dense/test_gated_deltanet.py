"""The gated delta rule and the Gated DeltaNet layer at world 1.

- the chunked form equals the step-by-step recurrence, values and gradients (of q, k, v, g, beta and the
  initial state), with grouped value heads, a ragged last chunk and a carried state; and both equal
  transformers' own reference functions;
- a DeltaNet layer decoding token by token through its ``RecurrentCache`` equals one pass over the sequence;
- the convolution's fp32 island (``causal_conv_silu``) has the gradients of its forward;
- the fla backend is refused in one line when flash-linear-attention is missing; the layer refuses a tp, or a
  tp x cp, that does not divide its key heads, naming the numbers.

Parallel layouts (tp2 with and without SP, cp2, pp2) run in tests/models/test_parallel.py; HF parity of the
whole layer in tests/models/test_hf_interop.py.
"""

from __future__ import annotations

import pytest
import torch

from moefold.dense.gated_delta_rule import (
    chunk_gated_delta_rule,
    fla_available,
    gated_delta_rule_impl,
    recurrent_gated_delta_rule,
)
from moefold.dense.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig, RecurrentCache, causal_conv_silu


def _inputs(B=2, S=37, hk=2, hv=4, dk=8, dv=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    q, k, v = rand(B, S, hk, dk), rand(B, S, hk, dk), rand(B, S, hv, dv)
    decay = -torch.rand(B, S, hv, generator=g, dtype=dtype) * 0.5    # log decays in (-0.5, 0]
    beta = torch.rand(B, S, hv, generator=g, dtype=dtype)
    h0 = rand(B, hv, dk, dv) * 0.3
    return [t.requires_grad_() for t in (q, k, v, decay, beta, h0)]


def _grads(fn, inputs, seed=1):
    out, state = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum() + \
        (state * torch.randn(state.shape, generator=g, dtype=state.dtype)).sum()
    return out.detach(), state.detach(), torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("chunk_size", [8, 16, 64])
def test_chunked_equals_recurrence_values_and_gradients(chunk_size):
    inputs = _inputs()
    ref_out, ref_state, ref_grads = _grads(recurrent_gated_delta_rule, inputs)
    out, state, grads = _grads(lambda *a, **kw: chunk_gated_delta_rule(*a, chunk_size=chunk_size, **kw), inputs)
    # both compute in fp32 (transformers' and fla's choice): fp32 rounding, compared against values of order 1
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(state, ref_state, atol=2e-5, rtol=0)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    for name, g, r in zip(names, grads, ref_grads):
        assert r.abs().max() > 1e-2, name   # a gradient that can fail
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


def test_equals_transformers_reference():
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, decay, beta, h0 = (t.detach().float() for t in _inputs(S=29))
    kw = {"initial_state": h0, "output_final_state": True}
    hf_chunk = torch_chunk_gated_delta_rule(q, k, v, decay, beta, chunk_size=8, use_qk_l2norm_in_kernel=True, **kw)
    hf_rec = torch_recurrent_gated_delta_rule(q, k, v, decay, beta, use_qk_l2norm_in_kernel=True, **kw)
    for ours, theirs in ((chunk_gated_delta_rule(q, k, v, decay, beta, chunk_size=8, **kw), hf_chunk),
                         (recurrent_gated_delta_rule(q, k, v, decay, beta, **kw), hf_rec)):
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_a_carried_state_continues_the_sequence():
    """Two halves, the second starting from the first's final state, equal the whole sequence (what decoding and
    any state passing rely on)."""
    q, k, v, decay, beta, _ = (t.detach() for t in _inputs(S=40))
    whole, final = chunk_gated_delta_rule(q, k, v, decay, beta, chunk_size=16, output_final_state=True)
    first, mid = chunk_gated_delta_rule(*(t[:, :23] for t in (q, k, v, decay, beta)), chunk_size=16,
                                        output_final_state=True)
    second, end = recurrent_gated_delta_rule(*(t[:, 23:] for t in (q, k, v, decay, beta)), initial_state=mid,
                                             output_final_state=True)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(end, final, atol=1e-5, rtol=0)


def _layer(**kw) -> GatedDeltaNet:
    torch.manual_seed(0)
    cfg = GatedDeltaNetConfig(hidden_size=32, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6,
                              conv_kernel_size=4, chunk_size=8, backend="torch", **kw)
    layer = GatedDeltaNet(cfg)
    with torch.no_grad():
        layer.conv1d.weight.normal_(0, 0.5)
        layer.norm.weight.normal_(1, 0.2)
    return layer


def test_decoding_with_the_recurrent_cache_equals_one_pass():
    layer = _layer()
    x = torch.randn(13, 2, 32, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(13)
    with torch.no_grad():
        full = layer(x, pos)
        layer.cache = RecurrentCache()
        steps = [layer(x[:5], pos[:5])] + [layer(x[t:t + 1], pos[t:t + 1]) for t in range(5, 13)]
        layer.cache = None
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-6, rtol=0)
    # negative control: without the cache a step forgets the prefix
    with torch.no_grad():
        assert (layer(x[5:6], pos[5:6]) - full[5:6]).abs().max() > 1e-3


def test_convolution_backward_recomputes_the_same_gradients():
    """``causal_conv_silu``'s backward (recomputed from the saved inputs) is the derivative of its forward
    (float64 gradcheck), and in fp32 it computes what plain autograd through conv1d and silu computes."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 6, 3 + 9, generator=gen, dtype=torch.float64), torch.randn(6, 4, generator=gen,
                                                                                       dtype=torch.float64)
    assert torch.autograd.gradcheck(causal_conv_silu, (x.requires_grad_(), w.requires_grad_()))
    x32, w32 = (t.detach().float().requires_grad_() for t in (x, w))
    y = causal_conv_silu(x32, w32)
    gy = torch.randn(y.shape, generator=gen)
    got = torch.autograd.grad(y, (x32, w32), gy)
    y_ref = torch.nn.functional.silu(torch.nn.functional.conv1d(x32, w32.view(6, 1, 4), groups=6))
    torch.testing.assert_close(y, y_ref, atol=0, rtol=0)
    for a, b in zip(got, torch.autograd.grad(y_ref, (x32, w32), gy)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_backends_and_refusals():
    assert gated_delta_rule_impl("auto", "cpu").__name__ == "torch_chunked"
    if not fla_available():
        with pytest.raises(ValueError, match=r"needs the flash-linear-attention package") as err:
            GatedDeltaNetConfig(hidden_size=32, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8,
                                backend="fla")
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"runs on CUDA tensors only"):
        from moefold.dense.gated_delta_rule import fla_gated_delta_rule

        fla_gated_delta_rule(*(t.detach() for t in _inputs()[:5]))
    cfg = GatedDeltaNetConfig(hidden_size=32, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8)
    with pytest.raises(ValueError, match=r"num_key_heads=2 .* not divisible by tp=4"):
        cfg.check_parallel(4)
    cfg.check_parallel(1, 2)
    with pytest.raises(ValueError, match=r"context parallelism .* num_key_heads=2 / tp=2 is not divisible by cp=2"):
        cfg.check_parallel(2, 2)
    with pytest.raises(ValueError, match=r"num_value_heads=3 is not a multiple of num_key_heads=2"):
        GatedDeltaNetConfig(hidden_size=32, num_key_heads=2, num_value_heads=3, key_head_dim=8, value_head_dim=8)

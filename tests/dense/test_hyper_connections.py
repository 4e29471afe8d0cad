"""Manifold-constrained hyper-connections (dense.hyper_connections, the block's ``hyper``: DeepSeek-V4's mHC).

- ``HyperConnection`` and ``HyperHead`` equal transformers' ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``
  (fp32, 1e-5) over random parameters, inputs, stream counts, Sinkhorn iterations and eps, and so do their
  gradients;
- the block with ``hyper`` equals transformers' ``DeepseekV4DecoderLayer`` around the same attention and FFN
  (stand-ins: the real V4 sub-layers are tested on their own), outputs and gradients;
- comb is doubly stochastic after enough Sinkhorn iterations; bad values are refused naming them;
- under sequence parallelism (tp2, a 2-rank world) the block on each sequence shard equals world 1's, and its
  parameters' gradients summed over tp (each marked sequence-parallel) equal world 1's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moefold.dense.block import TransformerBlock
from moefold.dense.hyper_connections import HyperConfig, HyperConnection, HyperHead, expand_streams
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import init_parameters, is_sequence_parallel, mark_sequence_parallel
from tests.distributed import run_distributed

H, S, B = 8, 5, 3
CASES = [(4, 20, 1e-6), (2, 3, 1e-3), (3, 1, 0.0)]   # (n_hc, sinkhorn iterations, hc_eps)


def _hf_config(n_hc: int, iters: int, eps: float):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(vocab_size=16, hidden_size=H, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                            q_lora_rank=8, o_groups=2, o_lora_rank=4, index_n_heads=2, index_head_dim=4,
                            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, hc_mult=n_hc,
                            hc_sinkhorn_iters=iters, hc_eps=eps, rms_norm_eps=1e-5, sliding_window=4,
                            layer_types=["sliding_attention"], mlp_layer_types=["moe"])


def _randomise(*modules: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in modules:
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


@pytest.mark.parametrize("n_hc,iters,eps", CASES)
def test_hyper_connection_and_head_equal_transformers(n_hc, iters, eps):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

    cfg = _hf_config(n_hc, iters, eps)
    hf_hc, hf_head = DeepseekV4HyperConnection(cfg), DeepseekV4HyperHead(cfg)
    hc = HyperConnection(H, n_hc, sinkhorn_iters=iters, hc_eps=eps, norm_eps=1e-5)
    head = HyperHead(H, n_hc, hc_eps=eps, norm_eps=1e-5)
    _randomise(hf_hc, hf_head, seed=n_hc)
    hc.load_state_dict(hf_hc.state_dict())
    head.load_state_dict(hf_head.state_dict())
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x_SBNH = (torch.randn(S, B, n_hc, H, generator=g) * 3).requires_grad_()
        x_BSNH = x_SBNH.detach().transpose(0, 1).clone().requires_grad_()
        got, want = hc(x_SBNH), hf_hc(x_BSNH)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b.transpose(0, 1), atol=1e-5, rtol=1e-5)
        got_head, want_head = head(x_SBNH), hf_head(x_BSNH)
        torch.testing.assert_close(got_head, want_head.transpose(0, 1), atol=1e-5, rtol=1e-5)
        w = torch.randn(S, B, n_hc, n_hc, generator=g)
        (sum(t.pow(2).sum() for t in got[:2]) + (got[1] * w).sum() + got_head.sum()).backward()
        (sum(t.pow(2).sum() for t in want[:2]) + (want[1] * w.transpose(0, 1)).sum() + want_head.sum()).backward()
        torch.testing.assert_close(x_SBNH.grad, x_BSNH.grad.transpose(0, 1), atol=1e-5, rtol=1e-5)
    for (name, p), (_, q) in zip([*hc.named_parameters(), *head.named_parameters()],
                                 [*hf_hc.named_parameters(), *hf_head.named_parameters()], strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-5, msg=name)


class _Attn(nn.Module):
    """A stand-in token mixer with both call conventions: moefold's (h, position_ids) and HF's (h, **kw) -> (out, _)."""

    def __init__(self, hf: bool, proj: nn.Linear) -> None:
        super().__init__()
        self.hf, self.proj = hf, proj

    def forward(self, h, *args, **kwargs):
        out = torch.tanh(self.proj(h))
        return (out, None) if self.hf else out


class _FFN(nn.Module):
    def __init__(self, proj: nn.Linear) -> None:
        super().__init__()
        self.proj = proj

    def forward(self, h, input_ids=None):
        return torch.nn.functional.silu(self.proj(h))


@pytest.mark.parametrize("n_hc,iters,eps", CASES[:2])
def test_block_with_hyper_equals_the_transformers_decoder_layer(n_hc, iters, eps):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

    hf = DeepseekV4DecoderLayer(_hf_config(n_hc, iters, eps), layer_idx=0)
    attn_proj, ffn_proj = nn.Linear(H, H), nn.Linear(H, H)
    hf.self_attn, hf.mlp = _Attn(True, attn_proj), _FFN(ffn_proj)
    _randomise(hf, seed=n_hc + 10)
    block = TransformerBlock(H, _Attn(False, attn_proj), _FFN(ffn_proj), 1e-5,
                             hyper=HyperConfig(n_hc=n_hc, sinkhorn_iters=iters, eps=eps))
    for name in ("input_layernorm", "post_attention_layernorm", "attn_hc", "ffn_hc"):
        getattr(block, name).load_state_dict(getattr(hf, name).state_dict())
    g = torch.Generator().manual_seed(2)
    x = expand_streams(torch.randn(S, B, H, generator=g), n_hc) + 0.3 * torch.randn(S, B, n_hc, H, generator=g)
    x_ours, x_hf = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
    got, extra = block(x_ours, torch.arange(S))
    want = hf(x_hf)
    assert extra is None
    torch.testing.assert_close(got, want.transpose(0, 1), atol=1e-5, rtol=1e-5)
    gy = torch.randn(S, B, n_hc, H, generator=g)
    grads_ours = torch.autograd.grad((got * gy).sum(), [x_ours, *block.attn_hc.parameters()])
    grads_hf = torch.autograd.grad((want * gy.transpose(0, 1)).sum(), [x_hf, *hf.attn_hc.parameters()])
    torch.testing.assert_close(grads_ours[0], grads_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    for a, b in zip(grads_ours[1:], grads_hf[1:], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    assert "n_hc=" in block.extra_repr()


def test_comb_is_doubly_stochastic_and_the_streams_start_as_copies():
    hc = HyperConnection(H, 4, sinkhorn_iters=200, hc_eps=0.0)
    _randomise(hc)
    _, comb, _ = hc(torch.randn(S, B, 4, H, generator=torch.Generator().manual_seed(3)))
    torch.testing.assert_close(comb.sum(-1), torch.ones(S, B, 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(S, B, 4), atol=1e-6, rtol=0)
    x = torch.randn(S, B, H)
    assert all(torch.equal(expand_streams(x, 3)[:, :, i], x) for i in range(3))


def test_refusals_name_the_value():
    with pytest.raises(ValueError, match="n_hc=0 must be a positive integer"):
        HyperConfig(n_hc=0)
    with pytest.raises(ValueError, match="sinkhorn_iters=0"):
        HyperConnection(H, 2, sinkhorn_iters=0)
    with pytest.raises(ValueError, match="hc_eps=-1"):
        HyperHead(H, 2, hc_eps=-1)
    with pytest.raises(ValueError, match=r"expected \[S, B, 2, 8\]"):
        HyperConnection(H, 2)(torch.zeros(S, B, 3, H))


# ------------------------------------------------------------------------------------ sequence parallel, one world
class _TokenMix(nn.Module):
    """A per-token stand-in for the attention and the FFN: replicated, so under SP its weight's gradient is a
    partial sum over tp (marked as the norms' are)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(H, H, bias=False)
        mark_sequence_parallel(self.proj.weight)

    def forward(self, h, *args):
        return torch.tanh(self.proj(h))


def _sp_block(sp: bool) -> TransformerBlock:
    torch.manual_seed(0)
    block = TransformerBlock(H, _TokenMix(), _TokenMix(), 1e-5, sequence_parallel=sp, hyper=HyperConfig(n_hc=3))
    init_parameters(block, seed=4)
    return block


def _sp_world() -> list[str]:
    dims = ParallelDims.build(ParallelConfig(tp=2))
    g = torch.Generator().manual_seed(9)
    x, gy = torch.randn(2 * S, B, 3, H, generator=g), torch.randn(2 * S, B, 3, H, generator=g)
    ref = _sp_block(False)
    want = ref(x, torch.arange(2 * S))[0]
    (want * gy).sum().backward()
    block = _sp_block(True)
    shard = slice(dims.tp_rank * S, (dims.tp_rank + 1) * S)
    got = block(x[shard], torch.arange(S))[0]
    (got * gy[shard]).sum().backward()
    failures = [] if torch.allclose(got, want[shard], atol=1e-5) else ["output"]
    for (name, p), (_, q) in zip(block.named_parameters(), ref.named_parameters(), strict=True):
        if not is_sequence_parallel(p):
            failures.append(f"{name} is not marked sequence-parallel")
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad, group=dims.tp_group)
        if not torch.allclose(grad, q.grad, atol=1e-5, rtol=1e-5):
            failures.append(f"grad {name}: max err {(grad - q.grad).abs().max():.3g}")
    return failures


def test_sequence_parallel_block_equals_world1():
    failures = sorted({f for per_rank in run_distributed(_sp_world, 2, timeout=120) for f in per_rank})
    assert not failures, "\n".join(failures)

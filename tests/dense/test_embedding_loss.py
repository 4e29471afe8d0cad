"""Vocab-parallel embedding, output head (tied/untied) and cross-entropy equal the world-1 / torch results."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moefold.dense.cross_entropy import masked_mean, vocab_parallel_cross_entropy
from moefold.dense.embedding import OutputHead, VocabParallelEmbedding, pad_vocab_size
from moefold.dense.norm import RMSNorm
from moefold.parallel.comm import gather_along_dim
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.groups import Group, group_rank, group_size
from moefold.parallel.sharding import init_parameters
from tests.dense.parity import assert_all_close, full_grads, full_params
from tests.distributed import run_distributed

S, B, H, V = 8, 2, 16, 32


def _ce_data():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(S, B, V, generator=gen) * 3
    labels = torch.randint(0, V, (S, B), generator=gen)
    labels[0, 1] = -100  # ignored
    mask = (torch.rand(S, B, generator=gen) > 0.3).float()
    return logits, labels, mask


def _ce_reference():
    logits, labels, mask = _ce_data()
    logits = logits.requires_grad_()
    per_token = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(S, B) * mask
    loss = per_token.sum() / mask.sum()
    loss.backward()
    return per_token.detach(), logits.grad


def _ce_parallel(tp_group: Group):
    logits, labels, mask = _ce_data()
    local = logits.chunk(group_size(tp_group), dim=-1)[group_rank(tp_group)].clone().requires_grad_()
    per_token = vocab_parallel_cross_entropy(local, labels, tp_group, loss_mask=mask)
    assert per_token.dtype == torch.float32 and per_token.shape == (S, B)
    masked_mean(per_token, mask).backward()
    return per_token.detach(), gather_along_dim(local.grad, tp_group, -1)


class _TinyLM(nn.Module):
    """embedding -> RMSNorm -> tanh -> head -> per-token vocab-parallel CE."""

    def __init__(self, tp_group: Group, sp: bool, tied: bool) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.embed = VocabParallelEmbedding(V, H, tp_group, sequence_parallel=sp)
        self.norm = RMSNorm(H, sequence_parallel=sp)
        self.head = OutputHead(H, V, tp_group, sequence_parallel=sp, tied_to=self.embed if tied else None)

    def forward(self, ids, labels, mask):
        logits = self.head(torch.tanh(self.norm(self.embed(ids))))
        return masked_mean(vocab_parallel_cross_entropy(logits, labels, self.tp_group, loss_mask=mask), mask)


def _lm_run(tp_group: Group, sp: bool, tied: bool):
    model = _TinyLM(tp_group, sp, tied)
    init_parameters(model, seed=2)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, V, (S, B), generator=gen)
    labels = torch.randint(0, V, (S, B), generator=gen)
    mask = (torch.rand(S, B, generator=gen) > 0.25).float()
    loss = model(ids, labels, mask)
    loss.backward()
    return loss.detach(), full_params(model), full_grads(model, tp_group)


def _all_layouts():
    ce_ref = _ce_reference()
    lm_ref = {tied: _lm_run(None, False, tied) for tied in (False, True)}
    checked = []
    for tp in (2, 4):
        dims = ParallelDims.build(ParallelConfig(tp=tp))
        per_token, grad = _ce_parallel(dims.tp_group)
        assert_all_close({"loss": per_token, "grad": grad}, {"loss": ce_ref[0], "grad": ce_ref[1]}, f"CE tp={tp}")
        for sp in (False, True):
            for tied in (False, True):
                what = f"LM tp={tp} sp={sp} tied={tied}"
                loss, params, grads = _lm_run(dims.tp_group, sp, tied)
                ref_loss, ref_params, ref_grads = lm_ref[tied]
                assert_all_close(params, ref_params, what + " params", atol=0)
                assert_all_close({"loss": loss}, {"loss": ref_loss}, what)
                assert_all_close(grads, ref_grads, what + " grads")
                checked.append(what)
    with pytest.raises(ValueError) as info:
        VocabParallelEmbedding(30, H, dims.tp_group)
    return checked, str(info.value)


def test_embedding_head_and_loss_layouts_match_world_1():
    checked, message = run_distributed(_all_layouts, 4)[0]
    assert len(checked) == 8
    assert "vocab_size=30 is not divisible by tp=4" in message and "32" in message


def test_cross_entropy_single_rank_matches_torch():
    ref_loss, ref_grad = _ce_reference()
    loss, grad = _ce_parallel(None)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)


def test_cross_entropy_bf16_logits_fp32_loss():
    logits, labels, _ = _ce_data()
    local = logits.bfloat16().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, None)
    ref = F.cross_entropy(logits.bfloat16().float().view(-1, V), labels.view(-1), reduction="none").view(S, B)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-5)
    loss.sum().backward()
    assert local.grad.dtype == torch.bfloat16


def _softmax_then_clone_grad(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The logits' gradient as the backward computed it before it reused the saved softmax: the forward's softmax
    (the same ops), cloned, minus the one-hot target, times the loss gradient (ignored labels: target 0, gradient
    0), rounded to the logits' dtype."""
    x = logits.float()
    e = (x - x.max(dim=-1).values.unsqueeze(-1)).exp_()
    softmax = e.div_(e.sum(dim=-1).unsqueeze(-1))
    ignored = labels == -100
    grad = softmax.clone()
    grad.scatter_add_(-1, labels.masked_fill(ignored, 0).unsqueeze(-1), -torch.ones_like(grad[..., :1]))
    grad.mul_(weights.masked_fill(ignored, 0.0).unsqueeze(-1))
    return grad.to(logits.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_backward_in_place_equals_clone(dtype):
    """The backward builds the gradient in the saved softmax's buffer (Megatron-Core's way, no [tokens, V] clone):
    bit for bit the gradient of the clone-based backward, fp32 and bf16 logits (whose softmax is recomputed in
    backward), ignored labels included (the second backward: tests/dense/test_cross_entropy_recompute.py)."""
    logits, labels, mask = _ce_data()
    local = logits.to(dtype).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, None, loss_mask=mask)
    weights = torch.rand(S, B, generator=torch.Generator().manual_seed(1))
    loss.backward(weights)
    expected = _softmax_then_clone_grad(logits.to(dtype), labels, weights * mask)
    assert local.grad.dtype == dtype and torch.equal(local.grad, expected)


def test_bad_inputs():
    assert pad_vocab_size(30, 4) == 32 and pad_vocab_size(30, 4, multiple=16) == 64
    with pytest.raises(ValueError, match="must be labels"):
        vocab_parallel_cross_entropy(torch.zeros(4, 2, 8), torch.zeros(4, 3, dtype=torch.long), None)
    with pytest.raises(ValueError, match="cannot be tied"):
        OutputHead(H, 2 * V, None, tied_to=VocabParallelEmbedding(V, H, None))
    assert masked_mean(torch.ones(3), torch.zeros(3)).item() == 0.0

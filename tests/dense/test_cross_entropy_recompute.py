"""The cross-entropy's backward keeps bf16/fp16 logits plus two fp32 scalars per token instead of the fp32 softmax,
and recomputes the softmax from them: the loss and the logits' gradient are bit-identical to keeping the softmax
(the implementation before this change, copied below as the reference), at tp 1 and tp 2, with a loss mask and
ignored labels; fp32 logits still keep the softmax. The saved bytes are measured with saved_tensors_hooks."""

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from moefold.dense.cross_entropy import masked_mean, vocab_parallel_cross_entropy
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.groups import Group, group_rank, group_size
from tests.distributed import run_distributed

T, B, V = 6, 3, 64   # the saved-bytes cases
# The bit-identity cases: a recompute that differs from the forward by one fp32 ulp here and there (a multiply by
# the reciprocal instead of the division) changes a few of a million bf16/fp16 gradients, none of a thousand
# (checked: it fails the fp16 tp 1 case and both tp 2 cases).
LARGE = (256, 4, 1024)   # the full vocabulary: tp 2 gives 512 per rank
DTYPES = (torch.bfloat16, torch.float16)


class _KeptSoftmax(torch.autograd.Function):
    """The reference: the loss as it was when its backward kept the fp32 softmax (dense/cross_entropy.py at
    e81b02c, forward and backward unchanged)."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, group: Group) -> Tensor:
        v_local = logits.shape[-1]
        start = group_rank(group) * v_local
        logits32 = logits.float()
        max_logit = logits32.max(dim=-1).values
        if group_size(group) > 1:
            dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
        shifted = logits32 - max_logit.unsqueeze(-1)
        outside = (labels < start) | (labels >= start + v_local)
        local_labels = (labels - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        if group_size(group) > 1:
            dist.all_reduce(target_logit, group=group)
            dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - target_logit
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_labels, outside)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad, local_labels, outside = ctx.saved_tensors
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def _reference(logits: Tensor, labels: Tensor, group: Group, mask: Tensor) -> Tensor:
    ignored = labels == -100
    loss = _KeptSoftmax.apply(logits, labels.masked_fill(ignored, 0), group).masked_fill(ignored, 0.0)
    return loss * mask


def _data(dtype: torch.dtype, tp_group: Group, shape: tuple[int, int, int] = LARGE):
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(*shape, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, shape[-1], shape[:2], generator=gen)
    labels[0, 0] = labels[3, 2] = -100
    mask = (torch.rand(shape[:2], generator=gen) > 0.3).float()
    local = logits.chunk(group_size(tp_group), dim=-1)[group_rank(tp_group)].contiguous()
    return local, labels, mask


def _run(dtype: torch.dtype, tp_group: Group, reference: bool, mean: bool) -> tuple[Tensor, Tensor]:
    local, labels, mask = _data(dtype, tp_group)
    local.requires_grad_()
    if reference:
        loss = _reference(local, labels, tp_group, mask)
    else:
        loss = vocab_parallel_cross_entropy(local, labels, tp_group, loss_mask=mask)
    (masked_mean(loss, mask) if mean else loss.sum()).backward()
    return loss.detach(), local.grad


def _both(dtype: torch.dtype, tp_group: Group) -> list[str]:
    """Loss and gradient of the new loss and the reference under two loss weightings (the token mean and the sum:
    gradients of order 1/tokens and 1), compared with torch.equal; the mismatches named."""
    bad = []
    for mean in (True, False):
        new, ref = _run(dtype, tp_group, False, mean), _run(dtype, tp_group, True, mean)
        assert new[1].dtype == dtype
        for what, a, b in (("loss", new[0], ref[0]), ("grad", new[1], ref[1])):
            if not torch.equal(a, b):
                bad.append(f"{dtype} tp={group_size(tp_group)} mean={mean} {what}: "
                           f"max diff {(a.float() - b.float()).abs().max()}")
    return bad


@pytest.mark.parametrize("dtype", DTYPES)
def test_recomputed_softmax_bit_identical_tp1(dtype):
    assert _both(dtype, None) == []


def _tp2() -> list[str]:
    dims = ParallelDims.build(ParallelConfig(tp=2))
    return [m for dtype in DTYPES for m in _both(dtype, dims.tp_group)]


def test_recomputed_softmax_bit_identical_tp2():
    assert run_distributed(_tp2, 2) == [[], []]


def _saved_bytes(dtype: torch.dtype) -> int:
    """Bytes the loss's graph keeps for its backward (each storage once), logits [T, B, V] of ``dtype``."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    logits = torch.randn(T, B, V).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (T, B))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_cross_entropy(logits, labels, None)
    return sum(storages.values())


@pytest.mark.parametrize("dtype", DTYPES)
def test_low_precision_logits_keep_their_own_bytes(dtype):
    """The logits (2 bytes per logit) plus per-token scalars, labels and flags (at most 32 bytes per token: the
    fp32 max and sum, the int64 local labels, the bool flags of the function and of the ignored mask), never the
    fp32 softmax (4 bytes per logit, 24 KiB more here)."""
    saved = _saved_bytes(dtype)
    assert 2 * T * B * V <= saved <= 2 * T * B * V + 32 * T * B, saved


def test_fp32_logits_keep_the_softmax():
    saved = _saved_bytes(torch.float32)
    assert 4 * T * B * V <= saved <= 4 * T * B * V + 32 * T * B, saved


def test_second_backward_recomputes_for_bf16_and_is_refused_for_fp32():
    """bf16: each backward recomputes its own softmax, so retain_graph gives the same gradient twice. fp32: the
    kept softmax is the first backward's gradient buffer, so a second backward is refused."""
    local, labels, mask = _data(torch.bfloat16, None, (T, B, V))
    local.requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, None, loss_mask=mask).sum()
    first = torch.autograd.grad(loss, local, retain_graph=True)[0]
    assert torch.equal(torch.autograd.grad(loss, local)[0], first)
    local32 = local.detach().float().requires_grad_()
    loss = vocab_parallel_cross_entropy(local32, labels, None).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_bf16_peak_is_one_fp32_copy_and_the_gradient():
    """Forward and backward of the loss over bf16 logits allocate at most one fp32 ``[tokens, V]`` buffer (the
    upcast, shifted, exponentiated and divided in place, in backward the gradient) beside the bf16 gradient: 6 bytes
    per logit plus per-token terms, as ``planner.profile.head`` counts them (two fp32 buffers would be 8)."""
    from moefold.training.observe.memory import measure_peak

    logits, labels, mask = _data(torch.bfloat16, None, (32, 4, 2048))
    logits.requires_grad_()

    def step():
        vocab_parallel_cross_entropy(logits, labels, None, loss_mask=mask).sum().backward()

    _, peak = measure_peak(step)
    per_logit = logits.numel()
    assert 6 * per_logit <= peak.bytes <= 6 * per_logit + 64 * labels.numel(), peak.bytes / per_logit

"""Cross-entropy over vocab-parallel logits, without ever gathering the full vocabulary (Megatron-style).

Each tp rank holds logits for its vocabulary slice ``[r * V/tp, (r + 1) * V/tp)``. Per token,
three scalars cross ranks (all-reduces over the tp group, in fp32): the max logit, the
target's logit (only its owner contributes) and the sum of exponentials. The backward needs
no communication: ``softmax - one_hot(target)`` restricted to the local slice.

An fp32 island of the bf16 path: bf16 logits are upcast (``upcast_logits``) before the max, the
exponentials and their sum, as Megatron-Core's ``VocabParallelCrossEntropy`` does
(``calculate_logits_max``: ``vocab_parallel_logits.float()``) and HF's ``ForCausalLMLoss``
(``logits.float()``); only the logits' gradient returns in their dtype.

What the backward keeps: for fp32 logits the softmax ``[..., V/tp]`` (4 bytes per logit, the buffer the
forward computed it in: recomputing would save nothing). For lower-precision logits the logits themselves
(2 bytes per logit for bf16/fp16) plus the per-token fp32 max and sum of exponentials (8 bytes per token),
as Transformer Engine's fused loss keeps its input: the backward recomputes the softmax with the forward's
own operations in the same order (upcast, subtract the max, exp, divide by the sum), so the gradient is
bit-identical to keeping the fp32 softmax (the GPT-OSS vocabulary of 201k makes that softmax 13 GB per
micro-batch of 16k tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.parallel.groups import Group, group_rank, group_size


def _all_reduce_(x: Tensor, group: Group, op: dist.ReduceOp) -> None:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)


def upcast_logits(logits: Tensor) -> Tensor:
    """The logits the loss is computed from: fp32 (a copy for bf16 logits, the tensor itself for fp32)."""
    return logits.float()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-token ``logsumexp(logits) - logits[target]`` over the vocab split across ``group``.
    Backward: ``(softmax - one_hot(target)) * grad`` on the local slice, in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, group: Group) -> Tensor:
        v_local = logits.shape[-1]
        start = group_rank(group) * v_local
        logits32 = upcast_logits(logits)
        max_logit = logits32.max(dim=-1).values
        _all_reduce_(max_logit, group, dist.ReduceOp.MAX)
        recompute = logits.element_size() < 4   # bf16, fp16: their own bytes are fewer than the softmax's
        # A bf16/fp16 upcast is a copy of its own: shifted in place (the same subtraction, one [T, V/tp] fp32
        # buffer fewer); fp32 logits are the caller's tensor.
        shifted = logits32.sub_(max_logit.unsqueeze(-1)) if recompute else logits32 - max_logit.unsqueeze(-1)

        outside = (labels < start) | (labels >= start + v_local)
        local_labels = (labels - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        _all_reduce_(target_logit, group, dist.ReduceOp.SUM)

        exp = shifted.exp_()  # reuses the buffer: shifted is not needed any more
        sum_exp = exp.sum(dim=-1)
        _all_reduce_(sum_exp, group, dist.ReduceOp.SUM)
        loss = sum_exp.log() - target_logit

        ctx.recompute = recompute
        if recompute:   # keep the logits (their dtype) and two fp32 scalars per token; exp is freed here
            ctx.save_for_backward(logits, max_logit, sum_exp, local_labels, outside)
        else:
            softmax = exp.div_(sum_exp.unsqueeze(-1))
            ctx.save_for_backward(softmax, local_labels, outside)
        ctx.logits_dtype, ctx.consumed = logits.dtype, False
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        # The gradient is built in the softmax's own buffer, as Megatron-Core's VocabParallelCrossEntropy
        # does: a [tokens, V/tp] fp32 clone per step is a freshly page-faulted buffer on CPU (9 ms of the 57.7M
        # bf16 step). Kept (fp32 logits), a second backward through the same graph (retain_graph) would read
        # the consumed buffer and is refused; recomputed (lower-precision logits), each backward has its own.
        if ctx.recompute:
            logits, max_logit, sum_exp, local_labels, outside = ctx.saved_tensors
            # The forward's operations in its order (upcast, subtract the max, exp, divide): the same bits, in one
            # fp32 buffer (the upcast's copy) that becomes the gradient.
            softmax = upcast_logits(logits).sub_(max_logit.unsqueeze(-1)).exp_().div_(sum_exp.unsqueeze(-1))
        else:
            if ctx.consumed:
                raise RuntimeError("vocab_parallel_cross_entropy: a second backward through the same loss "
                                   "(retain_graph=True) with fp32 logits; its softmax was consumed by the first "
                                   "(compute the loss again)")
            ctx.consumed = True
            softmax, local_labels, outside = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, tp_group: Group, loss_mask: Tensor | None = None,
                                 ignore_index: int = -100) -> Tensor:
    """Per-token cross-entropy ``[...]`` in fp32 from this rank's logits ``[..., V/tp]``.

    ``labels [...]`` are global vocabulary ids, identical on every tp rank (usually ``[S, B]``).
    Tokens whose label is ``ignore_index`` get loss 0 and no gradient; the loss is multiplied by
    ``loss_mask`` (0/1 or weights) when given.
    Collective over ``tp_group`` (three fp32 all-reduces of size ``labels.numel()``).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} must be labels "
                         f"{tuple(labels.shape)} + [V/tp]")
    if loss_mask is not None and loss_mask.shape != labels.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: loss_mask {tuple(loss_mask.shape)} must have the labels' "
                         f"shape {tuple(labels.shape)}")
    ignored = labels == ignore_index
    loss = _VocabParallelCrossEntropy.apply(logits, labels.masked_fill(ignored, 0), tp_group)
    loss = loss.masked_fill(ignored, 0.0)
    return loss if loss_mask is None else loss * loss_mask.to(loss.dtype)


def masked_mean(loss: Tensor, mask: Tensor | None) -> Tensor:
    """Mean of ``loss`` over the positions where ``mask`` is non-zero (0 when none is); plain mean without a mask.

    Local to this rank: a mean over data/context-parallel ranks must sum ``(loss * mask).sum()`` and
    ``mask.sum()`` across them first.
    """
    if mask is None:
        return loss.mean()
    mask = mask.to(loss.dtype)
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)

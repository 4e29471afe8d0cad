"""Sequence-parallel column-parallel GEMMs keep this rank's shard for backward, not the gathered sequence
(``parallel.sequence_input``; Megatron's ``ColumnParallelLinear`` and TE's ``backward_input_needs_gather``).

On 2 gloo ranks with SP, the dense MLP, the shared experts (one gather for gate and up) and a single
``ColumnParallelLinear``, in high precision and with FP8 GEMMs (tensorwise: the quantised copy is kept as this
rank's rows), are run under an outer ``saved_tensors_hooks`` that records every tensor autograd keeps (the
region hands its shards to the hooks it found, as it does to activation offload and checkpoints). No kept tensor
has the gathered sequence's rows; the shard is kept instead; values and every gradient equal world 1.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moefold.dense.linear import ColumnParallelLinear
from moefold.dense.mlp import DenseMLP, MLPConfig
from moefold.execution.fp8_linear import convert_linears_to_fp8
from moefold.moe.shared_experts import SharedExperts
from moefold.parallel.groups import Group
from moefold.parallel.sharding import init_parameters
from moefold.precision.fp8 import FP8Config
from tests.dense.parity import assert_all_close, full_grads, seq_gather, seq_shard
from tests.distributed import run_distributed

S, B, H, F = 8, 2, 16, 64


def _model(kind: str, tp_group: Group, sp: bool) -> nn.Module:
    if kind == "mlp":
        return DenseMLP(MLPConfig(H, F), tp_group, sequence_parallel=sp)
    if kind == "shared":
        return SharedExperts(H, F, tp_group=tp_group, sequence_parallel=sp)
    return ColumnParallelLinear(H, F, tp_group, sequence_parallel=sp, gather_output=True)


def _setup(tp_group: Group, sp: bool, kind: str, fp8: bool) -> tuple[nn.Module, torch.Generator, torch.Tensor]:
    """The model (FP8 linears if ``fp8``), the generator after the input, and this rank's input shard."""
    model = _model(kind, tp_group, sp)
    init_parameters(model, seed=3)
    if fp8:
        convert_linears_to_fp8(model, FP8Config("e4m3", "tensorwise"), tp_group)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(S, B, H, generator=gen)
    return model, gen, seq_shard(x, tp_group, sp).requires_grad_()


def _run(tp_group: Group, sp: bool, kind: str, fp8: bool):
    model, gen, x_local = _setup(tp_group, sp, kind, fp8)
    params = {p.data_ptr() for p in model.parameters()}
    kept: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}   # by storage: one tensor saved twice counts once

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            kept[t.data_ptr()] = (tuple(t.shape), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x_local)
    out = y if kind == "linear" else seq_gather(y, tp_group, sp)
    dy = torch.randn(out.shape, generator=gen)
    y.backward(dy if kind == "linear" else seq_shard(dy, tp_group, sp))
    return out.detach(), seq_gather(x_local.grad, tp_group, sp), full_grads(model, tp_group), list(kept.values())


def _gathered_rows(kept) -> list:
    """Kept tensors with the gathered sequence's rows of the input: [S, B, H] or [S*B, H]."""
    return [k for k in kept if k[0] in ((S, B, H), (S * B, H))]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-path", "fp8"])
def test_sp_column_parallel_keeps_the_shard(fp8):
    def body(kind):
        import torch.distributed as dist

        tp = dist.new_group([0, 1])
        want = _run(None, False, kind, fp8)
        got = _run(tp, True, kind, fp8)
        return want, got

    for kind in ("mlp", "shared", "linear"):
        results = run_distributed(body, 2, kind)
        (w_y, w_dx, w_grads, w_kept), (g_y, g_dx, g_grads, g_kept) = results[0]
        assert torch.allclose(g_y, w_y, atol=1e-5, rtol=1e-5), kind
        assert torch.allclose(g_dx, w_dx, atol=1e-5, rtol=1e-5), kind
        assert_all_close(g_grads, w_grads, f"{kind} grads")
        assert _gathered_rows(w_kept), f"{kind}: world 1 keeps its [S, B, H] input"   # the check can see one
        assert not _gathered_rows(g_kept), f"{kind} keeps the gathered input: {g_kept}"
        if fp8:   # the quantised copy, this rank's rows: one for gate and up together (precision.fp8_cast.shared_cast)
            assert g_kept.count(((S * B // 2, H), torch.float8_e4m3fn)) == 1, g_kept
        else:     # the shard itself
            assert ((S // 2, B, H), torch.float32) in g_kept, g_kept


def _run_checkpointed(tp_group: Group, sp: bool, kind: str, fp8: bool):
    """``_run`` inside torch's non-reentrant checkpoint: the region's shards go to its holders (one per saved
    tensor: a holder is unpacked once) and come back from the recomputation."""
    from torch.utils.checkpoint import checkpoint

    model, gen, x_local = _setup(tp_group, sp, kind, fp8)
    y = checkpoint(model, x_local, use_reentrant=False)
    out = seq_gather(y, tp_group, sp)
    y.backward(seq_shard(torch.randn(out.shape, generator=gen), tp_group, sp))
    return out.detach(), seq_gather(x_local.grad, tp_group, sp), full_grads(model, tp_group)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-path", "fp8"])
def test_sp_input_under_a_checkpoint_equals_world1(fp8):
    def body(kind):
        import torch.distributed as dist

        tp = dist.new_group([0, 1])
        return _run_checkpointed(None, False, kind, fp8), _run_checkpointed(tp, True, kind, fp8)

    for kind in ("mlp", "shared"):
        (w_y, w_dx, w_grads), (g_y, g_dx, g_grads) = run_distributed(body, 2, kind)[0]
        assert torch.allclose(g_y, w_y, atol=1e-5, rtol=1e-5), kind
        assert torch.allclose(g_dx, w_dx, atol=1e-5, rtol=1e-5), kind
        assert_all_close(g_grads, w_grads, f"{kind} grads")

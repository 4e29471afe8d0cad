"""Gradient-accumulation fusion (``dense.grad_accumulation``, ``GradSync(fusion=True)``): the same training as the
unfused path, with the weight-gradient GEMMs writing the main-grad buffer themselves and no per-step zeroing.

- values: losses, gradient norms and parameters after several steps of several micro-batches equal the
  unfused run's, at world 1 (fp32 and bf16) and in one spawned world at dp2 x ep2, tp2 x ep2 and pp2 x ep2;
- the ops: under a dispatch mode that records every aten call writing into the main-grad buffer, the fused
  GEMM weights' buffers are written only by GEMMs (``mm`` / ``addmm_`` / ``bmm`` / ``baddbmm_``, their first
  micro-batch without accumulation), nothing ``fill_``s / ``zero_``s the buffer, and the profile of a step has no
  grad-sized ``fill_`` / ``add_``; the unfused path shows all three (so the checks can fail);
- an unused parameter still gets a zero gradient (the buffer holds the previous step's otherwise).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moefold.dense.grad_accumulation import mm_into, widen_into
from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear
from moefold.execution.grad_accumulation import _weight_grad_into
from moefold.moe.experts import GroupedExperts
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.training.trainer_common import run, tiny_config, tiny_data

GEMM_WRITES = {"aten.mm.out", "aten.addmm_.default", "aten.bmm.out", "aten.baddbmm_.default"}


def _config(fusion: bool, parallel: ParallelConfig = ParallelConfig(), **train):
    t = dict(steps=3, recipe="qwen3_moe_tiny", micro_batch_size=1, global_batch_size=4, clip_grad=1.0)
    t.update(train)
    c = tiny_config(parallel, **t)
    return dataclasses.replace(c, train=dataclasses.replace(c.train, gradient_accumulation_fusion=fusion))


def _fused_weights(trainer: Trainer) -> list[torch.Tensor]:
    out = []
    for m in trainer.model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            out.append(m.weight)
        elif isinstance(m, GroupedExperts):
            out += [m.w13, m.w2]
    return out


def _compare(fusion_runs, tol: float) -> None:
    (l0, p0, _), (l1, p1, _) = fusion_runs
    torch.testing.assert_close(torch.tensor(l1), torch.tensor(l0), atol=tol, rtol=tol)
    for name, v in p0.items():
        torch.testing.assert_close(p1[name], v, atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("bf16", [False, True])
def test_fused_equals_unfused_world1(bf16):
    """Four micro-batches per step, three steps: the fused run's losses and parameters equal the unfused run's
    (fp32: to the rounding of the accumulating GEMM, 1e-7 here; bf16 params with fp32 main grads: the CPU's bf16
    product is added into the fp32 buffer as autograd's gradient was: bit for bit)."""
    runs = [run(_config(fusion, bf16=bf16)) for fusion in (False, True)]
    assert runs[1][2].sync.fusion and not runs[0][2].sync.fusion
    _compare(runs, 0.0 if bf16 else 1e-6)
    if not bf16:
        norms = [[g.float().norm() for g in r[2].sync.owned_grads()] for r in runs]
        torch.testing.assert_close(torch.stack(norms[1]), torch.stack(norms[0]), atol=1e-6, rtol=1e-5)


def _layouts_equal():
    out = []
    for cfg in (ParallelConfig(ep=2), ParallelConfig(tp=2, ep=2), ParallelConfig(pp=2, ep=2)):
        dims = ParallelDims.build(cfg)
        runs = [run(_config(fusion, cfg), dims=dims) for fusion in (False, True)]
        _compare(runs, 1e-5)
        out.append(True)
    return all(out)


def test_fused_equals_unfused_layouts():
    """dp2 x ep2, tp2 x ep2 (sequence parallel) and pp2 x ep2 (1F1B: several forwards in flight) in one world of 4."""
    assert all(run_distributed(_layouts_equal, 4))


class _MainGradWrites(TorchDispatchMode):
    """Every aten op that writes (in place or ``out=``) into memory of the given buffers: [(op, buffer index)]."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        super().__init__()
        self.ranges = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers]
        self.writes: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        written = [kwargs[a.name] if a.name in kwargs else args[i]
                   for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
                   and (a.name in kwargs or i < len(args))]
        for t in written:
            if isinstance(t, torch.Tensor) and t.numel():
                p = t.data_ptr()
                for j, (lo, hi) in enumerate(self.ranges):
                    if lo <= p < hi:
                        self.writes.append((str(func), j, t.numel()))
        return func(*args, **(kwargs or {}))


def _one_step_writes(fusion: bool):
    cfg = _config(fusion, steps=2)
    trainer = Trainer(cfg, ParallelDims.single(), log=lambda _m: None)
    data = torch.from_numpy(tiny_data())
    batches = [data[i:i + 1] for i in range(4)]
    trainer.train_step(batches)   # warm-up step: every slot has been written once
    weights = _fused_weights(trainer)
    mode = _MainGradWrites([w.main_grad for w in weights] + [g.grad_data for g in trainer.sync.groups])
    with mode:   # the step's forwards, backwards and gradient sync (the optimizer's clipping multiply aside)
        trainer.sync.start_step(len(batches))
        for b in batches:
            (trainer.model(b[:, :-1], b[:, 1:]).loss / len(batches)).backward()
        trainer.sync.finish()
    with torch.profiler.profile(record_shapes=True) as prof:
        trainer.train_step(batches)
    # the largest flat buffer and the expert weights (the tiny model's other weights share their sizes with activations;
    # the dispatch mode above is exact for them). Not the embedding's size: its backward zeroes a table to scatter
    # into, as every framework's does, and it is no GEMM.
    embedding = {p.numel() for n, p in trainer.model.named_parameters() if "embed" in n}
    experts = {w.numel() for w in weights if w.dim() > 2}
    sizes = {max(g.grad_data.numel() for g in trainer.sync.groups)} | (experts - embedding)
    grad_sized = [(e.name, e.input_shapes[0]) for e in prof.events()
                  if e.name in ("aten::fill_", "aten::zero_", "aten::add_") and e.input_shapes
                  and e.input_shapes[0] and _numel(e.input_shapes[0]) in sizes]
    return mode.writes, weights, grad_sized


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def test_fused_step_writes_gradients_with_gemms_only():
    writes, weights, grad_sized = _one_step_writes(True)
    n = len(weights)
    # an expert that got no rows in the first micro-batch has its slice zeroed: the only non-GEMM write allowed
    expert_slices = {w.numel() // w.shape[0] for w in weights if w.dim() > 2}
    on_weights = [op for op, j, numel in writes
                  if j < n and not (op == "aten.zero_.default" and numel in expert_slices)]
    assert on_weights and set(on_weights) <= GEMM_WRITES, sorted(set(on_weights))
    # every linear's first micro-batch writes (mm out=), the later three accumulate; an expert (one GEMM per expert
    # with rows) is written once and accumulated only in the micro-batches that route rows to it
    gemm = [(op, j) for op, j, _ in writes if j < n and op in GEMM_WRITES]
    linears = {j for j, w in enumerate(weights) if w.dim() == 2}
    for j in linears:
        ops = [op for op, k in gemm if k == j]
        assert sum(op.endswith(".out") for op in ops) == 1 and sum(op.endswith("_.default") for op in ops) >= 3, ops
    assert sum(op.endswith(".out") for op, _ in gemm) < sum(op.endswith("_.default") for op, _ in gemm)
    whole = [numel for op, j, numel in writes if ("fill" in op or "zero" in op) and j >= n]
    assert not [x for x in whole if x > max(expert_slices)], "a zeroing pass over the main-grad buffer"
    assert not grad_sized, grad_sized
    unfused, _, grad_sized_unfused = _one_step_writes(False)
    assert {op for op, j, _ in unfused if j < n} & {"aten.add_.Tensor", "aten.fill_.Scalar", "aten.zero_.default"}
    assert grad_sized_unfused   # the per-step zeroing and autograd's accumulation show in the profile


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_widen_into_equals_mixed_add(src_dtype):
    """A bf16 weight gradient widened into an fp32 main grad (``widen_into``: through an fp32 workspace on CPU) is
    bit for bit torch's mixed-dtype ``copy_`` / ``add_``, into a contiguous buffer and into a transposed view
    (``mm_into``'s target), above and below the workspace's 1 MiB minimum."""
    gen = torch.Generator().manual_seed(3)
    for rows, cols in ((512, 768), (24, 40)):
        src = torch.randn(rows, cols, generator=gen).to(src_dtype) * 1e-3
        for transposed in (False, True):
            base = torch.randn(cols, rows, generator=gen).t() if transposed else torch.randn(rows, cols, generator=gen)
            for accumulate in (False, True):
                out, ref = base.clone(), base.clone()
                if transposed:
                    out, ref = base.t().clone().t(), base.t().clone().t()
                widen_into(out, src, accumulate)
                ref.add_(src) if accumulate else ref.copy_(src)
                assert torch.equal(out, ref), (rows, transposed, accumulate)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_weight_grad_equals_mm_into_the_transposed_buffer(dtype):
    """The fused linear's weight gradient (``_weight_grad_into``: on CPU the bf16 product transposed into a
    workspace, then widened contiguously) is bit for bit ``mm_into`` straight into the transposed fp32 buffer, first
    write and accumulation, above and below the workspace's 1 MiB minimum."""
    gen = torch.Generator().manual_seed(5)
    for M, K, N in ((512, 256, 1024), (9, 24, 40)):
        x = torch.randn(M, K, generator=gen).to(dtype)
        dy = torch.randn(M, N, generator=gen).to(dtype)
        for accumulate in (False, True):
            out = torch.randn(N, K, generator=gen)
            ref = out.clone()
            _weight_grad_into(out, x, dy, accumulate)
            mm_into(ref.t(), x.t(), dy, accumulate)
            assert torch.equal(out, ref), (M, accumulate)


def test_unused_parameter_gets_zero_gradient():
    """A weight nothing used this step reads zero, not last step's gradient."""
    cfg = _config(True, steps=2)
    trainer = Trainer(cfg, ParallelDims.single(), log=lambda _m: None)
    data = torch.from_numpy(tiny_data())
    batches = [data[i:i + 1] for i in range(4)]
    trainer.train_step(batches)
    head = next(m for m in trainer.model.modules() if isinstance(m, ColumnParallelLinear))
    assert head.weight.main_grad.abs().sum() > 0
    saved = head.forward_local
    head.forward_local = lambda x: torch.nn.functional.linear(x, head.weight.detach())   # no gradient reaches it
    try:
        trainer.sync.start_step(1)
        out = trainer.model(batches[0][:, :-1], batches[0][:, 1:])
        out.loss.backward()
        trainer.sync.finish()
    finally:
        head.forward_local = saved
    assert head.weight.main_grad.abs().sum() == 0

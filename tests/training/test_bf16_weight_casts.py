"""``--bf16`` keeps the bf16 weight copies its GEMMs read: no per-op cast of a weight on the hot path.

Under ``--bf16`` the model's parameters are bf16 (routers and the expert bias fp32), the distributed optimizer
keeps the fp32 masters and main grads, and its param sync casts the masters into the parameters once per
optimizer step (Megatron's scheme, docs/precision.md). A dispatch mode records every dtype-changing copy
(``aten._to_copy``, ``aten.copy_``) of one bf16 step of two micro-batches with its phase: forward, backward (an
autograd node is running) or the optimizer step. Copies shaped like a parameter are classified:

- fp32 -> bf16 of a GEMM weight's shape (a >= 2-D bf16 parameter) in forward or backward: a per-op weight cast,
  the thing ``--bf16`` must not do (a model keeping fp32 weights and casting them for each GEMM, autocast's way).
  None allowed. 1-D (norm weights): only the gradients the norms' fp32 island returns in the parameter's dtype,
  in backward, one per norm call;
- bf16 -> fp32 of a parameter's shape: in forward the norms' weight upcast (their fp32 island); in backward the
  weight gradients widened into the fp32 main grads, at most one per parameter per micro-batch;
- the optimizer step: fp32 -> bf16 copies of exactly the bf16 parameters' element count (the param sync, once),
  none shaped like a GEMM weight.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.copy_profile import category, copy_callers
from moefold.dense.cross_entropy import upcast_logits
from moefold.dense.norm import rms_norm
from moefold.parallel.dims import ParallelDims
from moefold.training.trainer import Trainer
from tests.training.trainer_common import tiny_config, tiny_data

_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


class _Casts(TorchDispatchMode):
    """Every dtype-changing copy: (phase, source dtype, destination dtype, shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.casts: list[tuple[str, torch.dtype, torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _COPIES:
            if func is torch.ops.aten.copy_.default:
                src, dst = args[1].dtype, args[0].dtype
            else:
                src, dst = args[0].dtype, kwargs.get("dtype") or args[0].dtype
            if src != dst:
                phase = self.phase
                if phase == "forward" and torch._C._current_autograd_node() is not None:
                    phase = "backward"
                self.casts.append((phase, src, dst, tuple(args[0].shape)))
        return func(*args, **kwargs)


def _bf16_step_casts():
    cfg = tiny_config(steps=3, recipe="qwen3_moe_tiny", bf16=True, micro_batch_size=3, global_batch_size=6)
    trainer = Trainer(cfg, ParallelDims.single(), log=lambda _m: None)
    data = torch.from_numpy(tiny_data())
    batches = [data[3 * i:3 * i + 3] for i in range(2)]   # 96 tokens: no activation is weight-shaped
    trainer.train_step(batches)   # warm-up: layouts measured, workspaces and optimizer state made
    mode = _Casts()
    step = trainer.optimizer.step

    def optimizer_step(*args, **kwargs):
        mode.phase = "optimizer"
        try:
            return step(*args, **kwargs)
        finally:
            mode.phase = "forward"

    trainer.optimizer.step = optimizer_step
    with mode:
        result = trainer.train_step(batches)
    assert not result.skipped
    return trainer, mode.casts, len(batches)


def _count(casts, phase: str, src: torch.dtype, dst: torch.dtype, shapes) -> collections.Counter:
    return collections.Counter(s for p, a, b, s in casts if p == phase and (a, b) == (src, dst) and s in shapes)


def test_bf16_step_has_no_per_op_weight_casts():
    trainer, casts, micro = _bf16_step_casts()
    params = [p for p in trainer.model.parameters() if p.dtype == torch.bfloat16]
    assert params and any(p.dim() == 3 for p in params)   # the experts' weights are bf16 parameters
    per_shape = collections.Counter(tuple(p.shape) for p in params)
    gemm_weights = {s for s in per_shape if len(s) >= 2}
    vectors = {s for s in per_shape if len(s) == 1}
    bf16, fp32 = torch.bfloat16, torch.float32
    for phase in ("forward", "backward", "optimizer"):
        weight_casts = _count(casts, phase, fp32, bf16, gemm_weights)
        assert not weight_casts, f"{phase}: fp32 -> bf16 copies shaped like a GEMM weight: {dict(weight_casts)}"
    # only backward returns the norms' fp32 weight gradients in bf16; the forward casts no weight down
    assert not _count(casts, "forward", fp32, bf16, vectors)
    norms = _count(casts, "forward", bf16, fp32, vectors)   # the norm island's weight upcast, once per call
    assert norms and _count(casts, "backward", fp32, bf16, vectors) == norms
    # gradients into the fp32 main grads: at most one widening per parameter per micro-batch
    grads = _count(casts, "backward", bf16, fp32, set(per_shape))
    assert grads and all(n <= micro * per_shape[s] for s, n in grads.items()), (dict(grads), dict(per_shape))
    assert sum(n for s, n in grads.items() if len(s) == 3) > 0   # the experts' weight gradients are among them
    # the param sync: every bf16 parameter cast from its fp32 master exactly once per optimizer step
    synced = sum(torch.Size(s).numel() for p, a, b, s in casts if p == "optimizer" and (a, b) == (fp32, bf16))
    assert synced == sum(p.numel() for p in params)


def test_copy_profile_names_the_callers():
    """``train_step.py --copies`` (benchmarks/copy_profile.py) attributes each copy_ to the moefold line that asked for
    it and sorts the fp32 islands' casts as such."""
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    calls, totals, rows = copy_callers(lambda: (rms_norm(x, torch.ones(16, dtype=torch.bfloat16), 1e-6),
                                                upcast_logits(x)), repeats=1)
    frames = {(inside, frame.split("(")[0]) for _, _, _, inside, frame in rows}
    assert {("aten::_to_copy", "dense/norm.py"), ("aten::_to_copy", "dense/cross_entropy.py")} <= frames, frames
    assert calls == sum(n for _, n, *_ in rows) and len(totals) == 1
    assert {category(inside, frame) for _, _, _, inside, frame in rows if "dense/" in frame} == {
        "activation casts of the fp32 islands (and their gradients)"}
    assert category("-", "training/optim/optimizer.py(148): after_step").startswith("param sync")

"""Split backward of the routed experts (``moe.split_gemm``, torchao FP8 ``moe.fp8_gemm``): after ``I`` the
input gradient equals the plain backward's while ``w13``/``w2`` wait; after ``W`` their gradients equal the plain
ones, with experts that got no rows and with no rows at all (N = 0), for the ``grouped_mm`` and ``loop`` backends,
SwiGLU and GELU, with the ``moe_act`` recompute, and for torchao FP8 (tensorwise and rowwise)."""

from __future__ import annotations

import copy

import pytest
import torch

from moefold.dense.split_backward import WeightGradStore
from moefold.execution.recompute import DISCARD_OUTPUT
from moefold.execution.split_backward import install_weight_grad_store
from moefold.moe.build import build_experts
from moefold.moe.config import ExpertsConfig
from moefold.moe.experts import GroupedExperts
from moefold.parallel.sharding import init_parameters
from moefold.precision.fp8 import FP8Config
from tests.moe import te_standin

E, H, FFN = 4, 32, 48

CASES = {
    "grouped_mm": dict(gemm_backend="grouped_mm"),
    "loop": dict(gemm_backend="loop"),
    "gelu_loop": dict(gemm_backend="loop", activation="gelu"),
    "grouped_mm_recompute_act": dict(gemm_backend="grouped_mm", recompute_activation=True),
    "fp8_tensorwise": dict(gemm_backend="grouped_mm", fp8=FP8Config("hybrid", "tensorwise")),
    "fp8_rowwise_loop": dict(gemm_backend="loop", fp8=FP8Config("e4m3", "rowwise")),
}
COUNTS = {"some_empty": [3, 0, 6, 0], "all_empty": [0, 0, 0, 0], "full": [2, 5, 1, 4]}


def _experts(case: dict) -> GroupedExperts:
    case = dict(case)
    recompute = case.pop("recompute_activation", False)
    experts = build_experts(E, H, ExpertsConfig(FFN, **case))
    if recompute:
        experts.configure(moe_act=DISCARD_OUTPUT)
    init_parameters(experts, seed=5)
    return experts


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("case", CASES)
def test_split_grouped_gemm_equals_plain_backward(case, counts):
    plain = _experts(CASES[case])
    split = copy.deepcopy(plain)
    store = WeightGradStore()
    assert install_weight_grad_store(split, store) == [""]
    c = torch.tensor(COUNTS[counts])
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(int(c.sum()), H, generator=gen)
    dy = torch.randn(int(c.sum()), H, generator=gen)

    xp = x.clone().requires_grad_()
    plain(xp, c, tuple(COUNTS[counts])).backward(dy)
    xs = x.clone().requires_grad_()
    fp8_no_rows = "fp8" in case and counts == "all_empty"   # moe.gemm.no_rows: zero gradients at once
    with store.splitting():
        out = split(xs, c, tuple(COUNTS[counts]))
    with store.defer() as later:
        out.backward(dy)
    assert torch.equal(xs.grad, xp.grad)
    if not fp8_no_rows:
        assert split.w13.grad is None and split.w2.grad is None and len(later) == 2, "I deferred both projections"
    later.run()
    for name in ("w13", "w2"):
        got, want = getattr(split, name).grad, getattr(plain, name).grad
        assert torch.equal(got, want), f"{case}/{counts}: {name}"
    if counts != "full":
        empty = [i for i, n in enumerate(COUNTS[counts]) if n == 0]
        assert split.w13.grad[empty].abs().sum() == 0 and split.w2.grad[empty].abs().sum() == 0


def test_te_expert_gemms_are_refused_with_one_line(monkeypatch):
    te_standin.install(monkeypatch)
    experts = build_experts(E, H, ExpertsConfig(FFN, gemm_backend="te"))
    with pytest.raises(ValueError, match="cannot defer the weight gradients of the 'te' expert GEMMs"):
        install_weight_grad_store(experts, WeightGradStore())

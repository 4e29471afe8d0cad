"""Tolerances from the arithmetic: how far two fp32 evaluations of the same quantity may fall apart.

A parallel layout computes the same sums as world 1 in another order (tp partial sums, cp sequence parts, the
experts' rows on other ranks), so each result carries its own fp32 rounding error, and how large that error is
depends on the quantity: a norm weight's gradient is a sum over every token of products that mostly cancel,
so its rounding error is large against its own size (on AMD EPYC, glm4_moe's k_norm gradient was 1.09e-8 off at
a largest element of 7.6e-4: 1.4e-5 relative, over the old fixed 1e-5), while a projection's is small.

The bound is therefore measured per quantity, in the same run, on the same CPU kind: the same world-1 computation
in float64 gives the exact value to ~1e-16, and ``|ref32 - ref64|`` is fp32's error on this input. Two fp32
evaluations (world 1, the layout) each carry an error of that size; their difference is within twice it, and
``FACTOR`` leaves room for the layout's own order (other partial sums of the same terms), while a real defect (a
missing reduction, a wrong shard) is off by the size of the quantity itself. The floor, a few ulps of the
largest element, covers quantities fp32 happens to compute (nearly) exactly in one order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

EPS32 = torch.finfo(torch.float32).eps
# two evaluations' errors (2x) with room for another summation order (8x): the own error is one sample, and where a
# sum cancels, the layout's other order reaches 8-11x it (DeepSeek-V4's hc_head.hc_base at etp2 x ep2: 8.2x;
# Nemotron-H's router weight at ep2: 10.3x) once the float64 references are exact through the norms (dense.norm
# computes float64 inputs in float64). A defect (a missing reduction, a wrong scale) is off by the quantity itself.
FACTOR = 16.0
# the floor, in ulps of the largest element: where world 1's own fp32 error happens to be small (one sample), a
# cancelling sum in another order still differs by about sqrt(terms) ulps of its partial sums, which exceed the
# result (GPT-OSS's router bias gradient at tp2, once the routing probs moved into the experts' activation:
# 8.6 ulps of its largest element, against world 1's 0.36); a defect is off by the element itself (2**23 ulps)
ULPS = 16.0


def fp32_noise(ref32: torch.Tensor, ref64: torch.Tensor) -> float:
    """fp32's rounding error of one quantity: its largest element-wise distance from the float64 value."""
    return (ref32.double() - ref64).abs().max().item()


def bound(ref32: torch.Tensor, ref64: torch.Tensor) -> float:
    """How far another fp32 evaluation of ``ref32`` (another summation order) may be, element-wise at most."""
    scale = ref64.abs().max().item()
    return max(FACTOR * fp32_noise(ref32, ref64), ULPS * EPS32 * scale)


def assert_within_fp32_noise(got: dict[str, torch.Tensor], ref32: dict[str, torch.Tensor],
                             ref64: dict[str, torch.Tensor], what: str) -> float:
    """Every tensor of ``got`` within ``bound`` of ``ref32``; returns the largest difference (for reports)."""
    assert sorted(got) == sorted(ref32), (what, sorted(set(got) ^ set(ref32)))
    worst = 0.0
    for name, g in got.items():
        err = (g.double() - ref32[name].double()).abs().max().item()
        limit = bound(ref32[name], ref64[name])
        assert err <= limit, (f"{what} {name}: |diff| {err:.3g} > {limit:.3g} ({FACTOR:g} x fp32's own error "
                              f"{fp32_noise(ref32[name], ref64[name]):.3g} against float64; largest element "
                              f"{ref64[name].abs().max().item():.3g})")
        worst = max(worst, err)
    return worst


def reference_steps(build: Callable[[], torch.nn.Module], batches: list[tuple[torch.Tensor, ...]],
                    ) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """World 1, one forward/backward per batch ``(ids, labels, loss_mask)``, each on its own: (fp32 losses, fp32
    gradients, float64 gradients of the same weights: the exact values that size each gradient's tolerance).
    ``build()`` returns the fp32 model (called once per dtype, so both start from the same weights)."""
    losses, grads, grads64 = [], [], []
    for dtype, out_grads in ((torch.float32, grads), (torch.float64, grads64)):
        model = build().to(dtype)
        for ids, labels, mask in batches:
            model.zero_grad()
            out = model(ids, labels, mask.to(dtype))
            out.loss.backward()
            if dtype == torch.float32:
                losses.append(out.loss.detach())
            out_grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return losses, grads, grads64

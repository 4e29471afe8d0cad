"""An FP8 reference for the tests, independent of moefold's code: torchao's cast written out with plain
torch ops, and the error bound of an FP8 GEMM derived from the formats.

Cast (torchao): ``scale = fp8_max / max(amax, 1e-12)`` in fp64 then fp32 (rowwise: rounded down to a power
of 2), ``q = saturate(t * scale)``, dequantised ``q * (1 / scale)``.

Bound: a value in the normal range is rounded to ``p`` significant bits (e4m3: 4, e5m2: 3), a relative
error of at most ``u = 2^-p`` (half an ulp); below it, the subnormal step ``s`` (e4m3 2^-9, e5m2 2^-16 in
the scaled domain) bounds the absolute error by ``s/2 * (1/scale)``. So each dequantised element obeys
``|dq(t) - t| <= D(t) = u |t| + s/2 * inv_scale``, and a GEMM of dequantised operands::

    |dq(a) dq(b) - a b| <= (|a| + Da) @ Db + Da @ |b|         (+ fp32 accumulation and output rounding)
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
UNIT_ROUNDOFF = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
SUBNORMAL_STEP = {E4M3: 2.0 ** -9, E5M2: 2.0 ** -16}
OUT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


def ref_cast(t: Tensor, dtype: torch.dtype, dims: tuple[int, ...] | None = None, pow2: bool = False,
             amax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """-> (dequantised fp32 values, fp32 inverse scale) of torchao's cast of ``t`` (scale over ``dims``;
    None: the whole tensor; or from the given ``amax``, broadcastable to ``t``)."""
    if amax is None:
        a = t.abs().float().amax() if dims is None else t.abs().float().amax(dim=dims, keepdim=True)
    else:
        a = amax.float()
    scale = (FP8_MAX[dtype] / a.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (t.float() * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    inv = scale.reciprocal()
    return q.float() * inv, inv


def cast_bound(t: Tensor, inv_scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Elementwise bound of ``|dq(t) - t|``."""
    return UNIT_ROUNDOFF[dtype] * t.abs().float() + 0.5 * SUBNORMAL_STEP[dtype] * inv_scale


def gemm_bound(a: Tensor, da: Tensor, b: Tensor, db: Tensor, y_hat: Tensor, out_dtype: torch.dtype) -> Tensor:
    """Elementwise bound of ``|y_hat - a @ b|`` for ``y_hat`` the GEMM of casts of ``a [M, K]``, ``b [K, N]``
    with element bounds ``da``, ``db``, computed in fp32 and rounded to ``out_dtype``."""
    a, b = a.float(), b.float()
    A, B = a.abs() + da, b.abs() + db
    accumulate = a.shape[1] * 2.0 ** -24 * (A @ B)
    return A @ db + da @ b.abs() + accumulate + OUT_ROUNDOFF[out_dtype] * y_hat.float().abs()


def fp32_gemm_bound(qa: Tensor, qb: Tensor, y: Tensor) -> Tensor:
    """Elementwise bound of the difference between two fp32 GEMMs of the same operands that sum in
    different orders (torch's CPU FP8 GEMM against ``qa @ qb``): accumulation and output rounding."""
    return qa.shape[1] * 2.0 ** -23 * (qa.abs() @ qb.abs()) + 2.0 ** -23 * y.abs()


class GemmRecorder:
    """Records the operands of every ``scaled_mm`` call of the given modules (installed with ``monkeypatch``),
    as dequantised fp32 matrices ``(a * inv_a, b * inv_b)``, and still runs the GEMM."""

    def __init__(self, monkeypatch, *modules) -> None:
        from moefold.precision.fp8_cast import scaled_mm

        self.calls: list[tuple[Tensor, Tensor]] = []

        def record(a, inv_a, b, inv_b, out_dtype, fast_accum=False):
            ia = inv_a.reshape(-1, 1) if inv_a.dim() else inv_a
            ib = inv_b.reshape(1, -1) if inv_b.dim() else inv_b
            self.calls.append((a.float() * ia, b.float() * ib))
            return scaled_mm(a, inv_a, b, inv_b, out_dtype, fast_accum)

        for module in modules:
            monkeypatch.setattr(module, "scaled_mm", record)


def check_gemm(call: tuple[Tensor, Tensor], qa: Tensor, qb: Tensor, got: Tensor) -> None:
    """The GEMM consumed exactly the reference's casts (bit for bit) and computed their product (to fp32
    summation order)."""
    assert torch.equal(call[0], qa) and torch.equal(call[1], qb), "the GEMM's operands are not the reference casts"
    want = qa @ qb
    assert ((got.float() - want).abs() <= fp32_gemm_bound(qa, qb, want)).all()


@functools.cache
def torchao_blockwise_references() -> SimpleNamespace:
    """torchao's own torch references for DeepSeek's blockwise FP8 (``torch_blockwise_scale_act_quant_lhs`` /
    ``_rhs`` and ``torch_blockwise_scale_weight_quant`` of ``torchao/prototype/blockwise_fp8_training/kernels.py``),
    taken from the installed torchao's source: that module imports triton at its top (absent on a CPU install), so
    the three pure-torch functions and the two constants they read (``EPS``, ``FP8_E4M3_DTYPES``) are compiled
    alone, unchanged."""
    spec = importlib.util.find_spec("torchao")
    path = Path(spec.origin).parent / "prototype" / "blockwise_fp8_training" / "kernels.py"
    tree = ast.parse(path.read_text())
    names = ("torch_blockwise_scale_act_quant_lhs", "torch_blockwise_scale_act_quant_rhs",
             "torch_blockwise_scale_weight_quant")
    keep = [node for node in tree.body
            if (isinstance(node, ast.FunctionDef) and node.name in names)
            or (isinstance(node, ast.Assign) and any(getattr(t, "id", None) in ("EPS", "FP8_E4M3_DTYPES")
                                                     for t in node.targets))]
    found = {n.name for n in keep if isinstance(n, ast.FunctionDef)}
    assert found == set(names), f"{path} no longer defines {set(names) - found}: torchao changed its references"
    namespace = {"torch": torch, "Tuple": tuple, "e4m3_dtype": E4M3}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), namespace)
    return SimpleNamespace(lhs=namespace[names[0]], rhs=namespace[names[1]], weight=namespace[names[2]])


def rel_err(x: Tensor, ref: Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


__all__ = ["E4M3", "E5M2", "GemmRecorder", "cast_bound", "check_gemm", "fp32_gemm_bound", "gemm_bound", "ref_cast",
           "rel_err", "torchao_blockwise_references"]

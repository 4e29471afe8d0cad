"""Mamba-2's optional GPU kernels: ``mamba_ssm``'s chunked SSD scan and ``causal_conv1d``'s convolution.

``MambaBackend``: ``torch`` (``dense.ssd_scan``, any device; the default) or ``mamba_ssm`` (CUDA only), chosen by
``--mamba-backend``. The packages (``pip install mamba-ssm causal-conv1d``) are imported lazily, when a layer
first runs them; asking for the backend without them fails at start-up in one line naming what to install.

Their real APIs (state-spaces/mamba ``mamba_ssm/ops/triton/ssd_combined.py``, Dao-AILab/causal-conv1d
``causal_conv1d_interface.py``)::

    mamba_chunk_scan_combined(x [b,s,h,p], dt [b,s,h], A [h], B [b,s,g,n], C [b,s,g,n], chunk_size, D=[h],
                              z=None, dt_bias=[h], dt_softplus=True, dt_limit=(lo, hi)) -> y [b,s,h,p]
    causal_conv1d_fn(x [b,c,s], weight [c,k], bias [c], activation="silu") -> [b,c,s]

``mamba_chunk_scan_combined`` applies ``softplus(dt + dt_bias)`` clamped to ``dt_limit`` itself and adds ``D x``
(the torch form's discretisation and skip, ``dense.mamba2``). ``check_kernel_inputs`` refuses what the kernels
refuse (``_mamba_chunk_scan_combined_fwd``'s asserts, causal_conv1d's CUDA checks: tensors on CUDA, widths 2 to
4, fp32 / fp16 / bf16), each in one line, before a kernel would fail with an assert.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from moefold.dense.choices import MambaBackend as MambaBackend

PACKAGES = "mamba-ssm and causal-conv1d"
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CONV_WIDTHS = (2, 3, 4)   # causal_conv1d's CUDA kernels are built for these widths only


def mamba_ssm_available() -> bool:
    return importlib.util.find_spec("mamba_ssm") is not None and importlib.util.find_spec("causal_conv1d") is not None


def require_mamba_ssm() -> None:
    """Raise (one line) unless both kernel packages can be imported."""
    if not mamba_ssm_available():
        raise ValueError(f"the 'mamba_ssm' Mamba-2 backend needs the {PACKAGES} packages (pip install mamba-ssm "
                         "causal-conv1d), or --mamba-backend torch")


def check_kernel_inputs(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, conv_weight: Tensor) -> None:
    """What the kernels refuse, in one line each: x [b,s,h,p], dt [b,s,h], A [h], B = C [b,s,g,n] with h divisible
    by g, a conv weight [c, 1, k] with k in ``CONV_WIDTHS``, every tensor on CUDA in a kernel dtype."""
    b, s, h, _ = x.shape
    if dt.shape != (b, s, h) or A.shape != (h,) or B.shape[:2] != (b, s) or C.shape != B.shape or h % B.shape[2]:
        raise ValueError(f"mamba_ssm scan: shapes x {list(x.shape)}, dt {list(dt.shape)}, A {list(A.shape)}, "
                         f"B {list(B.shape)}, C {list(C.shape)} do not fit x [b,s,h,p], dt [b,s,h], A [h], "
                         "B = C [b,s,g,n], h divisible by g")
    if conv_weight.shape[-1] not in CONV_WIDTHS:
        raise ValueError(f"causal_conv1d: conv_kernel={conv_weight.shape[-1]} is not supported (its CUDA kernels "
                         f"take widths {CONV_WIDTHS})")
    check_kernel_device(x, B, C, conv_weight)


def check_kernel_device(x: Tensor, B: Tensor, C: Tensor, conv_weight: Tensor) -> None:
    """The kernels' device and dtype: CUDA tensors in ``KERNEL_DTYPES``."""
    for name, t in (("x", x), ("B", B), ("C", C), ("conv weight", conv_weight)):
        if t.device.type != "cuda":
            raise ValueError(f"the 'mamba_ssm' Mamba-2 backend runs on CUDA tensors only, got {name} on {t.device}")
        if t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"the 'mamba_ssm' Mamba-2 backend takes {[str(d) for d in KERNEL_DTYPES]}, got "
                             f"{name} in {t.dtype}")


def kernel_conv(xbc_BSC: Tensor, weight_C1K: Tensor, bias_C: Tensor | None) -> Tensor:
    """``silu(causal depthwise conv)`` of ``[b, s, c]`` by causal_conv1d's kernel (channels-last input: the kernel
    takes either layout, so no copy)."""
    from causal_conv1d import causal_conv1d_fn

    return causal_conv1d_fn(xbc_BSC.transpose(1, 2), weight_C1K.squeeze(1), bias_C, activation="silu").transpose(1, 2)


def kernel_scan(x: Tensor, dt_raw: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor,
                dt_bias: Tensor, dt_limit: tuple[float, float]) -> Tensor:
    """y [b, s, h, p] of ``mamba_chunk_scan_combined`` from the raw ``dt`` (the kernel discretises it)."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    return mamba_chunk_scan_combined(x, dt_raw, A, B, C, chunk_size, D=D, z=None, dt_bias=dt_bias,
                                     dt_softplus=True, dt_limit=dt_limit)

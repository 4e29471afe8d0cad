"""Host synchronisations on a real GPU: the MoE layer's budget under ``torch.cuda.set_sync_debug_mode``.

``set_sync_debug_mode("error")`` makes every operation that synchronises the host with the device
raise (scalar reads, device<->host copies, data-dependent sizes): a forward + backward of the MoE
layer in bf16 with the local dispatcher, dropless or padded, must raise nothing. Where syncs are
expected (unpadded capacity mode: the kept count; fp32 experts: torch's grouped_mm fallback),
"warn" mode counts them and the count must equal what the CPU counter (``HostSyncCounter``, which
the CPU tests use) sees on the same run. Skipped without CUDA. In a rehearsal (tests/gpu/rehearsal.py) the
layer runs on the CPU and only the CPU counter's side is checked (CUDA's sync debug mode is CUDA-only), against
the same expected counts for a Hopper-class GPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from moefold.dispatch.config import DispatchConfig
from moefold.moe.build import build_moe_layer
from moefold.moe.config import ExpertsConfig, MoEConfig, SharedExpertsConfig
from moefold.moe.layer import MoELayer
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import init_parameters
from moefold.training.observe.host_sync import HostSyncCounter
from tests.gpu.rehearsal import REHEARSAL, capability

E, H, F = 8, 64, 64


def _layer(mode: str, dtype: torch.dtype, device: str) -> MoELayer:
    capacity = {} if mode == "dropless" else {"expert_capacity_factor": 1.0,
                                              "pad_expert_input_to_capacity": mode == "padded"}
    router = RouterConfig(num_experts=E, topk=2, aux_loss_coeff=0.01, z_loss_coeff=1e-3, **capacity)
    cfg = MoEConfig(num_experts=E, router=router, experts=ExpertsConfig(F), dispatch=DispatchConfig("local"),
                    shared=SharedExpertsConfig(F))
    layer = build_moe_layer(cfg, H, ParallelDims.single(device), sequence_parallel=False, dtype=dtype, device=device)
    init_parameters(layer, seed=0)
    return layer


def _step(layer: MoELayer, dtype: torch.dtype) -> None:
    x = torch.randn(64, 4, H, device=next(layer.parameters()).device, dtype=dtype, requires_grad=True)
    y, info = layer(x)
    (y.float().square().sum() + info.aux_loss).backward()


def _sync_warnings(fn) -> int | None:
    """CUDA's own count of host syncs in ``fn`` ("warn" mode); None in a rehearsal (no CUDA)."""
    if REHEARSAL:
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize()  # outside the count: flush the backward thread's warnings
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _grouped_kernel_device() -> bool:
    """torch's bf16 grouped_mm kernel exists on sm90/sm100 (Hopper, Blackwell); elsewhere it falls back."""
    return capability()[0] in (9, 10)


@pytest.mark.parametrize("mode", ["dropless", "padded"])
def test_moe_layer_never_synchronises(mode, device):
    if not _grouped_kernel_device():
        pytest.skip(f"no bf16 grouped_mm kernel on compute capability {capability()}")
    dtype = torch.bfloat16
    layer = _layer(mode, dtype, device)
    _step(layer, dtype)  # warm-up: lazy initialisation (cuBLAS handles, ...) is not per step
    if not REHEARSAL:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _step(layer, dtype)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    with HostSyncCounter() as syncs:
        _step(layer, dtype)
    assert syncs.total == 0, syncs.report()


@pytest.mark.parametrize(("mode", "dtype", "expected"), [("drop", torch.bfloat16, 1), ("dropless", torch.float32, 6)],
                         ids=["capacity-bf16", "dropless-fp32"])
def test_sync_count_equals_the_cpu_model(mode, dtype, expected, device):
    """Unpadded capacity mode reads the kept count once; fp32 experts take torch's grouped_mm fallback
    (offsets copied to the host in each of 6 calls). CUDA's count must equal the counter's model."""
    if not _grouped_kernel_device():
        pytest.skip(f"the counter models sm90/sm100 GPUs, this is {capability()}")
    layer = _layer(mode, dtype, device)
    _step(layer, dtype)
    if device == "cuda":
        torch.cuda.synchronize()
    n = _sync_warnings(lambda: _step(layer, dtype))
    with HostSyncCounter() as syncs:
        _step(layer, dtype)
    assert n in (None, syncs.total) and syncs.total == expected, \
        f"CUDA sync debug mode saw {n}, the counter {syncs.total}:\n{syncs.report()}"

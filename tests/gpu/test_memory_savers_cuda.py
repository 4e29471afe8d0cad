"""Issue 30's savers on a real GPU: activation offloading's side streams and optimizer offload's CPU update.

- Activation offloading (every module kind together) on CUDA, bf16: the loss and every gradient equal no
  offloading (the copies are exact); the forward + backward synchronises the host exactly as often as without
  offloading (``torch.cuda.set_sync_debug_mode("warn")`` counts: the copies run on the offloader's two side
  streams after events, into pinned memory, and nothing waits for them on the host); the device memory the
  forward leaves (``torch.cuda.memory_allocated``) falls by the planner's prediction within 10%.
- Optimizer offload (fraction 0.5 and 1): three trainer steps equal the on-device update to fp32 rounding (the
  CUDA and CPU fused AdamW kernels may round the last bit differently; the bound is derived in the test).

In a rehearsal (no GPU) the same code runs on the CPU, where the stream and sync checks skip.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from moefold.dense.activation_offload import OFFLOAD_MODULES
from moefold.execution import build_decoder
from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import named_full_params
from moefold.planner.profile import activation_memory
from moefold.training.config import RunConfig, TrainConfig
from moefold.training.trainer import Trainer
from tests.gpu.rehearsal import REHEARSAL, cuda_only, device_type


def _model(options: ModelOptions, device: str) -> MoEDecoder:
    config = get_recipe("deepseek_v3_tiny").with_(num_layers=3, hidden_size=256, vocab_size=256)
    with torch.device(device):
        model = build_decoder(config, ParallelDims.single(device), options)
    model.init_weights(3)
    return model


def _counting_syncs(fn):
    """(fn(), the host synchronisations CUDA reports while it runs; 0 off CUDA)."""
    if not torch.cuda.is_available():
        return fn(), 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sum("synchroniz" in str(w.message) for w in caught)


def test_activation_offloading_on_the_device() -> None:
    device = device_type()
    ids = torch.randint(0, 256, (1, 513), generator=torch.Generator().manual_seed(0)).to(device)
    results = {}
    for name, modules in (("plain", ()), ("offload", OFFLOAD_MODULES)):
        model = _model(ModelOptions(offload_modules=modules, min_offloaded_tensor_size=0, dtype="bf16"), device)
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
        left = {}

        def step():
            out = model(ids[:, :-1], ids[:, 1:])
            left["bytes"] = torch.cuda.memory_allocated() - base if device == "cuda" else 0
            out.loss.backward()
            return out.loss.detach()

        loss, syncs = _counting_syncs(step)
        results[name] = (loss.float().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()},
                         left["bytes"], model.offloader, syncs)
    (ref_loss, ref_grads, ref_left, _, ref_syncs) = results["plain"]
    (loss, grads, left, offloader, syncs) = results["offload"]
    assert syncs == ref_syncs
    assert torch.equal(loss, ref_loss)
    for n, g in grads.items():
        assert torch.equal(g, ref_grads[n]), n
    if REHEARSAL:
        cuda_only("side streams, sync debug mode and allocator statistics")
    assert offloader._d2h is not None and offloader._h2d is not None
    config = RunConfig(model=get_recipe("deepseek_v3_tiny").with_(num_layers=3, hidden_size=256, vocab_size=256),
                       options=ModelOptions(offload_modules=OFFLOAD_MODULES, min_offloaded_tensor_size=0,
                                            dtype="bf16"),
                       train=TrainConfig(micro_batch_size=1, global_batch_size=1, seq_length=512, train_iters=1,
                                         lr_warmup_iters=0, bf16=True))
    sizes, m = config.resolve(1)
    plain = RunConfig(model=config.model, options=ModelOptions(dtype="bf16"), train=config.train)
    planned = (activation_memory(plain, sizes, 0, m).per_microbatch[0]
               - activation_memory(config, sizes, 0, m).per_microbatch[0])
    assert planned == pytest.approx(ref_left - left, rel=0.10)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_optimizer_offload_on_the_device(fraction: float) -> None:
    """Three steps with the offloaded buckets updated by the CPU's AdamW equal three steps of the device's AdamW
    within the two kernels' rounding. The bound: each step's update of an element may differ by a few ulps of the
    parameter and of the update (at most lr), and the next steps' gradients follow those differences smoothly,
    so 32 ulps of (largest parameter + lr) per tensor over three steps. Smoothly only without routing flips: two
    experts, both chosen by every token (top-2 of 2), so the routing ids are fixed and only the probs move (on the
    H200 the 8-expert model's near ties routed some tokens elsewhere after the first step's last-bit difference,
    which no rounding bound covers)."""
    device = device_type()
    model = get_recipe("qwen3_moe_tiny").with_(num_layers=2, vocab_size=256, num_experts=2, moe_topk=2)
    data = torch.randint(0, 256, (12, 33), generator=torch.Generator().manual_seed(0))
    params = {}
    lr = 3e-3
    for offload in (False, True):
        train = TrainConfig(micro_batch_size=2, global_batch_size=4, seq_length=32, train_iters=3, lr=lr,
                            lr_warmup_iters=1, bucket_numel=2048, optimizer_cpu_offload=offload,
                            optimizer_offload_fraction=fraction)
        trainer = Trainer(RunConfig(model=model, train=train), ParallelDims.single(device), device=device,
                          log=lambda _m: None)
        for step in range(3):
            trainer.train_step([data[4 * step:4 * step + 2], data[4 * step + 2:4 * step + 4]])
        trainer.optimizer.finish_param_sync()
        params[offload] = named_full_params(trainer.model)
        trainer.optimizer.close()
    eps = torch.finfo(torch.float32).eps
    for n, v in params[True].items():
        ref = params[False][n]
        err, limit = (v - ref).abs().max().item(), 32 * eps * (ref.abs().max().item() + lr)
        assert err <= limit, f"{n}: the offloaded update is {err:.3g} off the device's, over {limit:.3g}"

"""The batch-level overlap and the split backward on CUDA (skipped without a GPU; rehearsed on the CPU).

- One GPU, bf16, the local dispatcher (dropless: no host sync of its own): the overlapped step (F0, FB(1, 0), ...,
  with --delay-wgrad-compute) gives the plain step's losses and gradients, and CUDA's own sync debug mode sees as
  many host synchronisations as in the plain step (the claim "no host waits added" on the real device: the
  exchanges are waited on with stream waits, not host waits).
- Two GPUs (NCCL, ep2, alltoall): the same equality, the all-to-all running on ProcessGroupNCCL's stream and
  waited on with ``Work.wait()`` (a stream wait); the syncs equal the plain step's (the dispatch's split sizes).
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moefold.dense.split_backward import WeightGradStore
from moefold.execution.split_backward import install_weight_grad_store
from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.pipeline.decoder_stage import DecoderStage
from moefold.pipeline.executor import run_schedule
from moefold.pipeline.overlap import OverlapConfig
from moefold.pipeline.p2p import TensorSpec
from moefold.pipeline.schedules import build_schedule
from moefold.pipeline.stages import StageLayout
from tests.gpu.rehearsal import REHEARSAL

M, S, B = 3, 64, 2


def _step(dims: ParallelDims, device: str, overlap: bool) -> tuple[list[float], dict[str, torch.Tensor], int | None]:
    config = get_recipe("qwen3_moe_tiny").with_(num_layers=2, vocab_size=256, hidden_size=64)
    torch.manual_seed(0)
    with torch.device(device):
        model = MoEDecoder(config, dims, ModelOptions(dtype="bf16"))
    model.init_weights(3)
    store = WeightGradStore() if overlap else None
    if overlap:
        install_weight_grad_store(model, store)
    stage = DecoderStage(model, StageLayout(2), 0, OverlapConfig(True, store) if overlap else None)
    gen = torch.Generator().manual_seed(1 + dims.rank)
    ids = torch.randint(0, 256, (M, B, S), generator=gen).to(device)
    mbs = [{"index": i, "input_ids": ids[i], "labels": torch.roll(ids[i], -1, 1)} for i in range(M)]
    spec = TensorSpec((S, B, config.hidden_size), torch.bfloat16, device)

    def run():
        return run_schedule(stage, build_schedule("1f1b", 1, M, overlap=overlap), mbs, stage.loss_fn, None, spec,
                            weight_store=store)

    syncs = None
    if REHEARSAL or device == "cpu":
        result = run()
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = run()
                torch.cuda.synchronize()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return [float(x) for x in result.losses], grads, syncs


def _compare(plain, overlapped) -> None:
    (pl, pg, ps), (ol, og, os_) = plain, overlapped
    assert ol == pytest.approx(pl, abs=2e-2)
    assert sorted(og) == sorted(pg)
    for n, g in pg.items():
        scale = max(float(g.abs().max()), 1e-6)
        assert float((og[n] - g).abs().max()) <= 3e-2 * scale, n
    assert os_ == ps, f"host synchronisations: overlap {os_}, plain {ps}"


def test_overlap_on_one_gpu_equals_plain_and_adds_no_host_sync(device):
    dims = ParallelDims.single(torch.device(device).type)
    _compare(_step(dims, device, False), _step(dims, device, True))


def _ep2_rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    try:
        dims = ParallelDims.build(ParallelConfig(ep=2), device_type="cuda")
        plain, overlapped = _step(dims, "cuda", False), _step(dims, "cuda", True)
        _compare(plain, overlapped)
        results.put((rank, "ok"))
    except BaseException as exc:   # the parent reports it
        results.put((rank, repr(exc)))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(REHEARSAL or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_overlap_at_ep2_on_two_gpus_equals_plain():
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_ep2_rank, args=(29600 + os.getpid() % 1000, results), nprocs=2, start_method="spawn")
    outcomes = dict(results.get() for _ in range(2))
    assert outcomes == {0: "ok", 1: "ok"}, outcomes

"""Megatron-Core 0.16.1 on a CPU, for the tests that compare moefold with Megatron's own code.

``megatron-core==0.16.1`` (the test extra) is a CUDA library; on a CPU-only torch a handful of its calls fail.
``patch_for_cpu()`` replaces exactly those, nothing that computes a value:

- ``torch.cuda.current_device`` -> ``"cpu"`` (parameters, buffers and RNG trackers ask for the CUDA device);
- ``torch.cuda.synchronize`` -> no-op (``dist_checkpointing``'s save preloads tensors "to the host");
- ``CudaRNGStatesTracker.fork`` -> a null context (forks CUDA RNG states: dropout draws from the CPU generator);
- ``moe_utils.te_general_gemm = None`` (0.16.1 reads the name without Transformer Engine: a NameError);
- ``dist_checkpointing``'s writer runs its write buckets in the calling process, one after the other (it forks a
  writer process per bucket and collects results through a spawned multiprocessing manager: neither can
  start inside the daemonic ranks of ``run_distributed``); the bytes written are the same;
- the sliding-window mask of Megatron's own softmax (``--window-size``) is made with ``torch.ones(...,
  device='cuda')``: made on the CPU instead (the same mask).

``megatron_optimizer_on_cpu()`` is a context for building Megatron-Core's optimizers: their constructors make
their loss-scale and overflow scalars with ``device='cuda'``; inside it ``torch.tensor`` makes a ``device='cuda'``
tensor on the CPU (nothing else changes; the optimizer's arithmetic is torch's Adam).

``init_megatron(tp, ep, ...)`` initialises ``parallel_state`` over an existing gloo world (the ranks of
``tests.distributed.run_distributed``). Nothing here is imported by moefold.
"""

from __future__ import annotations

import contextlib
import queue
import warnings

import pytest
import torch

MEGATRON_VERSION = "0.16.1"


def require_megatron() -> None:
    """Skip unless megatron-core 0.16.1 is installed (it is in the test extra)."""
    mcore = pytest.importorskip("megatron.core")
    version = getattr(mcore, "__version__", None)
    if version is None:
        from megatron.core import package_info

        version = package_info.__version__
    if version != MEGATRON_VERSION:
        pytest.skip(f"these tests compare with megatron-core {MEGATRON_VERSION}, installed: {version}")


def patch_for_cpu() -> None:
    """Apply the CPU patches of the module docstring (idempotent)."""
    warnings.filterwarnings("ignore", module="megatron")
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._get_write_results_queue = queue.Queue
    from megatron.core.fusions import fused_softmax

    if not hasattr(fused_softmax.get_sliding_window_causal_mask, "on_cpu"):
        fused_softmax.get_sliding_window_causal_mask = _window_mask_on_cpu(fused_softmax.get_sliding_window_causal_mask)
        fused_softmax.get_sliding_window_causal_mask.on_cpu = True
    filesystem_async.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(_write_in_process)


def _write_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """``FileSystemWriterAsync.write_preloaded_data_multiproc`` without processes (same results protocol)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results, count = queue.Queue(), queue.Queue()
    out: dict | Exception = {}
    for i, bucket in enumerate(write_buckets):
        count.put(i)
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, results, count, True)
        idx, value = results.get()
        if isinstance(value, Exception):
            out = value
            break
        out[idx] = value
    global_results_queue.put(out)


@contextlib.contextmanager
def _cuda_made_on_cpu(*names: str):
    """``torch.<name>(..., device='cuda')`` makes its tensor on the CPU while inside (nothing else changes)."""
    saved = {n: getattr(torch, n) for n in names}

    def on_cpu(make):
        def made(*args, device=None, **kwargs):
            return make(*args, device="cpu" if device == "cuda" else device, **kwargs)
        return made
    for name, make in saved.items():
        setattr(torch, name, on_cpu(make))
    try:
        yield
    finally:
        for name, make in saved.items():
            setattr(torch, name, make)


def megatron_optimizer_on_cpu():
    """``torch.tensor(..., device='cuda')`` on the CPU while Megatron-Core's optimizer is built (module docstring)."""
    return _cuda_made_on_cpu("tensor")


def _window_mask_on_cpu(make):
    def mask(*args, **kwargs):
        with _cuda_made_on_cpu("ones"):
            return make(*args, **kwargs)
    return mask


def init_megatron(tp: int = 1, ep: int = 1, pp: int = 1, etp: int | None = None) -> None:
    """``parallel_state.initialize_model_parallel`` over the current gloo world (CPU patches applied first)."""
    patch_for_cpu()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


class StandInTokenizer:
    """What Megatron's dataset classes read from a tokenizer: vocab size, EOD, no pad (unique_identifiers is
    hashed into their cache keys)."""

    def __init__(self, vocab_size: int, eod: int = 0) -> None:
        self.vocab_size, self.eod, self.eos = vocab_size, eod, eod
        self.unique_identifiers = {"class": "StandInTokenizer", "vocab_size": vocab_size}

    @property
    def pad(self) -> int:
        raise AttributeError("no pad token")


def causal_mask(seq_len: int) -> torch.Tensor:
    """Megatron's attention mask convention: True = masked out, [1, 1, S, S]."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]

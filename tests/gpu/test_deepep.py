"""The flex dispatcher with the real ``deep_ep``: DeepEP V2's ``ElasticBuffer`` and the legacy ``Buffer`` API.

- one GPU: DeepEP's own buffer-size hints as moefold sizes its one buffer per group (legacy), and the refusal of a
  one-rank group;
- >= 2 GPUs with NVLink, per backend (``deepep``: DeepEP 2.x only; ``deepep-legacy``: DeepEP v1.2.1 or 2.x): flex
  equals the alltoall dispatcher (values and gradients, bf16), with the buffer shared by two dispatchers
  (layers); on V2 also with FP8 dispatch and ``expert_alignment`` 16, and the sync-free dispatch runs under
  CUDA's sync debug mode set to "error" (the synchronisations torch makes raise; DeepEP's own C++ makes none on
  its ``do_cpu_sync=False`` path, which no CPU tool can see).

Skipped without ``deep_ep`` (not on PyPI: built from source, see docs/gpus.md, "On GPUs"). Run it in a pytest process of
its own (the GPU check does): its ranks are forked, which needs a parent that has not initialised CUDA. In a
rehearsal (tests/gpu/rehearsal.py) ``deep_ep`` is the CPU stand-in of DeepEP 2.x (both APIs:
tests/dispatch/deepep_elastic_standin.py and deepep_standin.py: DeepEP's signatures, plain arithmetic over gloo)
and the two ranks run on the CPU.
"""

import pytest
import torch

from tests.dispatch.common import expert_weights, make_case, make_routing, run_experts
from tests.distributed import run_distributed
from tests.gpu.rehearsal import REHEARSAL, gpu_library

EP = 2
E = 8
H = 32   # DeepEP V2: rows of a multiple of 32 bytes (e4m3 with FP8 dispatch)


@pytest.fixture
def deep_ep(monkeypatch):
    gpu_library("deep_ep", monkeypatch)
    return pytest.importorskip("deep_ep", reason="the flex dispatcher needs DeepEP (docs/gpus.md: On GPUs)")


def _dispatchers(backend: str, group, fp8: bool, alignment: int):
    from moefold.dispatch import FlexBackend, FlexOptions
    from moefold.dispatch.deepep import DeepEPBuffers, FlexDispatcher
    from moefold.dispatch.deepep_elastic import ElasticBuffers, ElasticFlexDispatcher

    if backend == "deepep-legacy":
        buffers = DeepEPBuffers()
        return buffers, [FlexDispatcher(E, group, buffers=buffers) for _ in range(2)]
    buffers = ElasticBuffers()
    options = FlexOptions(FlexBackend.DEEPEP, max_tokens_per_rank=64)
    return buffers, [ElasticFlexDispatcher(E, group, options=options, hidden_size=H, fp8=fp8,
                                           expert_alignment=alignment, buffers=buffers) for _ in range(2)]


def _compare(backend: str, mode: str, fp8: bool, alignment: int, device_type: str):
    import torch.distributed as dist

    from moefold.dispatch import AllToAllDispatcher

    rank = dist.get_rank()
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dev = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    # NCCL bound to the GPU as moefold's launchers bind it (parallel.init.init_process_group_on: device_id): its
    # communicator is formed at once; ElasticBuffers forms it anyway before DeepEP V2 reuses it (dispatch.deepep_nccl)
    group = dist.new_group(list(range(EP)), backend="nccl", device_id=dev) if device_type == "cuda" else \
        dist.new_group(list(range(EP)), backend="gloo")
    tokens = [64, 48]
    x_all, ids_all, probs_all = make_case("random", tokens, E, seed=1, hidden=H)
    off = sum(tokens[:rank])
    sl = slice(off, off + tokens[rank])
    w1, w2 = (w.to(dev) for w in expert_weights(E, hidden=H))
    base = make_routing(probs_all[sl], ids_all[sl], E, mode, capacity=8)
    results = {}
    buffers, flex = _dispatchers(backend, group, fp8, alignment)
    if backend == "deepep":   # made before the sync-debug region: creating a buffer synchronises (collective)
        buffers.get(flex[0]._deep_ep, flex[0].group, flex[0].layout(base.topk), dev)
    errors: list[str] = []
    for name, d in (("alltoall", AllToAllDispatcher(E, group, fp8=fp8)), ("flex", flex[0]), ("flex2", flex[1])):
        x = x_all[sl].to(dev, torch.bfloat16).requires_grad_()
        p = base.probs_TK.to(dev).requires_grad_()
        routing = type(base)(p, base.expert_ids_TK.to(dev), base.tokens_per_expert_E.to(dev),
                             None if base.keep_TK is None else base.keep_TK.to(dev), base.capacity,
                             base.pad_to_capacity)
        if device_type == "cuda" and name != "alltoall" and backend == "deepep":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")   # sync-free: any host synchronisation raises
        try:
            out = d.dispatch(x, routing)
        finally:
            if device_type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        per = out.tokens_per_expert_e.tolist()
        n = sum(per)
        rows = run_experts(out.tokens_NH[:n].float(), per, d.local_expert_offset, w1, w2,
                           probs_N=out.probs_N[:n].float())   # the probs weight the rows inside the experts
        rows = torch.cat([rows, rows.new_zeros(out.tokens_NH.shape[0] - n, H)])   # rows past the blocks: unread
        y = d.combine(rows.to(torch.bfloat16), out.handle)
        y.float().square().sum().backward()
        results[name] = (y.float().cpu(), x.grad.float().cpu(), p.grad.cpu())
    if buffers.created != 1:
        errors.append(f"{buffers.created} DeepEP buffers for two layers, expected 1")
    buffers.destroy()   # collective, before the process group goes (DeepEP: explicitly_destroy=True)
    for other in ("flex", "flex2"):
        for i, what in enumerate(("y", "grad x", "grad probs")):
            a, b = results["alltoall"][i], results[other][i]
            if not torch.allclose(a, b, atol=3e-2, rtol=3e-2):
                errors.append(f"{backend} {other} {mode} fp8={fp8} align={alignment} {what}: max err "
                              f"{(a - b).abs().max()}")
    return errors


def test_buffer_hints_from_the_library(deep_ep):
    from moefold.dispatch.deepep import buffer_sizes

    for n in (2, 4, 8):
        nvl, rdma = buffer_sizes(deep_ep.Buffer, n, 7168 * 2)
        assert nvl > 0 and rdma == 0, (n, nvl, rdma)  # one NVLink domain: no RDMA buffer


def test_one_rank_is_refused(deep_ep):
    from moefold.dispatch import DispatchConfig, DispatcherKind, FlexOptions, build_dispatcher

    for backend in ("deepep-legacy", *(("deepep",) if hasattr(deep_ep, "ElasticBuffer") else ())):
        with pytest.raises(ValueError, match="use 'local'"):
            build_dispatcher(DispatchConfig(DispatcherKind.FLEX, FlexOptions(backend, max_tokens_per_rank=8)), E,
                             hidden_size=H)


CASES = [("deepep-legacy", mode, False, 1) for mode in ("dropless", "drop", "padded")] + [
    ("deepep", mode, False, 1) for mode in ("dropless", "drop", "padded")] + [
    ("deepep", "dropless", True, 16), ("deepep", "drop", False, 16)]


@pytest.mark.parametrize("backend, mode, fp8, alignment", CASES)
def test_flex_matches_alltoall(backend, mode, fp8, alignment, deep_ep, device):
    if backend == "deepep" and not hasattr(deep_ep, "ElasticBuffer"):
        pytest.skip(f"DeepEP {getattr(deep_ep, '__version__', '1.x')} has no ElasticBuffer (V2)")
    if not REHEARSAL and torch.cuda.device_count() < EP:
        pytest.skip(f"needs {EP} GPUs, this machine has {torch.cuda.device_count()}")
    errors = [e for per_rank in run_distributed(_compare, EP, backend, mode, fp8, alignment, device, timeout=300)
              for e in per_rank]
    assert not errors, "\n".join(errors)

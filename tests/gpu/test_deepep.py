"""The flex (DeepEP) dispatcher with the real ``deep_ep`` (DeepEP v1.2.1's Buffer API).

- one GPU: DeepEP's own buffer-size hints, as moefold sizes its one buffer per group, and the
  refusal of a one-rank group (DeepEP's kernels are built for 2, 4, 8 or multiples of 8 ranks);
- >= 2 GPUs with NVLink: flex equals the alltoall dispatcher (values and gradients, bf16), with
  the buffer shared by two dispatchers (layers).

Skipped without ``deep_ep`` (not on PyPI: built from source, see README "On GPUs"). Run it in a
pytest process of its own (the GPU check does): its ranks are forked, which needs a parent that
has not initialised CUDA. In a rehearsal (tests/gpu/rehearsal.py) ``deep_ep`` is the CPU stand-in
(tests/dispatch/deepep_standin.py: DeepEP's signatures, plain arithmetic over gloo) and the two
ranks run on the CPU.
"""

import pytest
import torch

from tests.dispatch.common import H, expert_weights, make_case, make_routing, run_experts
from tests.distributed import run_distributed
from tests.gpu.rehearsal import REHEARSAL, gpu_library

EP = 2
E = 8


@pytest.fixture
def deep_ep(monkeypatch):
    gpu_library("deep_ep", monkeypatch)
    return pytest.importorskip("deep_ep", reason="the flex dispatcher needs DeepEP v1.2.1 (README: On GPUs)")


def _compare(mode: str, device_type: str):
    import torch.distributed as dist

    from moefold.dispatch import AllToAllDispatcher
    from moefold.dispatch.deepep import DeepEPBuffers, FlexDispatcher

    rank = dist.get_rank()
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dev = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    group = dist.new_group(list(range(EP)), backend="nccl" if device_type == "cuda" else "gloo")
    tokens = [64, 48]
    x_all, ids_all, probs_all = make_case("random", tokens, E, seed=1)
    off = sum(tokens[:rank])
    sl = slice(off, off + tokens[rank])
    w1, w2 = (w.to(dev) for w in expert_weights(E))
    base = make_routing(probs_all[sl], ids_all[sl], E, mode, capacity=8)
    results = {}
    buffers = DeepEPBuffers()
    flex = [FlexDispatcher(E, group, buffers=buffers) for _ in range(2)]
    for name, d in (("alltoall", AllToAllDispatcher(E, group)), ("flex", flex[0]), ("flex2", flex[1])):
        x = x_all[sl].to(dev, torch.bfloat16).requires_grad_()
        p = base.probs_TK.to(dev).requires_grad_()
        routing = type(base)(p, base.expert_ids_TK.to(dev), base.tokens_per_expert_E.to(dev),
                             None if base.keep_TK is None else base.keep_TK.to(dev), base.capacity,
                             base.pad_to_capacity)
        out = d.dispatch(x, routing)
        per = out.tokens_per_expert_e.tolist()
        y = d.combine(run_experts(out.tokens_NH.float(), per, d.local_expert_offset, w1, w2)
                      .to(torch.bfloat16), out.handle)
        y.float().square().sum().backward()
        results[name] = (y.float().cpu(), x.grad.float().cpu(), p.grad.cpu())
    errors = [] if buffers.created == 1 else [f"{buffers.created} DeepEP buffers for two layers, expected 1"]
    buffers.destroy()   # collective, before the process group goes (DeepEP: explicitly_destroy=True)
    for other in ("flex", "flex2"):
        for i, what in enumerate(("y", "grad x", "grad probs")):
            a, b = results["alltoall"][i], results[other][i]
            if not torch.allclose(a, b, atol=3e-2, rtol=3e-2):
                errors.append(f"{other} {mode} {what}: max err {(a - b).abs().max()}")
    return errors


def test_buffer_hints_from_the_library(deep_ep):
    from moefold.dispatch.deepep import buffer_sizes

    for n in (2, 4, 8):
        nvl, rdma = buffer_sizes(deep_ep.Buffer, n, 7168 * 2)
        assert nvl > 0 and rdma == 0, (n, nvl, rdma)  # one NVLink domain: no RDMA buffer


def test_one_rank_is_refused(deep_ep):
    from moefold.dispatch import build_dispatcher

    with pytest.raises(ValueError, match="use 'local'"):
        build_dispatcher("flex", E)


@pytest.mark.parametrize("mode", ["dropless", "drop", "padded"])
def test_flex_matches_alltoall(mode, deep_ep, device):
    if not REHEARSAL and torch.cuda.device_count() < EP:
        pytest.skip(f"needs {EP} GPUs, this machine has {torch.cuda.device_count()}")
    assert H % 8 == 0
    errors = [e for per_rank in run_distributed(_compare, EP, mode, device, timeout=300) for e in per_rank]
    assert not errors, "\n".join(errors)

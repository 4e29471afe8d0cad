"""The flex (DeepEP) dispatcher against a stand-in ``deep_ep`` built from DeepEP v1.2.1's signatures.

These tests check the *protocol* moefold follows, not DeepEP's numerics: argument names and
return arities (the stand-in has the real signatures), one buffer per group shared by every
layer and sized from DeepEP's hints, the asynchronous calls (``previous_event``,
``async_finish``, ``allocate_on_comm_stream``) and the dispatch's ``wait()`` consuming the
event, plus the routing logic on top of DeepEP's documented semantics (local ids, etp virtual
experts, padding) through round trips against the single-process reference in bf16 (DeepEP
moves bf16 only). The real library runs in tests/gpu/test_deepep.py.
"""

from __future__ import annotations

import sys

import pytest
import torch

from moefold.dispatch.deepep import DeepEPBuffers, FlexDispatcher, buffer_sizes
from tests.dispatch import deepep_standin
from tests.dispatch.common import H, expert_weights, make_case, make_routing, reference, run_experts
from tests.distributed import run_distributed

E = 8
TOKENS = [5, 0, 7, 3]  # per rank; rank 1 has none
CAPACITY = 2


def test_buffer_size_is_the_larger_hint_of_dispatch_and_combine():
    Buffer = deepep_standin.module().Buffer
    hidden_bytes = 7168 * 2
    for n in (2, 4, 8, 16, 32):
        nvl, rdma = buffer_sizes(Buffer, n, hidden_bytes)
        hints = [(c.get_nvl_buffer_size_hint(hidden_bytes, n), c.get_rdma_buffer_size_hint(hidden_bytes, n))
                 for c in (Buffer.get_dispatch_config(n), Buffer.get_combine_config(n))]
        assert nvl == max(h[0] for h in hints) > 0
        assert rdma == max(h[1] for h in hints)
        assert (rdma > 0) == (n > deepep_standin.NUM_MAX_NVL_PEERS), "RDMA bytes exactly when the group spans nodes"


def test_flex_refuses_what_deepep_cannot_run(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", deepep_standin.module())
    with pytest.raises(ValueError, match="ep=1 etp=1; use 'local'"):
        FlexDispatcher(E)
    from moefold.dispatch.config import DispatchConfig, FlexOptions
    from moefold.moe.config import ExpertsConfig, MoEConfig
    from moefold.moe.router_config import RouterConfig

    with pytest.raises(ValueError, match="deepep_num_sms=3 must be an even"):
        MoEConfig(num_experts=E, router=RouterConfig(num_experts=E), experts=ExpertsConfig(8),
                  dispatch=DispatchConfig("flex", FlexOptions(num_sms=3)))


def _flex_world(layouts):
    """One spawned world: every layout, mode and case; returns failures (empty when all is well)."""
    import torch.distributed as dist

    from moefold.dispatch import DispatchConfig, DispatcherKind, FlexOptions, build_dispatcher
    from moefold.parallel import ParallelConfig, ParallelDims
    from moefold.training.observe.host_sync import HostSyncCounter

    standin = deepep_standin.module()
    sys.modules["deep_ep"] = standin
    Buffer = standin.Buffer
    rank = dist.get_rank()
    off = sum(TOKENS[:rank])
    mine = slice(off, off + TOKENS[rank])
    w1, w2 = expert_weights(E)
    failures: list[str] = []
    counter = HostSyncCounter()
    deepep_standin.HOST_WORK = counter.paused  # DeepEP's bookkeeping is C++; its host wait for the counts is counted

    for ep, etp in layouts:
        dims = ParallelDims.build(ParallelConfig(ep=ep, etp=etp))
        buffers = DeepEPBuffers()
        # three MoE layers' dispatchers: one buffer for the group, made at the first dispatch
        flex = DispatchConfig(DispatcherKind.FLEX, FlexOptions(num_sms=24))
        layers = [build_dispatcher(flex, E, dims, buffers=buffers) for _ in range(3)]
        made_before = len(Buffer.instances)
        for case in ("random", "one_expert", "topk_all"):
            for mode in ("dropless", "drop", "padded"):
                tag = f"flex ep{ep} etp{etp} {case} {mode}"
                x, ids, probs = make_case(case, TOKENS, E)
                x = x.to(torch.bfloat16).float()  # what DeepEP moves
                routings = [make_routing(probs[sum(TOKENS[:r]):sum(TOKENS[:r + 1])],
                                         ids[sum(TOKENS[:r]):sum(TOKENS[:r + 1])], E, mode, CAPACITY)
                            for r in range(len(TOKENS))]
                keep = None if mode == "dropless" else torch.cat([r.keep_TK for r in routings])
                g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
                xr, pr = x.clone().requires_grad_(), probs.clone().requires_grad_()
                (reference(xr, pr, ids, keep, w1, w2) * g).sum().backward()
                y_ref = reference(x, probs, ids, keep, w1, w2)
                for layer, d in enumerate(layers):
                    x_l = x[mine].to(torch.bfloat16).requires_grad_()
                    p_l = probs[mine].clone().requires_grad_()
                    r = routings[rank]
                    routing = type(r)(p_l, r.expert_ids_TK, r.tokens_per_expert_E, r.keep_TK, r.capacity,
                                      r.pad_to_capacity)
                    Buffer.calls.clear()
                    counter.reset()
                    with counter:
                        pending = d.dispatch_start(x_l, routing)
                        events = [c[1]["previous_event"] for c in Buffer.calls]
                        dispatch_event = Buffer.events[-1]  # DeepEP's dispatch event, to be consumed by wait()
                        in_flight = dispatch_event.event.waits == 0  # the shared experts would run now
                        out = pending.wait()
                        waits = dispatch_event.event.waits
                        pending.wait()  # a second wait() must not wait again
                        with counter.paused():  # the test's own read
                            per = out.tokens_per_expert_e.tolist()
                        expert_out = run_experts(out.tokens_NH.float(), per, d.local_expert_offset, w1, w2, etp,
                                                 dims.etp_rank, probs_N=out.probs_N)
                        y = d.combine(expert_out.to(torch.bfloat16), out.handle)
                        (y.float() * g[mine]).sum().backward()
                    if not in_flight or waits != 1 or dispatch_event.event.waits != 1:
                        failures.append(f"{tag}: event waited {waits} times by wait(), in flight before: {in_flight}")
                    calls = [(name, kw["async_finish"], kw["allocate_on_comm_stream"], kw["previous_event"] is None)
                             for name, kw in Buffer.calls]
                    want = [("get_dispatch_layout", True, True, False), ("dispatch", True, True, False),
                            ("combine", True, True, False), ("dispatch", True, True, False),  # combine's backward
                            ("combine", True, True, False)]  # dispatch's backward
                    if calls != want:
                        failures.append(f"{tag}: DeepEP calls {calls}, expected {want}")
                    if len(events) < 2 or events[1] is events[0]:
                        failures.append(f"{tag}: dispatch must wait on the layout's event, not the captured one")
                    # one: DeepEP's own wait for the received counts (the stand-in reads them once, counted);
                    # moefold adds none
                    if counter.total != 1 or set(counter.counts) != {next(iter(counter.counts), None)}:
                        failures.append(f"{tag}: host syncs {counter.report()}, expected DeepEP's one")
                    if out.tokens_per_expert_host is None or list(out.tokens_per_expert_host) != per:
                        failures.append(f"{tag}: host counts {out.tokens_per_expert_host} vs {per}")
                    if mode == "padded" and per != [CAPACITY * ep * etp] * (E // ep):
                        failures.append(f"{tag}: padded tokens_per_expert {per}")
                    for name, got, want_t in (("y", y.float(), y_ref[mine]), ("grad x", x_l.grad.float(),
                                              xr.grad[mine]), ("grad probs", p_l.grad, pr.grad[mine])):
                        scale = max(1.0, float(want_t.abs().max())) if want_t.numel() else 1.0
                        if got.shape != want_t.shape or not torch.allclose(got, want_t, atol=3e-2 * scale, rtol=0):
                            err = (got - want_t).abs().max() if got.shape == want_t.shape else got.shape
                            failures.append(f"{tag} layer {layer}: {name} differs (max err {err})")
        made = len(Buffer.instances) - made_before
        if made != 1 or buffers.created != 1:
            failures.append(f"ep{ep} etp{etp}: {made} DeepEP buffers for 3 layers, expected 1 per group")
        b = Buffer.instances[-1]
        n = ep * etp
        if (b.num_nvl_bytes, b.num_rdma_bytes) != buffer_sizes(Buffer, n, H * 2) or b.group_size != n:
            failures.append(f"ep{ep} etp{etp}: buffer of {b.num_nvl_bytes}/{b.num_rdma_bytes} bytes over "
                            f"{b.group_size} ranks, expected the hints {buffer_sizes(Buffer, n, H * 2)} over {n}")
        if Buffer.num_sms != 24:
            failures.append(f"Buffer.set_num_sms not applied: {Buffer.num_sms}")
        # created with explicitly_destroy=True and destroyed (collectively) by the owner, not at interpreter exit
        if not b.explicitly_destroy or b.destroyed or buffers.destroy() != 1 or not b.destroyed:
            failures.append(f"ep{ep} etp{etp}: buffer explicitly_destroy={b.explicitly_destroy}, destroyed "
                            f"{b.destroyed}: expected created for an explicit destroy() and destroyed by it")
    return failures


def test_flex_roundtrip_and_deepep_protocol():
    results = run_distributed(_flex_world, 4, [(2, 1), (4, 1), (2, 2), (1, 4)], timeout=300)
    failures = sorted({f for per_rank in results for f in per_rank})
    assert not failures, "\n".join(failures)

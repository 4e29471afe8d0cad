"""The flex dispatcher on DeepEP V2 (``dispatch.deepep_elastic``) against the CPU stand-in of ``ElasticBuffer``.

What is checked (DeepEP's kernels run in tests/gpu/test_deepep.py): the protocol, on the stand-in that has V2's
signatures and rejects what V2 rejects (tests/dispatch/deepep_elastic_standin.py): one buffer per group shared by
every layer and sized by ``get_buffer_size_hint``, destroyed explicitly; ``num_sms`` from
``get_theoretical_num_sms``; the call sequence (sync-free expanded dispatch with zeroed padding and the received
counts, combine, the cached-handle dispatch and the combine of the backward); the dispatch left in flight until
the dispatch's ``wait()``; no host synchronisation without the CPU sync and exactly DeepEP's one with it; and
the routing arithmetic on top, by round trips against the single-process reference (values and gradients, in
bf16: DeepEP moves bf16) at ep2, ep4 and ep2 x etp2, in hybrid and direct mode, with FP8 dispatch and
``expert_alignment``. The stand-in fills the worst-case rows past the experts' blocks with NaN, so an expert or
combine that read them would fail the comparison. The MoE layer on top: tests/moe/test_moe_layer_flex.py.
"""

from __future__ import annotations

import sys

import torch

from moefold.dispatch.deepep_elastic import ElasticBuffers
from moefold.dispatch.fp8_exchange import dequantize_rows, quantize_rows
from tests.dispatch import deepep_elastic_standin
from tests.dispatch.common import expert_weights, make_case, make_routing, reference, run_experts
from tests.distributed import run_distributed

E, H = 8, 32            # H: DeepEP V2 takes rows of a multiple of 32 bytes (e4m3 with FP8 dispatch)
TOKENS = [5, 0, 7, 3]   # per rank; rank 1 has none
MAX_TOKENS = 8          # num_max_tokens_per_rank
CAPACITY = 2


def _experts(out, offset: int, w1, w2, etp: int, etp_rank: int) -> torch.Tensor:
    """The test's experts on the rows the blocks cover; NaN for the rows past them (never read)."""
    per = out.tokens_per_expert_e.tolist()
    n = sum(per)
    rows = out.tokens_NH.float()
    got = run_experts(rows[:n], per, offset, w1, w2, etp, etp_rank, probs_N=out.probs_N[:n])
    return torch.cat([got, torch.full((rows.shape[0] - n, H), float("nan"))]).to(torch.bfloat16)


def _reference(case: str, mode: str, fp8: bool, w1, w2):
    """(x, the routings of every rank, g, y, grad x, grad probs) of the single-process reference."""
    x, ids, probs = make_case(case, TOKENS, E, hidden=H)
    x = x.to(torch.bfloat16).float()
    routings = [make_routing(probs[sum(TOKENS[:r]):sum(TOKENS[:r + 1])], ids[sum(TOKENS[:r]):sum(TOKENS[:r + 1])],
                             E, mode, CAPACITY) for r in range(len(TOKENS))]
    keep = None if mode == "dropless" else torch.cat([r.keep_TK for r in routings])
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    x_ref = dequantize_rows(*quantize_rows(x), x.dtype) if fp8 else x   # what FP8 dispatch delivers
    xr, pr = x_ref.clone().requires_grad_(), probs.clone().requires_grad_()
    (reference(xr, pr, ids, keep, w1, w2) * g).sum().backward()
    return x, probs, routings, g, reference(x_ref, probs, ids, keep, w1, w2), xr.grad, pr.grad


def _case(d, dims, standin, counter, failures, tag, ref, w1, w2, *, fp8, alignment, cpu_sync):
    import torch.distributed as dist

    rank = dist.get_rank()
    off = sum(TOKENS[:rank])
    mine = slice(off, off + TOKENS[rank])
    x, probs, routings, g, y_ref, x_grad, p_grad = ref
    x_l = x[mine].to(torch.bfloat16).requires_grad_()
    p_l = probs[mine].clone().requires_grad_()
    r = routings[rank]
    routing = type(r)(p_l, r.expert_ids_TK, r.tokens_per_expert_E, r.keep_TK, r.capacity, r.pad_to_capacity)
    Buffer = standin.ElasticBuffer
    Buffer.calls.clear()
    counter.reset()
    events, real_dispatch = [], Buffer.dispatch

    def recording_dispatch(self, *args, **kwargs):   # DeepEP's EventOverlap of each dispatch call, in order
        out = real_dispatch(self, *args, **kwargs)
        events.append(out[-1])
        return out

    Buffer.dispatch = recording_dispatch
    with counter:
        pending = d.dispatch_start(x_l, routing)
        event = events[0]                     # the forward dispatch's, to be waited on by wait()
        in_flight = event.event.waits == 0    # the shared experts would run now
        out = pending.wait()
        pending.wait()                        # a second wait() waits no more
        with counter.paused():                # the test's own reads and experts
            expert_out = _experts(out, d.local_expert_offset, w1, w2, dims.etp, dims.etp_rank)
            per = out.tokens_per_expert_e.tolist()
            received = out.received_e.tolist()
            rows = out.tokens_NH.float()
        y = d.combine(expert_out, out.handle)
        (y.float() * g[mine]).sum().backward()
    Buffer.dispatch = real_dispatch
    if not in_flight or event.event.waits != 1:
        failures.append(f"{tag}: dispatch event waited {event.event.waits} times, in flight before wait: {in_flight}")
    want_syncs = 1 if cpu_sync else 0
    if counter.total != want_syncs:
        failures.append(f"{tag}: {counter.total} host syncs, expected {want_syncs}:\n{counter.report()}")
    calls = [(name, {k: kw[k] for k in ("cached", "do_cpu_sync", "do_expand", "do_zero_padding", "stats", "fp8")
                     if k in kw}, kw["with_weights"], kw["async_with_compute_stream"]) for name, kw in Buffer.calls]
    fwd = {"cached": False, "do_cpu_sync": cpu_sync, "do_expand": True, "do_zero_padding": True, "stats": True,
           "fp8": fp8}
    bwd = {"cached": True, "do_cpu_sync": False, "do_expand": True, "do_zero_padding": True, "stats": False,
           "fp8": False}
    want = [("dispatch", fwd, True, True), ("combine", {}, False, True),   # forward
            ("dispatch", bwd, False, True),                                # combine's backward: the cached handle
            ("combine", {}, True, True)]                                   # dispatch's backward, weights alongside
    if calls != want:
        failures.append(f"{tag}: DeepEP calls {calls}\n expected {want}")
    sms = {kw["num_sms"] for _, kw in Buffer.calls}
    buffer = Buffer.instances[-1]
    if sms != {buffer.get_theoretical_num_sms(E * dims.etp, routing.topk * dims.etp)}:
        failures.append(f"{tag}: num_sms {sms}, expected get_theoretical_num_sms")
    # the layout: aligned blocks, zero padding, the worst case allocated without the CPU sync, counts on the host
    # only with it, the received copies counted
    n = sum(per)
    starts = [sum(per[:j]) for j in range(len(per))]
    want_rows = n if cpu_sync else (d.ep * d.etp * MAX_TOKENS * min(routing.topk * d.etp, d.num_local_experts)
                                    + (alignment - 1) * d.num_local_experts + alignment - 1) // alignment * alignment
    if any(c % alignment for c in per) or rows.shape[0] != want_rows:
        failures.append(f"{tag}: blocks {per} (alignment {alignment}), {rows.shape[0]} rows, expected {want_rows}")
    for j, (s0, c) in enumerate(zip(starts, received)):
        if not torch.all(rows[s0 + c:s0 + per[j]] == 0):
            failures.append(f"{tag}: expert {j}'s padding rows are not zero")
    if (out.tokens_per_expert_host is not None) != cpu_sync or (cpu_sync and list(out.tokens_per_expert_host) != per):
        failures.append(f"{tag}: host counts {out.tokens_per_expert_host} (cpu_sync={cpu_sync}), blocks {per}")
    if not cpu_sync and rows.shape[0] > n and not torch.isnan(rows[n:]).all():
        failures.append(f"{tag}: the stand-in's rows past the blocks should be NaN (the test relies on it)")
    group = dist.get_process_group_ranks(dims.etp_ep_group)   # the ranks whose tokens this rank's experts get
    kept = torch.cat([r.expert_ids_TK[r.keep_TK] if r.keep_TK is not None else r.expert_ids_TK.reshape(-1)
                      for i, r in enumerate(routings) if i in group])
    local = [int((kept == d.local_expert_offset + j).sum()) for j in range(d.num_local_experts)]
    if received != local:
        failures.append(f"{tag}: received_e {received}, the kept copies of this rank's experts {local}")
    for name, got, want_t in (("y", y.float(), y_ref[mine]), ("grad x", x_l.grad.float(), x_grad[mine]),
                              ("grad probs", p_l.grad, p_grad[mine])):
        scale = max(1.0, float(want_t.abs().max())) if want_t.numel() else 1.0
        if got.shape != want_t.shape or not torch.allclose(got, want_t, atol=3e-2 * scale, rtol=0):
            err = (got - want_t).abs().max() if got.shape == want_t.shape else got.shape
            failures.append(f"{tag}: {name} differs (max err {err})")


def _world(layouts) -> list[str]:
    """One spawned world: every layout, mode and case; returns failures (empty when all is well)."""
    from moefold.dispatch import DispatchConfig, DispatcherKind, FlexBackend, FlexOptions, build_dispatcher
    from moefold.parallel import ParallelConfig, ParallelDims
    from moefold.training.observe.host_sync import HostSyncCounter

    standin = deepep_elastic_standin.module()
    sys.modules["deep_ep"] = standin
    Buffer = standin.ElasticBuffer
    w1, w2 = expert_weights(E, hidden=H)
    failures: list[str] = []
    refs: dict[tuple, tuple] = {}
    counter = HostSyncCounter()
    deepep_elastic_standin.HOST_WORK = counter.paused   # DeepEP's bookkeeping is C++; its host wait is counted
    for ep, etp, nvl, hybrid in layouts:
        deepep_elastic_standin.NUM_NVL_RANKS = nvl
        dims = ParallelDims.build(ParallelConfig(ep=ep, etp=etp))
        label = f"ep{ep} etp{etp} {'hybrid' if hybrid else 'direct'} nvl{nvl}"
        # topk_all (k = E) first: the buffer made for it holds every later variant's (one buffer for all)
        variants = [(case, mode, False, 1, False) for case in ("topk_all", "random", "one_expert")
                    for mode in ("dropless", "drop", "padded")]
        variants += [("random", "dropless", True, 16, False), ("topk_all", "drop", True, 4, False),
                     ("random", "dropless", False, 1, True), ("random", "drop", True, 16, True)]
        buffers = ElasticBuffers()
        made_before = len(Buffer.instances)
        for case, mode, fp8, alignment, cpu_sync in variants:
            # three MoE layers' dispatchers, one buffer for the group
            flex = FlexOptions(FlexBackend.DEEPEP, max_tokens_per_rank=MAX_TOKENS, cpu_sync=cpu_sync, hybrid=hybrid)
            layers = [build_dispatcher(DispatchConfig(DispatcherKind.FLEX, flex, fp8=fp8), E, dims, hidden_size=H,
                                       expert_alignment=alignment, buffers=buffers) for _ in range(3)]
            key = (case, mode, fp8)
            if key not in refs:
                refs[key] = _reference(case, mode, fp8, w1, w2)
            for layer, d in enumerate(layers):
                tag = f"{label} {case} {mode} fp8={fp8} align={alignment} cpu_sync={cpu_sync} layer {layer}"
                _case(d, dims, standin, counter, failures, tag, refs[key], w1, w2, fp8=fp8, alignment=alignment,
                      cpu_sync=cpu_sync)
        made = Buffer.instances[made_before:]
        if len(made) != 1 or buffers.created != 1:
            failures.append(f"{label}: {len(made)} DeepEP buffers for every layer and variant, expected 1")
        b = made[-1]
        hint = max(Buffer.get_buffer_size_hint(dims.etp_ep_group if ep * etp > 1 else None, MAX_TOKENS, H,
                                               num_topk=k * etp, use_fp8_dispatch=False, allow_hybrid_mode=hybrid)
                   for k in (E,))   # the largest top-k the variants route with (topk_all: k = E)
        if b.num_bytes != hint or b.allow_hybrid_mode != hybrid or b.num_ranks != ep * etp:
            failures.append(f"{label}: buffer of {b.num_bytes} bytes (hybrid {b.allow_hybrid_mode}) over "
                            f"{b.num_ranks} ranks, expected the hint {hint} over {ep * etp}")
        if not b.explicitly_destroy or b.destroyed or buffers.destroy() != 1 or not b.destroyed:
            failures.append(f"{label}: buffer explicitly_destroy={b.explicitly_destroy}, destroyed {b.destroyed}: "
                            f"expected created for an explicit destroy() and destroyed by it")
    return failures


def test_elastic_flex_roundtrip_and_protocol():
    # ep2 (edp 2), ep4, ep2 x etp2 in one NVLink domain; ep4 over two "nodes" of 2 in hybrid and direct mode
    layouts = [(2, 1, 8, True), (4, 1, 8, True), (2, 2, 8, True), (4, 1, 2, True), (4, 1, 2, False)]
    results = run_distributed(_world, 4, layouts, timeout=600)
    failures = sorted({f for per_rank in results for f in per_rank})
    assert not failures, "\n".join(failures[:40])

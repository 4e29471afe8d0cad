"""The CPU stand-ins of the GPU-only libraries reject what the real ones reject.

Each stand-in lists the preconditions it copied from its library's source (``PRECONDITIONS``: what, and the upstream
file:line): Transformer Engine (tests/moe/te_standin.py), DeepEP v1.2.1 (tests/dispatch/deepep_standin.py), DeepEP
V2's ElasticBuffer (tests/dispatch/deepep_elastic_standin.py), grouped_gemm (tests/moe/grouped_gemm_standin.py). Every
entry has a case here that breaks exactly that precondition and expects the stand-in to refuse it, and every case is
in the list: a precondition cannot be listed without being enforced, nor enforced without being listed. moefold's own
calls pass them all (the protocol tests: tests/moe/test_experts.py, tests/dispatch/test_flex.py,
tests/dispatch/test_flex_elastic.py, tests/moe/test_gemm.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tests.dispatch import deepep_elastic_standin, deepep_standin
from tests.distributed import run_distributed
from tests.moe import grouped_gemm_standin, te_standin

bf16 = torch.bfloat16


def _refuses(case: Callable[[], object], match: str) -> str | None:
    """None when ``case()`` raises with ``match`` in its message, else what happened."""
    try:
        case()
    except (RuntimeError, ValueError, TypeError, AssertionError) as err:
        return None if match in str(err) else f"raised {type(err).__name__}: {err}"
    return "accepted"


def _check_list(listed: tuple[tuple[str, str], ...], cases: dict[str, tuple[Callable[[], object], str]]) -> list[str]:
    names = [name for name, _where in listed]
    problems = [f"listed without a case: {n}" for n in names if n not in cases]
    problems += [f"a case not listed: {n}" for n in cases if n not in names]
    for name, (case, match) in cases.items():
        if (what := _refuses(case, match)) is not None:
            problems.append(f"{name}: {what}")
    return problems


# -------------------------------------------------------------------------------- grouped_gemm
def test_grouped_gemm_standin_rejects_what_grouped_gemm_rejects():
    ops = grouped_gemm_standin.module()
    a, b, sizes = torch.ones(4, 8, dtype=bf16), torch.ones(2, 8, 6, dtype=bf16), torch.tensor([1, 3])
    cases = {
        "batch_sizes on the host (cuBLAS build)":
            (lambda: ops.gmm(a, b, sizes.to("meta")), "grouped_gemm.cu:480"),
        "batch_sizes 1-D int64": (lambda: ops.gmm(a, b, sizes.int()), "grouped_gemm.cu:486"),
        "a bf16 2-D": (lambda: ops.gmm(a.float(), b, sizes), "grouped_gemm.cu:492"),
        "b bf16": (lambda: ops.gmm(a, b.float(), sizes), "grouped_gemm.cu:505"),
        "b 3-D [experts, K, N] (or [experts, N, K] with trans_b)": (lambda: ops.gmm(a, b[0], sizes),
                                                                    "grouped_gemm.cu:524"),
        "a's K equals b's K": (lambda: ops.gmm(a, b, sizes, trans_b=True), "grouped_gemm.cu:531"),
        "one batch size per expert": (lambda: ops.gmm(a, b, torch.tensor([1, 1, 2])), "grouped_gemm.cu:534"),
        "a contiguous": (lambda: ops.gmm(torch.ones(8, 4, dtype=bf16).T, b, sizes), "grouped_gemm.cu:538"),
        "b contiguous": (lambda: ops.gmm(a, torch.ones(2, 6, 8, dtype=bf16).transpose(1, 2), sizes),
                         "grouped_gemm.cu:539"),
    }
    assert not (problems := _check_list(grouped_gemm_standin.PRECONDITIONS, cases)), problems
    ops.gmm(a, b, sizes)   # and a valid call passes


# -------------------------------------------------------------------------------- Transformer Engine
def test_te_standin_rejects_what_transformer_engine_rejects(monkeypatch):
    pt = te_standin.install(monkeypatch)
    delayed = te_standin.DelayedScaling()

    def compiled_autocast():
        def enter(x):
            with pt.autocast(enabled=True, recipe=delayed):
                return x + 1

        return torch.compile(enter, backend="eager", fullgraph=True)(torch.ones(2))

    def twice():
        context = pt.autocast(enabled=True, recipe=delayed)
        with context, context:
            pass

    grouped = pt.GroupedLinear(2, 16, 16, bias=False, device="cpu")
    linear = pt.Linear(16, 16, bias=False, device="cpu")

    def fp8_linear(rows: int):
        with pt.autocast(enabled=True, recipe=delayed):
            return linear(torch.ones(rows, 16))

    def on_device(capability, context, cuda=12.9, run=lambda: None):
        te_standin.DEVICE.update(capability=capability, cuda=cuda)
        try:
            with context:
                return run()
        finally:
            te_standin.DEVICE.update(capability=(9, 0), cuda=12.9)

    cases = {
        "DelayedScaling autocast entered while torch.compile traces":
            (compiled_autocast, "DelayedScaling is not supported under torch.compile"),
        "one autocast object entered twice at once": (twice, "cannot be entered more than once concurrently"),
        "m_splits of another length than num_gemms":
            (lambda: grouped(torch.ones(4, 16), [4]), "does not match number of GEMMs"),
        "an FP8 input to GroupedLinear":
            (lambda: grouped(torch.ones(4, 16).to(torch.float8_e4m3fn), [2, 2]), "doesn't support input tensor in FP8"),
        "FP8 te.Linear operands: leading dims a multiple of 8, last of 16":
            (lambda: fp8_linear(12), "FP8 execution requires the product of all dimensions except the last"),
        "Float8BlockScaling below compute capability 9.0 or CUDA 12.9":
            (lambda: on_device((9, 0), pt.autocast(enabled=True, recipe=te_standin.Float8BlockScaling()), 12.8),
             "FP8 block scaled GEMM requires compute capability 9.0"),
        "MXFP8BlockScaling outside compute capability 10.x-11.x":
            (lambda: on_device((9, 0), pt.autocast(enabled=True, recipe=te_standin.MXFP8BlockScaling())),
             "Device compute capability 10.0 or higher required for MXFP8"),
        "NVFP4BlockScaling below compute capability 10.0":
            (lambda: on_device((9, 0), pt.autocast(enabled=True, recipe=te_standin.NVFP4BlockScaling())),
             "Device compute capability 10.0 or higher required for NVFP4"),
        "Float8BlockScaling with 2-D blocks for two operands of one GEMM":
            (lambda: te_standin.Float8BlockScaling(x_block_scaling_dim=2), "2D by 2D block gemm not supported"),
        "NVFP4BlockScaling with an FP8 scale format other than E4M3":
            (lambda: te_standin.NVFP4BlockScaling(fp8_format=te_standin.Format.HYBRID), "Only E4M3 is supported"),
        "NVFP4 operands whose rows or columns are not multiples of 32":
            (lambda: on_device((10, 0), pt.autocast(enabled=True, recipe=te_standin.NVFP4BlockScaling()),
                               run=lambda: linear(torch.ones(16, 16))), "must be a multiple of 32"),
    }
    assert not (problems := _check_list(te_standin.PRECONDITIONS, cases)), problems
    torch._dynamo.reset()
    fp8_linear(16)   # valid calls pass
    grouped(torch.ones(4, 16), [1, 3])
    on_device((9, 0), pt.autocast(enabled=True, recipe=te_standin.Float8BlockScaling()))
    on_device((10, 0), pt.autocast(enabled=True, recipe=te_standin.MXFP8BlockScaling()))
    wide = pt.Linear(32, 32, bias=False, device="cpu")
    on_device((10, 0), pt.autocast(enabled=True, recipe=te_standin.NVFP4BlockScaling()),
              run=lambda: wide(torch.ones(32, 32)))


# -------------------------------------------------------------------------------- DeepEP
def _deepep_cases() -> list[str]:
    mod = deepep_standin.module()
    buffer = mod.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20, explicitly_destroy=True)
    R, E, T, H = dist.get_world_size(), 4, 6, 16
    idx = torch.arange(T * 2).reshape(T, 2) % E
    weights = torch.full((T, 2), 0.5)
    x = torch.ones(T, H, dtype=bf16)
    ev = mod.Buffer.capture

    def layout(topk=idx, **kw):
        kw = {"previous_event": ev(), "async_finish": True, "allocate_on_comm_stream": True, **kw}
        return buffer.get_dispatch_layout(topk, E, **kw)

    def dispatch(x=x, topk=idx, w=weights, **kw):
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk.long(), E)
        kw = {"previous_event": ev(), "async_finish": True, "allocate_on_comm_stream": True, **kw}
        return buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, **kw)

    handle = dispatch()[4]

    def combine(y=None, w=None, **kw):
        kw = {"previous_event": ev(), "async_finish": True, "allocate_on_comm_stream": True, **kw}
        rows = sum(handle[2])
        return buffer.combine(torch.ones(rows, H, dtype=bf16) if y is None else y, handle, topk_weights=w, **kw)

    def odd_sms():
        mod.Buffer.num_sms = 7   # as a Config(num_sms=7) would; set_num_sms itself refuses odd counts
        try:
            return layout()
        finally:
            mod.Buffer.num_sms = 20

    def destroy_unflagged():
        mod.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20).destroy()

    def destroy_twice():
        b = mod.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20, explicitly_destroy=True)
        b.destroy()
        b.destroy()

    wide = torch.arange(T * 33).reshape(T, 33) % E
    cases = {
        "num_topk <= 32 in dispatch":
            (lambda: dispatch(topk=wide, w=torch.zeros(T, 33)), "intranode.cu:187"),
        "num_topk <= 32 in combine":
            (lambda: combine(w=torch.zeros(sum(handle[2]), 33)), "intranode.cu:592"),
        "allocate_on_comm_stream needs previous_event and async_finish: layout":
            (lambda: layout(previous_event=None), "deep_ep.cpp:253"),
        "allocate_on_comm_stream needs previous_event and async_finish: dispatch":
            (lambda: dispatch(async_finish=False), "deep_ep.cpp:391"),
        "allocate_on_comm_stream needs previous_event and async_finish: combine":
            (lambda: combine(previous_event=None), "deep_ep.cpp:569"),
        "topk_idx int64: layout": (lambda: layout(topk=idx.int()), "deep_ep.cpp:272"),
        "topk_idx int64: dispatch": (lambda: dispatch(topk=idx.int()), "deep_ep.cpp:369"),
        "topk_idx 2-D contiguous: layout": (lambda: layout(topk=idx.T.contiguous().T), "deep_ep.cpp:246"),
        "topk_idx and topk_weights 2-D contiguous: dispatch":
            (lambda: dispatch(w=weights.T.contiguous().T), "deep_ep.cpp:364-365"),
        "topk_weights fp32: dispatch": (lambda: dispatch(w=weights.double()), "deep_ep.cpp:368"),
        "topk_weights fp32: combine": (lambda: combine(w=torch.ones(sum(handle[2]), 2).double()), "deep_ep.cpp:587"),
        "x 2-D contiguous: dispatch": (lambda: dispatch(x=torch.ones(H, T, dtype=bf16).T), "deep_ep.cpp:336"),
        "x 2-D contiguous: combine":
            (lambda: combine(y=torch.ones(H, sum(handle[2]), dtype=bf16).T), "deep_ep.cpp:547"),
        "hidden bytes a multiple of 16: dispatch":
            (lambda: dispatch(x=torch.ones(T, 12, dtype=bf16)), "deep_ep.cpp:337"),
        "bf16 dispatch input": (lambda: dispatch(x=torch.ones(T, H)), "buffer.py:323-324"),
        "bf16 combine input": (lambda: combine(y=torch.ones(sum(handle[2]), H)), "launch.cuh:84"),
        "an even SM count": (odd_sms, "deep_ep.cpp:315"),
        "num_experts a multiple of the ranks, <= 1024 per rank":
            (lambda: buffer.dispatch(x, num_tokens_per_rank=torch.zeros(R, dtype=torch.int32),
                                     is_token_in_rank=torch.zeros(T, R, dtype=torch.bool),
                                     num_tokens_per_expert=torch.zeros(1025 * R, dtype=torch.int32), topk_idx=idx,
                                     topk_weights=weights), "deep_ep.cpp:348"),
        "destroy() needs explicitly_destroy=True": (destroy_unflagged, "`explicitly_destroy` flag must be set"),
        "destroy() once": (destroy_twice, "deep_ep.cpp:144"),
    }
    problems = _check_list(deepep_standin.PRECONDITIONS, cases)
    buffer.destroy()
    return problems


def test_deepep_standin_rejects_what_deepep_rejects():
    for problems in run_distributed(_deepep_cases, 2, timeout=120):
        assert not problems, problems


# -------------------------------------------------------------------------------- DeepEP V2 (ElasticBuffer)
def _elastic_cases() -> list[str]:
    from moefold.dispatch.fp8_exchange import quantize_rows

    mod = deepep_elastic_standin.module()
    EB, group = mod.ElasticBuffer, dist.group.WORLD
    R, E, T, H, K, TMAX = dist.get_world_size(), 8, 6, 32, 2, 16
    dist.barrier(group=group)   # torch's communicator of the group formed before DeepEP reuses it (comm.py:57-64)
    buffer = EB(group, num_max_tokens_per_rank=TMAX, hidden=H, num_topk=E, explicitly_destroy=True)
    idx = (torch.arange(T * K).reshape(T, K) * 3) % E
    weights = torch.full((T, K), 0.5)
    x = torch.ones(T, H, dtype=bf16)
    args = {"num_experts": E, "num_max_tokens_per_rank": TMAX, "num_sms": 4, "do_cpu_sync": False, "do_expand": True,
            "do_zero_padding": True}

    def dispatch(buf=buffer, x=x, topk=idx, w=weights, **kw):
        return buf.dispatch(x, topk_idx=topk, topk_weights=w, **{**args, **kw})

    handle = dispatch()[3]
    rows = handle.num_expanded_tokens

    def cached(**kw):
        return buffer.dispatch(x, handle=handle, num_sms=4, do_expand=True, do_zero_padding=True, **kw)

    def combine(y=None, w=None, buf=buffer, **kw):
        return buf.combine(torch.ones(rows, H, dtype=bf16) if y is None else y, handle, topk_weights=w, **kw)

    def deterministic(fn):
        def run():
            fill = torch.utils.deterministic.fill_uninitialized_memory
            torch.use_deterministic_algorithms(True)
            torch.utils.deterministic.fill_uninitialized_memory = True
            try:
                return fn()
            finally:
                torch.use_deterministic_algorithms(False)
                torch.utils.deterministic.fill_uninitialized_memory = fill
        return run

    def small(tokens: int, **kw):   # a 2 MiB buffer (the smallest) for num_max_tokens_per_rank=tokens
        return EB(group, num_bytes=2 * 2**20, num_max_tokens_per_rank=tokens, explicitly_destroy=True, **kw)

    def combine_too_big():
        b = small(4096, allow_multiple_reduction=False)   # dispatch fits 2 MiB, the single-reduction combine not
        wide = torch.arange(T * 8).reshape(T, 8) % E
        h = b.dispatch(x, topk_idx=wide, topk_weights=torch.zeros(T, 8),
                       **{**args, "num_max_tokens_per_rank": 4096})[3]
        return b.combine(torch.ones(h.num_expanded_tokens, H, dtype=bf16), h)

    def destroy_unflagged():
        EB(group, num_max_tokens_per_rank=TMAX, hidden=H).destroy()

    wide = torch.arange(T * 33).reshape(T, 33) % E
    fp8, scales = quantize_rows(x.float())
    cases = {
        "deterministic algorithms with fill_uninitialized_memory: dispatch": (deterministic(dispatch), ""),
        "deterministic algorithms with fill_uninitialized_memory: combine": (deterministic(combine), ""),
        "QPs within the allocated ones: dispatch": (lambda: dispatch(num_qps=1000), "Allocated QPs are not enough"),
        "QPs within the allocated ones: combine": (lambda: combine(num_qps=1000), "Allocated QPs are not enough"),
        "a cached handle without topk_idx":
            (lambda: buffer.dispatch(x, topk_idx=idx, handle=handle, num_sms=4, do_expand=True), ""),
        "no CPU sync with a cached handle": (lambda: cached(do_cpu_sync=True), "Cannot do CPU sync with cached handle"),
        "a cached handle's experts, alignment and max tokens": (lambda: cached(expert_alignment=16), ""),
        "num_sms > 0": (lambda: dispatch(num_sms=-2), "buffer.hpp:728"),
        "zero padding only with do_expand": (lambda: dispatch(do_expand=False), "buffer.hpp:731"),
        "x contiguous: dispatch": (lambda: dispatch(x=torch.ones(H, T, dtype=bf16).T), "buffer.hpp:754"),
        "hidden bytes a multiple of 16: dispatch":
            (lambda: dispatch(x=torch.ones(T, 12, dtype=bf16)), "buffer.hpp:755"),
        "num_tokens <= num_max_tokens_per_rank: dispatch":
            (lambda: dispatch(x=torch.ones(TMAX + 1, H, dtype=bf16), topk=torch.zeros(TMAX + 1, K, dtype=torch.long),
                              w=torch.zeros(TMAX + 1, K)), "buffer.hpp:756"),
        "FP8 scales of 4 bytes": (lambda: dispatch(x=(fp8, scales.double())), "buffer.hpp:767"),
        "topk_idx of topk_idx_t": (lambda: dispatch(topk=idx.int()), "buffer.hpp:777"),
        "topk_weights contiguous: dispatch": (lambda: dispatch(w=weights.T.contiguous().T), "buffer.hpp:785"),
        "recv stats int32 with one count per local expert":
            (lambda: dispatch(cumulative_local_expert_recv_stats=torch.zeros(E, dtype=torch.int32)), "buffer.hpp:795"),
        "no recv stats with a cached handle":
            (lambda: cached(cumulative_local_expert_recv_stats=torch.zeros(E // R, dtype=torch.int32)),
             "dispatch.hpp:168"),
        "num_experts a multiple of the ranks": (lambda: dispatch(num_experts=E + 1), "buffer.hpp:805"),
        "at most 2048 experts, 256 per rank": (lambda: dispatch(num_experts=2 * 257 * R // 2), "layout.cuh:39-40"),
        "hidden bytes a multiple of 32 (TMA)": (lambda: dispatch(x=torch.ones(T, 24, dtype=bf16)), "layout.cuh:198"),
        "the buffer holds the dispatch": (lambda: dispatch(buf=small(16384), num_max_tokens_per_rank=16384),
                                          "buffer.hpp:963-966"),
        "num_sms within the device's SMs": (lambda: dispatch(num_sms=1000), "buffer.hpp:979"),
        "num_topk <= 32": (lambda: dispatch(topk=wide, w=torch.zeros(T, 33)), "NVCC compilation failed"),
        "bf16 combine input": (lambda: combine(y=torch.ones(rows, H)), "buffer.hpp:1203"),
        "hidden bytes a multiple of 16: combine":
            (lambda: combine(y=torch.ones(rows, 4, dtype=bf16)), "buffer.hpp:1204"),
        "topk_weights fp32: combine": (lambda: combine(w=torch.ones(rows).double()), "buffer.hpp:1234"),
        "the buffer holds the combine": (combine_too_big, "buffer.hpp:1254-1256"),
        "previous_event needs allocate_on_comm_stream":
            (lambda: dispatch(previous_event=EB.capture()), "buffer.hpp:540"),
        "buffer bytes a positive multiple of 2 MiB":
            (lambda: EB(group, num_bytes=3 * 2**20 // 2), "buffer.hpp:98"),
        "size hint: positive tokens and hidden": (lambda: EB.get_buffer_size_hint(group, 0, H), "buffer.hpp:657"),
        "destroy() needs explicitly_destroy=True": (destroy_unflagged, ""),
        "num_scaleout_topk == 0 in the SM estimate": (lambda: buffer.get_theoretical_num_sms(E, K, num_scaleout_topk=1),
                                                      ""),
        # a group that has run no collective: torch's NCCL communicator of it is still null (every rank makes it)
        "torch's communicator formed: size hint":
            (lambda: EB.get_buffer_size_hint(dist.new_group(list(range(R))), TMAX, H), "comm.py:61-64"),
        "torch's communicator formed: ElasticBuffer":
            (lambda: EB(dist.new_group(list(range(R))), num_max_tokens_per_rank=TMAX, hidden=H), "comm.py:61-64"),
    }
    problems = _check_list(deepep_elastic_standin.PRECONDITIONS, cases)
    dispatch()   # valid calls pass
    combine()
    buffer.destroy()
    return problems


def test_deepep_elastic_standin_rejects_what_deepep_v2_rejects():
    for problems in run_distributed(_elastic_cases, 2, timeout=120):
        assert not problems, problems

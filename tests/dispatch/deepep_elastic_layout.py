"""DeepEP V2's buffer arithmetic and SM estimate, restated for the CPU stand-in (deepep_elastic_standin.py).

Line for line from DeepEP main (dd758ca): ``get_dispatch_buffer_size`` / ``get_combine_buffer_size`` /
``calculate_buffer_size`` (csrc/elastic/buffer.hpp:586-686), ``TokenLayout::get_num_bytes`` and
``BufferLayout`` (deep_ep/include/deep_ep/common/layout.cuh:185-280), the logical domains (nccl.cu:49-60) and
``ElasticBuffer.get_theoretical_num_sms`` (deep_ep/buffers/elastic.py:728-834). The stand-in checks every call's
layout against the bytes it was created with, as DeepEP's ``EP_HOST_ASSERT``s at buffer.hpp:963 and 1254 do,
so a buffer moefold sizes too small fails here. (moefold's planner states the same arithmetic on its own,
``planner.deepep``; tests/planner/test_deepep_plan.py compares the two.)
"""

from __future__ import annotations

import math

ALIGNMENT = 2 * 2**20      # symmetric::kNumAlignmentBytes (csrc/kernels/backend/symmetric.hpp:16)
TMA_ALIGN = 32             # ptx::kNumTMAAlignBytes (deep_ep/include/deep_ep/common/ptx.cuh:16)
MAX_CHANNELS = 8 * 160     # ElasticBuffer::kNumMaxChannels (buffer.hpp:57-59)
NUM_DEVICE_SMS = 132       # H100 SXM5 (torch.cuda.get_device_properties().multi_processor_count)
NVLINK_GBS = 18 * 26.5625 * 0.9   # envs.py get_nvlink_gbs: 18 NVLink4 links x 26.5625 GB/s x 0.9
RDMA_GBS = 50.0            # envs.py get_rdma_gbs: one 400 Gb/s ConnectX-7


class EPAssertion(RuntimeError):
    """Stands for DeepEP's ``EPException`` (``EP_HOST_ASSERT``)."""


def host_assert(ok: bool, where: str, cond: str) -> None:
    """``EP_HOST_ASSERT`` (deep_ep/include/deep_ep/common/exception.cuh:27-33): "Assertion exception (FILE:LINE)"."""
    if not ok:
        raise EPAssertion(f"Assertion exception ({where}): {cond}")


def align(x: int, y: int) -> int:
    return -(-x // y) * y


def token_bytes(hidden_bytes: int, sf_bytes: int, num_topk: int, with_metadata: bool) -> int:
    """``TokenLayout::get_num_bytes<false>()``: hidden, scales and metadata (top-k ids and weights, 4 bytes each,
    plus source index and top-k slots with metadata), each 32-aligned."""
    host_assert(hidden_bytes % TMA_ALIGN == 0, "layout.cuh:198", "num_hidden_bytes % ptx::kNumTMAAlignBytes == 0")
    meta = num_topk * 8 + ((1 + num_topk) * 4 if with_metadata else 0)
    return align(hidden_bytes, TMA_ALIGN) + align(sf_bytes, TMA_ALIGN) + align(meta, TMA_ALIGN)


def dispatch_bytes(tokens: int, hidden: int, sf_packs: int, topk: int, elem: int, scaleout: int, scaleup: int,
                   scaleup_nvlink: bool) -> int:
    """``get_dispatch_buffer_size`` (buffer.hpp:586-614)."""
    tok = token_bytes(hidden * elem, sf_packs * 4, topk, True)
    if scaleout == 1:
        return tok * (0 if scaleup_nvlink else 1) * tokens + tok * scaleup * tokens
    return tok * (scaleup * scaleout * tokens + tokens + scaleout * (tokens + MAX_CHANNELS))


def combine_bytes(tokens: int, hidden: int, topk: int, scaleout: int, scaleup: int, scaleup_nvlink: bool,
                  multiple_reduction: bool) -> int:
    """``get_combine_buffer_size`` (buffer.hpp:616-650)."""
    tok = token_bytes(hidden * 2, 0, topk, False)
    ranks = scaleout * scaleup
    if scaleout == 1:
        in_layout = min(ranks, topk) if multiple_reduction else topk
        send = tok * (0 if scaleup_nvlink else ranks) * tokens * (1 if multiple_reduction else topk)
        return send + tok * in_layout * tokens
    up = min(scaleup, topk) if multiple_reduction else topk
    out = min(scaleout, topk) if multiple_reduction else topk
    return tok * (up * scaleout * tokens + out * tokens
                  + (1 if multiple_reduction else topk) * scaleout * (tokens + MAX_CHANNELS))


def domains(num_ranks: int, nvl_ranks: int, hybrid: bool) -> tuple[int, int, int, int]:
    """(scaleout, scaleup, rdma, nvl) of ``num_ranks`` in NVLink domains of ``nvl_ranks`` (nccl.cu:49-60)."""
    nvl = min(num_ranks, nvl_ranks)
    assert num_ranks % nvl == 0, f"{num_ranks} ranks are not whole NVLink domains of {nvl}"
    rdma = num_ranks // nvl
    return (rdma, nvl, rdma, nvl) if hybrid else (1, rdma * nvl, rdma, nvl)


def calculate_buffer_size(num_ranks: int, nvl_ranks: int, tokens: int, hidden: int, topk: int, fp8: bool,
                          hybrid: bool, multiple_reduction: bool) -> int:
    """``calculate_buffer_size`` (buffer.hpp:652-686): the larger layout, 2 MiB-aligned."""
    host_assert(tokens > 0 and hidden > 0, "buffer.hpp:657", "num_max_tokens_per_rank > 0 and hidden > 0")
    topk = topk or 32
    scaleout, scaleup, _, nvl = domains(num_ranks, nvl_ranks, hybrid)
    elem, packs = (1, -(-hidden // 32)) if fp8 else (2, 0)
    d = dispatch_bytes(tokens, hidden, packs, topk, elem, scaleout, scaleup, scaleup == nvl)
    c = combine_bytes(tokens, hidden, topk, scaleout, scaleup, scaleup == nvl, multiple_reduction)
    return align(max(d, c), ALIGNMENT)


def theoretical_num_sms(num_experts: int, num_topk: int, num_ranks: int, scaleout: int, scaleup: int, rdma_ranks: int,
                        nvl_ranks: int, prefer_overlap_with_compute: bool, rdma_gbs: float = 0, nvlink_gbs: float = 0,
                        sm_read_gbs: float = 200, sm_write_gbs: float = 50) -> int:
    """``ElasticBuffer.get_theoretical_num_sms`` (elastic.py:728-834) with this machine model's bandwidths."""
    if rdma_gbs == 0 and rdma_ranks > 1:
        rdma_gbs = RDMA_GBS
    if nvlink_gbs == 0:
        nvlink_gbs = NVLINK_GBS
    sm_read = sm_write = rdma = nvlink = 0.0

    def expected_topk(groups: int) -> float:
        assert num_experts % groups == 0
        miss = math.comb(num_experts - num_experts // groups, num_topk) / math.comb(num_experts, num_topk)
        return groups * (1 - miss)

    out_topk = expected_topk(scaleout) if scaleout > 1 else 0
    topk = expected_topk(num_ranks)
    sm_read += 1 / topk
    if scaleout > 1:
        sm_write += 1 / topk
        sm_write += (1 / topk) * (out_topk / scaleout)
        rdma += (1 / topk) * (out_topk * (1 - 1 / scaleout))
        sm_read += out_topk / topk
        sm_write += 1
        nvlink += 1 - (1 / scaleup)
    else:
        if rdma_ranks > 1:
            sm_write += 1 / topk
        sm_write += nvl_ranks / num_ranks
        nvlink += nvl_ranks / num_ranks * (1 - 1 / nvl_ranks)
        rdma += (num_ranks - nvl_ranks) / num_ranks
    if scaleout > 1 and rdma / rdma_gbs > nvlink / nvlink_gbs:
        traffic, gbs = rdma, rdma_gbs
    else:
        traffic, gbs = nvlink, nvlink_gbs
    num_sms: float = NUM_DEVICE_SMS
    if traffic > 0:
        num_sms = max(gbs / traffic * sm_read / sm_read_gbs, gbs / traffic * sm_write / sm_write_gbs)
    sms = align(max(4, math.ceil(num_sms * 1.25)), 2)
    sms = sms if prefer_overlap_with_compute else max(sms, 64)
    return min(sms, NUM_DEVICE_SMS)

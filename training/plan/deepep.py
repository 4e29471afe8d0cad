"""Bytes of the flex dispatcher's DeepEP buffer on one GPU, without DeepEP installed.

``dispatch.deepep.DeepEPBuffers`` allocates one ``deep_ep.Buffer`` per process for the etp x ep group, sized
by ``dispatch.deepep.buffer_sizes``: the larger of DeepEP's NVLink and RDMA size hints
(``Config.get_nvl_buffer_size_hint`` / ``get_rdma_buffer_size_hint``, csrc/config.hpp of DeepEP v1.2.1) for its
recommended dispatch and combine configs (``Buffer.get_dispatch_config`` / ``get_combine_config``,
deep_ep/buffer.py), with ``hidden_bytes`` = hidden x 2 (bf16 tokens). The planner has no GPU and no DeepEP, so
this module re-states those hints' arithmetic and the configs' chunk sizes (tokens per channel); DeepEP also
allocates a 32 MiB workspace per buffer (``NUM_WORKSPACE_BYTES``).
"""

from __future__ import annotations

from moefold.parallel.dims import ParallelSizes
from moefold.training.config import RunConfig

NVL_PEERS = 8                   # DeepEP's NUM_MAX_NVL_PEERS: ranks of one NVLink domain
WORKSPACE = 32 * 2**20
MAX_TOPK = MAX_SCALES = 128     # the hints' fixed per-token metadata (top-k ids, weights, FP8 scales)
SOURCE_META = 8                 # internode SourceMeta: two ints per token
# ranks -> (nvl chunked recv tokens, rdma chunked send tokens, rdma chunked recv tokens): the recommended
# dispatch and combine configs of DeepEP v1.2.1 (the send-token counts only matter for the RDMA alignment)
DISPATCH = {2: (256, 6, 128), 4: (256, 6, 128), 8: (256, 6, 128), 16: (288, 20, 128), 24: (288, 8, 128),
            32: (288, 8, 128), 48: (288, 8, 128), 64: (288, 8, 128), 96: (480, 12, 128), 128: (560, 12, 128),
            144: (720, 12, 128), 160: (720, 12, 128)}
COMBINE = {2: (256, 6, 128), 4: (256, 6, 128), 8: (256, 6, 128), 16: (288, 28, 128), 24: (288, 20, 128),
           32: (288, 20, 128), 64: (288, 20, 128), 128: (560, 12, 128), 144: (720, 8, 128), 160: (720, 8, 128)}


def _round128(n: int) -> int:
    return -(-n // 128) * 128


def nvl_hint(num_sms: int, nvl_recv: int, hidden_bytes: int, ranks: int) -> int:
    channels, rdma_ranks, nvl_ranks = num_sms // 2, max(ranks // NVL_PEERS, 1), min(ranks, NVL_PEERS)
    per_token = hidden_bytes + SOURCE_META + MAX_TOPK * (8 + 4) + MAX_SCALES * 4
    return _round128(channels * nvl_ranks * ((2 * rdma_ranks + 3) * 4 + nvl_recv * per_token))


def rdma_hint(num_sms: int, rdma_send: int, rdma_recv: int, hidden_bytes: int, ranks: int) -> int:
    if ranks <= NVL_PEERS:
        return 0
    channels, rdma_ranks = num_sms // 2, ranks // NVL_PEERS
    recv = -(-rdma_recv // rdma_send) * rdma_send
    per_token = 2 * (hidden_bytes + SOURCE_META + MAX_TOPK * (8 + 4) + MAX_SCALES * 4 + 16)
    return _round128(channels * rdma_ranks * ((NVL_PEERS * 2 + 2) * 2 * 4 + recv * per_token) + 2**20)


def deepep_buffer_bytes(config: RunConfig, sizes: ParallelSizes) -> int:
    """NVLink + RDMA buffer + workspace of the flex dispatcher's group (etp x ep ranks); ValueError for a group
    size DeepEP has no config for."""
    ranks = sizes.ep * sizes.etp
    if ranks == 1:
        return 0
    if ranks not in DISPATCH or ranks not in COMBINE:
        raise ValueError(f"--moe-token-dispatcher-type=flex: DeepEP has no config for {ranks} ranks (etp x ep); "
                         f"it supports {', '.join(map(str, sorted(set(DISPATCH) & set(COMBINE))))}")
    hidden_bytes = config.model.hidden_size * 2
    num_sms = config.options.moe_deepep_num_sms
    nvl = rdma = 0
    for nvl_recv, rdma_send, rdma_recv in (DISPATCH[ranks], COMBINE[ranks]):
        nvl = max(nvl, nvl_hint(num_sms, nvl_recv, hidden_bytes, ranks))
        rdma = max(rdma, rdma_hint(num_sms, rdma_send, rdma_recv, hidden_bytes, ranks))
    return nvl + rdma + WORKSPACE

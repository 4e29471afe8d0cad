"""Bytes of the flex dispatcher's DeepEP buffer on one GPU, and the rows its sync-free dispatch allocates.

Which DeepEP: ``--moe-flex-dispatcher-backend`` (``planned_backend``: ``auto`` plans ``deepep``, DeepEP V2, what a
DeepEP checkout builds today).

DeepEP V2 (``dispatch.deepep_elastic``): one ``ElasticBuffer`` per process for the etp x ep group, of
``ElasticBuffer.get_buffer_size_hint`` bytes for the layout's worst case (``num_max_tokens_per_rank`` = the tokens a
rank routes per MoE call, hidden, top-k x etp, the bf16 layout that the backward's gradient dispatch needs), plus
DeepEP's 16 MiB workspace. The planner has neither GPU nor DeepEP, so ``v2_buffer_bytes`` restates
``calculate_buffer_size`` (csrc/elastic/buffer.hpp:586-686: the larger of the dispatch and combine layouts, each
``TokenLayout`` 32-byte aligned, 2 MiB-aligned in total) and ``WorkspaceLayout::get_num_bytes``
(deep_ep/include/deep_ep/common/layout.cuh) of DeepEP main dd758ca. The NVLink domain is the group's ranks in one
node (``--gpus-per-node``): within it the buffer holds one receive slot per rank; across nodes hybrid mode
(``--moe-deepep-mode hybrid``) adds its scale-out buffers, direct mode a send buffer. Sync-free dispatch
(``do_cpu_sync=False``) also sizes the received rows for the worst case (``v2_receive_rows``: buffer.hpp:1066-1070),
which the experts' activations then have (``planner.activations_ffn``).

The legacy backend (``dispatch.deepep``, DeepEP v1's ``Buffer``) allocates the larger of DeepEP's NVLink and RDMA
size hints (``Config.get_nvl_buffer_size_hint`` / ``get_rdma_buffer_size_hint``, csrc/config.hpp of v1.2.1) for
its recommended dispatch and combine configs (``Buffer.get_dispatch_config`` / ``get_combine_config``,
deep_ep/buffer.py), with ``hidden_bytes`` = hidden x 2 (bf16 tokens), and a 32 MiB workspace.
"""

from __future__ import annotations

from moefold.models.options import ModelOptions
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

# DeepEP V2 (main dd758ca)
V2_ALIGNMENT = 2 * 2**20        # symmetric::kNumAlignmentBytes
TMA_ALIGN = 32                  # ptx::kNumTMAAlignBytes
MAX_CHANNELS = 8 * 160          # ElasticBuffer::kNumMaxChannels
_MAX_RANKS, _MAX_EXPERTS, _MAX_AGRS = 1024, 2048, 32   # WorkspaceLayout's fixed capacities
V2_WORKSPACE = -(-(16 + (_MAX_RANKS + _MAX_EXPERTS) * 8 * 3 + _MAX_RANKS * 4 + (_MAX_RANKS + _MAX_EXPERTS) * 4 * 2
                   + _MAX_RANKS * MAX_CHANNELS * (8 + 4) + 2 * 2 * 8 + (_MAX_AGRS + 1) * _MAX_RANKS * 4)
                 // V2_ALIGNMENT) * V2_ALIGNMENT


def planned_backend(options: ModelOptions) -> str:
    """The flex backend a plan assumes: the one asked for, ``auto`` as DeepEP V2 (``deepep``)."""
    backend = options.moe_flex_dispatcher_backend
    return "deepep" if backend == "auto" else backend


def _round128(n: int) -> int:
    return -(-n // 128) * 128


def _align(n: int, k: int) -> int:
    return -(-n // k) * k


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


def legacy_buffer_bytes(hidden: int, ranks: int, num_sms: int) -> int:
    """DeepEP v1: NVLink + RDMA buffer + workspace for ``ranks`` (ValueError for a group it has no config for)."""
    if ranks not in DISPATCH or ranks not in COMBINE:
        raise ValueError(f"--moe-token-dispatcher-type=flex: DeepEP has no config for {ranks} ranks (etp x ep); "
                         f"it supports {', '.join(map(str, sorted(set(DISPATCH) & set(COMBINE))))}")
    nvl = rdma = 0
    for nvl_recv, rdma_send, rdma_recv in (DISPATCH[ranks], COMBINE[ranks]):
        nvl = max(nvl, nvl_hint(num_sms, nvl_recv, hidden * 2, ranks))
        rdma = max(rdma, rdma_hint(num_sms, rdma_send, rdma_recv, hidden * 2, ranks))
    return nvl + rdma + WORKSPACE


def v2_token_bytes(hidden_bytes: int, sf_bytes: int, topk: int, with_metadata: bool) -> int:
    """One token's slot in an ``ElasticBuffer`` (``TokenLayout::get_num_bytes``): hidden, scales, metadata."""
    meta = topk * 8 + ((1 + topk) * 4 if with_metadata else 0)
    return _align(hidden_bytes, TMA_ALIGN) + _align(sf_bytes, TMA_ALIGN) + _align(meta, TMA_ALIGN)


def v2_domains(ranks: int, nvl_ranks: int, hybrid: bool) -> tuple[int, int, bool]:
    """(scale-out, scale-up ranks, scale-up is NVLink) of a group of ``ranks`` with ``nvl_ranks`` per node."""
    nodes = max(ranks // nvl_ranks, 1)
    if hybrid:
        return nodes, ranks // nodes, True
    return 1, ranks, nodes == 1


def v2_buffer_bytes(hidden: int, tokens: int, topk: int, ranks: int, nvl_ranks: int, hybrid: bool = True,
                    fp8: bool = False) -> int:
    """``get_buffer_size_hint`` (allow_multiple_reduction) + the workspace, for one ``ElasticBuffer``."""
    out, up, nvlink = v2_domains(ranks, nvl_ranks, hybrid)
    elem, packs = (1, -(-hidden // 32)) if fp8 else (2, 0)
    d_tok = v2_token_bytes(hidden * elem, packs * 4, topk, True)
    c_tok = v2_token_bytes(hidden * 2, 0, topk, False)
    if out == 1:
        dispatch = d_tok * tokens * ((0 if nvlink else 1) + up)
        combine = c_tok * tokens * ((0 if nvlink else ranks) + min(ranks, topk))
    else:
        dispatch = d_tok * (up * out * tokens + tokens + out * (tokens + MAX_CHANNELS))
        combine = c_tok * (min(up, topk) * out * tokens + min(out, topk) * tokens + out * (tokens + MAX_CHANNELS))
    return _align(max(dispatch, combine), V2_ALIGNMENT) + V2_WORKSPACE


def v2_receive_rows(tokens: int, topk: int, ranks: int, local_experts: int, alignment: int = 1) -> int:
    """Rows a sync-free expanded dispatch allocates (buffer.hpp:1066-1070): the worst case."""
    rows = ranks * tokens * min(topk, local_experts) + (alignment - 1) * local_experts
    return _align(rows, alignment)


def routed_tokens(config: RunConfig, sizes: ParallelSizes) -> int:
    """Tokens one rank routes per MoE call (DeepEP V2's ``num_max_tokens_per_rank``)."""
    t = config.train
    return max(1, t.micro_batch_size * t.seq_length // (sizes.tp * sizes.cp))


def sync_free(options: ModelOptions, fp8_gemms: bool) -> bool:
    """V2's dispatch runs without the CPU sync (``dispatch.config.FlexOptions.cpu_sync_for``, the one rule)."""
    return not options.flex.cpu_sync_for(options.gemm_backend.needs_host_counts or fp8_gemms)


def deepep_buffer_bytes(config: RunConfig, sizes: ParallelSizes, gpus_per_node: int = NVL_PEERS) -> int:
    """The flex dispatcher's DeepEP buffer (+ workspace) on one GPU of the etp x ep group (0 for one rank)."""
    ranks = sizes.ep * sizes.etp
    if ranks == 1:
        return 0
    m, o = config.model, config.options
    if planned_backend(o) == "deepep-legacy":
        return legacy_buffer_bytes(m.moe_latent_size or m.hidden_size, ranks, o.moe_deepep_num_sms or 20)
    nvl = min(ranks, gpus_per_node)
    return v2_buffer_bytes(m.moe_latent_size or m.hidden_size, routed_tokens(config, sizes), m.moe_topk * sizes.etp,
                           ranks, nvl,
                           hybrid=o.moe_deepep_mode == "hybrid")

"""The collectives a planned layout's code paths make (``planner.collective.Collective``: one call, its
group, operation, bytes and phase), read off the code paths that make them.

Per micro-batch, per transformer block (``block_collectives``), following:

- ``dense.linear``/``attention``/``mla``/``mlp``/``moe.shared_experts``: with sequence parallelism the block's
  input is all-gathered along the sequence before the column-parallel GEMMs (backward: reduce-scatter, and the
  shard they kept all-gathered again for their weight gradients) and the
  row-parallel output reduce-scattered (backward: all-gather); without it the input enters through
  ``copy_to_region`` (backward all-reduce) and the output is all-reduced. MLA gathers only its latents and the
  rope key; GQA with fewer kv heads than tp all-reduces the k/v weight gradients, qk-norm the norm weights'.
- ``dense.cp_fused`` (the CP attention the model runs): p2p sends K and V to the next CP rank cp-1 times forward;
  backward sends them cp-1 times again and the fp32 dK/dV accumulators cp times; all_gather mode all-gathers K
  and V (backward: reduce-scatter). Head dims are padded as the attention kernel of ``device_type`` pads them.
- ``moe.layer``/``dispatch.*`` with balanced routing (every expert receives T*K/E copies from every rank, as
  ``--moe-router-force-load-balancing`` makes exact): alltoall gathers the per-expert counts over etp x ep,
  exchanges the T*K token rows over ep (one call, or one per local expert when chunked; FP8 dispatch sends
  ``fp8_exchange.row_bytes`` per row forward, gradients return in the activations' dtype), all-gathers them
  over etp, and mirrors it in the combine; each row's fp32 prob travels beside it by the same collectives
  (the experts apply it; unless ``--moe-apply-probs-on-input``), its gradient back. allgather gathers tokens,
  expert ids and probs in one packed all-gather over etp x ep and reduce-scatters the partial outputs. flex
  (DeepEP) sends a token once per destination rank with its top-k ids and weights (the expected number of
  ranks its k experts live on under uniform routing), on DeepEP V2 in its ``ElasticBuffer`` token slot
  (``_elastic``), FP8 rows with FP8 dispatch, and in hybrid mode once per destination node over the network
  (``NodeDedup``); on the legacy backend with int64 ids; DeepEP's own kernels, and so these bytes, cannot run on a
  CPU: the only volume here that tests/planner/test_comm.py does not measure. The router's loss statistics are
  small all-reduces.
- recompute (``recompute_collectives``): a checkpointed region runs its forward collectives again in backward.
- the embedding (vocab-parallel: all-reduce, or reduce-scatter under SP), the output head (like a column-parallel
  layer) and the vocab-parallel cross-entropy (three fp32 all-reduces of one value per token, one over cp); each
  MTP depth repeats them around its block, after shifting its tokens across the cp group.
- pipeline: one activation forward and its gradient backward per micro-batch per stage boundary.

Per step (``grad_sync_collectives``): the distributed optimizer's reduce-scatter of every gradient bucket and
all-gather of every parameter bucket over the reduction group of its kind (dense: dp x cp; sp: tp x cp x dp;
expert: edp), buckets padded as ``training.optim.buffers`` pads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from moefold.dense.attention_config import MLAConfig
from moefold.dense.attention_kernels import attention_kernel
from moefold.dense.recompute import recomputed_modules
from moefold.dispatch.fp8_exchange import BLOCK, row_bytes
from moefold.models.layer_factory import attention_config, router_config
from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelSizes
from moefold.planner.collective import FP32, INT32, INT64, Collective, NodeDedup, distinct_ranks
from moefold.planner.deepep import planned_backend, v2_token_bytes
from moefold.training.config import RunConfig
from moefold.training.optim.buffers import ALIGN


@dataclass(frozen=True)
class _Shape:
    """What decides the bytes: sizes, the local sequence ``s`` (CP part), tokens in a TP region, dtype."""

    config: RunConfig
    sizes: ParallelSizes
    options: ModelOptions
    b: int
    s: int
    sp: bool
    a: int              # bytes per activation / parameter element
    device_type: str

    @property
    def tokens(self) -> int:
        """Tokens a TP region computes on (the whole CP part, after the SP all-gather)."""
        return self.s * self.b

    @property
    def routed(self) -> int:
        """Tokens this rank routes (its SP shard, or its 1/tp slice without SP)."""
        return self.tokens // self.sizes.tp


def _shape(config: RunConfig, sizes: ParallelSizes, device_type: str) -> _Shape:
    from moefold.training.build import model_options

    options = model_options(config)
    a = torch.empty((), dtype=options.torch_dtype).element_size()
    return _Shape(config=config, sizes=sizes, options=options, b=config.train.micro_batch_size,
                  s=config.train.seq_length // sizes.cp, sp=options.sequence_parallel and sizes.tp > 1, a=a,
                  device_type=device_type)


def _fwd_bwd(group: str, fwd: str, bwd: str, nbytes: int, region: str, what: str) -> list[Collective]:
    """A collective forward and its adjoint backward (either op may be None)."""
    out = []
    if fwd:
        out.append(Collective(group, fwd, nbytes, "forward", region, what))
    if bwd:
        out.append(Collective(group, bwd, nbytes, "backward", region, what))
    return out


def _enter_tp(sh: _Shape, width: int, region: str, what: str, original: bool = False) -> list[Collective]:
    """A TP region's input ``[tokens, width]``: SP all-gather (backward reduce-scatter, and one all-gather of what
    the GEMMs kept, their shard, for the weight gradients: ``parallel.sequence_input``; under FP8 their quantised
    rows, 1 byte an element, unless they keep the ``original`` input), else ``copy_to_region``."""
    if sh.sizes.tp == 1:
        return []
    nbytes = sh.tokens * width * sh.a
    if sh.sp:
        chosen = recomputed_modules(sh.options.recompute, sh.options.recompute_modules)
        quantised = sh.options.fp8.enabled and not original and "layernorm" not in chosen
        kept = sh.tokens * width if quantised else nbytes
        again = Collective("tp", "all_gather", kept, "backward", region, f"{what} again (weight gradient)")
        return [*_fwd_bwd("tp", "all_gather", "reduce_scatter", nbytes, region, what), again]
    return _fwd_bwd("tp", None, "all_reduce", nbytes, region, what)


def _leave_tp(sh: _Shape, width: int, region: str, what: str, trails: tuple[str, ...] = ()) -> list[Collective]:
    """A row-parallel output ``[tokens, width]``: SP reduce-scatter (backward all-gather), else all-reduce."""
    if sh.sizes.tp == 1:
        return []
    nbytes = sh.tokens * width * sh.a
    out = (_fwd_bwd("tp", "reduce_scatter", "all_gather", nbytes, region, what) if sh.sp
           else _fwd_bwd("tp", "all_reduce", None, nbytes, region, what))
    return [replace(c, trails=trails) if c.phase == "forward" else c for c in out]


# ----------------------------------------------------------------------------------------------- attention
def _cp(sh: _Shape, heads: int, d_qk: int, d_v: int) -> list[Collective]:
    """K ``[b, heads, s, d_qk]`` and V ``[b, heads, s, d_v]`` across the cp group (``dense.cp_fused``)."""
    cp = sh.sizes.cp
    if cp == 1:
        return []
    kernel = attention_kernel(sh.device_type, sh.options.torch_dtype, max(d_qk, d_v))
    d_qk, d_v = kernel.padded_head_dims(d_qk, d_v)
    k, v = sh.b * heads * sh.s * d_qk, sh.b * heads * sh.s * d_v
    if sh.options.cp_comm == "all_gather":
        return [c for n, what in ((k, "K"), (v, "V"))
                for c in _fwd_bwd("cp", "all_gather", "reduce_scatter", n * cp * sh.a, "core_attn", what)]
    out = []
    for _ in range(cp - 1):   # ring steps, forward and again in backward with the blocks
        for phase in ("forward", "backward"):
            out += [Collective("cp", "send", n * sh.a, phase, "core_attn", f"{what} block")
                    for n, what in ((k, "K"), (v, "V"))]
    for _ in range(cp):       # backward: the fp32 dK/dV accumulators follow their blocks home
        out += [Collective("cp", "send", n * FP32, "backward", "core_attn", f"d{what} accumulator")
                for n, what in ((k, "K"), (v, "V"))]
    return out


def attention_collectives(config: RunConfig, sizes: ParallelSizes, device_type: str = "cuda") -> list[Collective]:
    """One micro-batch through one attention module (GQA or MLA), forward and backward."""
    sh = _shape(config, sizes, device_type)
    att = attention_config(config.model, sh.options)
    tp, H = sizes.tp, config.model.hidden_size
    heads = att.num_heads // tp
    if isinstance(att, MLAConfig):
        out = []
        if tp > 1:
            rope = sh.tokens * att.qk_rope_head_dim * sh.a
            out += (_fwd_bwd("tp", "all_gather", "reduce_scatter", rope, "attention", "rope key") if sh.sp
                    else _fwd_bwd("tp", None, "all_reduce", rope, "attention", "rope key"))
        out += _enter_tp(sh, att.q_lora_rank or H, "mla_up_proj", "q latent" if att.q_lora_rank else "q input")
        out += _enter_tp(sh, att.kv_lora_rank, "mla_up_proj", "kv latent")
        out += _cp(sh, heads, att.qk_head_dim, att.v_head_dim)
        return out + _leave_tp(sh, att.hidden_size, "attention", "o_proj output")
    d, g = att.head_dim_resolved, att.kv_heads
    replicated = g % tp != 0
    out = _enter_tp(sh, H, "attention", "qkv input")
    if tp > 1 and replicated:   # the full k/v weights enter through copy_to_region: gradients all-reduced
        for name in ("k_proj", "v_proj"):
            out.append(Collective("tp", "all_reduce", g * d * H * sh.a, "backward", "attention", f"{name} weight"))
            if att.bias:
                out.append(Collective("tp", "all_reduce", g * d * sh.a, "backward", "attention", f"{name} bias"))
    if tp > 1 and att.qk_norm and att.qk_norm_scope == "projection":
        # weights over every head; the per-token sums of squares all-reduced (forward) with their gradient
        # (backward), for k only when its heads are split (replicated kv: each rank projects them all)
        out += [Collective("tp", "all_reduce", n * d * sh.a, "backward", "attention", f"{name} weight")
                for name, n in (("q_norm", att.num_heads), ("k_norm", g))]
        for name in ("q",) if replicated else ("q", "k"):
            out += _fwd_bwd("tp", "all_reduce", "all_reduce", sh.tokens * FP32, "attention", f"{name} sum of squares")
    elif tp > 1 and att.qk_norm:
        out += [Collective("tp", "all_reduce", d * sh.a, "backward", "attention", f"{n} weight")
                for n in ("q_norm", "k_norm")]
    out += _cp(sh, 1 if replicated else g // tp, d, d)
    return out + _leave_tp(sh, H, "attention", "o_proj output")


# ----------------------------------------------------------------------------------------------- FFNs
def _mlp(sh: _Shape, region: str, original: bool = False) -> list[Collective]:
    """A TP MLP: one column-parallel entry shared by gate and up (``original``: they keep their input itself, the
    shared experts' under FP8). The down-projection's output collective ends the dense MLP (and its block); the
    shared experts' runs before the MoE layer's combine."""
    H = sh.config.model.hidden_size
    out = _enter_tp(sh, H, region, "input", original)
    trails = ("mlp", "block") if region == "mlp" else ("shared_experts",)
    return out + _leave_tp(sh, H, region, "down_proj output", trails)


def _dispatch(sh: _Shape) -> list[Collective]:
    """The token dispatcher's collectives for this rank's routed tokens (module docstring)."""
    m, s = sh.config.model, sh.sizes
    # the rows' width (latent experts: the exchange moves moe_latent_size-wide rows, moe.latent)
    E, K, H, ep, etp = m.num_experts, m.moe_topk, m.moe_latent_size or m.hidden_size, s.ep, s.etp
    W, e, T = ep * etp, E // ep, sh.routed
    kind = sh.options.resolved_dispatcher(ep, etp)
    fp8 = sh.options.fp8.dispatch
    if W == 1:
        return []
    rows = T * K
    if m.moe_expert_capacity_factor is not None:
        cap = math.ceil(T * K / E * m.moe_expert_capacity_factor)
        rows = E * cap if m.moe_pad_expert_input_to_capacity else min(rows, E * cap)
    weighted = not m.moe_apply_probs_on_input
    if kind == "allgather":
        row = (row_bytes(H) if fp8 else H * sh.a) + K * INT32 + (K * FP32 if weighted else 0)
        out = [Collective("etp_ep", "all_gather", W * (E + 2) * INT64, "forward", "dispatch", "counts, T, capacity"),
               Collective("etp_ep", "all_gather", W * T * row, "forward", "dispatch", "tokens, ids, probs")]
        if weighted and sh.a == FP32:
            out.append(Collective("etp_ep", "reduce_scatter", W * T * (H + K) * FP32, "backward", "dispatch",
                                  "token and prob gradients"))
        else:
            out.append(Collective("etp_ep", "reduce_scatter", W * T * H * sh.a, "backward", "dispatch",
                                  "token gradients"))
            if weighted:
                out.append(Collective("etp_ep", "reduce_scatter", W * T * K * FP32, "backward", "dispatch",
                                      "prob gradients"))
        return out + _fwd_bwd("etp_ep", "reduce_scatter", "all_gather", W * T * H * sh.a, "dispatch",
                              "partial outputs")
    if kind == "flex" and planned_backend(sh.options) == "deepep":
        return _elastic(sh, fp8)
    if kind == "flex":
        # DeepEP v1: a token travels once per destination rank with its k*etp virtual ids (int64) and weights (fp32)
        Kv = K * etp
        sent = T * etp * distinct_ranks(E, K, e, ep)
        tok, meta = H * 2, Kv * (INT64 + FP32)
        return [Collective("etp_ep", "all_to_all", round(sent * (tok + meta)), "forward", "dispatch",
                           "DeepEP dispatch", overlaps="shared_experts"),
                Collective("etp_ep", "all_to_all", round(sent * tok), "forward", "dispatch", "DeepEP combine"),
                Collective("etp_ep", "all_to_all", round(sent * (tok + Kv * FP32)), "backward", "dispatch",
                           "DeepEP combine of the gradients"),
                Collective("etp_ep", "all_to_all", round(sent * tok), "backward", "dispatch",
                           "DeepEP cached dispatch of the gradients")]
    # alltoall
    out = []
    if not m.moe_pad_expert_input_to_capacity:
        out.append(Collective("etp_ep", "all_gather", W * E * INT64, "forward", "dispatch", "per-expert counts"))
    if ep > 1:
        chunks = e if (etp == 1 and 1 < e <= 8) else 1   # AllToAllDispatcher's max_chunked_experts default
        fwd_row = row_bytes(H) if fp8 else H * sh.a
        for _ in range(chunks):
            out.append(Collective("ep", "all_to_all", rows // chunks * fwd_row, "forward", "dispatch", "tokens",
                                  overlaps="shared_experts"))
            out += _fwd_bwd("ep", "all_to_all", "all_to_all", rows // chunks * H * sh.a, "dispatch", "outputs home")
            out.append(Collective("ep", "all_to_all", rows // chunks * H * sh.a, "backward", "dispatch",
                                  "token gradients"))
            if weighted:   # each row's fp32 prob beside it (the experts apply it), its gradient back
                out += _fwd_bwd("ep", "all_to_all", "all_to_all", rows // chunks * FP32, "dispatch", "row probs")
    if etp > 1:
        out += _fwd_bwd("etp", "all_gather", "reduce_scatter", etp * rows * H * sh.a, "dispatch", "rows over etp")
        if weighted:
            out += _fwd_bwd("etp", "all_gather", "reduce_scatter", etp * rows * FP32, "dispatch", "row probs over etp")
        out += _fwd_bwd("etp", "reduce_scatter", "all_gather", etp * rows * H * sh.a, "dispatch", "partial outputs")
    return out


def _elastic(sh: _Shape, fp8: bool) -> list[Collective]:
    """DeepEP V2 (``dispatch.deepep_elastic``): each token once per destination rank, in its ``ElasticBuffer`` slot
    (``planner.deepep.v2_token_bytes``: hidden, FP8 scales, top-k ids, weights and source metadata, each
    32-byte aligned); forward: the dispatch (e4m3 rows with FP8 dispatch) and the combine (bf16, slots of ids and
    weights); backward: the combine of the gradients (weights reduced alongside) and the cached dispatch of the
    gradients (bf16). In hybrid mode across nodes a token crosses the network once per destination node."""
    m, s = sh.config.model, sh.sizes
    E, K, H, ep, etp = m.num_experts, m.moe_topk, m.moe_latent_size or m.hidden_size, s.ep, s.etp
    T, Kv = sh.routed, K * etp
    sent = T * etp * distinct_ranks(E, K, E // ep, ep)
    packs = H // BLOCK if H % BLOCK == 0 else 1    # dispatch.fp8_exchange's fp32 scales per row
    fwd = v2_token_bytes(H * (1 if fp8 else 2), packs * 4 if fp8 else 0, Kv, True)
    bwd_dispatch = v2_token_bytes(H * 2, 0, Kv, True)
    combine = v2_token_bytes(H * 2, 0, Kv, False)
    hybrid = sh.options.moe_deepep_mode == "hybrid"

    def exchange(row: int, phase: str, what: str, overlaps: str = "") -> Collective:
        dedup = NodeDedup(T, row, E, K) if hybrid else None
        return Collective("etp_ep", "all_to_all", round(sent * row), phase, "dispatch", what, overlaps=overlaps,
                          hybrid=dedup)

    return [exchange(fwd, "forward", "DeepEP V2 dispatch", overlaps="shared_experts"),
            exchange(combine, "forward", "DeepEP V2 combine"),
            exchange(combine, "backward", "DeepEP V2 combine of the gradients"),
            exchange(bwd_dispatch, "backward", "DeepEP V2 cached dispatch of the gradients")]


def _router(sh: _Shape) -> list[Collective]:
    coeffs = router_config(sh.config.model, sh.options).loss_coeffs()
    E, s = sh.config.model.num_experts, sh.sizes
    out = []
    if s.tp * s.cp > 1 and "aux_loss" in coeffs:
        out.append(Collective("tp_cp", "all_reduce", E * INT64, "forward", "router", "aux-loss counts"))
    if s.tp * s.cp > 1 and "seq_aux_loss" in coeffs:
        out.append(Collective("tp_cp", "all_reduce", sh.b * (E + 1) * FP32, "forward", "router", "seq-aux statistics"))
    if s.tp * s.cp * s.dp > 1 and "global_aux_loss" in coeffs:
        out.append(Collective("tp_cp_dp", "all_reduce", E * INT64, "forward", "router", "global-aux counts"))
    return out


def moe_collectives(config: RunConfig, sizes: ParallelSizes, device_type: str = "cuda") -> list[Collective]:
    """One micro-batch through one MoE layer (router, dispatcher, shared experts), forward and backward."""
    sh = _shape(config, sizes, device_type)
    H = config.model.hidden_size
    out = []
    if sizes.tp > 1 and not sh.sp:   # each tp rank routes a 1/tp slice of the replicated tokens
        out += _fwd_bwd("tp", None, "all_gather", sh.tokens * H * sh.a, "moe", "token slice input gradient")
        out.append(Collective("tp", "all_gather", sh.tokens * H * sh.a, "forward", "moe", "routed output",
                              trails=("moe", "block")))
    out += _router(sh) + _dispatch(sh)
    if config.model.moe_expert_linear_bias and sizes.etp > 1:   # w2_bias enters through copy_to_region over etp
        e = config.model.num_experts // sizes.ep
        out.append(Collective("etp", "all_reduce", e * H * sh.a, "backward", "moe", "expert down-projection bias"))
    if config.model.moe_shared_expert_ffn_size:
        out += _mlp(sh, "shared_experts", original=True)
    return out


def mlp_collectives(config: RunConfig, sizes: ParallelSizes, device_type: str = "cuda") -> list[Collective]:
    """One micro-batch through one dense MLP, forward and backward."""
    return _mlp(_shape(config, sizes, device_type), "mlp")


def block_collectives(config: RunConfig, sizes: ParallelSizes, moe: bool,
                      device_type: str = "cuda") -> list[Collective]:
    """One micro-batch through one transformer block (attention + MoE or dense FFN), forward and backward,
    without what recompute repeats (``recompute_collectives``)."""
    ffn = moe_collectives if moe else mlp_collectives
    return attention_collectives(config, sizes, device_type) + ffn(config, sizes, device_type)


def recompute_collectives(collectives: list[Collective], options: ModelOptions, *, full: bool, moe: bool,
                          last_in_checkpoint: bool = True) -> list[Collective]:
    """The forward collectives of one block (``collectives``) that recomputation runs again during its backward.

    ``full``: the block is (part of) a full-recompute checkpoint, else the regions selective recompute
    checkpoints. Non-reentrant checkpointing stops recomputing after the last tensor the checkpoint saved, so a
    collective that trails it (``Collective.trails``: the row-parallel output ending a dense MLP, the routed
    output gather without SP) is not run again when it ends the checkpoint (``last_in_checkpoint``: the block
    is the last of its full-recompute group)."""
    chosen = recomputed_modules(options.recompute, options.recompute_modules)
    scopes: list[tuple[str, set[str] | None]] = [("block", None)] if full else []
    if not full:
        scopes += [(name, {name}) for name in ("core_attn", "mla_up_proj") if name in chosen]
        if moe and "moe" in chosen:
            scopes.append(("moe", {"moe", "dispatch", "router", "shared_experts"}))
        elif moe and "shared_experts" in chosen:
            scopes.append(("shared_experts", {"shared_experts"}))
        if not moe and "mlp" in chosen:
            scopes.append(("mlp", {"mlp"}))
    return [replace(c, phase="backward", what=f"recompute: {c.what}", trails=(), overlaps="")
            for c in collectives if c.phase == "forward"
            for name, regions in scopes
            if (regions is None or c.region in regions) and not (last_in_checkpoint and name in c.trails)]


def embedding_collectives(config: RunConfig, sizes: ParallelSizes) -> list[Collective]:
    """The vocab-parallel embedding of one micro-batch (``dense.embedding``)."""
    sh = _shape(config, sizes, "cuda")
    return _leave_tp(sh, config.model.hidden_size, "embedding", "embedding partial sums")


def head_collectives(config: RunConfig, sizes: ParallelSizes) -> list[Collective]:
    """The output head and the vocab-parallel cross-entropy of one micro-batch (``dense.cross_entropy``)."""
    sh = _shape(config, sizes, "cuda")
    out = _enter_tp(sh, config.model.hidden_size, "head", "head input")
    if sizes.tp > 1:
        out += [Collective("tp", "all_reduce", sh.tokens * FP32, "forward", "head", what)
                for what in ("max logit", "target logit", "sum of exponentials")]
    if sizes.cp > 1:
        out.append(Collective("cp", "all_reduce", 2 * FP32, "forward", "head", "loss sum and token count"))
    return out


def mtp_collectives(config: RunConfig, sizes: ParallelSizes, device_type: str = "cuda") -> list[Collective]:
    """One multi-token-prediction depth of one micro-batch (``models.mtp``, ``MoEDecoder._mtp_loss``): under CP the
    token ids, labels and loss mask shifted across the cp group (all-gathers), the embedding again, its block
    (with what full or selective recompute repeats; the block is its own checkpoint), the head and the loss."""
    sh = _shape(config, sizes, device_type)
    out = []
    if sizes.cp > 1:
        out += [Collective("cp", "all_gather", sizes.cp * sh.tokens * nbytes, "forward", "mtp", f"shifted {what}")
                for what, nbytes in (("token ids", INT64), ("labels", INT64), ("loss mask", FP32))]
    moe = config.model.num_experts > 0
    block = block_collectives(config, sizes, moe, device_type)
    block += recompute_collectives(block, sh.options, full=sh.options.recompute == "full", moe=moe)
    return out + embedding_collectives(config, sizes) + block + head_collectives(config, sizes)


def pipeline_collectives(config: RunConfig, sizes: ParallelSizes, model_chunk: int,
                         num_model_chunks: int) -> list[Collective]:
    """What model chunk ``model_chunk`` (of ``num_model_chunks`` = pp x vpp) sends per micro-batch
    (``pipeline.p2p``): its output activation to the next chunk (forward) unless it is the last, the gradient of
    its input to the previous one (backward) unless it is the first; ``[s/tp or s, b, H]`` in the model dtype."""
    sh = _shape(config, sizes, "cuda")
    nbytes = (sh.s // sizes.tp if sh.sp else sh.s) * sh.b * config.model.hidden_size * sh.a
    out = []
    if model_chunk < num_model_chunks - 1:
        out.append(Collective("pp", "send", nbytes, "forward", "pipeline", "activation"))
    if model_chunk > 0:
        out.append(Collective("pp", "send", nbytes, "backward", "pipeline", "activation gradient"))
    return out


KIND_GROUPS = {"dense": "dp_cp", "sp": "tp_cp_dp", "expert": "edp"}


def grad_sync_buckets(config: RunConfig, sizes: ParallelSizes, numel: dict[tuple[str, str], int],
                      ) -> list[tuple[str, str, int, int]]:
    """``grad_sync_collectives``' buckets as runs of equal ones, in the same order: (reduction kind, parameter
    dtype name, how many, padded elements of each)."""
    t = config.train
    group_size = {"dense": sizes.dp * sizes.cp, "sp": sizes.tp * sizes.cp * sizes.dp, "expert": sizes.edp}
    out = []
    for (kind, dtype), n in sorted(numel.items()):
        size = group_size[kind]
        if size == 1 or n == 0:
            continue
        full, rest = divmod(n, t.bucket_numel)
        for count, k in ((full, t.bucket_numel), (int(rest > 0), rest)):
            if count:
                out.append((kind, dtype, count, -(-k // (size * ALIGN)) * size * ALIGN))
    return out


def grad_sync_collectives(config: RunConfig, sizes: ParallelSizes, numel: dict[tuple[str, str], int],
                          ) -> list[Collective]:
    """Per step, the distributed optimizer's reduce-scatter of the gradient buckets and all-gather of the
    parameter buckets; ``numel``: elements per (reduction kind, parameter dtype name) on this rank. Buckets as
    ``training.optim.buffers`` cuts them: ``bucket_numel`` elements (the parameters' own boundaries, which make real
    buckets a little larger, are not known here), padded to a multiple of group size x ALIGN."""
    grad_bytes = torch.empty((), dtype=config.train.optimizer_precision().dtype("main_grads")).element_size()
    out = []
    for kind, dtype, count, padded in grad_sync_buckets(config, sizes, numel):
        p_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}[dtype]
        for _ in range(count):
            out.append(Collective(KIND_GROUPS[kind], "reduce_scatter", padded * grad_bytes, "step", "grad_sync",
                                  f"{kind} {dtype} gradient bucket"))
            out.append(Collective(KIND_GROUPS[kind], "all_gather", padded * p_bytes, "step", "param_sync",
                                  f"{kind} {dtype} parameter bucket"))
    return out

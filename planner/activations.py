"""Activation memory of one micro-batch on one rank: the tensors each module keeps for its backward (bytes).

Every figure here lists what moefold's modules keep for the backward (what autograd saves, or what
``torch.utils.checkpoint`` / ``CheckpointWithoutOutput`` keep instead), read off the code of ``dense/``,
``moe/``, ``dispatch/`` and ``models/``; ``planner.activations_ffn`` does the FFNs and
``planner.profile`` turns the pieces into the peak of a forward and backward. Sizes per rank
(``ActivationShape``)::

    S_c = seq / cp               this rank's sequence (context parallelism)
    T_c = S_c * micro_batch      tokens inside a tensor-parallel region (the sequence gathered under SP)
    T_x = T_c / tp under SP      tokens between regions (the sequence-parallel shard), else T_c
    T_r = T_c / tp if tp > 1     tokens this rank routes (the SP shard; without SP a 1/tp slice)
    a                            bytes of the model dtype (fp32 4, bf16 2)

RMSNorm keeps its input (in its own dtype; a view keeps its whole base alive) and the fp32 inverse RMS per row,
and recomputes the normalised value in its backward (``dense.norm._RMSNormFunction``, as Transformer Engine's
RMSNorm saves ``x`` and ``rstdevs``). A norm's output is kept only by consumers that save their input directly
(no all-gather in between), and ``layernorm`` recompute frees it (Megatron's output-discarding checkpoint).

Core attention: a fused kernel (CUDA's FlashAttention-2 / memory-efficient kernel; on CPU
``_scaled_dot_product_flash_attention_for_cpu`` when q/k and v share a head dim) keeps q, k, v, its output and
the fp32 log-sum-exp; under context parallelism moefold's fused blocks pad v's head dim to q's where the kernel
needs one head dim and keep the padded q, k, v (all-gathered k, v in ``all_gather`` mode). Torch's math path
(the CPU's choice for MLA's unequal head dims) keeps fp32 scaled q and k, the fp32 ``[S_c, S_c]``
probabilities of every head, v and its output instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from moefold.dense.recompute import recomputed_modules
from moefold.models.config import ModelConfig
from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelSizes
from moefold.training.config import RunConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ALIASED_OUTPUT = "attention output (= o_proj input)"
NOT_OFFLOADED = "(not offloadable)"   # a holder of a saved tensor that is no offload module (Part.offload)


@dataclass(frozen=True)
class Part:
    """A piece of a chunk's forward (attention, FFN, norm, embedding, head) as the memory profile sees it.

    saved:      tensors left for the backward, bytes by name
    fwd_extra:  the most its forward holds at once beyond what it leaves (``saved``)
    bwd_extra:  the most its backward holds at once beyond ``saved`` (gradients, weight gradients on their way
                to the main grads, activations a recompute brings back)
    offload:    saved name -> the modules that save that tensor, as offload modules (``dense.activation_offload``):
                all of them offloaded take it off the device, each offloaded one copies it to host memory; a
                holder that cannot be offloaded is ``NOT_OFFLOADED`` (names missing: only such holders)
    layer:      the transformer block it belongs to (None: embedding, head, pipeline buffers)
    """

    name: str
    saved: dict[str, int] = field(default_factory=dict)
    fwd_extra: int = 0
    bwd_extra: int = 0
    offload: dict[str, tuple[str, ...]] = field(default_factory=dict)
    layer: int | None = None

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())

    def offloaded_bytes(self, modules: frozenset[str]) -> int:
        """Bytes of ``saved`` that offloading ``modules`` takes off the device."""
        return sum(self.saved[k] for k, needs in self.offload.items() if k in self.saved and set(needs) <= modules)

    def host_bytes(self, modules: frozenset[str]) -> int:
        """Bytes offloading ``modules`` copies to host memory (a tensor once per offloaded module that saves it)."""
        return sum(self.saved[k] * len(modules.intersection(needs)) for k, needs in self.offload.items()
                   if k in self.saved)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


_HASHES: dict[int, tuple[object, int]] = {}


def _identity_hash(obj: object) -> int:
    """``hash(obj)``, computed once per object (kept alive here, so its id is never reused)."""
    entry = _HASHES.get(id(obj))
    if entry is None or entry[0] is not obj:
        entry = _HASHES[id(obj)] = (obj, hash(obj))
    return entry[1]


@dataclass(frozen=True)
class ActivationShape:
    """What the activations of one micro-batch on one rank depend on. ``device_type`` picks the attention
    kernels (see the module docstring): "cuda" for the planned GPUs, "cpu" to reproduce a CPU measurement."""

    model: ModelConfig
    options: ModelOptions
    tp: int
    cp: int
    ep: int
    etp: int
    micro_batch: int
    seq_length: int
    device_type: str = "cuda"
    max_load_ratio: float = 1.0   # the worst expert's copies over the mean (--moe-max-load-ratio; 1: balanced)

    def __hash__(self) -> int:   # the planner caches per shape: hash the (large) model config once per object
        return hash((_identity_hash(self.model), _identity_hash(self.options), self.tp, self.cp, self.ep, self.etp,
                     self.micro_batch, self.seq_length, self.device_type, self.max_load_ratio))

    @cached_property
    def a(self) -> int:
        return DTYPE_BYTES[self.options.dtype]

    @cached_property
    def sp(self) -> bool:
        return self.options.sequence_parallel and self.tp > 1

    @cached_property
    def S_c(self) -> int:
        return self.seq_length // self.cp

    @cached_property
    def T_c(self) -> int:
        return self.S_c * self.micro_batch

    @cached_property
    def T_x(self) -> int:
        return self.T_c // self.tp if self.sp else self.T_c

    @cached_property
    def T_r(self) -> int:
        return self.T_c // self.tp if self.tp > 1 else self.T_c

    @cached_property
    def chosen(self) -> frozenset[str]:
        """Selective recompute's modules (``dense.recompute.recomputed_modules``)."""
        return recomputed_modules(self.options.recompute, self.options.recompute_modules)

    @cached_property
    def fp8(self) -> bool:
        """FP8 / FP4 GEMMs in the linears and experts: they keep their inputs as quantised copies (``quantised``)."""
        return self.options.fp8.enabled

    # ------------------------------------------------------------------------------------ shared pieces
    def quantised(self, rows: int, cols: int, scale_rows: int | None = None, groups: int = 1) -> int:
        """Bytes of the quantised copy of a GEMM's ``[rows, cols]`` input that its FP8 GEMM keeps for the weight
        gradient (``execution.fp8_linear``, ``precision.block_linear``, ``moe.fp8_gemm``, ``moe.block_gemm``;
        Transformer Engine's column-wise copy): 1 byte an element (NVFP4's e2m1: half a byte packed by TE, 1 as
        torchao's codes), and its scales, over the tokens: one per tensor (tensorwise, delayed), one fp32 per
        column (rowwise), one per b x 1 tile (blockwise 128: fp32; mxfp8 32: e8m0; nvfp4 16: e4m3, and an fp32
        tensor scale). ``scale_rows``: the rows the scales cover (an SP shard's copy keeps the gathered rows'
        scales), default ``rows``; ``groups``: the experts with scales of their own (each expert's tiles restart
        at its first row)."""
        f = self.options.fp8
        recipe = str(f.recipe)
        r = scale_rows or rows
        tiles = {"blockwise": (128, 4), "mxfp8": (32, 1), "nvfp4": (16, 1)}
        if recipe in tiles:
            b, scale_bytes = tiles[recipe]
            scales = scale_bytes * (-(-r // b) + groups - 1) * cols + (4 * groups if recipe == "nvfp4" else 0)
        else:
            scales = 4 * groups * (cols if recipe == "rowwise" else 1)
        packed = recipe == "nvfp4" and str(f.backend) == "te"
        return (rows * cols // 2 if packed else rows * cols) + scales

    def gemm_input(self, rows: int, cols: int, scale_rows: int | None = None) -> int:
        """What a linear keeps of its ``[rows, cols]`` input: the model dtype, or the quantised copy under FP8."""
        return self.quantised(rows, cols, scale_rows) if self.fp8 else self.a * rows * cols

    def norm(self, tokens: int, width: int, prefix: str) -> dict[str, int]:
        """An RMSNorm's own tensors: its input and the fp32 inverse RMS (its output is its consumers' to keep)."""
        return {f"{prefix} input": self.a * tokens * width, f"{prefix} rsqrt": 4 * tokens}

    def gemm_backward(self, rows: int, d_in: int, d_out: int, weight: int) -> int:
        """A linear layer's backward: output gradient, input gradient, weight gradient (``weight`` elements)."""
        return self.a * (rows * (d_in + d_out) + weight)

    def kernel(self, d_qk: int, d_v: int) -> str:
        """"fused" or "math" (see the module docstring)."""
        if self.device_type == "cpu" and d_qk != d_v and self.cp == 1:
            return "math"
        return "fused"

    def padded_dims(self, d_qk: int, d_v: int) -> tuple[int, int]:
        """Head dims the fused kernels compute with: one head dim (v zero-padded) except CUDA's memory-efficient
        kernel, which moefold uses for fp32 or head dims over 256 (``dense.attention_kernels``)."""
        if self.cp == 1:
            return d_qk, d_v
        if self.device_type == "cpu":
            d = max(d_qk, d_v)
            return d, d
        if self.a == 4 or _round_up(max(d_qk, d_v), 8) > 256:
            return _round_up(d_qk, 8), _round_up(d_v, 8)
        d = _round_up(max(d_qk, d_v), 8)
        return d, d

    # ------------------------------------------------------------------------------------ core attention
    def core_attention(self, heads: int, kv_heads: int, d_qk: int, d_v: int, *, qkv_discarded: bool = False,
                       ) -> Part:
        """Core attention of this rank's heads with its q, k, v (``kv_heads`` per rank; MLA: one per head).

        ``qkv_discarded``: q, k, v are the outputs of MLA's ``mla_up_proj`` region, freed once saved."""
        a, B, S, cp = self.a, self.micro_batch, self.S_c, self.cp
        T = self.T_c
        recompute = "core_attn" in self.chosen
        qkv = {"q": a * T * heads * d_qk, "k": a * T * kv_heads * d_qk, "v": a * T * kv_heads * d_v}
        if qkv_discarded:
            qkv = dict.fromkeys(qkv, 0)
        saved: dict[str, int] = {}
        if self.kernel(d_qk, d_v) == "math":
            probs = 4 * B * heads * S * S
            inner = {"attention scaled q, k (fp32)": 2 * 4 * T * heads * d_qk, "attention probabilities": probs,
                     "attention output": a * T * heads * d_v}
            if a != 4:
                inner["attention v (fp32)"] = 4 * T * kv_heads * d_v
            saved.update(qkv if recompute else {"v": qkv["v"]})
            grads = 2 * probs + a * T * heads * (2 * d_qk + d_v)
        else:
            dq, dv = self.padded_dims(d_qk, d_v)
            padded = (dq, dv) != (d_qk, d_v)
            kv_len = S * cp if cp > 1 and self.options.cp_comm == "all_gather" else S
            # the kernels' output is laid out [B, S, h, d]: with one head dim and no CP, o_proj's input is a view of
            # it (the same tensor, which core attention keeps too)
            out_key = ALIASED_OUTPUT if not padded and cp == 1 else "attention output"
            inner = {out_key: a * T * heads * dv, "attention lse": 4 * B * heads * S}
            if padded:
                inner["attention padded q, k, v"] = a * T * (heads * dq + kv_heads * (dq + dv))
            if kv_len != S:
                inner["attention gathered k, v"] = a * B * kv_len * kv_heads * (dq + dv)
            if kv_len != S and not recompute:   # all_gather mode keeps the gathered k, v instead of its own
                qkv["k"] = qkv["v"] = 0
            saved.update(qkv if recompute or not padded else {})
            grads = a * T * heads * (dq + dv) + a * B * kv_len * kv_heads * (dq + dv)
            if cp > 1:   # fp32 accumulators of dq, dk, dv; p2p: the next K/V block and dK/dV on their way round
                grads += 4 * T * (heads * dq + kv_heads * (dq + dv))
                if self.options.cp_comm == "p2p":
                    grads += a * T * kv_heads * (dq + dv) + 4 * T * kv_heads * (dq + dv)
        if recompute:
            return Part("core attention", saved, fwd_extra=sum(inner.values()), bwd_extra=grads + sum(inner.values()))
        saved.update(inner)
        scores = inner.get("attention probabilities", 0)   # the math path's pre-softmax scores
        offload = dict.fromkeys(saved, ("core_attn",))
        if ALIASED_OUTPUT in saved:
            offload[ALIASED_OUTPUT] = ("core_attn", "attn_proj")
        return Part("core attention", saved, fwd_extra=scores, bwd_extra=grads, offload=offload)

    # ------------------------------------------------------------------------------------ attention
    def gqa(self) -> Part:
        """``dense.attention.GQAAttention`` after its input norm: input (gathered), q/k norms, RoPE, q/k/v,
        core attention, the reshaped output o_proj keeps."""
        m, a, T, H = self.model, self.a, self.T_c, self.model.hidden_size
        d = m.attention_head_dim
        heads = m.num_attention_heads // self.tp
        kv_heads = max(m.kv_heads // self.tp, 1)
        saved: dict[str, int] = {}
        # q, k and v keep the norm output (under SP the shard, gathered again in backward: parallel.sequence_input),
        # or under FP8 one quantised copy for the three of them; layernorm recompute frees it (their original input)
        if "layernorm" not in self.chosen:
            saved["attention input (norm output)" if not self.fp8 else "attention input (fp8 copy)"] = \
                self.gemm_input(self.T_x, H, T)
        if m.qk_norm:
            saved.update(self.norm(T, heads * d, "q_norm"))
            saved.update(self.norm(T, kv_heads * d, "k_norm"))
            saved["q_norm rsqrt"] = 4 * T * (heads + kv_heads)
            del saved["k_norm rsqrt"]
        saved["rope cos/sin"] = 2 * 4 * self.S_c * d
        offload = dict.fromkeys(saved, ("qkv_linear",))
        core = self.core_attention(heads, kv_heads, d, d)
        saved.update(core.saved)
        offload.update(core.offload)
        if m.attention_output_gate:   # gated attention (``dense.attention.output_gate``, an fp32 island)
            saved["output gate sigmoid (fp32)"] = 4 * T * heads * d
            if a != 4:   # the core output's fp32 copy (in fp32 the product reads the core output itself)
                saved["output gate core output (fp32)"] = 4 * T * heads * d
            saved["o_proj input (gated)"] = a * T * heads * d
            offload.update(dict.fromkeys(("output gate sigmoid (fp32)", "output gate core output (fp32)",
                                          "o_proj input (gated)"), ("attn_proj",)))
        elif ALIASED_OUTPUT not in saved:
            saved["o_proj input"] = a * T * heads * d
            offload["o_proj input"] = ("core_attn", "attn_proj")
        projections = self.gemm_backward(T, H, heads * d, heads * d * H)
        return Part("attention", saved, fwd_extra=core.fwd_extra,
                    bwd_extra=max(core.bwd_extra, projections) + a * T * H, offload=offload)

    def mla(self) -> Part:
        """``dense.mla.MLAttention`` after its input norm: down-projections on the block input, latent norms,
        gathered latents, the per-head q, k, v of ``_up_project``, core attention, o_proj's input."""
        m, a, H = self.model, self.a, self.model.hidden_size
        c, T, Tx = m.mla, self.T_c, self.T_x
        heads = m.num_attention_heads // self.tp
        d_qk, d_v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        up = "mla_up_proj" in self.chosen
        saved: dict[str, int] = {}
        if "layernorm" not in self.chosen:   # the down projections' input (one quantised copy for both under FP8)
            saved["attention input (norm output)" if not self.fp8 else "attention input (fp8 copy)"] = \
                self.gemm_input(Tx, H)
        latents = [("kv", c.kv_lora_rank)] + ([("q", c.q_lora_rank)] if c.q_lora_rank else [])
        for name, rank in latents:
            saved.update(self.norm(Tx, rank, f"{name}_a_layernorm"))
        # kv_a_layernorm's input is the latent view of kv_a_proj's output: keeping it keeps the rope key beside it
        saved["kv_a_layernorm input"] = a * Tx * (c.kv_lora_rank + c.qk_rope_head_dim)
        for name, rank in latents:
            if up:   # the region keeps its (shard) inputs; the gathers happen inside it
                saved[f"{name} latent"] = a * Tx * rank
            else:    # the up projection keeps the shard (SP) or its quantised rows (FP8)
                saved[f"{name} latent{' (fp8 copy)' if self.fp8 else ''}"] = self.gemm_input(Tx, rank, T)
        if not c.q_lora_rank and self.fp8 and not up and "layernorm" not in self.chosen:
            saved["q_proj input (fp8 copy)"] = self.quantised(Tx, H, T)   # a copy of its own (the gathered rows')
        if self.sp and up:
            saved["rope key (gathered)"] = a * T * c.qk_rope_head_dim
        saved["rope cos/sin"] = 2 * 4 * self.S_c * c.qk_rope_head_dim
        offload = dict.fromkeys(saved, ("qkv_linear",))
        core = self.core_attention(heads, heads, d_qk, d_v, qkv_discarded=up)
        saved.update(core.saved)
        offload.update(core.offload)
        if ALIASED_OUTPUT not in saved:
            saved["o_proj input"] = a * T * heads * d_v
            offload["o_proj input"] = ("core_attn", "attn_proj")
        up_outputs = a * T * heads * (2 * d_qk + d_v)
        projections = self.gemm_backward(T, c.kv_lora_rank, heads * (c.qk_nope_head_dim + d_v),
                                         c.kv_lora_rank * heads * (c.qk_nope_head_dim + d_v))
        projections = max(projections, self.gemm_backward(T, heads * d_v, H, heads * d_v * H))
        bwd = max(core.bwd_extra + (up_outputs if up else 0), projections + up_outputs)
        return Part("attention", saved, fwd_extra=core.fwd_extra + up_outputs, bwd_extra=bwd + a * T * H,
                    offload=offload)


@dataclass(frozen=True)
class ActivationMemory:
    """One pipeline rank's activations over a step: ``peak`` bytes (the schedule walk of ``schedule_peak``),
    ``in_flight`` the most micro-batch chunks held at once, ``per_microbatch`` the bytes one micro-batch leaves
    for its backward in each of the rank's chunks, ``by_kind`` those bytes by part kind summed over the chunks."""

    peak: int
    in_flight: int
    per_microbatch: tuple[int, ...]
    by_kind: dict[str, int]
    host: int = 0          # activation offloading: the most host bytes held at once (the chunks in flight)


def activation_shape(config: RunConfig, sizes: ParallelSizes, device_type: str = "cuda") -> ActivationShape:
    """The ``ActivationShape`` of ``config`` at layout ``sizes`` (the parameters' dtype as the trainer makes it)."""
    from moefold.training.build import model_options

    t = config.train
    return ActivationShape(model=config.model, options=model_options(config), tp=sizes.tp, cp=sizes.cp, ep=sizes.ep,
                           etp=sizes.etp, micro_batch=t.micro_batch_size, seq_length=t.seq_length,
                           device_type=device_type, max_load_ratio=t.moe_max_load_ratio or 1.0)

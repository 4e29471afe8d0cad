"""Activation memory of the FFNs of one micro-batch on one rank: the dense MLP and the MoE layer (bytes).

Sizes as in ``planner.activations``. The MoE layer, dropless with balanced routing (every expert receives
top-k / E of the tokens; with ``--moe-expert-capacity-factor``, each expert its capacity)::

    N_h = T_r * k            copies this rank sends out (its tokens' top-k)
    N_e = etp * T_r * k      rows its local experts compute (each etp rank computes the rows of the whole etp
                             group on its 1/etp of every expert's FFN); with the flex dispatcher on DeepEP V2
                             without its CPU sync, the worst case DeepEP allocates instead:
                             etp * ep * T_r * min(k * etp, E / ep) (+ alignment), the price of no host read

Imbalance (``--moe-max-load-ratio R``): the worst expert receives R x its share and the other experts the rest
evenly, so the rank holding it (e = E / ep local experts) computes ``N_e * (R + (e - 1)(E - R)/(E - 1)) / e``
rows (unchanged at ep = 1: all experts are local, dropless, whatever the skew); Megatron's per-rank capacity
(``--moe-expert-rank-capacity-factor C``) bounds that by ``C * N_e``.

What it keeps: the router's fp32 scores; the row map (int64 per copy); the experts' input rows (the GEMM keeps
them), the ``[N_e, 2f]`` gate/up output, each row's fp32 routing prob and the weighted product
``(act * p).to(dtype)`` (w2's input; under FP8 its quantised copy) (``f = ffn / etp``). The routing probs are
applied inside the activation, as Megatron-Core 0.16.1's experts apply them (``moe.activation``): the weighted
activation saves only its input and the probs (``moe.swiglu`` on the default GEMM path, ``moe.activation.Weighted``
elsewhere, recomputing the activation in backward), and the combine only sums a token's returned copies, keeping
nothing of them (it used to weight them and kept the ``[N, W]`` rows for the probs' gradient). With
``--moe-apply-probs-on-input`` (no probs in the experts) autograd's activation also keeps its silu where it runs
(TE's GEMMs, GPT-OSS's clamped variant). ``moe_act`` recompute keeps only the gate/up output (and the probs). The
shared experts like a dense MLP (one gather under SP for gate and up, whose GEMMs keep the shard). The
all-to-all's send and receive buffers are freed once the rows are permuted and live only in the forward
(``fwd_extra``). ``moe`` recompute keeps the layer's input only.

On CPU (``device_type`` "cpu", the default GEMM path) the experts may run on padded rows (``moe.cpu.expert_rows``,
chosen by measured speed): their input copy, gate/up output and product then have up to ``max_auto_rows`` rows,
counted at that bound, and the forward briefly holds the packed input rows beside the padded copy and the padded
w2 output beside the unpadded one (the peak of a ``moe`` recompute's refill, measured in
tests/planner/test_memory.py).
"""

from __future__ import annotations

import math

from moefold.moe.cpu.expert_rows import max_auto_rows
from moefold.planner.activations import ActivationShape, Part
from moefold.planner.deepep import planned_backend, sync_free, v2_receive_rows


def mlp(shape: ActivationShape, ffn: int, *, name: str = "mlp", recompute: str = "mlp",
        input_kept: bool = False) -> Part:
    """``dense.mlp.DenseMLP`` (or the shared experts) on this rank's ``ffn / tp`` units. Its input (the norm output;
    under SP the shard, gathered again in backward) is the block's to count (``planner.profile.block``); under FP8
    gate and up keep one quantised copy of it instead, unless it is kept anyway (``input_kept``: the shared experts,
    whose input the router keeps) or ``layernorm`` recompute frees it."""
    a, T, H = shape.a, shape.T_c, shape.model.hidden_size
    F = ffn // shape.tp
    inner: dict[str, int] = {}
    if shape.fp8 and not input_kept and "layernorm" not in shape.chosen:
        inner[f"{name} input (fp8 copy)"] = shape.quantised(shape.T_x, H, T)
    # gate, silu(gate), up (the activation's), the product: down_proj's input, quantised under FP8
    inner[f"{name} gate, silu, up, product"] = 3 * a * T * F + shape.gemm_input(T, F)
    backward = max(shape.gemm_backward(T, H, F, H * F), shape.gemm_backward(T, F, H, H * F)) + a * T * F
    if recompute in shape.chosen:   # one checkpoint: its input (the norm output) only, counted by the block
        total = sum(inner.values())
        return Part(name, {}, fwd_extra=total, bwd_extra=total + backward)
    offload = dict.fromkeys(inner, (recompute,)) if recompute == "shared_experts" else {}
    return Part(name, inner, bwd_extra=backward, offload=offload)


def moe_rows(shape: ActivationShape, dispatcher: str = "alltoall") -> tuple[int, int]:
    """(N_h, N_e) of the module docstring: N_e of the worst rank under ``shape.max_load_ratio``; with the flex
    dispatcher on DeepEP V2 dispatching sync-free, the worst case DeepEP allocates whatever the skew
    (``planner.deepep.v2_receive_rows``)."""
    m = shape.model
    if m.moe_expert_capacity_factor is not None:
        capacity = -(-shape.T_r * m.moe_topk * m.moe_expert_capacity_factor // m.num_experts)
        home = int(capacity) * m.num_experts
    else:
        home = shape.T_r * m.moe_topk
    o = shape.options
    if dispatcher == "flex" and planned_backend(o) == "deepep" and sync_free(o, o.fp8.enabled):
        rows = v2_receive_rows(shape.T_r, m.moe_topk * shape.etp, shape.ep * shape.etp, m.num_experts // shape.ep,
                               o.fp8.group_alignment)
        return home, rows
    rows = balanced = shape.etp * home
    E, e, R = m.num_experts, m.num_experts // shape.ep, min(shape.max_load_ratio, float(m.num_experts))
    if R > 1 and e < E:
        rows = math.ceil(balanced * (R + (e - 1) * (E - R) / (E - 1)) / e)
    if m.moe_expert_rank_capacity_factor is not None:
        rows = min(rows, math.floor(balanced * m.moe_expert_rank_capacity_factor))
    return home, rows


def router(shape: ActivationShape) -> dict[str, int]:
    """``moe.router.Router``: scores (sigmoid routing keeps a second, normalised copy for its balancing loss), the
    top-k ids and probs. Its gating GEMM keeps its input as it is (``moe.scoring._GatingLinear``, the fp32 cast
    inside, as Megatron's ``RouterGatingLinearFunction``): the norm output the block counts."""
    m, T = shape.model, shape.T_r
    out = {"router scores": 4 * T * m.num_experts * (2 if m.moe_score_function == "sigmoid" else 1)}
    out["router top-k"] = 12 * T * m.moe_topk + 16 * T
    return out


def _own_swiglu(shape: ActivationShape) -> bool:
    """The experts run ``moe.swiglu`` (plain SwiGLU on the default grouped_mm GEMMs, or on torchao's FP8 GEMMs:
    ``moe.expert_gemm``'s ``GroupedMMGemm`` and ``Fp8Gemm``), which saves only its input; autograd's activation
    (TE's GEMMs, GPT-OSS's clamped variant) also keeps ``silu(gate)``."""
    m, o = shape.model, shape.options
    plain = m.moe_swiglu_alpha in (None, 1.0) and m.moe_activation_clamp is None and not m.moe_glu_linear_offset
    fp8 = o.fp8.enabled
    return plain and (o.fp8.backend == "torchao" if fp8 else o.gemm_backend == "grouped_mm")


def _cpu_padded_rows(shape: ActivationShape, rows: int, local_experts: int) -> int:
    """Rows the experts' GEMM buffers may hold for ``rows`` rows: on CPU, the default GEMM path without expert
    biases pads bf16 / fp16 rows (``moe.cpu.rows_gemm.choose_layout``'s ``auto`` rule: ``uniform`` or ``aligned``),
    up to ``max_auto_rows``; fp32 rows stay packed, as everywhere off the CPU: exactly ``rows``."""
    m, o = shape.model, shape.options
    if (shape.device_type != "cpu" or o.gemm_backend != "grouped_mm" or o.fp8.enabled or m.moe_expert_linear_bias
            or local_experts < 2 or shape.a >= 4):
        return rows
    return max_auto_rows(rows, local_experts)


def moe(shape: ActivationShape, dispatcher: str) -> Part:
    """``moe.layer.MoELayer`` with ``dispatcher`` ("local", "alltoall", "allgather" or "flex")."""
    m, a, H = shape.model, shape.a, shape.model.hidden_size
    W = m.moe_latent_size or H   # the rows' width from the dispatch to the combine (latent experts: moe.latent)
    home, rows = moe_rows(shape, dispatcher)
    f = m.moe_ffn_hidden_size // shape.etp
    local_experts = m.num_experts // shape.ep
    inner: dict[str, int] = {}
    if shape.tp > 1 and not shape.sp:   # the router keeps the 1/tp slice it routes: a view of the rows
        # (parallel.comm._split), which keeps the whole norm output's storage alive
        inner["router input (token slice)"] = a * shape.T_c * H
    inner.update(router(shape))
    inner["row map"] = 16 * home
    padded = _cpu_padded_rows(shape, rows, local_experts)   # P >= N_e: the GEMM buffers' rows
    # the padded copy when P > N_e; under FP8 the GEMM's quantised copy (per-expert scales)
    inner["expert input rows"] = shape.quantised(padded, W, groups=local_experts + 1) if shape.fp8 else a * padded * W
    if dispatcher in ("alltoall", "local") and (shape.etp > 1 or (shape.ep > 1 and not 1 < local_experts <= 8)):
        inner["row sort index"] = 8 * rows
    act = "moe_act" in shape.chosen
    weighted = not m.moe_apply_probs_on_input   # the probs applied inside the experts' activation (moe.activation)
    inner["experts gate/up output"] = a * padded * 2 * f
    # w2's input: the product, or its quantised copy under FP8 (moe_act recompute: the product itself, freed and
    # refilled, as Megatron's set_save_original_input(linear_fc2))
    product = shape.quantised(padded, f, groups=local_experts + 1) if shape.fp8 else a * padded * f
    if weighted:
        inner["experts row probs"] = 4 * padded   # fp32, saved by the weighted activation
    if not act and (weighted or _own_swiglu(shape)):
        inner["experts product (w2 input)"] = product
    elif not act:
        inner["experts silu"] = a * padded * f
        inner["experts product (w2 input)"] = product
    weights = local_experts * W * f
    # backward, in order: the combine's (unweighted) backward, the token gradients rounded to the rows' dtype and
    # gathered into rows; w2's input and weight gradients (the activation refilled first under moe_act), beside the
    # weighted activation's backward (its recomputed product and the fp32 output gradient and product for the
    # probs' gradient); w13's, once the activation is freed
    recompute_bwd = (4 + 4 + a) * padded * f if weighted else 0
    backward = max(a * (shape.T_r + home) * W,
                   a * padded * f + a * weights + (2 * a * padded * f if act else 0) + recompute_bwd,
                   2 * a * weights + a * padded * W)
    forward = a * (home + rows) * W     # the exchange's send and receive buffers
    if W != H:   # latent: the combine's sum, kept as the up projection's input for its weight gradient
        inner["latent up input"] = a * shape.T_r * W
    offload = {"expert input rows": ("expert_fc1",), "experts gate/up output": ("moe_act",),
               "experts silu": ("moe_act",)}
    if padded > rows:   # the packed rows beside their padded copy, then the padded w2 output beside its unpadding
        forward = max(forward, a * (rows + padded) * W)
    if m.moe_shared_expert_ffn_size:
        shared = mlp(shape, m.moe_shared_expert_ffn_size, name="shared experts", recompute="shared_experts",
                     input_kept=True)
        inner.update(shared.saved)
        offload.update(shared.offload)
        forward += shared.fwd_extra
        backward = max(backward, shared.bwd_extra)
    if "moe" in shape.chosen:
        total = sum(inner.values())
        return Part("moe", {}, fwd_extra=total + forward, bwd_extra=total + max(forward, backward))
    return Part("moe", inner, fwd_extra=forward, bwd_extra=backward, offload=offload)

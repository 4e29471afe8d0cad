"""Qwen3-Next's and Qwen3.5-MoE's ``linear_attention`` layers in the activation model: the Gated DeltaNet mixer.

Such a layer is a two-part block as any other (input norm + mixer, post-attention norm + FFN): ``profile.block``
puts ``deltanet_mixer`` where the attention goes. What ``dense.gated_deltanet.GatedDeltaNet`` keeps for its
backward, per rank (``hk = key heads / tp``, ``hv = value heads / tp``, ``r = hv / hk``, ``c = hk (2 dk + r dv)``
convolved channels; under CP the mixer holds the whole sequence for ``1/cp`` of those heads, the same bytes):

- ``in_proj``'s input (the norm output; under SP the shard, gathered again in
  backward; FP8: its quantised copy), the convolution's left-padded input ``[B, c,
  S + K - 1]`` (``causal_conv_silu`` keeps its input and recomputes the fp32 island), ``sigmoid(b)`` ``[T, hv]``,
  softplus's input and output for the decay ``[T, hv]`` (fp32);
- the delta rule. On CPU (or ``--linear-attention-backend torch``) the chunked form in plain torch
  (``dense.gated_delta_rule.chunk_gated_delta_rule``, chunks of ``L = 64`` tokens, all fp32, the sequence
  zero-padded to whole chunks): q and k repeated to the value heads and L2-normalised (each with its inverse norm);
  per token and value head five ``[L]`` rows (the decay matrix, ``k_beta k^T``, the UT system, ``q k^T``, its
  decayed product), six ``dk`` wide tensors (k, the batched-GEMM copies of ``k_beta``, the keys that read the state,
  the decayed q and k), three ``dv`` wide (v padded, the pseudo-values, each chunk's new values), four scalars
  (beta, the decays); one ``[hv, dk, dv]`` state per chunk. On CUDA with fla (``auto``, ``fla``) what its
  ``ChunkGatedDeltaRuleFunction`` saves: the normalised q, k at the key heads with their inverse norms, v, the
  cumulative decay (fp32), the inverted UT system ``[T, hv, L]`` (the chunk states are recomputed in backward).
  Under selective recompute of ``core_attn`` only the rule's inputs stay: the convolution's output (q, k, v are
  views of it) and the decay ``g`` (fp32);
- the gated RMSNorm (fp32 island): the rule's output, the normalised value, its weighted product, z, ``silu(z)``
  ``[T, hv dv]`` each and the per-head RMS; ``out_proj``'s input.

Transient: the projections' outputs in the forward, the rule's ``[T, hv, L]`` temporaries; in the backward the
gradients of the largest of these. Counted off the saved tensors of a layer whose sizes differ pairwise
(``tests/planner/test_memory_deltanet.py``).
"""

from __future__ import annotations

from moefold.dense.choices import DeltaRuleBackend
from moefold.planner.activations import ActivationShape, Part

CHUNK = 64   # ``GatedDeltaNetConfig.chunk_size``'s default, what ``models.layer_factory`` builds


def torch_rule(shape: ActivationShape) -> bool:
    """Whether the layers run the plain-torch chunked rule (CPU, or the torch backend) rather than fla's kernel."""
    backend = shape.options.linear_attention_backend
    return shape.device_type == "cpu" or backend == DeltaRuleBackend.TORCH


def deltanet_mixer(shape: ActivationShape) -> Part:
    """``GatedDeltaNet`` after its input norm (module docstring)."""
    m, a, T, H = shape.model, shape.a, shape.T_c, shape.model.hidden_size
    la, f32, L = m.linear_attention, 4, CHUNK
    hk, hv = la.num_key_heads // shape.tp, la.num_value_heads // shape.tp
    dk, dv, K = la.key_head_dim, la.value_head_dim, la.conv_kernel_size
    r = hv // hk
    c = hk * (2 * dk + r * dv)
    B, cp = shape.micro_batch, shape.cp
    S = shape.S_c * cp                       # the mixer's sequence: the whole one under CP, for 1/cp of the heads
    hv_m, c_m = hv // cp, c // cp
    padded = -(-S // L) * L * B              # the rule's tokens, the last chunk zero-padded
    chunks = padded // L
    saved = {"in_proj input": shape.gemm_input(shape.T_x, H, T),   # SP: the shard (parallel.sequence_input)
             "conv input (left-padded)": a * B * (S + K - 1) * c_m, "beta (sigmoid output)": a * T * hv,
             "decay softplus input, output (fp32)": 2 * f32 * T * hv, "decay A (fp32)": 2 * f32 * hv_m}
    rule_inner: dict[str, int] = {}
    if torch_rule(shape):
        if r == 1 and a == f32:   # q, k are read in place: views of the convolution's output
            rule_inner["rule q, k (conv output)"] = f32 * T * c
        else:
            rule_inner["rule q, k repeated (fp32)"] = 2 * f32 * T * hv * dk
        rule_inner["rule q, k inverse norms"] = 2 * f32 * T * hv
        rule_inner["rule causal mask"] = L * L
        rule_inner["rule in-chunk decay, k_beta k^T, UT system, q k^T, product"] = 5 * f32 * padded * hv_m * L
        rule_inner["rule k, k_beta copies, w, decayed q, k"] = 6 * f32 * padded * hv_m * dk
        rule_inner["rule v padded, u, new values"] = 3 * f32 * padded * hv_m * dv
        rule_inner["rule beta padded, decays"] = 4 * f32 * padded * hv_m
        rule_inner["rule chunk decay"] = f32 * chunks * hv_m
        rule_inner["rule chunk states"] = f32 * chunks * hv_m * dk * dv
    else:   # fla's ChunkGatedDeltaRuleFunction
        rule_inner["rule q, k normalised"] = 2 * a * T * hk * dk
        rule_inner["rule q, k inverse norms (fp32)"] = 2 * f32 * T * hk
        rule_inner["rule v"] = a * T * hv * dv
        rule_inner["rule cumulative decay (fp32)"] = f32 * T * hv
        rule_inner["rule inverted UT system"] = a * T * hv * L
    inputs = {"rule inputs q, k, v (conv output)": a * T * c, "rule decay g (fp32)": f32 * T * hv}
    recompute = "core_attn" in shape.chosen
    inner = sum(rule_inner.values())
    saved.update(inputs if recompute else rule_inner)
    saved["gated norm input, normalised, weighted, z, silu(z) (fp32)"] = 5 * f32 * T * hv * dv
    saved["gated norm rms (fp32)"] = f32 * T * hv
    if a != f32:
        saved["gated norm weight (fp32)"] = f32 * dv
    saved["out_proj input"] = a * T * hv * dv
    projected = hk * (2 * dk + 2 * r * dv) + 2 * hv   # in_proj_qkvz, in_proj_ba outputs per token
    temporaries = 2 * f32 * padded * hv_m * L if torch_rule(shape) else 0
    fwd = a * T * projected + temporaries + (inner if recompute else 0)
    bwd = 3 * temporaries + (inner if recompute else 0) + shape.gemm_backward(T, H, projected, H * projected)
    return Part("deltanet", saved, fwd_extra=fwd, bwd_extra=bwd)


__all__ = ["CHUNK", "deltanet_mixer", "torch_rule"]

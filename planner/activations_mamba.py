"""Nemotron-H's layers in the activation model: the Mamba-2 mixer, and the one-sublayer blocks of a hybrid stack.

A stack of one-sublayer layers (``ModelConfig.hybrid.one_sublayer``: Nemotron-H's ``layers_block_type``) has one
norm and one sub-layer per layer: a Mamba-2 mixer, GQA attention, an MoE layer or a dense MLP (``profile.block``
asks ``hybrid_block`` for those; MTP blocks stay two-part). Squared-ReLU FFNs (``ffn_activation="relu2"``) have one
up projection, not SwiGLU's gate + up: their ``[rows, f]`` up output and the squared product, not ``[rows, 2f]``.

What ``dense.mamba2.Mamba2Mixer`` keeps for its backward on the plain-torch path, per rank (``h = heads / tp``
heads of ``p`` channels, ``g = groups / tp`` groups of state ``n``, ``c = h p + 2 g n`` convolution channels,
chunks of ``L`` tokens; everything from the scan on in fp32):

- ``in_proj``'s input (the norm output; under SP the shard, gathered again in
  backward; FP8: its quantised copy), the convolution's input ``[T, c]`` (the
  concatenated x, B, C) and its output (SiLU's input), softplus's input and output for the time step ``[T, h]``;
- the chunked scan (``dense.ssd_scan.ssd_chunk_scan``): the padded x and dt, B and C repeated to every head
  ``[T, h, n]`` each, the input ``dt x``, the cumulative decay; inside each chunk the decay, the ``C . B`` products
  and their decayed product ``[T, L, h]`` each (the quadratic-in-L part: ``L`` per token); the to-end decay and the
  decayed B; one state per chunk ``[T / L, h, p, n]`` carried and stacked; the inter-chunk output before its decay;
  the einsums' operands copied into their batched-GEMM layouts (four ``[T, h, p]`` and two ``[T, h, n]``; counted
  off the saved tensors of a Mamba-2 layer whose sizes differ pairwise, ``tests/planner/test_memory_mamba.py``);
- the gated norm: ``y`` and ``silu(z)`` ``[T, h p]``, the normalised product and its per-group RMS; ``out_proj``'s
  input. Transient: ``in_proj``'s output (``2 h p + 2 g n + h`` per token) in the forward, the scan's ``[T, L, h]``
  differences; in the backward the gradients of the largest of these.

Under ``--recompute-modules`` nothing of the mixer is recomputed (moefold's selective recompute names no Mamba
module): the full-layer recompute (``--recompute-granularity full``) is what drops it, as for every block.
"""

from __future__ import annotations

from moefold.models.config import ModelConfig
from moefold.models.layer_factory import is_moe_block
from moefold.planner.activations import ActivationShape, Part
from moefold.planner.activations_ffn import mlp, moe


def block_kind(model: ModelConfig, index: int) -> bool | str:
    """What decides block ``index``'s tensors: MoE or not, in a one-sublayer stack its layer type (a Mamba-2
    and an attention layer are both "not MoE"), and for a Gated DeltaNet layer (Qwen3-Next) its mixer with MoE or
    not ("linear_attention moe")."""
    if model.hybrid.one_sublayer and index < model.num_layers:
        return model.layer_type(index)
    if model.layer_type(index) == "linear_attention":
        return f"linear_attention {'moe' if is_moe_block(model, index) else 'dense'}"
    return is_moe_block(model, index)


def representative(model: ModelConfig, kind: bool | str) -> int:
    """The first layer of ``kind`` (``block_kind``'s value), whose tensors stand for every layer of that kind."""
    return next((i for i in range(model.num_layers) if block_kind(model, i) == kind), 0)


def mamba_mixer(shape: ActivationShape) -> Part:
    """``Mamba2Mixer`` after its input norm (module docstring)."""
    m, a, T, H = shape.model, shape.a, shape.T_c, shape.model.hidden_size
    d = m.hybrid.mamba
    h, g, p, n, L = d.num_heads // shape.tp, d.num_groups // shape.tp, d.head_dim, d.state_size, d.chunk_size
    c = h * p + 2 * g * n
    padded = -(-shape.S_c // L) * L * shape.micro_batch   # the scan's tokens, the last chunk zero-padded
    chunks = padded // L
    f32 = 4
    saved = {"in_proj input": shape.gemm_input(shape.T_x, H, T),   # SP: the shard (parallel.sequence_input)
             "conv input": a * T * c, "conv output (silu input)": a * T * c,
             "dt softplus input, output (fp32)": 2 * f32 * T * h,
             "scan x, dt padded": f32 * padded * (h * p + h), "scan B, C per head": 2 * f32 * padded * h * n,
             "scan dt x": f32 * padded * h * p, "scan cumulative decay, its exp": 2 * f32 * padded * h,
             "scan in-chunk decay, C.B, product": 3 * f32 * padded * L * h,
             "scan to-end decay, decayed B": f32 * padded * h * (1 + n),
             "scan chunk states (carried, stacked)": 2 * f32 * chunks * h * p * n,
             "scan inter-chunk output": f32 * padded * h * p,
             # the einsums' batched-GEMM operands, laid out again ([b, k, h, l, .] copies of u, x, C, B, y)
             "scan einsum operand copies": f32 * padded * h * (4 * p + 2 * n),
             "gated norm y, silu(z), product (fp32)": 3 * f32 * T * h * p, "gated norm rms": f32 * T * g,
             "out_proj input": a * T * h * p}
    if a != f32:   # the fp32 copies of the convolution's output the scan and of z the norm read
        saved["scan x (fp32 copy)"] = f32 * T * h * p
        saved["gated norm z (fp32 copy)"] = f32 * T * h * p
    in_proj_out = a * T * (2 * h * p + 2 * g * n + h)
    differences = f32 * padded * L * h
    fwd = in_proj_out + 2 * differences
    bwd = 3 * differences + 2 * f32 * padded * h * (p + n) + shape.gemm_backward(T, H, in_proj_out // (a * T),
                                                                                  H * in_proj_out // (a * T))
    return Part("mamba", saved, fwd_extra=fwd, bwd_extra=bwd)


def _relu2_ffn(part: Part, moe_layer: bool) -> Part:
    """SwiGLU's counts made squared-ReLU's: one up projection (``[rows, f]``, not ``[rows, 2f]``), its ReLU and
    square (3 of a dense SwiGLU MLP's 4 ``[rows, f]`` tensors)."""
    saved = dict(part.saved)
    if moe_layer and "experts gate/up output" in saved:
        saved["experts gate/up output"] //= 2
        saved["experts relu (relu2)"] = saved.pop("experts silu", saved["experts gate/up output"])
    key = next((k for k in saved if k.endswith("gate, silu, up, product")), None)
    if key is not None:   # a dense MLP (or the shared expert)
        saved[key.replace("gate, silu, up, product", "up, relu, square")] = 3 * saved.pop(key) // 4
    return Part(part.name, saved, fwd_extra=part.fwd_extra, bwd_extra=part.bwd_extra,
                offload={k: v for k, v in part.offload.items() if k in saved})


def hybrid_block(shape: ActivationShape, index: int, dispatcher: str) -> Part:
    """Layer ``index`` of a one-sublayer stack: its norm and its one sub-layer (module docstring)."""
    m, a, Tx, H = shape.model, shape.a, shape.T_x, shape.model.hidden_size
    kind = m.layer_type(index)
    discard = "layernorm" in shape.chosen
    saved = {"input_layernorm input": a * Tx * H} if discard else shape.norm(Tx, H, "input_layernorm")
    offload = {} if discard else dict.fromkeys(saved, ("attn_norm",))
    if kind == "mamba":
        part = mamba_mixer(shape)
    elif kind == "full_attention":
        part = shape.gqa()
    elif kind == "moe":
        part = moe(shape, dispatcher)
        if m.ffn_activation == "relu2":
            part = _relu2_ffn(part, True)
        if "moe" not in shape.chosen and not discard:   # the router and experts keep the norm output
            saved["ffn input (norm output)"] = a * Tx * H
    else:
        part = mlp(shape, m.ffn_hidden_size)
        if m.ffn_activation == "relu2":
            part = _relu2_ffn(part, False)
        if (not shape.fp8 or "mlp" in shape.chosen) and not discard:   # gate/up keep it (SP: the shard)
            saved["ffn input (norm output)"] = a * Tx * H
    saved.update({f"{part.name}: {k}": v for k, v in part.saved.items()})
    offload.update({f"{part.name}: {k}": v for k, v in part.offload.items()})
    gradient = a * Tx * H   # the residual stream's gradient
    name = "moe layer" if kind == "moe" else f"{kind} layer"
    return Part(name, saved, fwd_extra=part.fwd_extra, bwd_extra=part.bwd_extra + gradient, offload=offload,
                layer=index)


__all__ = ["block_kind", "hybrid_block", "mamba_mixer", "representative"]

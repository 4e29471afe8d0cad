"""Activation recomputation in a built decoder: which modules recompute (``apply_recompute``) and how
full recompute groups the layers of one pipeline chunk (``full_recompute_groups``).

The options are Megatron's (``ModelOptions.recompute*``; semantics in ``dense.recompute``). Selective
choices become flags on the modules that own the region (attention: core attention and MLA's
up-projections, Gated DeltaNet's delta rule; block: norms and the FFN; MoE layer: shared experts;
experts: the activation). Full recompute of the decoder's layers is done by ``MoEDecoder.run_layers``
over the groups below; MTP blocks, which run one at a time, keep checkpointing themselves.
"""

from __future__ import annotations

from torch import nn

from moefold.dense.attention import GQAAttention
from moefold.dense.block import TransformerBlock
from moefold.dense.gated_deltanet import GatedDeltaNet
from moefold.dense.mla import MLAttention
from moefold.dense.recompute import recomputed_modules
from moefold.models.options import ModelOptions
from moefold.moe.layer import MoELayer


def apply_recompute(model: nn.Module, layers: nn.ModuleDict, options: ModelOptions) -> None:
    """Set every module's recompute flags in ``model`` from ``options``; ``layers`` (the decoder's blocks)
    stop checkpointing themselves: ``full_recompute_groups`` decides for them."""
    chosen = recomputed_modules(options.recompute, options.recompute_modules)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            module.recompute_layernorm = "layernorm" in chosen
            module.recompute_ffn = ("moe" if isinstance(module.mlp, MoELayer) else "mlp") in chosen
        elif isinstance(module, (GQAAttention, MLAttention, GatedDeltaNet)):   # DeltaNet: its delta rule
            module.recompute_core_attn = "core_attn" in chosen
            if isinstance(module, MLAttention):
                module.recompute_up_proj = "mla_up_proj" in chosen
        elif isinstance(module, MoELayer):
            module.recompute_shared_experts = "shared_experts" in chosen
            module.experts.recompute_activation = "moe_act" in chosen
    for block in layers.values():
        block.checkpoint_block = False


def full_recompute_groups(layer_ids: list[int], options: ModelOptions) -> list[tuple[list[int], bool]]:
    """``layer_ids`` (one pipeline chunk's, in order) cut into (consecutive ids, checkpointed as one unit).

    uniform N: every group of N layers is one checkpoint (its input is all that is kept). block N: the
    first N layers are checkpointed one by one, the rest run normally. Without full recompute: one
    unrecomputed group."""
    if options.recompute != "full":
        return [(layer_ids, False)]
    n = options.recompute_num_layers
    if options.recompute_method == "uniform":
        return [(layer_ids[i:i + n], True) for i in range(0, len(layer_ids), n)]
    groups = [([i], True) for i in layer_ids[:n]]
    return groups + ([(layer_ids[n:], False)] if layer_ids[n:] else [])

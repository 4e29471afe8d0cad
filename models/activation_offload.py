"""Fine-grained activation offloading in a built decoder: which module parts offload (``apply_activation_offload``).

The mechanism is ``dense.activation_offload``; the choice is Megatron's ``--offload-modules``
(``ModelOptions.offload_modules``). Every chosen part of every block (the decoder's layers and the MTP blocks)
gets a region of one ``ActivationOffloader`` per model (per process: its side streams are shared by every
layer), tagged with the block's global layer index for the one-layer-ahead prefetch in backward.
"""

from __future__ import annotations

import torch
from torch import nn

from moefold.dense.activation_offload import ActivationOffloader, OffloadRegion
from moefold.dense.attention import GQAAttention
from moefold.dense.block import TransformerBlock
from moefold.dense.mla import MLAttention
from moefold.models.options import ModelOptions
from moefold.moe.experts import GroupedExperts
from moefold.moe.layer import MoELayer

# module class -> {offload module name: the attribute that holds its region}
_REGIONS: dict[type, dict[str, str]] = {
    TransformerBlock: {"attn_norm": "offload_attn_norm", "mlp_norm": "offload_mlp_norm"},
    GQAAttention: {"qkv_linear": "offload_qkv_linear", "core_attn": "offload_core_attn",
                   "attn_proj": "offload_attn_proj"},
    MLAttention: {"qkv_linear": "offload_qkv_linear", "core_attn": "offload_core_attn",
                  "attn_proj": "offload_attn_proj"},
    GroupedExperts: {"expert_fc1": "offload_expert_fc1", "moe_act": "offload_moe_act"},
    MoELayer: {"shared_experts": "offload_shared_experts"},
}


def apply_activation_offload(blocks: dict[int, TransformerBlock], options: ModelOptions,
                             device: torch.device | str) -> ActivationOffloader | None:
    """Give every chosen part of ``blocks`` ({global layer index: block}) a region of one new offloader (returned;
    None when nothing is offloaded). ``device``: where the model computes."""
    if not options.offload_modules:
        return None
    offloader = ActivationOffloader(device, options.min_offloaded_tensor_size)
    chosen = set(options.offload_modules)
    for layer, block in blocks.items():
        for module in block.modules():
            for name, attr in _REGIONS.get(type(module), {}).items():
                if name in chosen:
                    setattr(module, attr, offloader.region(name, layer, module))
    return offloader


def offloaded_parts(model: nn.Module) -> dict[str, int]:
    """{offload module name: how many regions the model runs it in} (tests, the start-up line)."""
    out: dict[str, int] = {}
    for module in model.modules():
        for name, attr in _REGIONS.get(type(module), {}).items():
            if isinstance(getattr(module, attr), OffloadRegion):
                out[name] = out.get(name, 0) + 1
    return out

"""The MoE decoder model, recipes, multi-token prediction and HF checkpoint interop."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moefold.models.checkpoint import load_checkpoint, save_checkpoint
    from moefold.models.config import (
        ATTENTION_KINDS,
        FAMILIES,
        LAYER_TYPES,
        DSADims,
        LinearAttentionDims,
        MLADims,
        ModelConfig,
        YarnScaling,
    )
    from moefold.models.decoder import IGNORE_INDEX, ModelOutput, MoEDecoder
    from moefold.models.generate import generate
    from moefold.models.hf.exporter import export_hf
    from moefold.models.hf.importer import import_hf, load_hf_weights
    from moefold.models.layer_factory import (
        attention_config,
        build_block,
        check_layout,
        is_moe_block,
        linear_attention_config,
        mlp_config,
        moe_config,
        router_config,
    )
    from moefold.models.model_sections import (
        ModelAttention,
        ModelExperts,
        ModelHybrid,
        ModelMoE,
        ModelMTP,
        ModelRouter,
        ModelSharedExperts,
    )
    from moefold.models.mtp import MTPModule
    from moefold.models.options import ModelOptions
    from moefold.models.params import ParamReport, count_parameters, format_report
    from moefold.models.pretrained import load_pretrained_weights, pretrained_config
    from moefold.models.recipes import RECIPES, get_recipe
    from moefold.models.sublayers import Compute, Exchange, LayerCarry, Piece, block_pieces, check_overlap
    from moefold.models.upcycle import load_upcycled_weights, upcycled_config

# (``generate`` is also a submodule's name: once ``moefold.models.generate`` is imported, the name is that module;
# import the function from it)
# name -> the module that defines it: loaded on first use, so that reading a config or parsing flags imports
# no more than it needs (torch only where a module computes)
_LAZY = {
    **dict.fromkeys(["load_checkpoint", "save_checkpoint"], "moefold.models.checkpoint"),
    **dict.fromkeys(["ATTENTION_KINDS", "FAMILIES", "LAYER_TYPES", "LinearAttentionDims", "MLADims", "DSADims",
                     "ModelConfig", "YarnScaling"], "moefold.models.config"),
    **dict.fromkeys(["IGNORE_INDEX", "ModelOutput", "MoEDecoder"], "moefold.models.decoder"),
    "generate": "moefold.models.generate",
    "export_hf": "moefold.models.hf.exporter",
    **dict.fromkeys(["import_hf", "load_hf_weights"], "moefold.models.hf.importer"),
    **dict.fromkeys(["attention_config", "build_block", "check_layout", "is_moe_block", "linear_attention_config",
                     "mlp_config", "moe_config", "router_config"], "moefold.models.layer_factory"),
    **dict.fromkeys(["ModelAttention", "ModelExperts", "ModelHybrid", "ModelMoE", "ModelMTP", "ModelRouter",
                     "ModelSharedExperts"], "moefold.models.model_sections"),
    "MTPModule": "moefold.models.mtp",
    "ModelOptions": "moefold.models.options",
    **dict.fromkeys(["ParamReport", "count_parameters", "format_report"], "moefold.models.params"),
    **dict.fromkeys(["load_pretrained_weights", "pretrained_config"], "moefold.models.pretrained"),
    **dict.fromkeys(["RECIPES", "get_recipe"], "moefold.models.recipes"),
    **dict.fromkeys(["Compute", "Exchange", "LayerCarry", "Piece", "block_pieces", "check_overlap"],
                    "moefold.models.sublayers"),
    **dict.fromkeys(["load_upcycled_weights", "upcycled_config"], "moefold.models.upcycle"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ModelConfig", "MLADims", "DSADims", "YarnScaling", "FAMILIES", "ATTENTION_KINDS", "ModelOptions", "RECIPES",
    "get_recipe",
    "LinearAttentionDims", "LAYER_TYPES", "linear_attention_config", "ModelAttention", "ModelMoE", "ModelRouter",
    "ModelExperts", "ModelSharedExperts", "ModelMTP", "ModelHybrid",
    "MoEDecoder", "ModelOutput", "MTPModule", "IGNORE_INDEX",
    "attention_config", "router_config", "moe_config", "mlp_config", "build_block", "check_layout", "is_moe_block",
    "ParamReport", "count_parameters", "format_report",
    "import_hf", "load_hf_weights", "export_hf", "save_checkpoint", "load_checkpoint",
    "pretrained_config", "load_pretrained_weights", "upcycled_config", "load_upcycled_weights", "generate",
    "Compute", "Exchange", "LayerCarry", "Piece", "block_pieces", "check_overlap",
]

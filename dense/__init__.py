"""The dense transformer stack: TP/SP linear layers, embeddings and loss, norms, RoPE, attention, CP, MLP, Gated
DeltaNet linear attention, documents packed in a sample (``dense.documents``, ``dense.document_attention``); the
regions each layer runs its parts through (``dense.regions``, which
``moefold.execution`` fills with recompute and offloading) and the names and checks of those choices; the
weight-gradient store and main-grad slots the splitting and fusing GEMMs share, and the reused CPU buffers their
main-grad writes take (``dense.workspace``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moefold.dense.activation_offload import OFFLOAD_MODULES, check_offload
    from moefold.dense.attention import GQAAttention
    from moefold.dense.attention_config import AttentionConfig, MLAConfig
    from moefold.dense.block import TransformerBlock
    from moefold.dense.context_parallel import (
        CP_COMM_MODES,
        check_context_parallel_seq_length,
        context_parallel_attention,
        context_parallel_positions,
        gather_from_context_parallel,
        position_mask,
        split_for_context_parallel,
    )
    from moefold.dense.core_attention import CoreAttention, local_attention
    from moefold.dense.cross_entropy import masked_mean, vocab_parallel_cross_entropy
    from moefold.dense.document_attention import document_attention
    from moefold.dense.documents import Documents, packed_documents
    from moefold.dense.embedding import OutputHead, VocabParallelEmbedding, check_vocab, pad_vocab_size
    from moefold.dense.gated_delta_rule import (
        GATED_DELTA_RULE_BACKENDS,
        chunk_gated_delta_rule,
        gated_delta_rule_impl,
        recurrent_gated_delta_rule,
    )
    from moefold.dense.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig, RecurrentCache
    from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear
    from moefold.dense.mla import MLAttention
    from moefold.dense.mlp import MLP_ACTIVATIONS, DenseMLP, MLPConfig
    from moefold.dense.norm import RMSNorm
    from moefold.dense.recompute import RECOMPUTE_MODES, check_recompute, checkpointed
    from moefold.dense.regions import CHECKPOINT, KEEP_OUTPUT, PLAIN, OutputRegion, Region
    from moefold.dense.rope import (
        RotaryEmbedding,
        YarnConfig,
        apply_partial_rotary,
        apply_rotary,
        rotate_half,
        yarn_attention_factor,
        yarn_softmax_mscale,
    )
    from moefold.dense.split_backward import DeferredWeightGrads, WeightGradStore

# name -> the module that defines it: loaded on first use, so that reading a config or parsing flags imports
# no more than it needs (torch only where a module computes)
_LAZY = {
    **dict.fromkeys(["OFFLOAD_MODULES", "check_offload"], "moefold.dense.activation_offload"),
    "GQAAttention": "moefold.dense.attention",
    **dict.fromkeys(["AttentionConfig", "MLAConfig"], "moefold.dense.attention_config"),
    "TransformerBlock": "moefold.dense.block",
    **dict.fromkeys(["CP_COMM_MODES", "check_context_parallel_seq_length", "context_parallel_attention",
                     "context_parallel_positions", "gather_from_context_parallel", "position_mask",
                     "split_for_context_parallel"], "moefold.dense.context_parallel"),
    **dict.fromkeys(["CoreAttention", "local_attention"], "moefold.dense.core_attention"),
    **dict.fromkeys(["masked_mean", "vocab_parallel_cross_entropy"], "moefold.dense.cross_entropy"),
    "document_attention": "moefold.dense.document_attention",
    **dict.fromkeys(["Documents", "packed_documents"], "moefold.dense.documents"),
    **dict.fromkeys(["OutputHead", "VocabParallelEmbedding", "check_vocab", "pad_vocab_size"],
                    "moefold.dense.embedding"),
    **dict.fromkeys(["GATED_DELTA_RULE_BACKENDS", "chunk_gated_delta_rule", "gated_delta_rule_impl",
                     "recurrent_gated_delta_rule"], "moefold.dense.gated_delta_rule"),
    **dict.fromkeys(["GatedDeltaNet", "GatedDeltaNetConfig", "RecurrentCache"], "moefold.dense.gated_deltanet"),
    **dict.fromkeys(["ColumnParallelLinear", "RowParallelLinear"], "moefold.dense.linear"),
    "MLAttention": "moefold.dense.mla",
    **dict.fromkeys(["MLP_ACTIVATIONS", "DenseMLP", "MLPConfig"], "moefold.dense.mlp"),
    "RMSNorm": "moefold.dense.norm",
    **dict.fromkeys(["RECOMPUTE_MODES", "check_recompute", "checkpointed"], "moefold.dense.recompute"),
    **dict.fromkeys(["CHECKPOINT", "KEEP_OUTPUT", "PLAIN", "OutputRegion", "Region"], "moefold.dense.regions"),
    **dict.fromkeys(["RotaryEmbedding", "YarnConfig", "apply_partial_rotary", "apply_rotary", "rotate_half",
                     "yarn_attention_factor", "yarn_softmax_mscale"], "moefold.dense.rope"),
    **dict.fromkeys(["DeferredWeightGrads", "WeightGradStore"], "moefold.dense.split_backward"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "OFFLOAD_MODULES", "check_offload", "Region", "OutputRegion", "PLAIN", "KEEP_OUTPUT", "CHECKPOINT",
    # dense core: linear layers, RoPE, norm, embedding/head/loss, MLP, block, recompute
    "ColumnParallelLinear", "RowParallelLinear",
    "RotaryEmbedding", "YarnConfig", "apply_rotary", "apply_partial_rotary", "rotate_half", "yarn_attention_factor",
    "yarn_softmax_mscale",
    "RMSNorm",
    "VocabParallelEmbedding", "OutputHead", "check_vocab", "pad_vocab_size",
    "vocab_parallel_cross_entropy", "masked_mean",
    "DenseMLP", "MLPConfig", "MLP_ACTIVATIONS",
    "TransformerBlock", "RECOMPUTE_MODES", "check_recompute", "checkpointed",
    "WeightGradStore", "DeferredWeightGrads",
    # attention (GQA, MLA) and context parallelism
    "AttentionConfig", "MLAConfig", "GQAAttention", "MLAttention", "CoreAttention", "local_attention",
    "CP_COMM_MODES", "split_for_context_parallel", "context_parallel_positions", "gather_from_context_parallel",
    "check_context_parallel_seq_length", "context_parallel_attention", "position_mask",
    # documents packed in a sample (--reset-attention-mask, --reset-position-ids)
    "Documents", "packed_documents", "document_attention",
    # linear attention (Qwen3-Next)
    "GatedDeltaNet", "GatedDeltaNetConfig", "RecurrentCache", "GATED_DELTA_RULE_BACKENDS", "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule", "gated_delta_rule_impl",
]

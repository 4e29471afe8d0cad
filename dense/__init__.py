"""The dense transformer stack: TP/SP linear layers, embeddings and loss, norms, RoPE, attention, CP, MLP."""

from dense.attention import GQAAttention
from dense.attention_config import AttentionConfig, MLAConfig
from dense.block import TransformerBlock
from dense.context_parallel import (
    CP_COMM_MODES,
    check_context_parallel_seq_length,
    context_parallel_attention,
    context_parallel_positions,
    gather_from_context_parallel,
    position_mask,
    split_for_context_parallel,
)
from dense.core_attention import CoreAttention, local_attention
from dense.cross_entropy import masked_mean, vocab_parallel_cross_entropy
from dense.embedding import OutputHead, VocabParallelEmbedding, check_vocab, pad_vocab_size
from dense.linear import ColumnParallelLinear, RowParallelLinear
from dense.mla import MLAttention
from dense.mlp import MLP_ACTIVATIONS, DenseMLP, MLPConfig
from dense.norm import RMSNorm
from dense.recompute import RECOMPUTE_MODES, check_recompute, checkpointed
from dense.rope import (
    RotaryEmbedding,
    YarnConfig,
    apply_rotary,
    rotate_half,
    yarn_attention_factor,
    yarn_softmax_mscale,
)

__all__ = [
    # dense core: linear layers, RoPE, norm, embedding/head/loss, MLP, block, recompute
    "ColumnParallelLinear", "RowParallelLinear",
    "RotaryEmbedding", "YarnConfig", "apply_rotary", "rotate_half", "yarn_attention_factor", "yarn_softmax_mscale",
    "RMSNorm",
    "VocabParallelEmbedding", "OutputHead", "check_vocab", "pad_vocab_size",
    "vocab_parallel_cross_entropy", "masked_mean",
    "DenseMLP", "MLPConfig", "MLP_ACTIVATIONS",
    "TransformerBlock", "RECOMPUTE_MODES", "check_recompute", "checkpointed",
    # attention (GQA, MLA) and context parallelism
    "AttentionConfig", "MLAConfig", "GQAAttention", "MLAttention", "CoreAttention", "local_attention",
    "CP_COMM_MODES", "split_for_context_parallel", "context_parallel_positions", "gather_from_context_parallel",
    "check_context_parallel_seq_length", "context_parallel_attention", "position_mask",
]

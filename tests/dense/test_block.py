"""A full transformer block (pre-norm attention + dense SwiGLU MLP) equals world 1 in every layout."""

from moefold.dense.attention import GQAAttention
from moefold.dense.attention_config import AttentionConfig, MLAConfig
from moefold.dense.block import TransformerBlock
from moefold.dense.mla import MLAttention
from moefold.dense.mlp import DenseMLP, MLPConfig
from tests.dense.attention_layouts import STANDARD_LAYOUTS, Layout, attention_maker, check_layouts
from tests.distributed import run_distributed

GQA = AttentionConfig(hidden_size=32, num_heads=4, num_query_groups=2, qk_norm=True, sliding_window=6,
                      rope_theta=1000.0)
MLA = MLAConfig(hidden_size=32, num_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=8, rope_theta=1000.0)
MLP = MLPConfig(hidden_size=32, ffn_hidden_size=64)


def _maker(attn_cfg):
    make_attention = attention_maker(GQAAttention if isinstance(attn_cfg, AttentionConfig) else MLAttention, attn_cfg)

    def make(layout: Layout, tp_group, cp_group):
        attention = make_attention(layout, tp_group, cp_group)
        mlp = DenseMLP(MLP, tp_group, sequence_parallel=layout.sp)
        return TransformerBlock(32, attention, mlp, 1e-6, sequence_parallel=layout.sp, recompute=layout.recompute)
    return make


def _rank():
    cache: dict = {}
    done = check_layouts(_maker(GQA), STANDARD_LAYOUTS, seq=16, batch=2, hidden=32, seed=7, dims_cache=cache)
    mla = (Layout(tp=4, sp=True), Layout(cp=2, cp_comm="p2p"),
           Layout(tp=2, cp=2, sp=True, cp_comm="all_gather", recompute="full"))
    done += check_layouts(_maker(MLA), mla, seq=16, batch=2, hidden=32, seed=8, dims_cache=cache)
    return done


def test_block_layouts_equal_world1():
    done = run_distributed(_rank, 4)[0]
    assert len(done) == len(STANDARD_LAYOUTS) + 3

"""Megatron-LM checkpoints as Megatron-LM writes them, for every kind of model moefold reads from Megatron.

Each case is a Megatron-LM ``args`` namespace (every ``TransformerConfig`` argument at its default, then the
case's flags: ``tests/models/megatron_save.lm_args``), built as ``gpt_builder`` builds it (local spec), trained one
Adam step with Megatron-Core's DDP and optimizer, and saved as ``save_checkpoint`` saves it (``--ckpt-format
torch_dist``: args, the model's and the optimizer's sharded state dicts built with Megatron-LM's content
metadata, the scheduler, the RNG state). Then:

- ``import_megatron`` gives Megatron's logits at world 1 and at a parallel layout;
- ``export_megatron`` of the imported model loads into a fresh GPTModel the way Megatron-LM's ``load_checkpoint``
  loads (the content metadata read back from the checkpoint), at another layout, with the same logits.

========== ==================== =============================================================================
case       saved at             what it covers
========== ==================== =============================================================================
qwen3      world 1              ``--moe-layer-freq 1`` (the stacked ``decoder.layers.<name> [L, ...]`` layout),
                                qk-layernorm, softmax over all experts, ``--norm-epsilon 1e-6``, untied
mixtral    world 1              singleton local shards (per-expert tensors, GLU halves apart), tied
                                embeddings, a sliding window
deepseek   ep2 (world 2)        dense first layer (``--moe-layer-freq [0,1,1]``), sigmoid group-limited routing
                                with expert bias and scaling, a gated shared expert, one MTP layer
glm        tp2 (world 2)        stacked layers with an MTP layer beside them, q/k/v biases, partial RoPE,
                                qk-layernorm, sigmoid routing with expert bias, a shared expert (no optimizer:
                                Megatron trains MoE at tp > 1 only with sequence parallelism, which its CPU
                                norm does not support)
gpt_oss    ep2 (world 2)        GPT-OSS's features as Megatron-LM's flags: sinks (``--softmax-type learnable``),
                                biases on every linear and the router, quick GeGLU with offset 1 and a clamp,
                                a window on every other layer (``--window-attn-skip-freq 2``); stacked layers
========== ==================== =============================================================================

Tolerance: moefold's fp32 logits against the same moefold model in float64 give fp32's own error on these
logits; Megatron's fp32 logits are another fp32 evaluation of the same function (``tests/tolerance.bound``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from moefold.models.decoder import MoEDecoder
from moefold.models.megatron import export_megatron, import_megatron, load_megatron_weights, megatron_config
from moefold.parallel.dims import ParallelConfig, ParallelDims
from tests.distributed import run_distributed
from tests.megatron_compat import init_megatron, require_megatron
from tests.tolerance import bound

V, H, S, B = 64, 32, 8, 2
_BASE = dict(num_layers=2, hidden_size=H, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
             kv_channels=8, ffn_hidden_size=48, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
             position_embedding_type="rope", max_position_embeddings=64, padded_vocab_size=V, num_experts=4,
             moe_ffn_hidden_size=16, moe_router_topk=2, untie_embeddings_and_output_weights=True)
# name: (Megatron layout it is saved at, the layout moefold's export is loaded back at, optimizer step, singleton
# local shards, the layout moefold imports at besides world 1, the case's flags)
CASES = {
    "qwen3": ((1, 1), (1, 1), True, False, None,
              dict(moe_layer_freq=1, qk_layernorm=True, moe_router_pre_softmax=True, layernorm_epsilon=1e-6,
                   rotary_base=1000000)),
    "mixtral": ((1, 1), (1, 1), True, True, None,
                dict(moe_layer_freq=1, untie_embeddings_and_output_weights=False, window_size=(3, 0))),
    "deepseek": ((1, 2), (1, 1), True, False, dict(ep=2),
                 dict(num_layers=3, moe_layer_freq=[0, 1, 1], moe_router_score_function="sigmoid",
                      moe_router_num_groups=2, moe_router_group_topk=1, moe_router_enable_expert_bias=True,
                      moe_router_topk_scaling_factor=2.0, moe_shared_expert_intermediate_size=16,
                      moe_shared_expert_gate=True, mtp_num_layers=1, moe_router_load_balancing_type="seq_aux_loss",
                      moe_aux_loss_coeff=1e-2)),
    "glm": ((2, 1), (1, 2), False, False, dict(tp=2),
            dict(moe_layer_freq=1, add_qkv_bias=True, rotary_percent=0.5, qk_layernorm=True,
                 moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_shared_expert_intermediate_size=16, mtp_num_layers=1)),
    "gpt_oss": ((1, 2), (2, 1), True, False, dict(tp=2),
                dict(moe_layer_freq=1, add_bias_linear=True, softmax_type="learnable", swiglu=False, quick_geglu=True,
                     glu_linear_offset=1.0, activation_func_clamp_value=0.5, window_size=(3, 0),
                     window_attn_skip_freq=2, expert_tensor_parallel_size=1)),   # Megatron: MoE biases need etp 1
}
WORLDS = {1: ("qwen3", "mixtral"), 2: ("deepseek", "glm", "gpt_oss")}


def _ids() -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(3))


def _args(name: str):
    from tests.models.megatron_save import lm_args

    (tp, ep), *_ = CASES[name]
    return lm_args(**{**_BASE, **CASES[name][5], "tensor_model_parallel_size": tp, "expert_model_parallel_size": ep})


def _with_bound(model: MoEDecoder, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """moefold's fp32 logits and how far another fp32 evaluation may be (its float64 run: tests/tolerance.py)."""
    model.eval()
    ref64 = copy.deepcopy(model).double()
    ref64.eval()
    logits = model.logits(ids)
    return logits, bound(logits, ref64.logits(ids).double())


def _case(name: str, root: str) -> dict[str, float]:
    """Rank function: save case ``name`` as Megatron-LM, import it, export it, load the export back (module doc)."""
    from tests.models import megatron_save as mlm

    (tp, ep), (back_tp, back_ep), step, singleton, layout, _ = CASES[name]
    args, ids = _args(name), _ids()
    init_megatron(tp=tp, ep=ep, etp=args.expert_tensor_parallel_size)
    torch.manual_seed(11)
    model = mlm.build_gpt(args)
    mlm.perturb(model, 5)
    optimizer = mlm.train_step(model, ids) if step else None
    ref = mlm.logits(model, ids)
    ckpt = f"{root}/{name}"
    mlm.save_checkpoint(model, optimizer, args, ckpt, iteration=7, singleton=singleton)

    ours = import_megatron(ckpt)
    logits, limit = _with_bound(ours, ids)
    out = {"world 1": (logits - ref).abs().max().item(), "limit": limit}
    exported = ours
    if layout is not None:
        exported = import_megatron(ckpt, ParallelDims.build(ParallelConfig(**layout)))
        exported.eval()
        out["parallel"] = (exported.logits(ids) - ref).abs().max().item()
    export_megatron(exported, f"{root}/{name}-export")

    init_megatron(tp=back_tp, ep=back_ep, etp=args.expert_tensor_parallel_size)
    args.tensor_model_parallel_size, args.expert_model_parallel_size = back_tp, back_ep
    torch.manual_seed(99)   # other initial weights: everything must come from the checkpoint
    back = mlm.build_gpt(args)
    saved = mlm.load_checkpoint(back, f"{root}/{name}-export")
    assert saved.num_layers == args.num_layers
    out["back"] = (mlm.logits(back, ids) - ref).abs().max().item()
    return out


def _world(names: tuple[str, ...], root: str) -> dict[str, dict[str, float]]:
    return {name: _case(name, root) for name in names}


@pytest.fixture(scope="module")
def megatron_cases(tmp_path_factory):
    require_megatron()
    root = str(tmp_path_factory.mktemp("megatron-lm"))
    report = {}
    for world, names in WORLDS.items():
        results = run_distributed(_world, world, names, root, timeout=600)
        for name in names:   # the largest difference over the ranks
            report[name] = {k: max(r[name][k] for r in results) for k in results[0][name]}
    return root, report


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_lm_checkpoint_imports_and_exports(name, megatron_cases):
    _, report = megatron_cases
    r = report[name]
    print(name, {k: f"{v:.3g}" for k, v in r.items()})
    for key in ("world 1", "parallel", "back"):
        if key in r:
            assert r[key] <= r["limit"], (name, key, r)


def test_configs_read_from_the_args(megatron_cases):
    root, _ = megatron_cases
    qwen3, mixtral, deepseek, glm = (megatron_config(f"{root}/{n}") for n in ("qwen3", "mixtral", "deepseek", "glm"))
    assert (qwen3.norm_eps, qwen3.moe_layer_freq, qwen3.qk_norm, qwen3.moe_norm_topk_prob) == (1e-6, 1, True, False)
    assert (mixtral.tie_word_embeddings, mixtral.sliding_window, mixtral.norm_eps) == (True, 4, 1e-5)
    assert (deepseek.moe_layer_freq, deepseek.mtp_num_layers, deepseek.moe_shared_expert_gate) == ((0, 1, 1), 1, True)
    assert (glm.attention_bias, glm.attention_out_bias, glm.partial_rotary_factor, glm.family) == \
        (True, False, 0.5, "glm4_moe")
    gpt_oss = megatron_config(f"{root}/gpt_oss")
    assert (gpt_oss.attention_sinks, gpt_oss.moe_router_bias, gpt_oss.moe_expert_linear_bias, gpt_oss.moe_swiglu_alpha,
            gpt_oss.moe_glu_linear_offset, gpt_oss.moe_activation_clamp, gpt_oss.sliding_window_pattern) == \
        (True, True, True, 1.702, 1.0, 0.5, (1, 0))


def test_stacked_layers_are_checked_against_the_model(megatron_cases):
    """A stacked checkpoint holds L layers on its leading axis: a model of another depth is refused naming both."""
    root, _ = megatron_cases
    config = megatron_config(f"{root}/qwen3")
    with pytest.raises(ValueError, match=r"stores its layers stacked, 2 of them .*num_layers=3"):
        load_megatron_weights(MoEDecoder(config.with_(num_layers=3)), f"{root}/qwen3")


def test_the_checkpoints_hold_megatron_lms_layouts(megatron_cases):
    """What the cases cover is in the files: the stacked layer axis, singleton local shards, per-layer layers, the
    optimizer's moments, the RNG state and the content metadata Megatron-LM writes."""
    from moefold.models.megatron.convert import find_megatron_checkpoint
    from moefold.models.megatron.dcp_io import DcpReader

    root, _ = megatron_cases
    readers = {n: DcpReader(find_megatron_checkpoint(f"{root}/{n}")) for n in CASES}
    assert readers["qwen3"].shape("decoder.layers.mlp.experts.experts.linear_fc1.weight") == (2, 4, 32, H)
    assert readers["glm"].shape("decoder.layers.self_attention.linear_qkv.bias") == (2, 64)
    assert "mtp.layers.0.transformer_layer.mlp.router.weight" in readers["glm"]
    assert readers["mixtral"].shape("decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight_v") == (16, H)
    assert "output_layer.weight" not in readers["mixtral"]
    assert readers["deepseek"].shape("decoder.layers.0.mlp.linear_fc1.weight") == (96, H)
    for name in ("qwen3", "mixtral", "deepseek"):
        assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in readers[name].tensors), name
        assert any(k.startswith("rng_state") for k in readers[name].objects), name
    common = torch.load(f"{find_megatron_checkpoint(f'{root}/mixtral')}/common.pt", weights_only=False)
    assert common["content_metadata"] == {"singleton_local_shards": True, "chained_optim_avoid_prefix": True}
    export = torch.load(f"{root}/qwen3-export/release/common.pt", weights_only=False)
    assert export["content_metadata"]["non_homogeneous_layers"] is True

"""``ModelConfig`` composed of its concerns (issue 44 item 1): every earlier flat name still reads, takes, saves and
loads its value; each section hands its values to the component config it configures; the model flags are made
from the fields (issue 44 item 1's one table)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moefold.models.config import ModelConfig
from moefold.models.layer_factory import moe_config, router_config
from moefold.models.model_sections import ModelMoE, ModelRouter
from moefold.models.options import ModelOptions
from moefold.models.recipes import RECIPES, get_recipe
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelDims

# the fields of the flat ModelConfig before the sections, in its order: what checkpoints and run configs hold
EARLIER_FIELDS = (
    "name", "family", "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "head_dim",
    "attention", "mla", "qk_norm", "sliding_window", "attention_bias", "rope_theta", "yarn", "max_position_embeddings",
    "norm_eps", "ffn_hidden_size", "tie_word_embeddings", "num_experts", "moe_ffn_hidden_size", "moe_topk",
    "moe_score_function", "moe_pre_softmax", "moe_norm_topk_prob", "moe_topk_scaling_factor", "moe_num_groups",
    "moe_group_topk", "moe_group_score_topk", "moe_expert_bias", "moe_shared_expert_ffn_size",
    "moe_shared_expert_gate", "first_k_dense_replace", "moe_layer_freq", "moe_aux_loss_coeff",
    "moe_load_balancing_type", "moe_aux_loss_counts", "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_router_dtype",
    "moe_bias_update_rate", "moe_expert_capacity_factor", "moe_expert_rank_capacity_factor", "moe_token_drop_policy",
    "moe_pad_expert_input_to_capacity", "moe_router_force_load_balancing", "moe_apply_probs_on_input",
    "mtp_num_layers", "mtp_loss_scaling_factor", "qk_norm_scope", "partial_rotary_factor", "attention_out_bias",
    "attention_sinks", "sliding_window_pattern", "moe_router_bias", "moe_expert_linear_bias", "moe_swiglu_alpha",
    "moe_activation_clamp", "moe_glu_linear_offset", "layer_types", "linear_attention", "attention_output_gate",
    "norm_zero_centered_gamma", "extra")
# added since (issue 50): quantile balancing's EMA, latent experts
ADDED_FIELDS = ("moe_router_quantile_balancing_ema", "moe_latent_size", "dsa", "ffn_activation", "mamba",
                "v4")   # issue 51: Nemotron-H (ffn_activation, mamba), DeepSeek-V4 (v4)


def _earlier_router(c: ModelConfig, init_std: float) -> RouterConfig:
    """The RouterConfig the flat ModelConfig was translated into before the sections (the reference)."""
    pre = c.moe_pre_softmax and c.moe_score_function == "softmax"
    norm = None if c.moe_score_function == "softmax" and not pre else c.moe_norm_topk_prob
    scale = c.moe_topk_scaling_factor if c.moe_topk_scaling_factor != 1.0 else None
    return RouterConfig(
        num_experts=c.num_experts, topk=c.moe_topk, score_function=c.moe_score_function, pre_softmax=pre,
        norm_topk_prob=norm, topk_scaling_factor=scale,
        num_groups=c.moe_num_groups, group_topk=c.moe_group_topk, group_score_topk=c.moe_group_score_topk,
        load_balancing_type=c.moe_load_balancing_type, aux_loss_coeff=c.moe_aux_loss_coeff,
        aux_loss_counts=c.moe_aux_loss_counts, enable_expert_bias=c.moe_expert_bias,
        bias_update_rate=c.moe_bias_update_rate, z_loss_coeff=c.moe_z_loss_coeff,
        input_jitter_eps=c.moe_input_jitter_eps, router_dtype=c.moe_router_dtype,
        expert_capacity_factor=c.moe_expert_capacity_factor, token_drop_policy=c.moe_token_drop_policy,
        expert_rank_capacity_factor=c.moe_expert_rank_capacity_factor,
        pad_expert_input_to_capacity=c.moe_pad_expert_input_to_capacity,
        force_load_balancing=c.moe_router_force_load_balancing, init_std=init_std, bias=c.moe_router_bias)


def test_every_earlier_flat_name_is_a_flat_name_and_saved_flat():
    assert sorted(ModelConfig.FLAT_NAMES) == sorted(EARLIER_FIELDS + ADDED_FIELDS)
    for name in RECIPES:
        config = get_recipe(name)
        saved = json.loads(json.dumps(config.to_dict()))
        assert sorted(saved) == sorted(EARLIER_FIELDS + ADDED_FIELDS), name   # the flat form, as moefold writes it
        assert ModelConfig.from_dict(saved) == config
        if all(saved[k] == getattr(ModelConfig, k) for k in ADDED_FIELDS):   # a model an earlier moefold could write
            earlier = {k: saved[k] for k in EARLIER_FIELDS}   # what it wrote: the added fields take their defaults
            assert ModelConfig.from_dict(earlier) == config
        nested = json.loads(json.dumps(dataclasses.asdict(config)))   # by section, as YAML may give it
        assert "moe" in nested and "moe_topk" not in nested and ModelConfig.from_dict(nested) == config
        assert ModelConfig(**{**saved, "moe": {"router": {"topk": 1}}, "moe_topk": 1}).moe.router.topk == 1


def test_flat_names_reach_their_section_and_keep_the_others():
    config = get_recipe("deepseek_v3_tiny")
    assert (config.moe_topk, config.moe_expert_bias, config.attention) == \
        (config.moe.router.topk, config.moe.router.enable_expert_bias, config.self_attention.kind)
    assert (ModelConfig.moe_topk, ModelConfig.attention, ModelConfig.mtp_loss_scaling_factor) == (2, "gqa", 0.1)
    changed = config.with_(moe_topk=3, moe_shared_expert_ffn_size=64, rope_theta=5e5, mtp_num_layers=0)
    assert (changed.moe.router.topk, changed.moe.shared.ffn_size) == (3, 64)
    assert (changed.self_attention.rope_theta, changed.mtp.num_layers) == (5e5, 0)
    assert changed.moe.experts is config.moe.experts and changed.hybrid is config.hybrid   # untouched sections stay
    assert {k: v for k, v in changed.flat_dict().items() if v != config.flat_dict()[k]} == \
        {"moe_topk": 3, "moe_shared_expert_ffn_size": 64, "rope_theta": 5e5, "mtp_num_layers": 0}
    assert changed.with_(moe=config.moe).moe == config.moe


def test_each_value_is_checked_by_its_section():
    with pytest.raises(ValueError, match=r"moe_topk=9 must be in \[1, num_experts=8\]"):
        ModelMoE(num_experts=8, moe_topk=9, moe_ffn_hidden_size=16)
    with pytest.raises(ValueError, match=r"moe_score_function='relu'"):
        ModelRouter(score_function="relu")
    with pytest.raises(TypeError, match="moe_topk"):
        ModelRouter(moe_topk=2)   # a plain section takes its own names; the flat ones are the composite's


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_sections_reach_the_component_configs_unchanged(name):
    config = get_recipe(name)
    if not config.num_experts:
        pytest.skip("dense")
    options = ModelOptions(init_std=0.01)
    assert router_config(config, options) == _earlier_router(config, 0.01)
    moe = moe_config(config, options, ParallelDims.single())
    assert (moe.experts.ffn_hidden_size, moe.experts.bias) == \
        (config.moe_ffn_hidden_size, config.moe_expert_linear_bias)
    assert (moe.experts.glu.alpha, moe.experts.glu.clamp, moe.experts.glu.linear_offset) == \
        (config.moe_swiglu_alpha, config.moe_activation_clamp, config.moe_glu_linear_offset)
    assert (moe.shared is None) == (not config.moe_shared_expert_ffn_size)
    assert moe.apply_probs_on_input == config.moe_apply_probs_on_input


def test_model_flags_are_the_fields():
    from moefold.training.cli.model_flags import MODEL_FLAGS

    flags = {e.flag: e for e in MODEL_FLAGS}
    # the architecture flags, the router and run-time ones (+ --moe-router-quantile-balancing-ema, --moe-latent-size)
    assert len(flags) == len(MODEL_FLAGS) == 28 + 19 + 2
    topk = flags["--moe-router-topk"]
    assert (topk.field, topk.group, topk.type) == ("moe_topk", "model", int)
    score = flags["--moe-router-score-function"]
    field = next(f for f in dataclasses.fields(ModelRouter) if f.name == "score_function")
    assert (score.help, score.choices, score.override) == (field.metadata["help"],
                                                           ("softmax", "sigmoid", "sqrtsoftplus"), False)
    assert flags["--moe-z-loss-coeff"].override and flags["--moe-aux-loss-counts"].group == "megatron"
    assert flags["--q-lora-rank"].kinds == ("mla",) and flags["--kv-channels"].kinds == ("gqa",)
    for entry in MODEL_FLAGS:   # every flag sets a flat name of the model (or a field of its MLA sizes)
        assert entry.field.split(".")[0] in ModelConfig.FLAT_NAMES, entry

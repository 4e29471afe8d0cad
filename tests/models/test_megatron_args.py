"""Every argument of Megatron-LM's saved ``args`` is read, refused, or not part of the model (models/megatron/args.py).

The arguments are megatron-core 0.16.1's ``TransformerConfig`` and ``MLATransformerConfig`` fields (Megatron-LM
core_v0.16.1 generates one argument per field) and the network-size / MoE arguments of Megatron-LM's
``arguments.py`` (``tests/models/megatron_save._NETWORK_DEFAULTS``). For each:

- read: another value changes the ``ModelConfig`` (or is refused naming the argument);
- refused: any value but the default is refused in one line naming the argument and the value;
- not part of the model: listed with the reason in ``NOT_MODEL``; another value leaves the config as it was.
"""

from __future__ import annotations

import dataclasses

import pytest

from moefold.models.megatron.args import NOT_MODEL, READ, REFUSED, config_from_megatron
from tests.models.other_value import other_value

pytest.importorskip("megatron.core")

_MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
              kv_channels=8, ffn_hidden_size=48, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
              position_embedding_type="rope", max_position_embeddings=64, padded_vocab_size=64, num_experts=4,
              moe_ffn_hidden_size=16, moe_router_topk=2, mtp_num_layers=None)
# values tests.models.other_value cannot choose
_OTHER = {
    "normalization": "LayerNorm", "position_embedding_type": "learned_absolute", "moe_router_score_function": "sigmoid",
    "moe_router_load_balancing_type": "seq_aux_loss", "moe_router_dtype": "fp64", "moe_token_drop_policy": "position",
    "window_size": (3, 0), "window_attn_skip_freq": 2, "moe_layer_freq": [0, 1], "moe_router_num_groups": 2,
    "moe_router_group_topk": 1, "moe_shared_expert_intermediate_size": 16, "moe_z_loss_coeff": 1e-3,
    "moe_input_jitter_eps": 0.1, "moe_expert_capacity_factor": 1.5, "moe_router_topk_scaling_factor": 2.0,
    "mtp_num_layers": 1, "num_query_groups": 4, "kv_channels": 16, "num_attention_heads": 8,
    "moe_aux_loss_coeff": 1e-2, "softmax_type": "learnable", "experimental_attention_variant": "gated_delta_net",
    "rotary_percent": 0.5, "padded_vocab_size": 128,
}


# read arguments that only act beside another one: (the other's value)
_BESIDE = {"window_attn_skip_freq": {"window_size": (3, 0)}}


def _network_args() -> set[str]:
    from tests.models.megatron_save import _NETWORK_DEFAULTS

    return set(_NETWORK_DEFAULTS)


def _all_args() -> set[str]:
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return ({f.name for f in dataclasses.fields(TransformerConfig)}
            | {f.name for f in dataclasses.fields(MLATransformerConfig)} | _network_args())


def _base() -> dict:
    from tests.models.megatron_save import lm_args

    return vars(lm_args(**_MODEL))


def _config(args: dict):
    return config_from_megatron(args, int(args.get("padded_vocab_size") or 64))


def _other(name: str, value):
    return _OTHER[name] if name in _OTHER else other_value(value)


def test_every_argument_is_classified_once():
    not_model = {a for args in NOT_MODEL.values() for a in args}
    groups = {"read": READ, "refused": set(REFUSED), "not part of the model": not_model}
    for (a, x), (b, y) in ((p, q) for p in groups.items() for q in groups.items() if p[0] < q[0]):
        assert not x & y, f"in both {a} and {b}: {sorted(x & y)}"
    unclassified = _all_args() - READ - set(REFUSED) - not_model
    assert not unclassified, f"Megatron-LM arguments neither read, refused nor listed as not the model's: " \
                             f"{sorted(unclassified)}"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_argument_is_named_with_its_value(name):
    default, _ = REFUSED[name]
    value = _other(name, default)
    with pytest.raises(ValueError, match=rf"--{name.replace('_', '-')}={value!r}".replace("(", r"\(").replace(
            ")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        _config({**_base(), name: value})


def test_read_arguments_change_the_config():
    unread = []
    for name in sorted(READ):
        base = {**_base(), **_BESIDE.get(name, {})}
        ref = _config(base)
        changed = {**base, name: _other(name, base.get(name))}
        try:
            if _config(changed) == ref:
                unread.append(name)
        except ValueError as exc:
            assert str(exc).count("\n") == 0, (name, exc)
    assert not unread, f"read arguments whose value does not change the config: {unread}"


def test_not_model_arguments_leave_the_config():
    base = _base()
    ref = _config(base)
    for reason, names in NOT_MODEL.items():
        for name in names:
            if name in base and base[name] is not None and not callable(base[name]):
                assert _config({**base, name: _other(name, base[name])}) == ref, (name, reason)


def test_older_spellings():
    """Megatron-LM before core_v0.16 stored --norm-epsilon as norm_epsilon and --apply-layernorm-1p as
    apply_layernorm_1p; core_v0.16.1 stores the TransformerConfig names."""
    base = {k: v for k, v in _base().items() if k not in ("layernorm_epsilon", "layernorm_zero_centered_gamma")}
    assert _config({**base, "norm_epsilon": 1e-6}).norm_eps == 1e-6
    assert _config({**base, "layernorm_epsilon": 1e-6, "norm_epsilon": 1e-5}).norm_eps == 1e-6
    with pytest.raises(ValueError, match=r"--layernorm-zero-centered-gamma=True"):
        _config({**base, "apply_layernorm_1p": True})

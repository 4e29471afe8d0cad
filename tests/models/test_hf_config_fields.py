"""Every field of every family's transformers config class is read, inert, or refused (models/hf/config_fields.py).

For each config class (transformers 5.25) the test lists ``Class().to_dict()``'s fields and checks:

- each is in exactly one of ``READ`` / ``INERT`` (+ the class's own) / ``REFUSED``;
- a read field: another value changes ``from_hf_config``'s ``ModelConfig`` (or is refused there in one line);
- an inert field: another value leaves the ``ModelConfig`` as it was (its name aside: ``_name_or_path``);
- a refused field: any value but the default is refused at import in one line naming the field and the value;
- partial RoPE in a class that rotates whole heads is refused the same way.

The base of each class is the tiny config of ``tests/models/hf_tiny`` (transformers' own class fills the rest).
"""

from __future__ import annotations

import pytest

from moefold.models.hf.config_fields import INERT, INERT_BY_CLASS, PARTIAL_ROTARY, READ, REFUSED
from moefold.models.hf.config_map import from_hf_config
from tests.models.hf_tiny import TINY, VOCAB, qwen3_5_moe_config, qwen3_next_config
from tests.models.other_value import other_value

transformers = pytest.importorskip("transformers")

CLASSES = {"deepseek_v3": "DeepseekV3Config", "qwen3_moe": "Qwen3MoeConfig", "qwen3": "Qwen3Config",
           "mixtral": "MixtralConfig", "mistral": "MistralConfig", "gpt_oss": "GptOssConfig",
           "glm4_moe": "Glm4MoeConfig", "olmoe": "OlmoeConfig", "minimax_m2": "MiniMaxM2Config",
           "qwen3_next": "Qwen3NextConfig", "qwen3_5_moe_text": "Qwen3_5MoeTextConfig",
           "deepseek_v32": "DeepseekV32Config", "glm_moe_dsa": "GlmMoeDsaConfig", "nemotron_h": "NemotronHConfig"}
_DENSE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
# another value, where tests.models.other_value's does not fit
_OTHER = {"rope_parameters": {"rope_type": "default", "rope_theta": 12345.0}, "mlp_only_layers": [0],
          "hidden_act": "gelu", "layer_types": None, "torch_dtype": "float16", "dtype": "float16",
          "eos_token_id": 7, "id2label": {0: "a"}, "label2id": {"a": 0}, "problem_type": "regression",
          "_name_or_path": "elsewhere"}
# fields read only beside another value
_BESIDE = {("qwen3_moe", "sliding_window"): {"use_sliding_window": True},
           ("qwen3_moe", "use_sliding_window"): {"sliding_window": 4},
           # DeepSeek-V3.2: first_k_dense_replace makes mlp_layer_types only where a config leaves it out
           ("deepseek_v32", "first_k_dense_replace"): {"mlp_layer_types": None},
           ("glm_moe_dsa", "first_k_dense_replace"): {"mlp_layer_types": None}}
_IDENTITY = ("architectures", "model_type")   # they pick the family (test_hf_interop: unknown architectures)


def _base(key: str) -> dict:
    cls = getattr(transformers, CLASSES[key])
    if key == "qwen3_next":
        config = qwen3_next_config()
    elif key == "qwen3_5_moe_text":
        config = qwen3_5_moe_config()
    elif key == "nemotron_h":
        from tests.models.nemotron_h_tiny import draw

        config = cls(**draw(0))
    elif key in TINY:
        config = cls(**TINY[key][1])
    else:
        config = cls(**_DENSE)
    arch = CLASSES[key].replace("TextConfig", "Config").replace("Config", "ForCausalLM")
    return {**config.to_dict(), "architectures": [arch]}


def _other(key: str, field: str, value):
    if key in ("qwen3_next", "qwen3_5_moe_text") and field == "layer_types":
        return ["full_attention"] * len(value)
    if key == "nemotron_h" and field == "layers_block_type":
        return list(reversed(value))
    if key == "nemotron_h" and field == "moe_latent_size":
        return 8 if value is None else None
    if field == "layer_types" and value:
        return list(reversed(value)) if len(set(value)) > 1 else ["full_attention"] * (len(value) - 1) + \
            ["sliding_attention"]
    return _OTHER[field] if field in _OTHER else other_value(value)


def _fields(key: str) -> set[str]:
    return set(getattr(transformers, CLASSES[key])().to_dict())


@pytest.mark.parametrize("key", list(CLASSES))
def test_every_field_is_read_inert_or_refused(key):
    inert = set(INERT) | set(INERT_BY_CLASS.get(key, {}))
    groups = {"read": READ[key], "inert": inert, "refused": set(REFUSED[key])}
    for (a, x), (b, y) in ((p, q) for p in groups.items() for q in groups.items() if p[0] < q[0]):
        assert not x & y, f"{key}: in both {a} and {b}: {sorted(x & y)}"
    unclassified = _fields(key) - READ[key] - inert - set(REFUSED[key])
    assert not unclassified, f"{CLASSES[key]} fields neither read, inert nor refused: {sorted(unclassified)}"


@pytest.mark.parametrize("key", list(CLASSES))
def test_read_fields_change_the_config(key):
    unread = []
    for field in sorted(READ[key] & _fields(key)):
        base = {**_base(key), **_BESIDE.get((key, field), {})}
        ref = from_hf_config(base)
        try:
            changed = from_hf_config({**base, field: _other(key, field, base.get(field))})
        except ValueError as exc:   # refused, in one line
            assert "\n" not in str(exc), (field, exc)
            continue
        if changed == ref:
            unread.append(field)
    assert not unread, f"{CLASSES[key]}: read fields whose value does not change the config: {unread}"


@pytest.mark.parametrize("key", list(CLASSES))
def test_inert_fields_leave_the_config(key):
    base = _base(key)
    ref = from_hf_config(base).with_(name="x")
    for field in sorted((set(INERT) | set(INERT_BY_CLASS.get(key, {}))) & _fields(key)):
        if field in _IDENTITY:
            continue
        changed = from_hf_config({**base, field: _other(key, field, base.get(field))}).with_(name="x")
        assert changed == ref, (key, field)


@pytest.mark.parametrize("key", list(CLASSES))
def test_refused_fields_are_named_with_their_value(key):
    base = _base(key)
    for field, (default, _) in REFUSED[key].items():
        value = _other(key, field, default)
        with pytest.raises(ValueError, match=rf"^{key}: {field}={value!r} is not supported \("):
            from_hf_config({**base, field: value})


@pytest.mark.parametrize("key", sorted(set(CLASSES) - PARTIAL_ROTARY - {"nemotron_h"}))   # NemotronH: no RoPE
def test_partial_rotary_is_refused_where_transformers_rotates_whole_heads(key):
    base = _base(key)
    rope = {**(base.get("rope_parameters") or {"rope_type": "default", "rope_theta": 1e4}),
            "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match=rf"^{key}: partial_rotary_factor=0.5 is not supported"):
        from_hf_config({**base, "rope_parameters": rope})


def test_multimodal_rope_keys_are_inert_for_text():
    """Qwen3.5-MoE's ``mrope_section`` / ``mrope_interleaved`` (``ROPE_INERT``) leave the config as it was."""
    from moefold.models.hf.config_fields import ROPE_INERT

    base = _base("qwen3_5_moe_text")
    ref = from_hf_config(base).with_(name="x")
    rope = dict(base["rope_parameters"])
    for key in ROPE_INERT["qwen3_5_moe_text"]:
        rope.pop(key)
    assert from_hf_config({**base, "rope_parameters": rope}).with_(name="x") == ref
    other = {**rope, "mrope_section": [0, 1, 1], "mrope_interleaved": False}
    assert from_hf_config({**base, "rope_parameters": other}).with_(name="x") == ref

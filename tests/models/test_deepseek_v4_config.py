"""DeepSeek-V4's ``config.json`` reading without transformers equals ``DeepseekV4Config``'s (transformers 5.25).

``models.hf.deepseek_v4.read_fields`` transcribes the class's defaults and its folding of DeepSeek's legacy names;
here every field it gives equals the class's attribute of the same name, and ``config_from_hf`` equals
``model_config`` of the class itself (the reading before the transcription), over the random configs of
``test_deepseek_v4_model``, the published DeepSeek-V4-Flash config, each legacy spelling and configs with keys left
out. Then ``config_from_hf`` runs with ``transformers`` unimportable.
"""

from __future__ import annotations

import copy
import sys

import pytest

from moefold.models.hf import deepseek_v4 as v4
from tests.models.test_deepseek_v4_model import _hf_config
from tests.models.test_deepseek_v4_recipes import FLASH_BASE

YARN = {"type": "yarn", "factor": 4, "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1}
KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
_NOT_KWARGS = ("architectures", "model_type", "transformers_version", "topk_method")


def _variants() -> list[tuple[str, dict]]:
    """(label, config.json) pairs: each legacy spelling alone and together, keys left out, nested RoPE forms."""
    base = _hf_config(1)   # 2-4 layers, YaRN through a top-level rope_scaling
    n = base["num_hidden_layers"]
    drop = {k: v for k, v in base.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates",
                                                       "rope_scaling")}
    no_rotary = {k: v for k, v in drop.items() if k != "partial_rotary_factor"}   # head_dim 8: the default is 1/8
    out = [(f"random{seed}", _hf_config(seed)) for seed in range(8)]
    out += [("flash", FLASH_BASE), ("empty", {}), ("only layers", {"num_hidden_layers": 3}),
            ("one layer", {"num_hidden_layers": 1}), ("derived keys left out", drop),
            ("compress_ratios", {**drop, "compress_ratios": [*[0, 4, 128, 4, 0][:n], 0]}),
            ("compress_ratios under layer_types", {**base, "compress_ratios": [128] * n}),
            ("compress_rate_csa", {**drop, "compress_rate_csa": 8}),
            ("compress_rate_hca", {**base, "compress_rate_hca": 64}),
            ("num_hash_layers", {**drop, "num_hash_layers": 1}),
            ("num_hash_layers over layers", {**drop, "num_hash_layers": n + 2}),
            ("num_hash_layers under mlp_layer_types", {**base, "num_hash_layers": 0}),
            ("qk_rope_head_dim", {**no_rotary, "qk_rope_head_dim": 2}),
            ("qk_rope_head_dim under partial_rotary_factor", {**base, "qk_rope_head_dim": 2}),
            ("rope_scaling over rope_parameters", {**drop, "rope_scaling": YARN,
                                                   "rope_parameters": {"rope_type": "default"}}),
            ("flat rope_parameters yarn", {**drop, "rope_parameters": {**YARN, "rope_type": "yarn"}}),
            ("flat yarn without original length", {**drop, "rope_parameters": {"rope_type": "yarn", "factor": 2.0},
                                                   "partial_rotary_factor": 0.5}),
            ("nested rope_parameters", {**drop, "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": 50.0},
                "compress": {"type": "yarn", "factor": 2.0, "attention_factor": 0.5}}}),
            ("nested with partial_rotary_factor", {**base, "rope_parameters": {
                "main": {"rope_theta": 50.0}, "compress": {"rope_type": "default"}}}),
            ("nested, no partial_rotary_factor", {**no_rotary, "head_dim": 16, "rope_parameters": {
                "main": {"rope_theta": 50.0}, "compress": {"rope_type": "yarn", "factor": 2.0}}}),
            ("half nested", {**drop, "rope_parameters": {"main": {"rope_theta": 50.0}}}),
            ("all legacy", {**drop, "compress_ratios": [4] * n, "compress_rate_csa": 2, "compress_rate_hca": 3,
                            "num_hash_layers": 2, "qk_rope_head_dim": 4, "rope_scaling": YARN}),
            ("all legacy, no partial_rotary_factor", {**no_rotary, "compress_ratios": [128] * n,
                                                      "num_hash_layers": 0, "qk_rope_head_dim": 4,
                                                      "rope_scaling": YARN}),
            ("longer layer lists", {**base, "layer_types": base["layer_types"] + KINDS,
                                    "mlp_layer_types": base["mlp_layer_types"] + ["moe"]})]
    return out


VARIANTS = _variants()


@pytest.mark.parametrize("label,hf", VARIANTS, ids=[label for label, _ in VARIANTS])
def test_reading_equals_deepseek_v4_config(label, hf):
    from transformers import DeepseekV4Config

    given = copy.deepcopy(hf)
    theirs = DeepseekV4Config(**{k: v for k, v in copy.deepcopy(hf).items() if k not in _NOT_KWARGS})
    ours = v4.read_fields(hf)
    assert hf == given, "read_fields changed its input"
    for key, value in vars(ours).items():
        assert value == getattr(theirs, key), (label, key, value, getattr(theirs, key))
    assert set(vars(ours)) == set(v4.DEFAULTS) | {"compress_rates", "layer_types", "mlp_layer_types",
                                                  "partial_rotary_factor", "rope_parameters"}
    assert v4.config_from_hf(hf, name=label) == v4.model_config(theirs, label)


@pytest.mark.parametrize("hf,match", [
    ({"num_hidden_layers": 2, "layer_types": ["sliding_attention"]}, "layer_types has 1"),
    ({"num_hidden_layers": 2, "mlp_layer_types": ["moe", "dense"]}, "mlp_layer_types entries"),
    ({"num_hidden_layers": 2, "layer_types": ["attention"] * 2}, "layer_types entries"),
    ({"num_hidden_layers": 2, "compress_ratios": [0, 8]}, "compress_ratios entries"),
    ({"rope_scaling": {"type": "yarn"}}, "YaRN without a factor")])
def test_what_the_class_refuses_is_refused(hf, match):
    from huggingface_hub.errors import StrictDataclassClassValidationError
    from transformers import DeepseekV4Config

    with pytest.raises((StrictDataclassClassValidationError, KeyError)):
        DeepseekV4Config(**copy.deepcopy(hf))
    with pytest.raises(ValueError, match=match):
        v4.config_from_hf(hf)
    with pytest.raises(ValueError, match="no rate for 'heavily_compressed_attention'"):   # the class's KeyError
        v4.config_from_hf({"compress_rates": {"compressed_sparse_attention": 4}})   # came later, in moefold


def test_reads_without_transformers(monkeypatch):
    """transformers is a test dependency only: the published config and a random one read with it unimportable."""
    want = [v4.config_from_hf(FLASH_BASE), v4.config_from_hf(_hf_config(3))]
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError):
        import transformers  # noqa: F401
    assert [v4.config_from_hf(FLASH_BASE), v4.config_from_hf(_hf_config(3))] == want

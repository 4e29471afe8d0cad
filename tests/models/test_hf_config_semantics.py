"""HF config values that transformers reads in ways a quick mapping misses, each against the transformers class.

- YaRN's ``attention_factor`` scales cos/sin in place of the factor transformers infers (issue 45 defect 5: it was
  ignored; Qwen3-MoE with 0.8 was off by 2.7 in the logits, GPT-OSS with 1.3 by 0.15), and YaRN's defaults:
  ``original_max_position_embeddings`` from ``max_position_embeddings``, a zero beta (32 / 1), and
  ``mscale_all_dim`` without ``mscale`` (transformers then infers the cos/sin factor from ``factor`` alone);
- DeepSeek-V3's latent norms (``q_a_layernorm``, ``kv_a_layernorm``) use eps 1e-6 whatever ``rms_norm_eps`` says
  (issue 45 defect 4: they used ``rms_norm_eps``, 4.4e-5 off at 1e-5), while Megatron's ``--norm-epsilon`` is every
  norm's eps; an HF export of other latent eps is refused naming it.

Tolerance: moefold within fp32's own error of transformers' logits (``hf_tiny.hf_logits_and_bound``).
"""

from __future__ import annotations

import json

import pytest
import torch

from moefold.models.hf.config_map import from_hf_config, to_hf_config
from moefold.models.hf.exporter import export_hf
from moefold.models.hf.importer import import_hf
from tests.models.hf_tiny import hf_logits, hf_logits_and_bound, save_hf, tokens

transformers = pytest.importorskip("transformers")

_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
CASES = [  # (family, rope_parameters): each departs from transformers' inference of the YaRN factor
    ("qwen3_moe", {**_YARN, "attention_factor": 0.8}),
    ("gpt_oss", {**_YARN, "rope_theta": 150000.0, "truncate": False, "attention_factor": 1.3}),
    ("mixtral", {**_YARN, "mscale_all_dim": 1.0}),                               # no mscale: factor from `factor`
    ("qwen3_moe", {**_YARN, "beta_fast": 0.0, "beta_slow": 0.0}),                # zero betas: 32 and 1
    ("olmoe", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0}),   # original = max_position_embeddings
]
_CHANGES = {"mixtral": {"head_dim": 8}}   # transformers' YaRN needs a head_dim on the config


@pytest.mark.parametrize("family,rope", CASES, ids=[f"{f}-{'-'.join(sorted(r))}" for f, r in CASES])
def test_yarn_as_transformers_reads_it(family, rope, tmp_path):
    hf = save_hf(family, tmp_path / "hf", changes={"rope_parameters": rope, **_CHANGES.get(family, {})})
    ids = tokens()
    ref, limit = hf_logits_and_bound(hf, ids)
    model = import_hf(tmp_path / "hf")
    diff = (model.logits(ids) - ref).abs().max().item()
    print(f"{family} {rope}: max |logits diff| {diff:.3g} (fp32 bound {limit:.3g})")
    assert diff <= limit
    export_hf(model, tmp_path / "out")   # written back so that transformers computes the same
    back = type(hf).from_pretrained(tmp_path / "out").eval()
    back.config._attn_implementation = hf.config._attn_implementation
    torch.testing.assert_close(hf_logits(back, ids), ref, atol=limit, rtol=0)


def test_attention_factor_round_trips_through_the_config():
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 32,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "intermediate_size": 48, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
          "rope_parameters": {**_YARN, "attention_factor": 0.8}}
    config = from_hf_config(hf)
    assert config.yarn.attention_factor == 0.8
    fresh = to_hf_config(config.with_(extra={}))
    assert fresh["rope_parameters"]["attention_factor"] == 0.8 and from_hf_config(fresh) == config


@pytest.mark.parametrize("eps", [1e-5, 1e-4])
def test_mla_latent_norms_use_deepseeks_fixed_eps(eps, tmp_path):
    hf = save_hf("deepseek_v3", tmp_path / "hf", changes={"rms_norm_eps": eps})
    ids = tokens()
    ref, limit = hf_logits_and_bound(hf, ids)
    model = import_hf(tmp_path / "hf")
    assert model.config.norm_eps == eps and model.config.mla.latent_norm_eps == 1e-6
    diff = (model.logits(ids) - ref).abs().max().item()
    print(f"deepseek_v3 rms_norm_eps={eps}: max |logits diff| {diff:.3g} (fp32 bound {limit:.3g})")
    assert diff <= limit
    # the latent eps HF cannot express is refused on export, naming it
    other = model.config.with_(mla=model.config.mla.__class__(**{**vars(model.config.mla), "latent_norm_eps": eps}))
    with pytest.raises(ValueError, match=r"'mla.latent_norm_eps': " + f"{eps}" + r".*'mla.latent_norm_eps': 1e-06"):
        to_hf_config(other)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rms_norm_eps"] == eps


def test_norm_epsilon_flag_is_megatrons_every_norm():
    """``--norm-epsilon`` (Megatron's flag) sets every norm's eps, MLA's latent norms included."""
    from moefold.models.recipes import get_recipe
    from moefold.training.cli import build_parser
    from moefold.training.cli.model_flags import apply_model_flags

    args = build_parser("train").parse_args(["train", "--recipe", "deepseek_v3_tiny", "--norm-epsilon", "1e-5"])
    config = apply_model_flags(get_recipe("deepseek_v3_tiny"), args)
    assert (config.norm_eps, config.mla.latent_norm_eps) == (1e-5, 1e-5)

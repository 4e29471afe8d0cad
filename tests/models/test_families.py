"""Issue 33's families at world 1: GPT-OSS, GLM-4.5, Kimi-K2, OLMoE, MiniMax-M2.

- tiny random HF checkpoints built with transformers' own config classes import with logits equal to
  transformers' (fp32, 1e-5), export back bit-exact (same tensor names and values, same config.json)
  and transformers reloads the export with the same logits;
- a negative control per new feature: the feature switched off in moefold (same weights) and the
  logits differ from transformers' (or the checkpoint no longer loads);
- recipes <-> HF configs; the published configs (transcribed in ``published_configs``) read as the
  recipes, Kimi-K2's through the DeepSeek-V3 path;
- quantized checkpoints, unknown GPT-OSS layer types and OLMoE's clip_qkv are refused naming the value.

Parallel layouts: tests/models/test_families_parallel.py. Parameter counts: tests/models/test_params.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from moefold.models.decoder import MoEDecoder
from moefold.models.hf.config_map import from_hf_config, to_hf_config
from moefold.models.hf.exporter import export_hf, hf_tensors
from moefold.models.hf.importer import import_hf, load_config, load_hf_weights
from moefold.models.pretrained import pretrained_config
from moefold.models.recipes import get_recipe
from moefold.models.tensor_io import TensorReader
from tests.models.hf_tiny import FEATURE_FAMILIES, hf_logits, save_hf, tokens
from tests.models.published_configs import PUBLISHED_CONFIGS

transformers = pytest.importorskip("transformers")

TOL = 1e-5
RECIPES = {"gpt_oss": ("gpt_oss_120b", "gpt_oss_20b", "gpt_oss_tiny"),
           "glm4_moe": ("glm4_5", "glm4_5_air", "glm4_6", "glm4_moe_tiny"), "kimi_k2": ("kimi_k2", "kimi_k2_tiny"),
           "olmoe": ("olmoe_1b_7b", "olmoe_tiny"), "minimax_m2": ("minimax_m2", "minimax_m2_tiny")}


def _tensors(path) -> dict[str, torch.Tensor]:
    with TensorReader(path) as r:
        return {n: r.read(n) for n in r.names()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (HF dir, HF logits of ``tokens()``)} for the five families."""
    out = {}
    for family in FEATURE_FAMILIES:
        path = tmp_path_factory.mktemp(family)
        out[family] = (path, hf_logits(save_hf(family, path), tokens()))
    return out


@pytest.mark.parametrize("family", FEATURE_FAMILIES)
def test_import_parity_export_roundtrip(family, checkpoints, tmp_path):
    src, ref = checkpoints[family]
    ids = tokens()
    model = import_hf(src)
    diff = (model.logits(ids) - ref).abs().max().item()
    print(f"{family}: world-1 max |logits diff| = {diff:.3g}")
    assert diff <= TOL
    export_hf(model, tmp_path / "out")
    a, b = _tensors(src), _tensors(tmp_path / "out")
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    cls = getattr(transformers, json.loads((src / "config.json").read_text())["architectures"][0])
    reloaded = cls.from_pretrained(tmp_path / "out").eval()
    reloaded.config._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"
    torch.testing.assert_close(hf_logits(reloaded, ids), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", FEATURE_FAMILIES)
def test_gradients_equal_transformers(family, checkpoints):
    """One backward of the same next-token loss: every parameter's gradient (sinks, biases, projection norms,
    interleaved experts ...) equals transformers' autograd, mapped to HF's in-memory names and layouts."""
    src, _ = checkpoints[family]
    cls = getattr(transformers, json.loads((src / "config.json").read_text())["architectures"][0])
    hf = cls.from_pretrained(src).float()
    hf.config._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"
    ids, labels = tokens(seed=5), tokens(seed=6)
    logits = hf(input_ids=ids).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}

    config = load_config(src).with_(moe_aux_loss_coeff=0.0)   # HF's loss has no balancing term here
    model = MoEDecoder(config)
    with torch.no_grad():
        for name, tensor in import_hf(src).state_dict().items():
            model.state_dict()[name].copy_(tensor)
    model(ids, labels).loss.backward()
    checked = 0
    for name, p in model.named_parameters():
        for hf_name, grad in hf_tensors(name, p.grad, config, expert_format="fused"):
            torch.testing.assert_close(grad, hf_grads[hf_name], atol=1e-6, rtol=1e-4, msg=lambda m: f"{hf_name}: {m}")
            checked += 1
    assert checked == len(hf_grads)


# --------------------------------------------------------------------------------------------
# negative controls: each feature off (same weights) -> logits differ from transformers'
# --------------------------------------------------------------------------------------------
def _logits_with(src, **changes) -> torch.Tensor:
    """Logits of the checkpoint at ``src`` in a moefold model whose config has ``changes``: every tensor of the
    imported model that the changed one has (same name and shape) is copied; the others keep their init."""
    imported = import_hf(src).state_dict()
    model = MoEDecoder(load_config(src).with_(**changes))
    model.init_weights(0)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in imported and imported[name].shape == tensor.shape:
                tensor.copy_(imported[name])
    return model.logits(tokens())


CONTROLS = [  # (family, changes that switch one feature off)
    ("gpt_oss", dict(attention_sinks=False)),
    ("gpt_oss", dict(sliding_window_pattern=None)),                         # every layer windowed
    ("gpt_oss", dict(sliding_window=None, sliding_window_pattern=None)),    # no layer windowed
    ("gpt_oss", dict(moe_activation_clamp=None)),
    ("gpt_oss", dict(moe_swiglu_alpha=1.0)),
    ("gpt_oss", dict(moe_glu_linear_offset=0.0)),
    ("gpt_oss", dict(moe_router_bias=False)),
    ("gpt_oss", dict(moe_expert_linear_bias=False)),
    ("glm4_moe", dict(partial_rotary_factor=1.0)),
    ("minimax_m2", dict(partial_rotary_factor=1.0)),
    ("minimax_m2", dict(moe_expert_bias=False)),
    ("kimi_k2", dict(moe_topk_scaling_factor=1.0)),
]


@pytest.mark.parametrize("family,changes", CONTROLS, ids=[f"{f}-{'-'.join(c)}" for f, c in CONTROLS])
def test_feature_off_changes_logits(family, changes, checkpoints):
    src, ref = checkpoints[family]
    diff = (_logits_with(src, **changes) - ref).abs().max().item()
    assert diff > 1e-3, (family, changes, diff)


@pytest.mark.parametrize("family", ["olmoe", "minimax_m2"])
def test_projection_qk_norm_is_not_per_head(family, tmp_path):
    """With every norm weight 1 (so per-head RMSNorm needs no weights of its own), normalising each head on its own
    instead of the whole projection changes the logits; the projection norm matches transformers."""
    model = save_hf(family, tmp_path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(1.0)
    model.save_pretrained(tmp_path)
    ref = hf_logits(model, tokens())
    torch.testing.assert_close(import_hf(tmp_path).logits(tokens()), ref, atol=TOL, rtol=0)
    assert (_logits_with(tmp_path, qk_norm_scope="head") - ref).abs().max() > 1e-3


def test_glm_o_proj_has_no_bias(checkpoints):
    """GLM-4.5's q/k/v carry biases and its o_proj does not: with one flag for all four the checkpoint does not load."""
    src, _ = checkpoints["glm4_moe"]
    config = load_config(src)
    assert config.attention_bias and config.attention_out_bias is False
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.0.self_attn.o_proj.bias'"):
        load_hf_weights(MoEDecoder(config.with_(attention_out_bias=None)), src)


def test_gpt_oss_interleaved_layout(checkpoints):
    """Reading GPT-OSS's gate_up_proj as if gate and up were concatenated halves (the other families' fused
    layout) changes the logits: the interleave is what the importer undoes."""
    src, ref = checkpoints["gpt_oss"]
    model = import_hf(src)
    with TensorReader(src) as reader, torch.no_grad():
        for i in range(model.config.num_layers):
            experts = model.layers[str(i)].mlp.experts
            gate_up = reader.read(f"model.layers.{i}.mlp.experts.gate_up_proj")         # [E, H, 2F]
            E, H, F2 = gate_up.shape
            experts.w13.copy_(gate_up.transpose(1, 2).reshape(E, 2, F2 // 2, H))       # halves, not interleaved
    assert (model.logits(tokens()) - ref).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FEATURE_FAMILIES)
def test_recipes_roundtrip_through_hf_config(family):
    for name in RECIPES[family]:
        recipe = get_recipe(name)
        hf = to_hf_config(recipe)
        assert from_hf_config(hf, name=name) == recipe, name
        # transformers' own config class takes the export and gives it back unchanged
        cls = getattr(transformers, hf["architectures"][0].replace("ForCausalLM", "Config"))
        own = cls(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")}).to_dict()
        assert from_hf_config({**own, "architectures": hf["architectures"]}, name=name) == recipe, name


@pytest.mark.parametrize("recipe", sorted(PUBLISHED_CONFIGS))
def test_published_configs_read_as_the_recipes(recipe, tmp_path):
    hf = PUBLISHED_CONFIGS[recipe]
    assert from_hf_config(hf, name=recipe) == get_recipe(recipe)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    method = hf.get("quantization_config", {}).get("quant_method")
    if method == "mxfp4":   # the config reads (inspect, counts); MXFP4 weights are refused, naming why
        with pytest.raises(ValueError, match=r"quantization_config \(quant_method='mxfp4'\).*dequantize"):
            pretrained_config(tmp_path)
    elif method == "fp8":   # FP8 blocks (Kimi-K2, MiniMax-M2) are read (models.hf.fp8_blocks); what stops this
        # fixture is its one-element safetensors, which cannot belong to the config (models.hf.bounds)
        with pytest.raises(ValueError, match=r"parameters, but the safetensors headers hold 1; refusing"):
            pretrained_config(tmp_path)


def test_kimi_k2_is_the_deepseek_v3_path():
    hf = PUBLISHED_CONFIGS["kimi_k2"]
    assert hf["model_type"] == "kimi_k2" and hf["architectures"] == ["DeepseekV3ForCausalLM"]
    config = from_hf_config(hf)
    assert config.family == "deepseek_v3" and config.attention == "mla" and config.num_experts == 384
    # transformers reads it as a DeepseekV3Config too
    ds = transformers.DeepseekV3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type",
                                                                                    "quantization_config")})
    assert (ds.n_routed_experts, ds.n_group, ds.topk_group, ds.routed_scaling_factor) == (384, 1, 1, 2.827)


def test_kimi_k2_convert_keeps_every_field(checkpoints, tmp_path):
    """``moefold convert`` HF -> moefold -> HF of a Kimi-K2 directory whose config.json is spelled as the published
    one (model_type kimi_k2, DeepSeek's own keys, no head_dim / rope_interleave / qk_head_dim) writes it back as it
    was: nothing rewritten, nothing added, and the tensors bit-exact."""
    import shutil

    from moefold.training.cli import main as cli

    src, _ = checkpoints["kimi_k2"]
    kimi = tmp_path / "kimi"
    shutil.copytree(src, kimi)
    hf = json.loads((kimi / "config.json").read_text())
    for key in ("head_dim", "rope_interleave", "qk_head_dim", "dtype"):
        hf.pop(key, None)
    hf.update(model_type="kimi_k2", torch_dtype="float32", scoring_func="sigmoid", topk_method="noaux_tc",
              moe_layer_freq=1, aux_loss_alpha=0.001, seq_aux=True)
    (kimi / "config.json").write_text(json.dumps(hf))
    assert cli(["convert", str(kimi), str(tmp_path / "mf")]) == 0
    assert cli(["convert", str(tmp_path / "mf"), str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == hf
    a, b = _tensors(kimi), _tensors(tmp_path / "back")
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_bad_configs(checkpoints, tmp_path):
    src, _ = checkpoints["gpt_oss"]
    hf = json.loads((src / "config.json").read_text())
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\]"):
        from_hf_config({**hf, "layer_types": ["chunked_attention", "full_attention"]})
    olmoe = json.loads((checkpoints["olmoe"][0] / "config.json").read_text())
    with pytest.raises(ValueError, match=r"clip_qkv=8.0 is not supported"):
        from_hf_config({**olmoe, "clip_qkv": 8.0})
    with pytest.raises(ValueError, match=r"attention_sinks apply to GQA attention"):
        get_recipe("deepseek_v3_tiny").with_(attention_sinks=True)
    with pytest.raises(ValueError, match=r"sliding_window_pattern=\(1, 0, 1\) must hold one 0"):
        get_recipe("gpt_oss_tiny").with_(sliding_window_pattern=(1, 0, 1))
    with pytest.raises(ValueError, match=r"HF MixtralForCausalLM config: \{'attention_sinks': True\}"):
        to_hf_config(get_recipe("mixtral_tiny").with_(attention_sinks=True))
    with pytest.raises(ValueError, match=r"GLM-4.5's o_proj has no bias"):
        to_hf_config(get_recipe("glm4_moe_tiny").with_(attention_out_bias=True))
    # None means Megatron's top topk // group_topk = 4 experts per group score (a Megatron import), not HF's 2
    with pytest.raises(ValueError, match=r"groups scored by their top 4 experts .*ranks groups by their top 2"):
        to_hf_config(get_recipe("glm4_moe_tiny").with_(moe_group_score_topk=None, moe_topk=4))


def test_cli_inspect_and_convert(checkpoints, tmp_path, capsys):
    """``moefold inspect`` of a recipe and of a published config.json (Kimi-K2's, quantized weights: the config
    reads); ``moefold convert`` HF -> moefold -> HF of GPT-OSS (its interleaved experts) bit-exact."""
    from moefold.training.cli import main as cli

    assert cli(["inspect", "--recipe", "gpt_oss_120b", "--no-layers"]) == 0
    assert "total 116.829B" in capsys.readouterr().out
    (tmp_path / "kimi").mkdir()
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(PUBLISHED_CONFIGS["kimi_k2"]))
    assert cli(["inspect", "--hf", str(tmp_path / "kimi"), "--no-layers"]) == 0
    out = capsys.readouterr().out
    assert "total 1026.408B" in out and "active per token 32.861B" in out, out
    src, _ = checkpoints["gpt_oss"]
    assert cli(["convert", str(src), str(tmp_path / "mf")]) == 0
    with TensorReader(tmp_path / "mf") as r:
        assert r.shape("layers.0.mlp.experts.w13") == (4, 2, 16, 32) and "layers.0.self_attn.sinks" in r
    assert cli(["convert", str(tmp_path / "mf"), str(tmp_path / "back")]) == 0
    a, b = _tensors(src), _tensors(tmp_path / "back")
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_glm_mtp_layer_roundtrip(tmp_path):
    """GLM-4.5's MTP layer (DeepSeek-V3's layout: model.layers.{L}.eh_proj / enorm / hnorm / shared_head + an MoE
    block) exports and imports back bit-exact; transformers, which has no MTP, loads the main model with the same
    logits."""
    config = get_recipe("glm4_moe_tiny").with_(vocab_size=96)
    model = MoEDecoder(config)
    model.init_weights(5)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.normal_()
    export_hf(model, tmp_path / "hf")
    L = config.num_layers
    names = set(_tensors(tmp_path / "hf"))
    assert {f"model.layers.{L}.{n}" for n in ("eh_proj.weight", "enorm.weight", "hnorm.weight",
                                               "shared_head.norm.weight", "mlp.gate.e_score_correction_bias",
                                               "self_attn.q_proj.bias")} <= names
    back = import_hf(tmp_path / "hf")
    assert back.config.mtp_num_layers == 1
    for (n, a), (m, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    ids, labels = tokens(seed=1), tokens(seed=2)
    torch.testing.assert_close(back(ids, labels).loss, model(ids, labels).loss, atol=0, rtol=0)
    hf = transformers.Glm4MoeForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(hf_logits(hf, ids), model.logits(ids), atol=TOL, rtol=0)

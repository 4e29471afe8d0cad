"""HF interop at world 1: import tiny random HF checkpoints (DeepSeek-V3, Qwen3-MoE, Mixtral, Qwen3-Next,
Qwen3.5-MoE; the
feature families in tests/models/test_families.py), logits parity,
export back (per-expert and fused expert naming), HF reloads it with the same logits, bit-exact round trip.
Qwen3-Next: each block's output from HF's own input, a sequence over two DeltaNet chunks, and a negative
control per feature it added (gated attention, partial RoPE, zero-centred norms, the shared-expert gate, the
DeltaNet convolution's layout and decay). Parallel layouts: tests/models/test_parallel.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from moefold.models.hf.exporter import export_hf
from moefold.models.hf.importer import import_hf, load_config
from moefold.models.tensor_io import TensorReader
from tests.models.hf_tiny import FAMILIES, FEATURE_FAMILIES, hf_logits, hf_model, save_hf, tokens

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # the issue asks for <= 1e-4; fp32 differences here are ~5e-7
# the feature families' world-1 parity and round trip: tests/models/test_families.py
FAMILIES_HERE = tuple(f for f in FAMILIES if f not in FEATURE_FAMILIES)


def _tensors(path) -> dict[str, torch.Tensor]:
    with TensorReader(path) as r:
        return {n: r.read(n) for n in r.names()}


@pytest.mark.parametrize("family", FAMILIES_HERE)
def test_import_parity_export_roundtrip(family, tmp_path):
    src, out = tmp_path / "hf", tmp_path / "out"
    # sharded source (index + several files) for one family, a single file for the others
    hf = save_hf(family, src, max_shard_size="40KB" if family == "deepseek_v3" else "5GB")
    assert (src / "model.safetensors.index.json").is_file() == (family == "deepseek_v3")
    ids = tokens()
    ref = hf_logits(hf, ids)
    model = import_hf(src)
    diff = (model.logits(ids) - ref).abs().max().item()
    print(f"{family}: world-1 max |logits diff| = {diff:.3g}")
    assert diff <= TOL

    export_hf(model, out, max_shard_bytes=64 * 1024)
    # bit-exact: the export holds exactly the tensors save_pretrained wrote, with identical values
    a, b = _tensors(src), _tensors(out)
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # HF loads the export and computes the same logits
    reloaded = type(hf).from_pretrained(out).eval()
    torch.testing.assert_close(hf_logits(reloaded, ids), ref, atol=TOL, rtol=0)
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(hf).__name__]


def test_fused_expert_naming(tmp_path):
    """Fused experts (gate_up_proj [E, 2F, H], down_proj [E, H, F]) export and import; HF loads them."""
    family = "qwen3_moe"
    hf = save_hf(family, tmp_path / "hf")
    ids = tokens(seed=3)
    ref = hf_logits(hf, ids)
    export_hf(import_hf(tmp_path / "hf"), tmp_path / "fused", expert_format="fused")
    with safe_open(str(tmp_path / "fused" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape() == [8, 32, 32]
    assert not any(".experts.0." in k for k in keys)
    torch.testing.assert_close(import_hf(tmp_path / "fused").logits(ids), ref, atol=TOL, rtol=0)
    reloaded = type(hf).from_pretrained(tmp_path / "fused").eval()
    torch.testing.assert_close(hf_logits(reloaded, ids), ref, atol=TOL, rtol=0)


def test_config_mapping():
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    from moefold.models.hf.config_map import from_hf_config, to_hf_config
    from moefold.models.recipes import deepseek_v3, mixtral_8x7b, qwen3_moe_30b_a3b, qwen3_next_80b_a3b

    for recipe in (deepseek_v3(), qwen3_moe_30b_a3b(), mixtral_8x7b(), qwen3_next_80b_a3b()):
        back = from_hf_config(to_hf_config(recipe), name=recipe.name)
        assert back == recipe, recipe.name
    with pytest.raises(ValueError, match=r"as an HF MixtralForCausalLM config: \{'qk_norm': True\}"):
        to_hf_config(mixtral_8x7b().with_(qk_norm=True))
    # transformers' own config objects map to the published recipes' architecture fields
    ds = from_hf_config(DeepseekV3Config().to_dict())
    assert (ds.num_experts, ds.moe_topk, ds.moe_num_groups, ds.moe_group_topk, ds.first_k_dense_replace) == \
        (256, 8, 8, 4, 3)
    qw = from_hf_config(Qwen3MoeConfig(num_experts=128, decoder_sparse_step=2, mlp_only_layers=[0]).to_dict())
    assert [qw.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


def test_bad_input(tmp_path):
    hf = hf_model("mixtral")
    hf.save_pretrained(tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    # unknown architecture
    (tmp_path / "arch").mkdir()
    (tmp_path / "arch" / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"],
                                                               "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"unknown architecture.*GPT2LMHeadModel"):
        load_config(tmp_path / "arch")
    # wrong shape: the config claims a bigger vocabulary than the tensors hold
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**cfg, "vocab_size": 128}))
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight.*shape \[96, 32\], expected \[128, 32\]"):
        import_hf(tmp_path / "ok")
    # missing tensor: one expert's weights removed
    (tmp_path / "ok" / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file

    tensors = _tensors(tmp_path / "ok")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    (tmp_path / "missing").mkdir()
    save_file(tensors, str(tmp_path / "missing" / "model.safetensors"))
    (tmp_path / "missing" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.block_sparse_moe.experts.2.w3.weight'"):
        import_hf(tmp_path / "missing")


def test_mtp_weights_roundtrip(tmp_path):
    """DeepSeek MTP modules map to model.layers.{L+k}.* (enorm/hnorm/eh_proj/shared_head + block) and back."""
    from moefold.models.decoder import MoEDecoder
    from moefold.models.recipes import deepseek_v3_tiny

    cfg = deepseek_v3_tiny().with_(num_layers=2, mtp_num_layers=2)
    model = MoEDecoder(cfg)
    model.init_weights(5)
    with torch.no_grad():
        model.layers["1"].mlp.router.expert_bias.normal_()
    export_hf(model, tmp_path / "hf")
    names = set(_tensors(tmp_path / "hf"))
    for j in (2, 3):
        assert {f"model.layers.{j}.{n}" for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                  "shared_head.norm.weight", "shared_head.head.weight",
                                                  "embed_tokens.weight", "mlp.gate.e_score_correction_bias",
                                                  "mlp.experts.7.down_proj.weight")} <= names
    back = import_hf(tmp_path / "hf")
    assert back.config.mtp_num_layers == 2
    for (n, a), (m, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    ids, labels = tokens(seed=1), tokens(seed=2)
    torch.testing.assert_close(back(ids, labels).loss, model(ids, labels).loss, atol=0, rtol=0)
    # transformers has no MTP: it loads the main model (ignoring layers 2, 3) with the same logits
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(hf_logits(hf, ids), model.logits(ids), atol=TOL, rtol=0)


# Qwen3-Next-80B-A3B's config.json as published (transformers 4.57 spelling: rope_theta and partial_rotary_factor at
# the top level, the layer pattern as full_attention_interval)
QWEN3_NEXT_PUBLISHED = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 512, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.57.0.dev0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


def test_qwen3_next_config():
    from transformers import Qwen3NextConfig

    from moefold.models.hf.config_map import from_hf_config, to_hf_config
    from moefold.models.recipes import qwen3_next_80b_a3b

    recipe = qwen3_next_80b_a3b()
    published = from_hf_config(QWEN3_NEXT_PUBLISHED, name=recipe.name)
    assert published == recipe
    # exported in the spelling it was read in: nothing added, nothing lost
    assert to_hf_config(published, dtype="bfloat16") == QWEN3_NEXT_PUBLISHED
    # transformers' own defaults are the 80B model's architecture (not its rope theta, context or dense size)
    ours = from_hf_config(Qwen3NextConfig().to_dict(), name=recipe.name)
    assert ours == recipe.with_(rope_theta=10000.0, max_position_embeddings=32768, ffn_hidden_size=5632)
    assert ours.layer_types.count("linear_attention") == 36 and ours.layer_types[3::4] == ("full_attention",) * 12
    with pytest.raises(ValueError, match=r"Qwen3NextForCausalLM config: \{'attention_output_gate': False\}"):
        to_hf_config(recipe.with_(attention_output_gate=False))
    with pytest.raises(ValueError, match=r"'norm_zero_centered_gamma': True"):
        to_hf_config(qwen3_next_80b_a3b().with_(family="qwen3_moe"))


def test_qwen3_5_moe_published_config_and_count():
    """Qwen3.5-35B-A3B's text config (transformers' ``Qwen3_5MoeTextConfig`` defaults, with the hub's rope theta,
    context and multimodal RoPE sections) reads as the recipe, and moefold counts exactly the parameters of HF's
    model of it; what HF Qwen3.5-MoE cannot express is refused in one line."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from moefold.models.hf.config_map import from_hf_config, to_hf_config
    from moefold.models.params import count_parameters
    from moefold.models.recipes import qwen3_5_35b_a3b

    recipe = qwen3_5_35b_a3b()
    hub = Qwen3_5MoeTextConfig(max_position_embeddings=262144, rope_parameters={
        "rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True}, architectures=["Qwen3_5MoeForCausalLM"])
    published = from_hf_config(hub.to_dict(), name=recipe.name)
    assert published == recipe
    assert published.layer_types.count("linear_attention") == 30 and all(map(recipe.is_moe_layer, range(40)))
    with torch.device("meta"):
        hf = Qwen3_5MoeForCausalLM(hub)
    assert count_parameters(recipe).total == sum(p.numel() for p in hf.parameters()) == 34_660_610_688
    written = to_hf_config(published)
    assert written["rope_parameters"] == hub.to_dict()["rope_parameters"]   # kept as read
    assert "intermediate_size" not in written and "norm_topk_prob" not in written
    assert written["model_type"] == "qwen3_5_moe_text"
    for bad, what in ((dict(moe_layer_freq=(1, 0) * 20, ffn_hidden_size=64), "every layer must be MoE"),
                      (dict(moe_shared_expert_ffn_size=0), "a shared expert is required"),
                      (dict(moe_shared_expert_gate=False), "'moe_shared_expert_gate': True"),
                      (dict(moe_norm_topk_prob=False), "'moe_norm_topk_prob': False")):
        with pytest.raises(ValueError, match=what):
            to_hf_config(recipe.with_(**bad))


def test_qwen3_5_moe_split_projections_negative_control(tmp_path, monkeypatch):
    """Qwen3.5-MoE's four DeltaNet projections regrouped per key head give HF's logits; concatenated as stored
    (HF's all-heads-of-q-then-k-then-v order read as moefold's per-key-head one) they do not."""
    from moefold.models.hf import qwen3_5_moe

    hf = save_hf("qwen3_5_moe", tmp_path)
    ids = tokens()
    ref = hf_logits(hf, ids)
    assert (import_hf(tmp_path).logits(ids) - ref).abs().max().item() <= TOL
    monkeypatch.setattr(qwen3_5_moe.SplitLayout, "from_hf", lambda _self, parts, shape: torch.cat(parts).view(shape))
    assert (import_hf(tmp_path).logits(ids) - ref).abs().max().item() > 1e-2


def test_qwen3_next_blocks_and_two_chunks(tmp_path):
    """Every block fed HF's own input gives HF's output to fp32 rounding (a random hybrid stack amplifies rounding
    from layer to layer, so this is the sharp check); logits over 80 tokens (two DeltaNet chunks, the second padded)."""
    hf = save_hf("qwen3_next", tmp_path)
    model = import_hf(tmp_path)
    ids = tokens(seq=80)
    outputs = {}
    hooks = [layer.register_forward_hook(lambda _m, _i, out, i=i: outputs.__setitem__(i, out))
             for i, layer in enumerate(hf.model.layers)]
    ref = hf_logits(hf, ids)
    for h in hooks:
        h.remove()
    pos = torch.arange(ids.shape[1])
    with torch.no_grad():
        hidden = hf.model.embed_tokens(ids)
        for i in range(len(hf.model.layers)):
            ours, _ = model.layers[str(i)](hidden.transpose(0, 1).contiguous(), pos)
            diff = (ours.transpose(0, 1) - outputs[i]).abs().max().item()
            assert diff <= 2e-6, (i, model.config.layer_type(i), diff)
            hidden = outputs[i]
    diff = (model.logits(ids) - ref).abs().max().item()
    print(f"qwen3_next: 80 tokens, max |logits diff| = {diff:.3g}")
    assert diff <= TOL


def _with(model, ids, ref, **changes):
    """max |logits - ref| of ``model``'s weights in a model with ``changes`` to its config."""
    from moefold.models.decoder import MoEDecoder

    other = MoEDecoder(model.config.with_(**changes))
    state, heads, d = model.state_dict(), model.config.num_attention_heads, model.config.attention_head_dim
    new = {}
    for name, t in other.state_dict().items():
        src = state[name]
        if name.endswith("q_proj.weight") and src.shape != t.shape:   # without the gate: q rows of each head
            src = src.view(heads, 2, d, -1)[:, 0].reshape(t.shape)
        new[name] = src
    other.load_state_dict(new)
    return (other.logits(ids) - ref).abs().max().item()


def test_qwen3_next_negative_controls(tmp_path):
    hf = save_hf("qwen3_next", tmp_path)
    model = import_hf(tmp_path)
    ids = tokens()
    ref = hf_logits(hf, ids)
    assert (model.logits(ids) - ref).abs().max().item() <= TOL
    off = {"no output gate": _with(model, ids, ref, attention_output_gate=False),
           "full rotary": _with(model, ids, ref, partial_rotary_factor=1.0),
           "plain norm gamma": _with(model, ids, ref, norm_zero_centered_gamma=False),
           "no shared-expert gate": _with(model, ids, ref, moe_shared_expert_gate=False)}
    convs = {n: p for n, p in model.named_parameters() if n.endswith("conv1d.weight")}
    decays = {n: p for n, p in model.named_parameters() if n.endswith("A_log")}
    with torch.no_grad():
        saved = {n: p.clone() for n, p in {**convs, **decays}.items()}
        hf_conv = hf.model.layers[0].linear_attn.conv1d.weight   # HF's channel order, unpermuted
        convs["layers.0.self_attn.conv1d.weight"].copy_(hf_conv.reshape(saved["layers.0.self_attn.conv1d.weight"].shape))
        off["conv in HF's channel order"] = (model.logits(ids) - ref).abs().max().item()
        for n, p in convs.items():   # identity taps: no short convolution
            p.copy_(saved[n])
            p.zero_()[..., -1] = 1.0
        off["no short convolution"] = (model.logits(ids) - ref).abs().max().item()
        for n, p in convs.items():
            p.copy_(saved[n])
        for p in decays.values():    # A = 0: no decay
            p.fill_(-30.0)
        off["no decay"] = (model.logits(ids) - ref).abs().max().item()
        for n, p in decays.items():
            p.copy_(saved[n])
    assert (model.logits(ids) - ref).abs().max().item() <= TOL   # restored
    print({k: f"{v:.3g}" for k, v in off.items()})
    for feature, diff in off.items():
        assert diff > 1e-2, (feature, diff)


def test_qwen3_5_moe_published_multimodal_directory(tmp_path, capsys):
    """A ``Qwen3_5MoeForConditionalGeneration`` directory (the form Qwen3.5-MoE is published in: ``text_config``,
    ``model.language_model.*``, a vision tower) reads as its text model: logits equal the multimodal class's on
    text, ``moefold inspect`` says what it leaves out, the export is the text model HF reloads with the same
    logits; a nested ``tie_word_embeddings`` that contradicts the top level is refused in one line."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    from moefold.training.cli import main as cli
    from tests.models.hf_tiny import qwen3_5_moe_config

    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2,
                  temporal_patch_size=2, spatial_merge_size=2)
    hf = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=qwen3_5_moe_config().to_dict(),
                                                              vision_config=vision)).eval()
    src, out = tmp_path / "mm", tmp_path / "text"
    hf.save_pretrained(src)
    assert any(n.startswith("model.visual.") for n in _tensors(src))
    ids = tokens()
    ref = hf_logits(hf, ids)
    model = import_hf(src)
    diff = (model.logits(ids) - ref).abs().max().item()
    print(f"qwen3_5_moe (ConditionalGeneration directory): world-1 max |logits diff| = {diff:.3g}")
    assert diff <= TOL
    # the vision tower's tensors hold no text weight: reading the directory as an unwrapped one would miss them all
    visual = [n for n in _tensors(src) if n.startswith("model.visual.")]
    assert cli(["inspect", "--hf", str(src)]) == 0
    assert f"its {len(visual)} vision-tower tensors are not read" in capsys.readouterr().out

    export_hf(model, out)
    text = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(text).__name__ == "Qwen3_5MoeForCausalLM"
    torch.testing.assert_close(hf_logits(text, ids), ref, atol=TOL, rtol=0)
    written = {n: t for n, t in _tensors(out).items()}
    for name, t in _tensors(src).items():
        if name.startswith("model.language_model."):
            assert torch.equal(written["model." + name[len("model.language_model."):]], t), name

    config = json.loads((src / "config.json").read_text())
    config["text_config"]["tie_word_embeddings"] = True
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"text_config.tie_word_embeddings=True disagrees with the top level's False"):
        import_hf(src)

"""HF interop at world 1: import tiny random HF checkpoints (all three families), logits parity,
export back (per-expert and fused expert naming), HF reloads it with the same logits, bit-exact round trip.
Parallel layouts: tests/models/test_parallel.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from moefold.models.hf.exporter import export_hf
from moefold.models.hf.importer import import_hf, load_config
from moefold.models.tensor_io import TensorReader
from tests.models.hf_tiny import FAMILIES, hf_logits, hf_model, save_hf, tokens

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # the issue asks for <= 1e-4; fp32 differences here are ~5e-7


def _tensors(path) -> dict[str, torch.Tensor]:
    with TensorReader(path) as r:
        return {n: r.read(n) for n in r.names()}


@pytest.mark.parametrize("family", FAMILIES)
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
    from moefold.models.recipes import deepseek_v3, mixtral_8x7b, qwen3_moe_30b_a3b

    for recipe in (deepseek_v3(), qwen3_moe_30b_a3b(), mixtral_8x7b()):
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

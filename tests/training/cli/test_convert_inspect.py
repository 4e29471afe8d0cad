"""``moefold convert`` (HF <-> moefold checkpoint) and ``moefold inspect``."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from moefold.models.checkpoint import config_from_dict, config_to_dict, load_checkpoint
from moefold.models.recipes import RECIPES, get_recipe
from moefold.models.tensor_io import TensorReader
from moefold.training.cli import main as cli
from moefold.training.cli.convert import parse_size
from tests.models.hf_tiny import hf_logits, save_hf, tokens

pytest.importorskip("transformers")


def _back_to_hf_bit_exact(tmp_path, hf) -> None:
    """The moefold checkpoint in ``tmp_path / "mf"`` computes ``hf``'s logits and converts back to the very
    tensors of ``tmp_path / "hf"``."""
    ids = tokens()
    torch.testing.assert_close(load_checkpoint(tmp_path / "mf").logits(ids), hf_logits(hf, ids), atol=1e-5, rtol=0)
    assert cli(["convert", str(tmp_path / "mf"), str(tmp_path / "back")]) == 0
    with TensorReader(tmp_path / "hf") as a, TensorReader(tmp_path / "back") as b:
        assert sorted(a.names()) == sorted(b.names())
        assert all(torch.equal(a.read(n), b.read(n)) for n in a.names())


def test_convert_hf_moefold_hf_roundtrip(tmp_path, capsys):
    hf = save_hf("deepseek_v3", tmp_path / "hf")
    assert cli(["convert", str(tmp_path / "hf"), str(tmp_path / "mf"), "--max-shard-size", "64KB"]) == 0
    assert (tmp_path / "mf" / "moefold_config.json").is_file()
    assert (tmp_path / "mf" / "model.safetensors.index.json").is_file()  # sharded
    with TensorReader(tmp_path / "mf") as r:  # moefold naming, full tensors
        assert r.shape("layers.1.mlp.experts.w13") == (8, 2, 16, 32)
        assert "layers.1.mlp.router.expert_bias" in r
    _back_to_hf_bit_exact(tmp_path, hf)
    assert "wrote hf checkpoint" in capsys.readouterr().out


def test_convert_recipe_and_bad_source(tmp_path, capsys):
    assert cli(["convert", "--recipe", "qwen3_moe_tiny", "--seed", "1", str(tmp_path / "q")]) == 0
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts"] == 8
    (tmp_path / "empty").mkdir()
    capsys.readouterr()
    # errors are one line; --debug shows the traceback
    for source, message in [(tmp_path / "empty", "not a checkpoint moefold reads"),
                            (tmp_path / "missing", "not a checkpoint moefold reads")]:
        assert cli(["convert", str(source), str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("moefold convert: error:") and message in err and err.count("\n") == 1, err
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1000}))
    (tmp_path / "q" / "model.safetensors").rename(tmp_path / "broken" / "model.safetensors")
    assert cli(["convert", str(tmp_path / "broken"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    # the config is checked against the safetensors headers before the model is built (models.hf.bounds)
    assert "config.json: vocab_size=1000 but model.embed_tokens.weight has shape (512, 64)" in err, err
    assert err.count("\n") == 1, err
    with pytest.raises(ValueError, match=r"vocab_size=1000 but model\.embed_tokens\.weight has shape \(512, 64\)"):
        cli(["convert", str(tmp_path / "broken"), str(tmp_path / "x"), "--debug"])


def test_max_shard_size_parsing():
    assert (parse_size("64KB"), parse_size("1.5mb"), parse_size("5GB"), parse_size("1000")) == \
        (65536, 3 * 2**19, 5 * 2**30, 1000)
    for bad in ("lots", "0MB", "-1"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"--max-shard-size '{bad}' is not a positive size"):
            parse_size(bad)


def test_inspect(capsys, tmp_path):
    assert cli(["inspect", "--recipe", "mixtral_8x7b"]) == 0
    out = capsys.readouterr().out
    assert "total 46.703B" in out and "active per token 12.880B" in out and "x32" in out
    # an HF DeepSeek-V3 directory: the config announces an MTP layer, save_pretrained wrote no MTP tensors
    from transformers import DeepseekV3ForCausalLM

    model = save_hf("deepseek_v3", tmp_path / "ds")
    model.config.num_nextn_predict_layers = 1
    model.config.save_pretrained(tmp_path / "ds")
    capsys.readouterr()
    assert cli(["inspect", "--hf", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr().out
    assert "MTP modules:" not in out and "announces 1 MTP layer(s)" in out and "no MTP modules" in out
    assert "tensors in 1 safetensors file(s)" in out and "dtype F32" in out and "generation_config.json" in out
    assert DeepseekV3ForCausalLM.config_class.from_pretrained(tmp_path / "ds").num_nextn_predict_layers == 1
    # config.json only: what it announces
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text((tmp_path / "ds" / "config.json").read_text())
    assert cli(["inspect", "--hf", str(tmp_path / "cfg")]) == 0
    out = capsys.readouterr().out
    assert "MTP modules:" in out and "config.json only, no weights" in out
    assert cli(["inspect", "--hf", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moefold inspect: error:") and "no config.json" in err and err.count("\n") == 1


def test_config_json_roundtrip():
    for name in RECIPES:
        config = get_recipe(name)
        assert config_from_dict(json.loads(json.dumps(config_to_dict(config)))) == config
    with pytest.raises(ValueError, match=r"unknown ModelConfig fields \['bogus'\]"):
        config_from_dict({**config_to_dict(get_recipe("mixtral_tiny")), "bogus": 1})


def test_qwen3_next_convert_and_inspect(tmp_path, capsys):
    """Qwen3-Next HF -> moefold (DeltaNet's convolution regrouped per key head) -> HF bit-exact; a fresh recipe
    exported from scratch loads in transformers with moefold's logits; inspect shows each layer's mixer."""
    from transformers import Qwen3NextForCausalLM

    hf = save_hf("qwen3_next", tmp_path / "hf")
    assert cli(["convert", str(tmp_path / "hf"), str(tmp_path / "mf")]) == 0
    with TensorReader(tmp_path / "mf") as r:   # per key head: its q (16), k (16) and 2 value heads (2 x 8)
        assert r.shape("layers.0.self_attn.conv1d.weight") == (2, 48, 4)
        assert r.shape("layers.1.self_attn.q_proj.weight") == (64, 32)   # 4 heads x (q 8 + gate 8)
    _back_to_hf_bit_exact(tmp_path, hf)
    assert cli(["convert", "--recipe", "qwen3_next_tiny", "--seed", "2", str(tmp_path / "recipe"), "--to", "hf"]) == 0
    exported = Qwen3NextForCausalLM.from_pretrained(tmp_path / "recipe").eval()
    from moefold.models.hf.importer import import_hf

    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(hf_logits(exported, ids), import_hf(tmp_path / "recipe").logits(ids), atol=1e-5,
                               rtol=0)
    capsys.readouterr()
    assert cli(["inspect", "--hf", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "mixer" in out and "linear_attention" in out and "full_attention" in out


def test_qwen3_5_moe_convert_and_inspect(tmp_path, capsys):
    """Qwen3.5-MoE HF (DeltaNet's in_proj_qkv / _z / _b / _a) -> moefold (fused per key head) -> HF bit-exact; a
    fresh recipe exported from scratch loads in transformers with moefold's logits."""
    from transformers import Qwen3_5MoeForCausalLM

    from moefold.models.hf.importer import import_hf

    hf = save_hf("qwen3_5_moe", tmp_path / "hf")
    assert cli(["convert", str(tmp_path / "hf"), str(tmp_path / "mf")]) == 0
    with TensorReader(tmp_path / "mf") as r:   # 2 key heads x (q 16 + k 16 + 2 x (v 8 + z 8)); x (2 b + 2 a)
        assert r.shape("layers.0.self_attn.in_proj_qkvz.weight") == (128, 32)
        assert r.shape("layers.0.self_attn.in_proj_ba.weight") == (8, 32)
    _back_to_hf_bit_exact(tmp_path, hf)
    assert cli(["convert", "--recipe", "qwen3_5_moe_tiny", "--seed", "2", str(tmp_path / "recipe"), "--to", "hf"]) == 0
    with TensorReader(tmp_path / "recipe") as r:
        assert r.shape("model.layers.0.linear_attn.in_proj_qkv.weight") == (2 * 32 + 64, 64)
        assert "model.layers.0.linear_attn.in_proj_qkvz.weight" not in r
    exported = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "recipe").eval()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(hf_logits(exported, ids), import_hf(tmp_path / "recipe").logits(ids), atol=1e-5,
                               rtol=0)
    capsys.readouterr()
    assert cli(["inspect", "--recipe", "qwen3_5_35b_a3b"]) == 0
    assert "34.66" in capsys.readouterr().out

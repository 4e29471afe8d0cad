"""Upcycling: a dense Qwen3 / Mistral HF checkpoint (made here) or a moefold dense training run becomes an MoE
whose logits equal the dense model's, with every expert a copy of the MLP or (granular) a slice of it.
``--moe-use-upcycling`` at tp2 x ep2 x etp2 is in tests/training/test_train_from_hf.py."""

from __future__ import annotations

import json

import pytest
import torch

from moefold.models.hf.exporter import export_hf
from moefold.models.hf.importer import import_hf
from moefold.models.hf.mapping import expert_names
from moefold.models.upcycle import upcycled_config
from moefold.training.checkpoint.load_model import load_model
from moefold.training.cli import main as cli
from moefold.training.data.indexed import IndexedDatasetWriter
from tests.models.hf_tiny import hf_dense_model, hf_logits, tokens
from tests.training.trainer_common import tiny_data

transformers = pytest.importorskip("transformers")

TOL = 1e-5


@pytest.mark.parametrize("kind,experts,topk,moe_ffn,granularity", [
    ("qwen3", 4, 2, None, 1),     # every expert a copy of the 48-wide MLP
    ("mistral", 6, 4, 24, 2),     # granular: 6 experts of half the MLP, a token takes 2 whole copies
    ("qwen3", 12, 6, 16, 3),
])
def test_upcycled_logits_equal_the_dense_model(kind, experts, topk, moe_ffn, granularity, tmp_path):
    dense = hf_dense_model(kind)
    dense.save_pretrained(tmp_path / "dense")
    flags = ["--num-experts", str(experts), "--moe-router-topk", str(topk)]
    flags += ["--moe-ffn-hidden-size", str(moe_ffn)] if moe_ffn else []
    assert cli(["upcycle", str(tmp_path / "dense"), str(tmp_path / "moe"), *flags]) == 0
    ids = tokens(batch=2, seq=16, seed=7)   # longer than Mistral's sliding window of 8
    ref = hf_logits(dense, ids)
    moe = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    assert type(moe).__name__ == {"qwen3": "Qwen3MoeForCausalLM", "mistral": "MixtralForCausalLM"}[kind]
    diff = (hf_logits(moe, ids) - ref).abs().max().item()
    print(f"{kind} E={experts} top-{topk} granularity {granularity}: max |logits - dense| = {diff:.3g}")
    assert diff <= TOL
    model = import_hf(tmp_path / "moe")
    assert model.config.num_experts == experts and model.config.moe_ffn_hidden_size == 48 // granularity
    torch.testing.assert_close(model.logits(ids), ref, atol=TOL, rtol=0)
    # the dense config's other fields and the generation config come along
    dense_cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
    moe_cfg = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert all(moe_cfg[k] == dense_cfg[k] for k in ("bos_token_id", "eos_token_id", "initializer_range", "use_cache"))
    assert (tmp_path / "moe" / "generation_config.json").is_file()
    # the experts really are the slices: not a test that equal logits could pass by accident
    w13 = dict(model.named_parameters())["layers.1.mlp.experts.w13"]
    gate = dense.model.layers[1].mlp.gate_proj.weight
    for e in range(experts):
        s = e % granularity
        torch.testing.assert_close(w13[e, 0], gate[s * 48 // granularity:(s + 1) * 48 // granularity], atol=0,
                                   rtol=0)
    assert expert_names("layers.1.mlp.experts.w13", model.config) is not None


@pytest.mark.parametrize("kind", ["qwen3", "mistral"])
def test_dense_models_import_and_export(kind, tmp_path):
    """The dense relatives are read as their family without experts, and written back as themselves."""
    dense = hf_dense_model(kind)
    dense.save_pretrained(tmp_path / "dense")
    ids = tokens(batch=2, seq=16, seed=8)
    model = import_hf(tmp_path / "dense")
    assert model.config.num_experts == 0 and model.config.family == {"qwen3": "qwen3_moe", "mistral": "mixtral"}[kind]
    torch.testing.assert_close(model.logits(ids), hf_logits(dense, ids), atol=TOL, rtol=0)
    export_hf(model, tmp_path / "out")
    original = json.loads((tmp_path / "dense" / "config.json").read_text())
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == original
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(dense)
    torch.testing.assert_close(hf_logits(back, ids), hf_logits(dense, ids), atol=TOL, rtol=0)


def test_upcycle_a_moefold_dense_training_run(tmp_path):
    prefix = tmp_path / "data"
    with IndexedDatasetWriter(prefix, 256) as writer:
        for row in tiny_data(16):
            writer.add_document(row)
    train = ["train", "--recipe", "mixtral_tiny", "--num-experts", "0", "--ffn-hidden-size", "64", "--vocab-size",
             "256", "--data-path", str(prefix), "--train-iters", "1", "--seq-length", "32", "--micro-batch-size", "1",
             "--global-batch-size", "2", "--run-dir", str(tmp_path / "run"), "--save", str(tmp_path / "ckpt"),
             "--device", "cpu", "--no-balance-report"]
    assert cli(train) == 0
    assert cli(["upcycle", str(tmp_path / "ckpt"), str(tmp_path / "moe"), "--num-experts", "8", "--moe-router-topk",
                "4", "--moe-ffn-hidden-size", "32", "--to", "moefold"]) == 0
    dense, _ = load_model(tmp_path / "ckpt")
    moe, _ = load_model(tmp_path / "moe")
    assert dense.config.num_experts == 0 and moe.config.num_experts == 8
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(moe.logits(ids), dense.logits(ids), atol=TOL, rtol=0)


def test_upcycling_errors_are_one_line(tmp_path, capsys):
    dense = hf_dense_model("qwen3")
    dense.save_pretrained(tmp_path / "dense")
    cases = [(["--num-experts", "4", "--moe-router-topk", "1", "--moe-ffn-hidden-size", "24"],
              "--moe-router-topk=1 must be a multiple of the granularity 2"),
             (["--num-experts", "4", "--moe-ffn-hidden-size", "20"], "--moe-ffn-hidden-size=20 must divide the dense "
                                                                     "ffn_hidden_size=48"),
             (["--num-experts", "3", "--moe-ffn-hidden-size", "24"], "--num-experts=3 must be a positive multiple")]
    capsys.readouterr()   # transformers' save progress bar
    for flags, message in cases:
        assert cli(["upcycle", str(tmp_path / "dense"), str(tmp_path / "x"), *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    from tests.models.hf_tiny import save_hf

    save_hf("mixtral", tmp_path / "moe")
    capsys.readouterr()
    assert cli(["upcycle", str(tmp_path / "moe"), str(tmp_path / "x"), "--num-experts", "4"]) == 2
    assert "already has num_experts=4" in capsys.readouterr().err
    with pytest.raises(ValueError, match="multiple of the granularity"):
        upcycled_config(import_hf(tmp_path / "dense").config, 4, 1, 24)

"""``moefold train``'s model flags (Megatron names) build the model transformers builds from a config of the same
values: the moefold model (recipe + flags) is exported, its tensors load into the HF model made from an
independently written transformers config, and the two give the same logits.

Flags covered: --hidden-size --ffn-hidden-size --moe-ffn-hidden-size --num-attention-heads --num-query-groups
--kv-channels --num-experts --moe-router-topk --moe-shared-expert-intermediate-size --moe-layer-freq (pattern
and int) --mtp-num-layers --q-lora-rank (int and none) --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim
--v-head-dim --rotary-base --max-position-embeddings --norm-epsilon --untie-embeddings-and-output-weights
(tied) --qk-layernorm --window-size --num-layers --vocab-size --window-attn-skip-freq --softmax-type
--activation-func-clamp-value --glu-linear-offset --rotary-percent.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from moefold.models.decoder import MoEDecoder
from moefold.models.hf.exporter import export_hf
from moefold.models.tensor_io import TensorReader
from moefold.training.cli import build_parser
from moefold.training.cli import main as cli
from moefold.training.cli.model_flags import parse_layer_pattern, parse_window
from moefold.training.cli.train import config_from_args

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

CASES = {  # name: (moefold flags, transformers class, its config)
    "qwen3": (["--recipe", "qwen3_moe_tiny", "--hidden-size", "48", "--num-attention-heads", "6",
               "--num-query-groups", "3", "--kv-channels", "8", "--ffn-hidden-size", "40",
               "--moe-ffn-hidden-size", "24", "--num-experts", "6", "--moe-router-topk", "3", "--num-layers", "3",
               "--moe-layer-freq", "([0]*1+[1]*2)", "--rotary-base", "5000", "--vocab-size", "128",
               "--no-untie-embeddings-and-output-weights", "--norm-epsilon", "1e-5", "--max-position-embeddings",
               "64", "--qk-layernorm"],
              "Qwen3MoeForCausalLM",
              dict(vocab_size=128, hidden_size=48, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=3,
                   num_attention_heads=6, num_key_value_heads=3, head_dim=8, num_experts=6, num_experts_per_tok=3,
                   norm_topk_prob=True, mlp_only_layers=[0], rms_norm_eps=1e-5, tie_word_embeddings=True,
                   max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
    "deepseek_v3": (["--recipe", "deepseek_v3_tiny", "--hidden-size", "40", "--num-attention-heads", "2",
                     "--q-lora-rank", "24", "--kv-lora-rank", "12", "--qk-head-dim", "6", "--qk-pos-emb-head-dim", "4",
                     "--v-head-dim", "10", "--moe-shared-expert-intermediate-size", "64", "--num-layers", "4",
                     "--moe-layer-freq", "([0]*2+[1]*2)", "--mtp-num-layers", "2", "--vocab-size", "100",
                     "--max-position-embeddings", "128"],
                    "DeepseekV3ForCausalLM",
                    dict(vocab_size=100, hidden_size=40, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=2,
                         n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=2,
                         routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=12, qk_nope_head_dim=6,
                         qk_rope_head_dim=4, v_head_dim=10, max_position_embeddings=128, num_nextn_predict_layers=2,
                         rope_parameters=YARN)),
    "deepseek_v3 no q lora": (["--recipe", "deepseek_v3_tiny", "--q-lora-rank", "none", "--moe-layer-freq", "1",
                               "--ffn-hidden-size", "8", "--vocab-size", "100"],
                              "DeepseekV3ForCausalLM",
                              dict(vocab_size=100, hidden_size=64, intermediate_size=8, moe_intermediate_size=32,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                                   n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                   topk_group=2, first_k_dense_replace=0, routed_scaling_factor=2.5, q_lora_rank=None,
                                   kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                   max_position_embeddings=1024, rope_parameters=YARN)),
    "mixtral": (["--recipe", "mixtral_tiny", "--window-size", "4,0", "--kv-channels", "12", "--num-query-groups", "1",
                 "--moe-ffn-hidden-size", "40", "--num-experts", "3", "--moe-router-topk", "2", "--rotary-base", "2e4",
                 "--untie-embeddings-and-output-weights", "--vocab-size", "64"],
                "MixtralForCausalLM",
                dict(vocab_size=64, hidden_size=64, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=1, head_dim=12, num_local_experts=3, num_experts_per_tok=2, sliding_window=5,
                     rms_norm_eps=1e-5, max_position_embeddings=1024, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 2e4})),
    "gpt_oss": (["--recipe", "gpt_oss_tiny", "--num-layers", "3", "--window-size", "6", "--window-attn-skip-freq", "3",
                 "--activation-func-clamp-value", "0.4", "--glu-linear-offset", "1", "--softmax-type", "learnable",
                 "--vocab-size", "64"],
                "GptOssForCausalLM",
                dict(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=6,
                     layer_types=["sliding_attention", "sliding_attention", "full_attention"], swiglu_limit=0.4,
                     max_position_embeddings=1024,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})),
    "glm4_moe": (["--recipe", "glm4_moe_tiny", "--rotary-percent", "0.25", "--vocab-size", "64",
                  "--mtp-num-layers", "0"],
                 "Glm4MoeForCausalLM",
                 dict(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                      n_group=2, topk_group=1, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
                      max_position_embeddings=1024,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})),
}


def _model_config(*flags: str):
    return config_from_args(build_parser("train").parse_args(["train", *flags])).model


@pytest.mark.parametrize("name", CASES)
def test_flags_build_the_model_transformers_builds(name, tmp_path):
    flags, cls_name, hf_values = CASES[name]
    config = _model_config(*flags)
    model = MoEDecoder(config)
    model.init_weights(1)
    with torch.no_grad():   # non-trivial norms and expert biases, so a misplaced one shows in the logits
        for n, t in model.state_dict().items():
            if t.dim() == 1:
                t.copy_(1 + 0.3 * torch.randn_like(t)) if n.endswith("weight") else t.normal_(0, 0.3)
    export_hf(model, tmp_path, expert_format="fused")   # transformers' in-memory tensor names
    cls = getattr(transformers, cls_name)
    hf = cls(cls.config_class(**hf_values)).eval()
    hf.config._attn_implementation = "eager" if cls_name == "GptOssForCausalLM" else "sdpa"
    with TensorReader(tmp_path) as reader:
        state = {n: reader.read(n) for n in reader.names()}
    extra = {n for n in state if n.startswith(tuple(f"model.layers.{config.num_layers + k}." for k in range(4)))}
    assert bool(extra) == (config.mtp_num_layers > 0)   # MTP tensors are written; transformers has no MTP
    missing, unexpected = hf.load_state_dict({n: t for n, t in state.items() if n not in extra}, strict=False)
    assert unexpected == [] and set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    torch.testing.assert_close(model.logits(ids), ref, atol=1e-5, rtol=0)


def test_layer_freq_and_window_syntax():
    assert parse_layer_pattern("([0]*3+[1]*5)") == (0, 0, 0, 1, 1, 1, 1, 1)
    assert parse_layer_pattern("([1]*3+[0]*1)*2") == (1, 1, 1, 0) * 2
    assert parse_layer_pattern("2") == 2 and parse_layer_pattern("[1,0]") == (1, 0)
    for bad in ("([2]*3)", "__import__('os')", "[0]*x", "[]"):
        with pytest.raises(argparse.ArgumentTypeError, match="pattern"):
            parse_layer_pattern(bad)
    assert (parse_window("4096"), parse_window("4095,0"), parse_window("(4095,0)")) == (4096, 4096, 4096)
    with pytest.raises(argparse.ArgumentTypeError, match="left, 0"):
        parse_window("10,10")
    # an int frequency: layer i is MoE when i % N == 0 (Megatron)
    c = _model_config("--recipe", "qwen3_moe_tiny", "--num-layers", "4", "--moe-layer-freq", "2",
                      "--ffn-hidden-size", "64")
    assert [c.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    c = _model_config("--recipe", "deepseek_v3_tiny", "--moe-layer-freq", "([1]*3)")
    assert c.first_k_dense_replace == 0 and all(c.is_moe_layer(i) for i in range(3))


def test_flag_errors_name_the_flag(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("moefold.training.cli.train.run_ranks", lambda *_a, **_k: pytest.fail("a rank was started"))
    base = ["train", "--run-dir", str(tmp_path), "--no-save", "--train-iters", "1"]
    for flags, message in [(["--recipe", "qwen3_moe_tiny", "--q-lora-rank", "8"],
                            "--q-lora-rank does not apply to qwen3_moe_tiny (qwen3_moe, GQA attention)"),
                           (["--recipe", "deepseek_v3_tiny", "--kv-channels", "8"], "--kv-channels does not apply"),
                           (["--recipe", "qwen3_moe_tiny", "--num-query-groups", "3"],
                            "num_query_groups=3 does not divide num_attention_heads=4 (model flags: "
                            "--num-query-groups)"),
                           (["--recipe", "qwen3_moe_tiny", "--moe-layer-freq", "([1]*3)"],
                            "moe_layer_freq pattern has 3 entries, num_layers=2"),
                           (["--hidden-size", "64"], "give --recipe NAME")]:
        assert cli([*base, *flags]) == 2
        assert message in capsys.readouterr().err, message


def test_startup_line_prints_total_and_active(capsys, monkeypatch, tmp_path):
    from moefold.models.params import count_parameters, fmt_count

    monkeypatch.setattr("moefold.training.cli.train.run_ranks", lambda *_a, **_k: None)
    flags = ["--recipe", "qwen3_moe_tiny", "--hidden-size", "128", "--num-experts", "16"]
    assert cli(["train", *flags, "--run-dir", str(tmp_path), "--no-save"]) == 0
    report = count_parameters(_model_config(*flags))
    assert (f"{fmt_count(report.total)} parameters, {fmt_count(report.active)} active per token, 2 layers, "
            "16 experts top-2") in capsys.readouterr().out

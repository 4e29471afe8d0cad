"""The ``deepseek_v4`` family: ``MoEDecoder`` equals transformers' ``DeepseekV4ForCausalLM`` (fp32, 1e-5).

Tiny configs drawn at random over the fields that change the computation (per-layer attention kinds and rates,
hash layers, mHC streams and Sinkhorn iterations, top-k, the score function and its normalisation, the scaling,
the SwiGLU limit, the window, the indexer's top-k, RoPE dims); the HF config goes through
``models.hf.deepseek_v4.config_from_hf`` and the weights through its names, both ways.
"""

from __future__ import annotations

import random

import pytest
import torch

from moefold.models.decoder import MoEDecoder
from moefold.models.hf import deepseek_v4 as hf_v4
from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelDims

V, S, B = 48, 12, 2


def _hf_config(seed: int) -> dict:
    r = random.Random(seed)
    layers = r.randint(2, 4)
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    heads = r.choice([2, 4])
    # odd seeds: the compressed layers' RoPE with YaRN (the published config's form: a top-level rope_scaling)
    yarn = {"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 8, "beta_fast": 32,
                             "beta_slow": 1}, "max_position_embeddings": 32} if seed % 2 else {}
    return {**yarn,"vocab_size": V, "hidden_size": 16, "num_hidden_layers": layers, "num_attention_heads": heads,
            "head_dim": 8, "q_lora_rank": r.choice([6, 12]), "o_groups": r.choice([1, 2]), "o_lora_rank": 6,
            "index_n_heads": r.choice([1, 3]), "index_head_dim": 4, "index_topk": r.choice([1, 2, 3]),
            "sliding_window": r.choice([3, 5]), "partial_rotary_factor": r.choice([0.25, 0.5]),
            "rope_theta": 100.0, "compress_rope_theta": 1000.0, "rms_norm_eps": 1e-5,
            "layer_types": [r.choice(kinds) for _ in range(layers)],
            "mlp_layer_types": ["hash_moe"] * (n := r.randint(0, layers)) + ["moe"] * (layers - n),
            "hc_mult": r.choice([1, 2, 3]), "hc_sinkhorn_iters": r.choice([1, 5]), "n_routed_experts": 8,
            "num_experts_per_tok": r.choice([1, 2, 3]), "moe_intermediate_size": 8,
            "scoring_func": r.choice(["sqrtsoftplus", "sigmoid"]), "routed_scaling_factor": r.choice([1.0, 1.5]),
            "swiglu_limit": r.choice([0.5, 10.0]),
            "compress_rates": {"compressed_sparse_attention": r.choice([2, 3]),
                               "heavily_compressed_attention": r.choice([4, 5])}}


def _pair(seed: int):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf_dict = _hf_config(seed)
    cfg = DeepseekV4Config(**hf_dict)
    cfg._attn_implementation = "eager"
    hf = DeepseekV4ForCausalLM(cfg).eval()
    hf.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
        for name, b in hf.named_buffers():
            if name.endswith("tid2eid"):
                # a random table: each token's k distinct experts of all E
                b.copy_(torch.rand(V, hf_dict["n_routed_experts"], generator=g).argsort(-1)[:, :b.shape[-1]])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    config = hf_v4.config_from_hf(hf_dict)
    ours = MoEDecoder(config, ParallelDims.single(), ModelOptions())
    theirs = hf.state_dict()
    with torch.no_grad():
        for name, t in ours.state_dict().items():
            t.copy_(hf_v4.from_hf_tensor(name, theirs[hf_v4.hf_name(name)], t))
    return hf_dict, config, hf, ours


@pytest.mark.parametrize("seed", [0, 3, 5, 6])   # every attention kind, 0-3 hash layers, 1-3 streams, YaRN or not
def test_logits_equal_transformers(seed):
    _, config, hf, ours = _pair(seed)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed + 100))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    got = ours.logits(ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # every tensor has a name in HF's tree and back, and the config round-trips
    assert {hf_v4.hf_name(n) for n in ours.state_dict()} == set(hf.state_dict())
    assert hf_v4.config_from_hf(hf_v4.hf_config(config)) == config


def test_the_model_trains_and_refuses_what_it_cannot_compute():
    _, config, _, ours = _pair(5)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    out = ours(ids, torch.roll(ids, -1, 1))
    out.loss.backward()
    # the lightning indexer's top-k selection passes no gradient (as in HF: it has no training loss here)
    assert [n for n, p in ours.named_parameters() if p.grad is None] == [
        n for n, _ in ours.named_parameters() if ".compressor.indexer." in n]
    with pytest.raises(ValueError, match="builds no MTP"):
        config.with_(mtp_num_layers=1)
    with pytest.raises(ValueError, match="not read by moefold"):
        hf_v4.config_from_hf({**_hf_config(0), "unheard_of": 1})
    with pytest.raises(ValueError, match="hidden_act"):
        hf_v4.config_from_hf({**_hf_config(0), "hidden_act": "gelu"})


def test_hf_checkpoint_round_trip(tmp_path):
    """``save_pretrained``'s directory -> ``import_hf`` (the same logits) -> ``export_hf`` -> ``from_pretrained``
    (the same logits): DeepSeek's checkpoint names both ways, per-expert tensors, every tensor read."""
    from transformers import DeepseekV4ForCausalLM

    from moefold.models.hf.exporter import export_hf
    from moefold.models.hf.importer import import_hf

    _, _, hf, _ = _pair(6)
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    ours = import_hf(tmp_path / "hf")
    torch.testing.assert_close(ours.logits(ids), want, atol=1e-5, rtol=1e-5)
    export_hf(ours, tmp_path / "out")
    back = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)


def test_cli_convert_round_trip(tmp_path):
    """``moefold convert`` HF -> moefold -> HF keeps every tensor (DeepSeek's names both ways)."""
    from moefold.models.tensor_io import TensorReader
    from moefold.training.cli import main as cli

    _, _, hf, _ = _pair(0)
    hf.save_pretrained(tmp_path / "hf")
    assert cli(["convert", str(tmp_path / "hf"), str(tmp_path / "mf")]) == 0
    assert cli(["convert", str(tmp_path / "mf"), str(tmp_path / "back")]) == 0
    state = hf.state_dict()
    with TensorReader(tmp_path / "back") as r:
        assert r.names() and all(not n.startswith("model.layers") for n in r.names())
        assert torch.equal(r.read("layers.0.attn.wq_a.weight"), state["model.layers.0.self_attn.q_a_proj.weight"])
        w1 = r.read("layers.0.ffn.experts.3.w1.weight")
        assert torch.equal(w1, state["model.layers.0.mlp.experts.gate_up_proj"][3, :w1.shape[0]])

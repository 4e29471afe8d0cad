"""Nemotron-H (issue 51) at world 1: tiny random ``NemotronHForCausalLM`` checkpoints, drawn over the fields that
change the computation (``nemotron_h_tiny.draw``), import with logits equal to transformers' (fp32, within fp32's
own error measured against float64: ``tests/tolerance``), export back bit-exact in the hub's naming (``backbone.``,
per expert) with the same config.json, and transformers reloads the export with the same logits; a negative
control (RoPE switched on in moefold: the logits differ); the published Nano 30B-A3B config reads as the recipe
with its published parameter counts; refusals name the field and value."""

from __future__ import annotations

import json

import pytest
import torch

from moefold.models.decoder import MoEDecoder
from moefold.models.hf.config_map import from_hf_config
from moefold.models.hf.exporter import export_hf
from moefold.models.hf.importer import import_hf, load_config
from moefold.models.params import count_parameters
from moefold.models.recipes import get_recipe
from moefold.models.tensor_io import TensorReader
from moefold.parallel.dims import ParallelDims
from tests.models.hf_tiny import hf_logits, hf_logits_and_bound, tokens
from tests.models.nemotron_h_tiny import hf_model
from tests.models.published_nemotron_h import NEMOTRON_3_NANO_30B_A3B

transformers = pytest.importorskip("transformers")


def _tensors(path) -> dict[str, torch.Tensor]:
    with TensorReader(path) as r:
        return {n: r.read(n) for n in r.names()}


@pytest.mark.parametrize("seed", range(6))
def test_logits_equal_transformers(seed, tmp_path):
    hf = hf_model(seed)
    hf.save_pretrained(tmp_path / "hf")
    ids = tokens()
    ref, bound = hf_logits_and_bound(hf, ids)
    model = import_hf(tmp_path / "hf")
    diff = (model.logits(ids) - ref).abs().max().item()
    print(f"nemotron_h seed {seed}: world-1 max |logits diff| = {diff:.3g} (fp32 bound {bound:.3g})")
    assert diff <= max(bound, 1e-6)
    if seed < 2:   # export: the same tensors and config.json; transformers reads it back to the same logits
        export_hf(model, tmp_path / "out")
        a, b = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[n], b[n]) for n in a)
        written = json.loads((tmp_path / "out" / "config.json").read_text())
        assert from_hf_config(written, name="hf") == load_config(tmp_path / "hf")
        reloaded = transformers.NemotronHForCausalLM.from_pretrained(tmp_path / "out").eval()
        torch.testing.assert_close(hf_logits(reloaded, ids), ref, atol=1e-5, rtol=0)


def test_rope_switched_on_differs(tmp_path):
    """Negative control: the same weights with RoPE on the attention layers (NemotronH has none) move the logits."""
    hf = hf_model(1)
    hf.save_pretrained(tmp_path)
    ref = hf_logits(hf, tokens())
    model = MoEDecoder(load_config(tmp_path).with_(partial_rotary_factor=1.0))
    model.load_state_dict(import_hf(tmp_path).state_dict())
    assert (model.logits(tokens()) - ref).abs().max().item() > 1e-3


def test_published_nano_reads_as_recipe_with_its_counts():
    config = from_hf_config(NEMOTRON_3_NANO_30B_A3B)
    recipe = get_recipe("nemotron_3_nano_30b_a3b")
    assert config.with_(name=recipe.name, extra={}) == recipe.with_(extra={})
    report = count_parameters(recipe)
    # NVIDIA: 31.6B total, 3.2B active (3.6B with the embeddings); exactly, as moefold inspect prints them
    assert report.total == 31_577_937_344
    assert report.active_without_embedding == 3_227_751_872 and report.active == 3_580_073_408
    assert [layer.mixer for layer in report.layers].count("mamba") == 23
    assert [layer.mixer for layer in report.layers].count("full_attention") == 6


@pytest.mark.parametrize("field, value", [("mlp_hidden_act", "silu"), ("mamba_hidden_act", "gelu"),
                                          ("mlp_bias", True), ("sliding_window", 128)])
def test_refused_fields_named(field, value):
    with pytest.raises(ValueError, match=f"nemotron_h: {field}={value!r} is not supported"):
        from_hf_config({**NEMOTRON_3_NANO_30B_A3B, field: value})


def test_layouts_mamba_refuses_tp_and_cp_past_its_groups():
    """The Mamba-2 mixer splits whole B/C groups over tp, then a tp rank's groups over cp: other layouts are refused
    at start-up in one line."""
    from types import SimpleNamespace

    from moefold.models.layer_factory import check_layout
    from moefold.models.options import ModelOptions

    config = get_recipe("nemotron_h_tiny")   # 2 groups
    check_layout(config, SimpleNamespace(tp=2, cp=1, ep=1, etp=1), ModelOptions())
    check_layout(config, SimpleNamespace(tp=1, cp=2, ep=1, etp=1), ModelOptions())
    with pytest.raises(ValueError, match=r"num_groups=2 / tp=2 is not divisible by cp=2"):
        check_layout(config, SimpleNamespace(tp=2, cp=2, ep=1, etp=1), ModelOptions())
    with pytest.raises(ValueError, match=r"num_groups=2 \(n_groups\) is not divisible by tp=4"):
        check_layout(config.with_(num_attention_heads=8, num_query_groups=4), SimpleNamespace(tp=4, cp=1, ep=1, etp=1),
                     ModelOptions())


def test_flops_count_mamba_and_relu2_layers():
    """MFU's model FLOPs (training.observe.flops): a Mamba-2 layer's projections are its in/out weights, its scan
    two head_dim x state products per head; an ungated relu2 MLP reads two matrices, not SwiGLU's three; one-sublayer
    layers count their one sublayer only."""
    from moefold.models.layer_factory import build_block
    from moefold.models.options import ModelOptions
    from moefold.training.observe.flops import ffn_macs, forward_flops_per_token, mamba_macs

    c = get_recipe("nemotron_h_tiny")
    blocks = {i: build_block(c, i, ParallelDims.single(), ModelOptions()) for i in range(c.num_layers)}
    m = c.mamba
    mixer = blocks[0].self_attn
    assert mamba_macs(c) == mixer.in_proj.weight.numel() + mixer.out_proj.weight.numel() + \
        m.conv_channels * m.conv_kernel + 2 * m.num_heads * m.head_dim * m.state_size
    mlp = blocks[c.layer_types.index("mlp")].mlp
    assert ffn_macs(c, moe=False) == mlp.up_proj.weight.numel() + mlp.down_proj.weight.numel()
    assert blocks[0].mlp is None and blocks[1].self_attn is None
    swiglu = forward_flops_per_token(c.with_(ffn_activation="swiglu"), 64)
    assert forward_flops_per_token(c, 64) < swiglu


def test_gradients_equal_transformers(tmp_path):
    """One backward of the same next-token loss: every parameter's gradient (Mamba-2's in group-major rows, the
    ungated experts per expert) equals transformers' autograd, both in the hub's naming."""
    from moefold.models.hf.exporter import hf_tensors

    hf = hf_model(9)   # projection biases, latent experts, group-limited routing
    hf.save_pretrained(tmp_path)
    ids, labels = tokens(seed=5), tokens(seed=6)
    logits = hf(input_ids=ids).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    hf_grads = {}
    for name, p in hf.named_parameters():
        disk = name.replace("model.", "backbone.", 1)
        if name.endswith(("experts.up_proj", "experts.down_proj")):   # fused in memory, per expert on disk
            for e, g in enumerate(p.grad):
                hf_grads[f"{disk.rsplit('.', 1)[0]}.{e}.{disk.rsplit('.', 1)[1]}.weight"] = g
        else:
            hf_grads[disk] = p.grad
    config = load_config(tmp_path).with_(moe_aux_loss_coeff=0.0)   # HF's loss has no balancing term
    model = MoEDecoder(config)
    model.load_state_dict(import_hf(tmp_path).state_dict())
    model(ids, labels).loss.backward()
    ours = {n: g for name, p in model.named_parameters() for n, g in hf_tensors(name, p.grad, config)}
    assert sorted(ours) == sorted(hf_grads)
    for name, grad in ours.items():
        torch.testing.assert_close(grad, hf_grads[name], atol=1e-6, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

"""DeepSeek-V4's published checkpoint format (``models.hf.fp4_experts``), fixtures built here from a tiny random
``DeepseekV4ForCausalLM`` whose weights are quantised in the layout transformers 5.25 reads:

- routed experts packed FP4 (int8 bytes, two e2m1 values each, low nibble first) with a UE8M0 scale per row and 32
  values along K; the other linear weights e4m3 with a UE8M0 scale per 32x32 block (``X.scale``, DeepSeek's name);
  ``expert_dtype`` top-level (V4-Flash's config.json) or inside ``quantization_config`` (V4.1's), scales as
  float8_e8m0fnu or as their exponent bytes (uint8);
- moefold's import holds every tensor bit for bit as transformers' ``FineGrainedFP8Config(dequantize=True)`` load
  does (fp32), and the logits agree within the V4 parity tolerance (1e-5, the models' own arithmetic);
- a rank's slice of an FP4 weight (odd K start, across scale blocks) equals the slice of the whole, and an "F4"
  (float4_e2m1fn_x2) stored weight reads as its int8 twin;
- ``inspect`` counts the logical (unpacked) parameters: the published V4-Flash config with its quantization fields
  still counts 284,332,230,231, and the tiny checkpoint's headers hold what its config implies;
- ``--load-hf`` at ep4 and ep2 x etp2 reads each rank's slice (etp: half an FP4 scale block of ``w2``'s K);
- DeepSeek's ``mtp.*`` tensors published beside the model are ignored (transformers loads none either);
- ``convert --to hf --hf-fp8`` writes the same published form, read back to the same values by moefold and
  transformers;
- every ``quantization_config`` field is read or refused in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moefold.models.hf import deepseek_v4 as v4
from moefold.models.hf.fp4_experts import E8M0, dequantize_fp4, quantize_fp4, ue8m0_scale
from moefold.models.hf.fp8_blocks import E4M3, Fp8BlockReader, quant_format, stored_in_fp8
from moefold.models.hf.importer import import_hf
from moefold.models.tensor_io import TensorReader
from tests.models.test_deepseek_v4_recipes import FLASH_BASE

V, B = 48, 32   # vocabulary, the FP8 block (every tiny dim a multiple of it or smaller: transformers infers blocks)
TOL = 1e-5
CONFIG = {"vocab_size": V, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 32,
          "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 32, "index_n_heads": 2, "index_head_dim": 16,
          "index_topk": 2, "sliding_window": 4, "partial_rotary_factor": 0.5, "rope_theta": 100.0,
          "compress_rope_theta": 1000.0,
          "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
          "mlp_layer_types": ["hash_moe", "moe", "moe"], "hc_mult": 2, "hc_sinkhorn_iters": 3, "n_routed_experts": 8,
          "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}}
QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
         "weight_block_size": [B, B]}


def _fp8_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 per BxB block with the scale 2 ** ceil(log2(amax / 448)) (transformers' ue8m0 quantiser)."""
    N, K = w.shape
    nr, nc = -(-N // B), -(-K // B)
    blocks = torch.nn.functional.pad(w, (0, nc * B - K, 0, nr * B - N)).reshape(nr, B, nc, B)
    s = ue8m0_scale(blocks.abs().amax((1, 3)), 448.0)
    q = (w / s.repeat_interleave(B, 0).repeat_interleave(B, 1)[:N, :K]).clamp(-448, 448).to(E4M3)
    return q, s.to(E8M0)


def _checkpoint(tmp_path, v41: bool):
    """(transformers' dequantising load, the directory, its tensors) of a tiny V4 in the published layout."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, FineGrainedFP8Config

    hf = DeepseekV4ForCausalLM(DeepseekV4Config(**CONFIG)).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
        for name, b in hf.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.rand(V, 8, generator=g).argsort(-1)[:, :b.shape[-1]])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    hf.save_pretrained(tmp_path / "src")   # DeepSeek's names (transformers' conversion mapping undone)
    stored = {}
    for name, w in load_file(str(tmp_path / "src" / "model.safetensors")).items():
        scale = name[: -len(".weight")] + ".scale"
        if ".ffn.experts." in name:
            stored[name], stored[scale] = quantize_fp4(w)
        elif stored_in_fp8(name, w) and all(n % B == 0 or n < B for n in w.shape):
            stored[name], stored[scale] = _fp8_ue8m0(w)
        else:
            stored[name] = w
        if v41 and scale in stored:   # V4.1 / MXFP8 style: the scales' exponent bytes
            stored[scale] = stored[scale].view(torch.uint8)
    # DeepSeek's MTP layer is published beside the model; transformers' V4 class loads none of it, nor does moefold
    stored["mtp.0.e_proj.weight"], stored["mtp.0.e_proj.scale"] = _fp8_ue8m0(torch.randn(64, 64, generator=g))
    stored["mtp.0.ffn.experts.0.w1.weight"], stored["mtp.0.ffn.experts.0.w1.scale"] = quantize_fp4(
        torch.randn(32, 64, generator=g))
    path = tmp_path / ("v4.1" if v41 else "v4")
    path.mkdir()
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    if v41:
        config["quantization_config"] = {**QUANT, "expert_dtype": "fp4"}
    else:
        config.update(quantization_config=dict(QUANT), expert_dtype="fp4")
    (path / "config.json").write_text(json.dumps(config))
    theirs = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=(
        FineGrainedFP8Config(dequantize=True))).eval()
    return theirs, path, stored


@pytest.mark.parametrize("v41", [False, True], ids=["v4-flash", "v4.1"])
def test_published_forms_read_as_transformers_dequantises_them(tmp_path, v41):
    theirs, path, stored = _checkpoint(tmp_path, v41)
    assert sum(n.endswith(".scale") and n.startswith("model.layers") and ".experts." in n for n in stored) == 72
    assert sum(n.endswith(".scale") and n.startswith("model.layers") and ".experts." not in n for n in stored) > 20
    ours = import_hf(path)
    state = theirs.state_dict()
    for name, t in ours.state_dict().items():   # every tensor bit for bit: the same fp32 products
        want = v4.from_hf_tensor(name, state[v4.hf_name(name)], t)
        assert torch.equal(t, want), name
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(input_ids=ids).logits
    diff = (ours.logits(ids) - want).abs().max().item()
    print(f"deepseek_v4 {'V4.1' if v41 else 'V4'} FP4/FP8-ue8m0: max |logits diff| = {diff:.3g}")
    assert diff <= TOL


def test_fp4_slices_f4_storage_and_the_quantiser(tmp_path):
    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp4(w)
    assert q.dtype == torch.int8 and q.shape == (6, 48) and s.dtype == E8M0 and s.shape == (6, 3)
    full = dequantize_fp4(q, s)
    step = s.float().repeat_interleave(32, -1)   # e2m1's widest gap (4 -> 6) is 2 scale units: error <= 1 unit
    assert ((full - w).abs() <= step).all()
    assert torch.equal(dequantize_fp4(*quantize_fp4(full)), full)   # values on the grid stay (bytes may not)
    save_file({"x.weight": q, "x.scale": s, "y.weight": q.clone().view(torch.uint8).view(torch.float4_e2m1fn_x2),
               "y.scale": s.clone()}, str(tmp_path / "model.safetensors"))
    with TensorReader(tmp_path) as raw:
        reader = Fp8BlockReader(raw, quant_format({"quantization_config": {**QUANT, "expert_dtype": "fp4"}}))
        assert reader.names() == ["x.weight", "y.weight"] and reader.is_fp4("y.weight")
        assert reader.shape("x.weight") == reader.shape("y.weight") == (6, 96)
        assert torch.equal(reader.read("x.weight"), full) and torch.equal(reader.read("y.weight"), full)
        for box in ((slice(1, 4), slice(17, 70)), (slice(0, 6), slice(31, 33)), (slice(5, 6),)):
            assert torch.equal(reader.read("x.weight", box), full[box]), box


def test_inspect_counts_the_unpacked_parameters(tmp_path, capsys):
    from moefold.training.cli import main as cli

    flash = tmp_path / "flash"
    flash.mkdir()
    (flash / "config.json").write_text(json.dumps({**FLASH_BASE, "expert_dtype": "fp4", "quantization_config": {
        k: v if k != "weight_block_size" else [128, 128] for k, v in QUANT.items()}}))
    assert cli(["inspect", "--hf", str(flash), "--no-layers"]) == 0
    assert "total 284.332B" in capsys.readouterr().out
    _, path, _ = _checkpoint(tmp_path, v41=False)
    assert cli(["inspect", "--hf", str(path), "--no-layers"]) == 0
    out = capsys.readouterr().out
    assert "do not belong together" not in out, out
    # 72 + MTP's
    assert "routed experts packed FP4 (e2m1, a ue8m0 scale per row and 32 values): 73 tensors" in out, out
    assert "FP8 e4m3 in 32x32 blocks (ue8m0 scales)" in out, out
    # convert HF -> moefold -> HF (--hf-fp8): the CLI reads the published form and writes it back
    assert cli(["convert", str(path), str(tmp_path / "mf")]) == 0
    assert cli(["convert", str(tmp_path / "mf"), str(tmp_path / "back"), "--to", "hf", "--hf-fp8"]) == 0
    for a, b in zip(import_hf(path).state_dict().values(), import_hf(tmp_path / "back").state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("change, match", [
    ({"expert_dtype": "fp6"}, r"expert_dtype='fp6'; valid: \['fp8', 'fp4'\]"),
    ({"scale_fmt": "e5m2"}, r"scale_fmt='e5m2'; valid: \['float', 'ue8m0'\]"),
    ({"weight_group_size": 32}, r"fields \['weight_group_size'\] are not read by moefold"),
    ({"activation_scheme": "static"}, "dynamic activation scaling only"),
])
def test_quantization_fields_read_or_refused(change, match):
    with pytest.raises(ValueError, match=match):
        quant_format({"quantization_config": {**QUANT, **change}})
    # the top-level expert_dtype (V4) folds in unless quantization_config names one (V4.1), as transformers does
    assert quant_format({"expert_dtype": "fp4", "quantization_config": QUANT}).expert_dtype.value == "fp4"
    assert quant_format({"expert_dtype": "fp4", "quantization_config": {**QUANT, "expert_dtype": "fp8"}}
                        ).expert_dtype.value == "fp8"
    assert quant_format({"expert_dtype": "fp4"}) is None


def test_fp4_weights_under_expert_dtype_fp8_are_refused(tmp_path):
    q, s = quantize_fp4(torch.randn(4, 64))
    save_file({"e.weight": q, "e.scale": s}, str(tmp_path / "model.safetensors"))
    with TensorReader(tmp_path) as raw, pytest.raises(ValueError, match=r"packed FP4 .* expert_dtype='fp8'"):
        Fp8BlockReader(raw, quant_format({"quantization_config": QUANT}))


def test_hf_fp8_export_writes_the_published_form(tmp_path):
    """``--hf-fp8`` of a DeepSeek-V4 model writes V4-Flash's form (ue8m0 ``.scale`` partners, FP4 routed experts,
    ``expert_dtype`` top-level): read back by moefold every value is the imported one, bit for bit (the grid's
    values survive a recomputed power-of-two scale), and transformers' dequantising load gives the same logits.
    At these sizes every dim is one 128x128 block (transformers infers blocks from the grid)."""
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    from moefold.models.hf.exporter import export_hf

    _, path, _ = _checkpoint(tmp_path, v41=True)
    ours = import_hf(path)
    export_hf(ours, tmp_path / "out", fp8=True)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["expert_dtype"] == "fp4" and config["quantization_config"] == {**QUANT, "weight_block_size": [
        128, 128]}
    with TensorReader(tmp_path / "out") as r:
        dtypes = {n: r.dtype(n) for n in r.names()}
    assert dtypes["layers.1.ffn.experts.7.w2.weight"] == "I8" and dtypes["layers.1.ffn.experts.7.w2.scale"] == (
        "F8_E8M0")
    assert dtypes["layers.2.attn.wq_a.weight"] == "F8_E4M3" and dtypes["layers.2.attn.wq_a.scale"] == "F8_E8M0"
    assert dtypes["embed.weight"] == dtypes["head.weight"] == dtypes["layers.1.ffn.gate.weight"] == "F32"
    again = import_hf(tmp_path / "out")
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    theirs = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32, quantization_config=(
        FineGrainedFP8Config(dequantize=True))).eval()
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = theirs(input_ids=ids).logits
    assert (ours.logits(ids) - want).abs().max().item() <= TOL
    # without --hf-fp8: unquantised, and no expert_dtype left to tell DeepSeek's loader the experts are FP4
    export_hf(ours, tmp_path / "plain")
    plain = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "expert_dtype" not in plain and "quantization_config" not in plain


def _load_rank(path: str) -> list[str]:
    """``--load-hf``'s loading at ep4 and ep2 x etp2 (etp splits ``w2``'s K: half an FP4 scale block per rank):
    every gathered tensor equals the world-1 import; the names that differ."""
    from moefold.models.decoder import MoEDecoder
    from moefold.models.pretrained import load_pretrained_weights, pretrained_config
    from moefold.parallel.dims import ParallelConfig, ParallelDims
    from moefold.parallel.sharding import gather_full, shards_of

    whole = import_hf(path).state_dict()
    bad = []
    for label, layout in (("ep4", dict(ep=4)), ("ep2xetp2", dict(ep=2, etp=2))):
        model = MoEDecoder(pretrained_config(path), ParallelDims.build(ParallelConfig(**layout)))
        load_pretrained_weights(model, path)
        bad += [f"{label}: {n}" for n, t in model.state_dict(keep_vars=True).items()
                if not torch.equal(gather_full(t, shards_of(t)), whole[n])]
    return bad


def test_load_hf_reads_each_ranks_slice(tmp_path):
    from tests.distributed import run_distributed

    _, path, _ = _checkpoint(tmp_path, v41=False)
    assert run_distributed(_load_rank, 4, str(path), timeout=300) == [[]] * 4

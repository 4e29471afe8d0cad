"""FP8 block HF checkpoints (``float8_e4m3fn`` weights + ``weight_scale_inv`` per 128x128 block,
``quantization_config.weight_block_size``: DeepSeek-V3, Kimi-K2, MiniMax-M2 on the hub), fixtures built here:

- the dequantised weights equal ``w_fp8.float() * scale_inv`` block by block (ragged last blocks included), whole
  and as a rank's slice;
- the imported model's logits equal HF transformers' on the dequantised weights (DeepSeek-V3 at hidden 160:
  two blocks per dim, the second ragged; MiniMax-M2's per-expert w1/w2/w3);
- transformers' own FP8 loader (``FineGrainedFP8Config(dequantize=True)``) reads what ``convert --to hf --hf-fp8``
  writes, with the same logits;
- HF-FP8 -> moefold -> HF-FP8 keeps every FP8 byte and every unquantised tensor; a ``scale_inv`` is recomputed
  from its dequantised block and equals the original to within one fp32 ulp (``fp32(max|q| * s) / 448``
  may round; measured: all 154 blocks bit for bit);
- with ``--fp8-param-gather`` (blockwise) the checkpoint becomes FP8 primary weights: fp32 masters hold the
  dequantised values and the first FP8 all-gather (dp2) carries exactly the checkpoint's FP8 bytes;
- formats moefold does not read (MXFP4) are refused with one line, ``inspect`` names the FP8 blocks.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moefold.models.hf.fp8_blocks import Fp8BlockReader, stored_in_fp8
from moefold.models.hf.importer import import_hf
from moefold.models.tensor_io import TensorReader
from tests.models.hf_tiny import hf_logits, hf_model, tokens

TOL = 2e-5
E4M3 = torch.float8_e4m3fn
HUB = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The hub's convention, written out: per 128x128 block (ragged at the end) scale_inv = amax / 448."""
    N, K = w.shape
    s = torch.empty(-(-N // 128), -(-K // 128))
    q = torch.empty(N, K, dtype=E4M3)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            s[i, j] = blk.abs().amax().clamp(min=1e-12) / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / s[i, j]).clamp(-448, 448).to(E4M3)
    return q, s


def _dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            out[rows, cols] = q[rows, cols].float() * s[i, j]
    return out


def _fp8_checkpoint(family: str, path, **changes):
    """(HF model holding the dequantised weights, the FP8 directory): the family's tiny model, every linear
    weight quantised in the hub's layout, its config.json with quantization_config."""
    hf = hf_model(family, **changes)
    src = path / "src"
    hf.save_pretrained(src)
    tensors, fp8 = load_file(str(src / "model.safetensors")), {}
    dequantised = {}
    for name, t in tensors.items():
        if stored_in_fp8(name, t):
            q, s = _quantize(t)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            dequantised[name] = _dequantize(q, s)
        else:
            fp8[name] = t
    assert dequantised, "no tensor was quantised"
    out, deq = path / "fp8", path / "dequantised"
    out.mkdir()
    deq.mkdir()
    save_file(fp8, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file({**tensors, **dequantised}, str(deq / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (deq / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = dict(HUB)
    (out / "config.json").write_text(json.dumps(config))
    from transformers import AutoModelForCausalLM  # transformers' own loading of the dequantised weights

    ref = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    ref.config._attn_implementation = hf.config._attn_implementation
    return ref, out, fp8


DEEPSEEK = dict(hidden_size=160, intermediate_size=288, moe_intermediate_size=144, q_lora_rank=136, kv_lora_rank=132,
                num_hidden_layers=2)


def test_dequantised_block_by_block_and_logits_equal_transformers(tmp_path):
    hf, path, fp8 = _fp8_checkpoint("deepseek_v3", tmp_path, **DEEPSEEK)
    with TensorReader(path) as raw:
        reader = Fp8BlockReader(raw, (128, 128))
        name = "model.layers.0.mlp.gate_proj.weight"   # [288, 160]: blocks 3 x 2, both ragged
        assert fp8[name + "_scale_inv"].shape == (3, 2) and reader.is_fp8(name)
        assert name + "_scale_inv" not in reader and name + "_scale_inv" not in reader.names()
        full = reader.read(name)
        assert torch.equal(full, _dequantize(fp8[name], fp8[name + "_scale_inv"]))
        box = (slice(100, 290), slice(130, 160))   # a rank's slice crossing block boundaries
        assert torch.equal(reader.read(name, box), full[box])
    ids = tokens()
    model = import_hf(path)
    diff = (model.logits(ids) - hf_logits(hf, ids)).abs().max().item()
    print(f"deepseek_v3 (FP8 blocks): max |logits diff| = {diff:.3g}")
    assert diff <= TOL


def test_minimax_m2_per_expert_fp8(tmp_path):
    hf, path, fp8 = _fp8_checkpoint("minimax_m2", tmp_path)
    assert any(".experts.0.w1.weight_scale_inv" in n for n in fp8)
    ids = tokens()
    torch.testing.assert_close(import_hf(path).logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_roundtrip_hf_fp8_moefold_hf_fp8_keeps_the_bytes(tmp_path):
    _, path, fp8 = _fp8_checkpoint("deepseek_v3", tmp_path, **DEEPSEEK)
    out = tmp_path / "again"
    from moefold.training.cli import main

    run = lambda *a: main(["convert", *a]) == 0 or pytest.fail(f"convert {a}")
    run(str(path), str(tmp_path / "moefold"))
    run(str(tmp_path / "moefold"), str(out), "--to", "hf", "--hf-fp8")
    again = load_file(str(out / "model.safetensors"))
    assert set(again) == set(fp8)
    ulps = total = 0
    for name, t in fp8.items():
        if name.endswith("_scale_inv"):
            got = again[name]
            assert got.dtype == torch.float32
            ulps += int((got != t).sum())
            total += t.numel()
            assert ((got - t).abs() <= (torch.nextafter(t, torch.full_like(t, float("inf"))) - t)).all(), name
        elif t.dtype == E4M3:
            assert torch.equal(again[name].view(torch.uint8), t.view(torch.uint8)), name
        else:
            assert torch.equal(again[name], t), name
    print(f"scale_inv: {ulps} of {total} blocks one fp32 ulp apart, the rest bit for bit; every FP8 byte kept")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == HUB
    # without --hf-fp8 the export is unquantised, with no quantization_config
    run(str(tmp_path / "moefold"), str(tmp_path / "plain"), "--to", "hf")
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    assert not any(n.endswith("_scale_inv") for n in load_file(str(tmp_path / "plain" / "model.safetensors")))


def test_transformers_fp8_loader_reads_the_export(tmp_path):
    """transformers' FineGrainedFP8 loader (dequantize=True, on CPU) reads ``--hf-fp8``'s output with the logits
    of the model moefold exported. At hidden 32 every dim is one block: transformers 5.24 infers a block from
    the grid (rows // scale rows), which misreads ragged blocks (288 rows in 3 blocks -> 96); moefold reads
    ``weight_block_size``."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from moefold.models.hf.exporter import export_hf

    _, path, _ = _fp8_checkpoint("deepseek_v3", tmp_path)
    model = import_hf(path)
    export_hf(model, tmp_path / "out", fp8=True)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                    quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    ids = tokens()
    torch.testing.assert_close(hf_logits(reloaded, ids), model.logits(ids), atol=TOL, rtol=0)


def test_unread_formats_refused_and_inspect_names_the_blocks(tmp_path, capsys):
    _, path, _ = _fp8_checkpoint("deepseek_v3", tmp_path)
    from moefold.training.cli import main

    assert main(["inspect", "--hf", str(path)]) == 0
    out = capsys.readouterr().out
    assert "FP8 e4m3 in 128x128 blocks (weight_scale_inv)" in out
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config \(quant_method='mxfp4'\): moefold reads FP8 e4m3"):
        import_hf(path)
    assert main(["convert", str(path), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mxfp4" in err[0], err


def _primary_rank(path: str) -> dict:
    from moefold.models.pretrained import pretrained_config
    from moefold.parallel.dims import ParallelConfig, ParallelDims
    from moefold.precision.fp8 import FP8Config
    from moefold.training.config import RunConfig, TrainConfig
    from moefold.training.trainer import Trainer

    fp8 = FP8Config("e4m3", "blockwise", param_gather=True)
    from moefold.models.options import ModelOptions

    config = RunConfig(model=pretrained_config(path), options=ModelOptions(fp8=fp8),
                       train=TrainConfig(micro_batch_size=1, global_batch_size=2, seq_length=16, train_iters=1,
                                         load_hf=path, lr_warmup_iters=0))
    trainer = Trainer(config, ParallelDims.build(ParallelConfig()), log=lambda _m: None)
    trainer.optimizer.param_sync.launch()   # the FP8 gather a step ends with, from the loaded fp32 masters
    trainer.optimizer.finish_param_sync()
    params = dict(trainer.model.named_parameters())
    return {"dense": params["layers.0.mlp.gate_proj.weight"].detach().clone(),
            "expert": params["layers.1.mlp.experts.w13"].detach()[3, 0].clone()}


def test_fp8_checkpoint_as_fp8_primary_weights(tmp_path):
    """``--load-hf`` of an FP8 checkpoint with ``--fp8-param-gather`` (blockwise): the masters are the dequantised
    checkpoint, and the FP8 weights the optimizer gathers from them are the checkpoint's FP8 bytes (dp2)."""
    from tests.distributed import run_distributed

    _, path, fp8 = _fp8_checkpoint("deepseek_v3", tmp_path)
    got = run_distributed(_primary_rank, 2, str(path), timeout=300)[0]
    for mine, hf_name in (("dense", "model.layers.0.mlp.gate_proj.weight"),
                          ("expert", "model.layers.1.mlp.experts.3.gate_proj.weight")):
        q, s = fp8[hf_name], fp8[hf_name + "_scale_inv"]
        assert s.numel() == 1   # one block at hidden 32
        assert torch.equal((got[mine] / s).to(E4M3).view(torch.uint8), q.view(torch.uint8)), mine
        torch.testing.assert_close(got[mine], _dequantize(q, s), rtol=2 ** -21, atol=0)   # the scale re-derived

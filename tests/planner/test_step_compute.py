"""The calibrated compute model of ``moefold plan``: GEMM efficiency per shape and dtype, per-block GEMM shapes,
FP8 at its own rate, the exchange overlap, and the estimates against published runs."""

from __future__ import annotations

import dataclasses

import pytest

from moefold.models.options import ModelOptions
from moefold.models.recipes import deepseek_v3, qwen3_moe_30b_a3b
from moefold.parallel.dims import ParallelConfig
from moefold.planner.cluster import load_cluster
from moefold.planner.compute_time import block_gemms
from moefold.planner.gemm_efficiency import (
    B200_FP8_PEAKS,
    B200_PEAKS,
    BF16,
    BF16_B200,
    BF16_H100,
    BF16_SM100,
    FP8,
    FP8_B200,
    FP8_H800,
    FP8_SM100,
    H100_PEAKS,
    H800_FP8_PEAKS,
    fit_model,
    gemm_seconds,
    model_errors,
)
from moefold.planner.step_time import estimate_step_time
from moefold.precision.fp8 import FP8Config
from moefold.training.cli.train import validate_layout
from moefold.training.config import RunConfig, TrainConfig
from moefold.training.observe.flops import attention_macs, ffn_macs

FP8_ROWWISE = FP8Config(format="e4m3", backend="torchao", recipe="rowwise")


def test_gemm_model_within_its_stated_error_of_the_published_points():
    bf16 = model_errors(BF16, BF16_H100, H100_PEAKS)
    big = [e for e, p in zip(bf16, BF16_H100) if p.flops >= 4e9]
    assert min(big) >= -0.14 and max(big) <= 0.05 and max(bf16) <= 0.37
    fp8 = model_errors(FP8, FP8_H800, H800_FP8_PEAKS)
    assert min(fp8) >= -0.18 and max(fp8) <= 0.235
    # the constants are what the fit gives (the fit benchmarks/gemm_efficiency.py runs on measured points)
    assert fit_model("fp8", FP8_H800, H800_FP8_PEAKS, 1, 2) == FP8


def test_blackwell_gemms_from_their_own_points():
    """sm_100 clusters time GEMMs with the fit to OpenXLA's B200 table, within its stated error; Hopper's FP8 fit
    would put the same shapes well above what the B200 reaches."""
    assert fit_model("bf16", BF16_B200, B200_PEAKS, 2, 2) == BF16_SM100
    assert fit_model("fp8", FP8_B200, B200_FP8_PEAKS, 1, 2) == FP8_SM100
    bf16, fp8 = model_errors(BF16_SM100, BF16_B200, B200_PEAKS), model_errors(FP8_SM100, FP8_B200, B200_FP8_PEAKS)
    assert min(bf16) >= -0.10 and max(bf16) <= 0.26 and min(fp8) >= -0.10 and max(fp8) <= 0.21
    hopper = sorted(model_errors(FP8, FP8_B200, B200_FP8_PEAKS))
    assert hopper[len(hopper) // 2] > 0.4
    b200 = load_cluster("b200")
    assert b200.arch == "sm_100" and load_cluster("gb300").arch == "sm_100" and load_cluster("h100").arch == "sm_90"
    as_hopper = dataclasses.replace(b200, arch="sm_90")
    assert gemm_seconds(b200, "fp8", 256, 2048, 4096) > 1.3 * gemm_seconds(as_hopper, "fp8", 256, 2048, 4096)
    with pytest.raises(ValueError, match="arch='sm_75' must be one of"):
        dataclasses.replace(b200, arch="sm_75")


def test_gemm_seconds_by_shape_and_dtype():
    h100, a100 = load_cluster("h100"), load_cluster("a100")
    big = 2 * 8192 ** 3 / gemm_seconds(h100, "bf16", 8192, 8192, 8192) / 1e12
    thin = 2 * 64 * 4096 * 4096 / gemm_seconds(h100, "bf16", 64, 4096, 4096) / 1e12
    assert 0.75 * 989 < big < 0.85 * 989 and thin < 0.25 * big     # thin GEMMs are bound by memory
    assert gemm_seconds(h100, "fp8", 8192, 8192, 8192) < 0.6 * gemm_seconds(h100, "bf16", 8192, 8192, 8192)
    # no FP8 tensor cores: FP8 GEMMs at the bf16 rate
    assert gemm_seconds(a100, "fp8", 4096, 4096, 4096) == gemm_seconds(a100, "bf16", 4096, 4096, 4096)
    # many small experts in one grouped kernel are slower per FLOP than few large ones
    few, many = gemm_seconds(h100, "bf16", 4096, 1536, 2048, 8), gemm_seconds(h100, "bf16", 256, 1536, 2048, 128)
    assert many > 1.2 * few


def _config(model, world_parallel: ParallelConfig, fp8: FP8Config | None = None, gbs: int = 64) -> RunConfig:
    return RunConfig(model=model, parallel=world_parallel,
                     options=ModelOptions(dtype="bf16", **({"fp8": fp8} if fp8 else {})),
                     train=TrainConfig(micro_batch_size=1, global_batch_size=gbs, seq_length=4096, lr_warmup_iters=0))


@pytest.mark.parametrize("recipe, parallel", [(qwen3_moe_30b_a3b, ParallelConfig(tp=2, ep=4, etp=2)),
                                              (deepseek_v3, ParallelConfig(tp=1, ep=8))])
def test_block_gemms_count_the_model_flops(recipe, parallel):
    """The per-rank GEMMs of a block sum to the block's FLOPs (training.observe.flops) / ranks sharing them."""
    model = recipe()
    config = _config(model, parallel)
    sizes, _ = config.resolve(8)
    for index in (0, model.num_layers - 1):
        moe = model.is_moe_layer(index)
        score = model.num_attention_heads * (
            model.mla.qk_nope_head_dim + model.mla.qk_rope_head_dim + model.mla.v_head_dim
            if model.attention == "mla" else 2 * model.attention_head_dim) * (4096 + 1) / 2
        expected = 2 * (attention_macs(model, 4096, index) - score + ffn_macs(model, moe)) * 4096 / sizes.tp
        got = sum(g.flops for g in block_gemms(config, sizes, index))
        if model.attention == "mla":   # MLA's down-projections are replicated over tp, not split
            assert got >= expected * (1 - 1e-9)
        else:
            assert got == pytest.approx(expected, rel=1e-9)


def test_fp8_runs_at_its_own_rate_and_the_exchange_overlap_hides_ep():
    config = _config(qwen3_moe_30b_a3b(), ParallelConfig(ep=8))
    fp8 = dataclasses.replace(config, options=dataclasses.replace(config.options, fp8=FP8_ROWWISE))
    sizes, _ = config.resolve(8)
    h100 = load_cluster("h100")
    plain, quick = estimate_step_time(config, sizes, h100, 8), estimate_step_time(fp8, sizes, h100, 8)
    assert quick.terms["compute"] < plain.terms["compute"]   # small GEMMs: FP8 gains little here
    # an H100 described without FP8 units gains nothing (the casts cost a little)
    slow = dataclasses.replace(h100, fp8_tflops=0.0)
    assert estimate_step_time(fp8, sizes, slow, 8).terms["compute"] >= estimate_step_time(config, sizes, slow,
                                                                                           8).terms["compute"]
    hidden = estimate_step_time(config, sizes, h100, 4, exchange_overlap=1.0)
    exposed = estimate_step_time(config, sizes, h100, 4)
    assert exposed.terms["ep"] > 0 and hidden.terms["ep"] == 0
    shared = estimate_step_time(config, sizes, h100, 4, exchange_overlap=1.0, compute_share=0.5)
    assert shared.terms["compute"] == pytest.approx(2 * hidden.terms["compute"], rel=1e-9)
    for bad in ({"exchange_overlap": 1.5}, {"compute_share": 0.0}, {"efficiency": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            estimate_step_time(config, sizes, h100, 8, **bad)


def test_gemm_efficiency_benchmark_measures_and_fits(capsys):
    from benchmarks import gemm_efficiency

    argv = ["--device", "cpu", "--peak-tflops", "1", "--hbm-gbps", "10", "--scale", "64", "--iters", "1"]
    assert gemm_efficiency.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("# machine: ") and "# fp8 skipped: " in out and "# fitted bf16: compute_share=" in out
    assert sum(line.startswith("bf16 ") for line in out.splitlines()) == len(BF16_H100)


def test_mtp_counted_at_pp1_so_mfu_stays_below_the_peak():
    """A 2-layer DeepSeek-V3 proxy on one pipeline stage: its MTP block and MTP head are a third of its FLOPs; the
    step time left them out at pp = 1 while the MFU's FLOP count has them, which gave an MFU of 105.8%."""
    from moefold.models.recipes import get_recipe
    from moefold.planner.step_terms import UNCALIBRATED

    h100 = load_cluster("h100")
    times = {}
    for mtp in (0, 1):
        model = get_recipe("deepseek_v3_proxy").with_(num_layers=2, mtp_num_layers=mtp)
        config = RunConfig(model=model, parallel=ParallelConfig(ep=8), options=ModelOptions(dtype="bf16"),
                           train=TrainConfig(bf16=True, lr_warmup_iters=0, global_batch_size=64, seq_length=4096),
                           recipe="deepseek_v3_proxy")
        times[mtp] = estimate_step_time(config, validate_layout(config, 8), h100, 8, calibration=UNCALIBRATED)
    assert times[1].terms["compute"] > 1.4 * times[0].terms["compute"]
    assert 0 < times[1].mfu(h100) < 0.83 and 0 < times[0].mfu(h100) < 0.83   # 0.83: the GEMM model's best share

"""The tensor cores' sustained rate follows the board power (``planner.gemm_efficiency.tensor_tflops``): the GPUs the
fits were measured on (H100, H800, B200) keep their fitted rates, the same Blackwell silicon at 1,200 W (GB200) and
1,400 W (GB300) runs in proportion, no kernel beyond the datasheet peak, and a cluster without a board power (or an
architecture without a fit GPU) keeps the datasheet scaling."""

from __future__ import annotations

import dataclasses

import pytest

from moefold.planner.calibration import at_power_exponent
from moefold.planner.cluster import CLUSTERS, Cluster, load_cluster
from moefold.planner.gemm_efficiency import BF16_SM100, FIT_GPU, FP8_SM100, POWER_EXPONENT, gemm_seconds, tensor_tflops


def test_fit_gpus_keep_their_rates() -> None:
    for name in ("h100", "h200", "h800", "b200", "a100"):
        c = CLUSTERS[name]
        assert tensor_tflops(c, "bf16", 0.8) == c.bf16_tflops, name
        assert tensor_tflops(c, "fp8", 0.8) == (c.fp8_tflops or c.bf16_tflops), name


def test_blackwell_rate_in_proportion_to_board_power() -> None:
    bf16, fp8, watts = FIT_GPU["sm_100"]
    for name in ("gb200", "gb300"):
        c = CLUSTERS[name]
        scale = (c.board_watts / watts) ** POWER_EXPONENT
        assert tensor_tflops(c, "bf16", BF16_SM100.compute_share) == pytest.approx(bf16 * scale)
        assert tensor_tflops(c, "fp8", FP8_SM100.compute_share) == pytest.approx(fp8 * scale)
    # a large GEMM is bound by the tensor cores: its time goes with the board power, 1,200 -> 1,400 W
    gb200, gb300 = CLUSTERS["gb200"], CLUSTERS["gb300"]
    ratio = gemm_seconds(gb200, "fp8", 16384, 16384, 16384) / gemm_seconds(gb300, "fp8", 16384, 16384, 16384)
    assert ratio == pytest.approx(1400 / 1200, rel=0.01)


def test_no_kernel_beyond_the_datasheet_peak() -> None:
    gb300 = CLUSTERS["gb300"]
    for share in (0.5, 0.83, 0.95):
        assert share * tensor_tflops(gb300, "bf16", share) <= gb300.bf16_tflops * (1 + 1e-12)
    assert 0.95 * tensor_tflops(gb300, "bf16", 0.95) == pytest.approx(gb300.bf16_tflops)   # the cap binds there


def test_without_board_power_the_datasheet_peak() -> None:
    unknown = dataclasses.replace(CLUSTERS["gb300"], board_watts=0.0)
    assert tensor_tflops(unknown, "bf16", 0.71) == unknown.bf16_tflops
    assert tensor_tflops(unknown, "fp8", 0.75) == unknown.fp8_tflops


def test_calibration_restates_other_exponents_as_board_power() -> None:
    gb300 = CLUSTERS["gb300"]
    assert at_power_exponent(gb300, POWER_EXPONENT) == gb300
    assert tensor_tflops(at_power_exponent(gb300, 0.0), "bf16", 0.71) == pytest.approx(FIT_GPU["sm_100"][0])
    assert at_power_exponent(CLUSTERS["a100"], 0.0) == CLUSTERS["a100"]   # no fit GPU of its own


def test_cluster_file_takes_board_watts(tmp_path) -> None:
    path = tmp_path / "x.toml"
    base = 'memory = "186GB"\nbf16_tflops = 2500\nnvlink_gbps = 900\ninternode_gbps = 50\narch = "sm_100"\n'
    path.write_text(base + "board_watts = 1200\n")
    c = load_cluster(str(path))
    assert isinstance(c, Cluster) and c.board_watts == 1200
    assert tensor_tflops(c, "bf16", 0.71) == pytest.approx(2700)
    path.write_text(base + "board_watts = -5\n")
    with pytest.raises(ValueError, match="board_watts=-5 must be a number >= 0"):
        load_cluster(str(path))
    path.write_text(base + "fp8_tflops = -1\n")
    with pytest.raises(ValueError, match=r"fp8_tflops=-1 must be a number >= 0 \(0: no FP8 units\)"):
        load_cluster(str(path))


def test_calibration_refuses_a_bad_exponent_list_before_fitting(capsys) -> None:
    from moefold.planner import calibration

    with pytest.raises(SystemExit) as exc:
        calibration.main(["--power-exponents", "0,x"])
    assert exc.value.code == 2 and "give numbers separated by commas" in capsys.readouterr().err

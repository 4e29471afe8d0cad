"""How the step-time calibration scales a step's compute: single GEMMs as their shape's roofline times them, the
grouped expert GEMMs by ``Calibration.grouped``, the rest of the blocks' compute by ``Calibration.other``
(``step_terms.Calibration.compute_seconds``), each part tracked from ``compute_time.block_compute`` to the step."""

from __future__ import annotations

import pytest

from moefold.dense.recompute import recomputed_modules
from moefold.models.layer_factory import is_moe_block
from moefold.models.options import ModelOptions
from moefold.models.recipes import mixtral_8x7b, qwen3_moe_30b_a3b
from moefold.parallel.dims import ParallelConfig
from moefold.planner.cluster import load_cluster
from moefold.planner.compute_time import block_compute
from moefold.planner.step_terms import UNCALIBRATED, Calibration
from moefold.planner.step_time import _score_macs, estimate_step_time
from moefold.training.cli.train import validate_layout
from moefold.training.config import RunConfig, TrainConfig

H100 = load_cluster("h100")


def _config(model, ep: int, recompute: str = "none") -> RunConfig:
    options = ModelOptions(dtype="bf16", recompute=recompute,
                           **({"recompute_modules": ("moe_act", "moe")} if recompute == "selective" else {}))
    return RunConfig(model=model, parallel=ParallelConfig(ep=ep), options=options,
                     train=TrainConfig(micro_batch_size=1, global_batch_size=64, seq_length=4096, lr_warmup_iters=0))


def test_compute_seconds_scales_each_part() -> None:
    cal = Calibration(grouped=3.0, other=0.5)
    # 10 s of compute, 6 s of it GEMMs, 4 s of those grouped: 2 single + 3 x 4 grouped + 0.5 x 4 other
    assert cal.compute_seconds(10.0, 6.0, 4.0) == pytest.approx(16.0, rel=1e-12)
    assert UNCALIBRATED.compute_seconds(10.0, 6.0, 4.0) == pytest.approx(10.0, rel=1e-12)
    for name in ("grouped", "other", "communication"):
        with pytest.raises(ValueError, match=f"Calibration.{name}"):
            Calibration(**{name: 0.0})


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_grouped_gemms_are_a_ranks_several_local_experts(recompute: str) -> None:
    """Qwen3-30B-A3B at ep 8 holds 16 experts per rank (grouped); Mixtral-8x7B at ep 8 one (a single GEMM)."""
    for model, grouped in ((qwen3_moe_30b_a3b(), True), (mixtral_8x7b(), False)):
        config = _config(model, 8, recompute)
        sizes = validate_layout(config, 8)
        o = config.options
        chosen = recomputed_modules(o.recompute, o.recompute_modules)
        index = next(i for i in range(model.num_layers) if is_moe_block(model, i))
        cost = block_compute(config, sizes, index, H100, _score_macs(model, 4096, index), chosen)
        for part, gemm, some, whole in zip(("forward", "backward", "recompute"), cost.gemm, cost.grouped,
                                           (cost.forward, cost.backward, cost.recompute)):
            assert 0 <= some <= gemm <= whole, (model.name, part)
            if part != "recompute" or recompute == "selective":
                assert (some > 0) == grouped and gemm > 0, (model.name, part)


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_step_scales_only_what_its_constant_names(recompute: str) -> None:
    """At pp = 1 the compute term is the actions' compute summed: raising ``grouped`` by one adds the grouped GEMMs'
    seconds of every block and micro-batch (forward, backward and what selective recompute runs again; a second unit
    adds as much again), none where a rank holds one expert; ``other`` adds the rest; what neither scales (single
    GEMMs, the optimizer step) stays."""
    for model, grouped in ((qwen3_moe_30b_a3b(), True), (mixtral_8x7b(), False)):
        config = _config(model, 8, recompute)
        sizes = validate_layout(config, 8)
        _, micro = config.resolve(8)
        o = config.options
        chosen = recomputed_modules(o.recompute, o.recompute_modules)
        expected = micro * sum(sum(block_compute(config, sizes, i, H100, _score_macs(model, 4096, i), chosen).grouped)
                               for i in range(model.num_layers))

        def compute(**cal: float) -> float:
            return estimate_step_time(config, sizes, H100, 8, calibration=Calibration(**cal)).terms["compute"]

        plain = compute()
        one, two = compute(grouped=2.0) - plain, compute(grouped=3.0) - compute(grouped=2.0)
        assert one == pytest.approx(two, rel=1e-9) and one == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert (one > 0.05 * plain) == grouped and one >= 0, model.name
        rest = compute(other=2.0) - plain
        assert rest > 0 and one + rest < plain
        both = compute(grouped=2.0, other=2.0) - plain
        assert both == pytest.approx(one + rest, rel=1e-9)

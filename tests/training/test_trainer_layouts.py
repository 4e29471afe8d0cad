"""The same tiny 5-step fp32 run at world 1 and at tp2, ep2, etp2, cp2, dp, tp2 x ep2 and at pipeline layouts
(pp2 x tp2 1F1B, pp2 x ep2 GPipe, pp2 x 2 virtual stages interleaved, pp2 x tp2 with 1 of 3 layers on stage 0),
with the ZeRO-1 optimizer everywhere: same losses and same final weights (expert biases included), to TOL.
All in ONE 4-rank world.

Pipeline specifics (issue 8 item 4), each against world 1 of the same config:
- DeepSeek-V3 tiny (first layer dense, expert bias, seq aux loss, MTP) at pp2 (2 layers, or 3 with
  decoder_first_pipeline_num_layers=1): stage 0 holds only the dense layer, so the expert-bias update and the aux
  losses live on stage 1 alone.
- Qwen3 tiny (global_aux_loss: the load state threaded across the step's micro-batches, per layer) at pp2 x tp2
  (4 micro-batches, both stages MoE; 1F1B and interleaved) and, with a dense first layer, at pp2 x dp2 (stage 0
  without MoE).
  The aux coefficient is raised to 0.1 so that a wrong global state moves the logged aux loss and the weights.
- The metrics line (losses, grad norm, tokens per expert, worst layer's max/mean load, dropped fraction) is the
  same as at world 1: every stage's statistics are reduced across stages.
- A non-finite loss (made on the last stage) skips the optimizer step on every stage.
"""

from __future__ import annotations

import math

import pytest
import torch

from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.metrics import METRICS_FILE, read_metrics
from tests.distributed import run_distributed
from tests.training.trainer_common import run, tiny_config

TOL = 1e-4  # absolute, on losses and on every final weight (fp32)
AUX_RTOL = 1e-4  # the aux losses are small (coefficient 1e-4 for DeepSeek): relative

DEEP = {"model": {"num_layers": 4}, "num_layers_per_virtual_pipeline_stage": 1}   # pp2 x 2 chunks of 1 layer
UNEVEN = {"model": {"num_layers": 3}, "decoder_first_pipeline_num_layers": 1}      # stage 0: the dense layer
QWEN = {"recipe": "qwen3_moe_tiny", "model": {"moe_aux_loss_coeff": 0.1}}          # global_aux_loss
QWEN_DEEP = {**QWEN, **DEEP, "model": {**QWEN["model"], **DEEP["model"]}}
QWEN_DENSE0 = {"recipe": "qwen3_moe_tiny",
               "model": {"moe_aux_loss_coeff": 0.1, "first_k_dense_replace": 1, "ffn_hidden_size": 128}}

RUNS = {  # name -> (layout, tiny_config kwargs); compared with world 1 of the same kwargs minus the pipeline ones
    "tp2.dp2": (ParallelConfig(tp=2), {}),
    "ep2.dp4": (ParallelConfig(ep=2), {}),
    "etp2.dp4": (ParallelConfig(etp=2), {}),
    "cp2.dp2": (ParallelConfig(cp=2), {}),
    "dp4": (ParallelConfig(), {}),
    "tp2xep2.dp2": (ParallelConfig(tp=2, ep=2), {}),
    "pp2xtp2": (ParallelConfig(pp=2, tp=2), {}),
    "pp2xep2.dp2.gpipe": (ParallelConfig(pp=2, ep=2), {"pipeline_schedule": "gpipe"}),
    "pp2.dp2.interleaved": (ParallelConfig(pp=2), DEEP),
    "pp2xtp2.first1": (ParallelConfig(pp=2, tp=2), UNEVEN),
    "qwen3.pp2xtp2": (ParallelConfig(pp=2, tp=2), QWEN),
    "qwen3.pp2xtp2.interleaved": (ParallelConfig(pp=2, tp=2), QWEN_DEEP),
    "qwen3-dense0.pp2.dp2": (ParallelConfig(pp=2), QWEN_DENSE0),
}
# The global aux loss averages the load over the micro-batches seen so far in the step, all dp ranks together:
# dp2 x 1-sample micro-batches matches world 1 with 2-sample micro-batches (the same samples per micro-step).
REFERENCE_OVERRIDES = {"qwen3-dense0.pp2.dp2": {"micro_batch_size": 2}}
PIPELINE_RUNS = [name for name, (pc, _) in RUNS.items() if pc.pp > 1]
NO_MOE_ON_STAGE_0 = ["pp2xtp2", "pp2xep2.dp2.gpipe", "pp2xtp2.first1", "qwen3-dense0.pp2.dp2"]


def _reference_kwargs(name: str) -> dict:
    """tiny_config kwargs of the world-1 run that ``name`` is compared with: its own without the pipeline ones."""
    kwargs = RUNS[name][1]
    pipeline = ("pipeline_schedule", "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers")
    ref = {k: v for k, v in kwargs.items() if k not in pipeline}
    return {**ref, **REFERENCE_OVERRIDES.get(name, {})}


def _reference_key(name: str) -> str:
    return repr(_reference_kwargs(name))


def _world(run_root: str) -> dict:
    out = {}
    for name, (pc, kwargs) in RUNS.items():
        dims = ParallelDims.build(pc)
        run_dir = f"{run_root}/{name}" if pc.pp > 1 else None
        losses, params, trainer = run(tiny_config(pc, **kwargs), dims, run_dir=run_dir)
        out[name] = {"losses": losses, "params": params, "state_bytes": trainer.optimizer.state_bytes(),
                     "overlapped": trainer.overlapped_buckets, "pp_rank": dims.pp_rank,
                     "moe_layers_here": sorted(trainer.routers)}
    # NaN in the loss of micro-batch 0 of step 2 (made on the last stage only): every stage skips that step
    pc = ParallelConfig(pp=2, tp=2)
    nan_at_step_1 = lambda step, micro, loss: loss * float("nan") if step == 1 and micro == 0 else loss
    _, params, trainer = run(tiny_config(pc, steps=2), ParallelDims.build(pc), hook=nan_at_step_1)
    out["nan"] = {"optimizer_steps": trainer.optimizer.step_count, "iteration": trainer.iteration, "params": params}
    _, params, _ = run(tiny_config(pc, steps=1), ParallelDims.build(pc))
    out["one_step"] = params
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[list[dict], str]:
    root = str(tmp_path_factory.mktemp("layouts"))
    return run_distributed(_world, 4, root, timeout=400), root


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    """World-1 runs by reference kwargs: (losses, params, trainer, run_dir with its metrics)."""
    root = tmp_path_factory.mktemp("world1")
    out = {}
    for name in RUNS:
        key = _reference_key(name)
        if key not in out:
            run_dir = str(root / f"ref{len(out)}")
            out[key] = (*run(tiny_config(**_reference_kwargs(name)), run_dir=run_dir), run_dir)
    return out


def _merged_params(ranks: list[dict], name: str) -> dict[str, torch.Tensor]:
    params = {}
    for rank_result in ranks:   # pipeline stages hold different parameters
        params.update(rank_result[name]["params"])
    return params


@pytest.mark.parametrize("name", list(RUNS))
def test_layout_matches_world_1(world, references, name):
    ranks, _ = world
    ref_losses, ref_params, _, _ = references[_reference_key(name)]
    losses = ranks[0][name]["losses"]
    params = _merged_params(ranks, name)
    assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), atol=TOL, rtol=0), (name, losses,
                                                                                             ref_losses)
    assert params.keys() == ref_params.keys()
    worst = 0.0
    for k, v in ref_params.items():
        err = (params[k] - v).abs().max().item()
        worst = max(worst, err)
        assert err <= TOL, f"{name}: {k} differs by {err}"
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    print(f"{name}: max loss diff {loss_diff:.2e}, max weight diff {worst:.2e}")


def test_zero1_state_falls_with_dp_and_buckets_overlap(world, references):
    ranks, _ = world
    full = references[repr({})][2].optimizer.state_bytes()
    dp4 = ranks[0]["dp4"]["state_bytes"]
    print(f"optimizer state bytes per rank: world 1 {full}, dp4 {dp4} ({dp4 / full:.3f} of world 1)")
    assert dp4 <= full / 4 + 4096
    assert ranks[0]["dp4"]["overlapped"] > 0   # some bucket all-reduces started during the backward (overlap)


@pytest.mark.parametrize("name", NO_MOE_ON_STAGE_0)
def test_stage_without_moe_layer_trains_expert_bias_and_aux_loss(world, references, name):
    ranks, _ = world
    stage0 = {tuple(r[name]["moe_layers_here"]) for r in ranks if r[name]["pp_rank"] == 0}
    stage1 = {tuple(r[name]["moe_layers_here"]) for r in ranks if r[name]["pp_rank"] == 1}
    assert stage0 == {()} and stage1 and () not in stage1, (stage0, stage1)
    _, ref_params, ref_trainer, _ = references[_reference_key(name)]
    params = _merged_params(ranks, name)
    biases = [k for k in ref_params if k.endswith("expert_bias")]
    if ref_trainer.config.model.moe_expert_bias:   # the bias update ran on stage 1 with the global loads
        assert biases and all(ref_params[k].abs().sum() > 0 for k in biases), biases
        for k in biases:
            assert (params[k] - ref_params[k]).abs().max().item() <= TOL, k


@pytest.mark.parametrize("name", PIPELINE_RUNS)
def test_pipeline_metrics_line_matches_world_1(world, references, name):
    _, root = world
    ref_run_dir = references[_reference_key(name)][3]
    got, ref = read_metrics(f"{root}/{name}/{METRICS_FILE}"), read_metrics(f"{ref_run_dir}/{METRICS_FILE}")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3, 4, 5]
    for g, r in zip(got, ref):
        for key in ("loss", "loss_lm", "loss_mtp", "grad_norm"):
            if r[key] is None:
                assert g[key] is None, key
            else:
                assert math.isclose(g[key], r[key], abs_tol=TOL, rel_tol=0), (name, r["step"], key, g[key], r[key])
        assert r["loss_aux"] > 0 and math.isclose(g["loss_aux"], r["loss_aux"], rel_tol=AUX_RTOL, abs_tol=0), (
            name, r["step"], g["loss_aux"], r["loss_aux"])
        gm, rm = g["moe"], r["moe"]
        assert gm["layers"] == rm["layers"] and gm["worst_layer"] == rm["worst_layer"], (gm, rm)
        assert gm["tokens_per_expert"] == rm["tokens_per_expert"], (name, r["step"])
        assert gm["max_over_mean"] == pytest.approx(rm["max_over_mean"], rel=1e-6)
        assert gm["dropped_fraction"] == pytest.approx(rm["dropped_fraction"], abs=1e-9)


def test_pipeline_non_finite_loss_skips_the_step_on_every_stage(world):
    ranks, _ = world
    assert all(r["nan"]["optimizer_steps"] == 1 and r["nan"]["iteration"] == 2 for r in ranks)
    skipped = _merged_params(ranks, "nan")
    one_step = {}
    for r in ranks:
        one_step.update(r["one_step"])
    assert skipped.keys() == one_step.keys()
    for k, v in one_step.items():   # the skipped step changed nothing on either stage (weights, expert biases)
        assert torch.equal(skipped[k], v), k

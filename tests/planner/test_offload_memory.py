"""Activation offloading: the device memory it frees, measured through the trainer, against the planner.

For every offload module kind (``dense.activation_offload.OFFLOAD_MODULES``; ``attn_proj`` with ``core_attn``, as
the rule requires) and all of them together, on DeepSeek-V3 tiny widened to hidden 256 (MLA, dense and MoE
layers, shared experts, MTP) and on Qwen3-MoE tiny widened likewise (GQA: its projections and core attention),
fp32 at world 1, one forward + backward through ``Trainer._forward_backward`` under ``TensorMemoryTracker``:

- the tensors resident when the forward ends (what the backward finds; the host copies are counted apart by the
  tracker) drop, against the same run without offloading, by the planner's prediction within 10%
  (``planner.profile``: the saved tensors of the offloaded modules that nothing else keeps);
- the host copies are what the planner counts for host memory (within 10%);
- the peak of the forward + backward (with the one-layer-ahead prefetch) is the planner's within 15%.
"""

from __future__ import annotations

import pytest
import torch

from moefold.dense.activation_offload import OFFLOAD_MODULES
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelDims
from moefold.planner.profile import activation_memory
from moefold.training.config import RunConfig, TrainConfig
from moefold.training.observe.expert_counts import ROUTER_SUMS
from moefold.training.observe.memory import TensorMemoryTracker
from moefold.training.trainer import Trainer

DROP_RTOL, HOST_RTOL, PEAK_RTOL = 0.10, 0.10, 0.15
SETTINGS = {m: (m,) for m in OFFLOAD_MODULES if m != "attn_proj"}
SETTINGS.update({"core_attn+attn_proj": ("core_attn", "attn_proj"), "all": OFFLOAD_MODULES})
CASES = [("deepseek_v3_tiny", s) for s in SETTINGS] + [("qwen3_moe_tiny", s) for s in
                                                        ("qkv_linear", "core_attn", "core_attn+attn_proj", "all")]


def _config(recipe: str, modules: tuple[str, ...]) -> RunConfig:
    model = get_recipe(recipe).with_(hidden_size=256, num_layers=3)
    train = TrainConfig(micro_batch_size=1, global_batch_size=1, seq_length=256, train_iters=1, lr_warmup_iters=0)
    options = ModelOptions(offload_modules=modules, min_offloaded_tensor_size=0)
    return RunConfig(model=model, options=options, train=train, recipe=recipe)


def _measure(config: RunConfig) -> dict[str, int]:
    """After the forward: resident and host bytes; the peak of forward + backward (``TensorMemoryTracker``)."""
    torch.manual_seed(0)
    trainer = Trainer(config, ParallelDims.single(), log=lambda _m: None)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.model.vocab_size, (1, config.train.seq_length + 1), generator=gen)]
    loads = torch.zeros(len(trainer.moe_layers), config.model.num_experts + 1 + ROUTER_SUMS, dtype=torch.float64)
    logged = torch.zeros(4, dtype=torch.float64)
    out: dict[str, int] = {}
    with TensorMemoryTracker() as tracker:
        def after_forward(_step, _micro, loss):
            out.update(resident=tracker.current, host=tracker.offloaded)
            return loss
        trainer.loss_hook = after_forward
        trainer.sync.start_step(1)
        trainer._forward_backward(batches, loads, logged)
    out["peak"] = tracker.peak
    return out


def _predict(config: RunConfig) -> dict[str, int]:
    sizes, num_micro = config.resolve(1)
    a = activation_memory(config, sizes, 0, num_micro, device_type="cpu")
    return {"resident": a.per_microbatch[0], "host": a.host, "peak": a.peak}


@pytest.fixture(scope="module")
def baselines() -> dict[str, tuple[dict, dict]]:
    return {r: (_measure(_config(r, ())), _predict(_config(r, ()))) for r in ("deepseek_v3_tiny", "qwen3_moe_tiny")}


@pytest.mark.parametrize(("recipe", "setting"), CASES)
def test_resident_drop_matches_the_planner(recipe: str, setting: str, baselines) -> None:
    config = _config(recipe, SETTINGS[setting])
    measured, predicted = _measure(config), _predict(config)
    base_measured, base_predicted = baselines[recipe]
    drop = base_measured["resident"] - measured["resident"]
    planned = base_predicted["resident"] - predicted["resident"]
    assert drop > 0 and planned > 0, (drop, planned)
    assert planned == pytest.approx(drop, rel=DROP_RTOL), f"planned {planned / drop - 1:+.1%} of the measured drop"
    assert predicted["host"] == pytest.approx(measured["host"], rel=HOST_RTOL)
    assert predicted["peak"] == pytest.approx(measured["peak"], rel=PEAK_RTOL)
    print(f"{recipe} {setting}: resident drop {drop / 2**20:.2f} MiB measured, {planned / 2**20:.2f} planned; "
          f"host {measured['host'] / 2**20:.2f} / {predicted['host'] / 2**20:.2f}; peak "
          f"{measured['peak'] / 2**20:.2f} / {predicted['peak'] / 2**20:.2f} MiB")


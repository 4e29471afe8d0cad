"""The planner's memory model against the real trainer.

Static part: ``training.plan.static.exact_static`` (the model, gradient buffers and optimizer built on the meta
device on torch's fake process group) must equal, byte for byte and component by component (parameters, main
grads, fp32 master, exp_avg, exp_avg_sq), what ``training.memory.static_bytes`` counts from the tensors of real
``Trainer`` objects built in ONE 4-rank gloo world, on every rank, in 12 layouts mixing tp, ep, etp, pp, vpp,
dp, cp and the precision options; ``static_lower_bound`` (the search's first filter) must never exceed it.
"""

from __future__ import annotations

import dataclasses

import pytest

from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.memory import static_bytes
from moefold.training.plan.static import exact_static, static_lower_bound
from moefold.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.training.trainer_common import tiny_config

WORLD = 4
COMPONENTS = ("params", "grads", "master", "exp_avg", "exp_avg_sq")
BF16 = {"bf16": True}
LOW = {"bf16": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16", "main_grads_dtype": "bf16"}
DEEP = {"model": {"num_layers": 4}, "num_layers_per_virtual_pipeline_stage": 1}
QWEN = {"recipe": "qwen3_moe_tiny"}
MIXTRAL = {"recipe": "mixtral_tiny"}

LAYOUTS = {  # name -> (layout, tiny_config kwargs); small buckets so that padding and bucket cuts matter
    "tp2.dp2": (ParallelConfig(tp=2), {}),
    "ep2.dp4.bf16": (ParallelConfig(ep=2), BF16),
    "etp2.dp4.low-precision": (ParallelConfig(etp=2), LOW),
    "cp2.dp2": (ParallelConfig(cp=2), {}),
    "tp2xcp2.qwen3.bf16": (ParallelConfig(tp=2, cp=2), {**QWEN, **BF16}),
    "tp2xep2.dp2": (ParallelConfig(tp=2, ep=2), {}),
    "ep4xetp1.mixtral.bf16": (ParallelConfig(ep=4), {**MIXTRAL, **BF16}),
    "ep2xetp2.qwen3": (ParallelConfig(ep=2, etp=2), QWEN),
    "pp2xtp2": (ParallelConfig(pp=2, tp=2), {}),
    "pp2xep2.dp2.gpipe.bf16": (ParallelConfig(pp=2, ep=2), {"pipeline_schedule": "gpipe", **BF16}),
    "pp2.dp2.vpp2": (ParallelConfig(pp=2), DEEP),
    "pp2xcp2.first1.low-precision": (ParallelConfig(pp=2, cp=2), {"model": {"num_layers": 3},
                                                                  "decoder_first_pipeline_num_layers": 1, **LOW}),
}


def config_of(name: str):
    pc, kwargs = LAYOUTS[name]
    kwargs = dict(kwargs)
    recipe = kwargs.pop("recipe", "deepseek_v3_tiny")
    return tiny_config(pc, steps=1, recipe=recipe, bucket_numel=2048, **kwargs)


def _trainer_bytes() -> dict[str, tuple[int, dict[str, int]]]:
    """On each rank: {layout: (pipeline rank, static_bytes of a real Trainer)}."""
    out = {}
    for name in LAYOUTS:
        config = config_of(name)
        dims = ParallelDims.build(config.parallel)
        trainer = Trainer(config, dims, log=lambda _m: None)
        out[name] = (dims.pp_rank, static_bytes(trainer.sync, trainer.optimizer))
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict[str, tuple[int, dict[str, int]]]]:
    return run_distributed(_trainer_bytes, WORLD, timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_static_bytes_equal_the_trainers_tensors(name: str, measured) -> None:
    config = config_of(name)
    sizes, _ = config.resolve(WORLD)
    planned = exact_static(config, sizes)
    lower = static_lower_bound(config, sizes)
    assert sorted(planned) == list(range(sizes.pp))
    for rank, per_rank in enumerate(measured):
        pp_rank, counted = per_rank[name]
        plan = dataclasses.asdict(planned[pp_rank])
        assert {k: plan[k] for k in COMPONENTS} == {k: counted[k] for k in COMPONENTS}, f"rank {rank}"
        bound = lower[pp_rank]
        assert bound.total <= planned[pp_rank].total
        assert bound.params <= planned[pp_rank].params


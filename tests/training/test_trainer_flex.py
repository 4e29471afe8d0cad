"""Training with the flex dispatcher on DeepEP V2 (the CPU stand-in of ``ElasticBuffer``): the whole path.

Two ranks (ep2), DeepSeek-V3-tiny in bf16 (MLA, shared experts, MTP: MoE layers in the decoder and the MTP block),
two optimizer steps: the losses equal the alltoall dispatcher's (bf16 tolerance; the alltoall run is the
reference the layout tests tie to world 1), every MoE layer shares one DeepEP buffer, sized for the run's
micro-batch (``model_options`` fills ``num_max_tokens_per_rank``), destroyed when the rank's run ends
(``training.launch.ranks.run_rank``), and DeepEP's received counts reach the step results and the metrics file.
"""

from __future__ import annotations

import dataclasses
import sys

from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.observe.metrics import METRICS_FILE, read_metrics
from tests.dispatch import deepep_elastic_standin
from tests.distributed import run_distributed
from tests.training.trainer_common import run, tiny_config


def _train(dispatcher: str, run_dir: str) -> tuple[list[float], list[str]]:
    import torch

    from moefold.training.launch.ranks import run_rank

    standin = deepep_elastic_standin.module()
    sys.modules["deep_ep"] = standin
    config = tiny_config(ParallelConfig(ep=2), steps=2, bf16=True)
    config = dataclasses.replace(config, options=dataclasses.replace(config.options, dispatcher=dispatcher))
    dims = ParallelDims.build(config.parallel)
    out: dict = {}
    problems: list[str] = []

    def fn(_device, heartbeat=None):
        out["losses"] = run(config, dims, run_dir=run_dir if dispatcher == "flex" else None)[0]

    run_rank(fn, torch.device("cpu"), (), None)   # as a launched rank: its DeepEP buffers destroyed at the end
    if dispatcher != "flex":
        return out["losses"], problems
    made = standin.ElasticBuffer.instances
    if len(made) != 1 or not made[0].destroyed:
        problems.append(f"{len(made)} DeepEP buffers for every MoE layer (MTP included), destroyed "
                        f"{[b.destroyed for b in made]}: expected one, destroyed at the run's end")
    if made and made[0].num_max_tokens_per_rank != config.train.micro_batch_size * config.train.seq_length:
        problems.append(f"buffer sized for {made[0].num_max_tokens_per_rank} tokens per rank")
    return out["losses"], problems


def test_training_on_deepep_v2_equals_alltoall(tmp_path):
    flex = run_distributed(_train, 2, "flex", str(tmp_path), timeout=400)
    ref = run_distributed(_train, 2, "alltoall", str(tmp_path / "ref"), timeout=400)
    problems = [p for _, per_rank in flex for p in per_rank]
    assert not problems, problems
    for (got, _), (want, _) in zip(flex, ref):
        assert len(got) == len(want) == 2
        assert all(abs(a - b) <= 2e-2 * max(1.0, abs(b)) for a, b in zip(got, want)), (got, want)
    records = read_metrics(tmp_path / METRICS_FILE)
    moe = records[-1]["moe"]
    assert len(moe["received_per_expert"]) == len(moe["layers"]) and moe["received_max_over_mean"][0] >= 1.0
    # dropless: each expert received every copy routed to it, so the counts equal the router's
    assert moe["received_per_expert"] == moe["tokens_per_expert"], moe

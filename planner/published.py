"""The step-time model against published training runs: each run's layout, what it measured, and the estimate.

    python -m moefold.planner.published       # the README's table (markdown)

Each ``PublishedRun`` is a run someone measured and published, in moefold's terms: the recipe, the cluster
preset, the layout, the batch, FP8 and the dispatcher, and what moefold has no equivalent of, stated as the
estimator's two knobs (``estimate_step_time``'s ``exchange_overlap`` and ``compute_share``). Where the publication
does not give a setting the run's ``assumptions`` say what was taken. ``tests/planner/test_published.py``
keeps every estimate within ``TOLERANCE`` of its measurement.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig
from moefold.planner.cluster import load_cluster
from moefold.planner.step_time import StepTime, estimate_step_time
from moefold.precision.fp8 import FP8Config
from moefold.training.cli.train import validate_layout
from moefold.training.config import RunConfig, TrainConfig

TOLERANCE = 0.25
# DeepSeek's FP8 GEMMs scale 1x128 tiles and 128x128 blocks: torchao's rowwise recipe is moefold's nearest
FINE_GRAINED_FP8 = FP8Config(format="e4m3", backend="torchao", recipe="rowwise")


@dataclass(frozen=True)
class PublishedRun:
    """A measured run: ``measured`` in ``metric`` ("tokens/s/GPU" or "MFU"), and how to plan it."""

    name: str
    source: str
    metric: str
    measured: float
    recipe: str
    cluster: str
    gpus: int
    parallel: ParallelConfig
    train: dict
    options: dict
    assumptions: str
    exchange_overlap: float = 0.0
    compute_share: float = 1.0
    gpus_per_node: int = 8

    def config(self) -> RunConfig:
        return RunConfig(model=get_recipe(self.recipe), parallel=self.parallel,
                         options=ModelOptions(dtype="bf16", **self.options),
                         train=TrainConfig(bf16=True, lr_warmup_iters=0, **self.train), recipe=self.recipe)

    def step_time(self) -> StepTime:
        config = self.config()
        return estimate_step_time(config, validate_layout(config, self.gpus), load_cluster(self.cluster),
                                  self.gpus_per_node, exchange_overlap=self.exchange_overlap,
                                  compute_share=self.compute_share)

    def estimate(self) -> float:
        """The model's figure in this run's ``metric``."""
        st = self.step_time()
        return st.mfu(load_cluster(self.cluster)) if self.metric == "MFU" else st.tokens_per_s_per_gpu


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        name="DeepSeek-V3, 2048 H800, FP8, DualPipe, PP16 x EP64",
        source="DeepSeek-V3 technical report (arXiv 2412.19437): 180K H800 GPU-hours per trillion tokens = 1,543 "
               "tokens/s/GPU; PP16, EP64 over 8 nodes, ZeRO-1 DP, no TP, seq 4096, batch 15360 after the ramp",
        metric="tokens/s/GPU", measured=1e12 / (180e3 * 3600), recipe="deepseek_v3", cluster="h800", gpus=2048,
        parallel=ParallelConfig(tp=1, cp=1, pp=16, ep=64, etp=1),
        train={"micro_batch_size": 1, "global_batch_size": 15360, "seq_length": 4096,
               "decoder_first_pipeline_num_layers": 3, "decoder_last_pipeline_num_layers": 2},
        options={"fp8": FINE_GRAINED_FP8, "dispatcher": "alltoall", "recompute": "selective",
                 "recompute_modules": ("mla_up_proj", "layernorm")},
        exchange_overlap=1.0, compute_share=112 / 132,
        assumptions="DualPipe hides the expert all-to-all (exchange_overlap 1) on 20 of the H800's 132 SMs, so the "
                    "compute kernels get 112 (compute_share 0.85), both from the report; its bubble is modelled as "
                    "1F1B's (DualPipe's is smaller); FP8 GEMMs at DeepGEMM's fitted rate, attention in bf16; "
                    "recompute of RMSNorm and MLA up-projections as the report says; 61 layers split 3 + 14 x 4 + 2 "
                    "(the report gives no split); micro-batch 1"),
    PublishedRun(
        name="Qwen3-30B-A3B, 16 H100, FP8, EP16",
        source="Megatron-Bridge performance summary, qwen3_30b_a3b_pretrain_16gpu_h100_fp8cs_config: 8,960 "
               "tokens/s/GPU; TP1 PP1 EP16, global batch 1024, micro-batch 1, seq 4096, no recompute, flex "
               "dispatcher (HybridEP), moe_a2a_overlap off",
        metric="tokens/s/GPU", measured=8960.0, recipe="qwen3_moe_30b_a3b", cluster="h100", gpus=16,
        parallel=ParallelConfig(tp=1, cp=1, pp=1, ep=16, etp=1),
        train={"micro_batch_size": 1, "global_batch_size": 1024, "seq_length": 4096},
        options={"fp8": FP8Config(format="e4m3", backend="torchao", recipe="tensorwise"), "dispatcher": "alltoall",
                 "recompute": "none"},
        assumptions="FP8 current scaling as torchao tensorwise; the exchange as moefold's bf16 all-to-all "
                    "(HybridEP's own kernels not modelled), not overlapped, as the recipe sets; 2 nodes of 8"),
    PublishedRun(
        name="Mixtral-8x22B, 128 H100, bf16, MoE parallel folding",
        source="MoE Parallel Folding (arXiv 2504.14960): 49.3% MFU for Mixtral 8x22B on H100",
        metric="MFU", measured=0.493, recipe="mixtral_8x22b", cluster="h100", gpus=128,
        parallel=ParallelConfig(tp=2, cp=1, pp=8, ep=8, etp=1),
        train={"micro_batch_size": 1, "global_batch_size": 256, "seq_length": 4096},
        options={"dispatcher": "alltoall", "recompute": "none"},
        assumptions="the abstract gives the MFU, not the layout: taken as 128 GPUs, attention TP2 x PP8, experts "
                    "folded to EP8 x ETP1 in the same PP8, seq 4096, global batch 256, micro-batch 1, bf16, no "
                    "recompute; MFU with moefold's FLOP count (causal attention)"),
)


def validation_rows() -> list[tuple[PublishedRun, float]]:
    """(run, the model's estimate) for every published run."""
    return [(run, run.estimate()) for run in PUBLISHED_RUNS]


def _fmt(metric: str, value: float) -> str:
    return f"{100 * value:.1f}%" if metric == "MFU" else f"{value:,.0f}"


def render_table(rows: list[tuple[PublishedRun, float]]) -> str:
    """The README's markdown table: run, metric, published, estimate, error, and the assumptions below it."""
    lines = ["| run | metric | published | `moefold plan` | error |", "|---|---|---|---|---|"]
    for run, est in rows:
        lines.append(f"| {run.name} | {run.metric} | {_fmt(run.metric, run.measured)} | {_fmt(run.metric, est)} | "
                     f"{100 * (est / run.measured - 1):+.0f}% |")
    lines.append("")
    for i, (run, _) in enumerate(rows, 1):
        lines.append(f"{i}. {run.name}: {run.source}. Assumed: {run.assumptions}.")
    return "\n".join(lines)


def main() -> int:
    print(render_table(validation_rows()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

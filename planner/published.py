"""The step-time model against published training runs: each run's layout, what it measured, and the estimate.

    python -m moefold.planner.published       # the README's table (markdown)

Each ``PublishedRun`` is a run someone measured and published, in moefold's terms: the recipe, the cluster
preset, the layout, the batch, FP8 and the dispatcher, and what moefold has no equivalent of, stated as the
estimator's two knobs (``estimate_step_time``'s ``exchange_overlap`` and ``compute_share``). ``system``,
``precision`` and ``layout`` are the source's own words and figures; where the publication does not give a setting
the run's ``assumptions`` say what was taken.

The step-time model's end-to-end constants (``step_terms.CALIBRATION``) are fitted on the rows marked ``fitted``
(at most half: ``planner.calibration``); the other rows are held out. ``tests/planner/test_published.py`` keeps every
held-out estimate within ``HELD_OUT_BOUND`` of its measurement and checks the constants are the fit's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig
from moefold.pipeline.layout import format_layout, standard_layouts
from moefold.planner.cluster import Cluster, load_cluster
from moefold.planner.search import RankMemory, evaluate, stage_memory
from moefold.planner.step_terms import CALIBRATION, Calibration, StepTime
from moefold.planner.step_time import estimate_step_time
from moefold.precision.fp8 import FP8Config
from moefold.training.cli.train import validate_layout
from moefold.training.config import RunConfig, TrainConfig

# every held-out row's estimate is within this share of its published figure (tests/planner/test_published.py): issue
# 46's goal; the worst held-out row (DeepSeek-V3 on 2,048 H800, -14.98%) sits at it (docs/planner.md says why)
HELD_OUT_BOUND = 0.15
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
    fitted: bool = False      # one of the rows ``calibration.fit`` fits the step-time model's constants on
    system: str = ""          # the hardware as the source names it
    precision: str = ""       # the precision as the source names it
    layout: str = ""          # the layout as the source states it

    def config(self) -> RunConfig:
        """The run in moefold's terms; ``train["num_virtual_stages"]``: that many virtual stages per pipeline rank,
        split as ``pipeline.layout``'s even (else balanced) standard layout."""
        model = get_recipe(self.recipe)
        train = dict(self.train)
        vpp = train.pop("num_virtual_stages", None)
        placed = {"pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers"} & set(train)
        if vpp is not None or (self.parallel.pp > 1 and model.num_layers % self.parallel.pp and not placed):
            layouts = standard_layouts(model.num_layers, self.parallel.pp, vpp or 1, model.mtp_num_layers)
            train["pipeline_model_parallel_layout"] = format_layout(layouts.get("even", layouts["balanced"]))
        return RunConfig(model=model, parallel=self.parallel, options=ModelOptions(dtype="bf16", **self.options),
                         train=TrainConfig(bf16=True, lr_warmup_iters=0, **train), recipe=self.recipe)

    def step_time(self, calibration: Calibration | None = None, cluster: Cluster | None = None) -> StepTime:
        """The model's step (``calibration``: default ``step_terms.CALIBRATION``; ``cluster``: default the run's
        preset)."""
        config = self.config()
        return estimate_step_time(config, validate_layout(config, self.gpus), cluster or load_cluster(self.cluster),
                                  self.gpus_per_node, exchange_overlap=self.exchange_overlap,
                                  compute_share=self.compute_share, calibration=calibration)

    def cluster_peak_flops(self) -> float:
        """The dense bf16 peak (FLOP/s) the run's MFU is a share of."""
        return load_cluster(self.cluster).bf16_tflops * 1e12

    def memory(self) -> RankMemory:
        """The planner's memory per GPU of the run's fullest pipeline stage, from the search's formulas
        (``search.stage_memory(exact=False)``: static bytes per layer kind, activations held as the schedule's
        warm-up counts say; ``tests/planner/test_formula.py`` bounds them by the meta build), under ZeRO-1 as the
        run's recipe shards. (Not the meta build: moefold refuses row 7's MXFP8 with --delay-wgrad-compute.)"""
        plan = evaluate(self.config(), self.gpus, load_cluster(self.cluster), self.gpus_per_node, with_time=False)
        return max(stage_memory(plan, exact=False), key=lambda m: m.total)

    def gpu_memory(self) -> int:
        """Bytes of memory of one of the run's GPUs."""
        return load_cluster(self.cluster).memory_bytes

    def estimate(self, calibration: Calibration | None = None) -> float:
        """The model's figure in this run's ``metric``."""
        st = self.step_time(calibration)
        return st.mfu(load_cluster(self.cluster)) if self.metric == "MFU" else st.tokens_per_s_per_gpu


_MB = "Megatron-Bridge performance summary (NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md)"
_MB_NOTE = ("experts force-balanced, dropless; layout, batch and figure as the table prints them; recompute, "
            "dispatcher and overlap from the release's recipe file where it says (src/megatron/bridge/perf_recipes/)")
FP8_CS = FP8Config(format="e4m3", backend="torchao", recipe="tensorwise")   # Megatron's FP8 current scaling
MXFP8 = FP8Config(format="e4m3", backend="torchao", recipe="mxfp8")   # MXFP8 block scaling
NO_RECOMPUTE = {"recompute": "none"}
# CUDA graphs of a preset: Transformer Engine's per-layer capture of these scopes (cuda_graph_impl, cuda_graph_scope);
# moefold captures them only without gradient-accumulation fusion (which the step model does not time)
_GRAPHS = {"cuda_graph_impl": "transformer_engine", "gradient_accumulation_fusion": False}
GRAPHS_ATTN_ROUTER = {**_GRAPHS, "cuda_graph_modules": ("attn", "moe_router", "moe_preprocess")}
GRAPHS_ROUTER = {**_GRAPHS, "cuda_graph_modules": ("moe_router", "moe_preprocess")}
# Megatron-Bridge's DDP settings in every recipe of these families: gradients reduced in bf16
# (``grad_reduce_in_fp32 = False`` in scripts/performance/configs/{deepseek,qwen,gpt_oss}/*_llm_pretrain.py) and
# the distributed optimizer's parameter all-gather overlapped with the forward (``ddp.overlap_param_gather = True``
# in src/megatron/bridge/recipes/{deepseek,qwen,gpt_oss}/*.py), both at release v0.4.1 (26.04 containers)
BRIDGE_DDP = {"main_grads_dtype": "bf16", "overlap_param_gather": True}
# the workload presets of Megatron-Bridge v0.4.1 (the 26.04 containers), where a row's settings are read from
_V041 = "Megatron-Bridge v0.4.1 scripts/performance/configs/"
# GPT-OSS-120B's presets recompute the norms and the expert activation on every GPU (recompute_modules)
GPT_OSS_RECOMPUTE = {"recompute": "selective", "recompute_modules": ("layernorm", "moe_act")}
# HybridEP in eager bf16 (no CUDA graph of the MoE preprocess): a dropless dispatch whose received row count is not
# fixed ahead waits for it on the host and allocates what arrived, not DeepEP's sync-free worst case (every rank's
# tokens, planner.deepep.v2_receive_rows); the FP8 rows sync already (their GEMMs read the counts on the host)
HYBRIDEP_EAGER = {"dispatcher": "flex", "moe_deepep_cpu_sync": True}
# the 25.09 container's performance script (Megatron-Bridge v0.1.0rc4, 2025-10-23), where the DeepSeek-V3 H100 row's
# dispatcher and overlap are set
_V010_RUN = "Megatron-Bridge v0.1.0rc4 scripts/performance/run_script.py"
# the MoE parallel-folding paper's authors' benchmark configurations (yanring/Megatron-MoE-ModelZoo,
# runtime_configs/benchmarking/runtime.conf, BENCHMARKING_MODEL_CONFIGS)
_ZOO = "Megatron-MoE-ModelZoo runtime_configs/benchmarking/runtime.conf"
# DeepSeek-V3's 61 layers over 16 virtual stages, as Megatron-Bridge's Blackwell recipes split them
DSV3_16 = "Et*4|(tttt|)*14tmL"


def _mb(release: str, system: str, model: str, precision: str, measured: float, recipe: str, cluster: str,
        gpus: int, gbs: int, mbs: int, tp: int, pp: int, vp: str, ep: int, options: dict, assumptions: str,
        train: dict | None = None, gpus_per_node: int = 8, fitted: bool = False) -> PublishedRun:
    """A row of Megatron-Bridge's performance summary (its columns: #-GPUs, precision, GBS, MBS, sequence 4096,
    TP, PP, CP 1, VP, EP; tokens/s/GPU)."""
    layout = f"TP{tp} PP{pp} VP {vp} CP1 EP{ep} MBS{mbs} GBS{gbs} seq 4096"
    return PublishedRun(
        name=f"{model}, {gpus} {system}, {precision}, {layout.split(' MBS')[0].replace(' CP1', '')}, MBS{mbs}",
        source=f"{_MB}, {release} container, {system} row: {model}, {gpus} GPUs, {precision}, {layout}: "
               f"{measured:,.0f} tokens/s/GPU",
        metric="tokens/s/GPU", measured=measured, recipe=recipe, cluster=cluster, gpus=gpus,
        parallel=ParallelConfig(tp=tp, cp=1, pp=pp, ep=ep, etp=1),
        train={"micro_batch_size": mbs, "global_batch_size": gbs, "seq_length": 4096, **BRIDGE_DDP, **(train or {})},
        options=options, assumptions=f"{_MB_NOTE}; {assumptions}", gpus_per_node=gpus_per_node, fitted=fitted,
        system=system, precision=precision, layout=layout)


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    # ------------------------------------------------------------------ H100 (and H800)
    _mb("25.09", "DGX-H100", "DeepSeek-V3", "FP8", 1297, "deepseek_v3", "h100", 1024, 8192, 1, 2, 8, "4", 64,
        {"fp8": FP8_CS, "dispatcher": "flex", "recompute": "selective", "recompute_modules": ("mla_up_proj", "mlp")},
        "FP8 current scaling (the table's 330 TFLOP/s in parentheses is the 128x128 / 1x128 blockwise run); layout "
        "Et|(tt|)*30mL, recompute of MLA up-projections and MLP, DeepEP flex dispatcher with the batch-level overlap "
        f"and delayed weight gradients, as the release that measured it ran: {_V010_RUN} (h100: enable_deepep, "
        "A2A_1F1B sets overlap_moe_expert_parallel_comm and delay_wgrad_compute; the same in v0.2.0's "
        "DEEPSEEK_V3_H100_BASE_CONFIG, moe_a2a_overlap=True, and the Megatron-MoE-ModelZoo's H100 guide, "
        "best_practice/DeepSeekV3/readme.md: 'Enable EP A2A overlapping')",
        train={"pipeline_model_parallel_layout": "Et|(tt|)*30mL", "overlap_moe_expert_parallel_comm": True,
               "delay_wgrad_compute": True}),
    _mb("26.04.01", "DGX-H100", "Qwen3-235B-A22B", "FP8", 1712, "qwen3_moe_235b_a22b", "h100", 256, 8192, 1, 2, 8,
        "4", 32, {"fp8": FP8_CS, "dispatcher": "alltoall", **NO_RECOMPUTE},
        "FP8 current scaling, all-to-all dispatcher with the batch-level overlap (moe_a2a_overlap) and delayed "
        "weight gradients, no recompute (qwen3_235b_a22b_pretrain_256gpu_h100_fp8cs_config); 94 layers over 32 "
        "virtual stages as moefold's even split places them",
        train={"num_virtual_stages": 4, "overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True},
        fitted=True),
    _mb("26.04.01", "DGX-H100", "Qwen3-30B-A3B", "FP8", 8960, "qwen3_moe_30b_a3b", "h100", 16, 1024, 1, 1, 1, "n/a",
        16, {"fp8": FP8_CS, "dispatcher": "flex", **NO_RECOMPUTE},
        "FP8 current scaling, HybridEP flex dispatcher, no overlap, no recompute "
        "(qwen3_30b_a3b_pretrain_16gpu_h100_fp8cs_config); 2 nodes of 8", fitted=True),
    _mb("26.02.01", "DGX-H100", "Qwen3-30B-A3B", "FP8", 9058, "qwen3_moe_30b_a3b", "h100", 16, 1024, 1, 1, 2, "12",
        8, {"fp8": FP8_CS, "dispatcher": "flex", **NO_RECOMPUTE},
        "FP8 current scaling, HybridEP flex dispatcher, no overlap, no recompute; 48 layers over 24 virtual stages",
        train={"num_virtual_stages": 12}),
    _mb("26.04.01", "DGX-H100", "GPT-OSS-120B", "BF16", 5824, "gpt_oss_120b", "h100", 64, 1280, 1, 1, 4, "n/a", 8,
        {"dispatcher": "alltoall", **GPT_OSS_RECOMPUTE},
        f"all-to-all dispatcher, recompute of the norms and the expert activation, no overlap ({_V041}gpt_oss/"
        f"gpt_oss_workload_base_configs.py GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V2); 36 layers 9 per stage",
        fitted=True),
    _mb("25.11", "DGX-H100", "GPT-OSS-120B", "BF16", 5630, "gpt_oss_120b", "h100", 64, 512, 4, 1, 4, "1", 8,
        {"dispatcher": "alltoall", **GPT_OSS_RECOMPUTE},
        f"all-to-all dispatcher, recompute of the norms and the expert activation, no overlap ({_V041}gpt_oss/"
        f"gpt_oss_workload_base_configs.py GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V1); 36 layers 9 per stage; "
        "micro-batch 1, not the table's 4: the table's own GA column (2) contradicts MBS 4 at DP 16 "
        "(4 x 16 x 2 = 128, not GBS 512; it is the B200 row's MBS 4 and GA 2 at DP 64), and the recipe the "
        "25.11 release ran sets none for H100, so BASE_GPT_OSS_120B_CONFIG's micro_batch_size=1 holds "
        "(scripts/performance/configs/gpt_oss/workload_base_configs.py at Megatron-Bridge cb62f8620, "
        "2025-11-21: GB300/GB200/B200 set micro_batch_size=4, H100 only pipeline_model_parallel_size=4)",
        train={"micro_batch_size": 1}),
    # ------------------------------------------------------------------ B200
    _mb("26.04.01", "DGX-B200", "DeepSeek-V3", "MXFP8", 3328, "deepseek_v3", "b200", 256, 4096, 1, 1, 8, "2", 32,
        {"fp8": MXFP8, "dispatcher": "flex", "recompute": "selective", "recompute_modules": ("mla_up_proj", "mlp")},
        "MXFP8, DeepEP flex dispatcher with the batch-level overlap, recompute of MLA up-projections and MLP "
        f"(deepseek_v3_pretrain_256gpu_b200_fp8mx_config); layout {DSV3_16} assumed (the recipe's default map); "
        "planned without the recipe's delayed weight gradients: moefold's block-scaled (MXFP8) linears cannot defer "
        "theirs (execution.split_backward refuses them), so `moefold train` would refuse --delay-wgrad-compute here",
        train={"pipeline_model_parallel_layout": DSV3_16, "overlap_moe_expert_parallel_comm": True}, fitted=True),
    _mb("26.04.01", "DGX-B200", "Qwen3-30B-A3B", "MXFP8", 27136, "qwen3_moe_30b_a3b", "b200", 8, 512, 4, 1, 1, "n/a",
        8, {"fp8": MXFP8, "dispatcher": "flex", **NO_RECOMPUTE},
        f"MXFP8, HybridEP flex dispatcher, no recompute, no overlap, CUDA graphs of attention, router and "
        f"preprocess ({_V041}qwen/qwen3_workload_base_configs.py QWEN3_30B_A3B_PRETRAIN_CONFIG_B200_FP8_MX_V1)",
        train=GRAPHS_ATTN_ROUTER),
    _mb("26.04.01", "DGX-B200", "Qwen3-235B-A22B", "MXFP8", 3776, "qwen3_moe_235b_a22b", "b200", 256, 8192, 1, 1, 8,
        "n/a", 8, {"fp8": MXFP8, "dispatcher": "alltoall", **NO_RECOMPUTE},
        "MXFP8, all-to-all dispatcher, no recompute, no overlap (qwen3_235b_a22b b200 fp8mx recipe); 94 layers "
        "over 8 stages as moefold's even split places them"),
    _mb("26.04.01", "DGX-B200", "GPT-OSS-120B", "BF16", 13568, "gpt_oss_120b", "b200", 64, 1280, 4, 1, 1, "n/a", 8,
        {**HYBRIDEP_EAGER, **GPT_OSS_RECOMPUTE},
        f"HybridEP flex dispatcher, recompute of the norms and the expert activation, no overlap ({_V041}gpt_oss/"
        f"gpt_oss_workload_base_configs.py GPT_OSS_120B_PRETRAIN_CONFIG_B200_BF16_V2)", fitted=True),
    # ------------------------------------------------------------------ GB200 / GB300 (NVL72)
    _mb("26.04.01", "DGX-GB200", "DeepSeek-V3", "MXFP8", 4256, "deepseek_v3", "gb200", 256, 4096, 1, 1, 4, "4", 64,
        {"fp8": MXFP8, "dispatcher": "flex", "recompute": "selective", "recompute_modules": ("mlp",)},
        "MXFP8, HybridEP flex dispatcher over the NVLink domain, recompute of the MLP, CUDA graphs of attention, "
        f"router and preprocess ({_V041}deepseek/deepseek_workload_base_configs.py "
        f"DEEPSEEK_V3_PRETRAIN_CONFIG_GB200_V1); layout {DSV3_16}; NVLink domains of 64 GPUs",
        train={"pipeline_model_parallel_layout": DSV3_16, **GRAPHS_ATTN_ROUTER}, gpus_per_node=64),
    _mb("26.04.01", "DGX-GB200", "Qwen3-235B-A22B", "MXFP8", 5680, "qwen3_moe_235b_a22b", "gb200", 256, 8192, 1, 1,
        8, "3", 32, {"fp8": MXFP8, "dispatcher": "flex", **NO_RECOMPUTE},
        f"MXFP8, HybridEP flex dispatcher, no recompute, no overlap, CUDA graphs of attention, router and preprocess "
        f"({_V041}qwen/qwen3_workload_base_configs.py QWEN3_235B_A22B_PRETRAIN_CONFIG_GB200_FP8_MX_V2); 94 layers "
        "over 24 virtual stages as moefold's "
        "even split places them; NVLink domains of 64 GPUs",
        train={"num_virtual_stages": 3, **GRAPHS_ATTN_ROUTER}, gpus_per_node=64, fitted=True),
    _mb("26.04.01", "DGX-GB200", "GPT-OSS-120B", "BF16", 16640, "gpt_oss_120b", "gb200", 64, 1280, 4, 1, 1, "n/a",
        64, {**HYBRIDEP_EAGER, **GPT_OSS_RECOMPUTE},
        f"HybridEP flex dispatcher over the NVLink domain with the batch-level overlap (moe_a2a_overlap), recompute "
        f"of the norms and the expert activation ({_V041}gpt_oss/gpt_oss_workload_base_configs.py "
        f"GPT_OSS_120B_PRETRAIN_CONFIG_GB200_BF16_V2); 64 GPUs in one NVLink domain",
        train={"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}, gpus_per_node=64),
    _mb("26.04.01", "DGX-GB300", "DeepSeek-V3", "MXFP8", 4992, "deepseek_v3", "gb300", 256, 4096, 2, 1, 2, "8", 32,
        {"fp8": MXFP8, "dispatcher": "flex", "recompute": "selective", "recompute_modules": ("mla_up_proj",)},
        f"MXFP8, HybridEP flex dispatcher, recompute of MLA up-projections ({_V041}deepseek/"
        f"deepseek_workload_base_configs.py DEEPSEEK_V3_PRETRAIN_CONFIG_GB300_V1); layout {DSV3_16}; NVLink "
        "domains of 64 GPUs",
        train={"pipeline_model_parallel_layout": DSV3_16}, gpus_per_node=64, fitted=True),
    _mb("26.04.01", "DGX-GB300", "Qwen3-30B-A3B", "MXFP8", 31744, "qwen3_moe_30b_a3b", "gb300", 8, 512, 8, 1, 1,
        "n/a", 8, {"fp8": MXFP8, "dispatcher": "flex", **NO_RECOMPUTE},
        f"MXFP8, HybridEP flex dispatcher, no recompute, no overlap, CUDA graphs of router and preprocess "
        f"({_V041}qwen/qwen3_workload_base_configs.py QWEN3_30B_A3B_PRETRAIN_CONFIG_GB300_FP8_MX_V1)",
        train=GRAPHS_ROUTER, fitted=True),
    _mb("26.04.01", "DGX-GB300", "Qwen3-235B-A22B", "MXFP8", 6944, "qwen3_moe_235b_a22b", "gb300", 256, 8192, 2, 1,
        4, "12", 32, {"fp8": MXFP8, "dispatcher": "flex", **NO_RECOMPUTE},
        f"MXFP8, HybridEP flex dispatcher, no recompute, no overlap, CUDA graphs of attention, router and preprocess "
        f"({_V041}qwen/qwen3_workload_base_configs.py QWEN3_235B_A22B_PRETRAIN_CONFIG_GB300_FP8_MX_V2); 94 layers "
        "over 48 virtual stages as moefold's "
        "even split places them; NVLink domains of 64 GPUs",
        train={"num_virtual_stages": 12, **GRAPHS_ATTN_ROUTER}, gpus_per_node=64),
    PublishedRun(
        name="DeepSeek-V3, 2048 H800, FP8, DualPipe, PP16 x EP64",
        source="DeepSeek-V3 technical report (arXiv 2412.19437): 180K H800 GPU-hours per trillion tokens = 1,543 "
               "tokens/s/GPU; PP16, EP64 over 8 nodes, ZeRO-1 DP, no TP, seq 4096, batch 15360 after the ramp",
        metric="tokens/s/GPU", measured=1e12 / (180e3 * 3600), recipe="deepseek_v3", cluster="h800", gpus=2048,
        parallel=ParallelConfig(tp=1, cp=1, pp=16, ep=64, etp=1),
        train={"micro_batch_size": 1, "global_batch_size": 15360, "seq_length": 4096,
               "pipeline_schedule": "dualpipev", "num_virtual_stages": 2},
        options={"fp8": FINE_GRAINED_FP8, "dispatcher": "alltoall", "recompute": "selective",
                 "recompute_modules": ("mla_up_proj", "layernorm")},
        exchange_overlap=1.0, compute_share=112 / 132,
        assumptions="DualPipe hides the expert all-to-all (exchange_overlap 1) on 20 of the H800's 132 SMs, so the "
                    "compute kernels get 112 (compute_share 0.85), both from the report; DualPipe as moefold's "
                    "DualPipeV on the same 16 ranks: the report's bubble (PP/2 - 1)(F&B + B - 3W) within one chunk, "
                    "and its placement (the report: 'the shallowest layers (including the embedding layer) and deepest "
                    "layers (including the output head) of the model on the same PP rank'; DualPipeV's V puts chunks "
                    "0 and 31 on rank 0); 61 layers "
                    "and the MTP module over 32 chunks as moefold's even split places them (the report gives no "
                    "split); FP8 GEMMs at DeepGEMM's fitted rate, attention in bf16; recompute of RMSNorm and MLA "
                    "up-projections as the report says; micro-batch 1",
        system="H800", precision="FP8 (1x128 / 128x128 fine-grained)",
        layout="PP16 (DualPipe) EP64 TP1 ZeRO-1 DP, seq 4096, GBS 15360"),
    PublishedRun(
        name="Mixtral-8x22B, 128 H100, bf16, MoE parallel folding",
        source="MoE Parallel Folding (arXiv 2504.14960): 49.3% MFU for Mixtral 8x22B on H100; its layout from the "
               f"authors' benchmark configuration, {_ZOO}: Mixtral-8x22B TP2 PP8 EP8 CP1 VPP1 MBS1 GBS256, 56 layers, "
               "all-to-all dispatcher, grouped GEMM, 16 nodes, seq 4096",
        metric="MFU", measured=0.493, recipe="mixtral_8x22b", cluster="h100", gpus=128,
        parallel=ParallelConfig(tp=2, cp=1, pp=8, ep=8, etp=1),
        train={"micro_batch_size": 1, "global_batch_size": 256, "seq_length": 4096, "overlap_param_gather": True},
        options={"dispatcher": "alltoall", "recompute": "none"},
        assumptions="the abstract gives the MFU; the layout is the Model Zoo's (runtime.conf), its model file "
                    "(model_configs/benchmarking/Mixtral-8x22B.yaml) adds the distributed optimizer with overlapped "
                    "gradient reduce and parameter gather, sequence parallelism and TP communication overlap (which "
                    "moefold does not model: its TP term is under 2% of this step), bf16, no recompute; MFU with "
                    "moefold's FLOP count, causal attention as Megatron's num_floating_point_operations counted it "
                    "then (Megatron-LM at 2025-04-20: 'Only half of the attention matrix is non-zero'); the Zoo's "
                    "script (best_practice/Mixtral/run_mixtral_8x22B.sh) says this configuration runs at about 455 "
                    "TFLOP/s dropless (46.0% MFU), 470 with token dropping: the paper's 49.3% is its best",
        system="H100", precision="BF16",
        layout="TP2 PP8 EP8 ETP1 CP1 VPP1 MBS1 GBS256 seq 4096 (the authors' Model Zoo)"),
)


def validation_rows() -> list[tuple[PublishedRun, float]]:
    """(run, the model's estimate) for every published run."""
    return [(run, run.estimate()) for run in PUBLISHED_RUNS]


def error(run: PublishedRun, estimate: float) -> float:
    """The estimate's relative error: estimate / published - 1."""
    return estimate / run.measured - 1


def _fmt(metric: str, value: float) -> str:
    return f"{100 * value:.1f}%" if metric == "MFU" else f"{value:,.0f}"


def _dominant(run: PublishedRun) -> str:
    """The step's largest term and its share; for compute, the share of it that is host-bound
    (``Calibration.layer_seconds``)."""
    st = run.step_time()
    term = max(st.terms, key=st.terms.get)
    out = f"{term} {100 * st.terms[term] / st.total:.0f}%"
    if term == "compute":
        from moefold.planner.breakdown import host_seconds

        out += f" (host-bound {100 * host_seconds(run, st) / st.total:.0f}%)"
    return out


def _split_text(run: PublishedRun) -> str:
    from moefold.planner.breakdown import compute_split  # breakdown reads this module's table

    return ", ".join(f"{kind} {100 * share:.0f}%" for kind, share in compute_split(run).items())


def memory_cell(run: PublishedRun, mem: RankMemory) -> str:
    """The planned memory per GPU (``mem``: ``run.memory()``) against the GPU's: "peak / GPU GB (largest part GB)"."""
    return (f"{mem.total / 1e9:.0f} / {run.gpu_memory() / 1e9:.0f} GB "
            f"({mem.largest} {mem.components[mem.largest] / 1e9:.0f})")


def render_table(rows: list[tuple[PublishedRun, float]]) -> str:
    """The markdown table: each run (fitted ones marked), its hardware, precision and layout, the published figure,
    the estimate, the error and the step's largest term, the planned memory per GPU against the GPU's (the fullest
    stage, its largest part); the held-out summary; each run's source and assumptions."""
    lines = ["| | run | hardware | precision | layout | published | `moefold plan` | error | largest term | "
             "memory per GPU |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    memories = [run.memory() for run, _ in rows]
    for (run, est), mem in zip(rows, memories):
        lines.append(f"| {'fitted' if run.fitted else 'held out'} | {run.name.split(',')[0]} | "
                     f"{run.gpus} x {run.system or run.cluster.upper()} | {run.precision or '-'} | "
                     f"{run.layout or '-'} | {_fmt(run.metric, run.measured)} {run.metric} | "
                     f"{_fmt(run.metric, est)} | {100 * error(run, est):+.0f}% | {_dominant(run)} | "
                     f"{memory_cell(run, mem)} |")
    held = [(run, est) for run, est in rows if not run.fitted]
    worst, worst_est = max(held, key=lambda r: abs(error(*r)))
    lines += ["", f"{sum(r.fitted for r, _ in rows)} of {len(rows)} rows fitted (``planner.calibration``: "
              f"{CALIBRATION}); held out: {min(error(*r) for r in held):+.0%} .. {max(error(*r) for r in held):+.0%}, "
              f"worst {worst.name} at {error(worst, worst_est):+.0%} (largest term: {_dominant(worst)}; the step's "
              f"compute by kind: {_split_text(worst)}). "
              f"Memory: the plans of {sum(m.total <= r.gpu_memory() for (r, _), m in zip(rows, memories))} of "
              f"{len(rows)} runs fit their GPU's.", ""]
    for i, (run, _) in enumerate(rows, 1):
        lines.append(f"{i}. {run.name}: {run.source}. Assumed: {run.assumptions}.")
    return "\n".join(lines)


def main() -> int:
    print(render_table(validation_rows()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The step-time model's vocabulary and result: its terms (``TERMS``) and how each overlaps (``OVERLAP``), the
per-step answer (``StepTime``) and the end-to-end constants fitted on published runs (``Calibration``,
``CALIBRATION``). ``planner.step_time`` computes them; the report, plot, search and calibration read them.
Nothing here crosses ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

from moefold.planner.cluster import Cluster
from moefold.training.config import RunConfig

TERMS = ("compute", "tp", "cp", "ep", "pp", "dp", "offload", "bubble")
OVERLAP = {
    "compute": "each GEMM at its shape and dtype (planner.gemm_efficiency), core attention, elementwise "
               "kernels and the optimizer step by HBM bandwidth; recompute's extra forward included (flat model: "
               "FLOPs / (dense bf16 peak x --efficiency))",
    "tp": "exposed: TP/SP all-gathers, reduce-scatters and all-reduces sit between the GEMMs that need them "
          "(no TP communication overlap in moefold); router statistics all-reduces counted here",
    "cp": "p2p: each ring step's K/V transfer overlaps that block's attention, exposed only beyond the core "
          "attention compute; all_gather mode: exposed",
    "ep": "alltoall/flex: the forward token exchange overlaps the shared experts' forward (moefold launches it "
          "asynchronously), everything else (counts, combine, backward, etp gathers) exposed; allgather: exposed. "
          "With --overlap-moe-expert-parallel-comm: in every FB step the exchanges of both micro-batches hide behind "
          "the other's compute (up to that compute); unpaired forwards/backwards keep theirs exposed",
    "pp": "exposed: each stage boundary's activation (forward) and gradient (backward) per micro-batch is added "
          "to the action that sends it",
    "dp": "gradient reduce-scatter overlaps the last micro-batch's backward except what does not fit behind it "
          "(at least the last bucket); parameter all-gather exposed, or with --overlap-param-gather overlapped "
          "with the first micro-batch's forward except the first bucket; kinds (dense, sp, expert) back to back",
    "offload": "activation offloading: the PCIe copies beyond each action's compute (side streams); optimizer "
               "offload: the CPU AdamW and its PCIe copies beyond the next forward's part that does not wait for "
               "them",
    "bubble": "pipeline bubble: the critical rank's idle time on pipeline.simulator's clock, each action taking "
              "its compute + exposed communication",
}


@dataclass(frozen=True)
class StepTime:
    """Seconds per step by term (after overlap; ``TERMS``), why each is what it is, and the step's size."""

    terms: dict[str, float]
    exposed_notes: dict[str, str]
    flops_per_gpu: float       # model FLOPs per GPU per step (no recompute: the MFU convention)
    tokens_per_step: int
    gpus: int
    links: dict[str, str] = field(default_factory=dict)   # group -> "NVLink" | "network" (groups of > 1 rank)

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.total / self.gpus

    def mfu(self, cluster: Cluster) -> float:
        """Model FLOPs utilisation: model FLOPs per GPU per second over the dense bf16 peak."""
        return self.flops_per_gpu / self.total / (cluster.bf16_tflops * 1e12)


@dataclass(frozen=True)
class Calibration:
    """What the roofline model leaves out, fitted end to end on published runs (``planner.calibration``).

    A GEMM of one problem (attention and dense projections, the output head, an expert GEMM when a rank holds one
    expert) keeps the time ``planner.gemm_efficiency`` gives its shape: those tables are cuBLAS / DeepGEMM
    measurements of that shape, tile and wave quantisation included, and nothing is added to them. ``grouped``
    multiplies the grouped expert GEMMs (``Gemm.groups > 1``: a rank's several local experts in one layer), which
    the tables time as ``groups`` back-to-back GEMMs of the per-expert shape: in a run they also pay what happens
    per expert and per routed row around them (per-expert FP8 quantisation and transposes, the multi-stream loop of
    Transformer Engine's GroupedLinear on Hopper, the routed rows' permutation). ``other`` multiplies the rest of
    the blocks' compute (core attention, the HBM-bound elementwise kernels; the optimizer step stays as timed).
    ``communication`` multiplies every exposed collective (the share of a link's bandwidth NCCL / DeepEP reach).
    ``layer_seconds`` adds host-bound time per transformer block per micro-batch (a third in its forward, two
    thirds in its backward): the kernel launches the host issues one by one and the waits on the device (an MoE
    layer's dispatcher reads its per-expert token counts on the host before it can size the exchange), which the
    GPU does not hide when its kernels are short. That time is per block whatever its tokens, so it weighs on small
    models at small micro-batches; CUDA graphs (Megatron-Bridge's ``cuda_graph_scope`` attn / moe_router /
    moe_preprocess, docs/training/cuda-graphs.md: "launch-bound training steps ... smaller models or high step
    rates benefit most") remove part of it."""

    grouped: float = 1.0
    other: float = 1.0
    communication: float = 1.0
    layer_seconds: float = 0.0

    def __post_init__(self) -> None:
        for name in ("grouped", "other", "communication"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Calibration.{name}={getattr(self, name)!r} must be positive")
        if not self.layer_seconds >= 0:
            raise ValueError(f"Calibration.layer_seconds={self.layer_seconds!r} must be >= 0")

    def compute_seconds(self, total: float, gemm: float, grouped: float) -> float:
        """Calibrated seconds of compute that the roofline times at ``total``, of which ``gemm`` are GEMMs and
        ``grouped`` of those grouped expert GEMMs: single GEMMs as timed, grouped ones x ``grouped``, the rest
        x ``other``."""
        return (gemm - grouped) + self.grouped * grouped + self.other * (total - gemm)


# Fitted by ``python -m moefold.planner.calibration`` on the rows of ``planner.published`` marked ``fitted``
# (at most half of the table); the other rows' errors are what the model is worth on runs it was not tuned on.
CALIBRATION = Calibration(grouped=3.29, other=0.99, communication=1.38, layer_seconds=0.0016)
UNCALIBRATED = Calibration()
COMM_TERMS = ("tp", "cp", "ep", "pp", "dp")


def host_waits(config: RunConfig) -> bool:
    """Whether the host's kernel launches stay on the step's critical path (``Calibration.layer_seconds``): yes unless
    CUDA graphs replay the part of each layer where the host would wait on the device. An MoE layer's dispatcher
    reads its per-expert token counts on the host (a device-to-host sync) before it sizes the exchange; while the host
    waits the GPU drains its queue, and every kernel launched after it costs its launch time in full. Graphing the
    router and the dispatcher's preprocess (``--cuda-graph-modules moe_preprocess``, or ``moe``, the whole layer, a
    full-iteration graph) removes that wait, and the host runs ahead of the GPU again."""
    t = config.train
    if t.cuda_graph_impl == "none":
        return True
    modules = set(t.cuda_graph_modules)
    return t.cuda_graph_impl != "full_iteration" and bool(modules) and not modules & {"moe", "moe_preprocess"}


__all__ = ["CALIBRATION", "COMM_TERMS", "OVERLAP", "TERMS", "UNCALIBRATED", "Calibration", "StepTime", "host_waits"]

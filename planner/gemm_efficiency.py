"""How long one GEMM takes on a GPU, per shape and dtype: a roofline fitted to published measurements.

    seconds = groups x (max(compute, memory) + overlap x min(compute, memory)) + launch
    compute = 2 m n k / (compute_share x the GPU's peak of the dtype)
    memory  = (m k + n k) x input bytes + m n x output bytes, / (memory_share x the GPU's HBM bandwidth)

for ``C [m, n] = A [m, k] @ B [k, n]``, one kernel over ``groups`` equal problems (a grouped expert GEMM:
``m`` rows per expert). Small or thin GEMMs are bound by memory or by the launch; large ones by the
tensor cores, at a share of the datasheet peak that no library exceeds.

The constants are least-squares fits (in log space) to the published points below (``GemmPoint``), scaled
to each cluster's own peaks (``Cluster.bf16_tflops``, ``fp8_tflops``, ``hbm_gbps``):

- bf16: OpenXLA's default matmul performance table, ``xla/service/gpu/model/matmul_interpolator_data.h``
  (``kDefaultMatmulPTable``, key ``sm_90``: an H100 SXM, cuBLAS through XLA, ``bf16xbf16->bf16``, batch 1; the
  points of at least 1 GFLOP), plus cuBLAS at 8192^3 = 795 TFLOP/s on H100 from pranjalssh/fast.cu's README
  ("Fastest GPU kernels, written from scratch": cuBLAS 716 at 4096^3, 795 at 8192^3). Fit: 0.83 of the bf16
  peak, 0.84 of the HBM bandwidth, overlap 0.25, 6 us launch; within -14% .. +5% of the points of >= 4 GFLOP,
  at worst +36% (256 x 512 x 4096, a split-K shape).
- fp8 (e4m3 inputs, bf16 output, fine-grained scaling): DeepGEMM's README (deepseek-ai/DeepGEMM at commit
  55ab91f, "Update performance", 2025-03-25; H800 SXM, 1979 dense FP8 TFLOP/s), its normal GEMMs at
  M = 64, 128, 4096 on DeepSeek-V3's shapes and its grouped GEMMs (contiguous layout, 4-8 groups of
  4096-8192 rows; masked layout, 1-4 groups of 256-1024 rows). Fit: 0.74 of the FP8 peak, 1.0 of the HBM
  bandwidth, overlap 0.75, 2 us launch; within -18% .. +23% of every point. A GPU without FP8 tensor
  cores (``fp8_tflops = 0``) runs FP8 GEMMs at the bf16 rate.

Weight-gradient GEMMs (``k`` = the tokens) and input-gradient GEMMs use the same model with their own shape.
Core attention is not a GEMM here: ``ATTENTION_SHARE`` (FlashAttention-3, arXiv 2407.08608: causal, head
dim 128, seq 4k on H100, about 600 TFLOP/s forward in bf16 and 1.5-1.75x FlashAttention-2's backward, whose
~300 TFLOP/s puts FlashAttention-3's near 450-500; cuDNN's fused attention, which Transformer Engine
uses, is in the same range), and ``softmax_attention_seconds`` splits it into the tensor cores' part and the
exponentials' (``Cluster.exp_tops``), which sets its rate at other head dimensions and on other GPUs.
``benchmarks/gemm_efficiency.py`` measures these points on the device it runs on and fits the same model, which
is how the constants should be replaced once a GPU is measured.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from moefold.planner.cluster import Cluster

# (forward, backward) share of the bf16 peak that core attention sustains (module docstring): FlashAttention's TFLOP/s,
# the backward counted as 2.5 x the forward's FLOPs; what ``softmax_attention_seconds`` reproduces on an H100 at head
# dim 128, and what times the other cores (Mamba-2 scans, Gated DeltaNet rules: ``attention_seconds``)
ATTENTION_SHARE = (0.60, 0.47)
# Softmax attention (FlashAttention, cuDNN's fused attention): per score (one query-key product of one head) the tensor
# cores run 2 (d_qk + d_v) FLOPs forward and ATTENTION_BACKWARD_FLOPS times that backward (FlashAttention-2, arXiv
# 2307.08691: five score-sized GEMMs against two), and the special-function units one exponential each way (forward
# exp(S - max), backward P again from the saved log-sum-exp). The exponentials do not scale with the tensor cores
# (``Cluster.exp_tops``: the CUDA C++ Programming Guide's 16 exp2 per clock per SM on cc 9.0 and 10.0; the
# FlashAttention-4 write-up, together.ai/blog/flashattention-4: from H100 to B200 "BF16 tensor core throughput increases
# from 1 to 2.25 PFLOPs, while both the SFU count and shared memory bandwidth remains unchanged", and the forward is
# bound by the exponential), and the kernels overlap the two only in part, so the time is the MMA time plus the
# exponentials': MMA FLOPs / (ATTENTION_MMA_SHARE x bf16 peak) + scores / exp rate. The shares are what gives an H100
# (989 TFLOP/s, 4.18 T exp/s) at head dim 128 ATTENTION_SHARE's rates; at head dim 64 the model gives it 465 forward and
# 428 backward TFLOP/s, where the FlashAttention-3 paper (arXiv 2407.08608, H100, bf16, seq 4k) measures 476 / 453 for
# FlashAttention-3 and 408 / 417 for cuDNN. A narrow head pays the same exponentials for half the MMA work.
ATTENTION_BACKWARD_FLOPS = 2.5
ATTENTION_MMA_SHARE = (0.830, 0.515)


@dataclass(frozen=True)
class GemmPoint:
    """A published measurement: ``groups`` GEMMs of ``[m, k] x [k, n]`` in one kernel at ``tflops``."""

    m: int
    n: int
    k: int
    tflops: float
    groups: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.groups * self.m * self.n * self.k


@dataclass(frozen=True)
class GemmModel:
    """The roofline of one dtype (module docstring); shares are of the cluster's peaks."""

    dtype: str
    compute_share: float
    memory_share: float
    overlap: float
    launch_s: float
    input_bytes: int
    output_bytes: int

    def seconds_at(self, peak_tflops: float, hbm_gbps: float, m: float, n: float, k: float,
                   groups: int = 1) -> float:
        if min(m, n, k) <= 0:
            return 0.0
        compute = 2.0 * m * n * k / (self.compute_share * peak_tflops * 1e12)
        memory = ((m * k + n * k) * self.input_bytes + m * n * self.output_bytes) / (self.memory_share * hbm_gbps
                                                                                      * 1e9)
        return groups * (max(compute, memory) + self.overlap * min(compute, memory)) + self.launch_s


BF16 = GemmModel("bf16", compute_share=0.83, memory_share=0.84, overlap=0.25, launch_s=6e-6, input_bytes=2,
                 output_bytes=2)
FP8 = GemmModel("fp8", compute_share=0.74, memory_share=1.0, overlap=0.75, launch_s=2e-6, input_bytes=1,
                output_bytes=2)
MODELS = {"bf16": BF16, "fp8": FP8}
# Blackwell (sm_100: B200, GB200; GB300's sm_103 has the same bf16 / FP8 tensor cores): fitted to OpenXLA's sm_100
# table (``BF16_B200``, ``FP8_B200``; ``fit_model``): -10% .. +26% of its bf16 points, -9% .. +21% of its FP8 ones.
# The Hopper fits put the same FP8 shapes at a median +51% of what the B200 reaches: Blackwell's GEMMs reach a
# smaller share of its larger datasheet peaks, and thin ones are bound by the launch and HBM sooner.
BF16_SM100 = GemmModel("bf16", compute_share=0.71, memory_share=0.7, overlap=0.25, launch_s=6e-6, input_bytes=2,
                       output_bytes=2)
FP8_SM100 = GemmModel("fp8", compute_share=0.75, memory_share=0.7, overlap=0.25, launch_s=6e-6, input_bytes=1,
                      output_bytes=2)
# the models of each GPU architecture (``Cluster.arch``); Ampere (no FP8) uses Hopper's bf16 fit at its own peaks
ARCH_MODELS = {"sm_80": MODELS, "sm_90": MODELS, "sm_100": {"bf16": BF16_SM100, "fp8": FP8_SM100}}
# the peaks and HBM bandwidth of the GPUs the points were measured on (datasheets)
H100_PEAKS = (989.0, 3350.0)
H800_FP8_PEAKS = (1979.0, 3350.0)

BF16_H100: tuple[GemmPoint, ...] = tuple(GemmPoint(m, n, k, t) for m, n, k, t in (
    (1024, 2048, 256, 139.5), (4096, 512, 512, 238.8), (256, 2048, 4096, 285.9), (4096, 1024, 512, 343.7),
    (2048, 2048, 2048, 632.0), (256, 512, 4096, 91.7), (4096, 4096, 256, 392.2), (4096, 4096, 4096, 783.3),
    (512, 4096, 1024, 373.3), (512, 256, 4096, 91.1), (256, 1024, 4096, 172.3), (4096, 2048, 512, 447.0),
    (2048, 256, 1024, 135.8), (4096, 256, 2048, 304.7), (1024, 1024, 2048, 350.0), (1024, 512, 2048, 220.0),
    (512, 2048, 1024, 232.6), (4096, 512, 1024, 370.8), (1024, 2048, 2048, 524.3), (4096, 1024, 1024, 488.1),
    (1024, 2048, 1024, 373.3), (4096, 4096, 512, 543.1), (512, 2048, 2048, 342.4), (256, 4096, 512, 138.1),
    (2048, 256, 4096, 307.5), (512, 1024, 2048, 216.5), (4096, 512, 256, 142.5), (2048, 4096, 1024, 594.2),
    (4096, 4096, 2048, 738.7), (512, 512, 2048, 114.7), (4096, 512, 4096, 650.0), (4096, 1024, 256, 216.5),
    (1024, 4096, 1024, 490.3), (256, 4096, 4096, 412.0), (4096, 1024, 4096, 738.5), (1024, 256, 4096, 169.7),
    (4096, 2048, 256, 304.0), (2048, 1024, 2048, 523.3), (8192, 8192, 8192, 795.0)))

FP8_H800: tuple[GemmPoint, ...] = tuple(GemmPoint(m, n, k, t, g) for g, m, n, k, t in (
    (1, 64, 2112, 7168, 206), (1, 64, 24576, 1536, 289), (1, 64, 32768, 512, 219), (1, 64, 7168, 16384, 336),
    (1, 64, 4096, 7168, 287), (1, 64, 7168, 2048, 295), (1, 128, 2112, 7168, 352), (1, 128, 24576, 1536, 535),
    (1, 128, 32768, 512, 358), (1, 128, 7168, 16384, 645), (1, 128, 4096, 7168, 533), (1, 128, 7168, 2048, 510),
    (1, 4096, 2112, 7168, 1009), (1, 4096, 24576, 1536, 1125), (1, 4096, 32768, 512, 751),
    (1, 4096, 7168, 16384, 1426), (1, 4096, 4096, 7168, 1265), (1, 4096, 7168, 2048, 1168),
    (4, 8192, 4096, 7168, 1346), (4, 8192, 7168, 2048, 1214), (8, 4096, 4096, 7168, 1346),
    (8, 4096, 7168, 2048, 1214), (1, 1024, 4096, 7168, 1233), (1, 1024, 7168, 2048, 925),
    (2, 512, 4096, 7168, 1040), (2, 512, 7168, 2048, 916), (4, 256, 4096, 7168, 932), (4, 256, 7168, 2048, 815)))


# OpenXLA's default matmul table, key ``sm_100`` (a B200: ``xla/backends/gpu/cost_model/matmul_interpolator_data.h``,
# ``kDefaultMatmulPTable``, batch 1): (m, n, k, bf16xbf16->bf16 TFLOP/s, f8e4m3fnxf8e4m3fn->bf16 TFLOP/s), the points
# of at least 1 GFLOP at m = 4096 and the largest at m = 2048 and 256. At 4096^3 cuBLAS reaches 1,417 bf16 and 2,765
# FP8 TFLOP/s there: 63% and 61% of the DGX B200 peaks (2,250 and 4,500), where the H100 reaches 79% (783 of 989).
_SM100 = (
    (4096, 1024, 256, 271.1, 225.6), (4096, 2048, 256, 403.6, 487.1), (4096, 4096, 256, 514.7, 666.9),
    (4096, 512, 512, 287.9, 322.6), (4096, 1024, 512, 465.2, 538.9), (4096, 2048, 512, 652.3, 871.3),
    (4096, 4096, 512, 805.3, 1172.1), (4096, 256, 1024, 283.7, 312.8), (4096, 512, 1024, 490.6, 510.3),
    (4096, 1024, 1024, 715.6, 850.8), (4096, 2048, 1024, 913.8, 1332.2), (4096, 4096, 1024, 1075.6, 1895.4),
    (4096, 256, 2048, 458.8, 471.8), (4096, 512, 2048, 762.4, 979.5), (4096, 1024, 2048, 990.3, 1462.6),
    (4096, 2048, 2048, 1170.0, 1833.5), (4096, 4096, 2048, 1277.8, 2485.0), (4096, 256, 4096, 645.1, 861.8),
    (4096, 512, 4096, 991.5, 1485.0), (4096, 1024, 4096, 1204.9, 1951.8), (4096, 2048, 4096, 1343.5, 2499.4),
    (4096, 4096, 4096, 1416.9, 2765.0), (2048, 2048, 4096, 1208.5, 1955.8), (2048, 4096, 4096, 1342.5, 2491.3),
    (256, 1024, 4096, 205.9, 260.6), (256, 2048, 4096, 394.1, 488.9), (256, 4096, 2048, 464.4, 566.2),
    (256, 4096, 4096, 651.4, 930.5))
BF16_B200: tuple[GemmPoint, ...] = tuple(GemmPoint(m, n, k, t) for m, n, k, t, _ in _SM100)
FP8_B200: tuple[GemmPoint, ...] = tuple(GemmPoint(m, n, k, t) for m, n, k, _, t in _SM100)
B200_PEAKS, B200_FP8_PEAKS = (2250.0, 8000.0), (4500.0, 8000.0)

# The GPU each architecture's fit was measured on, per architecture: its dense bf16 and FP8 peaks (TFLOP/s) and its
# board power (W): Hopper's tables are an H100 SXM's and an H800 SXM's (700 W both), Blackwell's a B200 at 1,000 W
# (OpenXLA's sm_100 table; at 63% of the DGX B200 peak for 4096^3 against the H100's 79%: a GEMM that fills
# Blackwell's tensor cores runs at the board's power limit, below its boost clock). The same B200 silicon is
# configured to 1,200 W in a GB200 (2,500 dense bf16 TFLOP/s on its datasheet against 2,250 at 1,000 W) and Blackwell
# Ultra to 1,400 W in a GB300. At a fixed voltage a chip's switching power is proportional to its clock, so a GEMM at
# the power limit sustains a rate in proportion to the board power (POWER_EXPONENT = 1, the top of the physical range;
# voltage scaling would make it smaller). ``planner.calibration`` fits the other constants with this law; its
# docstring gives the fitted rows' error at other exponents. Ampere (no fit of its own) keeps the datasheet peaks.
FIT_GPU = {"sm_90": (989.0, 1979.0, 700.0), "sm_100": (2250.0, 4500.0, 1000.0)}
POWER_EXPONENT = 1.0


def model_errors(model: GemmModel, points: Iterable[GemmPoint], peaks: tuple[float, float]) -> list[float]:
    """Relative error of ``model`` at each point: modelled TFLOP/s / measured - 1."""
    out = []
    for p in points:
        t = model.seconds_at(peaks[0], peaks[1], p.m, p.n, p.k, p.groups)
        out.append(p.flops / t / 1e12 / p.tflops - 1.0)
    return out


def fit_model(dtype: str, points: Sequence[GemmPoint], peaks: tuple[float, float], input_bytes: int,
              output_bytes: int) -> GemmModel:
    """The ``GemmModel`` whose log errors at ``points`` have the least sum of squares, searched on a grid (what
    produced ``BF16`` and ``FP8``; ``benchmarks/gemm_efficiency.py`` fits measured points with it)."""
    best, best_cost = None, math.inf
    for compute in [x / 100 for x in range(40, 101, 1)]:
        for memory in (0.5, 0.6, 0.7, 0.75, 0.8, 0.84, 0.9, 1.0):
            for overlap in (0.0, 0.25, 0.5, 0.75, 1.0):
                for launch in (1e-6, 2e-6, 3e-6, 4e-6, 6e-6, 8e-6, 12e-6, 20e-6):
                    m = GemmModel(dtype, compute, memory, overlap, launch, input_bytes, output_bytes)
                    cost = sum(math.log1p(e) ** 2 for e in model_errors(m, points, peaks))
                    if cost < best_cost:
                        best, best_cost = m, cost
    return best


def tensor_tflops(cluster: Cluster, dtype: str, share: float) -> float:
    """The peak (TFLOP/s) that a kernel reaching ``share`` of it runs ``dtype`` at on ``cluster``: the datasheet peak,
    or, where the cluster states its board power and its architecture's fit was measured on a GPU of known power
    (``FIT_GPU``), that GPU's peak x (board power / its power) ** ``POWER_EXPONENT``; never beyond what puts the
    kernel above the datasheet peak. (A ``dtype`` without tensor cores of its own, FP8 on Ampere, runs at bf16's.)"""
    fp8 = dtype == "fp8" and cluster.fp8_tflops > 0
    datasheet = cluster.fp8_tflops if fp8 else cluster.bf16_tflops
    fit = FIT_GPU.get(cluster.arch)
    if not cluster.board_watts or fit is None:
        return datasheet
    sustained = fit[1 if fp8 else 0] * (cluster.board_watts / fit[2]) ** POWER_EXPONENT
    return min(sustained, datasheet / share)


def gemm_seconds(cluster: Cluster, dtype: str, m: float, n: float, k: float, groups: int = 1) -> float:
    """Seconds of ``groups`` x ``[m, k] @ [k, n]`` on one GPU of ``cluster`` in ``dtype`` ("bf16" or "fp8")."""
    models = ARCH_MODELS[cluster.arch]
    model = models["fp8"] if dtype == "fp8" and cluster.fp8_tflops > 0 else models["bf16"]
    return model.seconds_at(tensor_tflops(cluster, model.dtype, model.compute_share), cluster.hbm_gbps, m, n, k,
                            groups)


def attention_seconds(cluster: Cluster, flops: float, backward: bool) -> float:
    """Seconds of ``flops`` of a core that is not softmax attention (a Mamba-2 scan, a Gated DeltaNet rule) forward,
    or its backward, at ``ATTENTION_SHARE`` of the bf16 peak (``tensor_tflops``)."""
    share = ATTENTION_SHARE[1 if backward else 0]
    return flops / (share * tensor_tflops(cluster, "bf16", share) * 1e12)


def softmax_attention_seconds(cluster: Cluster, flops: float, head_dims: float, backward: bool) -> float:
    """Seconds of softmax attention whose forward is ``flops`` (scores and values: 2 x scores x ``head_dims``, with
    ``head_dims`` = d_qk + d_v of a head) forward, or its backward (``ATTENTION_MMA_SHARE``)."""
    scores = flops / (2.0 * head_dims)
    mma = flops * (ATTENTION_BACKWARD_FLOPS if backward else 1.0)
    share = ATTENTION_MMA_SHARE[1 if backward else 0]
    return mma / (share * tensor_tflops(cluster, "bf16", share) * 1e12) + scores / (cluster.exp_tops * 1e12)


__all__ = ["ARCH_MODELS", "ATTENTION_BACKWARD_FLOPS", "ATTENTION_MMA_SHARE", "ATTENTION_SHARE", "B200_FP8_PEAKS",
           "B200_PEAKS", "BF16", "BF16_B200", "BF16_H100", "BF16_SM100", "FIT_GPU", "FP8", "FP8_B200", "FP8_H800",
           "FP8_SM100", "H100_PEAKS", "H800_FP8_PEAKS", "MODELS", "POWER_EXPONENT", "GemmModel", "GemmPoint",
           "attention_seconds", "fit_model", "gemm_seconds", "model_errors", "softmax_attention_seconds",
           "tensor_tflops"]

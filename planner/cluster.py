"""What the planner assumes about the machines: memory, dense bf16 / FP8 throughput, HBM and link bandwidths per GPU.

A ``Cluster`` is one GPU type in one network: every figure is *per GPU*; bandwidths are GB/s (1e9 bytes/s) in
one direction. ``nvlink_gbps`` serves groups whose ranks share a node, ``internode_gbps`` groups that span nodes
(the GPU's share of the node's network: a node with eight 400 Gb/s InfiniBand NICs, one per GPU, gives each GPU
50 GB/s). The presets state where their figures come from (``source``); ``--cluster FILE.toml`` describes
another machine::

    name = "my-h100"
    memory = "80GB"            # or memory_bytes = 80000000000
    bf16_tflops = 989          # dense (no sparsity), per GPU
    nvlink_gbps = 450          # per GPU, one direction
    internode_gbps = 50        # per GPU, one direction
    pcie_gbps = 50             # optional: host <-> GPU per GPU, one direction (activation / optimizer offload)
    host_memory = "256GB"      # optional: host memory per GPU (the node's / its GPUs)
    host_memory_gbps = 75      # optional: host memory bandwidth per GPU (the CPU AdamW of optimizer offload)
    fp8_tflops = 1979          # dense FP8 peak; 0 or absent: no FP8 tensor cores (FP8 GEMMs at the bf16 rate)
    hbm_gbps = 3350            # memory bandwidth (bounds thin GEMMs and the elementwise kernels)
    arch = "sm_90"             # sm_80 (Ampere), sm_90 (Hopper) or sm_100 (Blackwell): whose GEMM rates apply
    exp_tops = 4.18            # optional: exponentials per second, 1e12 (softmax attention's special-function units)
    board_watts = 700          # optional: the GPU's configured board power (W); sets its sustained GEMM rate
    source = "where the figures come from"

Sizes are decimal unless they say otherwise (``parse_bytes``: GB = 1e9 bytes, GiB = 2**30).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

import tomllib

IB_NDR_PER_GPU = 50.0   # 8 x 400 Gb/s ConnectX-7 per node (DGX/HGX H100, H200, H800): 400 Gb/s = 50 GB/s per GPU
IB_HDR_PER_GPU = 25.0   # 8 x 200 Gb/s ConnectX-6 per node (DGX A100): 25 GB/s per GPU
# host side, per GPU of an 8-GPU node. PCIe Gen5 x16 is 64 GB/s per direction, Gen4 x16 32 GB/s; ~80% of it is
# what large pinned copies reach. Host memory: DGX H100 / H200 2 TB, DGX A100 2 TB (the larger option), over 8 GPUs.
# Host memory bandwidth: two sockets of 8 DDR5-4800 channels (Xeon 8480C, DGX H100) = 614 GB/s, two of 8 DDR4-3200
# (EPYC 7742, DGX A100) = 410 GB/s, over 8 GPUs.
PCIE_GEN5_PER_GPU, PCIE_GEN4_PER_GPU = 50.0, 25.0
HOST_MEMORY_PER_GPU = 256 * 10**9
DDR5_NODE_PER_GPU, DDR4_NODE_PER_GPU = 77.0, 51.0
ARCHS = ("sm_80", "sm_90", "sm_100")   # CUDA compute capabilities with their own GEMM fits
# Exponentials per second per GPU (1e12), what softmax attention's special-function units sustain
# (planner.gemm_efficiency.softmax_attention_seconds): the CUDA C++ Programming Guide's arithmetic-instruction
# throughput table gives 16 exp2 per clock per SM on compute capability 8.0, 9.0 and 10.0, times the SMs and the
# boost clock: H100
# SXM 132 SMs at 1.98 GHz, A100 108 at 1.41 GHz, B200 148 at about 1.965 GHz ("the SFU count ... remains unchanged"
# from H100, the FlashAttention-4 write-up); Blackwell Ultra (GB300) doubles it ("NVIDIA Blackwell Ultra alleviates
# this bottleneck by doubling SFU throughput over the standard NVIDIA Blackwell architecture", NVIDIA technical blog
# "Making Softmax More Efficient with NVIDIA Blackwell Ultra", MUFU.EX2)
EXP_H100, EXP_A100, EXP_B200 = 16 * 132 * 1.98e-3, 16 * 108 * 1.41e-3, 16 * 148 * 1.965e-3


@dataclass(frozen=True)
class Cluster:
    """One GPU and its links; figures per GPU, bandwidths in GB/s (1e9 B/s) in one direction."""

    name: str
    memory_bytes: int
    bf16_tflops: float       # dense bf16 tensor-core peak
    nvlink_gbps: float       # to a GPU of the same node
    internode_gbps: float    # to a GPU of another node
    source: str
    pcie_gbps: float = PCIE_GEN5_PER_GPU            # host <-> this GPU, one direction
    host_memory_bytes: int = HOST_MEMORY_PER_GPU    # the node's host memory over its GPUs
    host_memory_gbps: float = DDR5_NODE_PER_GPU     # the node's host memory bandwidth over its GPUs
    fp8_tflops: float = 0.0  # dense FP8 tensor-core peak; 0: none (FP8 GEMMs run at the bf16 rate)
    hbm_gbps: float = 3350.0  # HBM bandwidth (default: an H100 SXM's 3.35 TB/s)
    arch: str = "sm_90"       # the GPU architecture whose measured GEMM rates time the GEMMs (planner.gemm_efficiency)
    exp_tops: float = EXP_H100  # exponentials per second, 1e12 (softmax attention: EXP_H100's comment)
    # the board power the GPU is configured to (W): a GEMM that fills the tensor cores runs at that limit, so its
    # sustained rate is set by it (planner.gemm_efficiency.tensor_tflops); 0: unknown, rates scale with the peaks
    board_watts: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.memory_bytes, int) or self.memory_bytes < 1:
            raise ValueError(f"cluster {self.name!r}: memory_bytes={self.memory_bytes!r} must be a positive integer")
        if not isinstance(self.host_memory_bytes, int) or self.host_memory_bytes < 1:
            raise ValueError(f"cluster {self.name!r}: host_memory_bytes={self.host_memory_bytes!r} must be a positive "
                             "integer")
        for name in ("bf16_tflops", "nvlink_gbps", "internode_gbps", "pcie_gbps", "host_memory_gbps",
                     "hbm_gbps", "exp_tops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"cluster {self.name!r}: {name}={value!r} must be a positive number")
        if self.arch not in ARCHS:
            raise ValueError(f"cluster {self.name!r}: arch={self.arch!r} must be one of {', '.join(ARCHS)} (Ampere, "
                             "Hopper, Blackwell)")
        for name, zero in (("board_watts", "the GPU's board power in W, e.g. 700 for an H100 SXM; 0: unknown"),
                           ("fp8_tflops", "0: no FP8 units")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"cluster {self.name!r}: {name}={value!r} must be a number >= 0 ({zero})")

    def link_gbps(self, spans_nodes: bool) -> float:
        """Bandwidth per GPU of a group that stays in one node (NVLink) or spans nodes (network)."""
        return self.internode_gbps if spans_nodes else self.nvlink_gbps


CLUSTERS: dict[str, Cluster] = {c.name: c for c in (
    Cluster("h100", 80 * 10**9, 989.0, 450.0, IB_NDR_PER_GPU,
            "NVIDIA H100 SXM5 datasheet: 80 GB HBM3, BF16 tensor core 1,979 TFLOP/s with sparsity = 989 dense, "
            "NVLink 900 GB/s bidirectional = 450 per direction; network: 8 x 400 Gb/s NDR InfiniBand per node "
            "(DGX H100) = 50 GB/s per GPU; FP8 3,958 with sparsity = 1,979 dense; HBM3 3.35 TB/s; host: PCIe Gen5 "
            "x16, 2 TB and 2 x 8 DDR5-4800 channels per node; 700 W", fp8_tflops=1979.0, hbm_gbps=3350.0,
            board_watts=700.0),
    Cluster("h200", 141 * 10**9, 989.0, 450.0, IB_NDR_PER_GPU,
            "NVIDIA H200 SXM datasheet: 141 GB HBM3e, BF16 1,979 TFLOP/s with sparsity = 989 dense, NVLink "
            "900 GB/s bidirectional = 450 per direction; network: 8 x 400 Gb/s NDR InfiniBand per node "
            "(DGX H200) = 50 GB/s per GPU; FP8 1,979 dense; HBM3e 4.8 TB/s; host: PCIe Gen5 x16, 2 TB and 2 x 8 "
            "DDR5-4800 channels per node; 700 W", fp8_tflops=1979.0, hbm_gbps=4800.0, board_watts=700.0),
    Cluster("h800", 80 * 10**9, 989.0, 200.0, IB_NDR_PER_GPU,
            "NVIDIA H800 SXM5 = H100 SXM5 with NVLink cut to 400 GB/s bidirectional = 200 per direction "
            "(80 GB, 989 dense BF16 TFLOP/s); network: 8 x 400 Gb/s InfiniBand per node = 50 GB/s per GPU, "
            "as the DeepSeek-V3 technical report describes its H800 cluster; FP8 1,979 dense, HBM3 3.35 TB/s; host "
            "(assumed, as DGX H100): PCIe Gen5 x16, 2 TB and 2 x 8 DDR5-4800 channels per node; 700 W",
            fp8_tflops=1979.0, hbm_gbps=3350.0, board_watts=700.0),
    Cluster("a100", 80 * 10**9, 312.0, 300.0, IB_HDR_PER_GPU,
            "NVIDIA A100 SXM4 80GB datasheet: 80 GB HBM2e, BF16 tensor core 312 TFLOP/s dense, NVLink 600 GB/s "
            "bidirectional = 300 per direction; network: 8 x 200 Gb/s HDR InfiniBand per node (DGX A100) "
            "= 25 GB/s per GPU; no FP8 tensor cores; HBM2e 2.04 TB/s; host: PCIe Gen4 x16, 2 TB and 2 x 8 "
            "DDR4-3200 channels per node; 400 W",
            pcie_gbps=PCIE_GEN4_PER_GPU, host_memory_gbps=DDR4_NODE_PER_GPU, fp8_tflops=0.0, hbm_gbps=2039.0,
            arch="sm_80", exp_tops=EXP_A100, board_watts=400.0),
    Cluster("b200", 180 * 10**9, 2250.0, 900.0, IB_NDR_PER_GPU,
            "NVIDIA DGX B200 datasheet: 8 B200, 1,440 GB HBM3e = 180 GB per GPU, 72 PFLOPS FP8 training with sparsity "
            "per node = 4,500 dense FP8 TFLOP/s per GPU, dense BF16 half that (2,250); HBM3e 8 TB/s, "
            "NVLink 5 1.8 TB/s bidirectional = 900 per direction; network: 8 x 400 Gb/s ConnectX-7 = 50 GB/s per "
            "GPU; host: PCIe Gen5 x16, 4 TB (2 TB assumed usable as on DGX H100) and 2 x 8 DDR5 channels per node; "
            "the B200 configured at 1,000 W", fp8_tflops=4500.0, hbm_gbps=8000.0, arch="sm_100", exp_tops=EXP_B200,
            board_watts=1000.0),
    Cluster("gb200", 186 * 10**9, 2500.0, 900.0, IB_NDR_PER_GPU,
            "NVIDIA GB200 NVL72 datasheet: 72 Blackwell GPUs, 13.4 TB HBM3e = 186 GB per GPU, FP8 720 PFLOPS with "
            "sparsity = 5,000 dense per GPU, BF16 360 PFLOPS with sparsity = 2,500 dense per GPU, HBM3e 8 TB/s per "
            "GPU, NVLink 5 1.8 TB/s bidirectional = 900 per direction across the 72-GPU NVLink domain (plan with "
            "--gpus-per-node 72, or the domain a job gets); network: one 400 Gb/s ConnectX-7 per GPU = 50 GB/s; "
            "host: Grace, 480 GB LPDDR5X per 2 GPUs = 240 GB, NVLink-C2C 900 GB/s per Grace (450 per GPU) "
            "serving as the host link; the same B200 configured at 1,200 W, which is what raises its peaks over DGX "
            "B200's", fp8_tflops=5000.0, hbm_gbps=8000.0, pcie_gbps=450.0, arch="sm_100", exp_tops=EXP_B200,
            host_memory_bytes=240 * 10**9, host_memory_gbps=256.0, board_watts=1200.0),
)}
# GB300 NVL72: GB200's NVLink domain and dense peaks, with Blackwell Ultra's memory, ConnectX-8, twice the
# exponentials (EXP_H100's comment) and 1,400 W per GPU
CLUSTERS["gb300"] = dataclasses.replace(
    CLUSTERS["gb200"], name="gb300", memory_bytes=288 * 10**9, internode_gbps=100.0, exp_tops=2 * EXP_B200,
    board_watts=1400.0,
    source="NVIDIA GB300 NVL72 datasheet: 72 Blackwell Ultra GPUs, 20.7 TB HBM3e = 288 GB per GPU, FP8 720 PFLOPS "
           "with sparsity = 5,000 dense per GPU, BF16 360 PFLOPS with sparsity = 2,500 dense per GPU, HBM3e 8 TB/s, "
           "NVLink 5 1.8 TB/s bidirectional = 900 per direction across the 72-GPU NVLink domain; network: one "
           "800 Gb/s ConnectX-8 per GPU = 100 GB/s; host: Grace, 480 GB LPDDR5X per 2 GPUs = 240 GB, NVLink-C2C "
           "900 GB/s per Grace (450 per GPU) serving as the host link; Blackwell Ultra's special-function units: "
           "twice Blackwell's exponentials (NVIDIA technical blog, Making Softmax More Efficient with NVIDIA "
           "Blackwell Ultra); 1,400 W per GPU (GB200's 1,200)")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """Bytes in a size such as ``80GB``, ``80GiB``, ``141G``, ``1.5TB`` or ``123`` (bytes). Decimal units
    (K, M, G, T with or without B) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers of 1024."""
    match = _SIZE.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"memory size {text!r} is not a number with a unit: use e.g. 80GB, 80GiB, 141G or 1.5TB "
                         f"(GB = 1e9 bytes, GiB = 2**30)")
    value = round(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"memory size {text!r} must be at least one byte (e.g. 80GB)")
    return value


_TOML_KEYS = {"name", "memory", "memory_bytes", "bf16_tflops", "nvlink_gbps", "internode_gbps", "source", "pcie_gbps",
              "host_memory", "host_memory_gbps", "fp8_tflops", "hbm_gbps", "arch", "exp_tops", "board_watts"}


def load_cluster(spec: str) -> Cluster:
    """A preset (``CLUSTERS``: h100, h200, h800, a100, b200, gb200, gb300) or a TOML file with the ``Cluster``
    fields (module docstring)."""
    if spec in CLUSTERS:
        return CLUSTERS[spec]
    path = Path(spec)
    if path.suffix != ".toml":
        raise ValueError(f"--cluster {spec!r} is neither a preset ({', '.join(CLUSTERS)}) nor a FILE.toml")
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"--cluster {spec!r}: no such file (or use a preset: {', '.join(CLUSTERS)})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--cluster {spec!r} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - _TOML_KEYS)
    if unknown:
        raise ValueError(f"--cluster {spec!r}: unknown keys {unknown}; valid keys: {sorted(_TOML_KEYS)}")
    if ("memory" in data) == ("memory_bytes" in data):
        raise ValueError(f"--cluster {spec!r}: give exactly one of memory (e.g. \"80GB\") or memory_bytes")
    missing = sorted({"bf16_tflops", "nvlink_gbps", "internode_gbps"} - set(data))
    if missing:
        raise ValueError(f"--cluster {spec!r}: missing {missing} (per GPU: dense bf16 TFLOP/s, NVLink and "
                         f"inter-node GB/s in one direction)")
    memory = parse_bytes(data["memory"]) if "memory" in data else data["memory_bytes"]
    host = {"pcie_gbps": data["pcie_gbps"]} if "pcie_gbps" in data else {}
    if "host_memory" in data:
        host["host_memory_bytes"] = parse_bytes(data["host_memory"])
    if "host_memory_gbps" in data:
        host["host_memory_gbps"] = data["host_memory_gbps"]
    return Cluster(name=str(data.get("name", path.stem)), memory_bytes=memory, bf16_tflops=data["bf16_tflops"],
                   nvlink_gbps=data["nvlink_gbps"], internode_gbps=data["internode_gbps"],
                   source=str(data.get("source", f"{path} (no source given)")), fp8_tflops=data.get("fp8_tflops", 0.0),
                   hbm_gbps=data.get("hbm_gbps", Cluster.hbm_gbps), arch=str(data.get("arch", Cluster.arch)),
                   exp_tops=data.get("exp_tops", Cluster.exp_tops),
                   board_watts=data.get("board_watts", Cluster.board_watts), **host)

"""GPU measurements for the GPU check (``moefold.tools.gpu.check``), one subcommand per run.

    python -m moefold.tools.gpu.bench moe-layer [--tokens 8192 ...]   # MoE layer vs dense ceiling
    python -m moefold.tools.gpu.bench syncs [--train-recipe qwen3_moe_proxy --train-seq 4096 --train-vocab 16384]
    python -m moefold.tools.gpu.bench moe-layer --device cpu --tokens 64 --configs 8,2,32,64   # rehearsal

``moe-layer``: one MoE layer (router, local permutation, grouped experts, unpermutation) forward +
backward in bf16, per GEMM backend that imports here, timed with CUDA events (median of
``--iters`` after ``--warmup``), against the dense ceiling measured in the same run: six plain
bf16 matmuls doing the expert GEMMs' work as if every routed copy went to one expert
([N, H] x [H, 2F], [N, F] x [F, H] and their four backward products, N = tokens x top-k). The
figure of merit is layer TFLOP/s / dense TFLOP/s, counting the expert GEMMs only
(``expert_gemm_flops``: 3 GEMMs x 3 (forward + 2 backward) x 2 N H F).

The default shapes (``--configs E,k,F,H;...``, 8192 tokens) are real layers: Qwen3-30B-A3B (E 128, k 8, F 768,
H 2048); DeepSeek-V3 as one GPU of EP32 holds it (256 / 32 = 8 local experts, F 2048, H 7168, top-8 of the 8: each
token sends a copy to every local expert, so each gets T rows and N = 8 T, what a balanced all-to-all leaves a rank
whose T tokens route 8 copies each); Mixtral 8x7B (E 8, k 2, F 14336, H 4096). The layers route with softmax top-k
and no shared experts; ``tools.gpu.peers layer`` runs the same shapes with each family's router next to HF
transformers and TorchTitan.

``syncs``: host synchronisations per MoE layer (forward + backward) and per training step,
counted by CUDA itself (``torch.cuda.set_sync_debug_mode("warn")``) next to moefold's CPU model
(``training.observe.host_sync.HostSyncCounter``) on the same runs.

``--device cpu`` is the GPU check's rehearsal (``gpu_check --rehearsal``): the same code paths, timed with
the host clock, without CUDA's sync debug mode; its figures say nothing about a GPU. ``--deadline S``:
start no new row after S seconds (it prints a "skipped: out of time" row instead), so a caller's timeout
never cuts a table in half.

Every line printed is a result; the GPU check copies them into its report.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch

from moefold.dispatch.config import DispatchConfig, DispatcherKind
from moefold.execution.compile import compile_moe_layer, compile_unavailable
from moefold.moe.build import build_moe_layer
from moefold.moe.config import ExpertsConfig, MoEConfig, SharedExpertsConfig
from moefold.moe.gemm import check_gemm_backend
from moefold.moe.layer import MoELayer
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelDims
from moefold.precision.fp8 import FP8Config
from moefold.precision.fp8_region import fp8_autocast
from moefold.training.observe.host_sync import HostSyncCounter
from moefold.training.observe.machine import describe_machine


def device_time(fn: Callable[[], None], iters: int, warmup: int, device: str = "cuda") -> float:
    """Median seconds per call: CUDA events on a GPU, the host clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device != "cuda":
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    torch.cuda.synchronize()
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def dense_ceiling(N: int, H: int, F: int, iters: int, warmup: int, device: str = "cuda") -> float:
    """Seconds for the six bf16 matmuls of one gated MLP over N rows, forward + backward."""
    kw = {"device": device, "dtype": torch.bfloat16}
    x, gy = torch.randn(N, H, **kw), torch.randn(N, H, **kw)
    w13, w2 = torch.randn(H, 2 * F, **kw), torch.randn(F, H, **kw)
    h, dh = torch.randn(N, F, **kw), torch.randn(N, 2 * F, **kw)

    def step() -> None:
        x @ w13
        h @ w2
        gy @ w2.T
        h.T @ gy
        dh @ w13.T
        x.T @ dh

    return device_time(step, iters, warmup, device)


def expert_gemm_flops(T: int, k: int, H: int, F: int) -> int:
    """FLOPs of the routed experts' GEMMs for T tokens routed to k experts each, forward + backward: three
    projections (gate, up, down) x three GEMMs (forward, input gradient, weight gradient) x 2 N H F, N = T k."""
    return 3 * 3 * 2 * T * k * H * F


def _moe_layer(E: int, k: int, F: int, H: int, backend: str, fp8: FP8Config | None, device: str) -> MoELayer:
    """One bf16 MoE layer with the local dispatcher; weights as the constructors draw them (on the device:
    ``init_parameters``' layout-independent per-row draws on the host would dominate the check's time). Built
    with ``device`` as the default device too: the router's fp32 weight is created on the default device."""
    router = RouterConfig(num_experts=E, topk=k, load_balancing_type="none")
    cfg = MoEConfig(num_experts=E, router=router, experts=ExpertsConfig(F, gemm_backend=backend, fp8=fp8),
                    dispatch=DispatchConfig(DispatcherKind.LOCAL))
    with torch.device(device):
        return build_moe_layer(cfg, H, ParallelDims.single(device), sequence_parallel=False, dtype=torch.bfloat16,
                               device=device)


def _variants(backends: list[str], compiled: bool) -> list[tuple[str, FP8Config | None, bool]]:
    """(gemm backend, FP8 config or None, compiled) per row: each backend in bf16, TE in FP8 (its delayed
    recipe), torchao's recipes through torch's FP8 (grouped) GEMMs, and the layer as ``--compile`` runs it."""
    variants: list[tuple[str, FP8Config | None, bool]] = [(b, None, False) for b in backends]
    if "te" in backends:
        variants.append(("te", FP8Config("hybrid", "delayed", backend="te"), False))
    if "grouped_mm" in backends:
        variants += [("grouped_mm", FP8Config("e4m3", "rowwise"), False), ("grouped_mm", FP8Config("hybrid"), False)]
        if compiled:
            variants.append(("grouped_mm", None, True))
    return variants


def bench_moe_layer(args: argparse.Namespace) -> int:
    T, iters, warmup, device = args.tokens, args.iters, args.warmup, args.device
    deadline = time.monotonic() + args.deadline
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(f"device: {props.name} (sm{props.major}{props.minor}), torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}")
    else:
        print(f"device: cpu (a rehearsal: these figures say nothing about a GPU), torch {torch.__version__}")
    n = args.matmul_size
    print(f"bf16 matmul {n}^3: {2 * n ** 3 / _matmul_seconds(n, device) / 1e12:.3g} TFLOP/s")
    print("| config | backend | layer ms | expert-GEMM TFLOP/s | dense ceiling TFLOP/s | layer / dense |")
    print("|---|---|---|---|---|---|", flush=True)
    for spec in args.configs.split(";"):
        E, k, F, H = (int(v) for v in spec.split(","))
        name = f"E{E} k{k} F{F} H{H} T{T}"
        flops = expert_gemm_flops(T, k, H, F)
        dense = flops / dense_ceiling(T * k, H, F, iters, warmup, device)
        for backend, fp8, compiled in _variants(args.backends.split(","), not args.no_compile):
            label = backend + (f" fp8 {fp8.format} {fp8.recipe}" if fp8 else "") + (" compiled" if compiled else "")
            if time.monotonic() > deadline:
                print(f"| {name} | {label} | skipped: out of time (--deadline {args.deadline:.0f} s) | | | |")
                continue
            try:
                check_gemm_backend(backend, torch.bfloat16)
                if fp8 is not None:
                    fp8.check_available()
                layer = _moe_layer(E, k, F, H, backend, fp8, device)
                if compiled:
                    reason = compile_unavailable(device)
                    if reason is not None:
                        raise RuntimeError(reason)
                    compile_moe_layer(layer)
            except (ImportError, RuntimeError, ValueError) as err:
                print(f"| {name} | {label} | skipped: {str(err).splitlines()[0][:160]} | | | |", flush=True)
                continue
            try:
                seconds = device_time(_layer_step(layer, T, H), iters, warmup, device)
            except Exception as err:  # a backend that imports but fails here is a result, not a crash
                print(f"| {name} | {label} | failed: {type(err).__name__}: {str(err)[:160]} | | | |", flush=True)
                continue
            finally:
                del layer
                if device == "cuda":
                    torch.cuda.empty_cache()
            rate = flops / seconds
            print(f"| {name} | {label} | {seconds * 1e3:.2f} | {rate / 1e12:.3g} | {dense / 1e12:.3g} | "
                  f"{rate / dense:.2f} |", flush=True)
    return 0


def _matmul_seconds(n: int, device: str) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return device_time(lambda: a @ b, 10, 3, device)


def _layer_step(layer: MoELayer, T: int, H: int) -> Callable[[], None]:
    """Forward + backward of ``layer`` on fixed random [T, 1, H] bf16 tokens, as a trainer runs it."""
    device = next(layer.parameters()).device
    x = torch.randn(T, 1, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(T, 1, H, device=device, dtype=torch.bfloat16)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        with fp8_autocast(layer.experts.config.fp8):   # TE FP8: the region a model enters per forward (world 1 here)
            y, _ = layer(x)
        y.backward(gy)

    return step


def _loss_step(layer: MoELayer, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        y, info = layer(x)
        (y.float().square().sum() + info.aux_loss).backward()

    return step


def _sync_count(fn: Callable[[], None], device: str) -> tuple[int | str, int, str]:
    """(CUDA's count in warn mode, HostSyncCounter's count, its report) for one run of ``fn`` each.
    On the CPU (a rehearsal) CUDA's count is "n/a": its sync debug mode is CUDA-only."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()  # warm-up: lazy initialisation is not per step
    sync()
    cuda: int | str = "n/a (CPU)"
    if device == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            sync()
        cuda = sum("synchroniz" in str(w.message) for w in caught)
    with HostSyncCounter() as counter:
        fn()
    sync()
    return cuda, counter.total, counter.report().replace("\n", "; ")


def bench_syncs(args: argparse.Namespace) -> int:
    device = args.device
    print("| what | CUDA sync debug mode | CPU model (HostSyncCounter) | where (model) |")
    print("|---|---|---|---|", flush=True)
    H = 256
    for mode, dtype, backend in (("dropless", torch.bfloat16, "grouped_mm"), ("padded", torch.bfloat16, "grouped_mm"),
                                 ("drop", torch.bfloat16, "grouped_mm"), ("dropless", torch.float32, "grouped_mm"),
                                 ("dropless", torch.bfloat16, "loop")):
        capacity = {} if mode == "dropless" else {"expert_capacity_factor": 1.0,
                                                  "pad_expert_input_to_capacity": mode == "padded"}
        router = RouterConfig(num_experts=16, topk=2, aux_loss_coeff=0.01, **capacity)
        cfg = MoEConfig(num_experts=16, router=router, experts=ExpertsConfig(256, gemm_backend=backend),
                        dispatch=DispatchConfig(DispatcherKind.LOCAL), shared=SharedExpertsConfig(256))
        layer = build_moe_layer(cfg, H, ParallelDims.single(device), sequence_parallel=False, dtype=dtype,
                                device=device)
        x = torch.randn(512, 2, H, device=device, dtype=dtype, requires_grad=True)
        cuda, model, where = _sync_count(_loss_step(layer, x), device)
        name = f"MoE layer fwd+bwd, local {mode}, {str(dtype).split('.')[1]}, {backend}"
        print(f"| {name} | {cuda} | {model} | {where} |", flush=True)
    recipe, seq, vocab = args.train_recipe, args.train_seq, args.train_vocab
    cuda, model, where = _sync_count(_training_step(device, recipe, seq, vocab), device)
    print(f"| training step ({recipe} bf16, 4 micro-batches of {seq} tokens, vocabulary {vocab}), per step | {cuda} | "
          f"{model} | {where} |")
    return 0


def _training_step(device: str, recipe: str = "qwen3_moe_tiny", seq: int = 64,
                   vocab: int = 256) -> Callable[[], None]:
    """One optimizer step (4 micro-batches of ``seq`` random tokens) of ``recipe`` in bf16 per call."""
    import numpy as np

    from moefold.models.options import ModelOptions
    from moefold.models.recipes import get_recipe
    from moefold.training.config import RunConfig, TrainConfig
    from moefold.training.trainer import Trainer

    model = get_recipe(recipe).with_(vocab_size=vocab)
    train = TrainConfig(micro_batch_size=1, global_batch_size=4, seq_length=seq, train_iters=1000, bf16=True,
                        log_interval=1000, save=None)
    config = RunConfig(model=model, options=ModelOptions(dtype="bf16"), train=train, recipe=recipe)
    trainer = Trainer(config, ParallelDims.single(torch.device(device).type), device=device, log=lambda _m: None)
    data = np.random.default_rng(0).integers(0, vocab, size=(64, seq + 1), dtype=np.int64)

    def step() -> None:
        trainer.fit(data, stop_at=trainer.iteration + 1)

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="python -m moefold.tools.gpu.bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    m = sub.add_parser("moe-layer", help="MoE layer bf16 per GEMM backend vs the dense ceiling")
    m.add_argument("--tokens", type=int, default=8192)
    m.add_argument("--configs", default="128,8,768,2048;8,8,2048,7168;8,2,14336,4096",
                   help="E,k,F,H;... (default: Qwen3-30B-A3B; DeepSeek-V3's 8 local experts of EP32; Mixtral 8x7B)")
    m.add_argument("--backends", default="grouped_mm,grouped_gemm,te,loop")
    m.add_argument("--iters", type=int, default=5)
    m.add_argument("--warmup", type=int, default=2)
    m.add_argument("--matmul-size", type=int, default=8192, help="n of the n^3 bf16 matmul printed first")
    m.add_argument("--no-compile", action="store_true", help="leave out the compiled layer's row")
    m.add_argument("--deadline", type=float, default=float("inf"),
                   help="seconds after which no new row starts (its row says so)")
    s = sub.add_parser("syncs", help="host syncs per MoE layer and per training step: CUDA vs the CPU model")
    s.add_argument("--train-recipe", default="qwen3_moe_tiny", help="the training step's model (default "
                                                                     "qwen3_moe_tiny; the GPU check: qwen3_moe_proxy)")
    s.add_argument("--train-seq", type=int, default=64, help="tokens per micro-batch of the training step")
    s.add_argument("--train-vocab", type=int, default=256, help="the training step's vocabulary")
    for p in (m, s):
        p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                       help="cuda (default), or cpu: the GPU check's rehearsal of the same code paths")
    args = parser.parse_args(argv)
    return start(args.device) or (bench_moe_layer(args) if args.what == "moe-layer" else bench_syncs(args))


def start(device: str) -> int:
    """A measurement's first line: 0 after printing the machine; 2, saying why, when ``device`` is cuda and this
    machine has none."""
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (--device cpu rehearses the same code on the CPU)", file=sys.stderr)
        return 2
    print(describe_machine())
    return 0


if __name__ == "__main__":
    sys.exit(main())

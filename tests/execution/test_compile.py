"""``--compile``: 2 training steps of a tiny Qwen3-MoE equal eager, at world 1 and at tp2 x ep2.

Two steps: the second runs on weights the first step's optimizer update changed (the compiled graphs see new
values, not a fresh model); later steps repeat it.

Compared per step: the LM loss, the gradient norm and every parameter's reduced gradient (before the
optimizer: AdamW with clipping would hide a scaled gradient), then the final weights. fp32
tolerance: inductor's fused kernels reorder floating-point work (e.g. SwiGLU's backward in one
pass), so values agree to rounding, not bit for bit. One world-1 run and one 4-rank run in total
(compiling is the slow part; inductor caches the kernels on disk for later runs).
"""

from __future__ import annotations

import pytest
import torch

from moefold.execution.compile import compile_unavailable
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.load import communicate
from tests.training.trainer_common import tiny_config, tiny_data

pytestmark = pytest.mark.skipif(compile_unavailable("cpu") is not None, reason=str(compile_unavailable("cpu")))

STEPS = 2
TOL = dict(atol=1e-5, rtol=1e-4)       # losses, gradient norms, final weights
GRAD_TOL = dict(atol=2e-6, rtol=1e-4)  # gradients: measured differences are ~3e-7


def _steps(compile: bool, parallel: ParallelConfig, dims: ParallelDims, device: str = "cpu") -> dict:
    config = tiny_config(parallel, steps=STEPS, recipe="qwen3_moe_tiny", compile=compile)
    trainer = Trainer(config, dims, device=device, log=lambda _m: None)
    grads = []

    results = []

    def capture(result) -> None:  # the reduced gradients of this step, before the next step clears them
        results.append(result)
        grads.append({n: p.main_grad.detach().cpu() for n, p in trainer.model.named_parameters()})

    trainer.fit(tiny_data(), on_step=capture)
    out = {"loss": [r.loss_lm for r in results], "norm": [r.grad_norm for r in results], "grads": grads,
           "weights": {n: p.detach().cpu() for n, p in trainer.model.named_parameters()}}
    if compile:
        moe = [m for m in trainer.model.modules() if type(m).__name__ == "MoELayer"]
        out["compiled"] = (trainer.compiled.blocks, trainer.compiled.seconds(),
                           all(m.experts._activation is not m.experts._eager_activation for m in moe),
                           all(m.router._compiled_call_impl is not None for m in moe))
    return out


def _compare(eager: dict, compiled: dict, where: str) -> list[str]:
    failures = []
    for key in ("loss", "norm"):
        if not torch.allclose(torch.tensor(compiled[key]), torch.tensor(eager[key]), **TOL):
            failures.append(f"{where}: {key} per step {compiled[key]} vs eager {eager[key]}")
    for step, (g_c, g_e) in enumerate(zip(compiled["grads"], eager["grads"])):
        for name, g in g_e.items():
            if not torch.allclose(g_c[name], g, **GRAD_TOL):
                failures.append(f"{where}: step {step + 1} grad {name} differs by {(g_c[name] - g).abs().max():.2e}")
    for name, w in eager["weights"].items():
        if not torch.allclose(compiled["weights"][name], w, **TOL):
            failures.append(f"{where}: final weight {name} differs by {(compiled['weights'][name] - w).abs().max()}")
    blocks, seconds, fused, router = compiled["compiled"]
    if not (blocks == 2 and seconds > 0 and fused and router):
        failures.append(f"{where}: compiled {blocks} blocks in {seconds} s, fused activation {fused}, router {router}")
    return failures


def _tp2_ep2() -> list[str]:
    parallel = ParallelConfig(tp=2, ep=2)
    dims = ParallelDims.build(parallel)
    return _compare(_steps(False, parallel, dims), _steps(True, parallel, dims), "tp2 x ep2")


def test_compile_equals_eager_world1():
    dims = ParallelDims.single()
    failures = _compare(_steps(False, ParallelConfig(), dims), _steps(True, ParallelConfig(), dims), "world 1")
    assert not failures, "\n".join(failures)


def test_compile_equals_eager_tp2_ep2():
    results = run_distributed(_tp2_ep2, 4, timeout=600)
    failures = sorted({f for per_rank in results for f in per_rank})
    assert not failures, "\n".join(failures)


def test_cpu_kernel_cache_is_per_kernel_level(tmp_path) -> None:
    """Inductor's cache does not tell kernels built for one CPU kernel level from another's (reusing AVX-512 ones
    under ATEN_CPU_CAPABILITY=avx2 gave NaN losses and heap corruption): each level gets its own folder, and an
    explicit TORCHINDUCTOR_CACHE_DIR wins."""
    import os
    import subprocess
    import sys

    code = ("from moefold.execution.compile import use_cpu_kernel_cache; import os; use_cpu_kernel_cache(); "
            "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY")}

    def start(**extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code], env={**env, **extra}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    # the three interpreters start at once (each import of inductor takes seconds)
    procs = [start(), start(ATEN_CPU_CAPABILITY="default"), start(TORCHINDUCTOR_CACHE_DIR=str(tmp_path))]
    outs = [communicate(p, 120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    native, default, explicit = (out.strip() for out, _ in outs)
    assert native != default and default.endswith("cpu-default")
    assert explicit == str(tmp_path)

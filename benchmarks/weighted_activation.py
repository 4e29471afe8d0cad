"""The experts' weighted SwiGLU, forward + backward, against the same math done other ways (one process, CPU).

    python benchmarks/weighted_activation.py --cpu-time                 # bf16 and fp32, the layer's shapes a, b
    python benchmarks/weighted_activation.py --cpu-time --rows 8192 --ffn 1024 --dtypes bf16

``(silu(gate) * up * p).to(dtype)`` over ``h [N, 2F]`` and fp32 probs ``p [N]`` (the routing probs applied inside
the experts, Megatron-Core 0.16.1's order), gradients of ``h`` and ``p``. Rows, in the same rotated rounds:

- ``moefold``: ``moe.swiglu.swiglu_rows(h, p)`` (the default expert backend's; the probs' products in row blocks,
  ``moe.prob_rows``);
- ``moefold unweighted``: ``swiglu_rows(h)``, the floor: what the probs add is the difference;
- ``autograd formula``: ``moe.activation.weighted_product(swiglu, h, p)``, i.e. Megatron's
  ``activation_func_with_probs`` on the unfused path, by plain autograd ops;
- ``megatron fused``: Megatron-Core's ``weighted_bias_swiglu_impl`` (its ``--bias-activation-fusion`` path;
  TorchScript on CPU), when ``megatron-core`` is installed.

Shapes a and b are ``benchmarks/moe_layer.py``'s (T 4096: a = k 2, F 1024; b = k 8, F 256), N = T * k rows.
Printed: medians of fwd + bwd per row (ms) and each row's time over moefold's.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch

from moefold.moe.activation import swiglu, weighted_product
from moefold.moe.swiglu import swiglu_rows
from moefold.training.observe.machine import describe_machine

try:
    from benchmarks.moe_layer import DTYPES, _clock, rotated_medians
except ImportError:   # run as a script: benchmarks/ itself is on sys.path
    from moe_layer import DTYPES, _clock, rotated_medians

SHAPES = "8192,1024;32768,256"


def _megatron_weighted_swiglu():
    """Megatron-Core's fused weighted SwiGLU ``(h [N, 2F], None, p [N, 1]) -> [N, F]``, or None when absent."""
    try:
        from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
    except ImportError:
        return None
    return weighted_bias_swiglu_impl


def steps(N: int, F: int, dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    """Each way's fwd + bwd on the same ``h``, ``p`` and output gradient."""
    gen = torch.Generator().manual_seed(0)
    h = (3 * torch.randn(N, 2 * F, generator=gen)).to(dtype).requires_grad_()
    p = torch.rand(N, generator=gen).requires_grad_()
    g = torch.randn(N, F, generator=gen).to(dtype)
    p1 = p.detach().unsqueeze(1).requires_grad_()

    def run(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> Callable[[], None]:
        def step() -> None:
            torch.autograd.grad(fn(*args), [a for a in args if a.requires_grad], g)
        return step

    out = {"moefold": run(swiglu_rows, h, p), "moefold unweighted": run(swiglu_rows, h),
           "autograd formula": run(lambda h, p: weighted_product(swiglu, h, p), h, p1)}
    fused = _megatron_weighted_swiglu()
    if fused is not None:
        out["megatron fused"] = run(lambda h, p: fused(h, None, p), h, p1)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="N,F;N,F;... (rows, expert FFN)")
    ap.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32")
    ap.add_argument("--rounds", type=int, default=7, help="rotated rounds (medians)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpu-time", action="store_true", help="time with this process's CPU time (a shared machine)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    clock = _clock(a.cpu_time)
    print(describe_machine())
    print(f"# clock: {'process CPU' if a.cpu_time else 'wall'}; medians of {a.rounds} rotated rounds, fwd + bwd")
    print(f"{'dtype':5} {'N':>6} {'F':>5} {'way':20} {'ms':>8} {'/ moefold':>9}")
    for dname in a.dtypes.split(","):
        for spec in a.shapes.split(";"):
            N, F = (int(v) for v in spec.split(","))
            times = rotated_medians(steps(N, F, DTYPES[dname]), a.rounds, clock)
            for way, t in times.items():
                print(f"{dname:5} {N:6} {F:5} {way:20} {t * 1e3:8.1f} {t / times['moefold']:9.2f}", flush=True)
    print(f"# load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

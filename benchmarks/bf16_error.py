"""bf16 numerics: each tiny recipe's bf16 error against the same model in fp32, moefold beside HF and Megatron-Core.

    python -m benchmarks.bf16_error               # from the repository root (it uses tests/models); 4 seeds
    python -m benchmarks.bf16_error --recipes mixtral_tiny --seeds 8 --islands --plot bf16_error.png
    python -m benchmarks.bf16_error --recipes qwen3_next_tiny --first-seed 4 --batch 16   # a test's margin elsewhere

For every recipe of ``tests.models.hf_tiny.HF_TINY_RECIPES`` and seed: the weights are drawn once
(``tests.models.bf16_reference.reference_weights``: moefold's init, redrawn like the HF parity fixtures,
rounded to bf16), loaded into each system in fp32 and in bf16, and one batch (``--batch`` x ``--seq`` random
tokens) runs through both copies: logits, the next-token loss, every parameter's gradient and the experts each
token is routed to. A system's bf16 error is against its own fp32 run (the fp32 runs of all systems agree to
~1e-6): mean and max |logit difference|, |loss difference|, the gradients' relative error ||g16 - g32|| / ||g32||
and the share of (MoE layer, token) pairs routed as in fp32. Figures are means over seeds (max: the largest).

Systems: moefold; HF transformers' model of the same config (``to_hf_config``, SDPA attention); Megatron-Core
0.16.1's GPTModel (local spec, fp32 router) when ``megatron.core`` is installed and the recipe maps onto it
(``tests.models.megatron_tiny``; GQA families). ``--islands`` adds moefold with each of its bf16 path's fp32
islands removed in turn (``tests.models.bf16_reference.ISLAND_REMOVALS``): how much each one buys. ``--bisect``
adds moefold with one kind of module at a time run in fp32 inside the bf16 model (its parameters and inputs
upcast, its output rounded back, ``BISECT``): the method that found which operations carry the error.

Only the arithmetic differs between the runs, not the machine: the figures hold wherever torch's CPU kernels
are the same (bf16 GEMMs accumulate in fp32 on every x86 CPU torch supports). It prints the machine line, the
torch threads (``--threads``, one by default: the figures are the same at two, the time on a shared machine is
not) and the load.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from unittest import mock

import torch
from torch.func import functional_call
from torch.utils._pytree import tree_map

from moefold.dense.core_attention import CoreAttention
from moefold.dense.embedding import OutputHead
from moefold.dense.gated_deltanet import CausalConv1d, GatedDeltaNet, GatedRMSNorm
from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear
from moefold.dense.mlp import DenseMLP
from moefold.dense.norm import RMSNorm
from moefold.moe.experts import GroupedExperts
from moefold.moe.shared_experts import SharedExperts
from moefold.training.observe.machine import describe_machine
from tests.models.bf16_reference import (
    ISLAND_REMOVALS,
    Error,
    comparable_config,
    compare,
    hf_run,
    moefold_run,
    reference_weights,
    token_samples,
)
from tests.models.hf_tiny import HF_TINY_RECIPES
from tests.models.megatron_tiny import megatron_available, megatron_runs, megatron_supports


@contextlib.contextmanager
def modules_in_fp32(*classes: type) -> Iterator[None]:
    """Every module of ``classes`` runs in fp32 inside a bf16 model: its parameters and floating inputs upcast
    (exactly: they hold bf16 values), its floating outputs rounded back to its input's dtype."""
    originals = {cls: cls.forward for cls in classes}

    def wrap(forward: Callable) -> Callable:
        @functools.wraps(forward)
        def fp32_forward(self, *args, **kwargs):
            if getattr(self, "_bisect_in_fp32", False):     # the inner call of functional_call below
                return forward(self, *args, **kwargs)
            dtype = next((a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point()), None)

            def up(t):
                return t.float() if torch.is_tensor(t) and t.is_floating_point() else t

            def down(t):
                return t.to(dtype) if torch.is_tensor(t) and t.dtype == torch.float32 and dtype else t

            self._bisect_in_fp32 = True
            try:
                out = functional_call(self, {n: p.float() for n, p in self.named_parameters()}, tree_map(up, args),
                                      tree_map(up, kwargs))
            finally:
                self._bisect_in_fp32 = False
            return tree_map(down, out)
        return fp32_forward

    for cls, forward in originals.items():
        cls.forward = wrap(forward)
    try:
        yield
    finally:
        for cls, forward in originals.items():
            cls.forward = forward


def _rope_in_fp32() -> contextlib.AbstractContextManager:
    from moefold.dense.rope import apply_rotary

    def rotary(x, cos, sin, interleaved=False):
        return apply_rotary(x.float(), cos, sin, interleaved).to(x.dtype)

    stack = contextlib.ExitStack()
    for target in ("moefold.dense.rope.apply_rotary", "moefold.dense.mla.apply_rotary"):   # GQA: apply_partial_rotary
        stack.enter_context(mock.patch(target, rotary))
    return stack


def _projections_in_fp32() -> contextlib.AbstractContextManager:
    """The tp linear layers in fp32, also where a caller runs the local GEMM alone (``forward_local``: the q/k/v
    and DeltaNet input projections, which enter the tp region once for several layers)."""
    def forward_local(self, x):
        bias = None if self.bias is None else self.bias.float()
        return self.local_gemm(x.float(), self.weight.float(), bias).to(x.dtype)

    stack = contextlib.ExitStack()
    stack.enter_context(modules_in_fp32(ColumnParallelLinear, RowParallelLinear))
    stack.enter_context(mock.patch.object(ColumnParallelLinear, "forward_local", forward_local))
    return stack


# {what runs in fp32: () -> context manager}; the combine's and the norms' fp32 are moefold's own since issue 37
BISECT: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "RMSNorm": lambda: modules_in_fp32(RMSNorm, GatedRMSNorm),
    "core attention": lambda: modules_in_fp32(CoreAttention),
    "DeltaNet convolution": lambda: modules_in_fp32(CausalConv1d),
    "DeltaNet mixers (whole)": lambda: modules_in_fp32(GatedDeltaNet),
    "RoPE": _rope_in_fp32,
    "attention projections": _projections_in_fp32,
    "routed experts": lambda: modules_in_fp32(GroupedExperts),
    "shared experts, dense MLP": lambda: modules_in_fp32(SharedExperts, DenseMLP),
    "output head": lambda: modules_in_fp32(OutputHead),
}


HEADER = f"{'recipe':18s} {'system':40s} {'logits mean':>11s} {'logits max':>10s} {'loss':>9s} {'grad rel':>9s} " \
         f"{'routing':>8s}"


def row(recipe: str, system: str, e: Error) -> str:
    return (f"{recipe:18s} {system:40s} {e.logits_mean:11.3e} {e.logits_max:10.3g} {e.loss:9.2e} {e.grad:9.4f} "
            f"{e.routing:8.4f}")


def measure(recipe: str, seeds: int, batch: int, seq: int, megatron: bool, islands: bool,
            bisect: bool = False, first_seed: int = 0) -> dict[str, Error]:
    """{system: mean Error over seeds ``first_seed ..``} for one recipe."""
    errors: dict[str, list[Error]] = {}
    for seed in range(first_seed, first_seed + seeds):
        config, state = reference_weights(recipe, seed)
        samples = token_samples(config, seed, batch, seq)
        ref = moefold_run(config, state, torch.float32, samples)
        errors.setdefault("moefold", []).append(compare(moefold_run(config, state, torch.bfloat16, samples), ref))
        errors.setdefault("HF transformers", []).append(
            compare(hf_run(config, state, torch.bfloat16, samples), hf_run(config, state, torch.float32, samples)))
        if megatron:
            low, high = megatron_runs([(config, state, torch.bfloat16, samples),
                                       (config, state, torch.float32, samples)])
            errors.setdefault("Megatron-Core", []).append(compare(low, high))
        if islands:
            for name, removed in ISLAND_REMOVALS.items():
                with removed():
                    low = moefold_run(config, state, torch.bfloat16, samples)
                errors.setdefault(f"moefold without {name}", []).append(compare(low, ref))
        if bisect:
            for name, in_fp32 in BISECT.items():
                with in_fp32():
                    low = moefold_run(config, state, torch.bfloat16, samples)
                errors.setdefault(f"moefold, {name} in fp32", []).append(compare(low, ref))
    return {system: Error.mean(e) for system, e in errors.items()}


def plot(results: dict[str, dict[str, Error]], path: str) -> None:
    """Top: each system's mean logit error per recipe. Below (with ``--islands``): moefold's error with each
    fp32 island removed, relative to moefold's own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recipes = list(results)
    systems = [s for s in ("moefold", "HF transformers", "Megatron-Core") if any(s in r for r in results.values())]
    removed = list(dict.fromkeys(s for r in results.values() for s in r if s.startswith("moefold without ")))
    fig, axes = plt.subplots(2 if removed else 1, 1, figsize=(2 + 1.4 * len(recipes), 8 if removed else 4.5),
                             squeeze=False)
    ax = axes[0][0]
    width = 0.8 / len(systems)
    for j, system in enumerate(systems):
        xs = [i + j * width for i, r in enumerate(results.values()) if system in r]
        ax.bar(xs, [r[system].logits_mean for r in results.values() if system in r], width, label=system)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(recipes))], recipes, rotation=30, ha="right")
    ax.set_ylabel("mean |logit error|, bf16 vs fp32")
    ax.set_title("each system against its own fp32 run")
    ax.legend(fontsize=8)
    if removed:
        ax = axes[1][0]
        width = 0.8 / len(removed)
        for j, system in enumerate(removed):
            ax.bar([i + j * width for i in range(len(recipes))],
                   [r[system].logits_mean / r["moefold"].logits_mean for r in results.values()], width,
                   label=system.removeprefix("moefold without "))
        ax.axhline(1.0, color="black", linewidth=0.8)
        top = max(r[s].logits_mean / r["moefold"].logits_mean for r in results.values() for s in removed)
        ax.set_ylim(0.8, 1.15 * top)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(recipes))], recipes, rotation=30, ha="right")
        ax.set_ylabel("mean |logit error| / moefold's")
        ax.set_title("moefold without one fp32 island (removed)")
        ax.legend(fontsize=8, ncol=len(removed), loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=list(HF_TINY_RECIPES), choices=HF_TINY_RECIPES,
                   help="tiny recipes to measure (those with an HF model class)")
    p.add_argument("--seeds", type=int, default=4, help="weight/token draws per recipe (figures are their mean)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="the first draw's seed (the accuracy tests use 0..3; later ones check their margins)")
    p.add_argument("--batch", type=int, default=8, help="sequences per batch")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--islands", action="store_true", help="also moefold with each fp32 island removed in turn")
    p.add_argument("--bisect", action="store_true",
                   help="also moefold with one kind of module at a time run in fp32 inside the bf16 model")
    p.add_argument("--no-megatron", action="store_true", help="skip Megatron-Core even where it is installed")
    p.add_argument("--plot", metavar="PNG", help="bar chart of the mean logit error per recipe and system")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (the figures do not depend on it; on a shared machine more than one "
                        "made Qwen3-Next's delta rule 10-300x slower)")
    args = p.parse_args(argv)
    for name, value in (("--seeds", args.seeds), ("--batch", args.batch), ("--seq", args.seq),
                        ("--threads", args.threads)):
        if value < 1:
            print(f"bf16_error: {name}={value} must be >= 1", file=sys.stderr)
            return 2
    if args.first_seed < 0:
        print(f"bf16_error: --first-seed={args.first_seed} must be >= 0", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    megatron = megatron_available() and not args.no_megatron
    print(describe_machine())
    print(f"# torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    print(f"# bf16 vs fp32 on the same bf16-rounded weights: {args.seeds} seeds ({args.first_seed}.."
          f"{args.first_seed + args.seeds - 1}) x {args.batch} x {args.seq} tokens; "
          f"mean over seeds (logits max: the largest); Megatron-Core "
          f"{'installed' if megatron else 'not installed' if not megatron_available() else 'skipped'}")
    print(HEADER, flush=True)
    results = {}
    for recipe in args.recipes:
        reason = megatron_supports(comparable_config(recipe)) if megatron else None
        res = measure(recipe, args.seeds, args.batch, args.seq, megatron and reason is None, args.islands,
                      args.bisect, args.first_seed)
        for system, e in res.items():
            print(row(recipe, system, e), flush=True)
        hf = res["HF transformers"]
        print(f"{recipe:18s} {'moefold / HF':40s} {res['moefold'].logits_mean / hf.logits_mean:11.2f}x "
              f"{'':10s} {'':9s} {res['moefold'].grad / hf.grad:8.2f}x "
              f"{res['moefold'].routing - hf.routing:+8.4f}", flush=True)
        if reason is not None:
            print(f"{recipe:18s} {'Megatron-Core':40s} n/a: {reason}", flush=True)
        results[recipe] = res
    if args.plot:
        plot(results, args.plot)
        print(f"# plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""bf16 numerics: each tiny recipe's bf16 error against the same model in fp32, moefold beside HF and Megatron-Core.

    python -m benchmarks.bf16_error               # from the repository root (it uses tests/models); 4 seeds
    python -m benchmarks.bf16_error --recipes mixtral_tiny --seeds 8 --islands --plot bf16_error.png

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
islands removed in turn (``tests.models.bf16_reference.ISLAND_REMOVALS``): how much each one buys.

Only the arithmetic differs between the runs, not the machine: the figures hold wherever torch's CPU kernels
are the same (bf16 GEMMs accumulate in fp32 on every x86 CPU torch supports). It prints the machine line.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moefold.training.machine import describe_machine
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
from tests.models.megatron_tiny import megatron_available, megatron_run, megatron_supports

HEADER = f"{'recipe':18s} {'system':26s} {'logits mean':>11s} {'logits max':>10s} {'loss':>9s} {'grad rel':>9s} " \
         f"{'routing':>8s}"


def row(recipe: str, system: str, e: Error) -> str:
    return (f"{recipe:18s} {system:26s} {e.logits_mean:11.3e} {e.logits_max:10.3g} {e.loss:9.2e} {e.grad:9.4f} "
            f"{e.routing:8.4f}")


def measure(recipe: str, seeds: int, batch: int, seq: int, megatron: bool, islands: bool) -> dict[str, Error]:
    """{system: mean Error over seeds} for one recipe."""
    errors: dict[str, list[Error]] = {}
    for seed in range(seeds):
        config, state = reference_weights(recipe, seed)
        samples = token_samples(config, seed, batch, seq)
        ref = moefold_run(config, state, torch.float32, samples)
        errors.setdefault("moefold", []).append(compare(moefold_run(config, state, torch.bfloat16, samples), ref))
        errors.setdefault("HF transformers", []).append(
            compare(hf_run(config, state, torch.bfloat16, samples), hf_run(config, state, torch.float32, samples)))
        if megatron:
            errors.setdefault("Megatron-Core", []).append(
                compare(megatron_run(config, state, torch.bfloat16, samples),
                        megatron_run(config, state, torch.float32, samples)))
        if islands:
            for name, removed in ISLAND_REMOVALS.items():
                with removed():
                    low = moefold_run(config, state, torch.bfloat16, samples)
                errors.setdefault(f"moefold without {name}", []).append(compare(low, ref))
    return {system: Error.mean(e) for system, e in errors.items()}


def plot(results: dict[str, dict[str, Error]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = sorted({s for r in results.values() for s in r}, key=lambda s: (s.startswith("moefold without"), s))
    fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(results) * len(systems) / 3, 4))
    width = 0.8 / len(systems)
    for j, system in enumerate(systems):
        xs = [i + j * width for i, r in enumerate(results.values()) if system in r]
        ys = [r[system].logits_mean for r in results.values() if system in r]
        ax.bar(xs, ys, width, label=system)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))], list(results))
    ax.set_ylabel("mean |logit error| bf16 vs fp32")
    ax.set_title("bf16 error against the same model in fp32 (same bf16 weights)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=list(HF_TINY_RECIPES), choices=HF_TINY_RECIPES,
                   help="tiny recipes to measure (those with an HF model class)")
    p.add_argument("--seeds", type=int, default=4, help="weight/token draws per recipe (figures are their mean)")
    p.add_argument("--batch", type=int, default=8, help="sequences per batch")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--islands", action="store_true", help="also moefold with each fp32 island removed in turn")
    p.add_argument("--no-megatron", action="store_true", help="skip Megatron-Core even where it is installed")
    p.add_argument("--plot", metavar="PNG", help="bar chart of the mean logit error per recipe and system")
    args = p.parse_args(argv)
    for name, value in (("--seeds", args.seeds), ("--batch", args.batch), ("--seq", args.seq)):
        if value < 1:
            print(f"bf16_error: {name}={value} must be >= 1", file=sys.stderr)
            return 2
    megatron = megatron_available() and not args.no_megatron
    print(describe_machine())
    print(f"# bf16 vs fp32 on the same bf16-rounded weights: {args.seeds} seeds x {args.batch} x {args.seq} tokens; "
          f"mean over seeds (logits max: the largest); Megatron-Core "
          f"{'installed' if megatron else 'not installed' if not megatron_available() else 'skipped'}")
    print(HEADER, flush=True)
    results = {}
    for recipe in args.recipes:
        reason = megatron_supports(comparable_config(recipe)) if megatron else None
        res = measure(recipe, args.seeds, args.batch, args.seq, megatron and reason is None, args.islands)
        for system, e in res.items():
            print(row(recipe, system, e), flush=True)
        hf = res["HF transformers"]
        print(f"{recipe:18s} {'moefold / HF':26s} {res['moefold'].logits_mean / hf.logits_mean:11.2f}x "
              f"{'':10s} {'':9s} {res['moefold'].grad / hf.grad:8.2f}x "
              f"{res['moefold'].routing - hf.routing:+8.4f}", flush=True)
        if reason is not None:
            print(f"{recipe:18s} {'Megatron-Core':26s} n/a: {reason}", flush=True)
        results[recipe] = res
    if args.plot:
        plot(results, args.plot)
        print(f"# plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

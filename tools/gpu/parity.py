"""Correct on CUDA: whole tiny models' forward and backward on the device against the CPU, for the GPU check.

    python -m moefold.tools.gpu.parity --device cuda     # the GPU check's "correct on CUDA" rows
    python -m moefold.tools.gpu.parity --device cpu      # its rehearsal (below)

For each of qwen3_moe_tiny (GQA, qk-norm, softmax top-k), deepseek_v3_tiny (MLA, MTP, group-limited sigmoid
routing with expert bias, a dense first layer, shared experts) qwen3_next_tiny (Gated DeltaNet, gated
attention), deepseek_v32_tiny (DeepSeek sparse attention: the lightning indexer and top-k MLA), nemotron_h_tiny
(Mamba-2's chunked scan, relu2 experts) and deepseek_v4_tiny (compressed attentions, hyper-connections, hash
routing): the recipe's model is built and initialised on the CPU in fp32, its state copied into a second model
built on ``--device`` (``device=``, as ``moefold train`` builds it), and both run one forward
(logits ``[B, S, V]``) and one forward + backward of the training loss (LM + MoE balancing + MTP) on the same
tokens ``[B, S + 1]``. TF32 is off (``torch.backends.cuda.matmul.fp32_precision = "ieee"``, cuDNN's too), so
the two devices differ only in the order of their fp32 sums. Compared: the logits, the loss and every parameter's
gradient (by name), each tensor's largest element-wise difference against its limit; the row shows the
differences relative to each tensor's scale (its largest element), the worst gradient by name with the share of
its limit it used, the CPU run's own rounding error (against the same model in float64 on the CPU), and which
(layer, token) pairs the routers sent elsewhere (a near tie flipped: then the difference is not rounding).

Tolerance, fp32, per tensor: the larger of two bounds on how far two fp32 evaluations in different orders fall
apart. (1) From the arithmetic: each run is off the exact result by about ``u sqrt(K) sqrt(D)`` of the tensor's
scale (``u = 2^-24`` fp32's unit roundoff, ``K`` the longest sum in the model: hidden, FFN, vocabulary (the
softmax's normaliser) or tokens (the weight gradients), ``D`` the sequential operations: ``2 (8 blocks + 2)`` for
forward and backward, 8 per block: norm, q/k/v, scores, weighted sum, output projection, norm, up, down), so two
runs differ by at most twice that: ``2 u sqrt(K) sqrt(D)``, 1.6e-5 to 2.7e-5 of the scale for these models at
2 x 64 tokens (the 1e-5 of issue 42 is its order). (2) Measured, as tests/tolerance.py bounds parallel layouts:
``FACTOR = 8`` times the CPU's own fp32 error on that tensor (twice for two evaluations, 4x for another order),
which is the larger bound where a sum cancels (a norm weight's gradient: a large error against a small result);
the CPU's own error measured 0.4e-6 to 2e-6 of the scale here (3.3e-5 for deepseek_v4_tiny's and 4.8e-5 for
nemotron_h_tiny's logits, where bound (2) governs). A real defect is off by the size of the tensor.

Tolerance, bf16: the same model with bf16 parameters (routers fp32, as ``--bf16`` trains) on the same weights
rounded to bf16 (so both runs hold the same values and only the arithmetic differs) against its fp32 run on the
device: a rounding of ``u = 2^-8`` at each of the ``D`` operations moves a logit by about ``u sqrt(D) max|z|``;
a token's loss ``lse(z) - z_label`` moves by at most twice the largest logit change, so
``|loss_bf16 - loss_fp32| <= 2 u sqrt(D) max|z|`` (0.03-0.05 here at init; measured 1e-5 to 7e-4 on the CPU).

Rehearsal (``--device cpu``): the "device" model is a second CPU model built the same way, so every call runs and
every comparison is made, but its differences are zero (the same ops in the same order); its figures say nothing
about a GPU. Every line printed is a result; the exit code is 1 when a row failed.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from moefold.models.config import ModelConfig
from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.moe.router import Router
from moefold.parallel.dims import ParallelDims

# the 2025 families' attention and routing kinds, then the 2026 pieces no GPU has run yet: DeepSeek sparse
# attention (indexer + top-k MLA), Mamba-2's chunked scan, V4's compressed attentions, mHC and hash routing
MODELS = ("qwen3_moe_tiny", "deepseek_v3_tiny", "qwen3_next_tiny", "deepseek_v32_tiny", "nemotron_h_tiny",
          "deepseek_v4_tiny")
U_FP32, U_BF16 = 2.0 ** -24, 2.0 ** -8
FACTOR = 8.0   # tests/tolerance.py's: two fp32 evaluations' errors (2x), room for another summation order (4x)
OPS_PER_BLOCK = 8


@dataclass
class Run:
    """One model's results, on the host in float64: logits [B, S, V], the loss, gradients by name, and per MoE
    layer the [T, K] expert ids its router chose in the logits' forward."""

    logits: Tensor
    loss: float
    grads: dict[str, Tensor]
    routes: list[Tensor]


def depth(config: ModelConfig) -> int:
    """D: sequential operations of a forward and a backward (module docstring)."""
    return 2 * (OPS_PER_BLOCK * (config.num_layers + config.mtp_num_layers) + 2)


def longest_sum(config: ModelConfig, tokens: int) -> int:
    """K: the longest sum: hidden, FFN and expert FFN sizes, the vocabulary, or the tokens a weight gradient sums."""
    return max(config.hidden_size, config.ffn_hidden_size or 0, config.moe_ffn_hidden_size or 0, config.vocab_size,
               tokens)


def fp32_tolerance(config: ModelConfig, tokens: int) -> float:
    return 2 * U_FP32 * math.sqrt(longest_sum(config, tokens)) * math.sqrt(depth(config))


def bf16_loss_tolerance(config: ModelConfig, max_logit: float) -> float:
    return 2 * U_BF16 * math.sqrt(depth(config)) * max_logit


def build(config: ModelConfig, state: dict[str, Tensor], device: str, dtype: str = "fp32") -> MoEDecoder:
    """``config``'s model built on ``device`` (``device=``, as the trainer builds it) holding ``state``."""
    dims = ParallelDims.single(torch.device(device).type)
    model = MoEDecoder(config, dims=dims, options=ModelOptions(dtype=dtype), device=device)
    model.load_state_dict(state)
    return model


def run(model: MoEDecoder, samples: Tensor) -> Run:
    """Logits (one forward) and the loss and gradients (forward + backward) of ``model`` on ``samples`` [B, S+1]."""
    device = next(model.parameters()).device
    ids, labels = samples[:, :-1].to(device), samples[:, 1:].to(device)
    routes: list[Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _a, out: routes.append(out.routing.expert_ids_TK.cpu()))
             for m in model.modules() if isinstance(m, Router)]
    logits = model.logits(ids)
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    out = model(ids, labels)
    out.loss.backward()
    grads = {n: (torch.zeros(p.shape) if p.grad is None else p.grad.detach().cpu()).double()
             for n, p in model.named_parameters()}
    return Run(logits.detach().cpu().double(), float(out.loss.detach()), grads, routes)


def rel(a: Tensor, b: Tensor) -> float:
    """max|a - b| relative to max|b| (the tensor's scale; an all-zero b compares absolutely)."""
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


def used(got: Tensor, ref: Tensor, exact: Tensor, tol: float) -> float:
    """The share of its fp32 limit ``got``'s largest difference from ``ref`` takes (<= 1: within): the limit is
    the larger of ``tol`` times the scale and ``FACTOR`` times ``ref``'s own error against ``exact`` (float64)."""
    if not ref.numel():
        return 0.0
    diff = float((got - ref).abs().max())
    limit = max(tol * float(exact.abs().max()), FACTOR * float((ref - exact).abs().max()))
    return diff / limit if limit > 0 else (0.0 if diff == 0 else math.inf)


@dataclass
class Diff:
    """``a`` against ``b``: relative differences (``rel``) of the logits, the loss and the worst gradient."""

    logits: float
    loss: float
    grad: float
    grad_name: str


def diff(a: Run, b: Run) -> Diff:
    if a.grads.keys() != b.grads.keys():
        raise RuntimeError(f"the two models' parameters differ: {sorted(a.grads.keys() ^ b.grads.keys())[:4]}")
    grad, name = max(((rel(a.grads[n], g), n) for n, g in b.grads.items()), default=(0.0, "-"))
    return Diff(rel(a.logits, b.logits), abs(a.loss - b.loss) / max(abs(b.loss), 1e-30), grad, name)


def rerouted(a: Run, b: Run) -> str:
    """How many (MoE layer, token) pairs chose other experts in ``a`` than in ``b``."""
    moved = sum(int((x.sort(-1).values != y.sort(-1).values).any(-1).sum()) for x, y in zip(a.routes, b.routes))
    total = sum(y.shape[0] for y in b.routes)
    return "same routing" if moved == 0 else f"{moved} of {total} (layer, token) routings differ (a near tie)"


def check_model(recipe: str, device: str, batch: int, seq: int, seed: int = 0) -> list[str]:
    """The table rows of one recipe: fp32 device vs CPU, bf16 vs fp32 on the device."""
    config = get_recipe(recipe)
    cpu = MoEDecoder(config)
    cpu.init_weights(seed)
    state = {k: v.detach().clone() for k, v in cpu.state_dict().items()}
    samples = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    ref = run(cpu, samples)
    exact = run(build(config, state, "cpu").double(), samples)   # the CPU's own fp32 rounding error
    dev = run(build(config, state, device), samples)
    d, own = diff(dev, ref), diff(ref, exact)
    tol = fp32_tolerance(config, batch * seq)
    one = torch.ones(())
    shares = {"logits": used(dev.logits, ref.logits, exact.logits, tol),
              "loss": used(dev.loss * one, ref.loss * one, exact.loss * one, tol)}
    shares.update({n: used(dev.grads[n], g, exact.grads[n], tol) for n, g in ref.grads.items()})
    worst = max(shares, key=shares.get)
    grad = max(ref.grads, key=lambda n: shares[n], default="-")
    verdict = (f"passed (worst: {worst} at {shares[worst]:.2f} of its limit)" if shares[worst] <= 1 else
               f"failed: {worst} at {shares[worst]:.2f} of its limit")
    grad_diff = rel(dev.grads[grad], ref.grads[grad]) if grad in ref.grads else 0.0
    rows = [f"| {recipe} | fp32 {device} vs cpu | {d.logits:.2e} | {d.loss:.2e} | {grad_diff:.2e} ({grad}: "
            f"{shares.get(grad, 0.0):.2f} of its limit) | {max(own.logits, own.loss, own.grad):.2e} | {tol:.2e} | "
            f"{rerouted(dev, ref)} | {verdict} |"]
    # bf16: the same weights rounded to bf16 in both runs, so only the arithmetic differs
    rounded = {k: (v.bfloat16().to(v.dtype) if v.is_floating_point() else v) for k, v in state.items()}
    r32, r16 = run(build(config, rounded, device), samples), run(build(config, rounded, device, "bf16"), samples)
    max_logit = float(r32.logits.abs().max())
    tol16 = bf16_loss_tolerance(config, max_logit)
    err = abs(r16.loss - r32.loss)
    g = diff(r16, r32)
    ok16 = math.isfinite(r16.loss) and err <= tol16
    rows.append(f"| {recipe} | bf16 step loss vs fp32 ({device}) | {g.logits:.2e} | loss diff {err:.2e} "
                f"({r32.loss:.4f} fp32) | {g.grad:.2e} ({g.grad_name}) | | {tol16:.2e} | {rerouted(r16, r32)} | "
                + ("passed |" if ok16 else f"failed: loss diff {err:.2e} > {tol16:.2e} |"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m moefold.tools.gpu.parity",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default), or cpu: the GPU check's rehearsal (a second CPU model)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"recipes, comma-separated (default {MODELS})")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)   # the host's share is tiny models: more threads only add their spin-waits
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device (--device cpu rehearses the same code on the CPU)", file=sys.stderr)
            return 2
        torch.backends.cuda.matmul.fp32_precision = "ieee"   # no TF32: fp32 GEMMs as on the CPU
        torch.backends.cudnn.conv.fp32_precision = "ieee"    # the DeltaNet convolution's cuDNN kernels too
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; TF32 "
              f"off; against the CPU ({torch.get_num_threads()} thread)")
    else:
        print("device: cpu (a rehearsal: the device model is a second CPU model; its differences are zero)")
    print("| model | what | logits | loss | worst gradient | CPU fp32 vs fp64 | tolerance (of the scale) | routing | "
          "result |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    failed = False
    for recipe in args.models.split(","):
        try:
            rows = check_model(recipe, args.device, args.batch, args.seq)
        except Exception as err:   # one model's failure is its row; the others still run
            rows = [f"| {recipe} | | | | | | | | failed: {type(err).__name__}: {str(err).splitlines()[0][:200]} |"]
        failed = failed or any("| failed" in r for r in rows)
        print("\n".join(rows), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

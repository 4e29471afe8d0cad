"""bf16 against fp32 on the same weights: moefold and HF transformers (Megatron-Core: tests/models/megatron_tiny.py).

    config, state = reference_weights("mixtral_tiny", seed=0)       # HF-named tensors, bf16-representable
    samples = token_samples(config, seed=0)                           # [B, S + 1] ids
    err = compare(moefold_run(config, state, torch.bfloat16, samples),
                  moefold_run(config, state, torch.float32, samples))  # Error: logits, loss, grads, routing

Each system computes the same model twice, in fp32 and in bf16, on the same weights: drawn once (moefold's
init, then redrawn as ``hf_tiny.perturb_weights`` does for HF models: norms around 1, routers that decide)
and rounded to bf16, so the bf16 copy holds exactly the fp32 copy's values and every difference between the
two runs is the bf16 arithmetic. A system's bf16 error is measured against its own fp32 run (fp32 moefold
and fp32 HF agree to ~1e-6 on these weights, tests/models/test_hf_interop.py).

The comparison config is the recipe with its MoE balancing losses and MTP off (``comparable_config``):
HF computes neither, so the loss and its gradients are the LM loss's alone in every system.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn.functional as F
from torch import Tensor

from moefold.dense.norm import RMSNorm
from moefold.models.config import ModelConfig
from moefold.models.decoder import MoEDecoder
from moefold.models.hf.config_map import to_hf_config
from moefold.models.hf.exporter import hf_tensors
from moefold.models.hf.importer import load_weights
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.models.tensor_io import DictReader
from moefold.moe.router import Router
from tests.models.hf_tiny import perturb_weights

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


# ----------------------------------------------------------------------------------------------- fp32 islands
# Each fp32 island of moefold's bf16 path is made by one function; removing the island is patching that function
# with its low-precision counterpart (unittest.mock.patch, so it is undone on exit).
def _rms_norm_in_input_dtype(x: Tensor, weight: Tensor, eps: float, *, zero_centered_gamma: bool = False) -> Tensor:
    """RMSNorm with no fp32 island: every step in x's dtype (its reductions still accumulate in fp32 inside)."""
    gamma = (1.0 + weight.float()).to(x.dtype) if zero_centered_gamma else weight.to(x.dtype)
    return gamma * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _attention_in_input_dtype(q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, *, scale: float,
                              sliding_window: int | None = None, sinks: Tensor | None = None) -> Tensor:
    """Attention with bf16 scores and probabilities (Megatron-Core's unfused attention with
    ``attention_softmax_in_fp32=False``): q k^T rounded to q's dtype, the softmax taken and returned in it
    (with ``sinks [h]``: one more logit per head in the softmax's denominator, as GPT-OSS's)."""
    from moefold.dense.context_parallel import position_mask

    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~position_mask(position_ids, position_ids, sliding_window), float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v)


def _conv_silu_in_input_dtype(x_BCT: Tensor, weight_CK: Tensor) -> Tensor:
    """The DeltaNet convolution with no fp32 island: the convolution rounded to x's dtype, then the silu (HF's
    plain-torch ``causal_conv1d_fn`` fallback; Megatron-Core's ``deterministic_mode`` path)."""
    C, K = weight_CK.shape
    return F.silu(F.conv1d(x_BCT, weight_CK.to(x_BCT.dtype).view(C, 1, K), groups=C))


def _output_gate_in_input_dtype(out: Tensor, gate: Tensor) -> Tensor:
    """Gated attention's gate with no fp32 island: the sigmoid rounded, then the product (HF's Qwen3-Next)."""
    return out * torch.sigmoid(gate)


def _no_upcast(t: Tensor) -> Tensor:
    return t


def _same_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype


def _router_dtype_bf16(_config) -> torch.dtype:
    return torch.bfloat16


def _patches(*targets: tuple[str, object]) -> AbstractContextManager:
    stack = ExitStack()
    for target, replacement in targets:
        stack.enter_context(mock.patch(target, replacement))
    return stack


# {island: () -> context manager under which moefold runs without that fp32 island}
ISLAND_REMOVALS: dict[str, Callable[[], AbstractContextManager]] = {
    "fp32 RMSNorm": lambda: _patches(("moefold.dense.norm.rms_norm", _rms_norm_in_input_dtype)),
    "fp32 attention softmax": lambda: _patches(("moefold.dense.core_attention.local_attention",
                                                _attention_in_input_dtype)),
    "fp32 router": lambda: _patches(("moefold.moe.router.router_dtype", _router_dtype_bf16)),
    "fp32 combine": lambda: _patches(("moefold.dispatch.permutation.combine_dtype", _same_dtype),
                                     ("moefold.dispatch.alltoall.combine_dtype", _same_dtype)),
    "fp32 cross entropy": lambda: _patches(("moefold.dense.cross_entropy.upcast_logits", _no_upcast)),
    "fp32 DeltaNet convolution": lambda: _patches(("moefold.dense.gated_deltanet.causal_conv_silu",
                                                   _conv_silu_in_input_dtype)),
    "fp32 output gate": lambda: _patches(("moefold.dense.attention.output_gate", _output_gate_in_input_dtype)),
}


@dataclass(frozen=True)
class Run:
    """One forward (logits) and one forward + backward (loss, gradients) of a model on ``samples``.

    logits: [B, S, V] fp32 (upcast from the model's output dtype)
    loss:   token-mean next-token cross entropy (NaN when not computed)
    grads:  every parameter's gradient as fp32, in the model's parameter order (empty when not computed)
    routes: per MoE layer, [T, E] bool: the experts each token was sent to (the forward of ``logits``)
    """

    logits: Tensor
    loss: float
    grads: list[Tensor]
    routes: list[Tensor]


@dataclass(frozen=True)
class Error:
    """A bf16 run against the fp32 run of the same system.

    logits_mean / logits_max: mean / max |logit difference|
    loss:    |loss difference|
    grad:    relative error of all gradients together, ||g16 - g32|| / ||g32||
    routing: share of (MoE layer, token) pairs routed to the same experts as in fp32
    """

    logits_mean: float
    logits_max: float
    loss: float
    grad: float
    routing: float

    @staticmethod
    def mean(errors: Iterable[Error]) -> Error:
        """Mean over several runs (seeds) of each figure; the max of the max."""
        errors = list(errors)
        n = len(errors)
        return Error(logits_mean=sum(e.logits_mean for e in errors) / n, logits_max=max(e.logits_max for e in errors),
                     loss=sum(e.loss for e in errors) / n, grad=sum(e.grad for e in errors) / n,
                     routing=sum(e.routing for e in errors) / n)


def compare(low: Run, ref: Run) -> Error:
    """``low`` (bf16) against ``ref`` (fp32, the same system and weights)."""
    diff = (low.logits - ref.logits).abs()
    num = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(low.grads, ref.grads)))
    den = math.sqrt(sum(float(b.pow(2).sum()) for b in ref.grads)) if ref.grads else float("nan")
    same = sum(int((a == b).all(-1).sum()) for a, b in zip(low.routes, ref.routes))
    total = sum(b.shape[0] for b in ref.routes)
    return Error(logits_mean=float(diff.mean()), logits_max=float(diff.max()), loss=abs(low.loss - ref.loss),
                 grad=num / den, routing=same / total if total else 1.0)


# ----------------------------------------------------------------------------------------------- weights and data
def comparable_config(recipe: str) -> ModelConfig:
    """The recipe without MoE balancing losses and MTP (HF computes neither)."""
    return get_recipe(recipe).with_(moe_aux_loss_coeff=0.0, mtp_num_layers=0)


def reference_weights(recipe: str, seed: int = 0) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(comparison config, HF-named fp32 tensors with bf16-representable values; experts in HF's fused layout)."""
    config = comparable_config(recipe)
    model = MoEDecoder(config)
    model.init_weights(seed)
    state = {n: v.detach().clone() for name, t in model.state_dict(keep_vars=True).items()
             for n, v in hf_tensors(name, t, config, expert_format="fused")}
    buffers = [(n, t) for n, t in state.items() if n.endswith("e_score_correction_bias")]
    params = [(n, t) for n, t in state.items() if not n.endswith("e_score_correction_bias")]
    zero_centered = {n for name, m in model.named_modules() if isinstance(m, RMSNorm) and m.zero_centered_gamma
                     for n, _ in hf_tensors(f"{name}.weight", m.weight, config)}
    perturb_weights(params, buffers, torch.Generator().manual_seed(seed + 1), zero_centered)
    return config, {n: t.bfloat16().float() for n, t in state.items()}


def token_samples(config: ModelConfig, seed: int = 0, batch: int = 4, seq: int = 64) -> Tensor:
    """[batch, seq + 1] random token ids: inputs ``[:, :-1]``, next-token labels ``[:, 1:]``."""
    return torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1000 + seed))


def _grads(model: torch.nn.Module) -> list[Tensor]:
    return [torch.zeros(p.shape) if p.grad is None else p.grad.float() for p in model.parameters()]


# ----------------------------------------------------------------------------------------------- moefold
def moefold_model(config: ModelConfig, state: dict[str, Tensor], dtype: torch.dtype) -> MoEDecoder:
    """moefold's model of ``config`` in ``dtype`` (its routers and expert bias stay fp32) holding ``state``."""
    model = MoEDecoder(config, options=ModelOptions(dtype=DTYPE_NAMES[dtype]))
    load_weights(model, DictReader(state))
    return model


def moefold_run(config: ModelConfig, state: dict[str, Tensor], dtype: torch.dtype, samples: Tensor, *,
                loss: bool = True, grads: bool = True) -> Run:
    """``Run`` of moefold's model; ``loss``/``grads`` False skip the loss forward / the backward (NaN loss,
    no gradients): logits and routing alone cost one forward."""
    model = moefold_model(config, state, dtype)
    ids, labels = samples[:, :-1], samples[:, 1:]
    routes: list[Tensor] = []
    E = config.num_experts

    def record(_module, _args, out) -> None:
        ids_TK = out.routing.expert_ids_TK
        routes.append(torch.zeros(ids_TK.shape[0], E, dtype=torch.bool).scatter_(1, ids_TK, True))

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, Router)]
    logits = model.logits(ids)
    for h in hooks:
        h.remove()
    if not (loss or grads):
        return Run(logits=logits.float(), loss=float("nan"), grads=[], routes=routes)
    with torch.set_grad_enabled(grads):
        out = model(ids, labels)
    if grads:
        out.loss.backward()
    return Run(logits=logits.float(), loss=float(out.lm_loss.detach()), grads=_grads(model) if grads else [],
               routes=routes)


# ----------------------------------------------------------------------------------------------- HF transformers
def hf_model(config: ModelConfig, state: dict[str, Tensor], dtype: torch.dtype):
    """HF transformers' model of ``config`` (``to_hf_config``; SDPA attention, or eager where HF has no SDPA
    path: GPT-OSS's sinks) in ``dtype`` holding ``state``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**to_hf_config(config))
    hf_config._attn_implementation = "sdpa"
    try:
        model = AutoModelForCausalLM.from_config(hf_config)
    except ValueError:   # "... does not support an attention implementation through ... scaled_dot_product_attention"
        hf_config._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(hf_config)
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()


def hf_run(config: ModelConfig, state: dict[str, Tensor], dtype: torch.dtype, samples: Tensor, *,
           grads: bool = True) -> Run:
    """``Run`` of HF's model (one forward: logits, routing, loss; ``grads`` the backward too)."""
    model = hf_model(config, state, dtype)
    ids, labels = samples[:, :-1], samples[:, 1:]
    routes: list[Tensor] = []
    E = config.num_experts

    def record(_module, _args, out) -> None:   # HF's routers return (logits, weights, expert ids)
        routes.append(torch.zeros(out[2].shape[0], E, dtype=torch.bool).scatter_(1, out[2].long(), True))

    hooks = [m.register_forward_hook(record) for m in model.modules() if type(m).__name__.lower().endswith("router")]
    with torch.set_grad_enabled(grads):
        logits = model(input_ids=ids).logits
        # HF's ForCausalLMLoss: cross entropy of the fp32-upcast logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    for h in hooks:
        h.remove()
    if grads:
        loss.backward()
    return Run(logits=logits.detach().float(), loss=float(loss.detach()), grads=_grads(model) if grads else [],
               routes=routes)

"""Megatron-Core's own GPTModel for a moefold GQA recipe, on the CPU, from HF-named tensors (when it is installed).

    from tests.models.megatron_tiny import megatron_available, megatron_runs
    low, ref = megatron_runs([(config, state, torch.bfloat16, samples), (config, state, torch.float32, samples)])

Built from ``megatron.core`` 0.16.1's local (non-Transformer-Engine) layer spec: ``GPTModel`` with
``get_gpt_layer_local_spec`` (``SelfAttention`` with a fused q/k/v projection and optional q/k layernorm,
``DotProductAttention`` with ``attention_softmax_in_fp32``, ``MoELayer`` with the fp32 ``TopKRouter``
(``moe_router_dtype="fp32"``), the allgather token dispatcher and ``SequentialMLP`` experts, torch RMSNorm:
Apex and TE are not installed here). bf16 is Megatron's ``bf16=True, params_dtype=torch.bfloat16``.

Megatron-Core assumes CUDA in a few places that a forward/backward on the CPU reaches; ``megatron_on_cpu``
patches exactly those while a model is built and run, and nothing of Megatron's numerics:

- ``torch.cuda.current_device()`` (the rotary embedding moves its frequencies there) returns "cpu";
- ``CudaRNGStatesTracker.fork`` (entered around attention dropout, 0 here) is a no-op context;
- ``moe_utils.te_general_gemm`` is set to None: 0.16.1 leaves the name undefined when TE is missing, and
  ``RouterGatingLinearFunction`` then takes its torch path (``inp.to(fp32) @ weight.to(fp32).t()``);
- the causal (and sliding-window) mask is passed in: the default mask is built with ``device="cuda"``.

Megatron-Core needs torch.distributed and its parallel state: ``megatron_run`` runs in one forked gloo rank
(``tests.distributed.run_distributed``; ``megatron_runs`` runs a list of runs in one), so the calling
process never initialises either.

Only Qwen3-MoE and Mixtral map here (``MAPPED_FAMILIES``): DeepSeek-V3's MLA takes a rotary-interleave
permutation of its weights, and Megatron-Core ranks expert groups by the sum of each group's top
``topk // group_topk`` scores where HF and DeepSeek sum the top 2 (a different model at deepseek_v3_tiny's
topk 2 / group_topk 2); issue 33's families use features this mapping does not cover. ``megatron_supports``
says why for each.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

import torch
from torch import Tensor

from moefold.models.config import ModelConfig
from tests.distributed import run_distributed
from tests.models.bf16_reference import Run


def megatron_available() -> bool:
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


# The families whose every feature maps onto the GPTModel built here (GQA with optional per-head qk-norm, full
# RoPE, softmax top-k routing, SwiGLU experts without biases); the others need what is not mapped (below).
MAPPED_FAMILIES = ("qwen3_moe", "mixtral")


def megatron_supports(config: ModelConfig) -> str | None:
    """None when ``config`` maps onto Megatron-Core's GPTModel here, else why not."""
    if config.attention != "gqa":
        return "MLA: Megatron-Core's MLA needs DeepSeek's rotary-interleaved weights permuted (not mapped here)"
    if config.moe_num_groups is not None:
        return "group-limited routing: Megatron-Core scores a group by its top topk // group_topk experts, HF by 2"
    if config.family not in MAPPED_FAMILIES:
        features = _UNMAPPED.get(config.family, "features")
        return f"{config.family}: its {features} are not mapped onto Megatron-Core here"
    return None


_UNMAPPED = {"gpt_oss": "attention sinks, router and expert biases and clamped SwiGLU",
             "olmoe": "qk-norm over the whole projection (Megatron-Core's qk_layernorm is per head)",
             "minimax_m2": "sigmoid routing with expert bias, partial RoPE and projection qk-norm"}


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """The CPU patches of the module docstring, undone on exit."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    saved = (torch.cuda.current_device, mrandom.CudaRNGStatesTracker.fork, getattr(moe_utils, "te_general_gemm", None))
    torch.cuda.current_device = lambda: "cpu"
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    moe_utils.te_general_gemm = None
    try:
        yield
    finally:
        torch.cuda.current_device, mrandom.CudaRNGStatesTracker.fork, moe_utils.te_general_gemm = saved


def _transformer_config(c: ModelConfig, dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe_layers = [int(c.is_moe_layer(i)) for i in range(c.num_layers)]
    return TransformerConfig(
        num_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        num_query_groups=c.kv_heads, kv_channels=c.attention_head_dim, ffn_hidden_size=c.ffn_hidden_size or 1,
        qk_layernorm=c.qk_norm, normalization="RMSNorm", layernorm_epsilon=c.norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=c.attention_bias,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        num_moe_experts=c.num_experts, moe_layer_freq=moe_layers, moe_ffn_hidden_size=c.moe_ffn_hidden_size,
        moe_router_topk=c.moe_topk, moe_router_score_function="softmax",
        # softmax over all experts then renormalised top-k == Megatron's softmax over the top-k logits
        moe_router_pre_softmax=not c.moe_norm_topk_prob, moe_router_dtype="fp32",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False, use_cpu_initialization=True, perform_initialization=False,
        bf16=dtype == torch.bfloat16, params_dtype=dtype)


def _megatron_state(c: ModelConfig, hf: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF-named tensors (fused experts) -> Megatron-Core GPTModel state-dict names."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"], "output_layer.weight": hf["lm_head.weight"]}
    heads, groups, d = c.num_attention_heads, c.kv_heads, c.attention_head_dim
    for i in range(c.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        # linear_qkv: per query group [its heads' q rows, its k rows, its v rows]
        q = hf[p + "self_attn.q_proj.weight"].view(groups, heads // groups * d, -1)
        k = hf[p + "self_attn.k_proj.weight"].view(groups, d, -1)
        v = hf[p + "self_attn.v_proj.weight"].view(groups, d, -1)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, c.hidden_size)
        out[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        if c.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[p + "self_attn.q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[p + "self_attn.k_norm.weight"]
        if c.is_moe_layer(i):
            out[m + "mlp.router.weight"] = hf[p + "mlp.gate.weight"]
            for e in range(c.num_experts):   # linear_fc1 = [gate; up] (Megatron's GLU chunks it in this order)
                out[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = hf[p + "mlp.experts.gate_up_proj"][e]
                out[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = hf[p + "mlp.experts.down_proj"][e]
        else:
            out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
            out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
    return out


def _causal_mask(seq: int, window: int | None) -> Tensor:
    """[1, 1, S, S] bool, True where a query must not see a key (HF's window: 0 <= q - k < window)."""
    diff = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
    visible = diff >= 0 if window is None else (diff >= 0) & (diff < window)
    return (~visible)[None, None]


def _build(config: ModelConfig, state: dict[str, Tensor], dtype: torch.dtype):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=config.qk_norm, normalization="RMSNorm")
    model = GPTModel(_transformer_config(config, dtype), spec, vocab_size=config.vocab_size,
                     max_sequence_length=config.max_position_embeddings, position_embedding_type="rope",
                     rotary_base=int(config.rope_theta), share_embeddings_and_output_weights=False)
    model.load_state_dict(_megatron_state(config, state), strict=True)   # copies into the params' dtype
    return model.eval()


def _run(config: ModelConfig, state: dict[str, Tensor], dtype: torch.dtype, samples: Tensor) -> Run:
    from megatron.core.transformer.moe.router import TopKRouter

    model = _build(config, state, dtype)
    ids, labels = samples[:, :-1], samples[:, 1:]
    B, S = ids.shape
    pos, mask = torch.arange(S)[None].expand(B, S), _causal_mask(S, config.sliding_window)
    routes: list[Tensor] = []
    hooks = [mod.register_forward_hook(lambda _m, _a, out: routes.append(out[1].clone()))
             for mod in model.modules() if isinstance(mod, TopKRouter)]   # out: (probs, routing_map [T, E])
    with torch.no_grad():
        logits = model(ids, pos, mask)
    for h in hooks:
        h.remove()
    token_loss = model(ids, pos, mask, labels=labels)   # [B, S] fp32 (vocab-parallel CE of upcast logits)
    loss = token_loss.float().mean()
    loss.backward()
    grads = [torch.zeros(p.shape) if p.grad is None else p.grad.float() for p in model.parameters()]
    return Run(logits=logits.float(), loss=float(loss), grads=grads, routes=routes)


def _runs_on_rank(jobs: list[tuple[ModelConfig, dict[str, Tensor], torch.dtype, Tensor]]) -> list[Run]:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    with megatron_on_cpu():
        return [_run(*job) for job in jobs]


def megatron_runs(jobs: list[tuple[ModelConfig, dict[str, Tensor], torch.dtype, Tensor]]) -> list[Run]:
    """Megatron-Core's run of each (config, state, dtype, samples), all in one forked gloo rank."""
    for config, *_ in jobs:
        reason = megatron_supports(config)
        if reason is not None:
            raise ValueError(f"{config.name}: {reason}")
    return run_distributed(_runs_on_rank, 1, jobs, timeout=600)[0]


def megatron_run(config: ModelConfig, state: dict[str, Tensor], dtype: torch.dtype, samples: Tensor) -> Run:
    """Megatron-Core's run of ``config`` in ``dtype`` on ``samples`` (one forked gloo rank)."""
    return megatron_runs([(config, state, dtype, samples)])[0]

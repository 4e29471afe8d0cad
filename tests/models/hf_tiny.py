"""Tiny random HF models of the families, built from transformers' own config classes (nothing is downloaded).

Every parameter is perturbed (norm weights around 1, or around 0 where the norm stores ``gamma - 1``
(Qwen3-Next), biases such as DeepSeek's ``e_score_correction_bias`` random) so that a mis-mapped tensor
changes the logits. Qwen3-Next's DeltaNet gets a weak decay and larger key heads than values: random tiny
recurrent layers amplify fp32 rounding (a one-ulp change of the input moves HF's own logits by ~1e-5 with
these choices, by ~5e-4 with the decay and norms left as the generic rule would make them).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# every family ``hf_model`` builds (Kimi-K2: a DeepseekV3Config with Kimi-K2's distinctive values)
FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "kimi_k2", "olmoe", "minimax_m2",
            "qwen3_next", "qwen3_5_moe")
# issue 33's attention / MoE feature families: their world-1 and parallel parity tests have their own files
# (tests/models/test_families.py, test_families_parallel.py); the other families' are in test_hf_interop.py and
# test_parallel.py
FEATURE_FAMILIES = ("gpt_oss", "glm4_moe", "kimi_k2", "olmoe", "minimax_m2")
VOCAB = 96
# Qwen3-Next's tiny stack: DeltaNet and gated attention interleaved, a dense MLP in a DeltaNet layer (2)
QWEN3_NEXT_LAYERS = ("linear_attention", "full_attention", "linear_attention", "linear_attention")
# The tiny recipes (models/recipes.py) that HF transformers has a model class for: the bf16 accuracy tests
# (tests/models/test_bf16_accuracy.py) and benchmarks/bf16_error.py run each against HF's model of its config.
# A new family joins here once models/hf/config_map.py exports it.
HF_TINY_RECIPES = ("qwen3_moe_tiny", "mixtral_tiny", "deepseek_v3_tiny", "gpt_oss_tiny", "glm4_moe_tiny",
                   "kimi_k2_tiny", "olmoe_tiny", "minimax_m2_tiny", "qwen3_next_tiny",
                   "qwen3_5_moe_tiny")


def qwen3_next_config(**overrides):
    from transformers import Qwen3NextConfig

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              shared_expert_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, mlp_only_layers=[2], layer_types=list(QWEN3_NEXT_LAYERS),
              max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    return Qwen3NextConfig(**{**kw, **overrides})


def qwen3_5_moe_config(**overrides):
    """Qwen3.5-MoE text: Qwen3-Next's tiny stack, every layer MoE; multimodal RoPE sections (inert for text)."""
    from transformers import Qwen3_5MoeTextConfig

    kw = dict(vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              num_experts=8, num_experts_per_tok=2, layer_types=list(QWEN3_NEXT_LAYERS), max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
                               "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    return Qwen3_5MoeTextConfig(**{**kw, **overrides})


_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64)
_YARN16 = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
           "original_max_position_embeddings": 16}
# family: (transformers config class, its config fields) of the tiny models
TINY = {
    "deepseek_v3": ("DeepseekV3Config", dict(
        _COMMON, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, num_nextn_predict_layers=0,
        rope_parameters={**_YARN16, "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # DeepSeek-V3's tiny values (no MTP: transformers' V3.2 has none) and a lightning indexer keeping 5 of 16 tokens
    "deepseek_v32": ("DeepseekV32Config", dict(
        _COMMON, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, index_n_heads=4, index_head_dim=8, index_topk=5,
        rope_parameters={**_YARN16, "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # GLM-5: DeepSeek-V3.2's class with an interleaved indexer RoPE (and GLM's defaults: eps 1e-5)
    "glm_moe_dsa": ("GlmMoeDsaConfig", dict(
        _COMMON, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, index_n_heads=2, index_head_dim=8, index_topk=6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        _COMMON, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, head_dim=8, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "mixtral": ("MixtralConfig", dict(
        _COMMON, intermediate_size=24, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # swiglu_limit 0.5: the clamp acts on a good share of these small activations
    "gpt_oss": ("GptOssConfig", dict(
        _COMMON, num_hidden_layers=2, head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, swiglu_limit=0.5, rope_parameters={**_YARN16, "rope_theta": 150000.0, "truncate": False})),
    "glm4_moe": ("Glm4MoeConfig", dict(
        _COMMON, num_hidden_layers=3, head_dim=8, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})),
    # Kimi-K2's values: one expert group, scaling 2.827, one dense layer, YaRN beta 1/1
    "kimi_k2": ("DeepseekV3Config", dict(
        _COMMON, num_key_value_heads=4, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
        n_shared_experts=1, n_routed_experts=12, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.827, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, num_nextn_predict_layers=0,
        rope_parameters={**_YARN16, "rope_theta": 50000.0, "beta_fast": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
    "olmoe": ("OlmoeConfig", dict(
        _COMMON, num_hidden_layers=2, intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        eos_token_id=None, pad_token_id=None)),
    "minimax_m2": ("MiniMaxM2Config", dict(
        _COMMON, num_hidden_layers=2, head_dim=8, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
        rotary_dim=4, bos_token_id=None, eos_token_id=None)),
}


def hf_model(family: str, seed: int = 0, **changes):
    """(HF model in eval mode, fp32) for ``family``; ``changes``: config fields of the family's config class."""
    import transformers as tf

    torch.manual_seed(seed)
    if family == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(qwen3_next_config(**changes))
    elif family == "qwen3_5_moe":
        model = tf.Qwen3_5MoeForCausalLM(qwen3_5_moe_config(**changes))
    elif family in TINY:
        name, fields = TINY[family]
        model = getattr(tf, name.replace("Config", "ForCausalLM"))(getattr(tf, name)(**{**fields, **changes}))
    else:
        raise ValueError(family)
    # GPT-OSS has no SDPA path (sinks): its eager attention is the reference
    model.config._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"
    perturb_weights(model.named_parameters(), model.named_buffers(), torch.Generator().manual_seed(seed + 1),
                    zero_centered_norms(model))
    return model.eval().float()


def zero_centered_norms(model) -> set[str]:
    """HF parameter names of ``model``'s zero-centred RMSNorm weights (``Qwen3NextRMSNorm``, ``Qwen3_5MoeRMSNorm``)."""
    return {f"{n}.weight" for n, m in model.named_modules()
            if type(m).__name__ in ("Qwen3NextRMSNorm", "Qwen3_5MoeRMSNorm")}


@torch.no_grad()
def perturb_weights(params: Iterable[tuple[str, torch.Tensor]], buffers: Iterable[tuple[str, torch.Tensor]],
                    gen: torch.Generator, zero_centered: set[str] = frozenset()) -> None:
    """Redraw HF-named tensors in place: zero-centred norm weights (``zero_centered``) and sinks and biases
    around 0, other 1-D weights (norms) around 1, router gates wide enough to decide, matrices small, DeltaNet's
    decay weak and its convolution wide, DeepSeek's ``e_score_correction_bias`` random; other buffers stay."""
    for name, p in params:
        if name.endswith("A_log"):   # weak decay (A ~ 0.14), so the recurrence reaches far back
            p.copy_(-2.0 + 0.5 * torch.randn(p.shape, generator=gen))
        elif name.endswith("conv1d.weight"):
            p.copy_(0.4 * torch.randn(p.shape, generator=gen))
        elif name in zero_centered:
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        # sinks and biases around 0 (not the norm weights' 1); DeltaNet's dt_bias, the offset of its decay,
        # keeps the 1-D rule below (the weak decay above was chosen with it)
        elif name.endswith(("sinks", "bias")) and not name.endswith("dt_bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif p.dim() == 1:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith(("gate.weight", "router.weight")):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    for name, b in buffers:
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def save_hf(family: str, path, seed: int = 0, changes: dict | None = None, **save_kw):
    model = hf_model(family, seed, **(changes or {}))
    model.save_pretrained(path, **save_kw)
    return model


def save_all(families, root, ids_BS: torch.Tensor) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """({family: HF directory under ``root``}, {family: its HF logits of ``ids_BS``}) for ``families``."""
    dirs, refs = {}, {}
    for family in families:
        dirs[family] = str(root / family)
        refs[family] = hf_logits(save_hf(family, dirs[family]), ids_BS)
    return dirs, refs


def hf_logits(model, ids_BS: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids_BS).logits.float()


def hf_logits_and_bound(model, ids_BS: torch.Tensor) -> tuple[torch.Tensor, float]:
    """HF's fp32 logits and how far another fp32 evaluation of the same function may be from them: fp32's own
    error, measured against the same model in float64 (``tests/tolerance.bound``)."""
    import copy

    from tests.tolerance import bound

    ref = hf_logits(model, ids_BS)
    model64 = copy.deepcopy(model).double()
    model64.config._experts_implementation = "eager"   # torch._grouped_mm has no float64
    with torch.no_grad():
        ref64 = model64(input_ids=ids_BS).logits
    return ref, bound(ref, ref64)


def tokens(batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


DENSE_FAMILIES = ("qwen3", "mistral")


def hf_dense_model(kind: str, seed: int = 0):
    """A tiny random dense HF model (Qwen3 or Mistral, fp32, eval): what upcycling starts from."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=8))
    else:
        raise ValueError(kind)
    model.config._attn_implementation = "sdpa"
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if p.dim() == 1 else
                    0.08 * torch.randn(p.shape, generator=gen))
    return model.eval().float()


def save_tokenizer(path, vocab: int = VOCAB, separator: str = "<|endoftext|>") -> None:
    """A word-level tokenizer of ``vocab`` ids (id 0 the separator) saved as ``path/tokenizer.json``:
    every id decodes to a word, so generated ids read back as text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {separator: 0, **{f"w{i}": i for i in range(1, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token=separator))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(path / "tokenizer.json"))


def hf_lm_loss(model, samples: torch.Tensor) -> float:
    """HF's mean next-token loss over ``samples [N, S+1]`` (inputs ``[:, :-1]``, labels ``[:, 1:]``)."""
    import torch.nn.functional as F

    logits = hf_logits(model, samples[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), samples[:, 1:].reshape(-1)).item()

"""Tiny random Nemotron-H HF checkpoints (transformers' own ``NemotronHConfig``; nothing downloaded), drawn at
random over the fields that change the computation: the layer pattern, Mamba-2 sizes (heads, groups, state,
conv kernel and bias, chunk shorter or longer than the sequence, time-step limits), GQA heads, the router
(groups, top-k, renormalisation, scaling), the latent MoE width and tied embeddings."""

from __future__ import annotations

import random

import torch

from tests.models.hf_tiny import VOCAB, perturb_weights

PATTERNS = ("M*EM-E", "MEM*E", "*EM-ME", "MEMEM*E")


def draw(seed: int) -> dict:
    r = random.Random(seed)
    groups = r.choice([1, 2])
    n_group = r.choice([1, 2])
    experts = 8
    return dict(vocab_size=VOCAB, hidden_size=32, hybrid_override_pattern=r.choice(PATTERNS),
                num_attention_heads=4, num_key_value_heads=r.choice([1, 2, 4]), head_dim=8, intermediate_size=48,
                mamba_num_heads=groups * r.choice([2, 4]), mamba_head_dim=r.choice([4, 8]),
                ssm_state_size=r.choice([4, 16]), n_groups=groups, conv_kernel=r.choice([2, 4]),
                use_conv_bias=r.random() < 0.7, use_bias=r.random() < 0.3, chunk_size=r.choice([4, 8, 64]),
                time_step_limit=r.choice([(0.0, float("inf")), (0.01, 0.5)]),
                layer_norm_epsilon=r.choice([1e-5, 1e-3]), n_routed_experts=experts,
                num_experts_per_tok=r.choice([1, 2, 3]), moe_intermediate_size=16,
                moe_shared_expert_intermediate_size=24, moe_latent_size=r.choice([None, 16]),
                routed_scaling_factor=r.choice([1.0, 2.5]), n_group=n_group, topk_group=r.choice([1, n_group]),
                norm_topk_prob=r.random() < 0.7, tie_word_embeddings=r.random() < 0.3, max_position_embeddings=256)


def hf_model(seed: int, **changes):
    """(NemotronHForCausalLM, fp32, eval, every weight perturbed) of ``draw(seed)`` with ``changes``."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    model = NemotronHForCausalLM(NemotronHConfig(**{**draw(seed), **changes}))
    model.config._attn_implementation = "sdpa"
    perturb_weights(model.named_parameters(), model.named_buffers(), torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():   # Mamba-2's decay as its init makes it (A = 1..heads) keeps the recurrence tame
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.arange(1, p.numel() + 1, dtype=p.dtype)) - 1.0)
            elif name.endswith("dt_bias"):
                p.copy_(-1.0 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return model.eval().float()

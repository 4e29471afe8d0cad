"""``moefold plan`` for Qwen3-Next and Qwen3.5-MoE (``planner.activations_deltanet``, ``planner.compute_hybrid``).

- the Gated DeltaNet mixer's saved tensors, counted by ``deltanet_mixer``, equal what the built layer leaves for
  its backward (autograd's saved-tensor hooks), fp32 and bf16, at sizes that differ pairwise (key and value heads,
  key and value head dims, sequence and chunk), so each term's shape is the one it names;
- the activation peak of the tiny recipes (three DeltaNet layers and one gated-attention layer, MoE in each)
  against the trainer's measured peak at world 1, fp32 and bf16 (``tests/planner/test_memory.py``'s measurement),
  and with the delta rule recomputed (``--recompute-granularity selective``: ``core_attn``);
- the DeltaNet block's GEMM FLOPs equal the model FLOPs ``training.observe.flops`` counts for MFU, the parameter
  bound stays below the meta build, and ``moefold plan`` plans the published Qwen3.5-35B-A3B (the search over
  every layout: ``tests/planner/test_search_bound.py``).
"""

from __future__ import annotations

import pytest
import torch

from moefold.models.model_sections import LinearAttentionDims
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.config import RunConfig, TrainConfig
from tests.planner.test_memory import ACTIVATION_RTOL, measured_activations, predicted_activations


def _config(model, seq: int = 512, bf16: bool = False, options: ModelOptions | None = None) -> RunConfig:
    train = TrainConfig(micro_batch_size=1, global_batch_size=1, seq_length=seq, train_iters=1, lr_warmup_iters=0,
                        bf16=bf16)
    return RunConfig(model=model, parallel=ParallelConfig(), options=options or ModelOptions(), train=train,
                     recipe=model.name)


@pytest.mark.parametrize("bf16", [False, True])
def test_deltanet_mixer_saved_tensors_equal_the_layer(bf16: bool) -> None:
    from moefold.models.layer_factory import build_block
    from moefold.planner.activations import activation_shape
    from moefold.planner.activations_deltanet import deltanet_mixer

    # hidden 64; 2 key heads x 8, 6 value heads x 24 (r = 3), 200 tokens in chunks of 64 (the last one padded)
    model = get_recipe("qwen3_5_moe_tiny").with_(linear_attention=LinearAttentionDims(
        num_key_heads=2, num_value_heads=6, key_head_dim=8, value_head_dim=24, conv_kernel_size=4))
    config = _config(model, seq=200, bf16=bf16)
    S, dtype = config.train.seq_length, torch.bfloat16 if bf16 else torch.float32
    mixer = build_block(model, 0, ParallelDims.single(), ModelOptions()).to(dtype).self_attn
    assert model.layer_type(0) == "linear_attention"
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(S, 1, model.hidden_size, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mixer(x, torch.arange(S))
    for p in mixer.parameters():   # the hooks also see the weights
        saved.pop(p.untyped_storage().data_ptr(), None)
    shape = activation_shape(config, config.parallel.resolve(1), "cpu")
    assert deltanet_mixer(shape).saved_bytes == sum(saved.values())


@pytest.mark.parametrize(("recipe", "bf16", "recompute"), [("qwen3_5_moe_tiny", False, "none"),
                                                          ("qwen3_5_moe_tiny", True, "none"),
                                                          ("qwen3_5_moe_tiny", False, "selective"),
                                                          ("qwen3_next_tiny", True, "none")])
def test_deltanet_activation_peak_world1(recipe: str, bf16: bool, recompute: str) -> None:
    config = _config(get_recipe(recipe), bf16=bf16, options=ModelOptions(recompute=recompute))
    measured = measured_activations(config, ParallelDims.single())
    predicted = predicted_activations(config, 1, 0)
    assert predicted == pytest.approx(measured, rel=ACTIVATION_RTOL), f"{predicted / measured - 1:+.1%}"


def test_deltanet_block_gemm_flops_equal_the_model_flops() -> None:
    from moefold.planner.compute_hybrid import _layer_gemms
    from moefold.training.observe.flops import ffn_macs, linear_attention_macs

    model = get_recipe("qwen3_5_35b_a3b")
    config = _config(model, seq=4096)
    sizes = config.parallel.resolve(1)
    la = model.linear_attention
    keys, values = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
    # less the convolution (elementwise here) and the rule (core work, timed apart)
    mixer = linear_attention_macs(model) - (2 * keys + values) * la.conv_kernel_size - \
        3 * la.num_value_heads * la.key_head_dim * la.value_head_dim
    gemms, _ = _layer_gemms(config, sizes, "linear_attention moe")
    flops = sum(g.flops for g in gemms) / config.train.seq_length
    gate = model.hidden_size if model.moe_shared_expert_gate else 0   # a dot product, not one of compute_time's GEMMs
    assert flops == pytest.approx(2 * (mixer + ffn_macs(model, True) - gate), rel=1e-12)


@pytest.mark.parametrize("pp,ep", [(1, 2), (2, 1)])
def test_static_lower_bound_stays_below_the_meta_build(pp: int, ep: int) -> None:
    from moefold.planner.static import exact_static, static_lower_bound

    model = get_recipe("qwen3_5_moe_tiny")
    train = TrainConfig(micro_batch_size=1, global_batch_size=4, seq_length=64, train_iters=1, lr_warmup_iters=0)
    config = RunConfig(model=model, parallel=ParallelConfig(pp=pp, ep=ep), options=ModelOptions(), train=train,
                       recipe=model.name)
    sizes, _ = config.resolve(4)
    exact, bound = exact_static(config, sizes), static_lower_bound(config, sizes)
    for rank, memory in exact.items():
        assert 0.5 * memory.params <= bound[rank].params <= memory.params, (rank, bound[rank], memory)


def test_plan_qwen3_5(capsys) -> None:
    from moefold.training import cli

    code = cli.main(["plan", "--recipe", "qwen3_5_35b_a3b", "--gpus", "8", "--seq-length", "4096"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "qwen3_5_35b_a3b" in out.out and "tok/s/GPU" in out.out, out.out

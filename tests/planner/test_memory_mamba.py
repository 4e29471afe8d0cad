"""``moefold plan`` for Nemotron-H (``planner.activations_mamba``, ``planner.compute_hybrid``).

- the Mamba-2 mixer's saved tensors, counted by ``mamba_mixer``, equal what the built layer leaves for its backward
  (autograd's saved-tensor hooks), at sizes that differ pairwise (heads, head_dim, state, chunk, hidden), so each
  term's shape is the one it names;
- the activation peak of ``nemotron_h_tiny`` (Mamba-2, attention, MoE and a relu2 MLP layer) against the trainer's
  measured peak at world 1, fp32 and bf16 (``tests/planner/test_memory.py``'s measurement);
- each layer kind's GEMM FLOPs equal the model FLOPs ``training.observe.flops`` counts for MFU (projections, relu2's
  single up projection, the router), and ``moefold plan`` plans the published Nano 30B-A3B.
"""

from __future__ import annotations

import pytest
import torch

from moefold.models.mamba_dims import MambaDims
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.config import RunConfig, TrainConfig
from tests.planner.test_memory import ACTIVATION_RTOL, measured_activations, predicted_activations


def _config(model, seq: int = 512, bf16: bool = False) -> RunConfig:
    train = TrainConfig(micro_batch_size=1, global_batch_size=1, seq_length=seq, train_iters=1, lr_warmup_iters=0,
                        bf16=bf16)
    return RunConfig(model=model, parallel=ParallelConfig(), options=ModelOptions(), train=train, recipe=model.name)


def test_mamba_mixer_saved_tensors_equal_the_layer() -> None:
    from moefold.models.layer_factory import build_block
    from moefold.planner.activations import activation_shape
    from moefold.planner.activations_mamba import mamba_mixer

    # hidden 64; 4 heads x 8, state 24, 2 groups, chunks of 64: no two of the counted widths coincide
    model = get_recipe("nemotron_h_tiny").with_(
        mamba=MambaDims(num_heads=4, head_dim=8, state_size=24, num_groups=2, conv_kernel=4, chunk_size=64))
    config = _config(model)
    S = config.train.seq_length
    block = build_block(model, 0, ParallelDims.single(), ModelOptions())
    assert model.layer_type(0) == "mamba"
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(S, 1, model.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, torch.arange(S))
    shape = activation_shape(config, config.parallel.resolve(1), "cpu")
    predicted = mamba_mixer(shape).saved_bytes + sum(shape.norm(S, model.hidden_size, "norm").values())
    parameters = sum(p.numel() * p.element_size() for p in block.parameters())
    # the hooks also see the weights (in_proj's, out_proj's, the convolution's): at most the parameters' bytes
    assert 0 <= sum(saved.values()) - predicted <= parameters, (sum(saved.values()), predicted, parameters)


@pytest.mark.parametrize("bf16", [False, True])
def test_nemotron_h_activation_peak_world1(bf16: bool) -> None:
    config = _config(get_recipe("nemotron_h_tiny"), bf16=bf16)
    measured = measured_activations(config, ParallelDims.single())
    predicted = predicted_activations(config, 1, 0)
    assert predicted == pytest.approx(measured, rel=ACTIVATION_RTOL), f"{predicted / measured - 1:+.1%}"


def test_layer_gemm_flops_equal_the_model_flops() -> None:
    from moefold.planner.compute_hybrid import _layer_gemms
    from moefold.training.observe.flops import attention_macs, ffn_macs, mamba_macs

    model = get_recipe("nemotron_3_nano_30b_a3b")
    config = _config(model, seq=4096)
    sizes = config.parallel.resolve(1)
    tokens = config.train.seq_length
    d = model.hybrid.mamba
    attention = attention_macs(model, tokens, 0) - model.num_attention_heads * 2 * model.attention_head_dim * \
        (tokens + 1) / 2
    expected = {"mamba": mamba_macs(model) - d.conv_channels * d.conv_kernel - 2 * d.num_heads * d.head_dim *
                d.state_size, "full_attention": attention, "moe": ffn_macs(model, True), "mlp": None}
    for kind, macs in expected.items():
        if macs is None:
            continue
        gemms, _ = _layer_gemms(config, sizes, kind)
        assert sum(g.flops for g in gemms) / tokens == pytest.approx(2 * macs, rel=1e-12), kind


def test_plan_nemotron_nano(capsys) -> None:
    from moefold.training import cli

    code = cli.main(["plan", "--recipe", "nemotron_3_nano_30b_a3b", "--gpus", "8", "--seq-length", "4096",
                     "--global-batch-size", "64", "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
                     "--pipeline-model-parallel-size", "1", "--expert-model-parallel-size", "8",
                     "--expert-tensor-parallel-size", "1", "--micro-batch-size", "1"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "nemotron_3_nano_30b_a3b" in out.out and "tok/s/GPU" in out.out, out.out


@pytest.mark.parametrize("pp,ep", [(1, 2), (2, 1)])
def test_static_lower_bound_stays_below_the_meta_build(pp: int, ep: int) -> None:
    """A one-sublayer stack's non-MoE layers (Mamba-2, attention, MLP) differ in size: the bound takes the smallest,
    and the exact count builds each stage with its own layer types (``stage_signature``)."""
    from moefold.planner.static import exact_static, static_lower_bound

    model = get_recipe("nemotron_h_tiny")
    train = TrainConfig(micro_batch_size=1, global_batch_size=4, seq_length=64, train_iters=1, lr_warmup_iters=0)
    config = RunConfig(model=model, parallel=ParallelConfig(pp=pp, ep=ep), options=ModelOptions(), train=train,
                       recipe=model.name)
    sizes, _ = config.resolve(4)
    exact, bound = exact_static(config, sizes), static_lower_bound(config, sizes)
    for rank, memory in exact.items():
        assert 0.5 * memory.params <= bound[rank].params <= memory.params, (rank, bound[rank], memory)

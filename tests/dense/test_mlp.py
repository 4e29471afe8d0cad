"""Dense MLP and the transformer block around it: every tp (with and without SP) and recompute mode
equals world 1 (values and gradients of every parameter); SwiGLU equals HF's MLP."""

import pytest
import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3

from moefold.dense.block import TransformerBlock
from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear
from moefold.dense.mlp import DenseMLP, MLPConfig
from moefold.dense.recompute import check_recompute
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.groups import Group
from moefold.parallel.sharding import init_parameters, set_init
from tests.dense.parity import assert_all_close, full_grads, full_params, seq_gather, seq_shard
from tests.distributed import run_distributed

S, B, H, F = 8, 2, 16, 32


class _StandInAttention(nn.Module):
    """Position-dependent token mixing through a column/row pair, with the attention call signature."""

    def __init__(self, tp_group: Group, sp: bool) -> None:
        super().__init__()
        self.qkv = ColumnParallelLinear(H, 2 * H, tp_group, sequence_parallel=sp)
        self.o = RowParallelLinear(2 * H, H, tp_group, sequence_parallel=sp)

    def forward(self, x, position_ids):
        h = self.qkv(x)  # [S, B, 2H/tp]: the full sequence
        h = torch.cumsum(h * torch.cos(0.3 * position_ids.float())[:, None, None], dim=0) / S  # causal mixing
        return self.o(h)


class _MoELike(nn.Module):
    """Wraps an FFN, returns (y, extra) like the MoE layer; counts forward runs (test-only state)."""

    def __init__(self, ffn: nn.Module) -> None:
        super().__init__()
        self.ffn, self.calls = ffn, 0

    def forward(self, x):
        self.calls += 1
        y = self.ffn(x)
        return y, {"aux": y.float().pow(2).mean()}


def _mlp_run(tp_group: Group, sp: bool, activation: str, bias: bool):
    model = DenseMLP(MLPConfig(H, F, activation=activation, bias=bias), tp_group, sequence_parallel=sp)
    for name, p in model.named_parameters():
        if name.endswith("bias"):  # non-zero, still layout-independent (sharded column biases included)
            set_init(p, lambda t, gen: t.uniform_(-0.1, 0.1, generator=gen))
    init_parameters(model, seed=4)
    gen = torch.Generator().manual_seed(8)
    x, dy = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
    x_local = seq_shard(x, tp_group, sp).requires_grad_()
    y_local = model(x_local)
    y_local.backward(seq_shard(dy, tp_group, sp))
    out = {"y": seq_gather(y_local, tp_group, sp), "dx": seq_gather(x_local.grad, tp_group, sp)}
    return out, full_params(model), full_grads(model, tp_group)


def _block_run(tp_group: Group, sp: bool, recompute: str):
    ffn = _MoELike(DenseMLP(MLPConfig(H, F), tp_group, sequence_parallel=sp))
    block = TransformerBlock(H, _StandInAttention(tp_group, sp), ffn, 1e-5, sequence_parallel=sp, recompute=recompute)
    init_parameters(block, seed=6)
    with torch.no_grad():
        block.input_layernorm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
        block.post_attention_layernorm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(10)
    x, dy = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
    position_ids = torch.arange(S)
    x_local = seq_shard(x, tp_group, sp).requires_grad_()
    y_local, extra = block(x_local, position_ids)
    (y_local * seq_shard(dy, tp_group, sp)).sum().add(extra["aux"]).backward()
    expected_calls = 2 if recompute == "full" else 1
    assert ffn.calls == expected_calls, f"recompute={recompute}: FFN ran {ffn.calls} times, expected {expected_calls}"
    out = {"y": seq_gather(y_local, tp_group, sp), "dx": seq_gather(x_local.grad, tp_group, sp)}
    return out, full_params(block), full_grads(block, tp_group)


def _check(result, ref, what):
    out, params, grads = result
    assert_all_close(params, ref[1], what + " params", atol=0)
    assert_all_close(out, ref[0], what)
    assert_all_close(grads, ref[2], what + " grads")


def _all_layouts():
    mlp_cases = [("swiglu", False), ("gelu", True)]
    mlp_ref = {case: _mlp_run(None, False, *case) for case in mlp_cases}
    block_ref = _block_run(None, False, "none")
    _check(_block_run(None, False, "full"), block_ref, "block tp=1 recompute=full")
    checked = []
    for tp in (2, 4):
        dims = ParallelDims.build(ParallelConfig(tp=tp))
        for sp in (False, True):
            for case in mlp_cases:
                what = f"MLP tp={tp} sp={sp} activation={case[0]} bias={case[1]}"
                _check(_mlp_run(dims.tp_group, sp, *case), mlp_ref[case], what)
                checked.append(what)
            for recompute in ("none", "full"):
                what = f"block tp={tp} sp={sp} recompute={recompute}"
                _check(_block_run(dims.tp_group, sp, recompute), block_ref, what)
                checked.append(what)
    with pytest.raises(ValueError) as info:
        DenseMLP(MLPConfig(H, 30), dims.tp_group)
    return checked, str(info.value)


def test_mlp_and_block_layouts_match_world_1():
    checked, message = run_distributed(_all_layouts, 4)[0]
    assert len(checked) == 16
    assert message == "MLPConfig: ffn_hidden_size=30 is not divisible by tp=4"


def test_swiglu_matches_hf():
    cfg = Qwen3Config(hidden_size=H, intermediate_size=F, hidden_act="silu", num_attention_heads=2, vocab_size=8,
                      num_hidden_layers=1)
    ref = hf_qwen3.Qwen3MLP(cfg)
    ours = DenseMLP(MLPConfig(H, F))
    ours.load_state_dict(ref.state_dict())  # same names: gate_proj, up_proj, down_proj
    x = torch.randn(S, B, H)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)


def test_bad_configs():
    with pytest.raises(ValueError, match="activation='relu'"):
        MLPConfig(H, F, activation="relu")
    with pytest.raises(ValueError, match="ffn_hidden_size=0"):
        MLPConfig(H, 0)
    with pytest.raises(ValueError, match="recompute='some'"):
        TransformerBlock(H, nn.Identity(), nn.Identity(), recompute="some")
    assert check_recompute("selective") == "selective"
    block = TransformerBlock(H, _StandInAttention(None, False), DenseMLP(MLPConfig(H, F)))
    y, extra = block(torch.randn(S, B, H), torch.arange(S))
    assert y.shape == (S, B, H) and extra is None


@pytest.mark.parametrize("activation, approximate", [("gelu", "none"), ("gelu_tanh", "tanh")])
def test_gelu_variants_match_formula(activation, approximate):
    mlp = DenseMLP(MLPConfig(H, F, activation=activation, init_std=0.5))  # pre-activations of O(1)
    assert mlp.gate_proj is None
    x = torch.randn(S, B, H)
    expected = mlp.down_proj.weight @ torch.nn.functional.gelu(mlp.up_proj.weight @ x.unsqueeze(-1),
                                                               approximate=approximate)
    torch.testing.assert_close(mlp(x), expected.squeeze(-1), atol=1e-5, rtol=1e-5)
    other = "tanh" if approximate == "none" else "none"  # the two variants differ far beyond that here
    with_other = mlp.down_proj.weight @ torch.nn.functional.gelu(mlp.up_proj.weight @ x.unsqueeze(-1),
                                                                 approximate=other)
    assert (mlp(x) - with_other.squeeze(-1)).abs().max() > 1e-4

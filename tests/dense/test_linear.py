"""Column/row-parallel linear layers: every tp (with and without SP) equals world 1, values and grads."""

import pytest
import torch
from torch import nn

from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.groups import Group
from moefold.parallel.sharding import init_parameters
from tests.dense.parity import assert_all_close, full_grads, full_params, seq_gather, seq_shard
from tests.distributed import run_distributed

S, B, H, F = 8, 2, 16, 32


class _Pair(nn.Module):
    """Column then row parallel, the Megatron MLP shape; or the gather/scatter variant."""

    def __init__(self, tp_group: Group, sp: bool, gather: bool = False) -> None:
        super().__init__()
        self.col = ColumnParallelLinear(H, F, tp_group, bias=True, sequence_parallel=sp, gather_output=gather)
        self.row = RowParallelLinear(F, H, tp_group, bias=True, sequence_parallel=sp, input_is_parallel=not gather)

    def forward(self, x):
        return self.row(torch.tanh(self.col(x)))


def _run(tp_group: Group, sp: bool, gather: bool = False):
    model = _Pair(tp_group, sp, gather)
    init_parameters(model, seed=3)
    with torch.no_grad():  # non-zero biases so their gradients and reductions are exercised
        for p in (model.col.bias, model.row.bias):
            p.add_(0.1)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(S, B, H, generator=gen)
    dy = torch.randn(S, B, H, generator=gen)
    x_local = seq_shard(x, tp_group, sp).requires_grad_()
    y_local = model(x_local)
    y_local.backward(seq_shard(dy, tp_group, sp))
    y = seq_gather(y_local, tp_group, sp)
    dx = seq_gather(x_local.grad, tp_group, sp)
    return y, dx, full_params(model), full_grads(model, tp_group)


def _all_layouts():
    ref = _run(None, sp=False)
    checked = []
    for tp in (2, 4):
        dims = ParallelDims.build(ParallelConfig(tp=tp))
        for sp, gather in ((False, False), (True, False), (False, True)):
            y, dx, params, grads = _run(dims.tp_group, sp, gather)
            what = f"tp={tp} sp={sp} gather_output={gather}"
            # layout-independent init: identical full weights, bit for bit
            assert_all_close(params, ref[2], what + " params", atol=0)
            assert_all_close({"y": y, "dx": dx}, {"y": ref[0], "dx": ref[1]}, what)
            assert_all_close(grads, ref[3], what + " grads")
            checked.append(what)
    return checked, _divisibility_errors(dims.tp_group)


def test_linear_layouts_match_world_1():
    checked, messages = run_distributed(_all_layouts, 4)[0]
    assert len(checked) == 6
    # bad layouts fail at construction, naming the numbers
    assert "out_features=6 is not divisible by tp=4" in messages[0]
    assert "in_features=6 is not divisible by tp=4" in messages[1]


def test_linear_bad_configs():
    with pytest.raises(ValueError, match="out_features=0"):
        ColumnParallelLinear(4, 0, None)
    with pytest.raises(ValueError, match="requires input_is_parallel"):
        RowParallelLinear(4, 4, None, sequence_parallel=True, input_is_parallel=False)


def _divisibility_errors(tp_group: Group) -> list[str]:
    messages = []
    for make in (lambda: ColumnParallelLinear(8, 6, tp_group), lambda: RowParallelLinear(6, 8, tp_group)):
        with pytest.raises(ValueError) as info:
            make()
        messages.append(str(info.value))
    return messages

"""Tensor-parallel linear layers (Megatron's column/row pair), with optional sequence parallelism.

Activations are sequence-first ``[S, B, H]`` everywhere in moefold. With sequence parallelism
(SP) the activations between tensor-parallel regions are the sequence shard ``[S/tp, B, H]``:
the column-parallel layer all-gathers the sequence before its GEMM (backward: reduce-scatter;
the GEMM keeps the shard, not the gathered sequence, and gathers it again in backward, as
Megatron's and TE's column-parallel layers do: ``on_tp_input``) and the row-parallel layer
reduce-scatters its partial sums back to a shard (backward: all-gather). Without SP the input
is replicated across TP (``copy_to_region``: identity forward, all-reduce backward) and the
row-parallel output is all-reduced.

Weights are marked with their shards (``parallel.sharding``) and carry an init function, so
``init_parameters(module, seed)`` gives the same full weight at every tp.

The local GEMM is ``layer.local_gemm(x, weight, bias)``: ``F.linear`` unless ``layer.configure(gemm=...)``
installs another callable of that signature (``LocalGemm``, the layer's extension point, ``dense.regions``).
``moefold.execution`` installs them once after the model is built: an FP8 GEMM (``execution.fp8_linear``; the
weight and its dtype stay as they are), the split-backward GEMM whose weight gradient can be deferred
(``execution.split_backward``), or the gradient-accumulation-fusion GEMM whose weight gradient goes straight into
the trainer's main-grad buffer (``execution.grad_accumulation``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefold.parallel.comm import (
    all_gather_sequence,
    copy_to_region,
    gather_along_dim,
    reduce_from_region,
    reduce_scatter_sequence,
    scatter_along_dim,
)
from moefold.parallel.groups import Group, group_size
from moefold.parallel.sequence_input import SequenceParallelInput
from moefold.parallel.sharding import Shard, mark_sequence_parallel, mark_sharded, normal_init, set_init

# (x [..., in], weight [out, in], bias [out] | None) -> [..., out]
LocalGemm = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]
R = TypeVar("R")


def on_tp_input(x: Tensor, tp_group: Group, sequence_parallel: bool, fn: Callable[[Tensor], R]) -> R:
    """``fn(x_in)`` on the input of column-parallel GEMMs (``fn`` runs their ``forward_local``).

    With SP ``x_in`` is the sequence all-gather (backward: reduce-scatter), and the GEMMs ``fn`` runs keep the shard
    for their backward, all-gathering it again there (``parallel.sequence_input``; Megatron's and TE's
    column-parallel save); inside a compiled graph, the plain gather (its partitioner decides what is kept).
    Otherwise ``copy_to_region`` (identity forward, all-reduce backward); the GEMMs keep what they keep.
    A call, not a context manager, so that ``torch.compile`` traces the replicated path straight through.
    """
    if not sequence_parallel:
        return fn(copy_to_region(x, tp_group))
    if torch.compiler.is_compiling():
        return fn(all_gather_sequence(x, tp_group, 0))
    with SequenceParallelInput(x, tp_group, 0) as x_full:
        return fn(x_full)


def _check_divisible(name: str, value: int, tp: int, layer: str) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{layer}: {name}={value!r} must be a positive integer")
    if value % tp != 0:
        raise ValueError(f"{layer}: {name}={value} is not divisible by tp={tp}")


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W [out, in]`` split along ``out`` over ``tp_group``.

    Local weight ``[out/tp, in]`` (``Shard(dim=0)``), local bias ``[out/tp]`` (``Shard(dim=0)``).

    forward(x): ``x [..., in]`` replicated across TP, or with ``sequence_parallel`` the sequence
    shard ``[S/tp, ..., in]`` (all-gathered along dim 0 first; the GEMM keeps the shard for its weight
    gradient and gathers it again in backward: ``on_tp_input``). Returns ``[..., out/tp]``, or
    the full ``[..., out]`` (all-gathered along the last dim) with ``gather_output``.
    """

    def __init__(self, in_features: int, out_features: int, tp_group: Group, *, bias: bool = False,
                 sequence_parallel: bool = False, gather_output: bool = False, init_std: float = 0.02,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        tp = group_size(tp_group)
        _check_divisible("in_features", in_features, 1, "ColumnParallelLinear")
        _check_divisible("out_features", out_features, tp, "ColumnParallelLinear")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.sequence_parallel, self.gather_output = tp_group, sequence_parallel, gather_output
        kw = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, **kw))
        mark_sharded(self.weight, Shard.over(tp_group, 0))
        set_init(self.weight, normal_init(init_std))
        with torch.no_grad():  # usable before init_parameters; init_parameters overwrites it layout-independently
            self.weight.normal_(0.0, init_std)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features // tp, **kw))
            mark_sharded(self.bias, Shard.over(tp_group, 0))
        else:
            self.register_parameter("bias", None)
        self.local_gemm: LocalGemm = F.linear

    def forward(self, x: Tensor) -> Tensor:
        # SP: the GEMM needs the whole sequence; its backward reduce-scatters the input gradient.
        # Otherwise x is replicated and each rank's input gradient is partial: all-reduced backward.
        y = on_tp_input(x, self.tp_group, self.sequence_parallel, self.forward_local)
        if self.gather_output:
            y = gather_along_dim(y, self.tp_group, dim=-1)
        return y

    def forward_local(self, x: Tensor) -> Tensor:
        """The local GEMM only, ``[..., in] -> [..., out/tp]``, for callers that entered the TP region
        themselves (one all-gather / ``copy_to_region`` shared by several column-parallel layers)."""
        return self.local_gemm(x, self.weight, self.bias)

    def configure(self, *, gemm: LocalGemm) -> None:
        """Install the local GEMM (``LocalGemm``: ``F.linear``'s signature)."""
        self.local_gemm = _checked_gemm(gemm, "ColumnParallelLinear")

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={group_size(self.tp_group)}, "
                f"bias={self.bias is not None}, sp={self.sequence_parallel}, gather_output={self.gather_output}"
                + _gemm_repr(self.local_gemm))


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W [out, in]`` split along ``in`` over ``tp_group``.

    Local weight ``[out, in/tp]`` (``Shard(dim=1)``); the bias ``[out]`` is replicated and added
    once, after the reduction (with SP it sees only this rank's sequence shard, so its gradient
    is partial: it is marked ``mark_sequence_parallel``).

    forward(x): ``x [..., in/tp]`` (``input_is_parallel``, e.g. a column-parallel output) or the
    full ``[..., in]`` (scattered along the last dim first). Returns ``[..., out]`` all-reduced
    over TP, or with ``sequence_parallel`` the reduce-scattered sequence shard ``[S/tp, ..., out]``.
    """

    def __init__(self, in_features: int, out_features: int, tp_group: Group, *, bias: bool = False,
                 sequence_parallel: bool = False, input_is_parallel: bool = True, init_std: float = 0.02,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        tp = group_size(tp_group)
        _check_divisible("in_features", in_features, tp, "RowParallelLinear")
        _check_divisible("out_features", out_features, 1, "RowParallelLinear")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True requires input_is_parallel=True "
                             "(the input must already be split along the hidden dim)")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.sequence_parallel, self.input_is_parallel = tp_group, sequence_parallel, input_is_parallel
        kw = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, **kw))
        mark_sharded(self.weight, Shard.over(tp_group, 1))
        set_init(self.weight, normal_init(init_std))
        with torch.no_grad():
            self.weight.normal_(0.0, init_std)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, **kw))
            if sequence_parallel:
                mark_sequence_parallel(self.bias)
        else:
            self.register_parameter("bias", None)
        self.local_gemm: LocalGemm = F.linear

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_along_dim(x, self.tp_group, dim=-1)
        y = self.local_gemm(x, self.weight, None)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(y, self.tp_group, dim=0)
        else:
            y = reduce_from_region(y, self.tp_group)
        if self.bias is not None:
            y = y + self.bias
        return y

    def configure(self, *, gemm: LocalGemm) -> None:
        """Install the local GEMM (``LocalGemm``: ``F.linear``'s signature)."""
        self.local_gemm = _checked_gemm(gemm, "RowParallelLinear")

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={group_size(self.tp_group)}, "
                f"bias={self.bias is not None}, sp={self.sequence_parallel}, "
                f"input_is_parallel={self.input_is_parallel}" + _gemm_repr(self.local_gemm))


def _checked_gemm(gemm: LocalGemm, layer: str) -> LocalGemm:
    if not callable(gemm):
        raise ValueError(f"{layer}.configure: gemm={gemm!r} is not callable as (x, weight, bias) -> y")
    return gemm


def _gemm_repr(gemm: LocalGemm) -> str:
    """Names a GEMM that describes itself (FP8, split backward); ``F.linear`` and the fused one say nothing."""
    describe = getattr(gemm, "describe", None)
    return "" if gemm is F.linear or describe is None else f", gemm={describe()}"

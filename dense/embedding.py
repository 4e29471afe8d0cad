"""Vocab-parallel input embedding and the (tied or untied) output head.

The vocabulary is split along dim 0 over the tp group: rank r holds rows
``[r * V/tp, (r + 1) * V/tp)``. The embedding looks up the ids that fall in its rows (the rest
give zeros) and the partial results are summed across TP: all-reduced, or with sequence
parallelism reduce-scattered along the sequence (dim 0) so that the first block receives its
sequence shard. The output head is a column-parallel projection to ``V/tp`` logits, consumed
as-is by ``vocab_parallel_cross_entropy`` (full logits are never gathered).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefold.dense.linear import ColumnParallelLinear, on_tp_input
from moefold.parallel.comm import reduce_from_region, reduce_scatter_sequence
from moefold.parallel.groups import Group, group_rank, group_size
from moefold.parallel.sharding import Shard, mark_sharded, normal_init, set_init


def check_vocab(vocab_size: int, tp: int) -> None:
    """Vocab-parallel layers need ``vocab_size % tp == 0`` (pad the vocabulary, see ``pad_vocab_size``)."""
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r} must be a positive integer")
    if vocab_size % tp != 0:
        raise ValueError(f"vocab_size={vocab_size} is not divisible by tp={tp}; pad it to "
                         f"{pad_vocab_size(vocab_size, tp)} (pad_vocab_size) or choose a tp that divides it")


def pad_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """Smallest size >= ``vocab_size`` divisible by ``tp * multiple`` (Megatron's padded vocab)."""
    step = tp * multiple
    return -(-vocab_size // step) * step


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over ``tp_group``.

    Local weight ``[V/tp, H]`` (``Shard(dim=0)``). forward(ids [S, B] int64, identical on every
    tp rank) -> ``[S, B, H]`` (all-reduced over TP), or with ``sequence_parallel`` this rank's
    sequence shard ``[S/tp, B, H]`` (reduce-scattered along dim 0).
    """

    def __init__(self, vocab_size: int, hidden: int, tp_group: Group, *, sequence_parallel: bool = False,
                 init_std: float = 0.02, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        tp = group_size(tp_group)
        check_vocab(vocab_size, tp)
        if not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"VocabParallelEmbedding hidden={hidden!r} must be a positive integer")
        self.vocab_size, self.hidden, self.tp_group, self.sequence_parallel = vocab_size, hidden, tp_group, \
            sequence_parallel
        self.vocab_start = group_rank(tp_group) * (vocab_size // tp)
        self.vocab_end = self.vocab_start + vocab_size // tp
        self.weight = nn.Parameter(torch.empty(vocab_size // tp, hidden, dtype=dtype, device=device))
        mark_sharded(self.weight, Shard.over(tp_group, 0))
        set_init(self.weight, normal_init(init_std))
        with torch.no_grad():
            self.weight.normal_(0.0, init_std)

    def forward(self, ids_SB: Tensor) -> Tensor:
        if group_size(self.tp_group) == 1:
            x_SBH = F.embedding(ids_SB, self.weight)
        else:
            outside = (ids_SB < self.vocab_start) | (ids_SB >= self.vocab_end)
            local_ids = (ids_SB - self.vocab_start).masked_fill(outside, 0)
            x_SBH = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(x_SBH, self.tp_group, dim=0)
        return reduce_from_region(x_SBH, self.tp_group)

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size}, hidden={self.hidden}, tp={group_size(self.tp_group)}, "
                f"sp={self.sequence_parallel}")


class OutputHead(nn.Module):
    """Projection to this rank's ``V/tp`` logits: column-parallel, untied or tied to the embedding.

    forward(x [S, B, H], or with ``sequence_parallel`` the shard [S/tp, B, H]) -> logits
    ``[S, B, V/tp]`` (the sequence is all-gathered first under SP; the input gradient is
    all-reduced / reduce-scattered over TP in backward).

    Tied: the head multiplies by ``tied_to.weight`` ([V/tp, H], the same shard layout) and owns no
    parameter; the embedding is referenced outside the module tree so that the shared weight is
    registered (and checkpointed, and reduced) once, by the embedding.
    """

    def __init__(self, hidden: int, vocab_size: int, tp_group: Group, *, sequence_parallel: bool = False,
                 tied_to: VocabParallelEmbedding | None = None, init_std: float = 0.02,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        check_vocab(vocab_size, group_size(tp_group))
        self.hidden, self.vocab_size, self.tp_group, self.sequence_parallel = hidden, vocab_size, tp_group, \
            sequence_parallel
        self._tied: tuple[VocabParallelEmbedding, ...] = ()
        if tied_to is not None:
            if (tied_to.vocab_size, tied_to.hidden) != (vocab_size, hidden):
                raise ValueError(f"OutputHead(hidden={hidden}, vocab_size={vocab_size}) cannot be tied to an embedding "
                                 f"with vocab_size={tied_to.vocab_size}, hidden={tied_to.hidden}")
            if group_size(tied_to.tp_group) != group_size(tp_group):
                raise ValueError(f"OutputHead (tp={group_size(tp_group)}) and its tied embedding "
                                 f"(tp={group_size(tied_to.tp_group)}) must use the same tp group")
            self._tied = (tied_to,)
            self.proj = None
        else:
            self.proj = ColumnParallelLinear(hidden, vocab_size, tp_group, sequence_parallel=sequence_parallel,
                                             init_std=init_std, dtype=dtype, device=device)

    @property
    def tied(self) -> bool:
        return bool(self._tied)

    @property
    def tied_to(self) -> VocabParallelEmbedding | None:
        """The embedding whose weight a tied head reads (outside this module's tree), else None."""
        return self._tied[0] if self._tied else None

    def forward(self, x: Tensor) -> Tensor:
        if self.proj is not None:
            return self.proj(x)
        weight = self._tied[0].weight   # SP: the GEMM keeps the shard (dense.linear.on_tp_input)
        return on_tp_input(x, self.tp_group, self.sequence_parallel, lambda x_in: F.linear(x_in, weight))

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, vocab={self.vocab_size}, tied={self.tied}, sp={self.sequence_parallel}"

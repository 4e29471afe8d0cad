"""Newton-Schulz orthogonalisation of Muon's momentum, its tensor-parallel forms, and the update scale.

Muon (K. Jordan, 2024) replaces a matrix's update by the orthogonal factor ``U V^T`` of its momentum ``G = U S V^T``,
approximated by a few odd-polynomial iterations on ``X = G / ||G||_F`` (transposed so that ``X X^T`` is the smaller
Gram matrix)::

    A = X X^T;   X <- a X + (b A + c A A) X        (one (a, b, c) per step)

The coefficient sets and their names are emerging_optimizers' (Megatron-Core's Muon calls them; ``quintic``, its
default, cycles five sets tuned for five steps; ``polar_express`` and ``cans`` repeat their last set past their
length). ``bf16=True`` is Megatron's ``--muon-fp32-matmul-prec medium``: the iteration runs in bf16 and returns fp32.

A matrix split over a tensor-parallel group (``parallel.sharding.Shard`` on one of its two matrix dims; a shard on a
leading dim, the experts' ep, only splits the batch) is orthogonalised in one of Megatron's ``--muon-tp-mode``\\ s:

- ``blockwise``: each rank's block on its own (no communication; the update differs from the unsplit matrix's);
- ``duplicated``: all-gather the matrix over the group, orthogonalise it whole on every rank, keep this rank's block
  (equals the unsplit matrix's update);
- ``distributed``: iterate on the blocks, all-reducing the Frobenius norm and each step's Gram matrix ``X X^T`` over
  the group (the split dim becomes the summed one; equals the unsplit update up to the order of the sums).

Shapes: ``x [..., M, N]`` (leading dims: a batch of matrices, e.g. ``[e, G, F, H]`` experts, each its own matrix).
"""

from __future__ import annotations

import enum
from itertools import chain, cycle, islice, repeat

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.parallel.groups import group_rank, group_size
from moefold.parallel.sharding import Shard
from moefold.training.optim.grad_sync import all_gather_into

COEFFICIENTS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
    "cans": ((8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
             (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)),
}
_REPEAT_LAST = ("polar_express", "cans")
EPS = 1e-7   # emerging_optimizers' default: the norm never divides by less


class TPMode(enum.Enum):
    BLOCKWISE = "blockwise"
    DUPLICATED = "duplicated"
    DISTRIBUTED = "distributed"


class ScaleMode(enum.Enum):
    SPECTRAL = "spectral"              # sqrt(max(M, N)): Kimi's Moonlight, AdamW-like update RMS with 0.2 extra
    SHAPE_SCALING = "shape_scaling"    # sqrt(max(1, M / N)): Keller Jordan's
    UNIT_RMS_NORM = "unit_rms_norm"    # sqrt(M / N): Scion's


def coefficients(kind: str, steps: int) -> list[tuple[float, float, float]]:
    """The ``steps`` (a, b, c) of coefficient set ``kind`` (see the module docstring)."""
    if kind not in COEFFICIENTS:
        raise ValueError(f"Newton-Schulz coefficients {kind!r}; valid: {', '.join(COEFFICIENTS)}")
    sets = COEFFICIENTS[kind]
    base = chain(sets, repeat(sets[-1])) if kind in _REPEAT_LAST else cycle(sets)
    return list(islice(base, steps))


def scale_factor(rows: int, cols: int, mode: ScaleMode) -> float:
    """Muon's update scale for a ``rows x cols`` matrix (``[out, in]``)."""
    if mode is ScaleMode.SPECTRAL:
        return max(rows, cols) ** 0.5
    if mode is ScaleMode.SHAPE_SCALING:
        return max(1.0, rows / cols) ** 0.5
    return (rows / cols) ** 0.5


def newton_schulz(x: Tensor, steps: int, kind: str = "quintic", *, bf16: bool = False,
                  transpose: bool | None = None, group=None) -> Tensor:
    """The orthogonal factor of each matrix of ``x [..., M, N]`` (fp32 in, fp32 out, same shape). ``transpose``:
    iterate on ``X^T`` (default: when M > N). ``group``: ``x`` holds this rank's columns of the iterated matrix
    (after the transpose); the norm and each ``X X^T`` are summed over ``group`` (``distributed`` mode)."""
    if x.dim() < 2:
        raise ValueError(f"newton_schulz needs matrices [..., M, N], got shape {tuple(x.shape)}")
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    X = x.mT if transpose else x
    lead = X.shape[:-2]
    X = X.reshape(-1, X.size(-2), X.size(-1))
    X = X if X.dtype == torch.float64 else X.float()   # float64 stays (the tests' exact comparison)
    sq = X.square().sum(dim=(-2, -1), keepdim=True)
    if group is not None:
        dist.all_reduce(sq, group=group)
    X = X / sq.sqrt().clamp_min(EPS)
    if bf16:
        X = X.bfloat16()
    for a, b, c in coefficients(kind, steps):
        A = X @ X.mT
        if group is not None:
            dist.all_reduce(A, group=group)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)
    X = (X if X.dtype == torch.float64 else X.float()).reshape(*lead, X.size(-2), X.size(-1))
    return X.mT if transpose else X


def matrix_shard(shards: tuple[Shard, ...], ndim: int) -> Shard | None:
    """The shard that splits one of the two matrix dims of a tensor with ``ndim`` dims (None: unsplit)."""
    split = [s for s in shards if s.dim in (ndim - 2, ndim - 1)]
    if len(split) > 1:
        raise ValueError(f"Muon orthogonalises matrices split along one dim; got shards on dims "
                         f"{[s.dim for s in split]}")
    return split[0] if split else None


def orthogonalize(x: Tensor, shard: Shard | None, mode: TPMode, steps: int, kind: str, scale: ScaleMode,
                  *, bf16: bool = False) -> Tensor:
    """Muon's scaled update for this rank's block ``x [..., m, n]`` of a batch of matrices split by ``shard`` (None:
    whole); ``[..., m, n]`` fp32. Collective over ``shard.group`` in the duplicated and distributed modes."""
    rows, cols = x.size(-2), x.size(-1)
    if shard is None or mode is TPMode.BLOCKWISE:
        return newton_schulz(x, steps, kind, bf16=bf16) * scale_factor(rows, cols, scale)
    dim = shard.dim % x.dim()
    n = group_size(shard.group)
    full_rows, full_cols = (rows * n, cols) if dim == x.dim() - 2 else (rows, cols * n)
    factor = scale_factor(full_rows, full_cols, scale)
    if mode is TPMode.DUPLICATED:
        parts = torch.empty(n * x.numel(), dtype=torch.float32, device=x.device)
        all_gather_into(parts, x.float().contiguous().view(-1), group=shard.group)
        full = torch.cat(parts.view(n, *x.shape).unbind(0), dim=dim)
        return newton_schulz(full, steps, kind, bf16=bf16).chunk(n, dim=dim)[group_rank(shard.group)] * factor
    # distributed: the split dim must be the one X X^T sums over (X's columns)
    return newton_schulz(x, steps, kind, bf16=bf16, transpose=dim == x.dim() - 2, group=shard.group) * factor

"""How a parameter is cut across ranks, gathering it back, and layout-independent init.

A sharded parameter carries ``param.moefold_shards``: a tuple of ``Shard(dim, num, index,
group)``, one per dimension it is split along (e.g. expert weights [e, F/etp, H]: dim 0 over
ep, dim 1 over etp). Everything that needs the full tensor (tests, checkpoints, HF export)
reads that instead of knowing each layer.

Initialisation is independent of the layout: ``init_parameters(module, seed)`` draws each row
of a parameter's full tensor from a generator seeded by (seed, parameter name, row) and keeps
this rank's slice, drawing only the rows it holds. The same seed gives the same full weights
at tp 1 and tp 8.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moefold.parallel.comm import _all_gather
from moefold.parallel.groups import Group, group_rank, group_size

# init function: fills a full-size tensor in place from the generator it is given
InitFn = Callable[[Tensor, torch.Generator], None]


@dataclass(frozen=True)
class Shard:
    """This rank holds chunk ``index`` of ``num`` equal chunks of ``dim``; ``group`` holds the rest."""

    dim: int
    num: int
    index: int
    group: Group

    @classmethod
    def over(cls, group: Group, dim: int) -> Shard:
        return cls(dim=dim, num=group_size(group), index=group_rank(group), group=group)


def mark_sharded(param: Tensor, *shards: Shard) -> Tensor:
    """Record how ``param`` is split (shards of size 1 are dropped). Returns ``param``."""
    param.moefold_shards = tuple(s for s in shards if s.num > 1)
    return param


def shards_of(param: Tensor) -> tuple[Shard, ...]:
    return getattr(param, "moefold_shards", ())


def full_shape(param: Tensor) -> tuple[int, ...]:
    """Shape of the unsharded tensor."""
    shape = list(param.shape)
    for s in shards_of(param):
        shape[s.dim] *= s.num
    return tuple(shape)


def local_slice(full: Tensor, shards: tuple[Shard, ...]) -> Tensor:
    """This rank's part of ``full`` (a view)."""
    for s in shards:
        full = full.chunk(s.num, dim=s.dim)[s.index]
    return full


def gather_full(tensor: Tensor, shards: tuple[Shard, ...]) -> Tensor:
    """All-gather ``tensor`` (a shard, or its gradient) back to full shape. No autograd.

    Collective over each shard's group: every member must call it.
    """
    out = tensor.detach()
    for s in reversed(shards):
        out = _all_gather(out, s.group, s.dim)
    return out.contiguous()


def set_init(param: Tensor, init_fn: InitFn) -> Tensor:
    """Attach the function that fills ``param``'s full tensor at ``init_parameters`` time."""
    param.moefold_init = init_fn
    return param


def normal_init(std: float) -> InitFn:
    def init(t: Tensor, gen: torch.Generator) -> None:
        t.normal_(0.0, std, generator=gen)

    return init


def init_parameters(module: nn.Module, seed: int) -> None:
    """Fill every parameter that has an init function, independently of the layout.

    Row ``i`` (index along dim 0 of the *full* tensor) of each parameter is drawn on the CPU in
    fp32 from a generator seeded by (seed, name, i), so the same full weights come out at every
    layout, yet each rank draws only the rows it holds: a rank holding 16 of 256 experts, or
    1/tp of the vocabulary, never materialises the full tensor. Shards along other dims are cut
    from those rows. Init functions must therefore fill elements i.i.d. (as ``normal_init``).
    Parameters without an init function keep their (deterministic) constructor values;
    meta-device parameters are skipped.
    """
    for name, param in module.named_parameters():
        init_fn = getattr(param, "moefold_init", None)
        if init_fn is None or param.is_meta:
            continue
        shards = shards_of(param)
        shape = full_shape(param)
        start, rows = 0, shape[0]
        for s in shards:  # local_slice applies shards in order: nested dim-0 chunks are sub-ranges
            if s.dim == 0:
                rows //= s.num
                start += s.index * rows
        base = (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
        gen = torch.Generator()
        block = torch.empty((rows, *shape[1:]), dtype=torch.float32, device="cpu")   # the generator is a CPU one
        for i in range(rows):
            gen.manual_seed((base + (start + i) * 0x9E3779B97F4A7C15) % 2**63)
            init_fn(block[i], gen)
        with torch.no_grad():
            param.copy_(local_slice(block, tuple(s for s in shards if s.dim != 0)))


def mark_sequence_parallel(param: Tensor) -> Tensor:
    """Flag a parameter replicated across TP whose gradient is partial under sequence parallelism
    (norm weights, router): its gradient must be all-reduced over the tp group."""
    param.moefold_sequence_parallel = True
    return param


def is_sequence_parallel(param: Tensor) -> bool:
    return getattr(param, "moefold_sequence_parallel", False)


def reduction_kind(param: Tensor) -> str:
    """Which group reduces ``param``'s gradient: "expert" (``param.moefold_expert``, set by ``moe.experts``: over
    edp), "sp" (``mark_sequence_parallel``: over tp x cp x dp) or "dense" (over dp x cp)."""
    if getattr(param, "moefold_expert", False):
        return "expert"
    if is_sequence_parallel(param):
        return "sp"
    return "dense"


def named_full_params(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter gathered to full shape (fp32 copies: later steps do not change them). Collective over
    each shard's group."""
    from torch.distributed.tensor import DTensor

    def local(p: Tensor) -> Tensor:   # an FSDP2 shard: gathered over its mesh first
        return p.full_tensor() if isinstance(p, DTensor) else p

    return {n: gather_full(local(p), shards_of(p)).to(torch.float32, copy=True) for n, p in model.named_parameters()}

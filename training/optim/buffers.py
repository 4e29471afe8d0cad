"""Flat parameter and gradient buffers per reduction group, cut into buckets that ranks own shards of.

Every trainable parameter belongs to one *reduction kind* (``reduction_kind``):

- ``expert``  (``param.moefold_expert``): reduced over ``edp`` (the other replicas of those experts);
- ``sp``      (``parallel.sharding.is_sequence_parallel``): replicated over tp but with a partial
              gradient (sequence parallelism, or tokens split over tp), reduced over ``tp x cp x dp``;
- ``dense``   (everything else): reduced over ``dp x cp``.

Parameters of one kind and dtype share one ``FlatGroup``; parameters an optimizer updates whole (Muon's
matrices, ``training.optim.muon``: the ``whole`` predicate) get groups of their own, laid out so that every
parameter lies inside one rank's chunk (``_layout_whole``); FP8 primary weights (``--fp8-param-gather``,
``precision.fp8_param``) get groups of their own, whose buckets are all-gathered as FP8
(``training.optim.fp8_param_gather``). A module that several pipeline stages hold (the
embedding with MTP or tied weights, an untied output head that a standalone MTP stage reads:
``moefold_pipeline_copies``) gets a group of its own, so its layout, and hence the shard each rank owns, is the
same on every holding stage (its group in ``copies_groups`` sums them).

Layout of a group of ``n`` ranks (``n = 1``: no collective anywhere)::

    params in reverse registration order (~ the order backward produces their gradients), each
    starting at a multiple of ALIGN elements; buckets = runs of consecutive params closed once they
    hold >= bucket_numel elements, each padded to a multiple of n * ALIGN elements so that it splits
    into n equal, aligned chunks. Rank r of the group owns chunk r of every bucket (Megatron's
    distributed optimizer): the reduce-scatter of a bucket's gradients leaves the sum of chunk r on
    rank r, the optimizer updates it, the all-gather of the bucket brings every chunk to every rank.

    param_data [numel] (the parameters' dtype): every ``param.data`` is a view into it
    grad_data  [numel] (main-grads dtype):      every ``param.main_grad`` is a view into it
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import Group, group_rank, group_size
from moefold.parallel.sharding import reduction_kind

KINDS = ("dense", "sp", "expert")
WHOLE_SLACK = 16   # a whole-layout bucket pads at most 1/16 of its elements (``_layout_whole``)
ALIGN = 16   # elements: parameter and chunk starts stay 64-byte (fp32) / 32-byte (bf16) aligned for vector kernels


def kind_group(kind: str, dims: ParallelDims) -> Group:
    """The process group that sums gradients of ``kind``."""
    if kind == "expert":
        return dims.edp_group
    if kind == "sp":
        return dims.tp_cp_dp_group
    if kind == "dense":
        return dims.dp_cp_group
    raise ValueError(f"unknown reduction kind {kind!r}; valid: {KINDS}")


def _align(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class Bucket:
    """``[start, end)`` of its group's buffers (``end - start`` a multiple of ``n * ALIGN``) holding
    ``params`` (indices into ``FlatGroup.params``). Per-step state: ``pending`` reports before the
    reduce-scatter launches, the in-flight ``grad_work`` / ``param_work`` handles."""

    start: int
    end: int
    params: list[int]
    pending: int = 0
    grad_work: object | None = None
    param_work: object | None = None

    def chunk(self, n: int, r: int) -> tuple[int, int]:
        """Buffer range of chunk ``r`` of ``n``."""
        c = (self.end - self.start) // n
        return self.start + r * c, self.start + (r + 1) * c


@dataclass
class FlatGroup:
    """The parameters of one reduction kind (and dtype) in one pair of flat buffers (module docstring).

    ``group``: the reduction group; ``copies_group``: the pipeline stages holding the other copies of these
    parameters (None unless shared across stages). ``offsets[i]``: where ``params[i]`` starts.
    """

    kind: str
    group: Group
    copies_group: Group
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]
    buckets: list[Bucket]
    param_data: Tensor
    grad_data: Tensor
    bucket_of: list[int] = field(default_factory=list)
    fp8: bool = False   # FP8 primary weights: gathered as e4m3 (training.optim.fp8_param_gather)
    whole: bool = False  # every parameter inside one rank's chunk (``_layout_whole``)

    @property
    def size(self) -> int:
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    def owned(self, bucket: Bucket) -> tuple[int, int]:
        """This rank's chunk of ``bucket`` (buffer range)."""
        return bucket.chunk(self.size, self.rank)

    def pieces(self, bucket: Bucket) -> list[tuple[int, int, int]]:
        """(param index, lo, hi): the flat range ``[lo, hi)`` of each parameter that lies in this rank's chunk."""
        c0, c1 = self.owned(bucket)
        out = []
        for i in bucket.params:
            o, n = self.offsets[i], self.params[i].numel()
            lo, hi = max(o, c0), min(o + n, c1)
            if lo < hi:
                out.append((i, lo - o, hi - o))
        return out


def build_flat_groups(named_params: Iterable[tuple[str, nn.Parameter]], dims: ParallelDims, *,
                      bucket_numel: int, grad_dtype: torch.dtype,
                      copies_groups: Mapping[str, Group] | None = None,
                      whole: Callable[[str, nn.Parameter], bool] | None = None) -> list[FlatGroup]:
    """Lay out every parameter that requires grad (see the module docstring); afterwards ``param.data``
    and ``param.main_grad`` are views into the groups' buffers (values unchanged, gradients zero).
    ``copies_groups``: {top-level module name: the pipeline group summing its copies}. ``whole(name, param)``:
    the parameters whose every element one rank owns (groups of their own, ``_layout_whole``)."""
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel={bucket_numel} must be >= 1")
    copies_groups = dict(copies_groups or {})
    by_key: dict[tuple[str, str, torch.dtype, bool, bool], list[tuple[str, nn.Parameter]]] = {}
    for name, p in named_params:
        if p.requires_grad:
            module = name.split(".", 1)[0]
            shared = module if getattr(p, "moefold_pipeline_copies", 1) > 1 and module in copies_groups else ""
            fp8 = getattr(p, "moefold_fp8_param", None) is not None
            one_owner = whole is not None and whole(name, p)
            by_key.setdefault((reduction_kind(p), shared, p.dtype, fp8, one_owner), []).append((name, p))
    keys = sorted(by_key, key=lambda k: (KINDS.index(k[0]), k[1], str(k[2]), k[3], k[4]))
    # reversed registration order ~ the order in which backward produces the gradients
    return [(_layout_whole if one_owner else _layout)(
                kind, list(reversed(by_key[(kind, shared, dtype, fp8, one_owner)])), kind_group(kind, dims),
                copies_groups[shared] if shared else None, bucket_numel, grad_dtype, fp8)
            for kind, shared, dtype, fp8, one_owner in keys]


def _layout(kind: str, items: list[tuple[str, nn.Parameter]], group: Group, copies_group: Group,
            bucket_numel: int, grad_dtype: torch.dtype, fp8: bool = False) -> FlatGroup:
    n = group_size(group)
    offsets, buckets, bucket_of = [], [], []
    cursor = start = 0
    members: list[int] = []
    for i, (_, p) in enumerate(items):
        offsets.append(_align(cursor, ALIGN))
        cursor = offsets[-1] + p.numel()
        members.append(i)
        bucket_of.append(len(buckets))
        if cursor - start >= bucket_numel or i == len(items) - 1:
            end = start + _align(max(cursor - start, 1), n * ALIGN)
            buckets.append(Bucket(start, end, members))
            start = cursor = end
            members = []
    return _bind(kind, items, group, copies_group, offsets, buckets, bucket_of, start, grad_dtype, fp8)


def _share_out(sizes: dict[int, int], n: int) -> tuple[dict[int, int], dict[int, int], int]:
    """({item: chunk}, {item: offset in its chunk}, chunk length): the items go to the ``n`` chunks largest first,
    each to the chunk that holds the fewest elements so far (ties: the lowest rank); every start aligned."""
    fill = [0] * n
    owner, at = {}, {}
    for j in sorted(sizes, key=lambda j: (-sizes[j], j)):
        r = min(range(n), key=lambda r: (fill[r], r))
        owner[j], at[j] = r, fill[r]
        fill[r] += _align(sizes[j], ALIGN)
    return owner, at, _align(max(max(fill), 1), ALIGN)


def _layout_whole(kind: str, items: list[tuple[str, nn.Parameter]], group: Group, copies_group: Group,
                  bucket_numel: int, grad_dtype: torch.dtype, fp8: bool = False) -> FlatGroup:
    """Like ``_layout``, but each parameter lies inside one chunk (``_share_out``). A bucket closes once it holds >=
    bucket_numel elements and its padding (n x chunk length - elements) is at most 1/``WHOLE_SLACK`` of them (a
    rank's chunk is as long as the fullest one's), or at the last parameter. Rank r's chunk r then holds whole
    parameters: the reduce-scatter leaves their complete gradients on r and the all-gather spreads what r computed
    from them (Megatron's layer-wise distributed optimizer, without its separate all-reduce and all-gather-v). The
    layout depends only on the parameters' local shapes, so ranks that hold the same parameters (tp, etp peers)
    own the same ones."""
    n = group_size(group)
    offsets, buckets, bucket_of = [0] * len(items), [], [0] * len(items)
    start = 0
    members: dict[int, int] = {}
    for i, (_, p) in enumerate(items):
        members[i] = p.numel()
        filled = sum(_align(m, ALIGN) for m in members.values())
        if filled < bucket_numel and i < len(items) - 1:
            continue
        owner, at, chunk = _share_out(members, n)
        if n * chunk - filled > filled // WHOLE_SLACK and i < len(items) - 1:
            continue   # too uneven yet: more parameters even the chunks out
        for j in members:
            offsets[j] = start + owner[j] * chunk + at[j]
            bucket_of[j] = len(buckets)
        buckets.append(Bucket(start, start + n * chunk, sorted(members, key=lambda j: offsets[j])))
        start += n * chunk
        members = {}
    return _bind(kind, items, group, copies_group, offsets, buckets, bucket_of, start, grad_dtype, fp8, whole=True)


def _bind(kind: str, items: list[tuple[str, nn.Parameter]], group: Group, copies_group: Group, offsets: list[int],
          buckets: list[Bucket], bucket_of: list[int], numel: int, grad_dtype: torch.dtype, fp8: bool,
          whole: bool = False) -> FlatGroup:
    """Allocate the group's buffers of ``numel`` elements and make every parameter a view at its offset."""
    p0 = items[0][1]
    param_data = torch.zeros(numel, dtype=p0.dtype, device=p0.device)
    grad_data = torch.zeros(numel, dtype=grad_dtype, device=p0.device)
    for (_, p), off in zip(items, offsets):
        view = param_data[off:off + p.numel()].view(p.shape)
        view.copy_(p.detach())
        p.data = view   # Megatron's param buffer: the all-gather writes the parameters in place
        p.main_grad = grad_data[off:off + p.numel()].view(p.shape)
    return FlatGroup(kind=kind, group=group, copies_group=copies_group, names=[nm for nm, _ in items],
                     params=[p for _, p in items], offsets=offsets, buckets=buckets, param_data=param_data,
                     grad_data=grad_data, bucket_of=bucket_of, fp8=fp8, whole=whole)

"""Which decoder layers each pipeline rank and virtual chunk holds (Megatron's split).

The model is cut into ``pp * vpp`` *model chunks* of consecutive layers. Virtual chunk ``c`` of
pipeline rank ``r`` holds model chunk ``c * pp + r`` (interleaved assignment), so a micro-batch
visits rank 0, 1, ..., pp-1, then rank 0 again for chunk 1, and so on. Model chunk 0 also holds
the embedding; the last model chunk holds the final norm, the output head, the loss and MTP.

Split rules (Megatron-LM's ``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers``): without them every model chunk holds
``num_layers / (pp * vpp)`` layers. With them, the first (last) pipeline rank holds the given
number of layers, divided evenly over its ``vpp`` chunks, and the remaining layers are divided
evenly over the other ranks' chunks. Per virtual round ``c`` the chunks of rank 0..pp-1 hold
consecutive layers, exactly as Megatron's ``get_transformer_layer_offset``.

With the V placement (``zbv``, ``dualpipev``: ``actions.Placement.V``) rank r holds model chunks r and
``2 pp - 1 - r`` (its chunks 0 and 1), every chunk ``num_layers / (2 pp)`` layers; rank 0 then holds the
embedding and the head.

Layers keep their *global* index (e.g. an ``nn.ModuleDict`` keyed by ``str(layer_index)``), so a
stage's parameter names are a subset of the unsplit model's and checkpoints reshard across pp.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from moefold.pipeline.actions import Placement, model_chunk, rank_and_chunk


@dataclass(frozen=True)
class ChunkSpec:
    """One virtual chunk of one pipeline rank.

    ``model_chunk`` is its position in the forward order (0 .. pp*vpp-1); ``layers`` the global
    indices of its decoder layers (possibly empty for an embedding-only first chunk).
    """

    pp_rank: int
    chunk: int
    model_chunk: int
    layers: range
    has_embedding: bool
    has_head: bool


@dataclass(frozen=True)
class StageLayout:
    """The layer split for ``num_layers`` decoder layers over ``pp`` ranks x ``vpp`` virtual chunks.

    ``first_stage_layers`` / ``last_stage_layers`` are Megatron's
    ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` (None: even).
    Invalid combinations raise ValueError at construction, naming the numbers.
    """

    num_layers: int
    pp: int = 1
    vpp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    placement: Placement = Placement.INTERLEAVED

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", Placement(self.placement))
        for name in ("num_layers", "pp", "vpp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.vpp > 1 and self.pp < 2:
            raise ValueError(f"vpp={self.vpp} (virtual pipeline stages) needs pp >= 2, got pp={self.pp}")
        uneven = self.first_stage_layers is not None or self.last_stage_layers is not None
        if uneven and self.pp < 2:
            raise ValueError("decoder_first/last_pipeline_num_layers need pp >= 2, got "
                             f"pp={self.pp}")
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is None:
                continue
            flag = "--decoder-" + name.split("_")[0] + "-pipeline-num-layers"
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{flag}={value!r} must be a non-negative integer")
            if value % self.vpp != 0:
                raise ValueError(f"{flag}={value} is not divisible by vpp={self.vpp} "
                                 "(each virtual chunk of that rank gets an equal share)")
        if self.placement == Placement.V:
            if self.vpp != 2:
                raise ValueError(f"the V placement (zbv, dualpipev) holds 2 chunks per rank, got vpp={self.vpp}")
            if uneven:
                raise ValueError("the V placement (zbv, dualpipev) splits the layers evenly: drop "
                                 "--decoder-first/last-pipeline-num-layers")
        _ = self.per_round_counts  # validates the middle split

    @cached_property
    def per_round_counts(self) -> tuple[int, ...]:
        """Layers of each rank's chunk in one virtual round (same for every round)."""
        pp, vpp, n = self.pp, self.vpp, self.num_layers
        first, last = self.first_stage_layers, self.last_stage_layers
        if first is None and last is None:
            if n < pp * vpp:
                raise ValueError(f"num_layers={n} is too few for pp*vpp={pp}*{vpp}={pp * vpp} model chunks "
                                 "(each needs at least one layer); lower vpp or pp")
            if n % (pp * vpp) != 0:
                valid = f"a multiple of pp*vpp={pp}*{vpp}={pp * vpp}"
                raise ValueError(f"num_layers={n} is not divisible by pp*vpp={pp}*{vpp}={pp * vpp}; "
                                 f"use num_layers {valid}, or set --decoder-first/last-pipeline-num-layers")
            return (n // (pp * vpp),) * pp
        fixed = (first or 0) + (last or 0)
        middle_ranks = pp - (first is not None) - (last is not None)
        middle = n - fixed
        if middle < 0:
            raise ValueError(f"decoder first+last pipeline layers={fixed} exceed num_layers={n}")
        if middle_ranks == 0:
            if middle != 0:
                raise ValueError(f"with pp={pp} every rank is first or last: first+last={fixed} must equal "
                                 f"num_layers={n}")
            per_middle = 0
        else:
            if middle % (middle_ranks * vpp) != 0 or middle == 0:
                raise ValueError(
                    f"num_layers={n} minus first/last stage layers={fixed} leaves {middle} layers, which do not "
                    f"divide evenly (at least one each) over {middle_ranks} middle ranks x vpp={vpp} chunks")
            per_middle = middle // (middle_ranks * vpp)
        counts = [per_middle] * pp
        if first is not None:
            counts[0] = first // vpp
        if last is not None:
            counts[-1] = last // vpp
        return tuple(counts)

    @property
    def num_model_chunks(self) -> int:
        return self.pp * self.vpp

    def model_chunk(self, pp_rank: int, chunk: int) -> int:
        """Forward-order index of virtual chunk ``chunk`` of rank ``pp_rank``: ``chunk * pp + pp_rank`` (interleaved),
        ``pp_rank`` / ``2 pp - 1 - pp_rank`` (V)."""
        self._check(pp_rank, chunk)
        return model_chunk(pp_rank, chunk, self.pp, self.placement)

    @cached_property
    def model_chunk_layers(self) -> tuple[int, ...]:
        """Layers of each model chunk, in forward order."""
        counts = self.per_round_counts
        return tuple(counts[rank_and_chunk(mc, self.pp, self.placement)[0]] if self.placement != Placement.V
                     else counts[0] for mc in range(self.num_model_chunks))

    def chunk_spec(self, pp_rank: int, chunk: int) -> ChunkSpec:
        """Layers and extra modules of one (pp_rank, virtual chunk)."""
        mc = self.model_chunk(pp_rank, chunk)
        start = sum(self.model_chunk_layers[:mc])
        return ChunkSpec(pp_rank=pp_rank, chunk=chunk, model_chunk=mc,
                         layers=range(start, start + self.model_chunk_layers[mc]),
                         has_embedding=mc == 0, has_head=mc == self.num_model_chunks - 1)

    def rank_chunks(self, pp_rank: int) -> list[ChunkSpec]:
        """The ``vpp`` chunks of one rank, in virtual-chunk order."""
        return [self.chunk_spec(pp_rank, c) for c in range(self.vpp)]

    def rank_layers(self, pp_rank: int) -> list[int]:
        """Every global layer index held by ``pp_rank`` (all its chunks)."""
        return [i for spec in self.rank_chunks(pp_rank) for i in spec.layers]

    def describe(self) -> str:
        """One line per rank: its chunks' layer ranges, embedding and head."""
        lines = []
        for r in range(self.pp):
            parts = []
            for s in self.rank_chunks(r):
                layers = ("no layers" if not s.layers else f"layer {s.layers.start}" if len(s.layers) == 1
                          else f"layers {s.layers.start}-{s.layers.stop - 1}")
                extra = (" +embedding" if s.has_embedding else "") + (" +norm/head/loss/MTP" if s.has_head else "")
                parts.append(f"chunk {s.chunk}: {layers}{extra}")
            lines.append(f"pp rank {r}: " + "; ".join(parts))
        return "\n".join(lines)

    def _check(self, pp_rank: int, chunk: int) -> None:
        if not 0 <= pp_rank < self.pp:
            raise ValueError(f"pp_rank={pp_rank} out of range for pp={self.pp}")
        if not 0 <= chunk < self.vpp:
            raise ValueError(f"chunk={chunk} out of range for vpp={self.vpp}")


def vpp_from_layers_per_virtual_stage(num_layers: int, pp: int, layers_per_virtual_stage: int | None) -> int:
    """Megatron's ``--num-layers-per-virtual-pipeline-stage M`` -> vpp = num_layers / (pp * M)."""
    if layers_per_virtual_stage is None:
        return 1
    m = layers_per_virtual_stage
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"num_layers_per_virtual_pipeline_stage={m!r} must be a positive integer")
    if num_layers % (pp * m) != 0:
        raise ValueError(f"num_layers={num_layers} is not divisible by pp*num_layers_per_virtual_pipeline_stage="
                         f"{pp}*{m}={pp * m}")
    return num_layers // (pp * m)


def chunk_costs(layout: StageLayout) -> tuple[tuple[float, ...], ...]:
    """Relative forward time of every (rank, chunk) for a schedule's communication placement
    (``build_schedule(chunk_costs=...)``): its layer count, the embedding and the head counted as one layer each
    (at least 1, so that an embedding-only chunk still takes time)."""
    return tuple(tuple(max(1.0, len(s.layers) + s.has_embedding + s.has_head) for s in layout.rank_chunks(r))
                 for r in range(layout.pp))

"""Which decoder layers, embedding, MTP layers and loss each pipeline rank and virtual chunk holds.

The model is cut into ``pp * vpp`` *model chunks* (virtual stages) in forward order. The split is a list of what
each model chunk holds, in the items of Megatron's ``--pipeline-model-parallel-layout`` (``pipeline.layout``: ``E``
embedding, ``t`` decoder layer, ``m`` MTP layer, ``L`` final norm + output head + loss), either given as that flag
or made by the shorthands:

- even (no flag): every model chunk holds ``num_layers / (pp * vpp)`` layers;
- Megatron-LM's ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``: the first (last)
  pipeline rank holds the given number of layers, divided evenly over its ``vpp`` chunks, and the remaining layers
  are divided evenly over the other ranks' chunks (per virtual round the chunks of rank 0..pp-1 hold consecutive
  layers, exactly as Megatron's ``get_transformer_layer_offset``);

both with the embedding in model chunk 0 and the MTP layers and loss in the last one.

Placement: virtual chunk ``c`` of pipeline rank ``r`` holds model chunk ``c * pp + r`` (interleaved, Megatron's round
robin), so a micro-batch visits rank 0, 1, ..., pp-1, then rank 0 again for chunk 1, and so on. With the V placement
(``zbv``, ``dualpipev``: ``actions.Placement.V``) rank r holds model chunks r and ``2 pp - 1 - r`` (its chunks 0 and
1); without a layout every chunk holds ``num_layers / (2 pp)`` layers and rank 0 the embedding and the head.

Layers keep their *global* index (e.g. an ``nn.ModuleDict`` keyed by ``str(layer_index)``), so a
stage's parameter names are a subset of the unsplit model's and checkpoints reshard across layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from moefold.pipeline.actions import Placement, model_chunk, rank_and_chunk
from moefold.pipeline.layout import check_layout, format_layout, parse_layout


@dataclass(frozen=True)
class ChunkSpec:
    """One virtual chunk of one pipeline rank.

    ``model_chunk`` is its position in the forward order (0 .. pp*vpp-1); ``layers`` the global indices of its
    decoder layers (possibly empty: an embedding-only, MTP-only, loss-only or empty chunk); ``has_head`` the final
    norm, output head and LM loss; ``has_mtp`` the model's MTP layers (with their loss, the output head's copy and
    the embedding's copy that they read); ``has_final_norm`` the final norm, applied after its layers: with the
    loss, or, when the model has MTP, with the last decoder layer (Megatron-Core's
    ``has_final_layernorm_in_this_stage``), so that the MTP layers read the normalised hidden state wherever they are.
    """

    pp_rank: int
    chunk: int
    model_chunk: int
    layers: range
    has_embedding: bool
    has_head: bool
    has_mtp: bool = False
    has_final_norm: bool = False

    @property
    def reads_embedding(self) -> bool:
        """Its forward reads ``embed_tokens`` (the embedding, or MTP's input embedding); a tied head too: see
        ``StageLayout.embedding_chunks``."""
        return self.has_embedding or self.has_mtp


@dataclass(frozen=True)
class StageLayout:
    """The split of ``num_layers`` decoder layers (and embedding, MTP, loss) over ``pp`` ranks x ``vpp`` virtual chunks.

    ``layout``: Megatron's ``--pipeline-model-parallel-layout`` (text or list of lists; ``pipeline.layout``), which
    fixes vpp (its stages / pp; ``vpp`` must then be 1 or that). Without it: ``first_stage_layers`` /
    ``last_stage_layers`` are Megatron's ``--decoder-first/last-pipeline-num-layers`` (None: even).
    ``mtp_num_layers``: the model's MTP layers; None puts whatever the model has with the loss (a layout's ``m``
    count is then not checked). Invalid combinations raise ValueError at construction, naming the numbers.
    """

    num_layers: int
    pp: int = 1
    vpp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    placement: Placement = Placement.INTERLEAVED
    layout: str | tuple | None = None
    mtp_num_layers: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", Placement(self.placement))
        if isinstance(self.layout, list):
            object.__setattr__(self, "layout", tuple(tuple(stage) for stage in self.layout))
        for name in ("num_layers", "pp", "vpp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.layout is not None:
            self._check_explicit()
        else:
            self._check_shorthands()
        _ = self.stages   # validates

    def _check_explicit(self) -> None:
        uneven = self.first_stage_layers is not None or self.last_stage_layers is not None
        if uneven:
            raise ValueError("--pipeline-model-parallel-layout cannot be combined with "
                             "--decoder-first/last-pipeline-num-layers (the layout already places every layer); "
                             "drop one of them")
        stages = parse_layout(self.layout)
        mtp = "".join(stages).count("m")
        if self.mtp_num_layers is not None:
            mtp = self.mtp_num_layers
        vpp = len(stages) // self.pp if len(stages) % self.pp == 0 else self.vpp
        if self.placement == Placement.V and vpp != 2:
            raise ValueError(f"the V placement (zbv, dualpipev) holds 2 chunks per rank: "
                             f"--pipeline-model-parallel-layout needs 2 x pp={2 * self.pp} virtual stages, got "
                             f"{len(stages)}")
        given = self.layout if isinstance(self.layout, str) else None
        vpp = check_layout(stages, self.pp, self.num_layers, mtp,
                           lambda mc: rank_and_chunk(mc, self.pp, self.placement), text=given)
        if self.vpp not in (1, vpp):
            raise ValueError(f"--pipeline-model-parallel-layout has {len(stages)} virtual stages = pp {self.pp} x "
                             f"{vpp}, but vpp={self.vpp} was asked for; drop one of them")
        object.__setattr__(self, "vpp", vpp)

    def _check_shorthands(self) -> None:
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
                                 "(each virtual chunk of that rank gets an equal share; for uneven virtual stages "
                                 "give --pipeline-model-parallel-layout)")
        if self.placement == Placement.V:
            if self.vpp != 2:
                raise ValueError(f"the V placement (zbv, dualpipev) holds 2 chunks per rank, got vpp={self.vpp}")
            if uneven:
                raise ValueError("the V placement (zbv, dualpipev) splits the layers evenly without a layout: drop "
                                 "--decoder-first/last-pipeline-num-layers or give --pipeline-model-parallel-layout")

    @cached_property
    def per_round_counts(self) -> tuple[int, ...]:
        """Layers of each rank's chunk in one virtual round (same for every round): the shorthands' split."""
        if self.layout is not None:
            raise ValueError("per_round_counts describes the even / first-last splits; an explicit layout has "
                             "`stages`")
        pp, vpp, n = self.pp, self.vpp, self.num_layers
        first, last = self.first_stage_layers, self.last_stage_layers
        if first is None and last is None:
            if n < pp * vpp:
                raise ValueError(f"num_layers={n} is too few for pp*vpp={pp}*{vpp}={pp * vpp} model chunks "
                                 "(each needs at least one layer); lower vpp or pp, or give "
                                 "--pipeline-model-parallel-layout (empty stages allowed)")
            if n % (pp * vpp) != 0:
                valid = f"a multiple of pp*vpp={pp}*{vpp}={pp * vpp}"
                raise ValueError(f"num_layers={n} is not divisible by pp*vpp={pp}*{vpp}={pp * vpp}; "
                                 f"use num_layers {valid}, set --decoder-first/last-pipeline-num-layers, or give "
                                 f"--pipeline-model-parallel-layout")
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

    @cached_property
    def stages(self) -> tuple[str, ...]:
        """What each model chunk holds, in forward order, in ``pipeline.layout``'s letters (``E``, ``t``, ``m``,
        ``L``; without a layout and ``mtp_num_layers=None`` the loss's chunk shows no ``m``)."""
        if self.layout is not None:
            return parse_layout(self.layout)
        counts = self.per_round_counts
        stages = []
        for mc in range(self.num_model_chunks):
            rank = rank_and_chunk(mc, self.pp, self.placement)[0]
            stages.append("t" * (counts[0] if self.placement == Placement.V else counts[rank]))
        stages[0] = "E" + stages[0]
        stages[-1] += "m" * (self.mtp_num_layers or 0) + "L"
        return tuple(stages)

    @property
    def text(self) -> str:
        """The layout as ``--pipeline-model-parallel-layout`` text."""
        return format_layout(self.stages)

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
        """Decoder layers of each model chunk, in forward order."""
        return tuple(stage.count("t") for stage in self.stages)

    def chunk_spec(self, pp_rank: int, chunk: int) -> ChunkSpec:
        """Layers and extra modules of one (pp_rank, virtual chunk)."""
        mc = self.model_chunk(pp_rank, chunk)
        start = sum(self.model_chunk_layers[:mc])
        stage = self.stages[mc]
        head = "L" in stage
        layers = range(start, start + self.model_chunk_layers[mc])
        with_mtp = bool(self.mtp_num_layers) or "m" in "".join(self.stages)
        return ChunkSpec(pp_rank=pp_rank, chunk=chunk, model_chunk=mc, layers=layers, has_embedding="E" in stage,
                         has_head=head, has_mtp="m" in stage or (head and self.mtp_num_layers is None
                                                                 and self.layout is None),
                         has_final_norm=(self.num_layers - 1 in layers) if with_mtp else head)

    def rank_chunks(self, pp_rank: int) -> list[ChunkSpec]:
        """The ``vpp`` chunks of one rank, in virtual-chunk order."""
        self._check(pp_rank, 0)
        return list(self._rank_chunks[pp_rank])

    @cached_property
    def _rank_chunks(self) -> tuple[tuple[ChunkSpec, ...], ...]:
        # made once per layout: the planner asks for every rank's chunks per layout it plans (the specs are frozen)
        return tuple(tuple(self.chunk_spec(r, c) for c in range(self.vpp)) for r in range(self.pp))

    def rank_layers(self, pp_rank: int) -> list[int]:
        """Every global layer index held by ``pp_rank`` (all its chunks)."""
        return [i for spec in self.rank_chunks(pp_rank) for i in spec.layers]

    def chunks_where(self, holds) -> list[ChunkSpec]:
        """Every chunk (all ranks) for which ``holds(spec)`` is true, in forward order."""
        specs = [s for r in range(self.pp) for s in self.rank_chunks(r)]
        return sorted((s for s in specs if holds(s)), key=lambda s: s.model_chunk)

    def embedding_chunks(self, tied: bool) -> list[ChunkSpec]:
        """The chunks whose forward reads ``embed_tokens``: the embedding's, MTP's, and the head's when ``tied``."""
        return self.chunks_where(lambda s: s.reads_embedding or (tied and s.has_head))

    def output_head_chunks(self) -> list[ChunkSpec]:
        """The chunks whose forward reads the output head: the loss's and MTP's."""
        return self.chunks_where(lambda s: s.has_head or s.has_mtp)

    def describe(self) -> str:
        """One line per rank: its chunks' layer ranges, embedding, MTP and head."""
        lines = []
        for r in range(self.pp):
            parts = []
            for s in self.rank_chunks(r):
                layers = ("no layers" if not s.layers else f"layer {s.layers.start}" if len(s.layers) == 1
                          else f"layers {s.layers.start}-{s.layers.stop - 1}")
                tail = {(True, True): " +norm/head/loss/MTP", (True, False): " +norm/head/loss",
                        (False, True): " +MTP", (False, False): ""}[(s.has_head, s.has_mtp)]
                extra = (" +embedding" if s.has_embedding else "") + tail
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
    (``build_schedule(chunk_costs=...)``): its decoder and MTP layers, the embedding and the head counted as one
    layer each; an empty chunk (it passes the hidden state on) 0.1, as the schedules need positive costs."""
    def cost(spec: ChunkSpec) -> float:
        stage = layout.stages[spec.model_chunk]
        mtp = max(stage.count("m"), int(spec.has_mtp))
        return max(0.1, float(len(spec.layers) + spec.has_embedding + spec.has_head + mtp))

    return tuple(tuple(cost(s) for s in layout.rank_chunks(r)) for r in range(layout.pp))

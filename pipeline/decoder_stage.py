"""The MoE decoder as a :class:`pipeline.executor.PipelineStage`: the one adapter that the trainer and
the tests use.

    layout = StageLayout(config.num_layers, pp, vpp, first, last)
    model = build_stage_model(config, dims, options, layout)        # this rank's chunks, unsplit names
    model.init_weights(seed)
    apply_execution(model, ExecutionPlan(options), dims)              # recompute, offload, FP8 (moefold.execution)
    embed_group = embedding_group(model, dims, layout)                # once (collective)
    stage = DecoderStage(model, layout, dims.pp_rank)                 # one per step (overlap=OverlapConfig(...):
                                                                      # the chunks run as pieces, FB overlapped)
    result = run_schedule(stage, schedule, microbatches, stage.loss_fn, dims.pp_group,
                          stage.activation_spec(micro_batch_size, seq_len))
    stage.lm_losses, stage.mtp_losses, stage.moe_infos                # this step's values on this stage

A micro-batch is a dict: ``index`` (its position in the step), ``input_ids`` and ``labels``
``[B, S]`` (this rank's CP slice), optional ``loss_mask``, ``position_ids`` ``[S]`` and ``documents`` (the packed
documents, ``dense.documents``). Every stage
reads ``input_ids`` for its sequence length (and MTP), so give each rank the micro-batch's data (or
at least tensors of the right shape).

What crosses stages is the hidden state ``[S/tp, B, H]`` (the sequence-parallel shard). MoE aux
losses of the layers of a chunk are that chunk's *extra loss*: they reach the gradients on their
own stage, with no cross-stage reduction. The model's last chunk returns the loss share itself
(LM + weighted MTP), and the MTP layers' MoE aux losses as its extra loss; ``loss_fn`` is the
identity (wrap it to transform the loss, e.g. for fault injection in tests).

Batch-level overlap (``overlap=OverlapConfig(...)``, ``--overlap-moe-expert-parallel-comm``): every chunk runs as
the pieces of ``models.sublayers`` through ``pipeline.overlap`` (stitched into the executor's autograd graph, so
a plain B action runs its pieces' backward), and an FB action runs one micro-batch's forward interleaved with
another's backward (``forward_backward_step``). The values and gradients are the plain forward's.

Tied embeddings / MTP: every stage whose chunks read the embedding (the first, MTP's, a tied head's) holds its
own copy of ``embed_tokens`` (same name everywhere), and a standalone MTP stage holds a copy of the untied output
head; ``shared_weight_groups`` groups the holders so that the trainer can sum each copy's gradient over them
(Megatron's embedding group, wherever ``--pipeline-model-parallel-layout`` puts them). A chunk that only passes
the hidden state on (an empty stage, a standalone MTP stage) returns the received activation itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moefold.models.config import ModelConfig
from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.models.sublayers import Compute, LayerCarry, Piece, block_pieces, check_overlap
from moefold.moe.balance_losses import GlobalLoadState
from moefold.moe.layer import MoEOutputInfo
from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import Group
from moefold.pipeline.executor import BackwardStep
from moefold.pipeline.overlap import ChunkRun, OverlapConfig, backward_seed, run_overlapped, stitch
from moefold.pipeline.p2p import TensorSpec
from moefold.pipeline.stages import StageLayout


def build_stage_model(config: ModelConfig, dims: ParallelDims, options: ModelOptions,
                      layout: StageLayout, *, device: torch.device | str | None = None) -> MoEDecoder:
    """This pipeline rank's part of the decoder: the layers of all its chunks, the embedding on
    the first stage, norm/head/MTP on the last; parameter names are the unsplit model's. Built on ``device``
    (None: the default device)."""
    if layout.num_layers != config.num_layers or layout.pp != dims.pp:
        raise ValueError(f"layout (num_layers={layout.num_layers}, pp={layout.pp}) does not match the model "
                         f"(num_layers={config.num_layers}) and grid (pp={dims.pp})")
    check_model_layout(config, layout)
    chunks = layout.rank_chunks(dims.pp_rank)
    return MoEDecoder(config, dims, options, layer_ids=layout.rank_layers(dims.pp_rank),
                      with_embedding=any(c.has_embedding for c in chunks), with_head=any(c.has_head for c in chunks),
                      with_mtp=any(c.has_mtp for c in chunks), with_norm=any(c.has_final_norm for c in chunks),
                      device=device)


def check_model_layout(config: ModelConfig, layout: StageLayout) -> None:
    """A layout that names its MTP layers (``--pipeline-model-parallel-layout``'s ``m``) must name the model's."""
    if layout.layout is None and layout.mtp_num_layers is None:
        return
    got = "".join(layout.stages).count("m")
    if got != config.mtp_num_layers:
        raise ValueError(f"--pipeline-model-parallel-layout={layout.text!r} holds {got} MTP layers (m), but the model "
                         f"has mtp_num_layers={config.mtp_num_layers}: give {config.mtp_num_layers} x 'm'")


class DecoderStage:
    """Runs one chunk of a stage model per ``forward_step``; create one per training step.

    It threads each MoE layer's ``global_state`` (global aux loss) through the micro-batches in the
    order this stage runs them (a chunk's forwards run in micro-batch order in every schedule) and
    keeps, for the step's metrics and expert-bias update (all detached, on the model's device):

    - ``moe_infos`` ``{(microbatch, layer): MoEOutputInfo}``: every MoE layer of this stage (MTP too)
    - ``lm_losses`` ``{microbatch: token-mean LM loss}`` (reduced over cp; last stage only)
    - ``mtp_losses`` ``{microbatch: mean MTP loss over depths, unweighted}`` (last stage, with MTP)
    """

    def __init__(self, model: MoEDecoder, layout: StageLayout, pp_rank: int,
                 overlap: OverlapConfig | None = None) -> None:
        self.model = model
        self.chunks = layout.rank_chunks(pp_rank)
        self.overlap = overlap
        if overlap is not None:
            for i in layout.rank_layers(pp_rank):
                check_overlap(model.layers[str(i)], i)
            self.forward_backward_step = self._forward_backward_step   # else the executor runs an FB as F then B
        # overlap: the pieces' runs of each (micro-batch, chunk) from its forward to its backward
        self._runs: dict[tuple[int, int], tuple[ChunkRun, list[Tensor], tuple[Tensor, ...]]] = {}
        self.moe_infos: dict[tuple[int, int], MoEOutputInfo] = {}
        self.lm_losses: dict[int, Tensor] = {}
        self.mtp_losses: dict[int, Tensor] = {}
        self._global_states: dict[int, GlobalLoadState] = {}

    def activation_spec(self, micro_batch_size: int, seq_len: int,
                        device: torch.device | str | None = None) -> TensorSpec:
        """Shape of the hidden state between stages for ``[B, S]`` micro-batches (S: this rank's CP slice).

        ``device`` defaults to the model's: receive buffers must live where NCCL can write them.
        """
        if device is None:
            device = next(self.model.parameters()).device
        s = seq_len // self.model.dims.tp if self.model.sequence_parallel else seq_len
        v4 = self.model.config.v4   # DeepSeek-V4's residual: hc_mult streams [S, B, N, H]
        streams = () if v4 is None else (v4.hc_mult,)
        return TensorSpec((s, micro_batch_size, *streams, self.model.config.hidden_size),
                          self.model.options.torch_dtype, device)

    @staticmethod
    def loss_fn(output: Tensor, microbatch: dict) -> Tensor:
        """The last chunk already returns the loss share."""
        del microbatch
        return output

    def aux_loss_sum(self) -> Tensor | None:
        """This stage's MoE aux-loss shares summed over its layers and the step's micro-batches (detached);
        None if it has no MoE layer."""
        values = [info.aux_loss.detach().float() for info in self.moe_infos.values()]
        return torch.stack(values).sum() if values else None

    def forward_step(self, chunk: int, hidden: Tensor | None, microbatch: dict[str, Any]
                     ) -> tuple[Tensor, Tensor | None]:
        if self.overlap is not None:
            run = self._run(chunk, microbatch)
            with self._delayed():
                carry = run.forward(self._chunk_input(chunk, hidden, microbatch))
            return self._stitched(run, chunk, microbatch, carry)
        spec = self.chunks[chunk]
        model = self.model
        ids = microbatch["input_ids"]
        position_ids = self._positions(microbatch)
        logs = None
        with model.fp8_region():   # --fp8-backend te: one TE autocast per chunk forward, on the stage's group
            if spec.has_embedding:
                hidden = model.embed(ids)
            hidden, infos = model.run_layers(hidden, position_ids, spec.layers, self._global_states or None,
                                             microbatch.get("documents"), token_ids_BS=ids)
            if spec.has_final_norm:
                hidden = model.final_norm(hidden)
            share = None
            if spec.has_head or (spec.has_mtp and len(model.mtp)):
                share, logs, mtp_infos = model.head_loss(hidden, microbatch["labels"], microbatch.get("loss_mask"),
                                                         ids, position_ids, self._global_states or None,
                                                         normalised=True, documents=microbatch.get("documents"))
                infos.update(mtp_infos)
                if spec.has_head:   # the loss share is the output; a standalone MTP stage's share is an extra loss
                    hidden, share = share, None
        return self._finish(microbatch["index"], hidden, infos, logs, share)

    def _forward_backward_step(self, chunk: int, hidden: Tensor | None, microbatch: dict[str, Any],
                               backward: BackwardStep) -> tuple[Tensor, Tensor | None]:
        """An FB action (``pipeline.executor.OverlappedStage``, ``forward_backward_step`` of a stage built with
        ``overlap``): this micro-batch's forward through ``chunk`` and ``backward``'s micro-batch backward through
        its chunk, interleaved piece by piece (``pipeline.overlap``)."""
        b_run, b_outputs, b_stitched = self._runs.pop((backward.microbatch["index"], backward.chunk))
        b_run.seed(b_outputs, backward_seed(backward.outputs, backward.grads, b_stitched))
        run = self._run(chunk, microbatch)
        with self._delayed():
            run_overlapped(run.forward_steps(self._chunk_input(chunk, hidden, microbatch)), b_run.backward_steps())
        return self._stitched(run, chunk, microbatch, run.output)

    def _delayed(self) -> AbstractContextManager:
        """--delay-wgrad-compute: every forward builds split GEMMs (their backward defers weight gradients)."""
        o = self.overlap
        return o.store.splitting() if o.delay_wgrad else nullcontext()

    # ------------------------------------------------------------------------------------ internals
    def _positions(self, microbatch: dict[str, Any]) -> Tensor:
        position_ids = microbatch.get("position_ids")
        if position_ids is None:
            position_ids = self.model.position_ids(microbatch["input_ids"].shape[1], microbatch["input_ids"].device)
        return position_ids

    def _finish(self, index: int, hidden: Tensor, infos: dict[int, MoEOutputInfo], logs: dict[str, Tensor] | None,
                extra: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Keep this chunk's statistics (module docstring) and return (hidden or loss share, extra loss: ``extra``,
        a standalone MTP stage's weighted MTP share, plus the MoE aux losses)."""
        if logs:
            if "lm" in logs:
                self.lm_losses[index] = logs["lm"].detach()
            if "mtp" in logs:
                self.mtp_losses[index] = logs["mtp"].detach()
        for layer, info in infos.items():
            extra = info.aux_loss if extra is None else extra + info.aux_loss
            # detached: a graph-attached aux loss would keep this chunk's graph, and with it the received
            # activation (a leaf) and its gradient, alive until the step's end
            self.moe_infos[(index, layer)] = dataclasses.replace(info, aux_loss=info.aux_loss.detach())
            if info.global_state is not None:
                self._global_states[layer] = info.global_state
        # a loss without a graph (no aux coefficient, or no grad) has nothing to backpropagate
        return hidden, extra if extra is not None and extra.requires_grad else None

    # -- overlap: the chunk as pieces (models.sublayers), run by pipeline.overlap -----------------------------------
    def _run(self, chunk: int, microbatch: dict[str, Any]) -> ChunkRun:
        spec, model = self.chunks[chunk], self.model
        position_ids = self._positions(microbatch)
        states = self._global_states or None
        pieces: list[Piece] = []
        # The head (MTP, a tied output head) also reads the embedding: through a leaf, whose gradient the embedding
        # piece's backward adds, so that the weight's gradient is accumulated (its hooks fire) once per micro-batch
        borrowed = None
        head = spec.has_head or (spec.has_mtp and len(model.mtp) > 0)
        if spec.has_embedding and head and (len(model.mtp) or model.config.tie_word_embeddings):
            borrowed = model.embed_tokens.weight.detach().requires_grad_()
        if spec.has_embedding:
            pieces.append(Compute("embed", lambda ids: LayerCarry(model.embed(ids)),
                                  borrowed=() if borrowed is None else ((model.embed_tokens.weight, borrowed),)))
        for group, recompute in model.regions.layers.groups(list(spec.layers)):   # full recompute's groups
            for i in group:
                pieces += block_pieces(model.layers[str(i)], i, position_ids, model._ffn_kwargs(i, states), recompute,
                                       microbatch.get("documents"))
        if spec.has_final_norm:
            pieces.append(Compute("final_norm", lambda carry: LayerCarry(model.norm(carry.hidden), carry.infos)))
        if head:
            def head_piece(carry: LayerCarry) -> _HeadCarry:
                with _weight_swapped(model.embed_tokens, borrowed):
                    loss, logs, mtp_infos = model.head_loss(carry.hidden, microbatch["labels"],
                                                            microbatch.get("loss_mask"), microbatch["input_ids"],
                                                            position_ids, states, normalised=True,
                                                            documents=microbatch.get("documents"))
                infos = {**carry.infos, **mtp_infos}
                if spec.has_head:
                    return _HeadCarry(LayerCarry(loss, infos), logs)
                return _HeadCarry(LayerCarry(carry.hidden, infos), logs, loss)   # standalone MTP: hidden goes on

            pieces.append(Compute("head", head_piece))
        o = self.overlap
        return ChunkRun(pieces, f"mb{microbatch['index']}.chunk{chunk}.", o.trace, o.store, o.delay_wgrad)

    def _chunk_input(self, chunk: int, hidden: Tensor | None, microbatch: dict[str, Any]) -> Any:
        return microbatch["input_ids"] if self.chunks[chunk].has_embedding else LayerCarry(hidden)

    def _stitched(self, run: ChunkRun, chunk: int, microbatch: dict[str, Any], carry: Any,
                  ) -> tuple[Tensor, Tensor | None]:
        head = carry if isinstance(carry, _HeadCarry) else None
        carry = head.carry if head is not None else carry
        out, extra = self._finish(microbatch["index"], carry.hidden, carry.infos, head.logs if head else None,
                                  head.extra if head else None)
        outputs = [out] + ([extra] if extra is not None else [])
        stitched = stitch(run, outputs)
        self._runs[(microbatch["index"], chunk)] = (run, outputs, stitched)
        return stitched[0], stitched[1] if extra is not None else None


@contextmanager
def _weight_swapped(module: nn.Module | None, weight: Tensor | None) -> Iterator[None]:
    """``module.weight`` reads ``weight`` inside (nothing changes with None)."""
    if module is None or weight is None:
        yield
        return
    saved = module._parameters["weight"]
    module._parameters["weight"] = weight
    try:
        yield
    finally:
        module._parameters["weight"] = saved


@dataclass(frozen=True)
class _HeadCarry:
    carry: LayerCarry
    logs: dict[str, Tensor]
    extra: Tensor | None = None   # a standalone MTP stage's weighted MTP share


def decoder_microbatches(input_ids: Tensor, labels: Tensor, loss_mask: Tensor | None,
                         num_microbatches: int) -> list[dict]:
    """Split a ``[m*B, S]`` batch into ``num_microbatches`` micro-batch dicts (with their index)."""
    if input_ids.shape[0] % num_microbatches:
        raise ValueError(f"batch of {input_ids.shape[0]} sequences is not divisible by "
                         f"num_microbatches={num_microbatches}")
    b = input_ids.shape[0] // num_microbatches
    out = []
    for i in range(num_microbatches):
        rows = slice(i * b, (i + 1) * b)
        mb = {"index": i, "input_ids": input_ids[rows], "labels": labels[rows]}
        if loss_mask is not None:
            mb["loss_mask"] = loss_mask[rows]
        out.append(mb)
    return out


def shared_weight_holders(config: ModelConfig, pp: int, layout: StageLayout | None) -> dict[str, list[int]]:
    """{module name: the pipeline ranks holding a copy of it}, for the modules more than one rank holds: the
    embedding (read by its own chunk, the MTP chunk and, tied, the head's chunk) and, untied, the output head (the
    loss's chunk and a standalone MTP chunk). ``layout`` None: the embedding on the first and last rank."""
    tied = config.tie_word_embeddings
    if pp == 1 or not (tied or config.mtp_num_layers):
        return {}
    if layout is None:
        holders = {"embed_tokens": [0, pp - 1]}
    else:
        holders = {"embed_tokens": sorted({c.pp_rank for c in layout.embedding_chunks(tied)})}
        if not tied and config.mtp_num_layers:
            holders["output_head"] = sorted({c.pp_rank for c in layout.output_head_chunks()})
    return {name: ranks for name, ranks in holders.items() if len(ranks) > 1}


def shared_weight_groups(model: MoEDecoder, dims: ParallelDims, layout: StageLayout | None = None
                         ) -> dict[str, Group]:
    """{module name: the group of this rank's position on every pipeline rank holding that module}, for each
    module of ``shared_weight_holders`` this rank holds (Megatron's embedding group, wherever the layout puts the
    copies); the trainer sums the copies' gradients over it. Collective over the world: every rank creates every
    group, in order (pipeline stages are the outermost dimension of the rank grid).

    Marks those parameters ``moefold_pipeline_copies = len(holders)`` so that the gradient norm counts them once."""
    per_stage = dims.world_size // dims.pp
    mine: dict[str, Group] = {}
    for name, ranks in shared_weight_holders(model.config, dims.pp, layout).items():
        for j in range(per_stage):
            members = [j + r * per_stage for r in ranks]
            group = dist.new_group(members)
            if dims.rank in members:
                mine[name] = group
        module = getattr(model, name)
        if name in mine and module is not None:
            for p in module.parameters():
                p.moefold_pipeline_copies = len(ranks)
    return mine


def embedding_group(model: MoEDecoder, dims: ParallelDims, layout: StageLayout | None = None) -> Group:
    """The group of ``shared_weight_groups`` for the embedding (None when one rank holds it)."""
    return shared_weight_groups(model, dims, layout).get("embed_tokens")

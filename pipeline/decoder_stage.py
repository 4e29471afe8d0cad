"""The MoE decoder as a :class:`pipeline.executor.PipelineStage`: the one adapter that the trainer and
the tests use.

    layout = StageLayout(config.num_layers, pp, vpp, first, last)
    model = build_stage_model(config, dims, options, layout)        # this rank's chunks, unsplit names
    model.init_weights(seed)
    embed_group = embedding_group(model, dims)                        # once (collective)
    stage = DecoderStage(model, layout, dims.pp_rank)                 # one per step
    result = run_schedule(stage, schedule, microbatches, stage.loss_fn, dims.pp_group,
                          stage.activation_spec(micro_batch_size, seq_len))
    stage.lm_losses, stage.mtp_losses, stage.moe_infos                # this step's values on this stage

A micro-batch is a dict: ``index`` (its position in the step), ``input_ids`` and ``labels``
``[B, S]`` (this rank's CP slice), optional ``loss_mask`` and ``position_ids`` ``[S]``. Every stage
reads ``input_ids`` for its sequence length (and MTP), so give each rank the micro-batch's data (or
at least tensors of the right shape).

What crosses stages is the hidden state ``[S/tp, B, H]`` (the sequence-parallel shard). MoE aux
losses of the layers of a chunk are that chunk's *extra loss*: they reach the gradients on their
own stage, with no cross-stage reduction. The model's last chunk returns the loss share itself
(LM + weighted MTP), and the MTP layers' MoE aux losses as its extra loss; ``loss_fn`` is the
identity (wrap it to transform the loss, e.g. for fault injection in tests).

Tied embeddings / MTP: the last stage holds its own copy of ``embed_tokens`` (same name as on the
first stage); ``embedding_group`` pairs the two stages so that the trainer can sum that parameter's
gradient over them (Megatron's embedding group).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.models.config import ModelConfig
from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.moe.balance_losses import GlobalLoadState
from moefold.moe.layer import MoEOutputInfo
from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import Group
from moefold.pipeline.p2p import TensorSpec
from moefold.pipeline.stages import StageLayout


def build_stage_model(config: ModelConfig, dims: ParallelDims, options: ModelOptions,
                      layout: StageLayout) -> MoEDecoder:
    """This pipeline rank's part of the decoder: the layers of all its chunks, the embedding on
    the first stage, norm/head/MTP on the last; parameter names are the unsplit model's."""
    if layout.num_layers != config.num_layers or layout.pp != dims.pp:
        raise ValueError(f"layout (num_layers={layout.num_layers}, pp={layout.pp}) does not match the model "
                         f"(num_layers={config.num_layers}) and grid (pp={dims.pp})")
    chunks = layout.rank_chunks(dims.pp_rank)
    return MoEDecoder(config, dims, options, layer_ids=layout.rank_layers(dims.pp_rank),
                      with_embedding=any(c.has_embedding for c in chunks), with_head=any(c.has_head for c in chunks))


class DecoderStage:
    """Runs one chunk of a stage model per ``forward_step``; create one per training step.

    It threads each MoE layer's ``global_state`` (global aux loss) through the micro-batches in the
    order this stage runs them (a chunk's forwards run in micro-batch order in every schedule) and
    keeps, for the step's metrics and expert-bias update (all detached, on the model's device):

    - ``moe_infos`` ``{(microbatch, layer): MoEOutputInfo}``: every MoE layer of this stage (MTP too)
    - ``lm_losses`` ``{microbatch: token-mean LM loss}`` (reduced over cp; last stage only)
    - ``mtp_losses`` ``{microbatch: mean MTP loss over depths, unweighted}`` (last stage, with MTP)
    """

    def __init__(self, model: MoEDecoder, layout: StageLayout, pp_rank: int) -> None:
        self.model = model
        self.chunks = layout.rank_chunks(pp_rank)
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
        return TensorSpec((s, micro_batch_size, self.model.config.hidden_size), self.model.options.torch_dtype,
                          device)

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
        spec = self.chunks[chunk]
        model = self.model
        ids = microbatch["input_ids"]
        index = microbatch["index"]
        position_ids = microbatch.get("position_ids")
        if position_ids is None:
            position_ids = model.position_ids(ids.shape[1], ids.device)
        with model.fp8_region():   # --fp8-backend te: one TE autocast per chunk forward, on the stage's group
            if spec.has_embedding:
                hidden = model.embed(ids)
            hidden, infos = model.run_layers(hidden, position_ids, spec.layers, self._global_states or None)
            if spec.has_head:
                hidden, logs, mtp_infos = model.head_loss(hidden, microbatch["labels"], microbatch.get("loss_mask"),
                                                          ids, position_ids, self._global_states or None)
                infos.update(mtp_infos)
                self.lm_losses[index] = logs["lm"].detach()
                if "mtp" in logs:
                    self.mtp_losses[index] = logs["mtp"].detach()
        extra = None
        for layer, info in infos.items():
            extra = info.aux_loss if extra is None else extra + info.aux_loss
            # detached: a graph-attached aux loss would keep this chunk's graph, and with it the received
            # activation (a leaf) and its gradient, alive until the step's end
            self.moe_infos[(index, layer)] = dataclasses.replace(info, aux_loss=info.aux_loss.detach())
            if info.global_state is not None:
                self._global_states[layer] = info.global_state
        # a loss without a graph (no aux coefficient, or no grad) has nothing to backpropagate
        return hidden, extra if extra is not None and extra.requires_grad else None


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


def embedding_group(model: MoEDecoder, dims: ParallelDims) -> Group:
    """The group {first stage, last stage} of this rank's position when both hold ``embed_tokens`` (tied
    embeddings or MTP at pp > 1), else None. Collective over the world: every rank creates every pair,
    in order (pipeline stages are the outermost dimension of the rank grid).

    Marks the embedding's parameters ``moefold_pipeline_copies = 2`` so that the gradient norm counts
    them once."""
    config = model.config
    if dims.pp == 1 or not (config.tie_word_embeddings or config.mtp_num_layers):
        return None
    per_stage = dims.world_size // dims.pp
    mine = None
    for j in range(per_stage):
        ranks = [j, j + (dims.pp - 1) * per_stage]
        group = dist.new_group(ranks)
        if dims.rank in ranks:
            mine = group
    if model.embed_tokens is not None:
        for p in model.embed_tokens.parameters():
            p.moefold_pipeline_copies = 2
    return mine

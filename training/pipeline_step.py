"""The decoder as a ``pipeline.PipelineStage``: one rank's chunks of ``MoEDecoder`` for one training step.

(``pipeline.decoder_stage.DecoderStage`` is the same adapter but keeps no LM/MTP loss values for
logging, hence this one.) The trainer builds one ``DecoderPipelineStage`` per step (it holds that
step's MoE statistics and losses, never the model's state) and hands it to
``pipeline.run_schedule``. Each micro-batch is
``(input_ids [B, S_local], labels [B, S_local], position_ids [S_local])`` (this rank's CP slice):
the first model chunk embeds the ids, every chunk runs its layers, and ``loss_fn`` on the last
model chunk applies the final norm, head, LM loss and MTP. The MoE aux-loss shares of a chunk's
layers go back as the chunk's *extra loss* (backpropagated on the stage that made them).

With tied embeddings or MTP the first and the last pipeline stage both hold ``embed_tokens``;
``embedding_group`` pairs them so their gradients can be summed (Megatron's embedding group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from models.decoder import MoEDecoder
from moe.balance_losses import GlobalLoadState
from moe.layer import MoEOutputInfo
from parallel.dims import ParallelDims
from parallel.groups import Group
from pipeline.stages import StageLayout

MicroBatch = tuple[Tensor, Tensor, Tensor]


class DecoderPipelineStage:
    """``forward_step(chunk, hidden, microbatch)`` and ``loss_fn(output, microbatch)`` for one step."""

    def __init__(self, model: MoEDecoder, layout: StageLayout, pp_rank: int) -> None:
        self.model = model
        self.specs = layout.rank_chunks(pp_rank)
        self.states: dict[int, GlobalLoadState] = {}
        self.infos: dict[int, list[MoEOutputInfo]] = {}
        self.lm: list[Tensor] = []
        self.mtp: list[Tensor] = []
        self.aux = torch.zeros((), dtype=torch.float64)

    def _record(self, infos: dict[int, MoEOutputInfo]) -> Tensor | None:
        if not infos:
            return None
        for i, info in infos.items():
            if info.global_state is not None:
                self.states[i] = info.global_state  # forwards of one chunk run in micro-batch order
            self.infos.setdefault(i, []).append(info)
        aux = sum(info.aux_loss for info in infos.values())
        self.aux += float(aux.detach())
        return aux if aux.requires_grad else None

    def forward_step(self, chunk: int, hidden: Tensor | None, microbatch: MicroBatch) -> tuple[Tensor, Tensor | None]:
        ids, _, pos = microbatch
        spec = self.specs[chunk]
        if spec.has_embedding:
            hidden = self.model.embed(ids)
        hidden, infos = self.model.run_layers(hidden, pos, layer_ids=spec.layers, global_states=self.states)
        return hidden, self._record(infos)

    def loss_fn(self, output: Tensor, microbatch: MicroBatch) -> Tensor:
        ids, labels, pos = microbatch
        loss, logs, infos = self.model.head_loss(output, labels, None, ids, pos, self.states)
        self.lm.append(logs["lm"].detach())
        if "mtp" in logs:
            self.mtp.append(logs["mtp"].detach())
        extra = self._record(infos)
        return loss if extra is None else loss + extra


def embedding_group(model: MoEDecoder, dims: ParallelDims) -> Group:
    """The group {first stage, last stage} of this rank's position when both hold ``embed_tokens`` (tied
    embeddings or MTP at pp > 1), else None. Collective: every rank creates every pair, in order."""
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
            p.moefold_pipeline_copies = 2  # counted once in the gradient norm
    return mine

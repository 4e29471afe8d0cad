"""The MoE decoder: embedding -> blocks -> final norm -> output head -> vocab-parallel loss (+ MTP).

    model = MoEDecoder(config, dims, ModelOptions())
    model.init_weights(seed)                            # layout-independent
    out = model(input_ids_BS, labels_BS, loss_mask_BS)  # ModelOutput
    out.loss.backward()

Layers live in ``model.layers`` (an ``nn.ModuleDict`` keyed ``str(global layer index)``), so a
pipeline stage built with ``layer_ids=range(a, b)`` has the same parameter names as the whole
model. The pieces are exposed for pipelining: ``embed`` -> ``run_layers`` -> ``head_loss``.

Inputs are batch-first ``[B, S]``; activations are sequence-first ``[S, B, H]`` (the SP shard
``[S/tp, B, H]`` when tp > 1 with sequence parallelism). Under context parallelism every input is
this rank's CP slice (``dense.context_parallel.split_for_context_parallel`` along S) and
``position_ids [S_local]`` its true global positions.

Loss convention (the one the MoE losses use, see ``moe.balance_losses``): ``ModelOutput.loss`` is
this rank's *share* of the micro-batch loss. The LM (and MTP) share is ``sum(token losses on this
CP rank) / (loss tokens of the micro-batch over the cp group)``, identical on every tp rank; MoE
aux-loss shares add up over tp x cp. With gradients summed over cp (and sequence-parallel ones
over tp) and averaged over dp and micro-batches, a parallel step equals the world-1 step on the
same global batch whose loss is the mean over micro-batches of each micro-batch's token mean.
``lm_loss_sum``/``num_tokens`` allow other normalisations (e.g. per global token count).

FP8 through Transformer Engine (``--fp8-backend te``): ``forward`` and ``logits`` run inside one TE
autocast region (``fp8_region()``: the stage's dp x cp x tp ranks as TE's amax group), as
Megatron-Core does; a pipeline stage enters it per ``forward_step`` (``pipeline.decoder_stage``), and
a caller that runs the pieces (``run_layers``, ``head_loss``) itself enters ``fp8_region()`` around them.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moefold.dense.context_parallel import context_parallel_positions, gather_from_context_parallel
from moefold.dense.cross_entropy import vocab_parallel_cross_entropy
from moefold.dense.documents import Documents
from moefold.dense.embedding import OutputHead, VocabParallelEmbedding
from moefold.dense.hyper_connections import HyperHead, expand_streams
from moefold.dense.norm import RMSNorm
from moefold.dense.recompute import checkpointed
from moefold.dense.regions import replace_regions
from moefold.models.config import ModelConfig
from moefold.models.layer_factory import build_block, check_layout, is_moe_block
from moefold.models.mtp import MTPModule, shift_left
from moefold.models.options import ModelOptions
from moefold.moe.balance_losses import GlobalLoadState
from moefold.moe.layer import MoEOutputInfo
from moefold.parallel.comm import gather_along_dim
from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import group_size
from moefold.parallel.sharding import init_parameters
from moefold.precision.fp8_region import fp8_autocast

IGNORE_INDEX = -100  # labels with this value carry no loss (HF / torch convention)


class _TokenLoss(NamedTuple):
    """One cross-entropy over a micro-batch's tokens (all fp32 scalars).

    share:        on the graph: this rank's loss sum / the micro-batch's loss tokens over cp
    mean:         detached token mean over the cp group (the same on every rank)
    local_sum:    detached sum of this rank's masked token losses
    local_tokens: this rank's loss tokens
    """

    share: Tensor
    mean: Tensor
    local_sum: Tensor
    local_tokens: Tensor


@dataclass(frozen=True)
class ModelOutput:
    """One micro-batch through the model (see the module docstring for the loss convention).

    loss:        scalar on the graph, this rank's share: lm + MoE aux (+ mtp_scaling * mtp)
    lm_loss:     detached token-mean LM loss of the micro-batch (reduced over cp)
    lm_loss_sum: detached sum of this rank's masked token losses; num_tokens: its loss tokens (fp32)
    aux_loss:    detached sum of this rank's MoE aux-loss shares (already weighted by their coefficients)
    mtp_loss:    detached mean over MTP depths of their token-mean losses (unweighted); None without MTP
    losses:      logging values: "lm", "mtp", "mtp_<k>", "moe/<loss name>" (unweighted, summed over layers)
    moe:         per-layer MoEOutputInfo keyed by global layer index (MTP depth k: num_layers + k - 1):
                 router stats, load_E for the expert-bias update, global_state for the next micro-batch
    """

    loss: Tensor
    lm_loss: Tensor
    lm_loss_sum: Tensor
    num_tokens: Tensor
    aux_loss: Tensor
    mtp_loss: Tensor | None = None
    losses: dict[str, Tensor] = field(default_factory=dict)
    moe: dict[int, MoEOutputInfo] = field(default_factory=dict)

    @property
    def global_states(self) -> dict[int, GlobalLoadState]:
        """What to pass as ``global_states`` with the next micro-batch of the same step."""
        return {i: info.global_state for i, info in self.moe.items() if info.global_state is not None}


@runtime_checkable
class LayerRun(Protocol):
    """How the decoder runs a chunk of its layers (its ``layers`` region, ``dense.regions``): ``groups(layer_ids)``
    cuts them into (consecutive ids, checkpointed as one unit); ``begin_chunk`` / ``end_chunk`` bracket one
    micro-batch's pass through them (``end_chunk`` may hook the chunk's output). ``moefold.execution`` installs full
    recompute's groups and activation offloading's chunks."""

    def groups(self, layer_ids: list[int]) -> list[tuple[list[int], bool]]: ...

    def begin_chunk(self) -> None: ...

    def end_chunk(self, hidden: Tensor) -> Tensor: ...


class AllLayers:
    """The default ``LayerRun``: one group, not checkpointed (a block built with ``recompute="full"`` checkpoints
    itself), nothing around the chunk."""

    def groups(self, layer_ids: list[int]) -> list[tuple[list[int], bool]]:
        return [(layer_ids, False)]

    def begin_chunk(self) -> None:
        return None

    def end_chunk(self, hidden: Tensor) -> Tensor:
        return hidden

    def __repr__(self) -> str:
        return "ALL_LAYERS"


ALL_LAYERS = AllLayers()


@dataclass(frozen=True)
class DecoderRegions:
    """The decoder's regions: ``layers``, how it runs a chunk of its layers (``LayerRun``)."""

    layers: LayerRun = field(default=ALL_LAYERS, metadata={"kind": LayerRun})


class MoEDecoder(nn.Module):
    """The decoder over ``dims``. ``layer_ids``/``with_embedding``/``with_head``/``with_mtp`` build one pipeline
    stage (``with_mtp`` and ``with_norm`` default to ``with_head``: the MTP modules and the final norm go with the
    head; with MTP, Megatron-Core puts the final norm with the last decoder layer: ``with_norm``). A stage with MTP
    but no head (Megatron's standalone MTP stage) holds the MTP modules and its own copies of the embedding and,
    untied, of the output head, whose gradients the trainer sums with the other stages' copies. Parameters and
    buffers go to ``device`` (None: the default device); ``device="meta"`` builds for accounting without memory."""

    def __init__(self, config: ModelConfig, dims: ParallelDims | None = None, options: ModelOptions | None = None,
                 *, layer_ids: Iterable[int] | None = None, with_embedding: bool = True,
                 with_head: bool = True, with_mtp: bool | None = None, with_norm: bool | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        dims = dims or ParallelDims.single()
        options = options or ModelOptions()
        check_layout(config, dims, options)
        self.config, self.dims, self.options = config, dims, options
        self.sequence_parallel = options.sequence_parallel and dims.tp > 1
        ids = list(range(config.num_layers)) if layer_ids is None else sorted(layer_ids)
        bad = [i for i in ids if not 0 <= i < config.num_layers]
        if bad:
            raise ValueError(f"layer_ids {bad} are outside [0, num_layers={config.num_layers})")
        kw = {"sequence_parallel": self.sequence_parallel, "dtype": options.torch_dtype, "device": device}
        tied = config.tie_word_embeddings
        with_mtp = (with_head if with_mtp is None else with_mtp) and config.mtp_num_layers > 0
        self.embed_tokens = None
        if with_embedding or (with_head and tied) or with_mtp:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dims.tp_group,
                                                       init_std=options.init_std, **kw)
        self.layers = nn.ModuleDict({str(i): build_block(config, i, dims, options, device=device) for i in ids})
        self.norm = self.output_head = None
        self.mtp = nn.ModuleList()
        self.with_lm = with_head
        if with_head if with_norm is None else with_norm:
            self.norm = RMSNorm(config.hidden_size, config.norm_eps,
                                zero_centered_gamma=config.norm_zero_centered_gamma, **kw)
        # DeepSeek-V4: the mHC streams collapse once more before the final norm (HF ``hc_head``)
        self.hc_head = None
        if self.norm is not None and config.v4 is not None:
            self.hc_head = HyperHead(config.hidden_size, config.v4.hc_mult, hc_eps=config.v4.hc_eps,
                                     norm_eps=config.norm_eps, device=device)
        if with_head or with_mtp:
            self.output_head = OutputHead(config.hidden_size, config.vocab_size, dims.tp_group,
                                          tied_to=self.embed_tokens if tied else None, init_std=options.init_std,
                                          **kw)
        if with_mtp:
            self.mtp = nn.ModuleList(MTPModule(config, config.num_layers + k, dims, options, device=device)
                                     for k in range(config.mtp_num_layers))
        # recompute, activation offloading, FP8 GEMMs, ...: applied to the built model by moefold.execution
        self.regions = DecoderRegions()

    def configure(self, **regions: Any) -> None:
        """Install regions by name (``DecoderRegions``: ``layers``, a ``LayerRun``); ValueError otherwise."""
        self.regions = replace_regions(self.regions, "MoEDecoder", **regions)

    @property
    def offloader(self) -> Any:
        """The activation offloader the ``layers`` run brackets each chunk with (None without offloading)."""
        return getattr(self.regions.layers, "offloader", None)

    def init_weights(self, seed: int) -> None:
        """Layout-independent init of every weight (``parallel.sharding.init_parameters``)."""
        init_parameters(self, seed)

    def fp8_region(self) -> AbstractContextManager:
        """TE's FP8 autocast for one forward of this stage (``precision.fp8_region``; a null context unless
        ``--fp8-backend te``): its amaxes reduce over the stage's dp x cp x tp ranks, Megatron's
        ``get_amax_reduction_group(with_context_parallel=True)``."""
        return fp8_autocast(self.options.fp8, self.dims.tp_cp_dp_group)

    # ------------------------------------------------------------------------------------ pieces
    def position_ids(self, seq_local: int, device: torch.device) -> Tensor:
        """Default positions of this rank's tokens: 0..S-1, or its CP chunks' global positions."""
        cp = self.dims.cp
        return context_parallel_positions(seq_local * cp, self.dims.cp_rank, cp, device=device)

    def embed(self, input_ids_BS: Tensor) -> Tensor:
        """ids ``[B, S]`` -> hidden ``[S, B, H]`` (``[S/tp, B, H]`` under SP). Collective over tp."""
        if self.embed_tokens is None:
            raise ValueError("this stage has no embedding (with_embedding=False)")
        if input_ids_BS.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids_BS.shape)}")
        S = input_ids_BS.shape[1]
        if self.sequence_parallel and S % self.dims.tp:
            raise ValueError(f"sequence length {S} (this rank's) is not divisible by tp={self.dims.tp} "
                             "(sequence parallelism)")
        hidden = self.embed_tokens(input_ids_BS.t().contiguous())
        # DeepSeek-V4's residual is hc_mult streams [S, B, N, H], each starting as the embedding
        return hidden if self.config.v4 is None else expand_streams(hidden, self.config.v4.hc_mult)

    def final_norm(self, hidden: Tensor) -> Tensor:
        """The final norm (after DeepSeek-V4's stream collapse ``hc_head``: ``[S, B, N, H]`` -> ``[S, B, H]``)."""
        return self.norm(hidden if self.hc_head is None else self.hc_head(hidden))

    def run_layers(self, hidden: Tensor, position_ids: Tensor, layer_ids: Iterable[int] | None = None,
                   global_states: dict[int, GlobalLoadState] | None = None, documents: Documents | None = None,
                   token_ids_BS: Tensor | None = None) -> tuple[Tensor, dict[int, MoEOutputInfo]]:
        """Blocks ``layer_ids`` (default: all of this stage's, in order) -> (hidden, {layer: MoEOutputInfo}).
        ``documents``: the packed documents of the micro-batch (``dense.documents``), or None. ``token_ids_BS``: the
        micro-batch's input ids, which hash-routed MoE layers (DeepSeek-V4) select their experts by.

        The layers run in the groups of the ``layers`` region (one checkpoint per checkpointed group: full
        recompute, ``execution.recompute``), which also brackets the chunk (activation offloading)."""
        infos: dict[int, MoEOutputInfo] = {}
        ids = [int(k) for k in self.layers] if layer_ids is None else list(layer_ids)
        run = self.regions.layers
        run.begin_chunk()   # this micro-batch's offloaded tensors in these layers go together
        for group, recompute in run.groups(ids):
            hidden, group_infos = checkpointed(self._run_group, hidden, position_ids, group, global_states,
                                               documents, token_ids_BS, enabled=recompute)
            infos.update(group_infos)
        return run.end_chunk(hidden), infos

    def _run_group(self, hidden: Tensor, position_ids: Tensor, layer_ids: list[int],
                   global_states: dict[int, GlobalLoadState] | None, documents: Documents | None = None,
                   token_ids_BS: Tensor | None = None) -> tuple[Tensor, dict[int, MoEOutputInfo]]:
        infos = {}
        for i in layer_ids:
            hidden, extra = self.layers[str(i)](hidden, position_ids, documents,
                                                **self._ffn_kwargs(i, global_states, token_ids_BS))
            if extra is not None:
                infos[i] = extra
        return hidden, infos

    def head_logits(self, hidden: Tensor) -> Tensor:
        """Final norm and output head: hidden -> logits ``[S, B, V/tp]`` (sequence gathered under SP)."""
        return self.output_head(self.final_norm(hidden))

    def head_loss(self, hidden: Tensor, labels_BS: Tensor, loss_mask_BS: Tensor | None = None,
                  input_ids_BS: Tensor | None = None, position_ids: Tensor | None = None,
                  global_states: dict[int, GlobalLoadState] | None = None, normalised: bool = False,
                  documents: Documents | None = None,
                  ) -> tuple[Tensor, dict[str, Tensor], dict[int, MoEOutputInfo]]:
        """Last-stage part: (loss share on the graph: lm + weighted MTP, logging values, MTP layers' MoE infos).

        ``hidden`` is the last decoder layer's output (``normalised``: already through the final norm). A stage
        without the LM head (a standalone MTP stage) returns the weighted MTP share alone, and no ``lm`` logs.
        ``input_ids_BS``/``position_ids`` are needed only with MTP. Collective over tp and cp.
        """
        if self.output_head is None:
            raise ValueError("this stage has no output head (with_head=False)")
        labels = labels_BS.t()
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask_BS is None else loss_mask_BS.t().float()
        mask = mask * (labels != IGNORE_INDEX)  # ignored labels count as masked tokens
        # the main head's input, and MTP depth 1's (Megatron-Core's convention); already normalised where the
        # final norm lives on an earlier stage (with MTP: the one holding the last decoder layer)
        normed = hidden if normalised else self.final_norm(hidden)
        loss, logs, infos = None, {}, {}
        if self.with_lm:
            lm = self._token_loss(self.output_head(normed), labels, mask)
            logs = {"lm": lm.mean, "lm_loss_sum": lm.local_sum, "num_tokens": lm.local_tokens}
            loss = lm.share
        if len(self.mtp):
            if input_ids_BS is None or position_ids is None:
                raise ValueError("MTP needs input_ids_BS and position_ids in head_loss")
            mtp_share, mtp_logs, infos = self._mtp_loss(normed, input_ids_BS.t(), labels, mask, position_ids,
                                                        global_states, documents)
            mtp_share = self.config.mtp_loss_scaling_factor * mtp_share
            loss = mtp_share if loss is None else loss + mtp_share
            logs.update(mtp_logs)
        return loss, logs, infos

    # ------------------------------------------------------------------------------------ whole model
    def forward(self, input_ids: Tensor, labels: Tensor, loss_mask: Tensor | None = None,
                position_ids: Tensor | None = None, global_states: dict[int, GlobalLoadState] | None = None,
                documents: Documents | None = None) -> ModelOutput:
        """input_ids/labels/loss_mask ``[B, S]`` (this rank's CP slice; labels may hold -100 = ignored),
        position_ids ``[S]`` (default: this rank's global positions), ``documents``: the documents packed in each
        sample (``dense.documents.packed_documents``: attention inside them, restarted positions), or None.
        Needs the whole model."""
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
        if loss_mask is not None and loss_mask.shape != input_ids.shape:
            raise ValueError(f"loss_mask {tuple(loss_mask.shape)} must have the shape of input_ids "
                             f"{tuple(input_ids.shape)}")
        if position_ids is None:
            position_ids = self.position_ids(input_ids.shape[1], input_ids.device)
        with self.fp8_region():
            hidden, infos = self.run_layers(self.embed(input_ids), position_ids, global_states=global_states,
                                            documents=documents, token_ids_BS=input_ids)
            head_loss, logs, mtp_infos = self.head_loss(hidden, labels, loss_mask, input_ids, position_ids,
                                                        global_states, documents=documents)
        infos.update(mtp_infos)
        aux = torch.zeros((), dtype=torch.float32, device=input_ids.device)
        losses = {"lm": logs["lm"]}
        for info in infos.values():
            aux = aux + info.aux_loss
            for name, value in info.losses.items():
                key = f"moe/{name}"
                losses[key] = losses.get(key, 0.0) + value
        losses.update({k: v for k, v in logs.items() if k.startswith("mtp")})
        return ModelOutput(loss=head_loss + aux, lm_loss=logs["lm"], lm_loss_sum=logs["lm_loss_sum"],
                           num_tokens=logs["num_tokens"], aux_loss=aux.detach(), mtp_loss=logs.get("mtp"),
                           losses=losses, moe=infos)

    @torch.no_grad()
    def logits(self, input_ids: Tensor, position_ids: Tensor | None = None, gather_sequence: bool = True,
               documents: Documents | None = None) -> Tensor:
        """Full-vocabulary logits ``[B, S, V]`` fp32 (for parity tests and evaluation); ``documents`` as ``forward``.

        Gathered over tp (vocab) and, with ``gather_sequence``, over cp (the whole sequence in order).
        """
        if position_ids is None:
            position_ids = self.position_ids(input_ids.shape[1], input_ids.device)
        with self.fp8_region():
            hidden, _ = self.run_layers(self.embed(input_ids), position_ids, documents=documents,
                                        token_ids_BS=input_ids)
            logits = gather_along_dim(self.head_logits(hidden).float(), self.dims.tp_group, dim=-1)
        if gather_sequence:
            logits = gather_from_context_parallel(logits, self.dims.cp_group, 0)
        return logits.transpose(0, 1).contiguous()

    # ------------------------------------------------------------------------------------ internals
    def _ffn_kwargs(self, index: int, global_states: dict[int, GlobalLoadState] | None,
                    token_ids_BS: Tensor | None = None) -> dict:
        v4 = self.config.v4
        if v4 is not None and index < self.config.num_layers and v4.is_hash_layer(index):
            if token_ids_BS is None:
                raise ValueError(f"layer {index} is hash-routed (DeepSeek-V4): run_layers needs token_ids_BS")
            return {"token_ids_BS": token_ids_BS}
        if (global_states is None or "global_aux_loss" not in self.config.moe_load_balancing_type
                or not is_moe_block(self.config, index)):   # dense FFNs take no load state
            return {}
        return {"global_state": global_states.get(index)}

    def _token_loss(self, logits: Tensor, labels: Tensor, mask: Tensor) -> _TokenLoss:
        """Masked cross-entropy of this rank's tokens. Collective over tp (the loss) and cp (one
        all-reduce of [loss sum, token count]: the share's denominator is the micro-batch's tokens)."""
        token_loss = vocab_parallel_cross_entropy(logits, labels, self.dims.tp_group, loss_mask=mask)
        local = torch.stack([token_loss.sum().detach(), mask.sum()]).float()
        total = local.clone()
        if group_size(self.dims.cp_group) > 1:
            dist.all_reduce(total, group=self.dims.cp_group)
        tokens = total[1].clamp(min=1.0)
        return _TokenLoss(share=token_loss.sum() / tokens, mean=total[0] / tokens, local_sum=local[0],
                          local_tokens=local[1])

    def _mtp_loss(self, normed: Tensor, ids_SB: Tensor, labels_SB: Tensor, mask_SB: Tensor, position_ids: Tensor,
                  global_states: dict[int, GlobalLoadState] | None, documents: Documents | None = None,
                  ) -> tuple[Tensor, dict[str, Tensor], dict[int, MoEOutputInfo]]:
        cp_group, cp_rank = self.dims.cp_group, self.dims.cp_rank
        shares, logs, infos = [], {}, {}
        hidden = normed
        ids, labels, mask = ids_SB, labels_SB, mask_SB
        doc = None if documents is None or not documents.isolate else documents.document_ids(position_ids).t()
        for k, module in enumerate(self.mtp, start=1):
            ids = shift_left(ids, 1, 0, cp_group, cp_rank)
            labels = shift_left(labels, 1, 0, cp_group, cp_rank)
            mask = shift_left(mask, 1, 0.0, cp_group, cp_rank)
            if doc is not None:   # a token k on in the next document: as past a lone document's end (id 0, no loss)
                crossed = documents.document_ids(position_ids + k).t() != doc
                ids, mask = ids.masked_fill(crossed, 0), mask.masked_fill(crossed, 0.0)
            embedded = self.embed_tokens(ids.contiguous())
            hidden, extra = module(hidden, embedded, position_ids, documents,
                                   **self._ffn_kwargs(module.index, global_states))
            if extra is not None:
                infos[module.index] = extra
            hidden = module.final_layernorm(hidden)   # this depth's head input and the next depth's hidden input
            depth = self._token_loss(self.output_head(hidden), labels, mask)
            shares.append(depth.share)
            logs[f"mtp_{k}"] = depth.mean
        logs["mtp"] = torch.stack([logs[f"mtp_{k}"] for k in range(1, len(self.mtp) + 1)]).mean()
        return torch.stack(shares).mean(), logs, infos

"""Routing replay on a model (Megatron-Core's ``--moe-enable-routing-replay``): record the experts every token chose
in a forward (a rollout), replay exactly those choices in a later forward and backward (training on it).

    with record_routing(model) as recorder:          # every MoE layer of this stage records; restored on exit
        for ids_BS in micro_batches:                  # full-sequence forwards (model(...) or model.logits(...))
            model.logits(ids_BS)
    recording = recorder.gather()                    # RoutingRecording in the global token order (collective)
    recording.save("rollout.routing.safetensors")    # the file format: training.routing_file

    rows = recording.ids                             # {layer: [N, S, K]}; a micro-batch's: {layer: ids[rows]}
    with replay_routing(model, [micro_batch_ids, ...]):   # this rank's micro-batches, in forward order
        ... forward and backward each micro-batch ...     # expert ids fixed, probs from the current router

``Trainer.train_step(microbatches, routing=[...])`` does the replay for a step, and ``--moe-routing-replay-file``
(``DataConfig.moe_routing_replay_file``) replays a file: sample n of the run routes as the file's sample n.

Token order, whatever the layout. A micro-batch's ids are ``{global layer index: int64 [mb, S, K]}``, the rows of
its samples over the whole sequence (like the samples' token ids before the CP split): the replay context cuts
them over cp as the trainer cuts input ids (``dense.context_parallel.split_for_context_parallel``), each layer
over tp (``moe.layer``). ``RoutingRecorder.gather`` undoes all of it: tp inside each layer, then cp, dp (sample
n = ``(m * dp + r) * mb + j``: micro-batch m, dp rank r, row j: the trainer's sample order,
``training.data.sampler``) and pp (the stages' layers). So a recording made at one layout replays at another.

No global state: the contexts install a tap per layer through ``MoELayer.configure(routing=...)`` (its
``routing`` region, ``moe.routing_replay``) and put the previous ones back on exit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moefold.dense.context_parallel import gather_from_context_parallel, split_for_context_parallel
from moefold.models.layer_factory import is_moe_block
from moefold.moe.layer import MoELayer
from moefold.moe.routing_replay import RoutingRecorder, RoutingReplayer, RoutingTap
from moefold.parallel.comm import all_gather_single
from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import group_size
from moefold.training.routing_file import RoutingFile, RoutingRecording, check_ids

if TYPE_CHECKING:
    from moefold.training.config import RunConfig


def moe_layers(model: nn.Module) -> dict[int, MoELayer]:
    """{global layer index: MoE layer} of this stage (``model.layers`` keyed by index; MTP depth k's block:
    ``num_layers + k - 1``)."""
    blocks = [(int(i), b) for i, b in model.layers.items()] + [(m.index, m.block) for m in getattr(model, "mtp", [])]
    return {i: mod for i, block in blocks for mod in block.modules() if isinstance(mod, MoELayer)}


def _num_experts(layers: Mapping[int, MoELayer]) -> int:
    return next(iter(layers.values())).num_experts


@contextmanager
def _installed(layers: Mapping[int, MoELayer], taps: Mapping[int, RoutingTap]) -> Iterator[None]:
    previous = {i: layers[i].regions.routing for i in taps}
    for i, tap in taps.items():
        layers[i].configure(routing=tap)
    try:
        yield
    finally:
        for i, tap in previous.items():
            layers[i].configure(routing=tap)


class ModelRecorder:
    """The recorders of one stage's MoE layers (``record_routing``); ``gather`` assembles their calls."""

    def __init__(self, model: nn.Module, dims: ParallelDims) -> None:
        self.layers = moe_layers(model)
        self.dims = dims
        self.recorders = {i: RoutingRecorder() for i in self.layers}

    def local(self) -> list[dict[int, Tensor]]:
        """This rank's forward calls: one ``{layer: int64 [mb, S_cp, K]}`` per call (S_cp: its CP slice), in order."""
        counts = {i: len(r.calls) for i, r in self.recorders.items()}
        if len(set(counts.values())) > 1:
            raise RuntimeError(f"routing recording: the layers recorded different numbers of calls: {counts}")
        n = next(iter(counts.values()), 0)
        return [{i: r.calls[m] for i, r in self.recorders.items()} for m in range(n)]

    def gather(self) -> RoutingRecording:
        """Every rank's calls as one ``RoutingRecording`` in the global token order (module docstring), on every
        rank. Collective over the world: all-gathers over cp and dp, and the stages' layers over pp. Every dp rank
        must have recorded the same number of calls of the same micro-batch size."""
        dims, mine = self.dims, {}
        calls = self.local()
        if not calls:
            raise RuntimeError("routing recording: no forward call was recorded")
        for i in self.recorders:
            ids = torch.stack([c[i] for c in calls])                       # [M, mb, S_cp, K]
            ids = gather_from_context_parallel(ids, dims.cp_group, seq_dim=2)
            if dims.dp > 1:   # [dp, M, mb, S, K] -> micro-batch-major: the trainer's sample order
                out = ids.new_empty((dims.dp * ids.shape[0], *ids.shape[1:]))
                all_gather_single(out, ids.contiguous(), dims.dp_group)
                ids = out.view(dims.dp, *ids.shape).transpose(0, 1)
            mine[i] = ids.reshape(-1, *ids.shape[-2:]).cpu()
        merged: dict[int, Tensor] = {}
        if group_size(dims.pp_group) > 1:
            stages: list[dict[int, Tensor] | None] = [None] * group_size(dims.pp_group)
            dist.all_gather_object(stages, mine, group=dims.pp_group)
            for stage in stages:
                merged.update(stage or {})
        else:
            merged = mine
        return RoutingRecording(_num_experts(self.layers), dict(sorted(merged.items())))


@contextmanager
def record_routing(model: nn.Module, dims: ParallelDims | None = None) -> Iterator[ModelRecorder]:
    """Every MoE layer of ``model`` (this stage's) records its forward calls' expert choices while inside; the
    layers' previous taps come back on exit. ``dims``: the model's layout (default ``model.dims``)."""
    recorder = ModelRecorder(model, dims or model.dims)
    if not recorder.layers:
        raise ValueError("record_routing: the model has no MoE layer on this stage")
    with _installed(recorder.layers, recorder.recorders):
        yield recorder


def cut_for_rank(micro_batch: Mapping[int, Tensor], dims: ParallelDims) -> dict[int, Tensor]:
    """A micro-batch's full-sequence ids ``{layer: [mb, S, K]}`` -> this CP rank's ``{layer: [mb, S/cp, K]}``."""
    return {i: split_for_context_parallel(t, dims.cp_rank, dims.cp, seq_dim=1) for i, t in micro_batch.items()}


@contextmanager
def replay_routing(model: nn.Module, micro_batches: Sequence[Mapping[int, Tensor]],
                   dims: ParallelDims | None = None) -> Iterator[dict[int, RoutingReplayer]]:
    """Every MoE layer of ``model`` (this stage's) replays ``micro_batches`` while inside: forward call m of a layer
    routes as ``micro_batches[m][layer]`` (int64 ``[mb, S, K]``, the whole sequence: cut over cp here), a recompute
    in backward as its forward did; the layers' previous taps come back on exit. Each micro-batch must hold every
    MoE layer of this stage (others are ignored); ids are checked ([0, E), distinct per token). Yields the
    replayers ({layer: RoutingReplayer}; ``.used``: forward calls served)."""
    dims = dims or model.dims
    layers = moe_layers(model)
    if not layers:
        raise ValueError("replay_routing: the model has no MoE layer on this stage")
    E = _num_experts(layers)
    per_layer: dict[int, list[Tensor]] = {i: [] for i in layers}
    for m, micro in enumerate(micro_batches):
        missing = sorted(set(layers) - set(micro))
        if missing:
            raise ValueError(f"replay_routing: micro-batch {m} has no ids for MoE layers {missing} (it holds "
                             f"{sorted(micro)})")
        for i in layers:
            ids = check_ids(micro[i], E, f"replay_routing micro-batch {m} layer {i}")
            if ids.dim() != 3:
                raise ValueError(f"replay_routing: micro-batch {m} layer {i} has ids of shape {tuple(ids.shape)}, "
                                 "expected [mb, S, K]")
            per_layer[i].append(split_for_context_parallel(ids, dims.cp_rank, dims.cp, seq_dim=1))
    replayers = {i: RoutingReplayer(per_layer[i], layer=i) for i in layers}
    with _installed(layers, replayers):
        yield replayers


def micro_batch_rows(recording: RoutingRecording | Mapping[int, Tensor], rows: slice | Tensor) -> dict[int, Tensor]:
    """The ids of some samples: ``{layer: ids[rows]}`` (e.g. a micro-batch's ``slice(start, start + mb)``)."""
    ids = recording.ids if isinstance(recording, RoutingRecording) else recording
    return {i: t[rows] for i, t in ids.items()}


def trainer_rows(dims: ParallelDims, micro: int, micro_batch_size: int, first_sample: int = 0) -> slice:
    """The samples micro-batch ``micro`` of this dp rank holds in the trainer's order (``training.data.sampler``),
    from ``first_sample`` (the step's consumed samples)."""
    start = first_sample + (micro * dims.dp + dims.dp_rank) * micro_batch_size
    return slice(start, start + micro_batch_size)


def open_replay_file(config: RunConfig) -> RoutingFile | None:
    """``--moe-routing-replay-file`` opened and checked against the run (None without it): its MoE layers, experts,
    top-k and sequence length are the model's, and it holds the samples the run consumes (``--train-iters`` x
    ``--global-batch-size``). ValueError of one line otherwise; checked before any rank starts and by the trainer."""
    t, m = config.train, config.model
    if t.moe_routing_replay_file is None:
        return None
    layers = [i for i in range(m.num_layers + m.mtp_num_layers) if m.num_experts and is_moe_block(m, i)]
    if not layers:
        raise ValueError(f"--moe-routing-replay-file={t.moe_routing_replay_file}: the model has no MoE layer")
    replay = RoutingFile(t.moe_routing_replay_file, num_experts=m.num_experts, topk=m.moe_topk, layers=layers,
                         seq_length=t.seq_length)
    need = t.train_iters * t.global_batch_size
    if replay.num_samples < need:
        replay.close()
        raise ValueError(f"routing replay file {replay.path} holds {replay.num_samples} samples; --train-iters="
                         f"{t.train_iters} x --global-batch-size={t.global_batch_size} consume {need}")
    return replay


__all__ = ["ModelRecorder", "cut_for_rank", "micro_batch_rows", "moe_layers", "open_replay_file", "record_routing",
           "replay_routing", "trainer_rows"]

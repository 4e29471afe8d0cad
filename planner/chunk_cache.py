"""The step-time model's cache of per-chunk actions: the chunks of a layout (and of the search's layouts that share
its sizes and options) that hold alike blocks share their forward and backward durations.

What ``step_time._chunk_actions`` reads of a chunk: each of its blocks' kind (MoE or dense: the block's GEMMs and
collectives) and attention window (core attention's score products), the blocks' order (full recompute's checkpoint
groups), whether it holds the MTP layers, the embedding or the head, whether it receives and sends activations
(the pipeline's point-to-point transfers; the offloaded bytes) and, under FSDP2 only, its pipeline rank (the
stage's parameters that FSDP gathers). That is a chunk's signature here: two chunks with one signature have one
(forward, backward) pair, whichever layers and ranks they are.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from moefold.models.config import ModelConfig
from moefold.models.layer_factory import is_moe_block
from moefold.pipeline.stages import ChunkSpec
from moefold.training.config import RunConfig

MAX_CONTEXTS = 256   # (config, sizes, cluster, ...) contexts kept, least recently used dropped
_CONTEXTS: OrderedDict[tuple, dict[tuple, tuple]] = OrderedDict()
_KINDS: dict[tuple[int, int, int, int], tuple[ModelConfig, tuple]] = {}


def _layer_kinds(model: ModelConfig, layers: range) -> tuple:
    """(MoE?, attention window, mixer type) of each layer of ``layers``, computed once per model object and range."""
    key = (id(model), layers.start, layers.stop, layers.step)
    entry = _KINDS.get(key)
    if entry is None or entry[0] is not model:
        entry = _KINDS[key] = (model, tuple((is_moe_block(model, i), model.layer_sliding_window(i),
                                                         model.layer_type(i)) for i in layers))
    return entry[1]


def signature(config: RunConfig, chunk: ChunkSpec, last_model_chunk: int) -> tuple:
    """What ``step_time._chunk_actions`` reads of ``chunk`` (module docstring)."""
    return (_layer_kinds(config.model, chunk.layers), chunk.has_mtp, chunk.has_embedding, chunk.has_head,
            chunk.model_chunk > 0, chunk.model_chunk < last_model_chunk,
            chunk.pp_rank if config.train.use_torch_fsdp2 else None)


_LAST: list = [None, None]   # (the config last asked about, its context key): a step's chunks share one config


def context_key(config: RunConfig) -> tuple:
    """What ``step_time._chunk_actions`` reads of ``config`` besides the chunk's signature: everything but the
    pipeline's split (which layers a chunk holds is the signature's), unless FSDP2 is on (a chunk's gathered
    parameters are its whole stage's, ``step_time._stage_numel_per_layer``); the schedule stays (the V placement)."""
    from moefold.planner.step_bound import compute_token

    if _LAST[0] is not config:
        e = config.train.execution
        split = (e.num_layers_per_virtual_pipeline_stage, e.decoder_first_pipeline_num_layers,
                 e.decoder_last_pipeline_num_layers, e.pipeline_model_parallel_layout)
        _LAST[:] = [config, (compute_token(config), e.pipeline_schedule, e.overlap_moe_expert_parallel_comm,
                             e.delay_wgrad_compute, split if config.train.use_torch_fsdp2 else None)]
    return _LAST[1]


def cached_actions(actions: Callable[..., tuple], config: RunConfig, sizes, chunk: ChunkSpec, *rest) -> tuple:
    """``actions(config, sizes, chunk, *rest)``, computed once per (``context_key(config)``, sizes, rest) and chunk
    signature; ``rest`` = (links, cluster, flop_s, last_model_chunk, exchange_overlap) as
    ``step_time._chunk_actions`` takes them."""
    context = (context_key(config), sizes, *rest)
    cache = _CONTEXTS.get(context)
    if cache is None:
        cache = _CONTEXTS[context] = {}
        if len(_CONTEXTS) > MAX_CONTEXTS:
            _CONTEXTS.popitem(last=False)
    else:
        _CONTEXTS.move_to_end(context)
    key = signature(config, chunk, rest[3])
    if key not in cache:
        cache[key] = actions(config, sizes, chunk, *rest)
    return cache[key]


__all__ = ["cached_actions", "signature"]

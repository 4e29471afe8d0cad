"""Static memory per rank of a planned layout: parameters, main gradients, optimizer states.

Exact (``exact_static``): for each pipeline stage, one representative rank's model is built on the meta device in
the planned layout by the trainer's own ``training.build.build_model``, and its gradient buffers and optimizer
by ``build_optimizer`` (``GradSync``: flat buffers per reduction kind and dtype, cut into buckets padded to the
group size; ``DistributedAdamW``: this rank's chunk of every bucket, master copy only for bf16 parameters,
moments in their chosen dtypes). ``training.observe.memory.static_bytes`` then counts those tensors, as the trainer's
start-up line does. The ranks of one stage hold the same bytes (chunks are equal by construction), and stages
whose chunks hold the same kinds of layers (and the same embedding/head) are built once.

Lower bound (``static_lower_bound``): the same parameters counted per layer kind (blocks built on the meta
device once per tp x ep x etp), times the bytes per parameter of ``training.observe.memory`` with the optimizer state
divided by the reduction group's size, without the buckets' alignment padding; never above the exact figure.
The search uses it to discard layouts that cannot fit before building any of them.

The flex dispatcher's DeepEP buffer is ``planner.deepep``'s (not a tensor of the model or optimizer).

With optimizer offload (``--optimizer-cpu-offload``) the trainer's own optimizer built on the meta device keeps the
offloaded states on the meta "host": counted as ``host``, not device memory. With FSDP2 (``--use-torch-fsdp2``,
``training.optim.fsdp``) each parameter of the stage's meta model is sharded as ``fully_shard`` shards it (the
first dimension its mesh divides, else dim 0 padded to a multiple of the mesh), the fp32 shards being the
parameters (the masters), their gradients and the two moments; ``buffers`` are the gathered units FSDP holds
while computing: two blocks' parameters in the compute dtype (the current and the prefetched one) and the current
block's unsharded gradient (compute and reduce dtype) and, without pipelining, the last block (not resharded after
its forward); with pipelining every unit of the stage stays gathered from its forward to its backward.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from moefold.models.decoder import MoEDecoder
from moefold.models.layer_factory import build_block
from moefold.parallel.dims import ParallelConfig, ParallelSizes
from moefold.pipeline.stages import StageLayout
from moefold.planner.grid import planning_world, rank_dims
from moefold.training.config import RunConfig
from moefold.training.observe.memory import DTYPE_BYTES, optimizer_state_parts, static_bytes
from moefold.training.optim.buffers import reduction_kind

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class StaticMemory:
    """Bytes one rank holds for the whole run. ``exact``: counted from the trainer's tensors (else a lower bound)."""

    params: int
    grads: int
    master: int
    exp_avg: int
    exp_avg_sq: int
    exact: bool
    host: int = 0        # optimizer offload: states (and gradient copies) in host memory
    buffers: int = 0     # FSDP: the gathered units it holds while computing

    @property
    def optimizer(self) -> int:
        return self.master + self.exp_avg + self.exp_avg_sq

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def per_split(cache: dict, config: RunConfig, pp: int, make: Callable[[], Any]) -> Any:
    """``make()``, once per train object, model object and ``pp`` in ``cache``: what depends on the pipeline split
    only. The search's layouts of one split, schedule and micro-batch size share one train object (and every
    layout one model), so an identity key finds them without reading the split's flags through the train config's
    flat names, which the search did tens of thousands of times. The objects are kept with their entry (their ids
    are not reused meanwhile)."""
    key = (id(config.train), id(config.model), pp)
    entry = cache.get(key)
    if entry is None or entry[0] is not config.train or entry[1] is not config.model:
        if len(cache) > 4096:
            cache.clear()
        entry = cache[key] = (config.train, config.model, make())
    return entry[2]


_LAYOUTS: dict[tuple, tuple] = {}


def layout_of(config: RunConfig, pp: int) -> StageLayout:
    """``config.pipeline_layout(pp)``, parsed once per model and pipeline flags (the search asks for it per rung,
    rank and saver of every layout; ``RunConfig.pipeline_layout`` is memoised by those flags too)."""
    return per_split(_LAYOUTS, config, pp, lambda: config.pipeline_layout(pp))


def stage_signature(config: RunConfig, pp: int, pp_rank: int) -> tuple:
    """What decides a stage's parameters: per chunk, the kind of each layer, the embedding and the head."""
    m = config.model
    # a Mamba-2 or Gated DeltaNet layer is not an attention one
    types = m.layer_type if m.layer_types is not None else (lambda _i: None)
    if pp == 1:
        layers = range(m.num_layers)
        return ((tuple(m.is_moe_layer(i) for i in layers), True, True, True, tuple(types(i) for i in layers)),)
    layout = layout_of(config, pp)
    return tuple((tuple(m.is_moe_layer(i) for i in c.layers), c.has_embedding, c.has_head, c.has_mtp,
                  tuple(types(i) for i in c.layers)) for c in layout.rank_chunks(pp_rank))


_GROUPS: dict[tuple, tuple] = {}
_GROUPS_BY_SPLIT: dict[tuple, tuple] = {}


def stage_groups(config: RunConfig, pp: int) -> dict[tuple, list[int]]:
    """{stage signature: the pipeline ranks with it}, in pipeline order (once per model and pipeline split)."""
    def make() -> dict[tuple, list[int]]:   # once per model and split flags (the savers' train objects share it)
        t = config.train
        key = (id(config.model), pp, t.pipeline_schedule, t.pipeline_model_parallel_layout,
               t.num_layers_per_virtual_pipeline_stage, t.decoder_first_pipeline_num_layers,
               t.decoder_last_pipeline_num_layers)
        entry = _GROUPS_BY_SPLIT.get(key)
        if entry is None or entry[0] is not config.model:
            if len(_GROUPS_BY_SPLIT) > 4096:
                _GROUPS_BY_SPLIT.clear()
            out: dict[tuple, list[int]] = {}
            for r in range(pp):
                out.setdefault(stage_signature(config, pp, r), []).append(r)
            entry = _GROUPS_BY_SPLIT[key] = (config.model, out)
        return entry[1]

    return {signature: list(ranks) for signature, ranks in per_split(_GROUPS, config, pp, make).items()}


def exact_static(config: RunConfig, sizes: ParallelSizes) -> dict[int, StaticMemory]:
    """{pipeline rank: its ranks' static bytes}, counted from the trainer's buffers built on the meta device."""
    return dict(_exact_static(_key(config), sizes))


def _key(config: RunConfig) -> RunConfig:
    """The config with what cannot change the static bytes normalised (so the cache sees one entry)."""
    t = dataclasses.replace(config.train, micro_batch_size=1, global_batch_size=1, train_iters=1,
                            lr_warmup_iters=0, lr_decay_iters=None, lr_wsd_decay_iters=0, seq_length=1,
                            moe_max_load_ratio=None)
    options = dataclasses.replace(config.options, recompute="none", dispatcher="alltoall", offload_modules=(),
                                  recompute_modules=("core_attn",))
    return dataclasses.replace(config, train=t, options=options, parallel=ParallelConfig())


# what ``_model_key`` normalises (``_key``'s and its own): a config differing only in these has the same model key
_MODEL_KEY_OPTIONS = frozenset({"recompute", "dispatcher", "offload_modules", "recompute_modules"})
_MODEL_KEY_TRAIN = frozenset({"micro_batch_size", "global_batch_size", "train_iters", "lr_warmup_iters",
                              "lr_decay_iters", "lr_wsd_decay_iters", "seq_length", "moe_max_load_ratio",
                              "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                              "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout",
                              "pipeline_schedule", "use_torch_fsdp2", "optimizer_cpu_offload",
                              "optimizer_offload_fraction"})
_MODEL_KEYS: dict[tuple, RunConfig] = {}


def _model_key(config: RunConfig) -> RunConfig:
    """``_key`` without the pipeline split either: what the blocks' parameters depend on (made once per what it
    keeps: the search asks for it per layout, rung and sharding)."""
    options = tuple(v for k, v in vars(config.options).items() if k not in _MODEL_KEY_OPTIONS)
    train = tuple(tuple(v for k, v in vars(section).items() if k not in _MODEL_KEY_TRAIN)
                  if dataclasses.is_dataclass(section) else section for section in vars(config.train).values())
    key = (config.model, options, train, config.recipe)
    if key not in _MODEL_KEYS:
        if len(_MODEL_KEYS) > 4096:
            _MODEL_KEYS.clear()
        _MODEL_KEYS[key] = _make_model_key(config)
    return _MODEL_KEYS[key]


def _make_model_key(config: RunConfig) -> RunConfig:
    key = _key(config)
    train = dataclasses.replace(key.train, num_layers_per_virtual_pipeline_stage=None,
                                decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                                pipeline_model_parallel_layout=None, pipeline_schedule="1f1b",
                                use_torch_fsdp2=False, optimizer_cpu_offload=False,
                                optimizer_offload_fraction=1.0)
    return dataclasses.replace(key, train=train)


@lru_cache(maxsize=256)
def _exact_static(config: RunConfig, sizes: ParallelSizes) -> tuple[tuple[int, StaticMemory], ...]:
    from moefold.execution import apply_execution
    from moefold.training.build import build_model, build_optimizer, execution_plan

    config = dataclasses.replace(config, parallel=ParallelConfig(tp=sizes.tp, cp=sizes.cp, pp=sizes.pp, dp=sizes.dp,
                                                                 ep=sizes.ep, etp=sizes.etp))
    out = []
    per_stage = sizes.world_size // sizes.pp
    for ranks in stage_groups(config, sizes.pp).values():
        rank = ranks[0] * per_stage       # tp = cp = dp = 0 of that stage
        with planning_world(sizes.world_size, rank):
            dims = rank_dims(sizes, rank)
            model = build_model(config, dims, "meta")
            # the run's FP8 linears mark their weights for the FP8 all-gather's buffers (no compile, no sharding)
            apply_execution(model, execution_plan(config, dims, accounting=True), dims)
            if config.train.use_torch_fsdp2:
                memory = fsdp_static(model, config, sizes)
            else:
                _, sync, optimizer = build_optimizer(model, config, dims)
                b = static_bytes(sync, optimizer)
                memory = StaticMemory(params=b["params"], grads=b["grads"], master=b["master"], exp_avg=b["exp_avg"],
                                      exp_avg_sq=b["exp_avg_sq"], exact=True, host=b["host_optimizer"])
        out += [(r, memory) for r in ranks]
    return tuple(sorted(out))


def fsdp_shard_numel(shape: tuple[int, ...], n: int) -> int:
    """Elements of one rank's FSDP2 shard of a local tensor of ``shape`` over a mesh of ``n`` (``training.optim.fsdp``:
    the first dimension ``n`` divides, else dim 0 padded to a multiple of ``n``)."""
    if not shape:
        return 1
    numel = math.prod(shape)
    d = next((i for i, size in enumerate(shape) if size % n == 0), 0)
    return -(-shape[d] // n) * (numel // shape[d]) if shape[d] else 0


def fsdp_static(model, config: RunConfig, sizes: ParallelSizes) -> StaticMemory:
    """This stage's ranks' bytes under FSDP2 (module docstring), from its model built on the meta device."""
    from moefold.training.optim.fsdp import MESH_OF_KIND

    mesh = {"dp_cp": sizes.dp * sizes.cp, "tp_cp_dp": sizes.tp * sizes.cp * sizes.dp, "edp": sizes.edp}
    shard = sum(fsdp_shard_numel(tuple(p.shape), mesh[MESH_OF_KIND[reduction_kind(p)]])
                for p in model.parameters() if p.requires_grad)
    compute = DTYPE_BYTES[DTYPE_NAMES[next(model.parameters()).dtype]]
    reduce = DTYPE_BYTES[config.train.main_grads_dtype]
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.layers.values()]
    blocks += [sum(p.numel() for p in m.parameters()) for m in model.mtp]
    rest = sum(p.numel() for p in model.parameters()) - sum(blocks)
    units = [*blocks, rest]
    largest = max(units)
    # pipelined: every unit stays gathered from its forward to its backward; else two units and the last block
    gathered = compute * (sum(units) if sizes.pp > 1 else 2 * largest + (blocks[-1] if blocks else 0))
    return StaticMemory(params=4 * shard, grads=4 * shard, master=0, exp_avg=4 * shard, exp_avg_sq=4 * shard,
                        exact=True, buffers=gathered + (compute + reduce) * largest)


# ----------------------------------------------------------------------------------------------- lower bound
@dataclass(frozen=True)
class ParamCounts:
    """Elements per (reduction kind, dtype) of each piece of the model on one rank of a tp x ep x etp layout;
    ``head``: the output head (the final norm's few elements left out); ``output_head``: the output head alone (a
    standalone MTP stage's copy); ``mtp``: the MTP modules; ``head_embedding``: the loss's stage holds its own copy
    of the embedding (tied)."""

    dense_layer: tuple[tuple[tuple[str, str], int], ...]
    moe_layer: tuple[tuple[tuple[str, str], int], ...]
    embedding: tuple[tuple[tuple[str, str], int], ...]
    head: tuple[tuple[tuple[str, str], int], ...]
    head_embedding: bool
    output_head: tuple[tuple[tuple[str, str], int], ...] = ()
    mtp: tuple[tuple[tuple[str, str], int], ...] = ()


def _counts(params) -> tuple[tuple[tuple[str, str], int], ...]:
    out: dict[tuple[str, str], int] = {}
    for p in params:
        if p.requires_grad:
            key = (reduction_kind(p), DTYPE_NAMES[p.dtype])
            out[key] = out.get(key, 0) + p.numel()
    return tuple(sorted(out.items()))


@lru_cache(maxsize=1024)
def param_counts(config: RunConfig, tp: int, ep: int, etp: int) -> ParamCounts:
    """``ParamCounts`` of a tp x ep x etp rank: those of a tp x etp rank holding every expert, the experts' elements
    divided by ep (``validate_layout`` has ep divide the experts, which are split evenly and whole), so that a
    search builds blocks once per (tp, etp)."""
    counts = _built_counts(config, tp, 1, etp)
    if ep == 1:
        return counts

    def split(items: tuple[tuple[tuple[str, str], int], ...]) -> tuple[tuple[tuple[str, str], int], ...]:
        return tuple((key, n // ep if key[0] == "expert" else n) for key, n in items)

    return ParamCounts(dense_layer=split(counts.dense_layer), moe_layer=split(counts.moe_layer),
                       embedding=counts.embedding, head=counts.head, head_embedding=counts.head_embedding,
                       output_head=counts.output_head, mtp=split(counts.mtp))


@lru_cache(maxsize=128)
def _built_counts(config: RunConfig, tp: int, ep: int, etp: int) -> ParamCounts:
    """``ParamCounts`` from blocks built on the meta device (``models.layer_factory.build_block``, ``MoEDecoder``)."""
    from moefold.training.build import model_options

    model, options = config.model, model_options(config)
    world = math.lcm(tp, ep * etp)
    sizes = ParallelConfig(tp=tp, ep=ep, etp=etp).resolve(world)
    dense_ids = [i for i in range(model.num_layers) if not model.is_moe_layer(i)]
    moe_ids = [i for i in range(model.num_layers) if model.is_moe_layer(i)]
    with planning_world(world, 0), torch.device("meta"):
        dims = rank_dims(sizes, 0)
        # a one-sublayer stack's non-MoE layers differ (Mamba-2, attention, MLP): the smallest bounds them all
        kinds = {model.layer_type(i): i for i in reversed(dense_ids)} if model.hybrid.one_sublayer else {
            None: dense_ids[0]} if dense_ids else {}
        dense = min((_counts(build_block(model, i, dims, options).parameters()) for i in kinds.values()),
                    key=lambda c: sum(n for _, n in c), default=())
        # MoE layers with different mixers (Qwen3-Next's Gated DeltaNet and attention): the smallest bounds them all
        mixers = {model.layer_type(i): i for i in reversed(moe_ids)}
        moe = min((_counts(build_block(model, i, dims, options).parameters()) for i in mixers.values()),
                  key=lambda c: sum(n for _, n in c), default=())
        embed = MoEDecoder(model, dims, options, layer_ids=[], with_embedding=True, with_head=False)
        # without the final norm (H elements), which a layout with MTP puts with the last decoder layer
        head = MoEDecoder(model, dims, options, layer_ids=[], with_embedding=False, with_head=True, with_mtp=False,
                          with_norm=False)
        copy = head.embed_tokens is not None
        own = [p for name, p in head.named_parameters() if not name.startswith("embed_tokens.")]
        output_head = [p for name, p in head.named_parameters() if name.startswith("output_head.")]
        mtp = MoEDecoder(model, dims, options, layer_ids=[], with_embedding=False, with_head=False, with_mtp=True)
        mtp_own = [p for name, p in mtp.named_parameters() if name.startswith("mtp.")]
    return ParamCounts(dense_layer=dense, moe_layer=moe, embedding=_counts(embed.parameters()), head=_counts(own),
                       head_embedding=copy, output_head=_counts(output_head), mtp=_counts(mtp_own))


_BOUNDS: dict[tuple, dict[int, StaticMemory]] = {}
# what ``_key`` normalises: how activations are saved or moved changes no parameter
_ACTIVATION_OPTIONS = ("recompute", "recompute_modules", "recompute_method", "recompute_num_layers", "offload_modules",
                       "dispatcher")
_STATIC_FIELDS = ("bf16", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype", "use_torch_fsdp2",
                  "optimizer_cpu_offload", "optimizer_offload_fraction", "bucket_numel",
                  "pipeline_model_parallel_layout", "num_layers_per_virtual_pipeline_stage",
                  "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_schedule")


def _static_key(config: RunConfig, sizes: ParallelSizes) -> tuple:
    """What a layout's static bytes depend on: the model, the options but how activations are saved, the sizes and
    ``_STATIC_FIELDS``."""
    from moefold.planner.step_bound import value_token

    options = tuple(v for k, v in vars(config.options).items() if k not in _ACTIVATION_OPTIONS)
    return (value_token(config.model), options, sizes, *(getattr(config.train, f) for f in _STATIC_FIELDS))


def static_lower_bound(config: RunConfig, sizes: ParallelSizes) -> dict[int, StaticMemory]:
    """{pipeline rank: a lower bound of its static bytes}: the exact count without bucket padding (computed once per
    model, options, layout and the train fields it depends on: the search asks for it per rung of every layout)."""
    key = _static_key(config, sizes)
    if key not in _BOUNDS:
        if len(_BOUNDS) > 8192:
            _BOUNDS.clear()
        _BOUNDS[key] = _static_lower_bound(config, sizes)
    return _BOUNDS[key]


def _static_lower_bound(config: RunConfig, sizes: ParallelSizes) -> dict[int, StaticMemory]:
    counts = param_counts(_model_key(config), sizes.tp, sizes.ep, sizes.etp)
    t = config.train
    precision = t.optimizer_precision()
    shards = {"dense": sizes.dp * sizes.cp, "sp": sizes.tp * sizes.cp * sizes.dp, "expert": sizes.edp}
    out = {}
    for signature, ranks in stage_groups(config, sizes.pp).items():
        params = grads = host = 0
        states = {"master": 0, "exp_avg": 0, "exp_avg_sq": 0}
        for (kind, dtype), n in _signature_numel(counts, signature).items():
            if t.use_torch_fsdp2:   # fp32 shards of everything (the masters), their gradients, the moments
                params += 4 * n // shards[kind]
                grads += 4 * n // shards[kind]
                states["exp_avg"] += 4 * n // shards[kind]
                states["exp_avg_sq"] += 4 * n // shards[kind]
                continue
            params += n * DTYPE_BYTES[dtype]
            grads += n * DTYPE_BYTES[precision.main_grads_dtype]
            parts = optimizer_state_parts(dtype, precision)
            if t.optimizer_cpu_offload:   # the offloaded shards keep a copy of their main gradients on the host too
                parts = {**parts, "grads": DTYPE_BYTES[precision.main_grads_dtype]}
            for name, b in parts.items():
                if t.optimizer_cpu_offload:   # lower bounds: none on the device, the fraction (to a bucket) on the host
                    host += int(n * b // shards[kind] * t.optimizer_offload_fraction) - b * t.bucket_numel
                else:
                    states[name] += n * b // shards[kind]
        memory = StaticMemory(params=params, grads=grads, exact=False, host=max(host, 0), **states)
        out.update({r: memory for r in ranks})
    return out


_NUMEL: dict[tuple, dict[tuple[str, str], int]] = {}


def stage_numel(config: RunConfig, sizes: ParallelSizes, pp_rank: int) -> dict[tuple[str, str], int]:
    """Elements per (reduction kind, dtype) on ``pp_rank``'s ranks, from the blocks built on the meta device (once per
    ``static_lower_bound``'s key and rank: the step-time model asks for it per chunk and term of every layout)."""
    key = (_static_key(config, sizes), pp_rank)
    if key not in _NUMEL:
        if len(_NUMEL) > 1 << 16:
            _NUMEL.clear()
        counts = param_counts(_model_key(config), sizes.tp, sizes.ep, sizes.etp)
        _NUMEL[key] = _signature_numel(counts, stage_signature(config, sizes.pp, pp_rank))
    return dict(_NUMEL[key])


def _signature_numel(counts: ParamCounts, signature: tuple) -> dict[tuple[str, str], int]:
    """Elements per (reduction kind, dtype) of a stage with ``signature`` (``stage_signature``)."""
    numel: dict[tuple[str, str], int] = {}

    def add(items: tuple[tuple[tuple[str, str], int], ...], times: int = 1) -> None:
        for key, n in items:
            numel[key] = numel.get(key, 0) + n * times

    has_head = any(c[2] for c in signature)
    has_mtp = any(c[3] for c in signature) and bool(counts.mtp)
    moe_layers = sum(sum(c[0]) for c in signature)
    add(counts.moe_layer, moe_layers)
    add(counts.dense_layer, sum(len(c[0]) for c in signature) - moe_layers)
    if any(c[1] for c in signature) or (has_head and counts.head_embedding) or has_mtp:
        add(counts.embedding)
    if has_head:
        add(counts.head)
    elif has_mtp:   # a standalone MTP stage's copy of the output head
        add(counts.output_head)
    if has_mtp:
        add(counts.mtp)
    return numel

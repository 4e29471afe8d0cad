"""Typed run configuration: ``TrainConfig`` (by concern: ``training.sections``) and
``RunConfig`` (model + layout + run-time options + training), serialisable to JSON for checkpoints."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moefold.dispatch.config import DispatcherKind, dispatcher_text
from moefold.models.composed import composed
from moefold.models.config import ModelConfig
from moefold.models.options import DISPATCH_ALIASES, FLEX_FLAGS, ModelOptions, auto_dispatch
from moefold.parallel.sizes import ParallelConfig, ParallelSizes
from moefold.training.optim.loss_scaler import LossScaler
from moefold.training.optim.lr_schedule import LRSchedule
from moefold.training.optim.precision import OptimizerPrecision
from moefold.training.sections import EXIT_SIGNALS as EXIT_SIGNALS  # importable from here as before
from moefold.training.sections import STOP_SIGNALS as STOP_SIGNALS
from moefold.training.sections import (
    CheckpointConfig,
    DataConfig,
    ExecutionConfig,
    LoggingConfig,
    OptimizerConfig,
    PrecisionConfig,
    ScheduleConfig,
    flag,
)

if TYPE_CHECKING:
    from moefold.pipeline.stages import StageLayout
    from moefold.training.optim.muon import MuonOptions


@composed
@dataclass(frozen=True)
class TrainConfig:
    """How to train: the seed and one section per concern (``training.sections``), each checking its own values.
    Every section's field is also a flat name here, read and given as before: ``TrainConfig(lr=1e-3).lr``,
    ``t.schedule.lr``, ``dataclasses.replace(t, seq_length=64)`` (``models.composed``)."""

    seed: int = flag(1234, "seed of the initialisation and the data order")
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"--seed={self.seed!r} must be a non-negative integer")

    @property
    def has_validation(self) -> bool:
        """Validation data is configured (``--split`` or ``--valid-data-path``)."""
        return self.data.has_validation

    def optimizer_precision(self) -> OptimizerPrecision:
        return self.optimizer.optimizer_precision()

    def muon_options(self) -> MuonOptions | None:
        return self.optimizer.muon_options()

    def loss_scaler(self) -> LossScaler | None:
        """The fp16 loss scaler the flags describe (None without ``--fp16``)."""
        return self.precision.loss_scaler()

    def lr_schedule(self) -> LRSchedule:
        return self.schedule.lr_schedule()


_LAYOUTS: dict[tuple, Any] = {}   # RunConfig.pipeline_layout's, by the fields it reads and by (train, model, pp)


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs: the model, its layout, how it is computed, how it is trained."""

    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    options: ModelOptions = field(default_factory=ModelOptions)
    train: TrainConfig = field(default_factory=TrainConfig)
    recipe: str | None = None

    def resolve(self, world_size: int) -> tuple[ParallelSizes, int]:
        """(layout sizes, micro-batches per step) for ``world_size``; raises ValueError naming the flags."""
        s = self.parallel.resolve(world_size)
        t = self.train
        per_step = t.micro_batch_size * s.dp
        if t.global_batch_size % per_step:
            raise ValueError(f"--global-batch-size={t.global_batch_size} is not a multiple of --micro-batch-size="
                             f"{t.micro_batch_size} x data-parallel size {s.dp} (world {world_size} / "
                             f"(tp {s.tp} x cp {s.cp} x pp {s.pp}))")
        if t.seq_length % (2 * s.cp) and s.cp > 1:
            raise ValueError(f"--seq-length={t.seq_length} must be divisible by 2 x --context-parallel-size={s.cp}")
        if self.options.sequence_parallel and s.tp > 1 and (t.seq_length // s.cp) % s.tp:
            raise ValueError(f"--seq-length={t.seq_length} / cp {s.cp} must be divisible by "
                             f"--tensor-model-parallel-size={s.tp} with --sequence-parallel")
        if t.qk_clip and (s.cp > 1 or self.model.attention == "mla" or self.model.qk_norm):
            why = (f"context parallelism (cp={s.cp}): a rank's queries see other ranks' keys" if s.cp > 1 else
                   "MLA attention (its q_pe/k_pe split)" if self.model.attention == "mla" else
                   "qk-norm (the norms undo a clip of the projections)")
            raise ValueError(f"--qk-clip is implemented for GQA attention without qk-norm, not with {why}")
        if t.fp16 and self.model.dsa is not None:
            raise ValueError("--fp16 cannot train DeepSeek sparse attention (the model's dsa): the indexer's loss "
                             "joins the backward with gradient 1, unscaled (as Megatron-Core's "
                             "DSAIndexerLossAutoScaler), so the loss scale's unscaling would shrink the indexer's "
                             "gradients by the scale; use --bf16")
        if self.model.v4 is not None and (t.reset_position_ids or t.reset_attention_mask):
            raise ValueError("--reset-position-ids / --reset-attention-mask pack documents, which DeepSeek-V4 cannot "
                             "take: its compressed attention's windows and indexer read each sample from position 0 "
                             "(--eod-mask-loss alone is accepted)")
        if t.seq_length > self.model.max_position_embeddings:
            raise ValueError(f"--seq-length={t.seq_length} exceeds the model's max_position_embeddings="
                             f"{self.model.max_position_embeddings}")
        num_micro = t.global_batch_size // per_step
        if s.pp > 1:
            from moefold.pipeline.schedules import check_schedule_config

            vpp = self.pipeline_layout(s.pp).vpp
            check_schedule_config(self.schedule_name(vpp), s.pp, vpp, num_micro, t.overlap_moe_expert_parallel_comm)
        if t.overlap_moe_expert_parallel_comm:
            self._check_overlap(s)
        if t.overlap_moe_expert_parallel_comm or self.split_backward(s.pp):
            self._check_split_backends()
        conflict = self.memory_saver_conflict(s.pp)
        if conflict:
            raise ValueError(conflict)
        return s, num_micro

    def memory_saver_conflict(self, pp: int) -> str | None:
        """The one line refusing a memory saver (activation offloading, FSDP2) with this run's schedule at ``pp``
        stages, or None. ``moefold plan`` skips what this refuses."""
        t, o = self.train, self.options
        overlap = "--overlap-moe-expert-parallel-comm"
        if t.use_torch_fsdp2 and t.overlap_moe_expert_parallel_comm:
            return (f"--use-torch-fsdp2 cannot be combined with {overlap}: the overlap runs each block as pieces that "
                    f"bypass the FSDP units' forward (their parameter all-gathers) and defers weight gradients past "
                    f"the units' reduce-scatters; use the distributed optimizer (with --optimizer-cpu-offload to "
                    f"move its states to the host) or drop {overlap}")
        if t.use_torch_fsdp2 and self.split_backward(pp):
            return (f"--use-torch-fsdp2 cannot be combined with --pipeline-schedule {t.pipeline_schedule}: its split "
                    f"backward computes the weight gradients (W) after FSDP has reduce-scattered a unit's gradients "
                    f"at the end of its backward; use --pipeline-schedule 1f1b (interleaved with virtual stages) or "
                    f"the distributed optimizer")
        if t.use_torch_fsdp2 and (t.fp16 or o.fp8.param_gather):
            what = "--fp16" if t.fp16 else "--fp8-param-gather"
            return (f"--use-torch-fsdp2 cannot be combined with {what}: FSDP2's units gather and reduce in their own "
                    f"dtypes, outside the distributed optimizer's "
                    f"{'loss-scale unscaling' if t.fp16 else 'FP8 parameter gathers'}; use the distributed optimizer")
        if t.optimizer_type == "muon" and o.fp8.param_gather:
            return ("--optimizer muon cannot be combined with --fp8-param-gather: Muon's owning rank updates whole "
                    "matrices, the FP8 gather quantises AdamW's chunks; drop one of them")
        if t.optimizer_cpu_offload and o.fp8.param_gather:
            return ("--optimizer-cpu-offload cannot be combined with --fp8-param-gather: the FP8 gather quantises "
                    "the masters on the device, the offloaded masters live in host memory; drop one of them")
        if o.offload_modules and t.overlap_moe_expert_parallel_comm:
            return (f"--fine-grained-activation-offloading cannot be combined with {overlap}: the overlap runs the "
                    f"blocks as pieces, one micro-batch's forward interleaved with another's backward, outside the "
                    f"offloader's per-micro-batch chunks and their one-layer-ahead prefetch; recompute "
                    f"(--recompute-modules) instead or drop {overlap}")
        return None

    def split_backward(self, pp: int) -> bool:
        """The run defers weight gradients: a zero-bubble schedule at pp > 1, or --delay-wgrad-compute."""
        return (pp > 1 and self.train.pipeline_schedule in ("zb-h1", "zbv", "dualpipev")) or \
            self.train.delay_wgrad_compute

    def _check_overlap(self, sizes: ParallelSizes) -> None:
        """ValueError naming the flag for what --overlap-moe-expert-parallel-comm cannot run with (Megatron's rules)."""
        o, m = self.options, self.model
        flag = "--overlap-moe-expert-parallel-comm"
        if not m.num_experts:
            raise ValueError(f"{flag} overlaps the MoE layers' token exchanges; the model has no experts")
        if sizes.ep < 2:
            raise ValueError(f"{flag} hides the expert-parallel exchange: it needs --expert-model-parallel-size > 1, "
                             f"got {sizes.ep}")
        dispatcher = o.resolved_dispatcher(sizes.ep, sizes.etp)
        if dispatcher not in (DispatcherKind.ALLTOALL, DispatcherKind.FLEX):
            raise ValueError(f"{flag} runs with the alltoall and flex dispatchers, not --moe-token-dispatcher-type "
                             f"{dispatcher} (nothing of its exchange is in flight to hide; Megatron refuses it too)")
        if o.recompute == "selective" and "moe" in o.recompute_modules:
            raise ValueError(f"{flag} cannot checkpoint the whole MoE layer (--recompute-modules moe): the checkpoint "
                             f"would span its exchanges; recompute moe_act and shared_experts instead, or use full "
                             f"recompute")
        if o.recompute == "full" and o.recompute_method == "uniform" and o.recompute_num_layers > 1:
            raise ValueError(f"{flag} recomputes each layer's pieces on their own: --recompute-num-layers="
                             f"{o.recompute_num_layers} with --recompute-method uniform would checkpoint several "
                             f"layers as one unit across their exchanges; use --recompute-num-layers 1 or "
                             f"--recompute-method block")

    def _check_split_backends(self) -> None:
        o = self.options
        if o.gemm_backend == "te" or (o.fp8.enabled and o.fp8.backend == "te"):
            raise ValueError("split backwards (zero-bubble schedules, --delay-wgrad-compute) and the batch-level "
                             "overlap defer weight gradients with moefold's GEMMs, not Transformer Engine's: use "
                             "--moe-grouped-gemm-backend grouped_mm and --fp8-backend torchao")

    def pipeline_layout(self, pp: int) -> StageLayout:
        """The split of the decoder's layers over ``pp`` stages (x virtual stages) that the flags describe;
        ValueError naming the flags for an impossible one. Made once per what it reads (``moefold plan`` validates
        tens of thousands of layouts that share a few hundred splits; a ``StageLayout`` is frozen)."""
        t, m = self.train, self.model
        mine = _LAYOUTS.get((id(t), id(m), pp))   # the same train and model objects: no flag read again
        if mine is not None and mine[0] is t and mine[1] is m:
            return mine[2]
        key = (m.num_layers, m.mtp_num_layers, pp, t.pipeline_schedule, t.pipeline_model_parallel_layout,
               t.num_layers_per_virtual_pipeline_stage, t.decoder_first_pipeline_num_layers,
               t.decoder_last_pipeline_num_layers)
        if not isinstance(t.pipeline_model_parallel_layout, (str, type(None))):   # a list of lists: not hashable
            return self._pipeline_layout(pp)
        layout = _LAYOUTS.get(key)
        if layout is None:
            if len(_LAYOUTS) > 1 << 14:
                _LAYOUTS.clear()
            layout = _LAYOUTS[key] = self._pipeline_layout(pp)
        _LAYOUTS[(id(t), id(m), pp)] = (t, m, layout)   # (the objects kept: their ids are not reused meanwhile)
        return layout

    def _pipeline_layout(self, pp: int) -> StageLayout:
        from moefold.pipeline.schedules import placement_of
        from moefold.pipeline.stages import StageLayout, vpp_from_layers_per_virtual_stage

        t, m = self.train, self.model
        first, last = t.decoder_first_pipeline_num_layers, t.decoder_last_pipeline_num_layers
        text = t.pipeline_model_parallel_layout
        if text is not None:
            others = [f"--{name.replace('_', '-')}={getattr(t, name)}" for name in (
                "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers") if getattr(t, name) is not None]
            if others:
                raise ValueError(f"--pipeline-model-parallel-layout={text!r} places every layer itself: drop "
                                 f"{' and '.join(others)}")
            from moefold.pipeline.layout import parse_layout

            stages = len(parse_layout(text))
            vpp = stages // pp if stages % pp == 0 else 1
            placement = placement_of(self.schedule_name(vpp))
            layout = StageLayout(m.num_layers, pp, layout=text, mtp_num_layers=m.mtp_num_layers,
                                 placement=placement)
            self._check_schedule_vpp(layout.vpp, pp, f"--pipeline-model-parallel-layout={text!r} gives {layout.vpp} "
                                     f"virtual stages per rank ({stages} stages / pp {pp})")
            return layout
        if (first is not None or last is not None) and t.num_layers_per_virtual_pipeline_stage is not None:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage={t.num_layers_per_virtual_pipeline_stage} "
                             "cannot be combined with --decoder-first/last-pipeline-num-layers (uneven stages); "
                             "drop one of them, or give --pipeline-model-parallel-layout")
        vpp = vpp_from_layers_per_virtual_stage(m.num_layers, pp, t.num_layers_per_virtual_pipeline_stage)
        self._check_schedule_vpp(vpp, pp, f"--num-layers-per-virtual-pipeline-stage="
                                      f"{t.num_layers_per_virtual_pipeline_stage} gives {vpp} virtual stages per rank")
        return StageLayout(m.num_layers, pp, vpp, first, last, placement=placement_of(self.schedule_name(vpp)),
                           mtp_num_layers=m.mtp_num_layers)

    def _check_schedule_vpp(self, vpp: int, pp: int, source: str) -> None:
        from moefold.pipeline.schedules import V_SCHEDULES

        schedule = self.train.pipeline_schedule
        if vpp > 1 and schedule in ("gpipe", "zb-h1"):
            raise ValueError(f"--pipeline-schedule={schedule} runs one chunk per rank, but {source} (interleaved "
                             "1F1B schedule); drop one of them")
        if schedule in V_SCHEDULES and vpp != 2:
            raise ValueError(f"--pipeline-schedule={schedule} runs 2 chunks per rank in V placement: give 2 x pp "
                             f"virtual stages (--num-layers-per-virtual-pipeline-stage="
                             f"{self.model.num_layers // (2 * pp) or 1} or a layout of 2 x pp "
                             f"stages), but {source}")

    def schedule_name(self, vpp: int) -> str:
        """The pipeline schedule to run: interleaved whenever there are virtual stages (Megatron: 1F1B by
        default, interleaved 1F1B with virtual stages; GPipe, the zero-bubble ones, DualPipeV on request)."""
        from moefold.pipeline.schedules import V_SCHEDULES

        if self.train.pipeline_schedule in V_SCHEDULES:
            return self.train.pipeline_schedule
        return "interleaved" if vpp > 1 else self.train.pipeline_schedule

    def with_(self, **changes: Any) -> RunConfig:
        """A copy with values changed by their flat names, each routed to the part that holds it: the model's
        (``moe_topk``), the layout's (``tp``), the options' (``dispatcher``, ``moe_deepep_num_sms``), the train
        config's (``lr``, ``seq_length``); or whole parts (``model=...``). ``vocab_size`` is the model's and the
        built-in corpus's: give it through its part (``model=config.model.with_(vocab_size=...)``)."""
        parts = {name: changes.pop(name) for name in ("model", "parallel", "options", "train", "recipe")
                 if name in changes}
        routed: dict[str, dict[str, Any]] = {}
        for name, value in changes.items():
            holders = [part for part, names in _part_names().items() if name in names]
            if len(holders) != 1:
                raise TypeError(f"RunConfig.with_: {name!r} is " + (f"a field of {' and '.join(holders)}: change it "
                                                                    "through that part" if holders else
                                                                    "no field of the model, layout, options or train "
                                                                    "config"))
            routed.setdefault(holders[0], {})[name] = value
        for part, values in routed.items():
            parts[part] = dataclasses.replace(parts.get(part, getattr(self, part)), **values)
        return dataclasses.replace(self, **parts)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form a checkpoint and metrics.jsonl record: the model and the train config flat (their sections'
        fields by their flat names, as ``training.checkpoint.resume`` reads them and earlier moefold wrote them), the
        options' dispatcher by its earlier flat names likewise (``dispatcher``: ``auto`` for the layout's, and the flex
        options' flag names), which moefold before ``ModelOptions.dispatch`` reads."""
        options = {k: v for k, v in dataclasses.asdict(self.options).items() if k != "dispatch"}
        options["dispatcher"] = dispatcher_text(self.options.dispatch.kind)
        options.update({name: getattr(self.options, name) for name in FLEX_FLAGS})   # by their flag names
        chunked = self.options.dispatch.max_chunked_experts
        if chunked != auto_dispatch().max_chunked_experts:   # no flag sets it: written only when changed
            options["dispatch"] = {"max_chunked_experts": chunked}
        return {**dataclasses.asdict(self), "model": self.model.to_dict(), "options": options,
                "train": self.train.flat_dict()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        return cls(model=ModelConfig.from_dict(d["model"]), parallel=ParallelConfig(**d["parallel"]),
                   options=ModelOptions(**d["options"]), train=TrainConfig(**d["train"]), recipe=d.get("recipe"))


def _part_names() -> dict[str, frozenset[str]]:
    """The flat names ``RunConfig.with_`` routes, by the part that holds them."""
    return {"model": frozenset(ModelConfig.FLAT_NAMES) | frozenset(ModelConfig.SECTIONS),
            "parallel": frozenset(f.name for f in dataclasses.fields(ParallelConfig)),
            "options": frozenset(f.name for f in dataclasses.fields(ModelOptions)) | frozenset(DISPATCH_ALIASES),
            "train": frozenset(TrainConfig.FLAT_NAMES) | frozenset(TrainConfig.SECTIONS)}

"""Typed run configuration: ``TrainConfig`` (optimisation, batch, data, checkpoints, logging) and
``RunConfig`` (model + layout + run-time options + training), serialisable to JSON for checkpoints."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moefold.dispatch.config import DispatcherKind
from moefold.models.config import MLADims, ModelConfig, YarnScaling
from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelConfig, ParallelSizes
from moefold.training.optim.loss_scaler import LossScaler
from moefold.training.optim.lr_schedule import DECAY_STYLES, WSD_STYLES, LRSchedule
from moefold.training.optim.muon import MuonOptions
from moefold.training.optim.newton_schulz import ScaleMode, TPMode
from moefold.training.optim.precision import OptimizerPrecision

# the signals that stop a run after its current step, with a checkpoint (Megatron's --exit-signal-handler)
EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")   # the ones --exit-signal takes

if TYPE_CHECKING:
    from moefold.pipeline.stages import StageLayout


@dataclass(frozen=True)
class TrainConfig:
    """How to train. Batch sizes are in samples of ``seq_length`` tokens; ``global_batch_size`` =
    ``micro_batch_size * dp * num_micro_batches`` (checked against the layout by ``RunConfig.resolve``)."""

    # defaults: the README's first command (a *_tiny recipe on the built-in corpus, a few CPU minutes)
    micro_batch_size: int = 4
    global_batch_size: int = 8
    seq_length: int = 256
    train_iters: int = 250
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup_iters: int = 20
    lr_decay_style: str = "cosine"
    lr_decay_iters: int | None = None          # None: train_iters
    lr_wsd_decay_iters: int = 0
    lr_wsd_decay_style: str = "linear"
    lr_warmup_init: float = 0.0                # Megatron's --lr-warmup-init: the lr of step 0
    lr_warmup_skip_zero: bool = False          # warmup lr * (step + 1) / warmup (moefold's earlier convention)
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0                     # 0: no clipping
    seed: int = 1234
    bf16: bool = False                         # bf16 parameters/activations with fp32 master weights
    fp16: bool = False                         # fp16 parameters/activations, fp32 masters, loss scaling
    loss_scale: float | None = None            # fp16: a static loss scale (None: dynamic, Megatron's defaults)
    initial_loss_scale: float = 2.0 ** 32      # fp16 dynamic scaling: the starting scale
    min_loss_scale: float = 1.0                # fp16 dynamic scaling: never below
    loss_scale_window: int = 1000              # fp16 dynamic scaling: clean steps before the scale doubles
    hysteresis: int = 2                        # fp16 dynamic scaling: overflows in a row before it halves
    compile: bool = False                      # torch.compile per transformer block (execution.compile)
    max_skipped_steps: int = 5                 # stop after this many non-finite steps in a row
    bucket_numel: int = 2**22
    pipeline_schedule: str = "1f1b"            # gpipe | 1f1b | interleaved | zb-h1 | zbv | dualpipev (pp > 1;
                                               # interleaved for vpp > 1; zbv/dualpipev: 2 chunks per rank, V placed)
    overlap_moe_expert_parallel_comm: bool = False   # batch-level overlap: FB pairs (pipeline.overlap)
    delay_wgrad_compute: bool = False          # with the overlap: weight GEMMs behind the next exchange
    num_layers_per_virtual_pipeline_stage: int | None = None
    decoder_first_pipeline_num_layers: int | None = None   # pp > 1: layers on the first stage (None: even split)
    decoder_last_pipeline_num_layers: int | None = None    # pp > 1: layers on the last stage (None: even split)
    pipeline_model_parallel_layout: str | None = None      # Megatron's layout text, e.g. "Et|(tt|)*30mL"
                                                           # (pipeline.layout; fixes vpp, replaces the above)
    overlap_grad_reduce: bool = True
    gradient_accumulation_fusion: bool = True  # weight-gradient GEMMs write main grads (dense.grad_accumulation)
    overlap_param_gather: bool = False         # the parameter all-gather waits in the next forward, per module
    # the expert-load max/mean the plan sized the experts' activations for (training.observe.imbalance)
    moe_max_load_ratio: float | None = None
    # FSDP2 instead of the distributed optimizer (training.optim.fsdp)
    use_torch_fsdp2: bool = False
    # optimizer offload (Megatron's names; training.optim.offload): that share of the states on the host, CPU AdamW
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    # optimizer precision (Megatron's names; training.optim.precision.OptimizerPrecision)
    main_grads_dtype: str = "fp32"
    main_params_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    # Muon (Megatron's --optimizer muon, --muon-*; training.optim.muon): Muon for the matrices, AdamW for the rest
    optimizer: str = "adam"                    # adam | muon
    muon_momentum: float = 0.95
    muon_use_nesterov: bool = False
    muon_num_ns_steps: int = 5
    muon_coefficient_type: str = "quintic"     # training.optim.newton_schulz.COEFFICIENTS
    muon_scale_mode: str = "spectral"          # spectral | shape_scaling | unit_rms_norm
    muon_extra_scale_factor: float = 1.0
    muon_tp_mode: str = "blockwise"            # blockwise | duplicated | distributed
    muon_fp32_matmul_prec: str = "medium"      # medium: Newton-Schulz in bf16 | high | highest: in fp32
    qk_clip: bool = False                      # MuonClip: after each step, shrink q/k rows of heads past the threshold
    qk_clip_threshold: float = 100.0           # eta = min(1, threshold / max logit) (training.optim.qk_clip)
    qk_clip_alpha: float = 0.5                 # q rows *= eta^alpha, k rows *= eta^(1 - alpha)
    # data
    data_path: tuple[str, ...] = ()            # Megatron style: PREFIX or W1 PREFIX1 W2 PREFIX2 ...; () = built-in
    vocab_size: int | None = None              # built-in corpus vocabulary (None: the model's)
    data_cache_dir: str | None = None
    data_order: str = "moefold"                # moefold (independent of the run length) | megatron (GPTDataset's)
    mid_level_dataset_surplus: float = 0.005   # --data-order megatron: Megatron's per-corpus sample surplus
    # Megatron-LM's tokenizer flags (training.data.megatron_tokenizer): the model's vocabulary and SAVE/hf_assets
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    make_vocab_size_divisible_by: int = 128
    # output
    run_dir: str = "runs/moefold"
    log_interval: int = 10
    save: str | None = None
    save_interval: int = 0                     # 0: only at the end when save is set
    keep_last: int = 2
    load: str | None = None
    async_save: bool = False                   # write checkpoints in the background (training.checkpoint.save)
    run_id: str | None = None                  # this run's id (training.checkpoint.identity; the CLI sets it)
    # stopping early, saving first (training.launch.signals)
    exit_signals: tuple[str, ...] = EXIT_SIGNALS   # () : no handler (a signal ends the process as usual)
    exit_duration_in_mins: float | None = None  # stop (and save) after this many minutes
    exit_interval: int | None = None           # stop (and save) after a step divisible by this
    reset_data_position: bool = False          # resume with another data order (data, seq_length, seed) from its start
    balance_report: bool = True
    # starting weights (train --load-hf): the architecture and weights of an HF (or moefold) directory
    load_hf: str | None = None
    moe_use_upcycling: bool = False            # load_hf holds a dense model: start from its upcycled MoE
    load_megatron: str | None = None           # starting weights from a Megatron-Core torch_dist checkpoint
    # validation (training.evaluate): with --split or --valid-data-path
    eval_interval: int | None = None           # every N steps (None: only at the end of the run)
    eval_iters: int = 10                       # global batches per evaluation
    skip_train: bool = False                   # validation only: evaluate the loaded (or initial) model, no steps
    split: str | None = None                   # Megatron's "969,30,1": train/valid/test shares of each corpus
    valid_data_path: tuple[str, ...] = ()      # a separate validation corpus: PREFIX or W1 PREFIX1 W2 PREFIX2 ...
    # Weights & Biases (optional dependency; WANDB_MODE=offline works without network)
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "global_batch_size", "seq_length", "train_iters", "log_interval",
                     "max_skipped_steps", "bucket_numel", "keep_last", "loss_scale_window", "hysteresis"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
        for name in ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"--{name.replace('_', '-')}={value!r} must be a finite number >= 0")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1 and self.adam_eps > 0):
            raise ValueError(f"need 0 <= --adam-beta1={self.adam_beta1}, --adam-beta2={self.adam_beta2} < 1 and "
                             f"--adam-eps={self.adam_eps} > 0")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"--seed={self.seed!r} must be a non-negative integer")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"--global-batch-size={self.global_batch_size} is not a multiple of "
                             f"--micro-batch-size={self.micro_batch_size}")
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style={self.lr_decay_style!r}; valid: {', '.join(DECAY_STYLES)}")
        if self.lr_wsd_decay_style not in WSD_STYLES:
            raise ValueError(f"--lr-wsd-decay-style={self.lr_wsd_decay_style!r}; valid: {', '.join(WSD_STYLES)}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= --min-lr={self.min_lr} <= --lr={self.lr}")
        if self.clip_grad < 0 or self.weight_decay < 0 or self.save_interval < 0:
            raise ValueError(f"--clip-grad={self.clip_grad}, --weight-decay={self.weight_decay} and "
                             f"--save-interval={self.save_interval} must be >= 0")
        self.lr_schedule()  # validates warmup/decay lengths
        if self.eval_interval is not None and (not isinstance(self.eval_interval, int) or self.eval_interval < 1):
            raise ValueError(f"--eval-interval={self.eval_interval!r} must be a positive integer")
        if not isinstance(self.eval_iters, int) or self.eval_iters < 1:
            raise ValueError(f"--eval-iters={self.eval_iters!r} must be a positive integer")
        if self.eval_interval is not None and not self.has_validation:
            raise ValueError(f"--eval-interval={self.eval_interval} needs validation data: --split (e.g. 969,30,1) "
                             "or --valid-data-path")
        if self.skip_train and not self.has_validation:
            raise ValueError("--skip-train runs validation only: it needs validation data, --split (e.g. 969,30,1) "
                             "or --valid-data-path")
        if self.split is not None and self.valid_data_path:
            raise ValueError("give either --split (validation documents cut from --data-path) or --valid-data-path, "
                             "not both")
        if self.split is not None:
            from moefold.training.data.validation import parse_split

            parse_split(self.split)
        if self.data_order not in ("moefold", "megatron"):
            raise ValueError(f"--data-order={self.data_order!r}; valid: moefold, megatron")
        if self.load_hf and self.load_megatron:
            raise ValueError("give either --load-hf or --load-megatron (the starting weights), not both")
        if not 0 <= self.mid_level_dataset_surplus < float("inf"):
            raise ValueError(f"--mid-level-dataset-surplus={self.mid_level_dataset_surplus} must be >= 0")
        if self.moe_use_upcycling and not self.load_hf:
            raise ValueError("--moe-use-upcycling needs --load-hf DIR (the dense checkpoint to upcycle)")
        self.optimizer_precision()  # validates the dtypes
        self.muon_options()  # validates --optimizer and the Muon settings
        bad = [s for s in self.exit_signals if s not in STOP_SIGNALS]
        if bad:
            raise ValueError(f"--exit-signal {' '.join(bad)}: valid: {', '.join(STOP_SIGNALS)}")
        if self.exit_duration_in_mins is not None and not (isinstance(self.exit_duration_in_mins, (int, float))
                                                           and 0 < self.exit_duration_in_mins < math.inf):
            raise ValueError(f"--exit-duration-in-mins={self.exit_duration_in_mins!r} must be a positive number")
        if self.exit_interval is not None and (not isinstance(self.exit_interval, int) or self.exit_interval < 1):
            raise ValueError(f"--exit-interval={self.exit_interval!r} must be a positive integer")
        from moefold.training.optim.offload import check_offload_fraction

        check_offload_fraction(self.optimizer_offload_fraction)
        from moefold.training.observe.imbalance import check_max_load_ratio

        check_max_load_ratio(self.moe_max_load_ratio)
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 exclude each other; choose one")
        if self.fp16:
            self.loss_scaler()  # validates the loss-scale flags
        from moefold.pipeline.schedules import SCHEDULES

        if self.pipeline_schedule not in SCHEDULES:
            raise ValueError(f"--pipeline-schedule={self.pipeline_schedule!r}; valid: {', '.join(SCHEDULES)}")
        if self.delay_wgrad_compute and not self.overlap_moe_expert_parallel_comm:
            raise ValueError("--delay-wgrad-compute defers the experts' and attention's weight gradients behind the "
                             "exchanges of the batch-level overlap: it needs --overlap-moe-expert-parallel-comm "
                             "(as in Megatron; the zero-bubble schedules defer them by themselves)")
        if self.compile and (self.overlap_moe_expert_parallel_comm or self.pipeline_schedule in ("zb-h1", "zbv",
                                                                                               "dualpipev")):
            raise ValueError("--compile cannot be combined with split backwards or the batch-level overlap (their "
                             "GEMMs defer weight gradients and their graphs are cut between sub-layers; torch's "
                             "zero-bubble schedules refuse compile too): drop --compile")

    @property
    def has_validation(self) -> bool:
        """Validation data is configured (``--split`` or ``--valid-data-path``)."""
        return self.split is not None or bool(self.valid_data_path)

    def optimizer_precision(self) -> OptimizerPrecision:
        return OptimizerPrecision(main_grads_dtype=self.main_grads_dtype, main_params_dtype=self.main_params_dtype,
                                  exp_avg_dtype=self.exp_avg_dtype, exp_avg_sq_dtype=self.exp_avg_sq_dtype)

    def muon_options(self) -> MuonOptions | None:
        """Muon's settings (None with ``--optimizer adam``); refuses what Muon cannot run with."""
        if self.optimizer not in ("adam", "muon"):
            raise ValueError(f"--optimizer={self.optimizer!r}; valid: adam, muon")
        if self.qk_clip and self.optimizer != "muon":
            raise ValueError("--qk-clip (MuonClip) needs --optimizer muon")
        if not (self.qk_clip_threshold > 0 and 0 <= self.qk_clip_alpha <= 1):
            raise ValueError(f"need --qk-clip-threshold={self.qk_clip_threshold} > 0 and 0 <= "
                             f"--qk-clip-alpha={self.qk_clip_alpha} <= 1")
        if self.optimizer == "adam":
            return None
        if self.use_torch_fsdp2 or self.optimizer_cpu_offload:
            raise ValueError(f"--optimizer muon cannot be combined with "
                             f"{'--use-torch-fsdp2' if self.use_torch_fsdp2 else '--optimizer-cpu-offload'}: Muon "
                             "updates whole matrices on the distributed optimizer's owning rank; drop that flag")
        for name, enum in (("muon_scale_mode", ScaleMode), ("muon_tp_mode", TPMode)):
            valid = [m.value for m in enum]
            if getattr(self, name) not in valid:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)!r}; valid: {', '.join(valid)}")
        return MuonOptions(momentum=self.muon_momentum, use_nesterov=self.muon_use_nesterov,
                           num_ns_steps=self.muon_num_ns_steps, coefficient_type=self.muon_coefficient_type,
                           scale_mode=ScaleMode(self.muon_scale_mode), extra_scale_factor=self.muon_extra_scale_factor,
                           tp_mode=TPMode(self.muon_tp_mode), fp32_matmul_prec=self.muon_fp32_matmul_prec)

    def loss_scaler(self) -> LossScaler | None:
        """The fp16 loss scaler the flags describe (None without ``--fp16``)."""
        if not self.fp16:
            return None
        if self.loss_scale is not None:
            return LossScaler(scale=self.loss_scale, dynamic=False, min_scale=min(self.min_loss_scale, self.loss_scale))
        return LossScaler(scale=self.initial_loss_scale, min_scale=self.min_loss_scale,
                          growth_interval=self.loss_scale_window, hysteresis=self.hysteresis)

    def lr_schedule(self) -> LRSchedule:
        return LRSchedule(lr=self.lr, min_lr=self.min_lr, warmup_iters=self.lr_warmup_iters,
                          decay_iters=self.lr_decay_iters or self.train_iters, style=self.lr_decay_style,
                          wsd_decay_iters=self.lr_wsd_decay_iters, wsd_decay_style=self.lr_wsd_decay_style,
                          warmup_init=self.lr_warmup_init, warmup_skip_zero=self.lr_warmup_skip_zero)


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
        if t.optimizer == "muon" and o.fp8.param_gather:
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
        ValueError naming the flags for an impossible one."""
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        m = dict(d["model"])
        if m.get("mla"):
            m["mla"] = MLADims(**m["mla"])
        if m.get("yarn"):
            m["yarn"] = YarnScaling(**m["yarn"])
        if isinstance(m.get("moe_layer_freq"), list):
            m["moe_layer_freq"] = tuple(m["moe_layer_freq"])
        t = dict(d["train"])
        t["data_path"] = tuple(t.get("data_path") or ())
        t["valid_data_path"] = tuple(t.get("valid_data_path") or ())
        t["exit_signals"] = tuple(t.get("exit_signals", EXIT_SIGNALS))
        return cls(model=ModelConfig(**m), parallel=ParallelConfig(**d["parallel"]),
                   options=ModelOptions(**d["options"]), train=TrainConfig(**t), recipe=d.get("recipe"))

"""The concerns ``TrainConfig`` is composed of, each a frozen dataclass that checks its own values once.

    OptimizerConfig   AdamW, clipping, the optimizer's precision, offload, FSDP2 and the gradient buckets
    ScheduleConfig    the steps and the learning-rate schedule (``LRSchedule``)
    DataConfig        batch and sequence, corpora, tokenizer, the validation split and evaluation
    PrecisionConfig   bf16 / fp16 and fp16's loss scaling (``LossScaler``)
    ExecutionConfig   the pipeline schedule and split, the batch-level overlap, compile, grad-accumulation fusion
    CheckpointConfig  saving, loading, the starting weights, stopping early (with a save) and on bad steps
    LoggingConfig     the run directory and id, the logging interval, reports, Weights & Biases
                      (these two in ``training.run_sections``; the shared value checks in ``training.section_checks``)

Every field is also ``TrainConfig``'s flat name (``t.lr == t.schedule.lr``; ``models.composed``), the name of
its Megatron-LM flag with ``-`` for ``_``. A field made with ``flag(default, help, ...)`` is that flag of ``moefold
train``: its help, default and choices are the field's (``models.flag_field``; ``training.cli.field_flags`` adds them
to the parser).
Messages name the flags. Torch-free: checks that need a package that imports torch
import it when they run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moefold.models.flag_field import flag as flag  # one helper for the train and model flag fields
from moefold.pipeline.schedules import SCHEDULES
from moefold.training.data.megatron_tokenizer import TOKENIZER_TYPES
from moefold.training.optim.loss_scaler import LossScaler
from moefold.training.optim.lr_schedule import DECAY_STYLES, WSD_STYLES, LRSchedule
from moefold.training.optim.precision import DTYPES, OptimizerPrecision
from moefold.training.run_sections import EXIT_SIGNALS, STOP_SIGNALS, CheckpointConfig, LoggingConfig
from moefold.training.section_checks import finite_non_negative, positive_int_or_none, positive_ints

if TYPE_CHECKING:
    from moefold.training.optim.muon import MuonOptions

DATA_ORDERS = ("moefold", "megatron")
# Megatron-Core 0.18's CUDA graph flags (execution.cuda_graph's CudaGraphImpl / CudaGraphScope: the same names)
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")
CUDA_GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and what the distributed optimizer does around it (Megatron's names)."""

    weight_decay: float = flag(0.1, "AdamW weight decay (not on norms, biases and expert biases)")
    adam_beta1: float = flag(0.9, "AdamW beta1")
    adam_beta2: float = flag(0.95, "AdamW beta2")
    adam_eps: float = flag(1e-8, "AdamW epsilon")
    clip_grad: float = flag(1.0, "global gradient-norm clipping (0: off)")
    # optimizer precision (training.optim.precision.OptimizerPrecision)
    main_grads_dtype: str = flag("fp32", "optimizer precision", choices=tuple(DTYPES))
    main_params_dtype: str = flag("fp32", "the master copy of bf16 parameters (fp32)", choices=("fp32",))
    exp_avg_dtype: str = flag("fp32", "optimizer precision", choices=tuple(DTYPES))
    exp_avg_sq_dtype: str = flag("fp32", "optimizer precision", choices=tuple(DTYPES))
    # optimizer offload (training.optim.offload): that share of the states on the host, CPU AdamW
    optimizer_cpu_offload: bool = flag(False, "keep master weights and Adam moments of --optimizer-offload-fraction "
                                       "of this rank's shard in host memory and update them on the CPU while the "
                                       "device starts the next step", action="store_true")
    optimizer_offload_fraction: float = flag(1.0, "with --optimizer-cpu-offload: the share offloaded, 0..1")
    use_torch_fsdp2: bool = flag(False, "shard parameters, gradients and optimizer states with torch's fully_shard "
                                 "(FSDP2): dense modules over dp x cp, experts over the expert data-parallel group, "
                                 "composed with tp, ep/etp, pp; instead of the distributed optimizer",
                                 action="store_true")
    bucket_numel: int = 2**22
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = flag(False, "all-gather updated parameters during the next forward (each module "
                                      "waits for its own)", action="store_true")
    # Muon (Megatron's --optimizer muon, --muon-*; training.optim.muon): Muon for the matrices, AdamW for embeddings,
    # output layer, norms, routers, biases. Choices spelled here so that parsing needs no torch; MuonOptions checks
    # them against training.optim.newton_schulz's enums.
    optimizer_type: str = flag("adam", "adam, or muon: Newton-Schulz orthogonalised momentum for the matrices, "
                               "AdamW for the rest", choices=("adam", "muon"), name="--optimizer")
    muon_momentum: float = flag(0.95, "momentum (EMA) of Muon's SGD")
    muon_use_nesterov: bool = flag(False, "Nesterov momentum", action="store_true")
    muon_num_ns_steps: int = flag(5, "Newton-Schulz iterations")
    muon_coefficient_type: str = flag("quintic", "Newton-Schulz coefficient set",
                                      choices=("simple", "quintic", "polar_express", "cans"))
    muon_scale_mode: str = flag("spectral", "update scale: spectral sqrt(max(rows, cols)), shape_scaling, "
                                "unit_rms_norm", choices=("spectral", "shape_scaling", "unit_rms_norm"))
    muon_extra_scale_factor: float = flag(1.0, "multiplies the update (0.2 with spectral matches AdamW's update RMS)")
    muon_tp_mode: str = flag("blockwise", "tp-split matrices: blockwise (each block alone), duplicated (gathered, "
                             "whole: equals tp=1), distributed (Gram matrices all-reduced)",
                             choices=("blockwise", "duplicated", "distributed"))
    muon_fp32_matmul_prec: str = flag("medium", "medium: Newton-Schulz in bf16; high/highest: in fp32",
                                      choices=("highest", "high", "medium"))
    qk_clip: bool = flag(False, "MuonClip: after each step, scale the q and k rows of attention heads whose largest "
                         "logit passed --qk-clip-threshold (GQA without qk-norm, no cp)", action="store_true")
    qk_clip_threshold: float = flag(100.0, "QK-clip's logit bound")
    qk_clip_alpha: float = flag(0.5, "q rows take eta^alpha, k rows eta^(1 - alpha)")

    def __post_init__(self) -> None:
        positive_ints(self, "bucket_numel")
        finite_non_negative(self, "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1 and self.adam_eps > 0):
            raise ValueError(f"need 0 <= --adam-beta1={self.adam_beta1}, --adam-beta2={self.adam_beta2} < 1 and "
                             f"--adam-eps={self.adam_eps} > 0")
        self.optimizer_precision()  # validates the dtypes
        self.muon_options()  # validates --optimizer and the Muon settings
        from moefold.training.optim.offload import check_offload_fraction

        check_offload_fraction(self.optimizer_offload_fraction)

    def optimizer_precision(self) -> OptimizerPrecision:
        return OptimizerPrecision(main_grads_dtype=self.main_grads_dtype, main_params_dtype=self.main_params_dtype,
                                  exp_avg_dtype=self.exp_avg_dtype, exp_avg_sq_dtype=self.exp_avg_sq_dtype)

    def muon_options(self) -> MuonOptions | None:
        """Muon's settings (None with ``--optimizer adam``); refuses what Muon cannot run with."""
        if self.optimizer_type not in ("adam", "muon"):
            raise ValueError(f"--optimizer={self.optimizer_type!r}; valid: adam, muon")
        if self.qk_clip and self.optimizer_type != "muon":
            raise ValueError("--qk-clip (MuonClip) needs --optimizer muon")
        if not (self.qk_clip_threshold > 0 and 0 <= self.qk_clip_alpha <= 1):
            raise ValueError(f"need --qk-clip-threshold={self.qk_clip_threshold} > 0 and 0 <= "
                             f"--qk-clip-alpha={self.qk_clip_alpha} <= 1")
        if self.optimizer_type == "adam":
            return None
        if self.use_torch_fsdp2 or self.optimizer_cpu_offload:
            raise ValueError(f"--optimizer muon cannot be combined with "
                             f"{'--use-torch-fsdp2' if self.use_torch_fsdp2 else '--optimizer-cpu-offload'}: Muon "
                             "updates whole matrices on the distributed optimizer's owning rank; drop that flag")
        from moefold.training.optim.muon import MuonOptions
        from moefold.training.optim.newton_schulz import ScaleMode, TPMode

        for name, enum in (("muon_scale_mode", ScaleMode), ("muon_tp_mode", TPMode)):
            valid = [m.value for m in enum]
            if getattr(self, name) not in valid:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)!r}; valid: {', '.join(valid)}")
        return MuonOptions(momentum=self.muon_momentum, use_nesterov=self.muon_use_nesterov,
                           num_ns_steps=self.muon_num_ns_steps, coefficient_type=self.muon_coefficient_type,
                           scale_mode=ScaleMode(self.muon_scale_mode), extra_scale_factor=self.muon_extra_scale_factor,
                           tp_mode=TPMode(self.muon_tp_mode), fp32_matmul_prec=self.muon_fp32_matmul_prec)


@dataclass(frozen=True)
class ScheduleConfig:
    """The steps and the learning rate of each (``LRSchedule`` checks the warmup and decay lengths)."""

    # defaults: the README's first command (a *_tiny recipe on the built-in corpus, a few CPU minutes)
    train_iters: int = flag(250, "optimizer steps of the whole run (a resumed run counts the steps already done)")
    lr: float = flag(3e-3, "peak learning rate")
    min_lr: float = flag(3e-4, "learning rate at the end of the decay")
    lr_warmup_iters: int = flag(20, "steps of linear warmup from 0")
    lr_decay_style: str = flag("cosine", "learning-rate decay after the warmup (WSD: constant, then "
                               "--lr-wsd-decay-iters of decay)", choices=DECAY_STYLES)
    lr_decay_iters: int | None = flag(None, "steps over which the learning rate decays (default: --train-iters)")
    lr_wsd_decay_iters: int = flag(0, "--lr-decay-style WSD: the steps of the final decay")
    lr_wsd_decay_style: str = flag("linear", "the shape of WSD's final decay", choices=WSD_STYLES)
    lr_warmup_init: float = flag(0.0, "learning rate of step 0; warmup is lr-warmup-init + (lr - lr-warmup-init) * "
                                 "step / warmup (Megatron's; default 0)")
    lr_warmup_skip_zero: bool = flag(False, "moefold's earlier warmup, lr * (step + 1) / warmup: the first step "
                                     "already learns", action="store_true")

    def __post_init__(self) -> None:
        positive_ints(self, "train_iters")
        finite_non_negative(self, "lr", "min_lr")
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style={self.lr_decay_style!r}; valid: {', '.join(DECAY_STYLES)}")
        if self.lr_wsd_decay_style not in WSD_STYLES:
            raise ValueError(f"--lr-wsd-decay-style={self.lr_wsd_decay_style!r}; valid: {', '.join(WSD_STYLES)}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= --min-lr={self.min_lr} <= --lr={self.lr}")
        self.lr_schedule()  # validates warmup/decay lengths

    def lr_schedule(self) -> LRSchedule:
        return LRSchedule(lr=self.lr, min_lr=self.min_lr, warmup_iters=self.lr_warmup_iters,
                          decay_iters=self.lr_decay_iters or self.train_iters, style=self.lr_decay_style,
                          wsd_decay_iters=self.lr_wsd_decay_iters, wsd_decay_style=self.lr_wsd_decay_style,
                          warmup_init=self.lr_warmup_init, warmup_skip_zero=self.lr_warmup_skip_zero)


@dataclass(frozen=True)
class DataConfig:
    """What each step reads. Batch sizes are in samples of ``seq_length`` tokens; ``global_batch_size`` =
    ``micro_batch_size * dp * num_micro_batches`` (checked against the layout by ``RunConfig.resolve``)."""

    micro_batch_size: int = flag(4, "samples per micro-batch on each data-parallel rank")
    global_batch_size: int = flag(8, "samples per optimizer step, all ranks together (gradient accumulation fills the"
                                  " rest)")
    seq_length: int = flag(256, "tokens per sample")
    # routing replay (training.routing_replay; the file: training.routing_file)
    moe_routing_replay_file: str | None = flag(None, "replay recorded expert choices: sample n routes each MoE layer's "
                                               "tokens to this safetensors file's ids for sample n (recorded by "
                                               "record_routing), the router's probabilities recomputed at them",
                                               metavar="FILE")
    data_path: tuple[str, ...] = flag((), "PREFIX or W1 PREFIX1 W2 PREFIX2 ... (prepared with `moefold "
                                      "prepare-data`); default: built-in corpus", nargs="+")
    vocab_size: int | None = flag(None, "vocabulary of the built-in corpus (and the model); default: the recipe's")
    data_cache_dir: str | None = flag(None, "where the built-in corpus is tokenised and cached (default: "
                                      "~/.cache/moefold)")
    data_order: str = flag("moefold", "moefold (default): sample i never depends on --train-iters, so a longer run "
                           "continues a shorter one; megatron: Megatron-Core GPTDataset's exact samples for the same "
                           "--data-path, --split (default 969,30,1 as Megatron-LM), --seed, --seq-length, "
                           "--train-iters, --global-batch-size, --eval-interval and --eval-iters", choices=DATA_ORDERS)
    mid_level_dataset_surplus: float = flag(0.005, "--data-order megatron: Megatron's extra samples per blended "
                                            "corpus")
    # Megatron-LM's tokenizer flags (training.data.megatron_tokenizer): the model's vocabulary and SAVE/hf_assets
    tokenizer_type: str | None = flag(None, "the run's tokenizer (through HF tokenizers): the model's vocabulary "
                                      "(padded as Megatron pads it) and the tokenizer exports and `moefold generate` "
                                      "use", choices=TOKENIZER_TYPES)
    tokenizer_model: str | None = flag(None, "HuggingFaceTokenizer: a directory with tokenizer.json")
    vocab_file: str | None = flag(None, "GPT2BPETokenizer: vocab.json")
    merge_file: str | None = flag(None, "GPT2BPETokenizer: merges.txt")
    make_vocab_size_divisible_by: int = flag(128, "pad the tokenizer's vocabulary to a multiple of this x tp "
                                             "(Megatron's; default 128)")
    # documents packed in a sample, split at the tokenizer's end-of-document token (Megatron's flags, off by default;
    # moefold.dense.documents): attention inside each one through block kernels, never an [S, S] mask
    reset_position_ids: bool = flag(False, "positions restart at 0 after each end-of-document token",
                                    action="store_true")
    reset_attention_mask: bool = flag(False, "attention (and Gated DeltaNet's convolution and recurrence) stays inside "
                                      "each document of a packed sample", action="store_true")
    eod_mask_loss: bool = flag(False, "no loss where the input token is the end-of-document token (the prediction "
                               "across a document boundary)", action="store_true")
    reset_data_position: bool = flag(False, "allow resuming with another --data-path, --seq-length or --seed: the "
                                     "data position restarts at the first sample of the new order", action="store_true")
    # validation (training.evaluate): with --split or --valid-data-path
    split: str | None = flag(None, "train,valid,test shares of the documents of each --data-path corpus, e.g. "
                             "969,30,1 (Megatron)")
    valid_data_path: tuple[str, ...] = flag((), "a separate validation corpus: PREFIX or W1 PREFIX1 W2 PREFIX2 ...",
                                            nargs="+")
    eval_interval: int | None = flag(None, "validate every N steps (default: only at the end; needs --split or "
                                     "--valid-data-path)")
    eval_iters: int = flag(10, "global batches per validation")
    skip_train: bool = flag(False, "validation only (Megatron's flag): evaluate the --load checkpoint (or the "
                            "initialisation) on --split / --valid-data-path, train nothing, save nothing",
                            action="store_true")

    def __post_init__(self) -> None:
        for name in ("data_path", "valid_data_path"):   # a list after a JSON / YAML round trip
            object.__setattr__(self, name, tuple(getattr(self, name) or ()))
        positive_ints(self, "micro_batch_size", "global_batch_size", "seq_length")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"--global-batch-size={self.global_batch_size} is not a multiple of "
                             f"--micro-batch-size={self.micro_batch_size}")
        positive_int_or_none("--eval-interval", self.eval_interval)
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
        if self.data_order not in DATA_ORDERS:
            raise ValueError(f"--data-order={self.data_order!r}; valid: {', '.join(DATA_ORDERS)}")
        if not 0 <= self.mid_level_dataset_surplus < float("inf"):
            raise ValueError(f"--mid-level-dataset-surplus={self.mid_level_dataset_surplus} must be >= 0")

    @property
    def packs_documents(self) -> bool:
        """Samples are split into documents at the end-of-document token (any of the three document flags)."""
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss

    @property
    def has_validation(self) -> bool:
        """Validation data is configured (``--split`` or ``--valid-data-path``)."""
        return self.split is not None or bool(self.valid_data_path)


@dataclass(frozen=True)
class PrecisionConfig:
    """The parameters' and activations' dtype, and fp16's loss scaling (Megatron's defaults)."""

    bf16: bool = flag(False, "bf16 parameters and compute, fp32 master weights", action="store_true")
    fp16: bool = flag(False, "fp16 parameters and compute, fp32 master weights, loss scaling (dynamic unless "
                      "--loss-scale)", action="store_true")
    loss_scale: float | None = flag(None, "fp16: a static loss scale (a power of 2 helps); default: dynamic loss "
                                    "scaling")
    initial_loss_scale: float = flag(2.0 ** 32, "fp16 dynamic loss scaling: the starting scale")
    min_loss_scale: float = flag(1.0, "fp16 dynamic loss scaling: the smallest scale")
    loss_scale_window: int = flag(1000, "fp16 dynamic loss scaling: steps without overflow before the scale doubles")
    hysteresis: int = flag(2, "fp16 dynamic loss scaling: overflowing steps in a row before the scale halves")

    def __post_init__(self) -> None:
        positive_ints(self, "loss_scale_window", "hysteresis")
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 exclude each other; choose one")
        if self.fp16:
            self.loss_scaler()  # validates the loss-scale flags

    def loss_scaler(self) -> LossScaler | None:
        """The fp16 loss scaler the flags describe (None without ``--fp16``)."""
        if not self.fp16:
            return None
        if self.loss_scale is not None:
            return LossScaler(scale=self.loss_scale, dynamic=False, min_scale=min(self.min_loss_scale, self.loss_scale))
        return LossScaler(scale=self.initial_loss_scale, min_scale=self.min_loss_scale,
                          growth_interval=self.loss_scale_window, hysteresis=self.hysteresis)


@dataclass(frozen=True)
class ExecutionConfig:
    """How the steps run: the pipeline schedule and split, the batch-level overlap, compile, fused gradients."""

    pipeline_schedule: str = flag("1f1b", "pp > 1 (interleaved is implied by virtual stages; zb-h1: zero-bubble 1F1B;"
                                  " zbv and dualpipev: 2 chunks per rank in V placement, set "
                                  "--num-layers-per-virtual-pipeline-stage to num_layers / (2 pp))", choices=SCHEDULES)
    overlap_moe_expert_parallel_comm: bool = flag(False, "hide the expert exchange: one micro-batch's "
                                                  "dispatch/combine in flight while another micro-batch computes "
                                                  "(gradient accumulation at pp = 1, interleaved 1F1B's steady state "
                                                  "at pp > 1); needs ep > 1 and the alltoall or flex dispatcher; one "
                                                  "more micro-batch's activations in flight", action="store_true")
    delay_wgrad_compute: bool = flag(False, "with --overlap-moe-expert-parallel-comm: run the experts' and "
                                     "attention's weight-gradient GEMMs while the next dispatch/combine backward "
                                     "exchange is in flight", action="store_true")
    num_layers_per_virtual_pipeline_stage: int | None = flag(None, "pp > 1: virtual stages of M layers per rank "
                                                             "(interleaved 1F1B schedule)")
    decoder_first_pipeline_num_layers: int | None = flag(None, "pp > 1: layers on the first stage (it also holds the "
                                                         "embedding); default: even split")
    decoder_last_pipeline_num_layers: int | None = flag(None, "pp > 1: layers on the last stage (it also holds the "
                                                        "head, loss and MTP); default: even split")
    pipeline_model_parallel_layout: str | None = flag(None, "Megatron's layout of every virtual stage, round robin "
                                                      "over pp then vpp: E embedding, t decoder layer, m MTP layer, L"
                                                      " loss, | stage boundary, x*N / (...)*N repetition, e.g. "
                                                      "'Et|(tt|)*30mL' (DeepSeek-V3, PP8 x VP4); fixes vpp, empty "
                                                      "stages allowed; replaces the three flags above",
                                                      metavar="LAYOUT")
    compile: bool = flag(False, "torch.compile each transformer block (MoE: its static-shaped parts, the experts' "
                         "activation fused); compile time is printed", action="store_true")
    gradient_accumulation_fusion: bool = flag(True, "weight-gradient GEMMs write (first micro-batch) or add (later "
                                              "ones) straight into the fp32 main-grad buffer: no per-step zeroing "
                                              "pass, no separate gradient to add (--no-gradient-accumulation-fusion: "
                                              "autograd's gradients added into a zeroed buffer)", action="optional")
    # CUDA graphs (execution.cuda_graph, execution.step_graph; docs/memory.md): Megatron-Core 0.18's flags
    cuda_graph_impl: str = flag("none", "capture CUDA graphs: local (torch's make_graphed_callables per "
                                "--cuda-graph-modules scope), transformer_engine (the same scopes through TE's), "
                                "full_iteration (every micro-batch's forward and backward of a step in one graph; the "
                                "optimizer outside); refused in one line where a part syncs with the host or changes "
                                "shape", choices=CUDA_GRAPH_IMPLS)
    cuda_graph_modules: tuple[str, ...] = flag((), "local/transformer_engine: the scopes captured in every layer "
                                               "(default: the whole layer): attn, mlp (dense MLP), moe (the whole "
                                               "MoE layer: padded/capacity or sync-free flex dispatch only), "
                                               "moe_router, moe_preprocess (with moe_router)", nargs="+",
                                               choices=CUDA_GRAPH_MODULES)
    cuda_graph_warmup_steps: int = flag(3, "eager steps (calls of each scope) before the capture")
    # the expert-load max/mean the plan sized the experts' activations for (training.observe.imbalance)
    moe_max_load_ratio: float | None = flag(None, "the expert-load max/mean the plan sized the routed experts' "
                                            "activations for (moefold plan --moe-max-load-ratio): the run reports the"
                                            " observed one per micro-batch and warns once before it is exceeded")

    def __post_init__(self) -> None:
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
        self._check_cuda_graphs()
        from moefold.training.observe.imbalance import check_max_load_ratio

        check_max_load_ratio(self.moe_max_load_ratio)

    def _check_cuda_graphs(self) -> None:
        object.__setattr__(self, "cuda_graph_modules", tuple(self.cuda_graph_modules))
        impl, modules = self.cuda_graph_impl, tuple(self.cuda_graph_modules)
        if impl not in CUDA_GRAPH_IMPLS:
            raise ValueError(f"--cuda-graph-impl={impl!r}; valid: {', '.join(CUDA_GRAPH_IMPLS)}")
        bad = [m for m in modules if m not in CUDA_GRAPH_MODULES]
        if bad:
            raise ValueError(f"--cuda-graph-modules {' '.join(map(str, bad))}: valid: {', '.join(CUDA_GRAPH_MODULES)}")
        if modules and impl not in ("local", "transformer_engine"):
            raise ValueError(f"--cuda-graph-modules {' '.join(modules)} needs --cuda-graph-impl local or "
                             f"transformer_engine (got {impl}; full_iteration captures the whole step)")
        if "moe" in modules and {"moe_router", "moe_preprocess"} & set(modules):
            raise ValueError("--cuda-graph-modules moe already captures the router and the dispatch preprocessing: "
                             "give moe, or moe_router (moe_preprocess)")
        if "moe_preprocess" in modules and "moe_router" not in modules:
            raise ValueError("--cuda-graph-modules moe_preprocess must be paired with moe_router (as in Megatron)")
        if not isinstance(self.cuda_graph_warmup_steps, int) or self.cuda_graph_warmup_steps < 1:
            raise ValueError(f"--cuda-graph-warmup-steps={self.cuda_graph_warmup_steps!r} must be an integer >= 1 "
                             "(the eager steps record the static inputs)")
        if impl != "none" and (self.gradient_accumulation_fusion or self.compile):
            raise ValueError(f"--cuda-graph-impl {impl} cannot be combined with "
                             + ("--gradient-accumulation-fusion (on by default): the fused GEMMs decide on the host "
                                "whether to write or add each micro-batch, state a replay does not update (pass "
                                "--no-gradient-accumulation-fusion)" if self.gradient_accumulation_fusion else
                                "--compile: torch.compile's own graphs and guards run outside a captured graph"))
        if impl != "none" and (self.overlap_moe_expert_parallel_comm or self.pipeline_schedule in
                               ("zb-h1", "zbv", "dualpipev")):
            raise ValueError(f"--cuda-graph-impl {impl} cannot be combined with the batch-level overlap or a "
                             "zero-bubble schedule: several micro-batches' activations would share one graph's "
                             "static buffers, and split backward runs weight gradients outside it")


__all__ = ["DATA_ORDERS", "EXIT_SIGNALS", "STOP_SIGNALS", "flag", "CheckpointConfig", "DataConfig",
           "ExecutionConfig", "LoggingConfig", "OptimizerConfig", "PrecisionConfig", "ScheduleConfig"]

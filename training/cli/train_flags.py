"""``moefold train``'s flags (Megatron-LM's names), in argparse groups: the layout, the optimizer and schedule, data
and checkpoints, recovery (stops, background saves, other runs), memory (activation offloading, FSDP2, optimizer
offload), starting weights and validation; the model flags (``training.cli.model_flags``), the router flags
(``ROUTER_FLAGS``: each overrides one ``ModelConfig`` field) and the flags for Megatron-LM users (data order,
tokenizer, a Megatron checkpoint, conventions: ``training.cli.megatron_flags``) join them. ``training.cli.train``
turns the parsed flags into a ``RunConfig``.
"""

from __future__ import annotations

import argparse

from moefold.dense.activation_offload import MIN_OFFLOADED_TENSOR_SIZE, OFFLOAD_MODULES
from moefold.dense.context_parallel import CP_COMM_MODES
from moefold.dense.gated_delta_rule import GATED_DELTA_RULE_BACKENDS
from moefold.dense.recompute import DEFAULT_RECOMPUTE_MODULES, RECOMPUTE_METHODS, RECOMPUTE_MODES, RECOMPUTE_MODULES
from moefold.dispatch.config import DispatcherKind
from moefold.dispatch.flex_backend import FlexBackend
from moefold.models.options import DEEPEP_MODES, ModelOptions
from moefold.models.recipes import RECIPES
from moefold.moe.gemm import GemmBackend
from moefold.pipeline.schedules import SCHEDULES
from moefold.training.cli.fp8_flags import add_fp8_arguments
from moefold.training.cli.megatron_flags import add_megatron_arguments
from moefold.training.cli.model_flags import add_model_arguments
from moefold.training.cli.train_checks import check_backends as check_backends
from moefold.training.cli.train_checks import validate_layout as validate_layout
from moefold.training.cli.train_help import ROUTER_HELP, TRAIN_HELP
from moefold.training.config import EXIT_SIGNALS, STOP_SIGNALS, TrainConfig
from moefold.training.optim.lr_schedule import DECAY_STYLES, WSD_STYLES
from moefold.training.optim.muon import MATMUL_PRECISIONS
from moefold.training.optim.newton_schulz import COEFFICIENTS, ScaleMode, TPMode
from moefold.training.optim.precision import DTYPES

_T = TrainConfig()


# Router flags (Megatron-LM names) -> the ModelConfig field they override; unset keeps the recipe's.
ROUTER_FLAGS: tuple[tuple[str, str, type], ...] = (
    ("--moe-router-score-function", "moe_score_function", str),
    ("--moe-router-pre-softmax", "moe_pre_softmax", bool),
    ("--moe-router-topk-scaling-factor", "moe_topk_scaling_factor", float),
    ("--moe-router-num-groups", "moe_num_groups", int),
    ("--moe-router-group-topk", "moe_group_topk", int),
    ("--moe-router-load-balancing-type", "moe_load_balancing_type", str),
    ("--moe-z-loss-coeff", "moe_z_loss_coeff", float),
    ("--moe-input-jitter-eps", "moe_input_jitter_eps", float),
    ("--moe-router-dtype", "moe_router_dtype", str),
    ("--moe-router-enable-expert-bias", "moe_expert_bias", bool),
    ("--moe-router-bias-update-rate", "moe_bias_update_rate", float),
    ("--moe-expert-capacity-factor", "moe_expert_capacity_factor", float),
    ("--moe-expert-rank-capacity-factor", "moe_expert_rank_capacity_factor", float),
    ("--moe-token-drop-policy", "moe_token_drop_policy", str),
    ("--moe-pad-expert-input-to-capacity", "moe_pad_expert_input_to_capacity", bool),
    ("--moe-router-force-load-balancing", "moe_router_force_load_balancing", bool),
    ("--moe-apply-probs-on-input", "moe_apply_probs_on_input", bool),
)


# router flags that change what the model computes (not only how it is trained): refused with --load-hf
ARCH_ROUTER_FIELDS = frozenset({"moe_score_function", "moe_pre_softmax", "moe_topk_scaling_factor", "moe_num_groups",
                                "moe_group_topk", "moe_expert_bias"})


_DEVICES = ("auto", "cpu", "cuda")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", choices=sorted(RECIPES), metavar="NAME",
                   help=f"model recipe (the base the model flags change): {', '.join(sorted(RECIPES))}")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="YAML file of flags (keys: the flags' names, e.g. tensor-model-parallel-size: 2); flags "
                        "typed on the command line override it; every run writes its own as RUN_DIR/config.yaml")
    p.add_argument("--nproc", type=int, default=1, help="local ranks to spawn when not under torchrun (default 1)")
    p.add_argument("--device", default="auto", choices=_DEVICES,
                   help="auto: one GPU per rank when CUDA is available, else the CPU (gloo between ranks)")
    g = p.add_argument_group("parallelism (ranks: tp x cp x dp x pp; experts: etp x ep x edp x pp)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="tensor parallelism (tp): attention heads and MLP columns split over tp ranks")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline parallelism (pp): the layers split into pp stages")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="pp > 1: virtual stages of M layers per rank (interleaved 1F1B schedule)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="pp > 1: layers on the first stage (it also holds the embedding); default: even split")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="pp > 1: layers on the last stage (it also holds the head, loss and MTP); default: even split")
    g.add_argument("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
                   help="Megatron's layout of every virtual stage, round robin over pp then vpp: E embedding, t "
                        "decoder layer, m MTP layer, L loss, | stage boundary, x*N / (...)*N repetition, e.g. "
                        "'Et|(tt|)*30mL' (DeepSeek-V3, PP8 x VP4); fixes vpp, empty stages allowed; replaces the "
                        "three flags above")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="context parallelism (cp): each sequence split over cp ranks (ring attention)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="expert parallelism (ep): the experts split over ep ranks (tokens all-to-all)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=1,
                   help="expert tensor parallelism (etp): each expert's FFN split over etp ranks")
    g.add_argument("--pipeline-schedule", dest="pipeline_schedule", default=_T.pipeline_schedule,
                   choices=SCHEDULES, help="pp > 1 (interleaved is implied by virtual stages; zb-h1: zero-bubble "
                                           "1F1B; zbv and dualpipev: 2 chunks per rank in V placement, set "
                                           "--num-layers-per-virtual-pipeline-stage to num_layers / (2 pp))")
    g.add_argument("--overlap-moe-expert-parallel-comm", dest="overlap_moe_expert_parallel_comm",
                   action="store_true",
                   help="hide the expert exchange: one micro-batch's dispatch/combine in flight while another "
                        "micro-batch computes (gradient accumulation at pp = 1, interleaved 1F1B's steady state at "
                        "pp > 1); needs ep > 1 and the alltoall or flex dispatcher; one more micro-batch's "
                        "activations in flight")
    g.add_argument("--delay-wgrad-compute", dest="delay_wgrad_compute", action="store_true",
                   help="with --overlap-moe-expert-parallel-comm: run the experts' and attention's weight-gradient "
                        "GEMMs while the next dispatch/combine backward exchange is in flight")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="shard activations along the sequence between TP regions (tp > 1 only; --seq-length "
                        "must then divide by tp)")
    g.add_argument("--cp-comm-type", default=ModelOptions.cp_comm, choices=CP_COMM_MODES,
                   help="context-parallel K/V exchange: p2p (ring, overlapped) or all_gather")
    add_model_arguments(p)
    add_pretrained_arguments(p)
    m = p.add_argument_group("router and run-time choices (overrides of the recipe / --load-hf model)")
    m.add_argument("--moe-aux-loss-coeff", type=float,
                   help="weight of the load-balancing loss (--moe-router-load-balancing-type); default: the recipe's")
    for flag, _, typ in ROUTER_FLAGS:
        text, choices = ROUTER_HELP[flag]
        text = f"{text}; default: the model's (--recipe or --load-hf)"
        if typ is bool:
            m.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            m.add_argument(flag, type=typ, choices=choices, help=text)
    m.add_argument("--init-method-std", type=float, default=ModelOptions.init_std,
                   help="standard deviation of the weights' normal initialisation")
    m.add_argument("--moe-token-dispatcher-type", default="auto", choices=("auto", *(k.value for k in DispatcherKind)),
                   help="how tokens reach their experts: auto (local without ep/etp, else alltoall), allgather, "
                        "alltoall, flex (DeepEP, CUDA)")
    m.add_argument("--moe-grouped-gemm-backend", default=ModelOptions.gemm_backend.value,
                   choices=[b.value for b in GemmBackend],
                   help="the experts' GEMMs: torch's grouped_mm, a per-expert loop, grouped_gemm or Transformer "
                        "Engine (te) on CUDA")
    m.add_argument("--linear-attention-backend", default=ModelOptions.linear_attention_backend,
                   choices=GATED_DELTA_RULE_BACKENDS, help="Gated DeltaNet kernel (Qwen3-Next's linear_attention "
                   "layers): torch (chunked, any device), fla (flash-linear-attention, CUDA), auto (fla on CUDA when "
                   "installed)")
    m.add_argument("--recompute-granularity", default="none", choices=RECOMPUTE_MODES,
                   help="activation recomputation: selective (--recompute-modules) or full (whole layers)")
    m.add_argument("--recompute-modules", nargs="+", default=list(DEFAULT_RECOMPUTE_MODULES), choices=RECOMPUTE_MODULES,
                   metavar="MODULE", help=f"selective: any of {', '.join(RECOMPUTE_MODULES)} (default core_attn)")
    m.add_argument("--recompute-method", default=ModelOptions.recompute_method, choices=RECOMPUTE_METHODS,
                   help="full: uniform (groups of N layers) or block (the first N layers of each pipeline chunk)")
    m.add_argument("--recompute-num-layers", type=int, default=ModelOptions.recompute_num_layers,
                   help="full: the N of --recompute-method (default 1)")
    add_memory_arguments(p)
    gpu = p.add_argument_group("GPU backends: DeepEP, FP8 (torchao, Transformer Engine)")
    gpu.add_argument("--moe-deepep-num-sms", type=int, default=ModelOptions.moe_deepep_num_sms,
                     help="SMs DeepEP's kernels take (flex dispatcher; even; default 0: DeepEP V2's "
                          "get_theoretical_num_sms, 20 with deepep-legacy)")
    gpu.add_argument("--moe-flex-dispatcher-backend", default=ModelOptions.moe_flex_dispatcher_backend.value,
                     choices=[b.value for b in FlexBackend],
                     help="the flex dispatcher's DeepEP: deepep (V2 ElasticBuffer: sync-free, JIT-built kernels), "
                          "deepep-legacy (the v1 Buffer API), auto (default: deepep when the installed DeepEP is V2)")
    gpu.add_argument("--moe-deepep-mode", default=ModelOptions.moe_deepep_mode, choices=DEEPEP_MODES,
                     help="DeepEP V2 across nodes: hybrid (default: RDMA once per node, forwarded over NVLink) or "
                          "direct (RDMA to every destination rank)")
    gpu.add_argument("--moe-deepep-cpu-sync", action=argparse.BooleanOptionalAction, default=None,
                     help="DeepEP V2: the host waits for the received counts (exact receive buffers, one host sync "
                          "per dispatch) instead of worst-case-sized ones; default: on exactly when the expert "
                          "GEMMs take host counts anyway (te, grouped_gemm, loop, FP8)")
    add_fp8_arguments(gpu)
    m.add_argument("--vocab-size", type=int, help="vocabulary of the built-in corpus (and the model); default: "
                                                   "the recipe's")
    t = p.add_argument_group("training")
    for flag, field, typ in (("--micro-batch-size", "micro_batch_size", int),
                             ("--global-batch-size", "global_batch_size", int), ("--seq-length", "seq_length", int),
                             ("--train-iters", "train_iters", int), ("--lr", "lr", float),
                             ("--min-lr", "min_lr", float), ("--lr-warmup-iters", "lr_warmup_iters", int),
                             ("--lr-decay-iters", "lr_decay_iters", int),
                             ("--lr-wsd-decay-iters", "lr_wsd_decay_iters", int),
                             ("--weight-decay", "weight_decay", float), ("--adam-beta1", "adam_beta1", float),
                             ("--adam-beta2", "adam_beta2", float), ("--adam-eps", "adam_eps", float),
                             ("--clip-grad", "clip_grad", float), ("--seed", "seed", int),
                             ("--log-interval", "log_interval", int), ("--save-interval", "save_interval", int),
                             ("--keep-last", "keep_last", int), ("--max-skipped-steps", "max_skipped_steps", int)):
        t.add_argument(flag, dest=field, type=typ, default=getattr(_T, field), help=TRAIN_HELP[field])
    t.add_argument("--lr-decay-style", dest="lr_decay_style", default=_T.lr_decay_style, choices=DECAY_STYLES,
                   help="learning-rate decay after the warmup (WSD: constant, then --lr-wsd-decay-iters of decay)")
    t.add_argument("--lr-wsd-decay-style", dest="lr_wsd_decay_style", default=_T.lr_wsd_decay_style,
                   choices=WSD_STYLES, help="the shape of WSD's final decay")
    t.add_argument("--bf16", action="store_true", help="bf16 parameters and compute, fp32 master weights")
    t.add_argument("--fp16", action="store_true",
                   help="fp16 parameters and compute, fp32 master weights, loss scaling (dynamic unless --loss-scale)")
    t.add_argument("--loss-scale", dest="loss_scale", type=float, default=None,
                   help="fp16: a static loss scale (a power of 2 helps); default: dynamic loss scaling")
    t.add_argument("--initial-loss-scale", dest="initial_loss_scale", type=float, default=_T.initial_loss_scale,
                   help=f"fp16 dynamic loss scaling: the starting scale (default {_T.initial_loss_scale:g})")
    t.add_argument("--min-loss-scale", dest="min_loss_scale", type=float, default=_T.min_loss_scale,
                   help=f"fp16 dynamic loss scaling: the smallest scale (default {_T.min_loss_scale:g})")
    t.add_argument("--loss-scale-window", dest="loss_scale_window", type=int, default=_T.loss_scale_window,
                   help=f"fp16 dynamic loss scaling: steps without overflow before the scale doubles "
                        f"(default {_T.loss_scale_window})")
    t.add_argument("--hysteresis", dest="hysteresis", type=int, default=_T.hysteresis,
                   help=f"fp16 dynamic loss scaling: overflowing steps in a row before the scale halves "
                        f"(default {_T.hysteresis})")
    t.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (MoE: its static-shaped parts, the experts' "
                        "activation fused); compile time is printed")
    t.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="reduce gradients after the backward instead of bucket by bucket during it")
    t.add_argument("--gradient-accumulation-fusion", action=argparse.BooleanOptionalAction,
                   default=_T.gradient_accumulation_fusion,
                   help="weight-gradient GEMMs write (first micro-batch) or add (later ones) straight into the fp32 "
                        "main-grad buffer: no per-step zeroing pass, no separate gradient to add "
                        "(--no-gradient-accumulation-fusion: autograd's gradients added into a zeroed buffer)")
    t.add_argument("--overlap-param-gather", action="store_true",
                   help="all-gather updated parameters during the next forward (each module waits for its own)")
    for flag, field in (("--main-grads-dtype", "main_grads_dtype"), ("--exp-avg-dtype", "exp_avg_dtype"),
                        ("--exp-avg-sq-dtype", "exp_avg_sq_dtype")):
        t.add_argument(flag, dest=field, default=getattr(_T, field), choices=tuple(DTYPES),
                       help=f"optimizer precision (default {getattr(_T, field)})")
    t.add_argument("--main-params-dtype", dest="main_params_dtype", default=_T.main_params_dtype, choices=("fp32",),
                   help="the master copy of bf16 parameters (fp32)")
    mu = p.add_argument_group("Muon (--optimizer muon: Muon for the matrices, AdamW for embeddings, output layer, "
                              "norms, routers, biases; Megatron's flags and defaults)")
    mu.add_argument("--optimizer", default=_T.optimizer, choices=("adam", "muon"), help="default adam")
    mu.add_argument("--muon-momentum", type=float, default=_T.muon_momentum, help="momentum (EMA) of Muon's SGD")
    mu.add_argument("--muon-use-nesterov", action="store_true", help="Nesterov momentum (default off)")
    mu.add_argument("--muon-num-ns-steps", type=int, default=_T.muon_num_ns_steps, help="Newton-Schulz iterations")
    mu.add_argument("--muon-coefficient-type", default=_T.muon_coefficient_type, choices=tuple(COEFFICIENTS),
                    help="Newton-Schulz coefficient set")
    mu.add_argument("--muon-scale-mode", default=_T.muon_scale_mode, choices=[m.value for m in ScaleMode],
                    help="update scale: spectral sqrt(max(rows, cols)), shape_scaling, unit_rms_norm")
    mu.add_argument("--muon-extra-scale-factor", type=float, default=_T.muon_extra_scale_factor,
                    help="multiplies the update (0.2 with spectral matches AdamW's update RMS)")
    mu.add_argument("--muon-tp-mode", default=_T.muon_tp_mode, choices=[m.value for m in TPMode],
                    help="tp-split matrices: blockwise (each block alone), duplicated (gathered, whole: equals tp=1), "
                         "distributed (Gram matrices all-reduced)")
    mu.add_argument("--muon-fp32-matmul-prec", default=_T.muon_fp32_matmul_prec, choices=MATMUL_PRECISIONS,
                    help="medium: Newton-Schulz in bf16; high/highest: in fp32")
    mu.add_argument("--qk-clip", action="store_true", help="MuonClip: after each step, scale the q and k rows of "
                    "attention heads whose largest logit passed --qk-clip-threshold (GQA without qk-norm, no cp)")
    mu.add_argument("--qk-clip-threshold", type=float, default=_T.qk_clip_threshold, help="QK-clip's logit bound")
    mu.add_argument("--qk-clip-alpha", type=float, default=_T.qk_clip_alpha,
                    help="q rows take eta^alpha, k rows eta^(1 - alpha)")
    d = p.add_argument_group("data and output")
    d.add_argument("--data-path", nargs="+", default=[], help="PREFIX or W1 PREFIX1 W2 PREFIX2 ... (prepared with "
                                                               "`moefold prepare-data`); default: built-in corpus")
    d.add_argument("--data-cache-dir", default=None,
                   help="where the built-in corpus is tokenised and cached (default: ~/.cache/moefold)")
    d.add_argument("--run-dir", default=None,
                   help="metrics, logs and reports (default: a new runs/RECIPE/TIMESTAMP per fresh run, "
                        "runs/RECIPE/latest pointing at it; a resume: its run's)")
    d.add_argument("--save", default=None, help="checkpoint directory (default RUN_DIR/checkpoints)")
    d.add_argument("--no-save", action="store_true", help="write no checkpoint")
    d.add_argument("--load", default=None, help="resume from the newest intact checkpoint in this directory (or "
                                                  "this checkpoint); must exist unless it is also --save")
    d.add_argument("--reset-data-position", action="store_true",
                   help="allow resuming with another --data-path, --seq-length or --seed: the data position restarts "
                        "at the first sample of the new order")
    d.add_argument("--no-balance-report", action="store_true", help="skip the load-balance PNGs at the end")
    d.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is only drawn when stderr is a terminal anyway)")
    add_recovery_arguments(p)
    r = p.add_argument_group("failures")
    r.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="a collective that waits longer fails (default 10)")
    r.add_argument("--heartbeat-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="--nproc: end the job, naming the rank, when a rank shows no sign of life for this long "
                        "(default 300)")
    add_validation_arguments(p)
    add_megatron_arguments(p)


def add_recovery_arguments(p: argparse.ArgumentParser) -> None:
    """Saving on preemption, background saves, and writing over another run (docs/failures.md)."""
    g = p.add_argument_group("checkpoints, stops and other runs")
    g.add_argument("--async-save", action="store_true",
                   help="write --save-interval checkpoints in the background (torch.distributed.checkpoint."
                        "async_save): training waits only for the copy to host memory; the final save waits")
    g.add_argument("--exit-signal-handler", action=argparse.BooleanOptionalAction, default=True,
                   help="on an --exit-signal every rank finishes its step, the run saves (with --save, even at "
                        "--save-interval 0) and exits 128+signal (default on)")
    g.add_argument("--exit-signal", nargs="+", default=list(EXIT_SIGNALS), metavar="SIGNAL", choices=STOP_SIGNALS,
                   help=f"the signals that stop a run that way (default {' '.join(EXIT_SIGNALS)}; any of "
                        f"{', '.join(STOP_SIGNALS)})")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="stop (and save) after this many minutes of training; exit 0")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (and save) after the first step divisible by this; exit 0")
    g.add_argument("--override-save", action="store_true",
                   help="let a fresh run write into a --save that holds another run's checkpoints (they stay; this "
                        "run never resumes from or deletes them; one of an iteration it saves is moved to "
                        "SAVE/previous/RUN_ID/)")
    g.add_argument("--override-run-dir", action="store_true",
                   help="let a fresh run write into a --run-dir that holds another run's metrics (they are moved "
                        "to RUN_DIR/previous/RUN_ID)")


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    """Past ZeRO-1 (docs/memory.md): activation offloading, FSDP2, optimizer offload."""
    g = p.add_argument_group("memory: activation offloading, FSDP, optimizer offload")
    g.add_argument("--fine-grained-activation-offloading", action="store_true",
                   help="keep what --offload-modules save for backward in (pinned) host memory, copied on side streams "
                        "and brought back one layer ahead in backward")
    g.add_argument("--offload-modules", nargs="+", default=None, choices=OFFLOAD_MODULES, metavar="MODULE",
                   help=f"with --fine-grained-activation-offloading: any of {', '.join(OFFLOAD_MODULES)} (a module is "
                        "recomputed or offloaded, not both)")
    g.add_argument("--min-offloaded-tensor-size", type=int, default=MIN_OFFLOADED_TENSOR_SIZE,
                   help=f"saved tensors with fewer elements stay on the device (default {MIN_OFFLOADED_TENSOR_SIZE})")
    g.add_argument("--moe-max-load-ratio", type=float, default=None,
                   help="the expert-load max/mean the plan sized the routed experts' activations for (moefold plan "
                        "--moe-max-load-ratio): the run reports the observed one per micro-batch and warns once "
                        "before it is exceeded")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="shard parameters, gradients and optimizer states with torch's fully_shard (FSDP2): dense "
                        "modules over dp x cp, experts over the expert data-parallel group, composed with tp, ep/etp, "
                        "pp; instead of the distributed optimizer")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="keep master weights and Adam moments of --optimizer-offload-fraction of this rank's shard in "
                        "host memory and update them on the CPU while the device starts the next step")
    g.add_argument("--optimizer-offload-fraction", type=float, default=_T.optimizer_offload_fraction,
                   help=f"with --optimizer-cpu-offload: the share offloaded, 0..1 (default "
                        f"{_T.optimizer_offload_fraction})")


def add_pretrained_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("starting weights")
    g.add_argument("--load-hf", metavar="DIR", default=None,
                   help="start from an HF model directory (or a moefold checkpoint): its config.json is the model, "
                        "its weights the starting point (each rank reads its slices); instead of --recipe")
    g.add_argument("--moe-use-upcycling", action="store_true",
                   help="--load-hf holds a dense model (Qwen3, Mistral, a moefold dense checkpoint): start from its "
                        "MoE upcycling with --num-experts / --moe-router-topk [/ --moe-ffn-hidden-size: granular]")


def add_validation_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("validation and logging")
    g.add_argument("--eval-interval", type=int, default=_T.eval_interval,
                   help="validate every N steps (default: only at the end; needs --split or --valid-data-path)")
    g.add_argument("--eval-iters", type=int, default=_T.eval_iters, help=f"global batches per validation "
                                                                         f"(default {_T.eval_iters})")
    g.add_argument("--skip-train", action="store_true",
                   help="validation only (Megatron's flag): evaluate the --load checkpoint (or the initialisation) on "
                        "--split / --valid-data-path, train nothing, save nothing")
    g.add_argument("--split", default=None, help="train,valid,test shares of the documents of each --data-path "
                                                 "corpus, e.g. 969,30,1 (Megatron)")
    g.add_argument("--valid-data-path", nargs="+", default=[], help="a separate validation corpus: PREFIX or "
                                                                   "W1 PREFIX1 W2 PREFIX2 ...")
    g.add_argument("--wandb-project", default=None, help="also log to Weights & Biases (pip install wandb; "
                                                         "WANDB_MODE=offline works without network)")
    g.add_argument("--wandb-exp-name", default=None, help="W&B run name")
    g.add_argument("--wandb-save-dir", default=None, help="W&B directory (default: the run directory)")

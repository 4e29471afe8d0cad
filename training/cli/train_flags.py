"""``moefold train``'s flags (Megatron-LM's names), in argparse groups: the layout, the optimizer and schedule, data
and checkpoints, recovery (stops, background saves, other runs), memory (activation offloading, FSDP2, optimizer
offload), starting weights and validation; the model and router flags (``training.cli.model_flags``: each made
from, and setting, a ``ModelConfig`` field), the run-time flags (``training.cli.option_flags``: each a ``ModelOptions``
or flex-dispatcher field) and the flags for Megatron-LM users (data order,
tokenizer, a Megatron checkpoint, conventions: ``training.cli.megatron_flags``) join them. ``training.cli.train``
turns the parsed flags into a ``RunConfig``.
"""

from __future__ import annotations

import argparse

from moefold.dense.choices import OFFLOAD_MODULES
from moefold.models.recipes import RECIPES
from moefold.training.cli.field_flags import add_field_flags
from moefold.training.cli.fp8_flags import add_fp8_arguments
from moefold.training.cli.megatron_flags import add_megatron_arguments
from moefold.training.cli.model_flags import GROUPS, add_flags, add_model_arguments
from moefold.training.cli.option_flags import add_option_flags
from moefold.training.config import EXIT_SIGNALS, STOP_SIGNALS

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
    add_field_flags(g, ("num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                        "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout"))
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="context parallelism (cp): each sequence split over cp ranks (ring attention)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="expert parallelism (ep): the experts split over ep ranks (tokens all-to-all)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=1,
                   help="expert tensor parallelism (etp): each expert's FFN split over etp ranks")
    add_field_flags(g, ("pipeline_schedule", "overlap_moe_expert_parallel_comm", "delay_wgrad_compute"))
    add_option_flags(g, ("sequence_parallel", "cp_comm"))
    add_model_arguments(p)
    add_pretrained_arguments(p)
    m = p.add_argument_group(GROUPS["router"])
    add_flags(m, "router")   # ModelConfig's router fields (models.model_sections)
    add_option_flags(m, ("init_std", "dispatcher", "gemm_backend", "linear_attention_backend", "mamba_backend",
                         "recompute",
                         "recompute_modules", "recompute_method", "recompute_num_layers"))
    add_memory_arguments(p)
    gpu = p.add_argument_group("GPU backends: DeepEP, FP8 (torchao, Transformer Engine)")
    add_option_flags(gpu, ("flex.num_sms", "flex.backend", "flex.hybrid", "flex.cpu_sync"))
    add_fp8_arguments(gpu)
    add_field_flags(m, ("vocab_size",))
    t = p.add_argument_group("training")
    add_field_flags(t, ("micro_batch_size", "global_batch_size", "seq_length", "train_iters", "lr", "min_lr",
                        "lr_warmup_iters", "lr_decay_iters", "lr_wsd_decay_iters", "weight_decay", "adam_beta1",
                        "adam_beta2", "adam_eps", "clip_grad", "seed", "log_interval", "save_interval", "keep_last",
                        "max_skipped_steps"))
    add_field_flags(t, ("lr_decay_style", "lr_wsd_decay_style", "bf16", "fp16", "loss_scale", "initial_loss_scale",
                        "min_loss_scale", "loss_scale_window", "hysteresis", "compile"))
    t.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="reduce gradients after the backward instead of bucket by bucket during it")
    add_field_flags(t, ("gradient_accumulation_fusion", "overlap_param_gather"))
    add_field_flags(t, ("cuda_graph_impl", "cuda_graph_modules", "cuda_graph_warmup_steps"))
    add_field_flags(t, ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype"))
    mu = p.add_argument_group("Muon (--optimizer muon: Muon for the matrices, AdamW for embeddings, output layer, "
                              "norms, routers, biases; Megatron's flags and defaults)")
    add_field_flags(mu, ("optimizer_type", "muon_momentum", "muon_use_nesterov", "muon_num_ns_steps",
                         "muon_coefficient_type", "muon_scale_mode", "muon_extra_scale_factor", "muon_tp_mode",
                         "muon_fp32_matmul_prec", "qk_clip", "qk_clip_threshold", "qk_clip_alpha"))
    d = p.add_argument_group("data and output")
    add_field_flags(d, ("data_path", "data_cache_dir", "moe_routing_replay_file", "reset_position_ids",
                        "reset_attention_mask", "eod_mask_loss"))
    d.add_argument("--run-dir", default=None,
                   help="metrics, logs and reports (default: a new runs/RECIPE/TIMESTAMP per fresh run, "
                        "runs/RECIPE/latest pointing at it; a resume: its run's)")
    add_field_flags(d, ("save",))
    d.add_argument("--no-save", action="store_true", help="write no checkpoint")
    add_field_flags(d, ("load", "reset_data_position"))
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
    add_field_flags(g, ("async_save",))
    g.add_argument("--exit-signal-handler", action=argparse.BooleanOptionalAction, default=True,
                   help="on an --exit-signal every rank finishes its step, the run saves (with --save, even at "
                        "--save-interval 0) and exits 128+signal (default on)")
    g.add_argument("--exit-signal", nargs="+", default=list(EXIT_SIGNALS), metavar="SIGNAL", choices=STOP_SIGNALS,
                   help=f"the signals that stop a run that way (default {' '.join(EXIT_SIGNALS)}; any of "
                        f"{', '.join(STOP_SIGNALS)})")
    add_field_flags(g, ("exit_duration_in_mins", "exit_interval"))
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
    add_option_flags(g, ("min_offloaded_tensor_size",))
    add_field_flags(g, ("moe_max_load_ratio", "use_torch_fsdp2", "optimizer_cpu_offload", "optimizer_offload_fraction"))


def add_pretrained_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("starting weights")
    add_field_flags(g, ("load_hf", "moe_use_upcycling"))


def add_validation_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("validation and logging")
    add_field_flags(g, ("eval_interval", "eval_iters", "skip_train", "split", "valid_data_path", "wandb_project",
                        "wandb_exp_name", "wandb_save_dir"))

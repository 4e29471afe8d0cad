"""Megatron-LM's checkpoints as Megatron-LM (core_v0.16.1) writes and reads them, from megatron-core's own code.

megatron-core (the test extra) has ``GPTModel``, its ``sharded_state_dict``, the optimizers and
``dist_checkpointing``, but not Megatron-LM's ``megatron.training``; these helpers do what its pieces do, read
from core_v0.16.1's sources:

- ``lm_args(**changes)``: the ``args`` namespace Megatron-LM saves: every ``TransformerConfig`` field that is an
  argument (``ArgumentGroupFactory`` makes one per field since 0.16: ``args.layernorm_epsilon`` is
  ``--norm-epsilon``) at its default, the network-size and MoE arguments at theirs, then ``changes``;
- ``build_gpt(args)``: ``gpt_builders.gpt_builder`` with ``--transformer-impl local``
  (``core_transformer_config_from_args``, ``get_gpt_decoder_block_spec``, the MTP block of the last layer's spec);
- ``train_step(model, ids)``: Megatron-Core's ``DistributedDataParallel`` and ``get_megatron_optimizer`` (Adam,
  fp32: Megatron-LM's default, not the distributed optimizer) and one step, so the optimizer holds state;
- ``save_checkpoint(...)``: ``training/checkpointing.save_checkpoint`` for ``--ckpt-format torch_dist``:
  ``generate_state_dict`` (args, checkpoint_version 3.0, iteration, the model's and the optimizer's sharded state
  dicts built with ``_build_sharded_state_dict_metadata``, the scheduler, the RNG state as a ``ShardedObject``)
  saved by ``dist_checkpointing.save(..., content_metadata=...)`` under ``iter_NNNNNNN`` with the tracker file;
- ``load_checkpoint(model, root)``: ``load_checkpoint``'s model part: the content metadata read back from the
  checkpoint (``dist_checkpointing.load_content_metadata``) builds the sharded state dict that is loaded.

All run inside ranks of ``tests.distributed.run_distributed`` after ``tests.megatron_compat.init_megatron``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import random

import numpy as np
import torch

from tests.megatron_compat import causal_mask, megatron_optimizer_on_cpu

# Megatron-LM's network-size / MoE arguments outside TransformerConfig, at their core_v0.16.1 defaults
_NETWORK_DEFAULTS = {
    "group_query_attention": False, "window_size": None, "window_attn_skip_freq": None,
    "max_position_embeddings": None, "position_embedding_type": "learned_absolute", "use_rotary_position_embeddings":
    False, "rotary_base": 10000, "rotary_percent": 1.0, "rotary_seq_len_interpolation_factor": None,
    "use_rope_scaling": False, "rope_scaling_factor": 8.0, "no_rope_freq": None, "add_position_embedding": True,
    "make_vocab_size_divisible_by": 128, "openai_gelu": False, "squared_relu": False, "swiglu": False,
    "quick_geglu": False, "untie_embeddings_and_output_weights": False, "num_experts": None, "moe_layer_freq": 1,
    "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0, "spec": None,
    "heterogeneous_layers_config_path": None, "hybrid_override_pattern": None, "use_legacy_models": False,
    "transformer_impl": "local", "padded_vocab_size": None, "params_dtype": torch.float32,
}


def lm_args(**changes) -> argparse.Namespace:
    """Megatron-LM's saved ``args`` (module docstring) with ``changes``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    out = {}
    for f in dataclasses.fields(TransformerConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.init and not callable(default) and default is not dataclasses.MISSING and \
                (default is None or isinstance(default, (bool, int, float, str, enum.Enum, tuple, list))):
            out[f.name] = default
    out.pop("num_moe_experts", None)    # Megatron-LM's --num-experts
    return argparse.Namespace(**{**out, **_NETWORK_DEFAULTS, **changes})


def transformer_config(args: argparse.Namespace):
    """``core_transformer_config_from_args`` for a GPT model of the local spec (CPU: no fusions)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(TransformerConfig) if hasattr(args, f.name)}
    kw.update(num_moe_experts=args.num_experts, moe_layer_freq=args.moe_layer_freq,
              moe_router_load_balancing_type=args.moe_router_load_balancing_type,
              moe_aux_loss_coeff=args.moe_aux_loss_coeff, window_size=args.window_size,
              window_attn_skip_freq=args.window_attn_skip_freq,
              num_query_groups=args.num_query_groups if args.group_query_attention else None,
              use_cpu_initialization=True, pipeline_dtype=args.params_dtype, gradient_accumulation_fusion=False,
              masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
              persist_layer_norm=False, moe_token_dispatcher_type="allgather", moe_router_dtype="fp32")
    if args.swiglu:
        kw.update(activation_func=torch.nn.functional.silu, gated_linear_unit=True, bias_activation_fusion=False)
    elif args.quick_geglu:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        kw.update(activation_func=quick_gelu, gated_linear_unit=True, bias_activation_fusion=False)
    return TransformerConfig(**kw)


def build_gpt(args: argparse.Namespace):
    """``gpt_builder(args)`` with the local layer spec (the GPTModel Megatron-LM trains)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_decoder_layer_specs,
        get_gpt_mtp_block_spec,
    )

    config = transformer_config(args)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
    mtp = None
    if args.mtp_num_layers is not None:
        last = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization=args.normalization)[-1]
        mtp = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False)
    tied = not args.untie_embeddings_and_output_weights
    return GPTModel(config, block, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    parallel_output=True, share_embeddings_and_output_weights=tied,
                    position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                    rotary_base=args.rotary_base, mtp_block_spec=mtp)


@torch.no_grad()
def perturb(model, seed: int) -> None:
    """Norm weights around 1, biases, sinks and expert biases around 0 (the same values on every rank): a mis-mapped
    norm or bias changes the logits."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        elif name.endswith(("bias", "softmax_offset")):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
        if name.endswith("expert_bias"):
            b.copy_(0.2 * torch.randn(b.shape, generator=g))


def train_step(model, ids: torch.Tensor):
    """One Adam step of Megatron-Core's DDP + ``get_megatron_optimizer`` (fp32 Adam: Megatron-LM's default optimizer
    for an fp32 run) on the LM loss of ``ids``; returns the optimizer (holding exp_avg / exp_avg_sq)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    with megatron_optimizer_on_cpu():
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0), [ddp])
    B, S = ids.shape
    model.train()
    loss = model(ids, torch.arange(S).expand(B, S), causal_mask(S), labels=ids.roll(-1, 1))
    loss.float().mean().backward()
    ddp.finish_grad_sync()
    for inner in opt.chained_optimizers:   # the step without the grad-norm (a CUDA scalar in 0.16.1)
        inner.prepare_grads()
        inner.step_with_ready_grads()
    return opt


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The main head's logits [B, S, V], gathered over tp (eval; the output layer's last call is the main head:
    with MTP Megatron returns the losses only)."""
    B, S = ids.shape
    calls = []
    hook = model.output_layer.register_forward_hook(lambda _m, _i, out: calls.append(out[0].detach().clone()))
    model.eval()
    with torch.no_grad():
        model(ids, torch.arange(S).expand(B, S), causal_mask(S), runtime_gather_output=True,
              labels=ids if model.config.mtp_num_layers else None)
    hook.remove()
    return calls[-1].transpose(0, 1).contiguous().float()


def _content_metadata(singleton: bool) -> dict:
    """``_build_sharded_state_dict_metadata`` (fp32 Adam, not the distributed optimizer)."""
    from megatron.core import parallel_state

    return {"singleton_local_shards": singleton, "chained_optim_avoid_prefix": True,
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}


def _rng_state():
    """``get_rng_state`` for torch_dist: one ``ShardedObject`` per pp x tp rank, replicated over dp."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
              "torch_rng_state": torch.get_rng_state()}]
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    ranks = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank())
    return ShardedObject("rng_state", state, (pp, tp), ranks,
                         replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


def save_checkpoint(model, optimizer, args: argparse.Namespace, root: str, iteration: int,
                    singleton: bool = False) -> None:
    """Megatron-LM's ``save_checkpoint`` (torch_dist; module docstring) of ``model`` (and ``optimizer``) into
    ``root/iter_NNNNNNN`` and ``root/latest_checkpointed_iteration.txt``."""
    from megatron.core import dist_checkpointing

    metadata = _content_metadata(singleton)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": model.sharded_state_dict(metadata=metadata)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
        state["opt_param_scheduler"] = {"max_lr": 1e-2, "lr_warmup_steps": 0, "num_steps": iteration,
                                        "lr_decay_style": "cosine", "lr_decay_steps": 100, "min_lr": 0.0,
                                        "start_wd": 0.0, "end_wd": 0.0, "wd_incr_style": "constant",
                                        "wd_incr_steps": 100}
    state["rng_state"] = _rng_state()
    state["num_floating_point_operations_so_far"] = 0
    path = os.path.join(root, f"iter_{iteration:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    clean = {k: v for k, v in metadata.items() if k != "dp_cp_group"}
    dist_checkpointing.save(state, path, content_metadata=clean)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    torch.distributed.barrier()


def load_checkpoint(model, root: str) -> argparse.Namespace:
    """Megatron-LM's ``load_checkpoint`` of the model (as for a release checkpoint: no optimizer, no RNG): the
    tracker's iteration, the content metadata read from the checkpoint, the model's sharded state dict built with it,
    ``dist_checkpointing.load``; returns the checkpoint's args."""
    from megatron.core import dist_checkpointing, parallel_state

    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        it = f.read().strip()
    path = os.path.join(root, "release" if it == "release" else f"iter_{int(it):07d}")
    common = dist_checkpointing.load_common_state_dict(path)
    metadata = dict(dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {})
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    state = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, path)
    model.load_state_dict(state["model"])
    return common["args"]

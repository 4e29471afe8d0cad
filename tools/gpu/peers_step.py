"""The training step of ``python -m moefold.tools.gpu.peers step``: one optimizer step of the same model and
weights, ``--batch`` x ``--seq`` tokens, timed as ``bench.device_time`` times everything: moefold's
``Trainer.train_step`` (bf16 parameters and compute, fp32 master weights and main grads, distributed AdamW, clip,
the recipe's balancing loss) against HF's CausalLM of ``models.hf.config_map.to_hf_config`` (grouped_mm experts,
SDPA attention, router aux loss with the same coefficient) cast to bf16, ``clip_grad_norm_`` and
``torch.optim.AdamW(fused=True)`` over its bf16 parameters (``benchmarks/train_step.py --bf16``'s reference). HF starts
from moefold's weights after moefold's timed steps. TorchTitan's training step is not built: its model runs through
its own trainer and job config.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch
from torch import Tensor, nn

from moefold.models.config import ModelConfig
from moefold.models.hf.config_map import to_hf_config
from moefold.models.hf.exporter import hf_tensors
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelDims
from moefold.tools.gpu.bench import device_time
from moefold.tools.gpu.peers import Table, Unavailable, cell_error, free_cache, ratio, versions


def hf_causal_lm(config: ModelConfig, state: dict[str, Tensor], dtype: torch.dtype, device: str) -> nn.Module:
    """transformers' CausalLM of ``config`` (grouped_mm experts, SDPA, router aux loss as the recipe's coefficient)
    holding ``state`` (HF names; empty: HF's own init), in ``dtype`` on ``device``."""
    if importlib.util.find_spec("transformers") is None:
        raise Unavailable("not installed: transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**to_hf_config(config))
    hf_config._attn_implementation = "sdpa"
    hf_config._experts_implementation = "grouped_mm"
    hf_config.output_router_logits = config.moe_aux_loss_coeff > 0
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config)
    if state:
        model.load_state_dict(state, strict=True)
    return model.to(dtype).train()


def _moefold_train_step(config: ModelConfig, recipe: str, batch: Tensor, args: argparse.Namespace,
                  ) -> tuple[float, dict[str, Tensor]]:
    """(seconds per ``Trainer.train_step`` on ``batch``, the model's weights afterwards under HF names)."""
    from moefold.training.config import RunConfig, TrainConfig
    from moefold.training.trainer import Trainer

    B, S = batch.shape[0], batch.shape[1] - 1
    train = TrainConfig(micro_batch_size=B, global_batch_size=B, seq_length=S, train_iters=1000, lr=1e-4, min_lr=1e-5,
                        lr_warmup_iters=0, log_interval=1000, bf16=True, save=None)
    trainer = Trainer(RunConfig(model=config, options=ModelOptions(dtype="bf16"), train=train, recipe=recipe),
                      ParallelDims.single(torch.device(args.device).type), device=args.device, log=lambda _m: None)
    seconds = device_time(lambda: trainer.train_step([batch]), args.iters, args.warmup, args.device)
    return seconds, {hf_name: value.detach() for name, tensor in trainer.model.state_dict().items()
                     for hf_name, value in hf_tensors(name, tensor, config, "fused")}


def _hf_train_step(config: ModelConfig, state: dict[str, Tensor], batch: Tensor, args: argparse.Namespace) -> float:
    """Seconds per HF training step on ``batch`` (its model holding ``state``): forward with labels (HF shifts
    them; the router aux loss added), backward, clip, fused AdamW over the bf16 parameters, zero_grad."""
    hf = hf_causal_lm(config, state, torch.bfloat16, args.device)
    state.clear()
    ids = batch[:, :-1].to(args.device)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)

    def step() -> None:
        hf(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return device_time(step, args.iters, args.warmup, args.device)


def bench_step(args: argparse.Namespace) -> int:
    B, S, recipe = args.batch, args.seq, args.recipe
    deadline = time.monotonic() + args.deadline
    config = get_recipe(recipe).with_(vocab_size=args.vocab)
    print(f"training step, bf16, {B} x {S} tokens, {recipe} (vocabulary {args.vocab}); {versions()}")
    table = Table(["model", "tokens/step", "moefold ms", "HF ms", "TorchTitan ms", "moefold/HF", "moefold/TorchTitan"])
    batch = torch.randint(0, args.vocab, (B, S + 1), generator=torch.Generator().manual_seed(0))
    seconds: dict[str, float] = {}
    cells: dict[str, str] = {}
    state: dict[str, Tensor] = {}
    for who in ("moefold", "HF"):
        if time.monotonic() > deadline:
            cells[who] = f"skipped: out of time (--deadline {args.deadline:.0f} s)"
            continue
        try:   # HF starts from moefold's weights after its steps (its own init if moefold failed)
            if who == "moefold":
                seconds[who], state = _moefold_train_step(config, recipe, batch, args)
            else:
                seconds[who] = _hf_train_step(config, state, batch, args)
            cells[who] = f"{seconds[who] * 1e3:.1f}"
        except Exception as err:   # a row that reports the error; the other column still runs
            cells[who] = cell_error(err)
        free_cache(args.device)
    table.row([f"{recipe} B{B} S{S}", str(B * S), cells["moefold"], cells["HF"],
               "not built: TorchTitan's model trains through its own trainer and job config",
               ratio(seconds.get("moefold"), seconds.get("HF")), "-"])
    return 1 if table.failed else 0

"""Quantile balancing, the sqrtsoftplus score function and latent experts from the flags to a trained model:
the flags fill their fields, a run trains and moves the quantile bias once per step (and saves it), a latent model
has its projections, and the Megatron arguments round-trip while an HF export of a latent model is refused."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from moefold.models.megatron.args import config_from_megatron, megatron_args_from_config
from moefold.models.recipes import get_recipe
from moefold.training.cli.train import add_arguments, config_from_args
from moefold.training.trainer import Trainer
from tests.training.trainer_common import fit_results, tiny_config, tiny_data

QB = {"moe_load_balancing_type": "quantile_balancing", "moe_aux_loss_coeff": 0.0,
      "moe_router_quantile_balancing_ema": 0.5, "moe_score_function": "sqrtsoftplus"}


def test_flags_fill_the_fields() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args([
        "--recipe", "qwen3_moe_tiny", "--moe-router-load-balancing-type", "quantile_balancing",
        "--moe-aux-loss-coeff", "0", "--moe-router-quantile-balancing-ema", "0.5",
        "--moe-router-score-function", "sqrtsoftplus", "--moe-latent-size", "16"]))
    m = config.model
    assert (m.moe_load_balancing_type, m.moe_router_quantile_balancing_ema, m.moe_score_function,
            m.moe_latent_size) == ("quantile_balancing", 0.5, "sqrtsoftplus", 16)
    assert m.moe.router.quantile_balancing_ema == 0.5 and m.moe.latent_size == 16


def test_quantile_balancing_trains_and_moves_its_bias_once_per_step() -> None:
    trainer = Trainer(tiny_config(steps=3, recipe="qwen3_moe_tiny", model=QB), _single(), log=lambda _m: None)
    routers = list(trainer.routers.values())
    assert routers and all(r.qb_beta is not None for r in routers)
    betas, results = [], []
    trainer.fit(tiny_data(), on_step=lambda r: (results.append(r), betas.append(routers[0].qb_beta.clone())))
    assert len(results) == 3 and all(np.isfinite(r.loss_lm) for r in results)
    assert not torch.equal(betas[0], betas[1])               # updated every step
    assert abs(float(betas[-1].mean())) < 1e-6                # re-centred
    assert all(int(r.qb_beta_count) == 0 for r in routers)    # the step's sums consumed
    assert any(k.endswith("router.qb_beta") for k in trainer.model.state_dict())


def test_latent_experts_train() -> None:
    trainer = Trainer(tiny_config(steps=2, model={"moe_latent_size": 16}), _single(), log=lambda _m: None)
    names = [n for n, _ in trainer.model.named_parameters()]
    assert any("latent_down" in n for n in names) and any("latent_up" in n for n in names)
    results = fit_results(trainer, tiny_data())
    assert len(results) == 2 and all(np.isfinite(r.loss_lm) for r in results)


def test_megatron_arguments_round_trip_and_hf_refuses_latent() -> None:
    c = get_recipe("qwen3_moe_tiny").with_(moe_latent_size=16, **QB)
    args = megatron_args_from_config(c)
    assert args["moe_router_score_function"] == "sqrtsoftplus" and args["moe_latent_size"] == 16
    back = config_from_megatron(args, vocab_size=c.vocab_size, name=c.name)
    for name in ("moe_score_function", "moe_latent_size", "moe_load_balancing_type",
                 "moe_router_quantile_balancing_ema"):
        assert getattr(back, name) == getattr(c, name), name
    assert "moe_latent_size" not in megatron_args_from_config(get_recipe("qwen3_moe_tiny"))   # 0.16.1 readers
    from moefold.models.hf.config_map import to_hf_config

    with pytest.raises(ValueError, match="moe_latent_size"):
        to_hf_config(get_recipe("qwen3_moe_tiny").with_(moe_latent_size=16))


def _single():
    from moefold.parallel.dims import ParallelDims

    return ParallelDims.single()

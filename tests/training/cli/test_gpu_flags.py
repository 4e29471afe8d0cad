"""``moefold train``'s GPU-backend flags (--moe-deepep-num-sms, --fp8-format, --fp8-recipe) reach the
MoE layers, survive the run config's JSON round trip, and are refused before any rank starts
where they cannot run."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from moefold.models.layer_factory import moe_config
from moefold.parallel.dims import ParallelDims
from moefold.precision.fp8 import FP8Config
from moefold.training.cli.train import add_arguments, config_from_args, main, validate, validate_layout
from moefold.training.config import RunConfig


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--recipe", "qwen3_moe_tiny", *flags])


def test_flags_reach_the_moe_config_and_round_trip():
    run = config_from_args(_args("--moe-deepep-num-sms", "24", "--fp8-format", "hybrid", "--fp8-recipe",
                                 "tensorwise", "--fp8-backend", "te", "--moe-grouped-gemm-backend", "te"))
    want = FP8Config("hybrid", "tensorwise", backend="te")
    assert run.options.fp8 == want and run.options.moe_deepep_num_sms == 24
    again = RunConfig.from_dict(run.to_dict())
    assert again.options == run.options
    moe = moe_config(run.model, run.options, ParallelDims.single())
    assert (moe.experts.fp8, moe.dispatch.flex.num_sms, moe.experts.gemm_backend) == (want, 24, "te")
    assert config_from_args(_args()).options.fp8 == FP8Config()  # off by default


def test_impossible_choices_fail_before_ranks_start(capsys):
    with pytest.raises(ValueError, match=r"gemm backend 'te' .*not 'grouped_mm'"):
        validate(config_from_args(_args("--fp8-format", "e4m3", "--fp8-backend", "te")), 1)
    with pytest.raises(ValueError, match=r"deepep_num_sms=5 .*--moe-deepep-num-sms"):
        validate(config_from_args(_args("--moe-deepep-num-sms", "5")), 1)
    if importlib.util.find_spec("transformer_engine") is None:
        assert main(_args("--fp8-format", "e4m3", "--fp8-backend", "te", "--moe-grouped-gemm-backend", "te")) == 2
        assert "pip install" in capsys.readouterr().err
    if importlib.util.find_spec("deep_ep") is None:
        flex = ("--moe-token-dispatcher-type", "flex", "--nproc", "2", "--expert-model-parallel-size", "2")
        assert main(_args(*flex)) == 2
        assert "DeepEP V2" in capsys.readouterr().err   # auto: what a DeepEP checkout builds today
        assert main(_args(*flex, "--moe-flex-dispatcher-backend", "deepep-legacy")) == 2
        assert "DeepEP v1.2.1" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--moe-deepep-mode direct .*DeepEP V2 settings"):
        validate(config_from_args(_args("--moe-flex-dispatcher-backend", "deepep-legacy", "--moe-deepep-mode",
                                        "direct", "--moe-token-dispatcher-type", "flex")), 1)


def test_flex_backend_flags_reach_the_moe_config_and_are_stated(monkeypatch):
    """--moe-flex-dispatcher-backend / --moe-deepep-mode / --moe-deepep-cpu-sync reach MoEConfig; ``auto`` is
    resolved from the installed DeepEP (V2: deepep) before the ranks start, and stated in one line."""
    import sys

    from moefold.training.build import model_options
    from moefold.training.cli.train import resolve_flex
    from tests.dispatch import deepep_elastic_standin, deepep_standin

    flags = ("--moe-token-dispatcher-type", "flex", "--expert-model-parallel-size", "2", "--micro-batch-size", "2",
             "--seq-length", "64", "--tensor-model-parallel-size", "2", "--moe-deepep-mode", "direct",
             "--no-moe-deepep-cpu-sync")
    run = config_from_args(_args(*flags))
    assert (run.options.moe_flex_dispatcher_backend, run.options.moe_deepep_mode,
            run.options.moe_deepep_cpu_sync) == ("auto", "direct", False)
    monkeypatch.setitem(sys.modules, "deep_ep", deepep_elastic_standin.module())
    resolved, line = resolve_flex(run, 4)
    assert resolved.options.moe_flex_dispatcher_backend == "deepep"
    assert "DeepEP 2.1.0 ElasticBuffer" in line and "direct mode" in line and "sync-free" in line, line
    moe = moe_config(resolved.model, model_options(resolved), ParallelDims.single())
    assert (moe.dispatch.flex.backend, moe.dispatch.flex.hybrid, moe.dispatch.flex.cpu_sync) == ("deepep", False, False)
    assert moe.dispatch.flex.max_tokens_per_rank == 2 * 64 // 2   # micro-batch x sequence / (tp x cp)
    with pytest.raises(ValueError, match=r"DeepEP V2 needs a hidden size that is a multiple of 16.*--hidden-size 40"):
        resolve_flex(config_from_args(_args(*flags, "--hidden-size", "40")), 4)   # before any rank starts
    monkeypatch.setitem(sys.modules, "deep_ep", deepep_standin.module())   # DeepEP v1: only the legacy Buffer
    resolved, line = resolve_flex(config_from_args(_args(*flags[:-3])), 4)
    assert resolved.options.moe_flex_dispatcher_backend == "deepep-legacy" and "legacy Buffer" in line, line
    assert resolve_flex(config_from_args(_args()), 1) == (config_from_args(_args()), None)   # no flex: nothing


def test_flex_topk_over_deepep_limit_refused_naming_both_numbers(capsys):
    """DeepEP's kernels assert num_topk <= 32 on the device (intranode.cu:187, internode.cu:408, 1393); the flex
    dispatcher sends topk x etp virtual experts: refused by the layout check, exit 2, before any rank starts."""
    flags = ("--moe-token-dispatcher-type", "flex", "--nproc", "8", "--micro-batch-size", "1", "--num-experts", "16",
             "--moe-router-topk", "9",
             "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "4")
    assert main(_args(*flags)) == 2
    err = capsys.readouterr().err
    assert "--moe-router-topk x --expert-tensor-parallel-size = 9 x 4 = 36" in err and "at most 32" in err, err
    validate_layout(config_from_args(_args(*flags[:-2], "--expert-tensor-parallel-size", "2")), 8)  # 18: fine

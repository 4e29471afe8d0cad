"""FP8 settings: the flags (defined once, in ``parallel.fp8``), recipes per backend, refusals naming what
is valid, the run config's JSON round trip."""

from __future__ import annotations

import argparse
import sys

import pytest

from moefold.parallel.fp8 import FP8Config, add_fp8_arguments, fp8_config_from_args


def _parse(*flags: str) -> FP8Config:
    parser = argparse.ArgumentParser()
    add_fp8_arguments(parser)
    return fp8_config_from_args(parser.parse_args(list(flags)))


def test_defaults_and_recipes_per_backend():
    assert _parse() == FP8Config() and not FP8Config().enabled and FP8Config().backend == "torchao"
    assert _parse("--fp8-format", "hybrid") == FP8Config("hybrid", "tensorwise")   # torchao's default recipe
    assert _parse("--fp8-format", "e4m3", "--fp8-backend", "te").recipe == "delayed"  # TE's
    got = _parse("--fp8-format", "e4m3", "--fp8-recipe", "rowwise", "--fp8-exclude-modules", "output_head",
                 "layers.0.", "--moe-fp8-dispatch")
    assert got == FP8Config("e4m3", "rowwise", exclude_modules=("output_head", "layers.0."), dispatch=True)
    assert FP8Config(dispatch=True).describe() == "fp8 off, fp8 dispatch"
    assert FP8Config("hybrid").describe() == "fp8 hybrid tensorwise (torchao)"


def test_refused_with_the_valid_choices():
    with pytest.raises(ValueError, match=r"--fp8-recipe=delayed is not supported by --fp8-backend=torchao; "
                                         r"it supports tensorwise, rowwise"):
        FP8Config("hybrid", "delayed")
    with pytest.raises(ValueError, match=r"--fp8-recipe=rowwise is not supported by --fp8-backend=te; "
                                         r"it supports delayed, tensorwise, mxfp8"):
        FP8Config("e4m3", "rowwise", backend="te")
    with pytest.raises(ValueError, match=r"--fp8-backend='tao' is not one of torchao, te"):
        FP8Config("e4m3", backend="tao")
    FP8Config(None, "delayed")   # a recipe without a format is not checked: FP8 is off


def test_torchao_missing_is_named(monkeypatch):
    import moefold.parallel.fp8 as fp8

    monkeypatch.setattr(fp8, "_TORCHAO", [])
    monkeypatch.setitem(sys.modules, "torchao.float8", None)   # import fails as if not installed
    with pytest.raises(ImportError, match=r"--fp8-backend torchao needs the torchao package.*pip install torchao"):
        FP8Config("hybrid").check_available()


def test_flags_reach_the_model_and_survive_the_run_config():
    from moefold.models.layer_factory import moe_config
    from moefold.parallel.dims import ParallelDims
    from moefold.training.cli.train import add_arguments, config_from_args, validate
    from moefold.training.config import RunConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    run = config_from_args(parser.parse_args(["--recipe", "qwen3_moe_tiny", "--fp8-format", "hybrid",
                                              "--fp8-exclude-modules", "--moe-fp8-dispatch"]))
    assert run.options.fp8 == FP8Config("hybrid", exclude_modules=(), dispatch=True)
    assert RunConfig.from_dict(run.to_dict()).options == run.options
    validate(run, 1)   # torchao runs here: nothing refused
    assert moe_config(run.model, run.options, ParallelDims.single()).fp8 == run.options.fp8
    flex = config_from_args(parser.parse_args(["--recipe", "qwen3_moe_tiny", "--moe-fp8-dispatch",
                                               "--moe-token-dispatcher-type", "flex",
                                               "--moe-flex-dispatcher-backend", "deepep-legacy"]))
    # refused by the MoE layer's config itself (validate would first ask for the missing deep_ep)
    with pytest.raises(ValueError, match=r"FP8 dispatch \(--moe-fp8-dispatch\) runs with the alltoall and allgather"):
        moe_config(flex.model, flex.options, ParallelDims.single())

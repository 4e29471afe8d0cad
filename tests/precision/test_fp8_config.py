"""FP8 settings: the flags (defined once, in ``training.cli.fp8_flags``), recipes per backend, refusals naming what
is valid, the run config's JSON round trip."""

from __future__ import annotations

import argparse
import sys

import pytest

from moefold.precision.fp8 import FP8Config
from moefold.training.cli.fp8_flags import add_fp8_arguments, fp8_config_from_args


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
                                         r"it supports delayed, tensorwise, blockwise, mxfp8"):
        FP8Config("e4m3", "rowwise", backend="te")
    with pytest.raises(ValueError, match=r"--fp8-backend='tao' is not one of torchao, te"):
        FP8Config("e4m3", backend="tao")
    FP8Config(None, "delayed")   # a recipe without a format is not checked: FP8 is off


def test_torchao_missing_is_named(monkeypatch):
    import moefold.precision.fp8 as fp8

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
    assert moe_config(run.model, run.options, ParallelDims.single()).experts.fp8 == run.options.fp8
    flex = config_from_args(parser.parse_args(["--recipe", "qwen3_moe_tiny", "--moe-fp8-dispatch",
                                               "--moe-token-dispatcher-type", "flex",
                                               "--moe-flex-dispatcher-backend", "deepep-legacy"]))
    # refused by the MoE layer's config itself (validate would first ask for the missing deep_ep)
    with pytest.raises(ValueError, match=r"FP8 dispatch \(--moe-fp8-dispatch\) runs with the alltoall and allgather"):
        moe_config(flex.model, flex.options, ParallelDims.single())


def test_block_recipes_fp4_param_gather_and_padding_flags():
    assert _parse("--fp8-format", "e4m3", "--fp8-recipe", "blockwise") == FP8Config("e4m3", "blockwise")
    fp4 = _parse("--fp4-format", "nvfp4")   # the spelling; Megatron's is e2m1
    assert fp4 == _parse("--fp4-format", "e2m1") == FP8Config(fp4="e2m1") and fp4.recipe == "nvfp4" and fp4.enabled
    assert fp4.describe() == "fp4 e2m1 nvfp4 (torchao)" and fp4.align_size == 128
    got = _parse("--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--fp8-param-gather",
                 "--moe-router-padding-for-quantization")
    assert got.param_gather and got.router_padding and got.align_size == 128
    assert FP8Config("e4m3", "mxfp8").align_size == 32 and FP8Config("e4m3", "blockwise", backend="te").align_size == 16
    with pytest.raises(ValueError, match="cannot be used together"):
        FP8Config("e4m3", fp4="e2m1")
    with pytest.raises(ValueError, match="--fp8-param-gather needs one FP8 copy of each weight"):
        FP8Config("e4m3", "mxfp8", param_gather=True)
    with pytest.raises(ValueError, match="--fp8-param-gather keeps FP8 primary weights: it needs --fp8-format"):
        FP8Config(fp4="e2m1", param_gather=True)
    with pytest.raises(ValueError, match="e4m3 everywhere"):
        FP8Config("hybrid", "blockwise")
    with pytest.raises(ValueError, match="needs --fp8-format or --fp4-format"):
        FP8Config(router_padding=True)


def test_te_block_recipes_and_their_devices(monkeypatch):
    """TE's recipe objects for blockwise / mxfp8 / nvfp4, and TE's own device verdicts (the stand-in answers as TE
    does on an H100, then on a B200)."""
    from tests.moe import te_standin

    te_standin.install(monkeypatch)
    block = FP8Config("e4m3", "blockwise", backend="te")
    assert block.te_recipe() == te_standin.Float8BlockScaling(fp8_format=te_standin.Format.E4M3)
    assert FP8Config(fp4="e2m1", backend="te").te_recipe() == te_standin.NVFP4BlockScaling()
    block.check_available()   # Hopper runs block scaling
    for config, reason in ((FP8Config("e4m3", "mxfp8", backend="te"), "10.0 or higher required for MXFP8"),
                           (FP8Config(fp4="e2m1", backend="te"), "10.0 or higher required for NVFP4")):
        with pytest.raises(RuntimeError, match=reason):
            config.check_available()
        monkeypatch.setitem(te_standin.DEVICE, "capability", (10, 0))
        config.check_available()
        monkeypatch.setitem(te_standin.DEVICE, "capability", (9, 0))
    monkeypatch.setitem(te_standin.DEVICE, "cuda", 12.8)
    with pytest.raises(RuntimeError, match=r"CUDA >= 12\.9"):
        block.check_available()


def test_torchao_recipes_refused_on_gpus_without_their_tensor_cores(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    FP8Config("e4m3", "blockwise").check_device(torch.device("cuda"))
    with pytest.raises(RuntimeError, match=r"--fp8-format e4m3 --fp8-recipe mxfp8 needs compute capability 10.0\+ "
                                           r"\(Blackwell\); this GPU is 9.0; --fp8-recipe blockwise runs on Hopper"):
        FP8Config("e4m3", "mxfp8").check_device(torch.device("cuda"))
    with pytest.raises(RuntimeError, match=r"--fp4-format e2m1 --fp4-recipe nvfp4 needs compute capability 10.0"):
        FP8Config(fp4="e2m1").check_device(torch.device("cuda"))
    FP8Config(fp4="e2m1").check_device(torch.device("cpu"))   # a CPU emulates

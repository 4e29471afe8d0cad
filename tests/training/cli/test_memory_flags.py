"""``moefold train``'s memory flags (issue 30): they reach the run config, and bad input is one line, exit 2,
before any rank starts."""

from __future__ import annotations

import argparse

import pytest

from moefold.training.cli import main
from moefold.training.cli.train import add_arguments, config_from_args


def _config(*flags: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(["--recipe", "qwen3_moe_tiny", *flags]))


def test_flags_reach_the_config() -> None:
    run = _config("--fine-grained-activation-offloading", "--offload-modules", "core_attn", "attn_proj", "expert_fc1",
                  "--min-offloaded-tensor-size", "0", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5",
                  "--moe-max-load-ratio", "2", "--moe-expert-rank-capacity-factor", "1.5")
    assert run.options.offload_modules == ("core_attn", "attn_proj", "expert_fc1")
    assert run.options.min_offloaded_tensor_size == 0
    assert run.train.optimizer_cpu_offload and run.train.optimizer_offload_fraction == 0.5
    assert run.train.moe_max_load_ratio == 2.0 and run.model.moe_expert_rank_capacity_factor == 1.5
    assert _config("--use-torch-fsdp2").train.use_torch_fsdp2
    plain = _config()
    assert plain.options.offload_modules == () and not plain.train.use_torch_fsdp2
    assert not plain.train.optimizer_cpu_offload and plain.train.moe_max_load_ratio is None


@pytest.mark.parametrize(("flags", "message"), [
    (["--offload-modules", "core_attn"], "needs --fine-grained-activation-offloading"),
    (["--fine-grained-activation-offloading"], "needs --offload-modules"),
    (["--fine-grained-activation-offloading", "--offload-modules", "moe_act", "--recompute-granularity", "selective",
      "--recompute-modules", "moe_act"], "--offload-modules moe_act and --recompute-modules moe_act"),
    (["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "--compile"], "--compile with"),
    (["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5"], "--optimizer-offload-fraction=1.5"),
    (["--optimizer-offload-fraction", "0.5"], "needs --optimizer-cpu-offload"),
    (["--use-torch-fsdp2"], "--use-torch-fsdp2 with a world of one rank"),
    (["--use-torch-fsdp2", "--nproc", "2", "--optimizer-cpu-offload"], "--use-torch-fsdp2 with --optimizer-cpu-off"),
    # what issue 29's schedules cannot run with (training.config.RunConfig.memory_saver_conflict)
    (["--use-torch-fsdp2", "--nproc", "2", "--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm"],
     "--use-torch-fsdp2 cannot be combined with --overlap-moe-expert-parallel-comm"),
    (["--use-torch-fsdp2", "--nproc", "2", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"],
     "--use-torch-fsdp2 cannot be combined with --pipeline-schedule zb-h1"),
    (["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "--nproc", "2",
      "--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"],
     "--fine-grained-activation-offloading cannot be combined with --overlap-moe-expert-parallel-comm"),
    (["--use-torch-fsdp2", "--nproc", "2", "--fp16"], "--use-torch-fsdp2 cannot be combined with --fp16"),
    (["--optimizer-cpu-offload", "--fp8-format", "hybrid", "--fp8-param-gather"],
     "--optimizer-cpu-offload cannot be combined with --fp8-param-gather"),
    (["--moe-max-load-ratio", "0.5"], "--moe-max-load-ratio=0.5 must be a number >= 1"),
    (["--moe-expert-rank-capacity-factor", "0"], "expert_rank_capacity_factor=0.0 must be > 0"),
])
def test_bad_input_is_one_line_before_any_rank(flags: list[str], message: str, capsys, tmp_path) -> None:
    code = main(["train", "--recipe", "qwen3_moe_tiny", "--run-dir", str(tmp_path), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert message in err and err.count("\n") == 0, err

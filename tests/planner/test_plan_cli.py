"""``moefold plan`` with a fully fixed layout (issue 46): FP8 flags as ``moefold train`` takes them, a plan or one
line for every layout (the batch-level overlap without --distributed-optimizer), and "needs" naming what was
chosen."""

from __future__ import annotations

from moefold.training import cli

TINY = ["plan", "--recipe", "qwen3_moe_tiny", "--seq-length", "256", "--gpus", "4", "--global-batch-size", "8",
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1", "--micro-batch-size", "1"]


def test_fp8_flags_are_planned_and_printed_back(capsys) -> None:
    assert cli.main([*TINY, "--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]) == 0
    out = capsys.readouterr().out
    assert "--fp8-format e4m3 --fp8-recipe blockwise" in out, out
    assert cli.main([*TINY, "--fp4-format", "e2m1"]) == 0
    assert "--fp4-format e2m1" in capsys.readouterr().out
    assert cli.main([*TINY, "--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"]) == 2   # torchao mxfp8 is e4m3
    err = capsys.readouterr().err.strip()
    assert err.startswith("moefold plan:") and "mxfp8" in err and "\n" not in err


def test_overlap_without_a_fixed_sharding_prints_its_plan(capsys) -> None:
    """The offload rung and FSDP2 are refused with the overlap: skipped, not the layout's answer (was: exit 2 with
    activation offloading's message, unless --distributed-optimizer was given)."""
    code = cli.main([*TINY, "--overlap-moe-expert-parallel-comm"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "with zero1: fits" in captured.out and "--overlap-moe-expert-parallel-comm" in captured.out
    assert "with fsdp: not with this layout" in captured.out


def test_needs_names_the_modules_chosen(capsys) -> None:
    code = cli.main([*TINY, "--recompute-granularity", "selective", "--recompute-modules", "moe_act", "layernorm"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "fits with recompute moe_act layernorm" in out, out
    assert "core attention" not in out

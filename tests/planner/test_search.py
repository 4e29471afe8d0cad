"""``moefold plan``'s search, report and CLI on published layouts (no process is started: meta device, fake
process group).

- DeepSeek-V3 on 2048 H800 as its technical report describes it (PP16, EP64 inside 8 nodes, ZeRO-1 over DP, no
  TP) is predicted to fit in 80 GB, with the least recompute moefold needs for it;
- a MoE Parallel Folding layout (arXiv 2504.14960) of Mixtral-8x22B on 128 H100 (attention TP2 x DP8, experts
  EP8 x EDP2, PP8: the paper's text could not be read here, so this is the folded layout its abstract and
  Megatron-Core's folding describe for that model and scale, not a quoted table row) is predicted to fit;
- DeepSeek-V3 at tp1 pp1 ep8 on 8 GPUs does not fit, and the report names its largest component (the optimizer);
- the commands printed for the search's best layouts parse with ``moefold train``'s own parser into the same
  layout, batch, recompute and precision (the "exact command" promise);
- the CLI: a search on 8 GPUs prints the table and writes ``--plot``'s PNG; a fixed layout that does not fit
  exits 1 naming its largest component.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig
from moefold.planner.candidates import Fixed
from moefold.planner.cluster import CLUSTERS
from moefold.planner.profile import activation_memory
from moefold.planner.report import commands, train_flags, why_not
from moefold.planner.search import evaluate, recompute_ladder, search
from moefold.training import cli
from moefold.training.cli.train import config_from_args, validate_layout
from moefold.training.config import RunConfig, TrainConfig

GB80 = 80 * 10**9


def run_config(recipe: str, parallel: ParallelConfig, global_batch: int, **train) -> RunConfig:
    t = TrainConfig(micro_batch_size=1, global_batch_size=global_batch, seq_length=4096, bf16=True,
                    lr_warmup_iters=0, **train)
    return RunConfig(model=get_recipe(recipe), parallel=parallel, options=ModelOptions(dtype="bf16"), train=t,
                     recipe=recipe)


def least_fitting(config: RunConfig, world: int, cluster: str):
    """The plan with the least recompute that fits (evaluate over the ladder), or the leanest one."""
    plan = None
    for name, fields in recompute_ladder(config.model).items():
        planned = dataclasses.replace(config, options=dataclasses.replace(config.options, **fields))
        plan = evaluate(planned, world, CLUSTERS[cluster], 8, GB80, recompute=name)
        if plan.fits:
            break
    return plan


def test_deepseek_v3_report_layout_fits_80gb() -> None:
    # 61 layers over 16 stages: 4 per stage, 3 on the first (which also holds the embedding) and 2 on the last
    # (the head and the MTP module)
    config = run_config("deepseek_v3", ParallelConfig(pp=16, ep=64), 15360, decoder_first_pipeline_num_layers=3,
                        decoder_last_pipeline_num_layers=2)
    plan = least_fitting(config, 2048, "h800")
    assert (plan.sizes.tp, plan.sizes.pp, plan.sizes.ep, plan.sizes.dp, plan.sizes.edp) == (1, 16, 64, 128, 2)
    assert plan.fits and plan.memory.static.exact, why_not(plan)
    assert plan.memory.total <= GB80
    # the fullest stage is the first (the embedding and 3 layers), where 1F1B holds pp micro-batches; stage 1 holds
    # pp - 1. (Before the routing probs moved into the experts' activation, issue 46, the MoE layers kept their
    # routed rows once more and the last stage, head, fp32 logits and MTP with one micro-batch held, was the fullest.)
    assert (plan.memory.pp_rank, plan.memory.activations.in_flight) == (0, 16)
    assert activation_memory(plan.config, plan.sizes, 1, plan.num_micro).in_flight == 15
    assert plan.time is not None and plan.time.tokens_per_s_per_gpu > 0
    # ZeRO-1 over DP: the optimizer state is sharded (dense over dp 128, experts over edp 2)
    assert plan.memory.static.optimizer < plan.memory.static.params * 2


def test_parallel_folding_mixtral_8x22b_fits_80gb() -> None:
    config = run_config("mixtral_8x22b", ParallelConfig(tp=2, ep=8, pp=8), 256)
    plan = least_fitting(config, 128, "h100")
    assert (plan.sizes.tp, plan.sizes.dp, plan.sizes.ep, plan.sizes.edp, plan.sizes.pp) == (2, 8, 8, 2, 8)
    assert plan.fits, why_not(plan)
    assert plan.memory.total <= GB80


def test_deepseek_v3_on_8_gpus_does_not_fit_and_names_the_optimizer() -> None:
    config = run_config("deepseek_v3", ParallelConfig(ep=8), 64)
    plan = least_fitting(config, 8, "h800")
    assert not plan.fits
    assert plan.memory.largest == "optimizer"
    line = why_not(plan)
    assert "largest component: optimizer" in line and "does not fit" in line


@pytest.fixture(scope="module")
def qwen_search():
    config = run_config("qwen3_moe_30b_a3b", ParallelConfig(), 256)
    return config, search(config, 8, CLUSTERS["h200"], 8, fixed=Fixed(pp=1), top=3, exact=True)


def test_formula_search_agrees_with_the_exact_one(qwen_search) -> None:
    """The default (formula) search's best layouts fit when re-planned exactly, and rank as the exact mode's do."""
    config, exact = qwen_search
    formula = search(config, 8, CLUSTERS["h200"], 8, fixed=Fixed(pp=1), top=3)
    assert [(p.sizes, p.recompute, p.sharding) for p in formula.plans] == \
        [(p.sizes, p.recompute, p.sharding) for p in exact.plans]
    for plan in formula.plans:
        assert not plan.memory.static.exact
        assert evaluate(plan.config, 8, CLUSTERS["h200"], 8, with_time=False).fits


def test_search_ranks_fitting_plans_with_the_least_recompute(qwen_search) -> None:
    config, result = qwen_search
    assert len(result.plans) == 3 and result.valid <= result.considered and result.fitting >= 3
    speeds = [p.time.tokens_per_s_per_gpu for p in result.plans]
    assert speeds == sorted(speeds, reverse=True)
    ladder = list(recompute_ladder(config.model))
    for plan in result.plans:
        assert plan.fits and plan.memory.static.exact
        cheaper = ladder[:ladder.index(plan.recompute)]
        for name in cheaper:   # every cheaper recompute setting of the same layout does not fit
            options = dataclasses.replace(plan.config.options, **recompute_ladder(config.model)[name])
            other = evaluate(dataclasses.replace(plan.config, options=options), 8, CLUSTERS["h200"], 8,
                             with_time=False)
            assert not other.fits


def test_printed_commands_parse_into_the_same_run(qwen_search) -> None:
    _, result = qwen_search
    for plan in result.plans:
        local, launcher = commands(plan, ["--recipe", "qwen3_moe_30b_a3b"], 8)
        assert local.startswith("moefold train --nproc 8 ") and launcher.startswith("torchrun --nnodes 1")
        args = cli.build_parser("train").parse_args(["train", *train_flags(plan, ["--recipe", "qwen3_moe_30b_a3b"])])
        parsed = config_from_args(args)
        assert validate_layout(parsed, 8) == plan.sizes
        assert parsed.options.recompute == plan.config.options.recompute
        assert parsed.options.recompute_modules == plan.config.options.recompute_modules or \
            parsed.options.recompute != "selective"
        for field in ("micro_batch_size", "global_batch_size", "seq_length", "bf16", "main_grads_dtype"):
            assert getattr(parsed.train, field) == getattr(plan.config.train, field)


def test_cli_search_prints_table_and_plot(tmp_path, capsys) -> None:
    png = tmp_path / "plan.png"
    code = cli.main(["plan", "--recipe", "qwen3_moe_30b_a3b", "--gpus", "8", "--cluster", "h200",
                     "--global-batch-size", "64", "--pipeline-model-parallel-size", "1",
                     "--tensor-model-parallel-size", "1", "--top", "2", "--plot", str(png)])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, out
    assert "tok/s/GPU" in out and "#1: moefold train --nproc 8 --recipe qwen3_moe_30b_a3b" in out
    # the status lines go to stderr (a search over thousands of GPUs takes minutes), the table to stdout
    assert "moefold plan: layouts: " in captured.err and "moefold plan: memory and step times: " in captured.err
    assert "moefold plan: memory" not in out
    assert png.stat().st_size > 10_000


def test_cli_fixed_layout_that_does_not_fit(capsys) -> None:
    code = cli.main(["plan", "--recipe", "deepseek_v3", "--gpus", "8", "--cluster", "h800", "--gpu-memory", "80GB",
                     "--global-batch-size", "64", "--tensor-model-parallel-size", "1",
                     "--context-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                     "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
                     "--micro-batch-size", "1"])
    out = capsys.readouterr().out
    assert code == 1
    # under each of ZeRO-1, FSDP2 and optimizer offload; the closest (optimizer offload: its states on the host)
    assert all(f"with {s}: does not fit" in out for s in ("zero1", "fsdp", "cpu-adam")), out
    assert "does not fit" in out and "largest component: main grads" in out


def test_cli_fixed_layout_with_uneven_stages(capsys) -> None:
    # 5 layers on pp2 (as DeepSeek-V3's 61 on the report's pp16): the check takes a split the search takes and
    # prints the command that carries it, rather than refusing the layout
    code = cli.main(["plan", "--recipe", "qwen3_moe_tiny", "--num-layers", "5", "--seq-length", "256", "--gpus", "4",
                     "--global-batch-size", "8", "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
                     "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                     "--expert-tensor-parallel-size", "1", "--micro-batch-size", "1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "with zero1: fits" in captured.out
    # the searched split is printed as Megatron's layout (issue 35): pipeline.layout's standard ones for 5 on pp2
    assert "--pipeline-model-parallel-layout '" in captured.out, captured.out
    # the split fixed by moefold train's flags is the one planned (and printed); an impossible one is explained
    base = ["plan", "--recipe", "qwen3_moe_tiny", "--num-layers", "5", "--seq-length", "256", "--gpus", "4",
            "--global-batch-size", "8", "--pipeline-model-parallel-size", "2", "--top", "1"]
    assert cli.main([*base, "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "3"]) == 0
    out = capsys.readouterr().out
    assert "--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 3" in out, out
    assert "#1 layout Ett|t*3L" in out, out   # the shorthands' layout: 2 then 3
    assert cli.main([*base, "--decoder-first-pipeline-num-layers", "4", "--decoder-last-pipeline-num-layers", "4"]) == 1
    out = capsys.readouterr().out
    assert "no layout is valid" in out and "decoder" in out, out


def test_cli_bad_input_is_one_line(capsys) -> None:
    assert cli.main(["plan", "--recipe", "qwen3_moe_tiny", "--gpus", "8", "--gpu-memory", "lots"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moefold plan:") and "lots" in err and "\n" not in err


def test_cli_says_why_no_layout_is_valid_and_plans_the_nearest(capsys) -> None:
    """issue 27: ``--gpus 6 --tensor-model-parallel-size 4`` used to answer "0 valid ... no layout fits" alone."""
    code = cli.main(["plan", "--recipe", "qwen3_moe_30b_a3b", "--gpus", "6", "--tensor-model-parallel-size", "4",
                     "--global-batch-size", "48"])
    out = capsys.readouterr().out
    assert code == 1
    assert ("no layout is valid: --tensor-model-parallel-size=4 needs a multiple of 4 ranks (tp 4), but the world "
            "has 6 ranks (--gpus 6): use --gpus 8") in out
    assert "or on 6: --tensor-model-parallel-size 1 or 2" in out
    nearest = [line for line in out.splitlines() if line.startswith("nearest: ")]
    assert nearest[0].startswith("nearest: --gpus 8 --tensor-model-parallel-size 4: fits"), out
    # tp 2 on 6 GPUs: under ZeRO-1 none fits (the experts' states, 61.7 GB over 72); optimizer offload makes them fit
    assert nearest[1].startswith("nearest: --gpus 6 --tensor-model-parallel-size 2: fits"), out
    assert " cpu-adam: " in nearest[1], out
    zero1 = cli.main(["plan", "--recipe", "qwen3_moe_30b_a3b", "--gpus", "6", "--tensor-model-parallel-size", "2",
                      "--global-batch-size", "48", "--distributed-optimizer"])
    out = capsys.readouterr().out
    assert zero1 == 1 and re.search(r"\d+\.\d GB over; largest component: optimizer", out), out

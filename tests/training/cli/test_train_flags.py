"""``moefold train`` router flags reach the router config of the model they build."""

import argparse

import pytest

from moefold.models.layer_factory import router_config
from moefold.models.options import ModelOptions
from moefold.training.cli.model_flags import MODEL_FLAGS
from moefold.training.cli.train import add_arguments, config_from_args

ROUTER_FLAGS = [(e.flag, e.field, bool if e.type is None else e.type) for e in MODEL_FLAGS if e.group == "router"]


def _config(*flags: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(["--recipe", "mixtral_tiny", *flags]))


def test_unset_router_flags_keep_the_recipe():
    assert _config().model == _config("--train-iters", "3").model
    assert _config().model.moe_score_function == "softmax"


def test_router_flags_reach_the_router_config():
    run = _config("--moe-router-score-function", "sigmoid", "--moe-router-topk-scaling-factor", "2.5",
                  "--moe-z-loss-coeff", "1e-3", "--moe-input-jitter-eps", "0.01", "--moe-router-dtype", "fp64",
                  "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
                  "--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy", "position",
                  "--moe-pad-expert-input-to-capacity", "--moe-router-force-load-balancing",
                  "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01",
                  "--init-method-std", "0.01")
    router = router_config(run.model, ModelOptions(init_std=run.options.init_std))
    assert (router.score_function, router.topk_scaling_factor, router.z_loss_coeff) == ("sigmoid", 2.5, 1e-3)
    assert (router.input_jitter_eps, router.router_dtype, router.enable_expert_bias) == (0.01, "fp64", True)
    assert (router.bias_update_rate, router.expert_capacity_factor) == (0.01, 1.5)
    assert (router.token_drop_policy, router.pad_expert_input_to_capacity) == ("position", True)
    assert router.force_load_balancing and router.init_std == 0.01
    assert router.loss_coeffs() == {"seq_aux_loss": 0.01}


@pytest.mark.parametrize("flag", [f for f, _, typ in ROUTER_FLAGS if typ is bool])
def test_boolean_router_flags_can_be_turned_off(flag):
    field = next(name for f, name, _ in ROUTER_FLAGS if f == flag)
    assert getattr(_config("--no-" + flag[2:]).model, field) is False


def test_bad_router_value_names_the_field(capsys):
    with pytest.raises(ValueError, match="score_function"):
        router_config(_config().model.with_(moe_score_function="relu"), ModelOptions())
    with pytest.raises(SystemExit):   # the flag's choices refuse it first
        _config("--moe-router-score-function", "relu")
    err = capsys.readouterr().err
    assert "relu" in err and "softmax" in err and "sigmoid" in err


def test_linear_attention_backend_flag_and_refusals(capsys, monkeypatch, tmp_path):
    """--linear-attention-backend reaches the options; a hybrid layout DeltaNet's heads cannot split over, and the fla
    backend without its package, fail in one line before any rank starts."""
    from moefold.dense.gated_delta_rule import fla_available
    from moefold.training.cli import main as cli

    assert _config("--linear-attention-backend", "torch").options.linear_attention_backend == "torch"
    assert _config().options.linear_attention_backend == "auto"
    monkeypatch.setattr("moefold.training.cli.train.run_ranks", lambda *_a, **_k: pytest.fail("a rank was started"))
    base = ["train", "--recipe", "qwen3_next_tiny", "--run-dir", str(tmp_path), "--no-save", "--train-iters", "1"]
    cases = [(["--nproc", "4", "--tensor-model-parallel-size", "2", "--context-parallel-size", "2"],
              "num_key_heads=2 / tp=2 is not divisible by cp=2")]
    if not fla_available():
        cases.append((["--linear-attention-backend", "fla"], "needs the flash-linear-attention package"))
    for flags, message in cases:
        assert cli([*base, *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and err.startswith("moefold train: error:"), err


def test_fp16_loss_scaling_flags_and_refusals(capsys, monkeypatch, tmp_path):
    """--fp16 and Megatron's loss-scaling flags reach the trainer's scaler (dynamic, or static with --loss-scale);
    contradictory or out-of-range values fail in one line before any rank starts."""
    from moefold.training.cli import main as cli

    run = _config("--fp16", "--initial-loss-scale", "1024", "--min-loss-scale", "4", "--loss-scale-window", "10",
                  "--hysteresis", "3")
    assert run.train.fp16 and not run.train.bf16
    scaler = run.train.loss_scaler()
    assert (scaler.scale, scaler.dynamic, scaler.min_scale, scaler.growth_interval, scaler.hysteresis) == (
        1024.0, True, 4.0, 10, 3)
    static = _config("--fp16", "--loss-scale", "256").train.loss_scaler()
    assert (static.scale, static.dynamic) == (256.0, False)
    assert _config().train.loss_scaler() is None
    monkeypatch.setattr("moefold.training.cli.train.run_ranks", lambda *_a, **_k: pytest.fail("a rank was started"))
    base = ["train", "--recipe", "mixtral_tiny", "--run-dir", str(tmp_path), "--no-save", "--train-iters", "1"]
    for flags, message in ((["--fp16", "--bf16"], "--fp16 and --bf16 exclude each other"),
                           (["--fp16", "--min-loss-scale", "0"], "--min-loss-scale=0.0 must be > 0"),
                           (["--fp16", "--loss-scale-window", "0"], "loss_scale_window=0 must be a positive integer"),
                           (["--fp16", "--loss-scale", "-1"], "loss scale -1.0 must be a finite number > 0")):
        assert cli([*base, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and err.startswith("moefold train: error:"), err
    # DeepSeek sparse attention's indexer loss is not loss-scaled (Megatron's DSAIndexerLossAutoScaler): fp16 refused
    dsa = ["train", "--recipe", "deepseek_v32_tiny", "--run-dir", str(tmp_path), "--no-save", "--train-iters", "1"]
    assert cli([*dsa, "--fp16"]) == 2
    err = capsys.readouterr().err
    assert "--fp16 cannot train DeepSeek sparse attention" in err and err.count("\n") == 1, err


def test_v4_refuses_packed_documents(capsys, monkeypatch, tmp_path):
    """DeepSeek-V4's compressed attention reads each sample from position 0: restarted positions and documents'
    attention are refused in one line before any rank starts (the attention then checks no positions per step)."""
    from moefold.training.cli import main as cli

    monkeypatch.setattr("moefold.training.cli.train.run_ranks", lambda *_a, **_k: pytest.fail("a rank was started"))
    v4 = ["train", "--recipe", "deepseek_v4_tiny", "--run-dir", str(tmp_path), "--no-save", "--train-iters", "1"]
    for flag in ("--reset-position-ids", "--reset-attention-mask"):
        assert cli([*v4, flag]) == 2
        err = capsys.readouterr().err
        assert "pack documents, which DeepSeek-V4 cannot take" in err and err.count("\n") == 1, err


def test_mamba_backend_flag_and_refusals(capsys, monkeypatch, tmp_path):
    """--mamba-backend reaches the options; a Nemotron-H layout its Mamba-2 groups cannot split over, and the
    mamba_ssm backend without its packages, fail in one line before any rank starts."""
    from moefold.dense.mamba2_kernels import mamba_ssm_available
    from moefold.training.cli import main as cli

    assert _config("--mamba-backend", "mamba_ssm").options.mamba_backend == "mamba_ssm"
    assert _config().options.mamba_backend == "torch"
    monkeypatch.setattr("moefold.training.cli.train.run_ranks", lambda *_a, **_k: pytest.fail("a rank was started"))
    base = ["train", "--recipe", "nemotron_h_tiny", "--run-dir", str(tmp_path), "--no-save", "--train-iters", "1"]
    cases = [(["--nproc", "4", "--tensor-model-parallel-size", "2", "--context-parallel-size", "2"],
              "num_groups=2 / tp=2 is not divisible by cp=2")]
    if not mamba_ssm_available():
        cases.append((["--mamba-backend", "mamba_ssm"], "needs the mamba-ssm and causal-conv1d packages"))
    for flags, message in cases:
        assert cli([*base, *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and err.startswith("moefold train: error:"), err

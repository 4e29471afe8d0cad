"""``moefold train --config FILE`` and ``--skip-train`` (issue 27, item 6).

- a YAML file of flags (typed flags override it); each run writes ``RUN_DIR/config.yaml``, and ``moefold train
  --config RUN_DIR/config.yaml`` repeats the run: bit-identical losses;
- bad files and keys are one line naming the file and the key, exit 2;
- ``--skip-train`` validates the loaded checkpoint and trains nothing: its loss is, bit for bit, the training
  run's final validation of the same model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from moefold.training.cli import main as cli_main
from moefold.training.observe.metrics import METRICS_FILE, read_metrics
from tests.training.trainer_common import tiny_corpus

BASE = ["train", "--recipe", "qwen3_moe_tiny", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--log-interval", "1", "--device", "cpu", "--no-balance-report"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return Path(tiny_corpus(tmp_path_factory.mktemp("data") / "tiny"))


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / METRICS_FILE)]


def test_yaml_round_trip_repeats_the_run_bit_for_bit(tmp_path, data, one_thread):
    mine = tmp_path / "mine.yaml"   # what a user writes: flag names as keys, typed flags override
    mine.write_text(yaml.safe_dump({"data-path": [str(data)], "train-iters": 4, "lr": 0.01, "lr_warmup_iters": 1,
                                    "moe-aux-loss-coeff": 0.01, "seed": 7, "sequence-parallel": False,
                                    "bf16": False, "no-save": True}))
    first = tmp_path / "first"
    assert cli_main([*BASE, "--config", str(mine), "--lr", "0.004", "--run-dir", str(first)]) == 0
    written = yaml.safe_load((first / "config.yaml").read_text())
    assert written["lr"] == 0.004 and written["seed"] == 7 and written["lr-warmup-iters"] == 1   # typed wins
    assert written["data-path"] == [str(data)] and written["no-save"] is True
    assert written["sequence-parallel"] is False and "run-dir" not in written and "config" not in written
    assert written["micro-batch-size"] == 2 and written["adam-beta2"] == 0.95   # defaults too

    again = tmp_path / "again"
    assert cli_main(["train", "--config", str(first / "config.yaml"), "--run-dir", str(again)]) == 0
    assert len(_losses(first)) == 4 and _losses(again) == _losses(first)   # bit-identical, not approximately
    assert yaml.safe_load((again / "config.yaml").read_text()) == written
    def run_config(run_dir: Path) -> dict:   # the whole RunConfig each run recorded, but where it writes and
        lines = (run_dir / METRICS_FILE).read_text().splitlines()   # which run it is (a repeat is another run)
        config = next(r for r in map(json.loads, lines) if r["kind"] == "run")["config"]
        config["train"].pop("run_dir")
        config["train"].pop("run_id")
        return config

    assert run_config(again) == run_config(first)


def test_written_config_reads_back_to_the_same_flags(tmp_path):
    from moefold.training.cli.config_file import NOT_SAVED, config_args, write_effective_config
    from moefold.training.cli.train import train_parser

    parser = train_parser()
    typed = parser.parse_args(["--recipe", "deepseek_v3_tiny", "--moe-layer-freq", "([0]*1+[1]*2)", "--window-size",
                               "15,0", "--no-sequence-parallel", "--data-path", "0.3", "a", "0.7", "b", "--bf16",
                               "--recompute-modules", "core_attn", "moe_act", "--fp8-exclude-modules",
                               "--moe-router-enable-expert-bias", "--adam-eps", "1e-10", "--q-lora-rank", "none"])
    path = write_effective_config(parser, typed, tmp_path)
    again = parser.parse_args(config_args(parser, path))
    keep = lambda ns: {k: v for k, v in vars(ns).items() if k not in NOT_SAVED}
    assert keep(again) == keep(typed)
    assert again.moe_layer_freq == (0, 1, 1) and again.fp8_exclude_modules == [] and again.adam_eps == 1e-10


def test_bad_config_files_are_one_line(tmp_path, capsys):
    cases = {"lr: [0.1": "not YAML", "- 1\n- 2": "expected a mapping of flag names", "tensor-model-paralel-size: 2":
             "'tensor-model-paralel-size' is not a flag of moefold train (did you mean tensor-model-parallel-size",
             "bf16: 3": "bf16: 3 is not true or false", "train-iters: x": "argument --train-iters: invalid int value"}
    for i, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"{i}.yaml"
        path.write_text(text)
        with pytest.raises(SystemExit) as exc:
            cli_main(["train", "--recipe", "qwen3_moe_tiny", "--config", str(path)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err.strip().splitlines()[-1], (text, err)
    with pytest.raises(SystemExit):
        cli_main(["train", "--config", str(tmp_path / "missing.yaml")])
    assert "missing.yaml: no such file" in capsys.readouterr().err
    assert cli_main(["inspect", "--recipe", "qwen3_moe_tiny", "--config"]) == 0   # inspect's own --config switch
    assert "ModelConfig(" in capsys.readouterr().out


def test_skip_train_validates_the_checkpoint_and_trains_nothing(tmp_path, data, one_thread, capsys):
    common = [*BASE, "--data-path", str(data), "--split", "90,10,0", "--eval-iters", "1", "--train-iters", "3"]
    save = tmp_path / "ckpt"
    assert cli_main([*common, "--run-dir", str(tmp_path / "train"), "--save", str(save)]) == 0
    trained = read_metrics(tmp_path / "train" / METRICS_FILE, kind="valid")
    assert [v["step"] for v in trained] == [0, 3]

    capsys.readouterr()
    assert cli_main([*common, "--skip-train", "--load", str(save), "--run-dir", str(tmp_path / "eval")]) == 0
    out = capsys.readouterr().out
    assert "validation only (--skip-train), the model at step 3: lm loss" in out
    valid = read_metrics(tmp_path / "eval" / METRICS_FILE, kind="valid")
    assert [(v["step"], v["loss_lm"]) for v in valid] == [(3, trained[-1]["loss_lm"])]   # the same model, bit for bit
    assert read_metrics(tmp_path / "eval" / METRICS_FILE) == []   # no training step
    assert not (tmp_path / "eval" / "checkpoints").exists()

    assert cli_main([*BASE, "--skip-train", "--run-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--skip-train runs validation only: it needs validation data" in err and "\n" not in err


def test_config_yaml_records_the_recipes_model_so_a_changed_recipe_cannot_change_a_repeat(tmp_path, monkeypatch):
    """Issue 48 item 10: config.yaml holds every effective value, the model the recipe supplied included."""
    from moefold.models import recipes
    from moefold.training.cli.config_file import config_args, write_effective_config
    from moefold.training.cli.train import config_from_args, recorded_model, train_parser

    parser = train_parser()
    typed = ["--recipe", "deepseek_v3_tiny", "--num-experts", "8", "--moe-router-topk", "3", "--kv-lora-rank", "24",
             "--moe-aux-loss-coeff", "0.01", "--moe-router-enable-expert-bias"]
    args = parser.parse_args(typed)
    config = config_from_args(args)
    path = write_effective_config(parser, args, tmp_path, model=recorded_model(args, config))
    written = yaml.safe_load(path.read_text())
    model = written["model"]   # the nested form: every field, the MLA sizes as their own mapping
    assert model["hidden_size"] == config.model.hidden_size
    assert model["mla"]["kv_lora_rank"] == config.model.mla.kv_lora_rank
    assert model["num_experts"] == 8 and model["moe_topk"] == 3 and model["mla"]["kv_lora_rank"] == 24
    assert written["recipe"] == "deepseek_v3_tiny" and "model-json" not in written

    original = recipes.RECIPES["deepseek_v3_tiny"]
    changed = lambda: original().with_(hidden_size=2 * original().hidden_size, norm_eps=1e-5,
                                       moe_topk_scaling_factor=3.0)
    monkeypatch.setitem(recipes.RECIPES, "deepseek_v3_tiny", changed)
    assert config_from_args(parser.parse_args(typed)) != config   # the recipe did change
    again = config_from_args(parser.parse_args(config_args(parser, path)))
    assert again == config and again.model.extra == config.model.extra

    # typed flags still win over the file's model, and a bad model field is one line naming it
    over = config_from_args(parser.parse_args([*config_args(parser, path), "--hidden-size", "48"]))
    assert over.model.hidden_size == 48 and over.model.mla == config.model.mla
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"recipe": "deepseek_v3_tiny", "model": {**model, "hidden_sise": 3}}))
    with pytest.raises(ValueError, match=r"--model-json .*unknown ModelConfig fields \['hidden_sise'\]"):
        config_from_args(parser.parse_args(config_args(parser, bad)))


def test_config_file_sections_group_flags(tmp_path):
    """A --config file may group its flags in sections of any name (the nested form) or list them flat."""
    from moefold.training.cli.config_file import config_args
    from moefold.training.cli.train import train_parser

    parser = train_parser()
    nested, flat = tmp_path / "nested.yaml", tmp_path / "flat.yaml"
    nested.write_text(yaml.safe_dump({"recipe": "qwen3_moe_tiny", "parallel": {"tensor-model-parallel-size": 2,
                                                                               "expert_model_parallel_size": 2},
                                      "training": {"optimizer": {"lr": 0.01, "adam-beta2": 0.99}, "seed": 3}}))
    flat.write_text(yaml.safe_dump({"recipe": "qwen3_moe_tiny", "tensor-model-parallel-size": 2,
                                    "expert-model-parallel-size": 2, "lr": 0.01, "adam-beta2": 0.99, "seed": 3}))
    assert parser.parse_args(config_args(parser, nested)) == parser.parse_args(config_args(parser, flat))
    nested.write_text(yaml.safe_dump({"parallel": {"tensor-model-paralel-size": 2}}))
    with pytest.raises(ValueError, match=r"nested.yaml: parallel: 'tensor-model-paralel-size' is not a flag"):
        config_args(parser, nested)

"""``TrainConfig`` composed of its concerns and ``ModelOptions.flex`` (issue 44 item 1): the flat names still work
everywhere (given, read, replaced, saved), each value is checked by the section that owns it, and a run config saved
in the flat form of earlier moefold (a checkpoint's meta, metrics.jsonl) loads."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moefold.dispatch.config import FlexOptions
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.training.config import RunConfig, TrainConfig
from moefold.training.sections import DataConfig, OptimizerConfig, ScheduleConfig


def test_flat_names_reach_their_sections():
    t = TrainConfig(lr=1e-3, min_lr=1e-4, seq_length=64, adam_beta2=0.99, seed=7, exit_signals=["SIGTERM"])
    assert (t.schedule.lr, t.lr, t.data.seq_length, t.optimizer.adam_beta2, t.seed) == (1e-3, 1e-3, 64, 0.99, 7)
    assert t.exit_signals == ("SIGTERM",) and TrainConfig.lr == ScheduleConfig.lr == 3e-3   # class: the default
    nested = TrainConfig(seed=7, schedule=ScheduleConfig(lr=1e-3, min_lr=1e-4), data=DataConfig(seq_length=64),
                         optimizer=OptimizerConfig(adam_beta2=0.99), checkpoint={"exit_signals": ["SIGTERM"]})
    assert nested == t
    moved = dataclasses.replace(t, micro_batch_size=2, global_batch_size=4, lr=2e-3)
    assert (moved.micro_batch_size, moved.lr, moved.min_lr, moved.adam_beta2) == (2, 2e-3, 1e-4, 0.99)
    flat = t.flat_dict()
    # the 81 fields before the sections, Muon's 12, the routing replay file and the packed documents' 3 (issue 49),
    # the CUDA graphs' 3 (issue 50)
    assert len(flat) == len(TrainConfig.FLAT_NAMES) == 81 + 12 + 1 + 3 + 3 and flat["lr"] == 1e-3 \
        and "schedule" not in flat
    assert TrainConfig(**flat) == t
    with pytest.raises(TypeError, match="bogus"):
        TrainConfig(bogus=1)


@pytest.mark.parametrize("kw, section, message", [
    ({"lr": -1.0}, ScheduleConfig, "--lr=-1.0 must be a finite number >= 0"),
    ({"min_lr": 1.0, "lr": 0.5}, ScheduleConfig, "need 0 <= --min-lr=1.0 <= --lr=0.5"),
    ({"adam_beta1": 1.0}, OptimizerConfig, "--adam-beta1=1.0"),
    ({"global_batch_size": 6, "micro_batch_size": 4}, DataConfig, "--global-batch-size=6 is not a multiple"),
    ({"eval_interval": 5}, DataConfig, "--eval-interval=5 needs validation data"),
])
def test_each_value_is_checked_by_its_section(kw, section, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")) as via_train:
        TrainConfig(**kw)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        section(**kw)
    assert any(frame.name == "__post_init__" and section.__name__ in str(frame.locals.get("self", ""))[:40]
               for frame in via_train.traceback), "raised by another dataclass than the section that owns the value"


def test_flex_options_reach_the_dispatch_config_unchanged():
    from moefold.models.layer_factory import moe_config
    from moefold.parallel.dims import ParallelDims

    o = ModelOptions(dispatcher="flex", moe_deepep_num_sms=24, moe_deepep_mode="direct",
                     moe_flex_dispatcher_backend="deepep", moe_deepep_max_tokens_per_rank=64)
    assert o.flex == FlexOptions(backend="deepep", num_sms=24, hybrid=False, max_tokens_per_rank=64)
    assert (o.moe_deepep_num_sms, o.moe_deepep_mode, o.moe_deepep_max_tokens_per_rank) == (24, "direct", 64)
    assert (ModelOptions.moe_deepep_mode, ModelOptions().moe_deepep_max_tokens_per_rank) == ("hybrid", 0)
    assert dataclasses.replace(o, moe_deepep_mode="hybrid").flex.hybrid is True
    moe = moe_config(get_recipe("qwen3_moe_tiny"), o, ParallelDims.single())
    assert moe.dispatch.flex is o.flex
    with pytest.raises(ValueError, match=r"deepep_num_sms=5 .*--moe-deepep-num-sms"):
        ModelOptions(moe_deepep_num_sms=5)   # checked once, by FlexOptions, when the options are made
    with pytest.raises(ValueError, match=r"--moe-deepep-mode='both'; valid: hybrid, direct"):
        ModelOptions(moe_deepep_mode="both")


def _earlier_flat_form(config: RunConfig) -> dict:
    """What a moefold before the sections saved: every train value flat, the flex options as five flat fields."""
    return json.loads(config.to_json())


def test_a_run_config_saved_flat_or_nested_loads():
    config = RunConfig(model=get_recipe("deepseek_v3_tiny"),
                       options=ModelOptions(dispatcher="flex", moe_deepep_num_sms=8, moe_deepep_mode="direct"),
                       train=TrainConfig(lr=1e-3, data_path=("a", "b"), split="90,10,0", exit_signals=("SIGUSR1",)))
    saved = json.loads(config.to_json())
    assert saved["train"]["lr"] == 1e-3 and "schedule" not in saved["train"]   # flat, as training.checkpoint reads
    assert saved["options"]["moe_deepep_mode"] == "direct" and "flex" not in saved["options"]
    assert saved["model"]["mla"]["kv_lora_rank"] == config.model.mla.kv_lora_rank
    assert RunConfig.from_dict(saved) == config
    assert RunConfig.from_dict(_earlier_flat_form(config)) == config
    nested = {**saved, "train": json.loads(json.dumps(dataclasses.asdict(config.train))),
              "options": json.loads(json.dumps(dataclasses.asdict(config.options)))}
    assert "schedule" in nested["train"] and RunConfig.from_dict(nested) == config


def test_run_config_with_routes_flat_names_to_their_part():
    config = RunConfig(model=get_recipe("qwen3_moe_tiny"))
    changed = config.with_(lr=1e-3, seq_length=64, tp=2, moe_topk=4, moe_deepep_num_sms=8, dispatcher="alltoall")
    assert (changed.train.lr, changed.train.seq_length, changed.parallel.tp, changed.model.moe_topk) == (1e-3, 64, 2, 4)
    assert changed.options.flex.num_sms == 8 and changed.options.dispatcher == "alltoall"
    assert changed.train.min_lr == config.train.min_lr and changed.model.hidden_size == config.model.hidden_size
    assert config.with_(train=TrainConfig(seed=3), lr=1e-3).train == TrainConfig(seed=3, lr=1e-3)
    with pytest.raises(TypeError, match="'vocab_size' is a field of model and train"):
        config.with_(vocab_size=64)
    with pytest.raises(TypeError, match="'hidden_sise' is no field"):
        config.with_(hidden_sise=64)
    with pytest.raises(ValueError, match="--lr=-1"):
        config.with_(lr=-1)

"""The run-time flags (``training.cli.option_flags``) are ``ModelOptions``' and ``FlexOptions``' fields: each is on
``moefold train``'s parser with the field's default and choices, lands in its field, and ``auto`` for the
dispatcher reaches the dispatcher's builder unchanged."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json

from moefold.dispatch.config import DispatchConfig, DispatcherKind, FlexOptions
from moefold.dispatch.factory import build_dispatcher
from moefold.dispatch.local import LocalDispatcher
from moefold.models.layer_factory import moe_config
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelDims
from moefold.training.cli.option_flags import OPTION_FLAGS, options_from_args
from moefold.training.cli.train import add_arguments, config_from_args
from moefold.training.config import RunConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def test_every_option_field_is_a_flag_with_the_fields_default_and_choices():
    actions = {a.dest: a for a in _parser()._actions}
    paths = {o.path for o in OPTION_FLAGS}
    assert {"dispatcher", "gemm_backend", "recompute", "cp_comm", "flex.num_sms", "flex.hybrid"} <= paths
    for o in OPTION_FLAGS:
        action = actions[o.dest]
        assert o.flag in action.option_strings
        default = o.field.metadata.get("from_field", lambda v: v)(o.default)
        default = default.value if isinstance(default, enum.Enum) else default
        assert action.default == (list(default) if isinstance(default, tuple) else default), o.flag
        assert tuple(action.choices or ()) == tuple(o.field.metadata.get("choices", ())), o.flag


def test_the_flags_land_in_their_fields():
    defaults = config_from_args(_parser().parse_args(["--recipe", "qwen3_moe_tiny"])).options
    assert defaults == ModelOptions()
    flags = ["--recipe", "qwen3_moe_tiny", "--moe-token-dispatcher-type", "allgather", "--moe-deepep-num-sms", "24",
             "--moe-deepep-mode", "direct", "--recompute-granularity", "selective", "--recompute-modules", "mlp",
             "moe_act", "--cp-comm-type", "all_gather", "--moe-grouped-gemm-backend", "loop", "--no-sequence-parallel"]
    o = options_from_args(_parser().parse_args(flags))
    assert o == ModelOptions(dispatcher="allgather", flex=FlexOptions(num_sms=24, hybrid=False), recompute="selective",
                             recompute_modules=("mlp", "moe_act"), cp_comm="all_gather", gemm_backend="loop",
                             sequence_parallel=False)
    assert o.dispatcher is DispatcherKind.ALLGATHER and o.flex.num_sms == 24


def test_auto_reaches_the_dispatchers_builder_unchanged():
    o = ModelOptions()
    assert o.dispatcher is None and ModelOptions(dispatcher="auto") == o   # a saved run's / YAML's "auto"
    assert json.loads(json.dumps(dataclasses.asdict(o)))["dispatch"]["kind"] is None   # the nested form
    saved = RunConfig(model=get_recipe("qwen3_moe_tiny")).to_dict()["options"]
    assert saved["dispatcher"] == "auto" and "dispatch" not in saved   # the flat form, which base 16fae2e reads
    moe = moe_config(get_recipe("qwen3_moe_tiny"), o, ParallelDims.single())
    assert moe.dispatch.kind is None and moe.dispatch.flex is o.flex
    assert isinstance(build_dispatcher(moe.dispatch, 4), LocalDispatcher)   # ep = etp = 1: nothing travels
    assert DispatchConfig(None).kind_for(2, 1) is DispatcherKind.ALLTOALL == o.resolved_dispatcher(2, 1)
    assert o.resolved_dispatcher(1, 1) is DispatcherKind.LOCAL


def test_the_dispatcher_flags_reach_the_layer_in_one_dispatch_config():
    """flag -> ``ModelOptions.dispatch`` (a ``DispatchConfig``) -> the layer's, the same object (issue 44)."""
    o = options_from_args(_parser().parse_args(["--moe-token-dispatcher-type", "flex", "--moe-deepep-num-sms", "8"]))
    assert o.dispatch == DispatchConfig(DispatcherKind.FLEX, FlexOptions(num_sms=8))
    assert moe_config(get_recipe("qwen3_moe_tiny"), o, ParallelDims.single()).dispatch is o.dispatch
    # the earlier flat names and the nested form (a YAML file's) give the same options; a part left out keeps auto
    assert ModelOptions(dispatcher="flex", moe_deepep_num_sms=8) == o
    assert ModelOptions(dispatch={"flex": {"num_sms": 8}}).dispatch == DispatchConfig(None, FlexOptions(num_sms=8))
    chunked = RunConfig(model=get_recipe("qwen3_moe_tiny"), options=ModelOptions(dispatch=DispatchConfig(
        None, max_chunked_experts=2)))
    assert RunConfig.from_dict(json.loads(chunked.to_json())) == chunked
    fp8 = ModelOptions(fp8={"dispatch": True})
    assert not fp8.dispatch.fp8 and moe_config(get_recipe("qwen3_moe_tiny"), fp8, ParallelDims.single()).dispatch.fp8

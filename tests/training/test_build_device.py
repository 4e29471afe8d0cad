"""``build_model`` and ``build_optimizer`` honour the device they are given (issue 42): on the meta device, with no
``torch.device`` context (the default device stays the CPU), every parameter and buffer of the model and every
tensor the optimizer holds (flat parameter and gradient buffers, fp32 masters, both moments, the norm weights; with
optimizer offload its host part, which a meta model keeps on meta) is on meta, naming the first that is not.

Layouts beyond one rank (tensor, expert and pipeline parallel, the flex dispatcher on the DeepEP V2 stand-in) are
built as one rank of a fake process group (``planner.grid``, what ``moefold plan`` does): the groups have the
right sizes, nothing is communicated. The modules one by one, with forwards on meta: tests/models/test_device_build.py.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch import Tensor

from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.planner.grid import planning_world, rank_dims
from moefold.training.build import build_model, build_optimizer
from moefold.training.config import RunConfig
from tests.dispatch import deepep_elastic_standin
from tests.models.test_device_build import off_device
from tests.training.trainer_common import tiny_config

META = torch.device("meta")
WORLD = 8
# ParallelConfig, the rank of the fake world built, options
LAYOUTS = {
    "tp2-ep2-alltoall": (ParallelConfig(tp=2, ep=2), 1, {}),
    "ep2-allgather": (ParallelConfig(ep=2), 1, {"dispatcher": "allgather"}),
    "ep2-flex": (ParallelConfig(ep=2), 1, {"dispatcher": "flex", "moe_flex_dispatcher_backend": "deepep",
                                           "moe_deepep_max_tokens_per_rank": 32}),
    "pp2-first": (ParallelConfig(pp=2), 0, {}),
    "pp2-last": (ParallelConfig(pp=2), WORLD - 1, {}),
}


def _held_tensors(obj: object, seen: set[int] | None = None, depth: int = 0) -> list[tuple[str, Tensor]]:
    """(path, tensor) of every tensor reachable from ``obj`` through attributes, lists, tuples and dicts (modules
    and the optimizer's parts; not into torch's own classes other than ``torch.optim.Optimizer.state``)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 8:
        return []
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        return [("", obj)]
    if isinstance(obj, torch.optim.Optimizer):
        items = [("state", dict(obj.state))]
    elif isinstance(obj, dict):
        items = [(f"[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(obj)]
    elif type(obj).__module__.startswith("moefold.") and not isinstance(obj, torch.nn.Module):
        fields = getattr(obj, "__dict__", {}) or {s: getattr(obj, s, None) for s in getattr(obj, "__slots__", ())}
        items = [(f".{k}", v) for k, v in fields.items()]
    else:
        return []
    return [(f"{name}{sub}", t) for name, value in items for sub, t in _held_tensors(value, seen, depth + 1)]


def _config(parallel: ParallelConfig, options: dict, **train) -> RunConfig:
    config = tiny_config(parallel, **train)
    return dataclasses.replace(config, options=ModelOptions(dtype="bf16", **options))


def _check(config: RunConfig, dims: ParallelDims) -> None:
    assert torch.empty(0).device.type == "cpu", "a torch.device context is active"
    model = build_model(config, dims, "meta")
    bad = off_device(model, META)
    assert not bad, f"build_model(device='meta'): {len(bad)} tensors elsewhere, first {bad[0]}"
    if not config.train.use_torch_fsdp2:
        _, sync, optimizer = build_optimizer(model, config, dims)
        held = _held_tensors(sync) + _held_tensors(optimizer)
        assert any(name.endswith(".exp_avg") for name, _ in held), "the walk found no optimizer state"
        bad = [f"{name} ({t.device})" for name, t in held if t.device != META]
        assert not bad, f"build_optimizer on a meta model: {len(bad)} tensors elsewhere, first {bad[0]}"
    assert torch.empty(0).device.type == "cpu"


@pytest.mark.parametrize("offload", [None, 0.5], ids=["optimizer", "optimizer-offload"])
def test_model_and_optimizer_on_meta_world1(offload):
    train = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": offload} if offload else {}
    _check(_config(ParallelConfig(), {}, **train), ParallelDims.single())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_model_and_optimizer_on_meta_parallel(layout, monkeypatch):
    parallel, rank, options = LAYOUTS[layout]
    if options.get("dispatcher") == "flex":
        monkeypatch.setitem(sys.modules, "deep_ep", deepep_elastic_standin.module())
    config = _config(parallel, options)
    with planning_world(WORLD, rank):
        _check(config, rank_dims(parallel.resolve(WORLD), rank))

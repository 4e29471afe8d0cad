"""Per-layer router metrics (aux / z losses, entropy) from real training steps, validation records, and the
optional Weights & Biases output (a stand-in module: wandb is an optional dependency and needs no network here)."""

from __future__ import annotations

import math
import sys
import types

import pytest

from moefold.training.observe.metrics import METRICS_FILE, MetricsLogger, read_metrics
from tests.training.trainer_common import run, tiny_config


def test_per_layer_router_metrics_add_up_to_the_aux_loss(tmp_path):
    config = tiny_config(steps=2, model={"moe_z_loss_coeff": 1e-2, "moe_aux_loss_coeff": 1e-2, "mtp_num_layers": 1})
    run(config, run_dir=str(tmp_path))
    records = read_metrics(tmp_path / METRICS_FILE)
    assert len(records) == 2
    for rec in records:
        moe, router = rec["moe"], rec["moe"]["router"]
        assert moe["layers"] == [1, 2]   # layer 0 is dense; 2 is the MTP depth's MoE layer
        assert sorted(router) == ["entropy", "seq_aux_loss", "z_loss"]
        # the per-layer losses, weighted by their coefficients, are the logged aux loss
        weighted = sum(1e-2 * (a + z) for a, z in zip(router["seq_aux_loss"], router["z_loss"]))
        assert weighted == pytest.approx(rec["loss_aux"], rel=1e-5)
        assert all(0 < e < math.log(8) for e in router["entropy"])


class _FakeRun:
    def __init__(self, **kwargs):
        self.init, self.logged, self.finished = kwargs, [], False

    def log(self, data, step):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished = True


def test_wandb_gets_every_scalar(tmp_path, monkeypatch):
    fake = types.ModuleType("wandb")
    runs = []
    fake.init = lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with MetricsLogger(tmp_path, progress=False, tensorboard=False, print_fn=lambda _s: None, config={"a": 1},
                       wandb={"project": "moe", "name": "exp1"}) as logger:
        logger.log(1, loss_lm=2.0, tokens_per_expert=[[1, 3], [2, 2]], dropped_fraction=[0.0, 0.1],
                   moe_layers=[0, 1], router={"aux_loss": [1.5, 1.0], "entropy": [0.5, 0.6]})
        logger.log_validation(1, loss_lm=2.5, ppl=math.exp(2.5), tokens=64)
    (r,) = runs
    assert r.init == {"project": "moe", "name": "exp1", "dir": str(tmp_path), "config": {"a": 1}} and r.finished
    (step1, scalars), (step2, valid) = r.logged
    assert step1 == step2 == 1 and scalars["loss/loss_lm"] == 2.0
    assert (scalars["moe_aux_loss/layer00"], scalars["moe_entropy/layer01"], scalars["moe_max_over_mean/layer00"]) \
        == (1.5, 0.6, 1.5)
    assert valid == {"valid/loss_lm": 2.5, "valid/ppl": pytest.approx(math.exp(2.5))}
    assert [r["kind"] for r in read_metrics(tmp_path / METRICS_FILE, kind="valid")] == ["valid"]
    # not installed: the message says what to install
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path, progress=False, tensorboard=False, wandb={"project": "moe"})
    with pytest.raises(ValueError, match="one entry per MoE layer"):
        MetricsLogger._moe([[1, 2]], [0.0], [0], {"entropy": [0.1, 0.2]})

"""The moe package exports its public names, and importing it never breaks ``import dispatch``
(dispatch imports dispatch.routing while moe.layer imports dispatch)."""

import subprocess
import sys
from pathlib import Path

import torch

from moefold import moe
from moefold.moe.router import Router
from moefold.moe.router_config import RouterConfig

ROOT = Path(__file__).resolve().parents[2]


def test_public_names_resolve():
    for name in moe.__all__:
        assert getattr(moe, name) is not None, name
    assert moe.Router is Router


def test_fresh_process_import_orders():
    code = ("import dispatch, moe, models\n"
            "from moe import MoELayer, MoEOutputInfo, Router, Routing\n"
            "assert MoELayer.__module__ == 'moefold.moe.layer' and Routing.__module__ == 'moefold.dispatch.routing'\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_router_constructor_weight_is_deterministic_and_meta_safe():
    cfg = RouterConfig(num_experts=4, topk=2)
    torch.manual_seed(1)
    a = Router(cfg, 8).weight
    torch.manual_seed(2)
    b = Router(cfg, 8).weight
    assert torch.equal(a, b)  # replicated weight: the same on every rank before init_parameters
    assert a.std() > 0.5 * cfg.init_std
    with torch.device("meta"):
        m = Router(RouterConfig(num_experts=4, topk=2, enable_expert_bias=True), 8)
    assert m.weight.is_meta and m.expert_bias.is_meta

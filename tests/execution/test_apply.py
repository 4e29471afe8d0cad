"""The execution pass (``execution.apply``): what it installs, in which order, and that it installs it only through
the layers' own ``configure`` (``dense.regions``).

- ``configure`` refuses an unknown region name and a region of the wrong kind, with one line naming both;
- one pass over a model with selective recompute, offloading, FP8 and split backward leaves each layer with the
  regions and GEMMs the plan asks for (the norms' outputs discarded, the offloaded parts in one offloader's
  regions, FP8 GEMMs that split backward then gave the store); full recompute is the decoder's layer run (the
  values under each choice: ``test_recompute``, ``test_activation_offload``);
- no module attribute of a feature is assigned outside the layer that owns it (a source scan of every package but
  ``moe``, whose modules set their own: ``obj.regions = ...``, ``obj.local_gemm = ...``, the routed experts'
  strategies ``obj.gemm``/``obj.weight_grads``/``obj.activation_kernel``, ``obj.recompute_*``, ``obj.offload_*``,
  ``obj.use_*``, ``obj.fuse_*`` with ``obj`` not ``self`` (nor an autograd ``ctx``), or a ``setattr`` of those
  names); the scan finds each way the MoE modules' switches were set from outside ``moe/`` before they took
  ``configure``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from moefold.dense.attention import GQAAttention
from moefold.dense.attention_config import AttentionConfig
from moefold.dense.block import TransformerBlock
from moefold.dense.regions import CHECKPOINT, PLAIN
from moefold.execution import ExecutionPlan, apply_execution, build_decoder
from moefold.execution.fp8_linear import Float8LinearGemm
from moefold.execution.offloader import OffloadRegion
from moefold.execution.recompute import DISCARD_OUTPUT, FullRecompute
from moefold.models.decoder import ALL_LAYERS
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.precision.fp8 import FP8Config

ROOT = Path(__file__).resolve().parents[2]
FEATURE_ATTRS = ("regions", "local_gemm", "checkpoint_block", "gemm", "weight_grads", "activation_kernel")
FEATURE_PREFIXES = ("recompute_", "offload_", "use_", "fuse_")
# every package that holds no layer with feature attributes of its own: ``moe`` sets its modules' (through
# ``self`` and its own ``configure``); the dense layers are scanned too, where only ``self`` may set them
OWNERS = ("self", "ctx")   # the module itself; an autograd function's context (what its backward reads)
SCANNED = ("parallel", "precision", "dense", "dispatch", "models", "execution", "pipeline", "training", "planner",
           "tools")


def _attention() -> GQAAttention:
    return GQAAttention(AttentionConfig(hidden_size=32, num_heads=4, num_query_groups=2), None)


def test_configure_refuses_an_unknown_name_and_a_wrong_kind() -> None:
    attention = _attention()
    with pytest.raises(ValueError, match=r"GQAAttention.configure: 'up_proj' is not one of its regions "
                                         r"\(qkv_linear, core_attn, attn_proj\)"):
        attention.configure(up_proj=DISCARD_OUTPUT)
    with pytest.raises(ValueError, match=r"GQAAttention.configure: core_attn=DISCARD_OUTPUT is not a Region"):
        attention.configure(core_attn=DISCARD_OUTPUT)
    block = TransformerBlock(32, attention, torch.nn.Identity())
    with pytest.raises(ValueError, match=r"TransformerBlock.configure: attn_norm=CHECKPOINT is not a OutputRegion"):
        block.configure(attn_norm=CHECKPOINT)
    with pytest.raises(ValueError, match="is not callable"):
        attention.q_proj.configure(gemm=None)


def test_one_pass_installs_each_feature_in_order() -> None:
    config = get_recipe("qwen3_moe_tiny").with_(num_layers=2, vocab_size=256)
    options = ModelOptions(recompute="selective", recompute_modules=("layernorm",),
                           offload_modules=("attn_proj", "core_attn"), min_offloaded_tensor_size=0,
                           fp8=FP8Config("e4m3", "tensorwise"))
    model = build_decoder(config, options=ModelOptions())   # FP8 off: the plain model
    assert model.regions.layers is ALL_LAYERS and model.offloader is None
    done = apply_execution(model, ExecutionPlan(options, split_backward=True))
    block = model.layers["0"]
    attention = block.self_attn
    core = attention.regions.core_attn
    assert isinstance(core, OffloadRegion) and core.inner is PLAIN, core
    assert attention.regions.qkv_linear is PLAIN and isinstance(attention.regions.attn_proj, OffloadRegion)
    assert block.regions.attn_norm is DISCARD_OUTPUT and block.regions.mlp_norm is DISCARD_OUTPUT
    assert model.offloader is done.offloader is not None
    gemm = attention.q_proj.local_gemm
    assert isinstance(gemm, Float8LinearGemm) and gemm.store is done.weight_store   # FP8, then split backward
    assert done.fp8_linears and "output_head.proj" not in done.fp8_linears

    full = build_decoder(config, options=ModelOptions(recompute="full", recompute_num_layers=2))
    assert isinstance(full.regions.layers, FullRecompute)
    assert full.regions.layers.groups([0, 1]) == [([0, 1], True)]
    assert all(block.regions.body is PLAIN for block in full.layers.values())   # the decoder groups them


def _feature_assignments(path: Path) -> list[str]:
    """``obj.<feature attr> = ...`` (obj not ``self``) and ``setattr(obj, "<feature attr>" | name, ...)`` in a file."""
    tree = ast.parse(path.read_text())
    found = []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name

    def feature(name: str) -> bool:
        return name in FEATURE_ATTRS or name.startswith(FEATURE_PREFIXES)

    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for sub in ast.walk(t):
                if (isinstance(sub, ast.Attribute) and feature(sub.attr)
                        and not (isinstance(sub.value, ast.Name) and sub.value.id in OWNERS)):
                    found.append(f"{where}:{node.lineno} {ast.unparse(sub)}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and feature(name.value):
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_feature_attribute_is_set_from_outside() -> None:
    found = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += _feature_assignments(path)
    assert not found, "feature attributes set from outside their layer:\n" + "\n".join(found)


# what the MoE modules' switches looked like before they took ``configure`` (and what a regression would bring back)
_MOE_SWITCHES = """
layer.recompute_shared_experts = True
layer.offload_shared_experts = region
layer.experts.recompute_activation = True
experts.offload_expert_fc1 = experts.offload_moe_act = region
experts.gemm = experts.gemm.with_weight_grad_store(store)
moe.experts.weight_grads = WeightGrads.MAIN_GRAD
moe.experts.activation_kernel = COMPILED_ACTIVATION
experts.fuse_wgrad = True
experts.use_fused_activation = True
setattr(experts, "offload_moe_act", region)
layer.regions = MoERegions(shared_experts=CHECKPOINT)
"""


def test_the_scan_finds_an_moe_switch_set_from_outside(tmp_path) -> None:
    path = tmp_path / "outside_moe.py"
    path.write_text(_MOE_SWITCHES)
    found = _feature_assignments(path)
    lines = sorted(int(f.split(":")[1].split()[0]) for f in found)
    assert lines == [2, 3, 4, 5, 5, *range(6, 13)], found   # every line, line 5 twice

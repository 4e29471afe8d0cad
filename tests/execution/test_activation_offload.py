"""Fine-grained activation offloading (``dense.activation_offload``, ``--offload-modules``) in the decoder.

- Every module kind, alone and all together, on DeepSeek-V3 tiny (MLA, shared experts, MTP) and Qwen3-MoE tiny
  (GQA with qk-norm): the loss and every parameter's gradient are bit-identical to no offloading, and the module's
  region really copied its tensors out (the offloader's per-module byte counts).
- Combined with selective recompute of other modules (Megatron's recommended split: recompute the norms and the
  experts' activation, offload core attention, its projection and the experts' first GEMM): equal too.
- The backward prefetch is one layer ahead: when a layer's first offloaded tensor is asked for, the groups that
  are back are that layer's and the one before it, never earlier layers'.
- No host synchronisation is added (``HostSyncCounter``: the same count with and without offloading).
- Refused with one line: a module both recomputed and offloaded, full recompute, attn_proj without core_attn,
  an unknown module.

The resident-memory drop against the planner is ``tests/planner/test_offload_memory.py``; pipeline
schedules with several micro-batches in flight are ``tests/training/test_memory_features.py``.
"""

from __future__ import annotations

import pytest
import torch

from moefold.dense.activation_offload import OFFLOAD_MODULES
from moefold.execution import build_decoder
from moefold.execution.offloader import ActivationOffloader
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.training.observe.host_sync import HostSyncCounter

SETTINGS = {m: (m,) for m in OFFLOAD_MODULES if m != "attn_proj"}
SETTINGS["core_attn+attn_proj"] = ("core_attn", "attn_proj")
SETTINGS["all"] = OFFLOAD_MODULES
RECIPES = ("deepseek_v3_tiny", "qwen3_moe_tiny")


def _run(recipe: str, options: ModelOptions, layers: int = 2, seed: int = 0):
    config = get_recipe(recipe).with_(num_layers=layers, vocab_size=256)
    model = build_decoder(config, options=options)
    model.init_weights(3)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(seed))
    out = model(ids[:, :-1], ids[:, 1:])
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, model


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple]:
    return {r: _run(r, ModelOptions())[:2] for r in RECIPES}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_module_leaves_values_and_gradients_unchanged(recipe: str, setting: str, reference) -> None:
    modules = SETTINGS[setting]
    loss, grads, model = _run(recipe, ModelOptions(offload_modules=modules, min_offloaded_tensor_size=0))
    ref_loss, ref_grads = reference[recipe]
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name
    stats = model.offloader.stats
    present = [m for m in modules if not (m == "shared_experts" and recipe == "qwen3_moe_tiny")]
    assert all(stats.get(m, 0) > 0 for m in present), stats   # each region really copied its tensors out
    if recipe == "qwen3_moe_tiny":
        assert "shared_experts" not in stats   # Qwen3-MoE has no shared experts


def test_combines_with_selective_recompute(reference) -> None:
    options = ModelOptions(recompute="selective", recompute_modules=("layernorm", "moe_act"),
                           offload_modules=("core_attn", "attn_proj", "expert_fc1"), min_offloaded_tensor_size=0)
    loss, grads, model = _run("deepseek_v3_tiny", options)
    ref_loss, ref_grads = reference["deepseek_v3_tiny"]
    assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert set(model.offloader.stats) == {"core_attn", "attn_proj", "expert_fc1"}


def test_prefetch_is_one_layer_ahead(monkeypatch) -> None:
    events: list[tuple[str, int]] = []
    reload, unpack = ActivationOffloader._reload, ActivationOffloader._unpack

    def record_reload(self, group):
        events.append(("reload", group.layer))
        return reload(self, group)

    def record_unpack(self, handle):
        if not isinstance(handle, torch.Tensor) and handle.tensor is None:
            events.append(("use", handle.group.layer))
        return unpack(self, handle)

    monkeypatch.setattr(ActivationOffloader, "_reload", record_reload)
    monkeypatch.setattr(ActivationOffloader, "_unpack", record_unpack)
    _run("qwen3_moe_tiny", ModelOptions(offload_modules=("expert_fc1",), min_offloaded_tensor_size=0), layers=4)
    reloaded_when_used = {}
    back: set[int] = set()
    for kind, layer in events:
        if kind == "reload":
            back.add(layer)
        elif layer not in reloaded_when_used:
            reloaded_when_used[layer] = set(back)
    assert sorted(reloaded_when_used) == [0, 1, 2, 3]
    for layer, present in reloaded_when_used.items():
        assert layer in present, f"layer {layer} used before its copy came back"
        assert min(present) >= layer - 1, f"at layer {layer}'s backward layers {sorted(present)} are back"
    # the chunk's output gradient brought the last two layers back before their backward
    assert reloaded_when_used[3] >= {2, 3}


def test_no_host_synchronisation_added() -> None:
    counts = []
    for modules in ((), OFFLOAD_MODULES):
        with HostSyncCounter() as syncs:
            _run("qwen3_moe_tiny", ModelOptions(offload_modules=modules, min_offloaded_tensor_size=0))
        counts.append(syncs.total)
    assert counts[0] == counts[1]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"recompute": "selective", "recompute_modules": ("core_attn",), "offload_modules": ("core_attn",)},
     "--offload-modules core_attn and --recompute-modules core_attn"),
    ({"recompute": "selective", "recompute_modules": ("layernorm",), "offload_modules": ("mlp_norm",)},
     "--offload-modules mlp_norm and --recompute-modules layernorm"),
    ({"recompute": "selective", "recompute_modules": ("moe",), "offload_modules": ("expert_fc1",)},
     "--offload-modules expert_fc1 and --recompute-modules moe"),
    ({"recompute": "full", "offload_modules": ("moe_act",)}, "with --recompute-granularity full"),
    ({"offload_modules": ("attn_proj",)}, "attn_proj needs core_attn"),
    ({"offload_modules": ("mlp",)}, "'mlp' not among"),
])
def test_refused_with_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        ModelOptions(**kwargs)
    assert "\n" not in str(info.value)

"""QK-clip (MuonClip, ``--qk-clip``): the recorded logit maxima equal a brute-force float64 computation; after the clip
the first layer's kv groups that passed the threshold have their largest logit at the threshold exactly, the others
unchanged; training with the clip at tp x pp equals world 1 (tests/training/optim/test_muon_training.py's world);
refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moefold.dense.attention import GQAAttention
from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.config import TrainConfig
from moefold.training.optim.grad_sync import GradSync
from moefold.training.optim.muon import DistributedMuon, is_muon_matrix
from moefold.training.optim.qk_clip import clip_qk
from tests.training.trainer_common import RECIPE, tiny_config


@torch.no_grad()
def _brute_force(a: GQAAttention, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[h] float64: max over batch, query i and key j <= i inside the window of scale * q_i . k_j."""
    q, _, k, _ = a._project_in(x, pos)
    q, k = q.double(), k.double().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * a.core.scale
    ahead = pos[:, None] - pos[None, :]
    visible = (ahead >= 0) & (ahead < (a.config.sliding_window or 10 ** 9))
    return scores.masked_fill(~visible, float("-inf")).amax(dim=(0, 2, 3))


def test_recorded_maxima_and_the_clip_bound_the_first_layers_logits():
    dims = ParallelDims.single()
    options = ModelOptions(max_attention_logit=True)
    model = MoEDecoder(get_recipe("mixtral_tiny").with_(num_layers=2, vocab_size=256), dims, options=options)
    model.init_weights(0)
    model.train()
    sync = GradSync(model.named_parameters(), dims, whole=is_muon_matrix)
    opt = DistributedMuon(sync, dims)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    seen = {}
    first = next(m for m in model.modules() if isinstance(m, GQAAttention))
    first.register_forward_pre_hook(lambda _m, args: seen.setdefault("in", args))
    model(tokens, tokens)
    layers = [m for m in model.modules() if isinstance(m, GQAAttention)]
    assert len(layers) == 2 and all(a.max_logits is not None for a in layers)
    x, pos = seen["in"]
    before = _brute_force(first, x, pos)
    assert torch.allclose(first.max_logits.double(), before, rtol=1e-5), (first.max_logits, before)
    # a threshold between the two kv groups' maxima: one group is clipped, the other is not
    groups = before.view(2, -1).amax(dim=1)
    threshold = float(groups.mean())
    clipped = groups > threshold
    assert clipped.any() and not clipped.all(), groups
    recorded = max(float(a.max_logits.max()) for a in layers)
    assert float(clip_qk(model, dims, opt, threshold, 0.5)) == recorded
    assert all(a.max_logits is None for a in layers)
    after = _brute_force(first, x, pos).view(2, -1).amax(dim=1)
    for g in range(2):
        want = threshold if clipped[g] else float(groups[g])
        assert float(after[g]) == pytest.approx(want, rel=1e-5), (g, float(after[g]), want)


def test_refusals():
    with pytest.raises(ValueError, match=r"--qk-clip .* needs --optimizer muon"):
        TrainConfig(qk_clip=True)
    with pytest.raises(ValueError, match="--qk-clip-threshold"):
        TrainConfig(optimizer_type="muon", qk_clip=True, qk_clip_threshold=0.0)
    clip = {"optimizer_type": "muon", "qk_clip": True}
    for pc, recipe, match in ((ParallelConfig(cp=2), "mixtral_tiny", "context parallelism"),
                              (ParallelConfig(), "qwen3_moe_tiny", "qk-norm"), (ParallelConfig(), RECIPE, "MLA")):
        with pytest.raises(ValueError, match=match):   # before any rank starts
            tiny_config(pc, recipe=recipe, **clip).resolve(2)
    options = dataclasses.replace(ModelOptions(), max_attention_logit=True)
    with pytest.raises(ValueError, match="qk_norm"):
        MoEDecoder(get_recipe("qwen3_moe_tiny").with_(num_layers=1), ParallelDims.single(), options=options)
    with pytest.raises(ValueError, match="not MLA"):
        MoEDecoder(get_recipe("deepseek_v3_tiny").with_(num_layers=1), ParallelDims.single(), options=options)
